"""The gRPC front end: `tandem.v1.Generation/Generate` (server streaming), grpc.health.v1, and
server reflection (so `grpcurl` and GUI clients need no copy of the proto).

It runs inside the router replica, on the replica's event loop, and goes through the same
`Serving` core as HTTP, so both refuse and answer requests identically.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.engine.sampling_params import MAX_LOGPROBS
from tandem.router.api_keys import KeyDigests, check_api_key
from tandem.router.errors import APIError, bad_request
from tandem.router.grpc import generation_pb2, generation_pb2_grpc
from tandem.router.grpc.health_status import SERVICE_NAME, GrpcServer, HealthServicer
from tandem.router.grpc.reflection import enable_reflection
from tandem.router.openai_protocol import MAX_CLIENT_ID, MAX_TEMPERATURE
from tandem.router.prepared import Prepared
from tandem.router.request_prep import on_a_tokenizing_thread
from tandem.router.request_timings import RequestTimings
from tandem.router.serving import Serving
from tandem.router.stop_gate import StopGate
from tandem.router.structured_output import Structure, one_structure, parse_schema

logger = logging.getLogger("tandem.router")

REFLECTED_SERVICES = (
    SERVICE_NAME,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)
"""What server reflection lists (`grpcurl -plaintext HOST:PORT list`, Postman, Evans)."""

_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


REQUEST_ID_KEY = "x-request-id"
"""Metadata a call may name itself with (when `request_id` is empty), and which its trailing
metadata carries back."""
TIMINGS_KEY = "x-tandem-timings"
"""Trailing metadata of the call's stage timings (JSON, ms), as HTTP's header."""

MAX_REQUEST_BYTES = 64 << 20
"""The largest GenerateRequest the server reads."""

MAX_STATUS_MESSAGE = 2000
"""Bytes of an error message a status carries (gRPC's metadata limits are 8 and 16 KiB:
a longer one, e.g. quoting a client's huge field, came out as RESOURCE_EXHAUSTED instead)."""


def _status_message(message: str) -> str:
    """`message` cut to `MAX_STATUS_MESSAGE` bytes of UTF-8 (gRPC percent-encodes each byte
    that is not ASCII: 2,000 characters of "é" were 12 KB on the wire)."""
    data = message.encode("utf-8")
    if len(data) <= MAX_STATUS_MESSAGE:
        return message
    return data[: MAX_STATUS_MESSAGE - 3].decode("utf-8", errors="ignore") + "…"


def _status_code(exc: APIError) -> grpc.StatusCode:
    if exc.code == "context_length_exceeded" and exc.param == "prompt":
        return grpc.StatusCode.OUT_OF_RANGE  # (the prompt alone does not fit)
    return _STATUS_CODES.get(exc.status, grpc.StatusCode.UNAVAILABLE)


_STRUCTURE_FIELDS = ("json_schema", "regex", "choice", "grammar")
"""The SamplingOptions that constrain the output (checking them may take seconds)."""


def _sampling_fields(options: generation_pb2.SamplingOptions) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "ignore_eos": options.ignore_eos,
        "min_tokens": options.min_tokens,
        "include_stop_str_in_output": options.include_stop_str_in_output,
    }
    optional = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "skip_special_tokens")
    penalties = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    for name in optional + penalties:
        if options.HasField(name):
            value = getattr(options, name)
            if isinstance(value, float) and not math.isfinite(value):  # (as HTTP refuses it)
                raise bad_request(f"{name} must be a finite number, got {value}", name)
            # (float fields are float32 on the wire: 0.1 arrives as 0.10000000149...)
            fields[name] = float(f"{value:.7g}") if isinstance(value, float) else value
    if not 0 <= fields.get("logprobs", 0) <= MAX_LOGPROBS:  # (as the HTTP API bounds it)
        raise bad_request(
            f"logprobs must be 0 to {MAX_LOGPROBS}, got {fields['logprobs']}", "logprobs"
        )
    if fields.get("temperature", 0.0) > MAX_TEMPERATURE:  # (as the HTTP API refuses it)
        raise bad_request(
            f"temperature must be at most {MAX_TEMPERATURE:g}, got {fields['temperature']}",
            "temperature",
        )
    if options.logit_bias:
        fields["logit_bias"] = dict(options.logit_bias)
    found: list[tuple[str, Structure]] = []
    if options.json_schema:
        found.append(
            ("json_schema", ("json_schema", parse_schema(options.json_schema, "json_schema")))
        )
    for kind in _STRUCTURE_FIELDS[1:]:
        if value := getattr(options, kind):
            found.append((kind, (kind, list(value) if kind == "choice" else value)))
    if (structure := one_structure(found)) is not None:
        fields[structure[0]] = structure[1]
    if options.stop:
        fields["stop"] = list(options.stop)
    if options.bad_words:
        fields["bad_words"] = list(options.bad_words)
    if options.allowed_token_ids:
        fields["allowed_token_ids"] = list(options.allowed_token_ids)
    if options.stop_token_ids:
        fields["stop_token_ids"] = list(options.stop_token_ids)
    return fields


def _logprobs(entries: list[Any] | None) -> list[generation_pb2.TokenLogprob]:
    return [
        generation_pb2.TokenLogprob(
            logprob=lp, top=[generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top]
        )
        for lp, top in entries or ()
    ]


def _parse_request(data: bytes) -> generation_pb2.GenerateRequest | None:
    """The request message, or None for bytes that are not one (`Generate` answers
    INVALID_ARGUMENT; grpc's own deserializer would make it UNKNOWN)."""
    try:
        return generation_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        return None


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self, serving: Serving, api_key_digest: KeyDigests = None, gate: StopGate | None = None
    ) -> None:
        self.serving = serving
        self.api_key_digest = api_key_digest
        self.gate = gate or StopGate()

    async def Generate(  # noqa: N802 - the RPC's name
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        metadata = {k.lower(): v for k, v in context.invocation_metadata() or ()}
        try:
            check_api_key(self.api_key_digest, metadata.get("authorization"))
        except APIError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, exc.message)
        client_id = (request.request_id if request is not None else "") or metadata.get(
            REQUEST_ID_KEY, ""
        )
        req: Prepared | None = None
        try:
            with self.gate.admitted():  # (a 503 once the application stops)
                req = await self._prepare(request, client_id)
                async with contextlib.aclosing(self.serving.run(req)) as items:
                    async for item in items:
                        yield _response(client_id, req, item)
            context.set_trailing_metadata(_trailing(client_id, req))
        except APIError as exc:
            # (refusals before `prepare` are counted here, as HTTP's error handler counts them)
            exc.count(self.serving.metrics)
            await context.abort(
                _status_code(exc), _status_message(exc.message), _trailing(client_id, req)
            )
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # (as HTTP's 500: counted; the class, not the details, goes out)
            logger.exception("gRPC Generate: unexpected error")
            failed = APIError(500, f"internal error: {type(exc).__name__}", type="server_error")
            failed.count(self.serving.metrics)
            await context.abort(grpc.StatusCode.INTERNAL, failed.message)

    async def _prepare(
        self, request: generation_pb2.GenerateRequest | None, client_id: str
    ) -> Prepared:
        """`client_id`: the request's `request_id`, else its `x-request-id` metadata."""
        if request is None:  # (`_parse_request` could not read the bytes)
            raise bad_request(
                "the request is not a tandem.v1.GenerateRequest (its bytes do not parse; its "
                "strings must be valid UTF-8)"
            )
        options = request.sampling
        max_tokens = options.max_tokens if options.HasField("max_tokens") else 16
        prompt: str | list[int] = (
            list(request.prompt_token_ids) if request.prompt_token_ids else request.prompt
        )
        if request.prompt_token_ids and request.prompt:
            raise bad_request("give prompt or prompt_token_ids, not both", "prompt")
        if request.HasField("deadline_ms") and not 0 < request.deadline_ms < math.inf:
            raise bad_request(f"deadline_ms must be > 0 and finite, got {request.deadline_ms}")
        if len(client_id) > MAX_CLIENT_ID or not client_id.isprintable():  # (into the logs)
            raise bad_request(
                f"request_id must be at most {MAX_CLIENT_ID} printable characters", "request_id"
            )
        # A client's id may repeat (two calls at once): the workers get it made unique.
        own_id = f"{client_id}@{uuid.uuid4().hex[:8]}" if client_id else ""
        if any(getattr(options, kind) for kind in _STRUCTURE_FIELDS):
            # (checking a grammar takes seconds for a large schema: off the event loop, as HTTP)
            fields = await on_a_tokenizing_thread(_sampling_fields, options)
        else:
            fields = _sampling_fields(options)
        if request.cache_salt:
            fields["cache_salt"] = request.cache_salt
        return await self.serving.prepare(
            own_id or f"grpc-{uuid.uuid4().hex}",
            request.model or None,
            prompt,
            max_tokens,
            fields,
            RequestTimings(),
            deadline_ms=request.deadline_ms if request.HasField("deadline_ms") else None,
            priority=request.priority if request.HasField("priority") else None,
            user=request.user or None,
        )


def _trailing(client_id: str, req: Prepared | None) -> tuple[tuple[str, str], ...]:
    """The call's trailing metadata: its id (`x-request-id`) and, once it was prepared, its
    stage timings (`x-tandem-timings`, JSON in ms, as HTTP's header)."""
    rid = client_id or (req.request_id if req is not None else "")
    # (a metadata value is printable ASCII: an id that is not, the reply's field alone carries)
    # (nor one refused for its length: gRPC drops headers past 8-16 KiB with RESOURCE_EXHAUSTED)
    echo = rid and len(rid) <= MAX_CLIENT_ID and all(" " <= c <= "~" for c in rid)
    out = [(REQUEST_ID_KEY, rid)] if echo else []
    if req is not None:
        out.append((TIMINGS_KEY, json.dumps(req.timings.stages_ms(), separators=(",", ":"))))
    return tuple(out)


def _response(
    client_id: str, req: Prepared, item: dict[str, Any]
) -> generation_pb2.GenerateResponse:
    """One item of the stream as a message; the last one (with a finish reason) has usage."""
    finish = item.get("finish_reason") or ""
    usage = None
    if finish:
        usage = generation_pb2.Usage(
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=req.completion_tokens,
            cached_tokens=req.num_cached_tokens,
        )
    stop = req.stop_reason if finish == "stop" else None
    return generation_pb2.GenerateResponse(
        request_id=client_id or req.request_id,
        token_ids=item["token_ids"],
        text=item["text"],
        finish_reason=finish,
        usage=usage,
        logprobs=_logprobs(item.get("logprobs")),
        stop_string=stop if isinstance(stop, str) else None,
        stop_token_id=stop if isinstance(stop, int) else None,
    )


async def start_grpc_server(
    serving: Serving,
    host: str,
    port: int,
    api_key_digest: KeyDigests = None,
    ready: Callable[[], bool] = lambda: True,
    gate: StopGate | None = None,
) -> GrpcServer:
    """Starts Generation, health and server reflection on `host:port`. Health reports "" and
        the Generation service SERVING while `ready()` holds (checked every `HEALTH_EVERY_S`). With
        `api_key_digest` (`key_digest` of the key, or of each key), `Generate` wants the metadata
        ``authorization: Bearer <key>`` (reflection and health do not). `gate`: the router's, which
    counts the calls in flight and refuses new ones once the application stops."""
    # (a request over grpc's default 4 MiB was RESOURCE_EXHAUSTED, "retry later"; HTTP takes
    # such a body and answers a prompt too long with its 400)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            GenerationServicer(serving, api_key_digest, gate).Generate,
            request_deserializer=_parse_request,
            response_serializer=generation_pb2.GenerateResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(REFLECTED_SERVICES, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC: cannot bind {host}:{port}")
    await server.start()
    running = GrpcServer(server, bound, health_servicer, ready)
    logger.info("gRPC Generation + health + reflection serving on %s:%d", host, bound)
    return running
