"""The cluster config `tandem serve` runs: the config file's, with the flags given over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def cluster_config_from(
    config_file: Path | None,
    overrides: dict[str, Any],
    role_overrides: dict[str, int | None],
    nested: dict[tuple[str, str], Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Any:
    """The cluster config: `defaults` (from the environment) where the file is silent, the
    file's, then the flags that were given (`overrides` at the top level, replicas per role,
    `nested` as (section, field): value; an engine flag also over a role's own setting)."""
    from tandem.deploy.cluster_config import ClusterConfig, read_config_file

    data: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if v is not None}
    data.update(read_config_file(config_file) if config_file is not None else {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    for role, replicas in role_overrides.items():
        if replicas is not None:
            data[role] = {**(data.get(role) or {}), "replicas": replicas}
    for (section, field), value in (nested or {}).items():
        if value is not None:
            data[section] = {**(data.get(section) or {}), field: value}
            if section == "engine":  # (the flag sets it for both roles: theirs give way)
                for role in ("prefill", "decode"):
                    _drop_role_engine_field(data, role, field)
    return ClusterConfig.model_validate(data)


def _drop_role_engine_field(data: dict[str, Any], role: str, field: str) -> None:
    role_data = data.get(role)
    engine = role_data.get("engine") if isinstance(role_data, dict) else None
    if isinstance(role_data, dict) and isinstance(engine, dict) and field in engine:
        data[role] = {**role_data, "engine": {k: v for k, v in engine.items() if k != field}}
