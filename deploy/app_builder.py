"""`build_app(config)`: the Ray Serve application (router -> prefill / decode actor groups).

`app_builder(args)` is the same for Serve config files (`import_path:
tandem.deploy.app_builder:app_builder`, `args:` = cluster config fields).
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

from ray.serve import Application

from tandem.deploy.cluster_config import ClusterConfig, RoleConfig
from tandem.deploy.embedded_model import ensure_embedded_model
from tandem.engine.hub_cache import cached_snapshot
from tandem.engine.model_config import load_model_spec
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.weights import check_weights

logger = logging.getLogger("tandem.deploy")

SHUTDOWN_MARGIN_S = 10.0  # Serve's wait loop and the replica's own close, after the drain


def chat_template_text(value: str | None) -> str | None:
    """A chat template given as a file's path or as its text: the text, checked to be Jinja
    (ValueError naming the problem otherwise). Read here, where the config is, so that a
    router on another node gets the text."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "\n" not in value and len(value) < 4096 and path.is_file():
        try:
            value = path.read_text()
        except UnicodeDecodeError:
            raise ValueError(f"chat_template {str(path)!r} is not UTF-8 text") from None
    elif "\n" not in value and len(value) < 4096 and path.is_dir():
        raise ValueError(f"chat_template {value!r} is a directory: give the template's file")
    elif not any(c in value for c in "{}\n"):  # (as vLLM: path-like, yet no such file)
        raise ValueError(f"chat_template {value!r} looks like a path, but there is no such file")
    import jinja2

    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template is not a Jinja template: {exc}") from None
    return value


def resolve_model(config: ClusterConfig) -> str:
    """The checkpoint to serve: `config.model`, or the embedded tiny model (built once)."""
    if config.model:
        path = Path(cached_snapshot(config.model)).expanduser()
        if path.is_file():
            raise ValueError(f"{path} is a file: --model takes a checkpoint's directory")
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} is not a Hugging Face checkpoint directory (no config.json; tandem "
                "loads local checkpoints and models the Hugging Face cache holds; nothing is "
                "downloaded)"
            )
        # What every worker would refuse at start-up, refused here in one line (an unsupported
        # architecture or rope, missing or unreadable weight files, tensors that do not fit the
        # config, no tokenizer) rather than after Ray and Serve started.
        check_weights(load_model_spec(path), path)
        if not config.tokenizer:  # (loaded, not only found: a broken file says so here)
            Tokenizer.from_pretrained(path)
        return str(path.resolve())
    return str(ensure_embedded_model(Path(config.cache_dir).expanduser()))


def resolve_tokenizer(config: ClusterConfig) -> str | None:
    """The directory of `config.tokenizer` (a repo id: the snapshot the Hugging Face cache
    holds), its tokenizer loaded once here; None when the checkpoint's own is used."""
    if not config.tokenizer:
        return None
    path = Path(cached_snapshot(config.tokenizer)).expanduser()
    Tokenizer.from_pretrained(path)
    return str(path.resolve())


KV_LAYOUT_SETTINGS = ("dtype", "block_size", "model_revision")
"""Engine settings the two roles must share: a prefill worker's pages land in a decode
worker's pool as they are (the decode side refuses other layouts or namespaces)."""


def check_roles_agree(config: ClusterConfig, model: str) -> None:
    """ValueError naming the setting where prefill's and decode's engine settings (the shared
    ones with each role's own over them) would move KV pages between different layouts."""
    prefill, decode = (config.engine_config(role, model) for role in ("prefill", "decode"))
    for name in KV_LAYOUT_SETTINGS:
        if getattr(prefill, name) != getattr(decode, name):
            raise ValueError(
                f"prefill and decode engines must agree on {name} (KV pages move between "
                f"them as they are): prefill {getattr(prefill, name)!r}, decode "
                f"{getattr(decode, name)!r}"
            )


def registry_name(config: ClusterConfig) -> str:
    return f"tandem-registry-{config.app_name}"


def _kept_token(registry: str) -> str | None:
    """The cluster token generated for the application's first deployment, kept by its worker
    registry (None without Ray): a redeploy with no `auth_token` reuses it. A fresh token would
    make the workers still running refuse the new router until they drained."""
    import ray

    from tandem.engine.worker_registry import get_registry

    if not ray.is_initialized():
        return None
    return str(ray.get(get_registry(registry).cluster_token.remote(secrets.token_hex(16))))


def worker_options(role_cfg: RoleConfig, role: str) -> dict[str, Any]:
    """Serve options of a worker deployment: fixed `replicas`, or autoscaling by role; Serve
    waits for the drain (`drain_timeout_s`) before it kills a stopping replica."""
    options: dict[str, Any] = {
        "ray_actor_options": role_cfg.ray_actor_options(),
        "graceful_shutdown_timeout_s": role_cfg.drain_timeout_s + SHUTDOWN_MARGIN_S,
    }
    scaling = getattr(role_cfg, "autoscaling", None)
    if scaling is None:
        options["num_replicas"] = role_cfg.replicas
    else:
        options["autoscaling_config"] = scaling.serve_autoscaling_config(role, role_cfg.replicas)
    return options


def build_app(config: ClusterConfig) -> Application:
    """Validates `config` (engine settings included) and binds the deployments: router, decode
    workers and, unless `config.mode` is "colocated", prefill workers."""
    from tandem.decode_workers.deployment import DecodeWorker
    from tandem.engine.generation_defaults import max_tokens_ceiling, sampling_defaults
    from tandem.prefill_workers.deployment import PrefillWorker
    from tandem.router.api_keys import key_digest
    from tandem.router.deployment import Router

    registry = registry_name(config)
    config = config.with_auth_token(_kept_token(registry) if not config.auth_token else None)
    model = resolve_model(config)
    config = config.model_copy(update={"tokenizer": resolve_tokenizer(config)})
    prefill = None
    if config.mode == "pd":
        check_roles_agree(config, model)
        prefill = PrefillWorker.options(  # type: ignore[attr-defined]
            **worker_options(config.prefill, "prefill")
        ).bind(config.worker_settings("prefill", model, registry).model_dump(mode="json"))
    decode = DecodeWorker.options(  # type: ignore[attr-defined]
        **worker_options(config.decode, "decode")
    ).bind(config.worker_settings("decode", model, registry).model_dump(mode="json"))
    source = str(config.engine.get("generation_config", "auto"))
    defaults = sampling_defaults(model, source)  # (the generation config, read and checked here)
    router_settings = {
        "model": model,
        "tokenizer": config.tokenizer,
        "mode": config.mode,
        "served_model_name": config.model_names(model),
        "registry_name": registry,
        "auth_token": config.auth_token,
        "api_key_sha256": [key_digest(k) for k in config.api_keys()] or None,
        "host": config.host,
        "grpc_port": config.grpc_port,
        "direct_port": config.direct_port,
        "request_timeout_s": config.router.request_timeout_s,
        "cors_allowed_origins": config.router.cors_allowed_origins,
        "responses_store_size": config.router.responses_store_size,
        "tool_call_parser": config.router.tool_call_parser,
        "reasoning_parser": config.router.reasoning_parser,
        "log_requests": config.router.log_requests,
        "chat_template": chat_template_text(config.chat_template),
        "sampling_defaults": defaults,
        "max_tokens_ceiling": max_tokens_ceiling(defaults, source),
        "log_level": config.log_level,
        "routing": config.routing.model_dump(mode="json"),
        "decode_routing": config.decode_routing.model_dump(mode="json"),
        "admission": config.admission.model_dump(mode="json"),
        "slo": config.slo.model_dump(mode="json"),
        "replica_targets": {
            role: getattr(config, role).replicas
            for role in (("decode",) if config.mode == "colocated" else ("prefill", "decode"))
        },
    }
    # A stopping router waits for its streams as long as the workers drain, and as long again:
    # a stream whose decode worker's drain ran out (a redeploy replaces the workers too) goes
    # on on another worker, through this router.
    drain_s = max(config.decode.drain_timeout_s, config.prefill.drain_timeout_s)
    router_settings["drain_timeout_s"] = drain_s
    router_settings["graceful_shutdown_s"] = 2 * drain_s + SHUTDOWN_MARGIN_S
    return Router.options(  # type: ignore[attr-defined]
        num_replicas=config.router.replicas,
        ray_actor_options=config.router.ray_actor_options(),
        graceful_shutdown_timeout_s=router_settings["graceful_shutdown_s"],
    ).bind(router_settings, prefill, decode)


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for Serve config files: `args` are `ClusterConfig` fields."""
    return build_app(ClusterConfig.model_validate(args or {}))
