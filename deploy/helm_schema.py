"""The parts of the Helm chart's values schema that come from tandem's own config models.

The chart forwards some values blocks as they are into the cluster config of `serveConfigV2`
(`serve.engine`, `serve.routing`, the roles' `engine` and `autoscaling`, ...). Their schemas in
`helm/tandem/values.schema.json` are generated here from the pydantic models that read them, so
that `helm install` refuses a typo or an out-of-range value at render time instead of the
cluster failing the deployment later. A unit test keeps the committed file in step:

    python -m tandem.deploy.helm_schema            # rewrites helm/tandem/values.schema.json
    python -m tandem.deploy.helm_schema --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tandem.deploy.autoscaling_config import DecodeAutoscaling, PrefillAutoscaling
from tandem.deploy.cluster_config import SLOConfig
from tandem.engine.config import DTYPE_ALIASES, EngineConfig
from tandem.router.admission import AdmissionConfig
from tandem.router.route_planner import DecodeRoutingConfig
from tandem.router.routing_policy import RoutingConfig

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "helm" / "tandem" / "values.schema.json"

ENGINE_SET_BY_CHART = ("model",)
"""EngineConfig fields the chart sets itself (the model's path)."""


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """`node` with every `$ref` to `defs` replaced by its target, and pydantic's titles and
    defaults dropped (Helm's draft-07 validator wants neither)."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    return {k: _inline(v, defs) for k, v in node.items() if k not in ("title", "default")}


def object_schema(
    model: type[BaseModel], description: str, *, leave_out: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A closed object schema of `model`'s fields (less `leave_out`), as values hold them."""
    full = model.model_json_schema()
    defs = full.get("$defs", {})
    properties = {
        name: _inline(field, defs)
        for name, field in full["properties"].items()
        if name not in leave_out
    }
    return {
        "type": "object",
        "description": description,
        "properties": properties,
        "additionalProperties": False,
    }


def engine_schema(description: str) -> dict[str, Any]:
    schema = object_schema(EngineConfig, description, leave_out=ENGINE_SET_BY_CHART)
    dtype = schema["properties"]["dtype"]  # vLLM's spellings are taken too
    dtype["enum"] = [*dtype["enum"], "auto", *DTYPE_ALIASES]
    return schema


def autoscaling_schema(model: type[BaseModel], required: list[str]) -> dict[str, Any]:
    schema = object_schema(
        model,
        "Serve autoscaling by role; every key but `enabled` is forwarded to the cluster "
        "config's `autoscaling` block.",
    )
    schema["properties"] = {"enabled": {"type": "boolean"}, **schema["properties"]}
    schema["required"] = required
    return schema


def generated_parts() -> dict[tuple[str, ...], dict[str, Any]]:
    """Path of property names in the values schema -> that property's generated schema."""
    forwarded = "Forwarded to the cluster config's `{}` (tandem.deploy.cluster_config)."
    required = ["enabled", "min_replicas", "max_replicas"]
    return {
        ("serve", "engine"): engine_schema(
            "Engine settings of every worker (EngineConfig, less `model`)."
        ),
        ("prefill", "engine"): engine_schema("Engine settings of prefill workers only."),
        ("decode", "engine"): engine_schema("Engine settings of decode workers only."),
        ("serve", "routing"): object_schema(RoutingConfig, forwarded.format("routing")),
        ("serve", "decodeRouting"): object_schema(
            DecodeRoutingConfig, forwarded.format("decode_routing")
        ),
        ("serve", "admission"): object_schema(AdmissionConfig, forwarded.format("admission")),
        ("serve", "slo"): object_schema(SLOConfig, forwarded.format("slo")),
        ("prefill", "autoscaling"): autoscaling_schema(PrefillAutoscaling, required),
        ("decode", "autoscaling"): autoscaling_schema(DecodeAutoscaling, required),
    }


def updated(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (the values schema) with its generated parts as the models say now."""
    out = json.loads(json.dumps(schema))
    for path, part in generated_parts().items():
        node = out
        for name in path[:-1]:
            node = node["properties"][name]
        node["properties"][path[-1]] = part
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--file", type=Path, default=SCHEMA_FILE)
    args = parser.parse_args(argv)
    current = args.file.read_text()
    fresh = render(updated(json.loads(current)))
    if args.check:
        if fresh != current:
            print(f"{args.file} is out of date: run python -m tandem.deploy.helm_schema")
            return 1
        return 0
    args.file.write_text(fresh)
    print(f"wrote {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
