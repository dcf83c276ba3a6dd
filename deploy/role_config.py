"""The cluster config's parts for each deployment: a role's actor group (prefill, decode),
the router, and the service-level objectives the router counts requests against."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.deploy.autoscaling_config import DecodeAutoscaling, PrefillAutoscaling


class RoleConfig(BaseModel):
    """One actor group: how many replicas and what each needs from Ray."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1, description="Replicas (actors) of this role.")
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs per replica.")
    num_gpus: float = Field(
        0.0,
        ge=0,
        description="Ray GPUs per replica. A share below 1 also sets the engine's "
        "gpu_memory_utilization to 0.9 x that share unless it is set.",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description='Custom Ray resources per replica, e.g. {"prefill": 1} to pin a role to '
        "the Kubernetes worker group that advertises it.",
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per replica.")
    engine: dict[str, Any] = Field(
        default_factory=dict, description="Engine settings for this role only (override `engine`)."
    )
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A replica Serve stops (scale-down, redeploy) first finishes its requests, "
        "KV transfers and token streams, for at most this long.",
    )

    @model_validator(mode="after")
    def _replicas_within_bounds(self) -> RoleConfig:
        scaling = getattr(self, "autoscaling", None)
        if scaling is not None and not (
            scaling.min_replicas <= self.replicas <= scaling.max_replicas
        ):
            raise ValueError(
                f"replicas ({self.replicas}) is the initial count when autoscaling: it must lie "
                f"within min_replicas..max_replicas ({scaling.min_replicas}..{scaling.max_replicas})"
            )
        return self

    def ray_actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class PrefillRoleConfig(RoleConfig):
    autoscaling: PrefillAutoscaling | None = Field(
        None, description="Scale between min and max replicas (absent: fixed `replicas`)."
    )


class DecodeRoleConfig(RoleConfig):
    autoscaling: DecodeAutoscaling | None = Field(
        None, description="Scale between min and max replicas (absent: fixed `replicas`)."
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Tokens a request's stream gathers before they go out (its last ones go "
        "at once): 1 streams every token as it is sampled; more send fewer, larger chunks "
        "(less work per token for the decode worker, the router and the client, coarser "
        "inter-token timing). A request's first token is never held.",
    )


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.1, ge=0)
    resources: dict[str, float] = Field(
        default_factory=dict,
        description='Custom Ray resources per router replica, e.g. {"router": 1} to place it '
        "on the nodes that advertise it.",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Longest a request may take.")
    responses_store_size: int = Field(
        1000,
        ge=0,
        description="Responses API replies each router replica keeps in memory for GET "
        "/v1/responses/{id} and previous_response_id (the newest; 0 keeps none).",
    )
    cors_allowed_origins: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Origins a browser may call the API from (CORS), as vLLM's "
        '--allowed-origins: all ("*") by default; [] turns CORS off.',
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="How a model writes tool calls in a free reply (tool_choice auto): hermes "
        '(<tool_call>{...}</tool_call>, Qwen), llama3_json ({"name", "parameters"}), '
        "mistral ([TOOL_CALLS]...), or auto: the one the chat template teaches (else hermes).",
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None,
        description="Put a reasoning model's <think>...</think> in the chat reply's "
        "reasoning_content, apart from its content: qwen3, deepseek_r1 (default: none).",
    )
    log_requests: bool = Field(
        True, description="One log line per finished request, with its stage timings."
    )

    def ray_actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class SLOConfig(BaseModel):
    """Service-level objectives the router counts requests against (goodput metrics)."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(2000.0, gt=0, description="Time-to-first-token target.")
    tpot_ms: float | None = Field(200.0, gt=0, description="Time-per-output-token target.")
