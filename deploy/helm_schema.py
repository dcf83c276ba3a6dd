"""The parts of the Helm chart's values schema that come from tandem's own config models.

The chart forwards some values blocks as they are into the cluster config of `serveConfigV2`
(`serve.engine`, `serve.routing`, the roles' `engine` and `autoscaling`, ...), and some single
fields only when they are set (`serve.corsAllowedOrigins`, `serve.checksums`, ...). Their schemas
in `helm/tandem/values.schema.json` are generated here from the pydantic models that read them, so
that `helm install` refuses a typo or an out-of-range value at render time instead of the
cluster failing the deployment later. A unit test keeps the committed file in step:

    python -m tandem.deploy.helm_schema            # rewrites helm/tandem/values.schema.json
    python -m tandem.deploy.helm_schema --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter

from tandem.deploy.autoscaling_config import DecodeAutoscaling, PrefillAutoscaling
from tandem.deploy.cluster_config import SET_BY_CLUSTER, ClusterConfig, RouterConfig, SLOConfig
from tandem.engine.config import DTYPE_ALIASES, EngineConfig
from tandem.kv_transfer.registry import option_names, transport_class
from tandem.router.admission import AdmissionConfig
from tandem.router.route_planner import DecodeRoutingConfig
from tandem.router.routing_policy import RoutingConfig

CHART_DIR = Path(__file__).resolve().parent.parent / "helm" / "tandem"
SCHEMA_FILE = CHART_DIR / "values.schema.json"
NUMBERS_FILE = CHART_DIR / "templates" / "_numbers.tpl"

CHART_TRANSPORTS = ("torch", "ucx")
"""The KV transports the chart offers (`serve.transport`: shm cannot cross pods)."""


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


def optional_field(model: type[BaseModel], name: str) -> dict[str, Any]:
    """The schema of `model`'s field `name`, or null: a value the chart forwards only when set
    (null keeps the model's default, and the field out of the rendered config)."""
    full = model.model_json_schema()
    field = _inline(full["properties"][name], full.get("$defs", {}))
    description = field.pop("description", "")
    default = model.model_fields[name].get_default(call_default_factory=True)
    return {
        "description": f"{description} Forwarded as `{name}`; null: the default "
        f"({json.dumps(default)}), left out of serveConfigV2.".lstrip(),
        "anyOf": [field, {"type": "null"}],
    }


def engine_schema(description: str) -> dict[str, Any]:
    schema = object_schema(EngineConfig, description, leave_out=tuple(SET_BY_CLUSTER))
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
        ("serve", "transportOptions"): transport_options_schema(),
    }


def transport_options_schema() -> dict[str, Any]:
    """`serve.transportOptions`: the options the chart's transports take, each of its type (a
    typo is refused at render time; one the chosen transport does not take, when the app
    starts)."""
    properties: dict[str, Any] = {}
    takes = []
    for name in CHART_TRANSPORTS:
        names = option_names(name)
        if names is None:
            raise RuntimeError(f"transport {name!r} cannot be imported: install tandem-serve[ucx]")
        hints = typing.get_type_hints(transport_class(name).__init__)
        for option in sorted(names):
            properties[option] = TypeAdapter(hints[option]).json_schema()
        takes.append(f"{name}: {', '.join(sorted(names))}")
    return {
        "type": "object",
        "description": f"Options of the chosen KV transport ({'; '.join(takes)}).",
        "properties": properties,
        "additionalProperties": False,
    }


def generated_fields() -> dict[tuple[str, ...], dict[str, Any]]:
    """Path of property names in the values schema -> the schema of a single cluster-config
    field the chart forwards only when it is set (null: left out, the model's default holds)."""
    return {
        ("serve", "corsAllowedOrigins"): optional_field(RouterConfig, "cors_allowed_origins"),
        ("serve", "responsesStoreSize"): optional_field(RouterConfig, "responses_store_size"),
        ("serve", "checksums"): optional_field(ClusterConfig, "checksums"),
        ("serve", "chunkPublisher"): optional_field(ClusterConfig, "chunk_publisher"),
        ("serve", "logRequests"): optional_field(RouterConfig, "log_requests"),
    }


# Helm's `--set x=0.5` passes the string "0.5" (only integers, booleans and null are typed), so
# every number of the values schema also takes a decimal string, whose pattern keeps the bounds;
# the chart's templates turn such strings into numbers (templates/_numbers.tpl, generated below).
_DECIMAL = r"(\d+\.?\d*|\.\d+)"
_POSITIVE = r"(\d*[1-9]\d*\.?\d*|\d*\.\d*[1-9]\d*)"
_AT_LEAST_1 = r"(0*[1-9]\d*\.?\d*)"
_ABOVE_1 = r"(0*[1-9]\d*\.\d*[1-9]\d*|0*([2-9]|[1-9]\d+)\.?\d*)"
_UNIT = r"(0*\.\d+|0+\.?|0*1(\.0*)?)"
_POSITIVE_UNIT = r"(0*\.\d*[1-9]\d*|0*1(\.0*)?)"
_BOUNDED_DECIMALS: dict[tuple[str, float, float | None], str] = {
    ("minimum", 0.0, None): _DECIMAL,
    ("exclusiveMinimum", 0.0, None): _POSITIVE,
    ("minimum", 1.0, None): _AT_LEAST_1,
    ("exclusiveMinimum", 1.0, None): _ABOVE_1,
    ("minimum", 0.0, 1.0): _UNIT,
    ("exclusiveMinimum", 0.0, 1.0): _POSITIVE_UNIT,
}
_BOUND_KEYS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def decimal_pattern(bounds: dict[str, Any]) -> str | None:
    """A regular expression for the decimal strings (no exponent) within a number schema's
    `bounds`, or None for bounds it cannot express (the number then takes no string)."""
    given = {k: float(v) for k, v in bounds.items() if k in _BOUND_KEYS}
    if not given:
        return f"^[+-]?{_DECIMAL}$"
    if "exclusiveMaximum" in given:
        return None
    lower = [k for k in ("minimum", "exclusiveMinimum") if k in given]
    if len(lower) != 1:
        return None
    body = _BOUNDED_DECIMALS.get((lower[0], given[lower[0]], given.get("maximum")))
    return None if body is None else f"^\\+?{body}$"


def _all_numeric_strings() -> list[dict[str, Any]]:
    bounds: list[dict[str, Any]] = [{}]
    for lower, low, high in _BOUNDED_DECIMALS:
        bounds.append({lower: low} if high is None else {lower: low, "maximum": high})
    return [{"type": "string", "pattern": decimal_pattern(b)} for b in bounds]


def _is_number(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "number"


def _numeric_string(number: dict[str, Any]) -> dict[str, Any] | None:
    pattern = decimal_pattern(number)
    return None if pattern is None else {"type": "string", "pattern": pattern}


def accepting_numeric_strings(node: Any) -> Any:
    """`node` with every `type: number` schema also taking a decimal string in its bounds
    (idempotent: a number already beside its string form is left as it is)."""
    if isinstance(node, list):
        return [accepting_numeric_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    if _is_number(node):
        string = _numeric_string(node)
        if string is None:
            return dict(node)
        number = {k: v for k, v in node.items() if k != "description"}
        out = {"description": node["description"]} if "description" in node else {}
        return {**out, "anyOf": [number, string]}
    out = {}
    for key, value in node.items():
        if key in ("anyOf", "oneOf") and isinstance(value, list):
            branches: list[Any] = []
            for branch in value:
                if branch in _all_numeric_strings():
                    continue  # made by an earlier run: made again after its number
                branches.append(
                    accepting_numeric_strings(branch) if not _is_number(branch) else branch
                )
                string = _numeric_string(branch) if _is_number(branch) else None
                if string is not None:
                    branches.append(string)
            out[key] = branches
        else:
            out[key] = accepting_numeric_strings(value)
    return out


def number_fields(node: Any) -> Any:
    """Where the values schema takes numbers: True for a number, else {property: ...} ("*" for
    additionalProperties), None where there is none."""
    if not isinstance(node, dict):
        return None
    branches = node.get("anyOf", [node])
    if any(_is_number(b) for b in branches):
        return True
    out: dict[str, Any] = {}
    for branch in branches:
        if not isinstance(branch, dict):
            continue
        for name, child in branch.get("properties", {}).items():
            found = number_fields(child)
            if found is not None:
                out[name] = found
        found = number_fields(branch.get("additionalProperties"))
        if found is not None:
            out["*"] = found
    return out or None


def numbers_template(schema: dict[str, Any]) -> str:
    """templates/_numbers.tpl: the number fields of `schema`, for tandem.numbers."""
    fields = json.dumps(number_fields(schema), sort_keys=True, separators=(",", ":"))
    return (
        "{{/* Generated by `python -m tandem.deploy.helm_schema` from values.schema.json: do\n"
        "not edit. Where the values hold numbers that `--set` may have passed as strings\n"
        "(tandem.numbers, in _helpers.tpl, turns them into numbers). */}}\n"
        '{{- define "tandem.numberFields" -}}\n'
        f"{fields}\n"
        "{{- end -}}\n"
    )


def updated(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (the values schema) with its generated parts as the models say now, and every
    number taking its decimal string too."""
    out = json.loads(json.dumps(schema))
    for path, part in {**generated_parts(), **generated_fields()}.items():
        node = out
        for name in path[:-1]:
            node = node["properties"][name]
        node["properties"][path[-1]] = part
    fresh = accepting_numeric_strings(out)
    assert isinstance(fresh, dict)
    return fresh


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--file", type=Path, default=SCHEMA_FILE)
    parser.add_argument("--numbers-file", type=Path, default=NUMBERS_FILE)
    args = parser.parse_args(argv)
    schema = updated(json.loads(args.file.read_text()))
    files = {args.file: render(schema), args.numbers_file: numbers_template(schema)}
    if args.check:
        stale = [p for p, text in files.items() if not p.is_file() or p.read_text() != text]
        for path in stale:
            print(f"{path} is out of date: run python -m tandem.deploy.helm_schema")
        return 1 if stale else 0
    for path, text in files.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
