"""The router: the Serve ingress (FastAPI) with the OpenAI API, a debug view, and gRPC.

(No `from __future__ import annotations` here: FastAPI must see real types on the methods.)

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (OpenAI's Responses
API, answered as a chat completion), GET /v1/models[/{model}], GET /health,
POST /tokenize and /detokenize (vLLM's),
GET /debug/workers (every worker's KV block accounting, from the worker registry),
GET /metrics (Prometheus).
"""

import asyncio
import logging
import os
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Header, Query
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve

from tandem import __version__
from tandem.deploy.ingress import HAPROXY_FLAG
from tandem.engine.metrics import RouterMetrics, WorkerMetricsCollector
from tandem.engine.serve_logging import use_serve_log_handlers
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.worker_registry import get_registry
from tandem.router.admission import AdmissionConfig
from tandem.router.api_keys import APIKeyMiddleware, KeyDigests, key_digest
from tandem.router.cors import LateCORS
from tandem.router.direct_http import DirectHTTPServer, start_direct_http
from tandem.router.http_errors import install_error_handlers
from tandem.router.model_cards import model_card, models_body
from tandem.router.openai_api import (
    create_chat_completion,
    create_completion,
)
from tandem.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tandem.router.pd_orchestrator import PDOrchestrator
from tandem.router.reasoning import ReasoningParser
from tandem.router.replica_watch import ReplicaWatch, configured_targets
from tandem.router.request_record import log_requests
from tandem.router.responses_api import create_response
from tandem.router.responses_protocol import ResponsesRequest
from tandem.router.responses_store import ResponsesStore
from tandem.router.route_planner import DecodeRoutingConfig, RoutePlanner
from tandem.router.routing_policy import RoutingConfig
from tandem.router.serving import Serving
from tandem.router.sse_keepalive import KEEPALIVE_S
from tandem.router.stop_gate import StopGate, StopGateMiddleware, follow_stop
from tandem.router.tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from tandem.router.tool_parsers import pick_tool_parser
from tandem.router.worker_directory import WorkerDirectory

logger = logging.getLogger("tandem.router")

api = FastAPI(title="tandem", description="Disaggregated prefill/decode LLM serving (OpenAI API).")


install_error_handlers(api)
api.add_middleware(StopGateMiddleware, gate=lambda: getattr(api.state, "stop_gate", None))
api.add_middleware(APIKeyMiddleware, key=lambda: getattr(api.state, "api_key_digest", None))
# (added last: outermost, so that a browser's preflight needs no key)
api.add_middleware(LateCORS, origins=lambda: getattr(api.state, "cors_origins", []))


ROUTER_MAX_ONGOING = 960
"""Requests one router replica takes through Serve's proxy at once (more wait in the proxy;
the direct port is not counted). Below Ray's default concurrency of an async actor (1000):
Serve makes the replica's concurrency equal to this when it is larger, and at 1024 a replica
whose 1024 slots were taken (long streams, or clients that never send their body) queued the
controller's health checks behind them, failed them and was restarted, its streams lost."""


# (module level, above the class: Serve pickles the ingress class as it is defined, with the
# names it uses that exist by then)
HEALTHY = ("ok", "degraded")
"""The `health_status` values that serve requests (`/health` 200, gRPC SERVING)."""


def health_status(live: dict[str, int], stopping: bool) -> str:
    """ok: a worker of each role in use is reachable; degraded: decode workers only (they
    prefill requests themselves meanwhile, `route_planner`); unavailable: no decode worker;
    stopping: the application stops."""
    if stopping:
        return "stopping"
    if live.get("decode", 0) == 0:
        return "unavailable"
    return "ok" if all(live.values()) else "degraded"


@serve.deployment(name="router", max_ongoing_requests=ROUTER_MAX_ONGOING)
@serve.ingress(api)
class Router:
    app: Any  # (Serve's ingress wrapper: the ASGI app this replica runs, its routes bound here)

    def __init__(self, settings: dict[str, Any], prefill: Any, decode: Any) -> None:
        """`prefill` / `decode` are the worker deployments' handles: binding them makes Serve
        deploy the workers with the router; requests reach workers over their RPC endpoints.
        `prefill` is None in colocated mode (`settings["mode"]`)."""
        use_serve_log_handlers(str(settings.get("log_level", "info")).upper())
        log_requests(bool(settings.get("log_requests", True)))
        self.settings = settings
        # The keys' digests: from the config (never the key: Serve shows init arguments), else
        # the key in the environment this replica was started in (the Helm chart puts its
        # Secret on the router pods as TANDEM_API_KEY).
        env_key = os.environ.get("TANDEM_API_KEY")
        self.api_key_digest: KeyDigests = settings.get("api_key_sha256") or (
            key_digest(env_key) if env_key else None
        )
        api.state.api_key_digest = self.api_key_digest  # (one router replica per process)
        api.state.cors_origins = list(settings.get("cors_allowed_origins", ["*"]))
        tokenizer = Tokenizer.from_pretrained(
            settings.get("tokenizer") or settings["model"], settings["model"]
        )
        if settings.get("chat_template"):  # the config's, instead of the checkpoint's
            tokenizer.hf.chat_template = settings["chat_template"]
        registry = settings["registry_name"]
        self.directory = WorkerDirectory(
            get_registry(registry), settings["auth_token"], lambda: get_registry(registry)
        )
        self.directory.start()
        self.stop_gate = api.state.stop_gate = StopGate()
        self.roles = ("decode",) if settings.get("mode") == "colocated" else ("prefill", "decode")
        model_names: list[str] = settings["served_model_name"]  # (`ClusterConfig.model_names`)
        model_name = model_names[0]  # (the one replies and metrics carry)
        self.model_root = settings["model"]  # (what `/v1/models` names as each card's root)
        context = serve.get_replica_context()
        replica = context.replica_id.unique_id
        self.metrics = RouterMetrics(model_name, replica)
        self.directory.on_kv_resync.append(self.metrics.kv_resynced)
        api.state.metrics = self.metrics  # (the error handlers count what reaches them)
        self.responses_store = ResponsesStore(int(settings.get("responses_store_size", 1000)))
        self._scrape_stats: list[tuple[str, str, dict[str, Any]]] = []
        planner = RoutePlanner(
            self.directory,
            RoutingConfig.model_validate(settings.get("routing", {})),
            DecodeRoutingConfig.model_validate(settings.get("decode_routing", {})),
            AdmissionConfig.model_validate(settings.get("admission", {})),
            colocated=self.roles == ("decode",),
        )
        self.serving = Serving(
            PDOrchestrator(self.directory),
            planner,
            tokenizer,
            model_names,
            settings.get("request_timeout_s", 600.0),
            self.metrics,
            settings.get("slo"),
            # Behind Ray's HAProxy ingress (tandem serve --ingress haproxy, the chart's
            # serve.ingress: haproxy) a client's leaving is noticed only when a stream writes.
            sse_keepalive_s=KEEPALIVE_S if os.environ.get(HAPROXY_FLAG) == "1" else None,
            tool_parser=pick_tool_parser(
                settings.get("tool_call_parser", "auto"), tokenizer.hf.chat_template
            ),
            reasoning_parser=(
                ReasoningParser(settings["reasoning_parser"])
                if settings.get("reasoning_parser")
                else None
            ),
            sampling_defaults=settings.get("sampling_defaults"),
            max_tokens_ceiling=settings.get("max_tokens_ceiling"),
        )
        # Replicas each role should have: configured, then what Serve is bringing up
        # (autoscaling); and whether Serve stops this one.
        self.replicas = ReplicaWatch(
            context.app_name,
            replica,
            self.roles,
            configured_targets(settings),
            self.serving.deadlines,
            float(settings.get("graceful_shutdown_s") or 0),
        )
        self.metrics.registry.register(
            WorkerMetricsCollector(
                model_name,
                self._worker_series,
                lambda: self.replicas.targets,
                lambda: {"router": self.replicas.running_routers},
            )
        )
        asyncio.get_running_loop().create_task(self.replicas.follow())
        asyncio.get_running_loop().create_task(
            follow_stop(
                self.stop_gate,
                f"router/{replica}",
                lambda: self.directory.registry,
                self._end_requests,
            )
        )
        logger.info(
            "router for %s: tool calls read as %s (%s), reasoning parser %s, chat template %s",
            model_name,
            self.serving.tool_parser.name,
            settings.get("tool_call_parser", "auto"),
            settings.get("reasoning_parser") or "none",
            "from the config"
            if settings.get("chat_template")
            else "the checkpoint's"
            if tokenizer.hf.chat_template
            else "none (chat requests are a 400)",
        )
        self.registry_name: str = settings["registry_name"]
        self._grpc_server: Any = None
        port = settings.get("grpc_port")
        if port:
            asyncio.get_running_loop().create_task(self._start_grpc(settings["host"], port))
        self._direct_http: DirectHTTPServer | None = None
        if settings.get("direct_port"):
            asyncio.get_running_loop().create_task(
                self._start_direct_http(settings["host"], settings["direct_port"])
            )

    async def __del__(self) -> None:
        """Serve stops this replica (shutdown, redeploy, scale-down) once its HTTP requests
        have ended (`graceful_shutdown_timeout_s`); gRPC streams and requests on the direct
        HTTP port in flight get as long to end (new ones are refused meanwhile). A request
        still waiting for a worker (the app's are gone at shutdown) fails at once with a 503."""
        directory = getattr(self, "directory", None)  # (none: `__init__` failed early)
        if directory is not None:
            directory.stop_waiting()  # (no worker comes back now: fail, don't hold the stop)
        grace_s = float(self.settings.get("drain_timeout_s", 30.0))
        server = getattr(self, "_grpc_server", None)
        direct = getattr(self, "_direct_http", None)
        self._grpc_server = self._direct_http = None
        await asyncio.gather(
            *(s.stop(grace_s) for s in (server, direct) if s is not None),
            return_exceptions=True,
        )

    async def _start_direct_http(self, host: str, port: int) -> None:
        try:  # (`self.app`: the ASGI app Serve runs in this replica, routes bound to it)
            self._direct_http = await start_direct_http(self.app, host, port)
        except Exception:
            logger.exception("the direct HTTP port did not open on %s:%s", host, port)

    async def _start_grpc(self, host: str, port: int) -> None:
        from tandem.router.grpc.server import start_grpc_server

        try:
            self._grpc_server = await start_grpc_server(
                self.serving,
                host,
                port,
                api_key_digest=self.api_key_digest,
                ready=lambda: (
                    health_status(self._live_workers(), self.stop_gate.stopping) in HEALTHY
                ),
                gate=self.stop_gate,
            )
        except Exception:
            logger.exception("gRPC server did not start on %s:%s", host, port)

    @api.post("/v1/completions")
    async def completions(
        self, body: CompletionRequest, x_request_id: str | None = Header(None)
    ) -> Any:
        return await create_completion(self.serving, body, client_id=x_request_id)

    @api.post("/v1/chat/completions")
    async def chat_completions(
        self, body: ChatCompletionRequest, x_request_id: str | None = Header(None)
    ) -> Any:
        return await create_chat_completion(self.serving, body, client_id=x_request_id)

    @api.post("/v1/responses")
    async def responses(self, body: ResponsesRequest) -> Any:
        return await create_response(self.serving, body, self.responses_store)

    @api.get("/v1/responses/{response_id}")
    async def stored_response(self, response_id: str) -> dict[str, Any]:
        """A response this replica stored (`responses_store.py`); 404 otherwise."""
        return self.responses_store.get(response_id).response

    @api.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        self,
        response_id: str,
        after: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        """`client.responses.input_items.list`: what a stored response answered."""
        return self.responses_store.input_items(response_id, after=after, limit=limit, order=order)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str) -> dict[str, Any]:
        return self.responses_store.delete(response_id)

    @api.post("/tokenize")
    async def tokenize_route(self, body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(self.serving, body)

    @api.post("/detokenize")
    async def detokenize_route(self, body: DetokenizeRequest) -> dict[str, Any]:
        return await detokenize(self.serving, body)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        limits = await self.serving.limits()
        return models_body(self.serving.model_names, self.model_root, limits.max_model_len)

    @api.get("/v1/models/{model:path}")
    async def model_card(self, model: str) -> dict[str, Any]:
        """One model's card (`client.models.retrieve`); 404 for a model not served here.
        `/v1/models/` (a trailing slash, no name) is the list."""
        if not model:
            return await self.models()
        self.serving.check_model(model)
        limits = await self.serving.limits()
        return model_card(model, self.model_root, limits.max_model_len)

    @api.get("/version")
    async def version(self) -> dict[str, str]:
        """tandem's version, as vLLM's `GET /version` answers."""
        return {"version": __version__}

    @api.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' probes)
    @api.get("/ping")  # (vLLM's and SageMaker's name for it)
    @api.post("/ping")
    async def health(self) -> JSONResponse:
        """200 when a worker of each role in use is reachable ("ok"), or a decode worker only
        ("degraded": decode prefills requests itself meanwhile); else 503 ("unavailable"; also
        while the application stops: "stopping")."""
        live = self._live_workers()
        status = health_status(live, self.stop_gate.stopping)
        code = 200 if status in HEALTHY else 503
        return JSONResponse({"status": status, "workers": live}, status_code=code)

    def _live_workers(self) -> dict[str, int]:
        """Per role in use, how many of its workers are reachable."""
        return {role: len(self.directory.live(role)) for role in self.roles}

    def _end_requests(self) -> None:
        """The application's stop ran out of drain time: the requests still running end now."""
        grace_s = float(self.settings.get("drain_timeout_s", 30.0))
        self.serving.deadlines.cut_at(
            asyncio.get_running_loop().time(),
            f"the server is shutting down and this request did not finish within {grace_s:g}s: "
            "send it again",
        )

    def _worker_series(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(role, replica, stats) of every worker this router routes to, as read for the
        current scrape (`prometheus_metrics`)."""
        return self._scrape_stats

    @api.get("/metrics")
    async def prometheus_metrics(self) -> Response:
        """Prometheus text format: every `tandem:*` metric (see `tandem.engine.metrics`).
        Worker series are read from each worker now (its registry report, up to 2 s old when
        it went idle, if it does not answer within 1 s)."""
        live = {s.get("worker_id"): s for s in await self.directory.live_stats(timeout=1.0)}
        series = []
        for w in list(self.directory.workers.values()):
            if w.client.closed:
                continue
            fresh = live.get(w.worker_id)
            stats = fresh if fresh is not None and "error" not in fresh else w.stats
            series.append((w.role, w.worker_id.split("/", 1)[-1], stats))
        self._scrape_stats = series
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/debug/workers")
    async def workers(self) -> JSONResponse:
        """The workers this router routes to, each with its stats read from it now."""
        return JSONResponse({"workers": await self.directory.live_stats()})
