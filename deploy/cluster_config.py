"""The cluster config: one pydantic tree for the whole application (roles, engine, transport).

`tandem serve` builds it from flags and an optional YAML/JSON file; the Serve config YAML passes
it as application args. Validation happens here, before anything starts.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.deploy.role_config import (
    DecodeRoleConfig,
    PrefillRoleConfig,
    RoleConfig,
    RouterConfig,
    SLOConfig,
)
from tandem.engine.config import EngineConfig
from tandem.engine.errors import summarize_validation
from tandem.engine.worker_settings import WorkerSettings
from tandem.kv_transfer.registry import TRANSPORTS, check_options
from tandem.router.admission import AdmissionConfig
from tandem.router.route_planner import DecodeRoutingConfig
from tandem.router.routing_policy import RoutingConfig

__all__ = ["ClusterConfig", "RoleConfig", "RouterConfig", "SLOConfig", "read_config_file"]


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file's mapping (YAML or JSON); ValueError in one line naming the file when it
    is not valid YAML or not a mapping."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "not valid YAML"
        raise ValueError(f"{path}: {why}: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


SET_BY_CLUSTER = frozenset({"model", "tokenizer"})
"""Engine settings the cluster config's own fields set for every engine (not in `engine`)."""


class ClusterConfig(BaseModel):
    """Everything `build_app` needs. `model=None` serves the embedded tiny model."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Local Hugging Face checkpoint directory.")
    served_model_name: str | list[str] | None = Field(
        None,
        description="Model name clients send (default: the checkpoint folder's name); a list "
        "gives several names for the same model (replies carry the first: the canonical one).",
    )
    tokenizer: str | None = Field(
        None,
        description="A directory (or a repo id the local Hugging Face cache holds) whose "
        "tokenizer and chat template are used instead of the checkpoint's own, by the router "
        "and every worker (as vLLM's --tokenizer).",
    )
    chat_template: str | None = Field(
        None,
        description="Jinja chat template for the chat API, instead of the checkpoint's: the "
        "path of a file that holds it, or its text (as vLLM's --chat-template).",
    )
    app_name: str = Field("tandem", pattern=r"^[A-Za-z0-9_.-]+$")  # (a name Serve shows)
    mode: Literal["pd", "colocated"] = Field(
        "pd",
        description="pd: prefill and decode workers (disaggregated). colocated: no prefill "
        "workers; every request is prefilled and decoded by one decode-role worker.",
    )
    transport: str = Field("shm", description="KV transport between prefill and decode.")
    transport_options: dict[str, Any] = Field(
        default_factory=dict,
        description="The transport's own options (its constructor's keyword arguments, e.g. "
        "torch: host, advertise_host, port, timeout); unknown ones are refused. A worker's "
        "transport listens on its node's address unless `host` is given.",
    )
    api_key: str | list[str] | None = Field(
        None,
        description="Clients must send 'Authorization: Bearer <key>' (HTTP header or gRPC "
        "metadata), with this key or one of a list; /health and /metrics stay open. Unset: "
        "no key needed.",
    )
    auth_token: str | None = Field(
        None, description="Cluster token for KV transfer handshakes (generated when unset)."
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="EngineConfig fields shared by both roles (dtype, block_size, num_kv_blocks, "
        "max_model_len, max_num_batched_tokens, max_num_seqs, enable_prefix_caching, ...).",
    )
    prefill: PrefillRoleConfig = Field(default_factory=PrefillRoleConfig)
    decode: DecodeRoleConfig = Field(default_factory=DecodeRoleConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig,
        description="Prefill choice: policy (cache_affinity, least_loaded, power_of_two, "
        "round_robin) and its weights.",
    )
    decode_routing: DecodeRoutingConfig = Field(default_factory=DecodeRoutingConfig)
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig,
        description="Deadlines (default, per tenant), prefill queue caps, TTFT prediction.",
    )
    slo: SLOConfig = Field(
        default_factory=SLOConfig,
        description="TTFT/TPOT targets: tandem:slo_met_requests / slo_missed_requests count "
        "finished requests against them (null: no target).",
    )
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8000, ge=1, le=65535)
    grpc_port: int | None = Field(50051, ge=0, le=65535, description="0 or null: no gRPC.")
    direct_port: int | None = Field(
        8001,
        ge=0,
        le=65535,
        description="The OpenAI API served by each router replica itself, skipping Serve's "
        "proxy (lower latency; replicas of one node share the port). 0 or null: none.",
    )
    lease_s: float = Field(30.0, gt=0)
    stall_timeout_s: float = Field(10.0, gt=0)
    reserve_wait_s: float = Field(
        60.0,
        ge=0,
        description="A request for which its decode worker has no KV room now waits this long "
        "for room, in arrival order, as in vLLM's queue (then 429 with Retry-After); 0: refused "
        "at once.",
    )
    ack_timeout_s: float = Field(10.0, gt=0)
    checksums: bool = Field(
        False,
        description="Each chunk of KV pages carries an xxhash of its pages, checked on decode "
        "(a failed check fails the request).",
    )
    chunk_publisher: bool = Field(
        True,
        description="Prefill workers hand a request's chunks (all but the last) to a thread of "
        "their own, which sends them while the next chunk computes; false: the engine's thread "
        "sends each chunk itself.",
    )
    cache_dir: str = Field("~/.cache/tandem", description="Where the embedded tiny model lives.")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("transport")
    @classmethod
    def _known_transport(cls, value: str) -> str:
        if value not in TRANSPORTS or value in ("local", "fake"):
            usable = ", ".join(sorted(set(TRANSPORTS) - {"local", "fake"}))
            why = "in-process only: it cannot join processes" if value in TRANSPORTS else "unknown"
            raise ValueError(f"transport {value!r} is {why} (use {usable})")
        return value

    @field_validator("served_model_name")
    @classmethod
    def _names_given(cls, value: str | list[str] | None) -> str | list[str] | None:
        names = _name_list(value)
        if value is not None and (not names or not all(n.strip() for n in names)):
            raise ValueError("served_model_name: give a non-empty name (or a list of them)")
        if len(set(names)) < len(names):
            raise ValueError(f"served_model_name: a name comes twice in {names}")
        return value

    def api_keys(self) -> list[str]:
        """The keys clients may present (none: no key needed)."""
        return [k for k in _name_list(self.api_key) if k]

    def model_names(self, model: str) -> list[str]:
        """The names clients may send for `model` (the checkpoint's path): the configured ones;
        else the checkpoint folder's name, and `self.model` as it was given too (vLLM's name:
        its clients send the path), or only that where it is a Hugging Face repo id (its
        snapshot folder's name is a commit hash)."""
        if names := _name_list(self.served_model_name):
            return names
        given = self.model
        if given is None:
            return [Path(model).name]
        if not Path(given).expanduser().exists():  # a repo id the local HF cache holds
            return [given]
        folder = Path(given).expanduser().name or Path(model).name
        return [folder] if folder == given else [folder, given]

    @model_validator(mode="after")
    def _transport_options_exist(self) -> ClusterConfig:
        check_options(self.transport, self.transport_options)
        return self

    @field_validator("engine", "prefill", "decode", mode="after")
    @classmethod
    def _engine_fields_exist(cls, value: Any) -> Any:
        fields = value if isinstance(value, dict) else value.engine
        unknown = set(fields) - set(EngineConfig.model_fields) | (SET_BY_CLUSTER & set(fields))
        if unknown:
            raise ValueError(f"unknown or misplaced engine settings: {sorted(unknown)}")
        return value

    def _device(self, role: Literal["prefill", "decode"]) -> str:
        """Where the role's engines run: its `device`, with "auto" meaning CUDA exactly when
        Ray gives each replica a GPU (Ray 2.60 does not hide GPUs from an actor that asked
        for none, so torch would find them anyway)."""
        role_cfg = self.prefill if role == "prefill" else self.decode
        device = str({**self.engine, **role_cfg.engine}.get("device", "cpu"))
        if device == "auto":
            return "cuda" if role_cfg.num_gpus > 0 else "cpu"
        return device

    @model_validator(mode="after")
    def _ports_differ(self) -> ClusterConfig:
        if self.grpc_port and self.grpc_port == self.port:
            raise ValueError(
                f"grpc_port and port are both {self.port}: the gRPC and HTTP servers need "
                "a port each (grpc_port 0: no gRPC)"
            )
        for name, other in (("port", self.port), ("grpc_port", self.grpc_port)):
            if self.direct_port and self.direct_port == other:
                raise ValueError(
                    f"direct_port and {name} are both {other}: each server needs a port of "
                    "its own (direct_port 0: no direct HTTP port)"
                )
        return self

    @model_validator(mode="after")
    def _devices_fit_the_roles(self) -> ClusterConfig:
        """A role on CUDA asks Ray for a GPU (else Ray would place replicas on no GPU of their
        own, however many share one); ucx moves host-memory pools only."""
        roles: tuple[Literal["prefill", "decode"], ...] = (
            ("decode",) if self.mode == "colocated" else ("prefill", "decode")
        )
        for role in roles:
            device = self._device(role)
            if not device.startswith("cuda"):
                continue
            if getattr(self, role).num_gpus <= 0:
                raise ValueError(
                    f"{role} runs on {device!r} but asks Ray for no GPU: set {role}.num_gpus "
                    "(1 for a GPU of its own, 0.5 for two replicas sharing one)"
                )
            if self.transport == "ucx" and self.mode == "pd":
                raise ValueError(
                    f"transport 'ucx' moves host-memory KV pools only, and {role} runs on "
                    f"{device!r}: use transport 'torch' (NCCL between GPUs) or 'shm'"
                )
        return self

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> ClusterConfig:
        """Reads YAML or JSON; `overrides` (non-None values) win over the file."""
        data = read_config_file(path)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)

    def with_auth_token(self, generated: str | None = None) -> ClusterConfig:
        """This config with a cluster token: its own, else `generated`, else a fresh random one."""
        if self.auth_token:
            return self
        return self.model_copy(update={"auth_token": generated or secrets.token_hex(16)})

    def ray_resources_needed(self) -> dict[str, float]:
        """Ray resources the deployment asks for with every role at its most replicas (the
        router's, each worker role's `autoscaling.max_replicas` or `replicas`): CPU, GPU and
        custom resources, summed. A cluster with less leaves some replicas unscheduled."""
        groups: list[tuple[int, dict[str, Any]]] = [
            (self.router.replicas, self.router.ray_actor_options())
        ]
        roles: list[PrefillRoleConfig | DecodeRoleConfig] = (
            [self.decode] if self.mode == "colocated" else [self.prefill, self.decode]
        )
        for role in roles:
            most = role.autoscaling.max_replicas if role.autoscaling else role.replicas
            groups.append((most, role.ray_actor_options()))
        needed: dict[str, float] = {}
        for count, options in groups:
            per_replica = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0)}
            for name, amount in {**per_replica, **options.get("resources", {})}.items():
                if amount:
                    needed[name] = round(needed.get(name, 0.0) + count * amount, 6)
        return needed

    def engine_config(self, role: Literal["prefill", "decode"], model: str) -> EngineConfig:
        role_cfg = self.prefill if role == "prefill" else self.decode
        settings = {**self.engine, **role_cfg.engine, "device": self._device(role)}
        if self.tokenizer:
            settings["tokenizer"] = self.tokenizer
        if 0 < role_cfg.num_gpus < 1:  # a share of a GPU: that share of its memory, by default
            default = EngineConfig.model_fields["gpu_memory_utilization"].default
            settings.setdefault("gpu_memory_utilization", round(default * role_cfg.num_gpus, 4))
        try:
            return EngineConfig(model=model, **settings)
        except ValidationError as exc:
            where = f"engine settings for {role}"
            if not role_cfg.engine or not _valid_engine(model, self.engine):
                where = "engine settings (shared)" if self.engine else where
            raise ValueError(f"{where}: {summarize_validation(exc)}") from None

    def worker_settings(
        self, role: Literal["prefill", "decode"], model: str, registry_name: str
    ) -> WorkerSettings:
        role_cfg = self.prefill if role == "prefill" else self.decode
        return WorkerSettings(
            role=role,
            engine=self.engine_config(role, model),
            transport=self.transport,
            transport_options=self.transport_options,
            auth_token=self.auth_token or "",
            registry_name=registry_name,
            torch_threads=role_cfg.torch_threads,
            lease_s=self.lease_s,
            stall_timeout_s=self.stall_timeout_s,
            reserve_wait_s=self.reserve_wait_s,
            ack_timeout_s=self.ack_timeout_s,
            drain_timeout_s=role_cfg.drain_timeout_s,
            checksums=self.checksums,
            hand_off=self.chunk_publisher,
            stream_interval=self.decode.stream_interval if role == "decode" else 1,
        )


def _valid_engine(model: str, settings: dict[str, Any]) -> bool:
    """Whether the shared engine settings alone make an EngineConfig (else a role's failure
    is theirs)."""
    try:
        EngineConfig(model=model, **settings)
    except (ValidationError, ValueError):
        return False
    return True


def _name_list(value: str | list[str] | None) -> list[str]:
    """A name-or-names field (`served_model_name`, `api_key`) as a list (none given: [])."""
    return [value] if isinstance(value, str) else list(value or [])
