"""The router's core, shared by HTTP and gRPC: validate, tokenize, run through PD, log timings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

from tandem.engine.metrics import RouterMetrics
from tandem.engine.reasoning_gate import prompt_opens_thoughts
from tandem.engine.tokenizer import Tokenizer
from tandem.router.errors import APIError, WorkerLost, bad_request
from tandem.router.pd_orchestrator import PDOrchestrator
from tandem.router.prepared import Prepared
from tandem.router.reasoning import REASONING_TAGS, ReasoningParser
from tandem.router.request_prep import (
    ModelLimits,
    chat_text_size,
    check_token_ids,
    off_the_loop_if_long,
    prompt_token_ids,
    render_chat,
    sampling_params,
    truncated,
)
from tandem.router.request_record import (
    finished_fields,
    log_left_early,
    log_request,
    routing_decision,
)
from tandem.router.request_timings import RequestTimings
from tandem.router.route_planner import RoutePlanner
from tandem.router.sibling_load import SiblingPlans
from tandem.router.stream_deadlines import StreamDeadlines
from tandem.router.tool_parsers import HermesParser, ToolParser
from tandem.router.worker_failures import LossAllowance

logger = logging.getLogger("tandem.router")


class Serving:
    def __init__(
        self,
        orchestrator: PDOrchestrator,
        planner: RoutePlanner,
        tokenizer: Tokenizer,
        model_name: str | Sequence[str],
        request_timeout_s: float = 600.0,
        metrics: RouterMetrics | None = None,
        slo: dict[str, float | None] | None = None,
        sse_keepalive_s: float | None = None,
        tool_parser: ToolParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        max_tokens_ceiling: int | None = None,
    ) -> None:
        self.sse_keepalive_s = sse_keepalive_s
        """How often a waiting SSE stream writes a comment (None: never; see `openai_stream`)."""
        self.tool_parser = tool_parser or HermesParser()
        """How free replies to chats with tools write their calls (`tool_parsers.py`)."""
        self.reasoning_parser = reasoning_parser
        """Splits a chat reply's thoughts from its answer (`reasoning.py`; None: it does not)."""
        self._tag_ids: tuple[list[int], ...] | None = None  # (the reasoning tags, encoded)
        self.sampling_defaults = dict(sampling_defaults or {})
        """The model's sampling settings (`engine.generation_defaults`), for the fields a request
        leaves out; `max_tokens` among them caps a request that gives none."""
        self.max_tokens_ceiling = max_tokens_ceiling
        """Caps every request's `max_tokens` (another folder's generation config, as vLLM's
        `--generation-config DIR`: `generation_defaults.max_tokens_ceiling`)."""
        names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.model_names = names
        """The names clients may send as `model` (vLLM's `--served-model-name a b`)."""
        self.model_name = names[0]
        """The name replies carry (the first: the canonical one, whichever a request names)."""
        self.metrics = metrics or RouterMetrics(self.model_name, "router")
        slo = slo or {}
        self.slo_ttft_s = _seconds(slo.get("ttft_ms"))
        self.slo_tpot_s = _seconds(slo.get("tpot_ms"))
        self.orchestrator = orchestrator
        self.planner = planner
        self.tokenizer = tokenizer
        self.request_timeout_s = request_timeout_s
        self.deadlines = StreamDeadlines(request_timeout_s)
        self._limits: ModelLimits | None = None
        self.info: dict[str, Any] = {}

    async def limits(self) -> ModelLimits:
        if self._limits is None:
            self.info = await self.orchestrator.limits()
            self._limits = ModelLimits(
                int(self.info["max_model_len"]), int(self.info["vocab_size"])
            )
        return self._limits

    def prompt_text(self, token_ids: list[int]) -> str:
        """The text of a prompt given as token ids (for `echo`)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def reasoning_after(self, prompt_token_ids: Sequence[int]) -> ReasoningParser | None:
        """The reasoning parser for a reply to this prompt: one that starts inside the
        thoughts when the prompt opened them (`prompt_opens_thoughts`)."""
        parser = self.reasoning_parser
        if parser is None or parser.starts_inside:
            return parser
        if self._tag_ids is None:
            encode = self.tokenizer.encode
            self._tag_ids = tuple(encode(tag, add_special_tokens=False) for tag in REASONING_TAGS)
        open_ids, close_ids = self._tag_ids
        if prompt_opens_thoughts(prompt_token_ids, open_ids, close_ids):
            return parser.inside()
        return parser

    def token_text(self, token_id: int) -> str:
        """A token's own text, as logprobs name it (`Tokenizer.token_text`)."""
        return self.tokenizer.token_text(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, as chat's logprobs give them (`bytes`)."""
        return self.tokenizer.token_bytes(token_id)

    def check_model(self, model: str | None) -> None:
        if model and model not in self.model_names:
            served = ", ".join(f"`{name}`" for name in self.model_names)
            raise APIError(
                404,
                f"The model `{model:.200}` does not exist (this server serves {served}).",
                param="model",
                code="model_not_found",
            )

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> list[int]:
        """The token ids of chat `messages` (`request_prep.render_chat`: 400 if it fails)."""
        return render_chat(self.tokenizer, messages, **options)

    async def prepare(
        self,
        request_id: str,
        model: str | None,
        prompt: str | list[int] | list[dict[str, Any]],
        max_tokens: int | None,
        fields: dict[str, Any],
        timings: RequestTimings,
        *,
        deadline_ms: float | None = None,
        priority: int | None = None,
        user: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        truncate_prompt_tokens: int | None = None,
        add_special_tokens: bool = True,
        siblings: SiblingPlans | None = None,
    ) -> Prepared:
        """`prompt` is text, token ids, or chat messages (rendered with the chat template, with
        the chat API's template options). `truncate_prompt_tokens` keeps the prompt's
        last that many tokens (-1: as many as the context holds next to `max_tokens`); a text
        prompt gets the tokenizer's special tokens (BOS) unless not `add_special_tokens`, a
        chat prompt only what its template writes unless `add_special_tokens` (the chat API
        passes its own field, False by default, as vLLM's).
        Also routes and admits the request: a 429 here means nothing was started (without a
        deadline, a decode worker without KV room now makes it wait its turn first; each
        choice of a request, `n` > 1 or a batch of prompts, waits its own turn, as vLLM queues
        each sample: those granted run meanwhile). A client that leaves meanwhile (its task
        cancelled) is logged and counted as an abort."""
        self.metrics.arrived(user, timings.arrival)
        with self._counting_refusals(), self._noting_departure(request_id, timings, user):
            self.check_model(model)
            limits = await self.limits()
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                chat = {"add_generation_prompt": add_generation_prompt, "tools": tools,
                        "continue_final_message": continue_final_message,
                        "template_kwargs": chat_template_kwargs, "documents": documents,
                        "add_special_tokens": add_special_tokens}  # fmt: skip
                size = chat_text_size(prompt)
                token_ids = await off_the_loop_if_long(size, self.render_chat, prompt, **chat)
                if not token_ids:  # (as a text prompt's; the workers would refuse it later)
                    raise bad_request("the chat template rendered an empty prompt", "messages")
                check_token_ids(token_ids, limits.vocab_size, "messages", "prompt token ids")
            else:
                truncating = truncate_prompt_tokens is not None
                text_or_ids: str | list[int] = prompt  # type: ignore[assignment]
                token_ids = await prompt_token_ids(
                    self.tokenizer, text_or_ids, limits, truncating, add_special_tokens
                )
            if truncate_prompt_tokens is not None:
                token_ids = truncated(token_ids, truncate_prompt_tokens, max_tokens, limits)
            timings.mark("tokenized")
            defaults = self.sampling_defaults
            params = sampling_params(
                len(token_ids),
                max_tokens,
                {**defaults, **fields} if defaults else fields,
                limits,
                default_max_tokens=defaults.get("max_tokens"),
                max_tokens_ceiling=self.max_tokens_ceiling,
            )
            if self.reasoning_parser is not None and params.structure is not None:
                # the model thinks first; the structure constrains its answer
                params = params.model_copy(update={"reasoning_tags": REASONING_TAGS})
            admission = self.planner.admission
            req = Prepared(
                request_id,
                token_ids,
                params,
                timings,
                priority=admission.priority(priority, user),
                user=user,
                deadline_ms=admission.deadline_ms(deadline_ms, user),
                siblings=siblings,
            )
            losses = LossAllowance()
            while True:
                try:
                    await self._route(req)
                    break
                except WorkerLost as exc:
                    if not losses.spend(exc):
                        raise
                    self._starting_over(req, exc)
            return req

    @contextlib.contextmanager
    def _noting_departure(
        self, request_id: str, timings: RequestTimings, user: str | None
    ) -> Iterator[None]:
        """A request whose client leaves (its task is cancelled) before it is routed gets one
        log line, and counts as an abort."""
        try:
            yield
        except asyncio.CancelledError:
            log_left_early(request_id, timings)
            self._finished(finished_fields(None, timings, user))
            raise

    async def _route(self, req: Prepared) -> None:
        """Plans the request's workers and opens its calls (decode's reservation first)."""
        prompt, params = req.attempt_prompt(), req.attempt_params()
        plan = await self.planner.plan(
            prompt,
            self.info,
            req.deadline_ms,
            hold_s=self.request_timeout_s,
            max_tokens=params.max_tokens or 0,
            cache_salt=params.cache_salt,
            siblings=req.siblings,
        )
        self.metrics.decision(self.planner.policy_name, routing_decision(plan))
        req.plan = plan
        try:
            await self.orchestrator.reserve(
                plan,
                req.worker_request_id,
                prompt,
                params.model_dump(exclude_defaults=True),
                req.priority,
                req.timings,
            )
        except BaseException:
            plan.release()
            raise
        if plan.grant is not None:  # known before the first token (usage while streaming)
            hits = int(plan.grant.get("num_hit_blocks", 0)) * int(self.info["block_size"])
            req.num_cached_tokens = min(hits, len(req.prompt_token_ids))
            req.num_transferred_blocks = len(plan.grant.get("dst_block_ids", ()))

    def _starting_over(self, req: Prepared, exc: WorkerLost) -> None:
        req.start_over(self.tokenizer)
        self.metrics.retried(exc.worker_id, resumed=req.resumed_tokens > 0)
        how = (
            f"continuing after {req.resumed_tokens} tokens"
            if req.resumed_tokens
            else "starting over"
        )
        logger.warning(
            "request %s: %s is gone (%s); %s on the workers still alive",
            req.request_id,
            exc.worker_id,
            exc.message,
            how,
        )

    async def abandon(self, req: Prepared, refused: APIError | None = None) -> None:
        """A prepared request that will never `run` (a streaming client left before its first
        byte; `refused`: another choice of its request was, and the request with it): its
        calls on the workers are closed now, not by the garbage collector."""
        if req.plan is not None and not req.started:
            req.started = True  # once
            try:
                await self.orchestrator.abandon(req.plan, req.worker_request_id)
            finally:
                if refused is None:
                    log_request(req, "cancelled(client left before the first byte)")
                    self._record(req)
                else:  # (counted as its request was: a rejection or a failure, not an abort)
                    log_request(req, f"failed({refused.code or refused.type}, another choice)")
                    refused.tally(self.metrics)

    @contextlib.contextmanager
    def _counting_refusals(self) -> Iterator[None]:
        """A 429 counts as an admission rejection, any other API error as a failure."""
        try:
            yield
        except APIError as exc:
            exc.count(self.metrics)
            raise

    async def run(self, req: Prepared) -> AsyncGenerator[dict[str, Any], None]:
        """Token items from the cluster; updates `req` (usage, finish) and logs one line at the end."""
        req.started = True
        outcome = "cancelled"
        last_item: float | None = None
        last_tokens: float | None = None  # when the last item that carried tokens came
        deadline: asyncio.Timeout | None = None
        try:
            async with self.deadlines.running() as deadline:
                losses = LossAllowance()
                while True:
                    try:
                        async with contextlib.aclosing(self._generate(req)) as items:
                            async for item in items:
                                now = time.time()
                                if tokens := len(item.get("token_ids") or ()):
                                    if last_tokens is not None:
                                        self.metrics.token_gap(now - last_tokens, tokens)
                                    elif tokens > 1:  # (tokens that came with the first)
                                        self.metrics.token_gap(0.0, tokens - 1)
                                    last_tokens = now
                                last_item = now
                                outcome = req.take(item) or outcome
                                yield item
                                if req.stopped_here:  # (closing the stream cancels it)
                                    break
                        break
                    except WorkerLost as exc:
                        # Start over, or go on from the tokens sent, without that worker.
                        if not losses.spend(exc):
                            raise
                        if not (last_item is None or req.resumable):
                            if not req.buffered:
                                exc.message += (
                                    "; a structured output cannot go on on another worker "
                                    "(its grammar's state was lost with it): send it again"
                                )
                                raise
                            req.forget_output()  # (nothing was sent: it starts again)
                        self._starting_over(req, exc)
                        await self._route(req)
        except TimeoutError:
            assert deadline is not None
            timed_out = self.deadlines.timed_out(deadline)  # (a 504, or the router's stop)
            outcome = f"failed({timed_out.code or timed_out.type})"
            timed_out.count(self.metrics)
            raise timed_out from None
        except APIError as exc:
            outcome = f"failed({exc.code})"
            if not exc.counted:
                self.metrics.failed(exc.code or exc.type)
                exc.counted = True
            raise
        finally:
            log_request(req, outcome)
            if not outcome.startswith("failed"):
                self._record(req)

    def _generate(self, req: Prepared) -> AsyncGenerator[dict[str, Any], None]:
        assert req.plan is not None
        return self.orchestrator.generate(
            req.worker_request_id,
            req.attempt_prompt(),
            req.attempt_params().model_dump(exclude_defaults=True),
            req.timings,
            req.plan,
            req.priority,
        )

    def _record(self, req: Prepared) -> None:
        """Metrics of a request that finished, or that the client abandoned ("abort")."""
        self._finished(finished_fields(req, req.timings, req.user))

    def _finished(self, fields: dict[str, Any]) -> None:
        self.metrics.finished(**fields, slo_ttft_s=self.slo_ttft_s, slo_tpot_s=self.slo_tpot_s)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else float(ms) / 1000


async def run_to_end(serving: Serving, req: Prepared) -> None:
    """`serving.run(req)` for a caller that answers once the request ended (not streamed):
    `req` takes the tokens, and it may start again from none after a lost worker."""
    req.buffered = True
    async with contextlib.aclosing(serving.run(req)) as items:
        async for _ in items:
            pass
