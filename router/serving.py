"""The router's core, shared by HTTP and gRPC: validate, tokenize, run through PD, log timings."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.router.errors import APIError, bad_request
from tandem.router.pd_orchestrator import PDOrchestrator, RequestTimings
from tandem.router.request_prep import ModelLimits, sampling_params, tokenize_prompt
from tandem.router.route_planner import RoutePlan, RoutePlanner

logger = logging.getLogger("tandem.router")


@dataclass
class Prepared:
    """A validated request, ready for the cluster."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timings: RequestTimings
    completion_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    plan: RoutePlan | None = None
    priority: int = 0
    num_transferred_blocks: int = 0

    def usage(self) -> dict[str, Any]:
        prompt = len(self.prompt_token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
            "kv_transferred_blocks": self.num_transferred_blocks,
        }


class Serving:
    def __init__(
        self,
        orchestrator: PDOrchestrator,
        planner: RoutePlanner,
        tokenizer: Tokenizer,
        model_name: str,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.orchestrator = orchestrator
        self.planner = planner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self._limits: ModelLimits | None = None
        self.info: dict[str, Any] = {}

    async def limits(self) -> ModelLimits:
        if self._limits is None:
            self.info = await self.orchestrator.limits()
            self._limits = ModelLimits(
                int(self.info["max_model_len"]), int(self.info["vocab_size"])
            )
        return self._limits

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.model_name}`).",
                param="model",
                code="model_not_found",
            )

    async def prepare(
        self,
        request_id: str,
        model: str | None,
        prompt: str | list[int] | list[dict[str, str]],
        max_tokens: int | None,
        fields: dict[str, Any],
        timings: RequestTimings,
        *,
        deadline_ms: float | None = None,
        priority: int | None = None,
        user: str | None = None,
    ) -> Prepared:
        """`prompt` is text, token ids, or chat messages (rendered with the chat template).
        Also routes and admits the request: a 429 here means nothing was started."""
        self.check_model(model)
        limits = await self.limits()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            try:
                token_ids = self.tokenizer.apply_chat_template(prompt)
            except (ValueError, TypeError) as exc:
                raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
        else:
            token_ids = tokenize_prompt(self.tokenizer, prompt, limits.vocab_size)  # type: ignore[arg-type]
        timings.mark("tokenized")
        params = sampling_params(len(token_ids), max_tokens, fields, limits)
        admission = self.planner.admission
        plan = await self.planner.plan(
            token_ids,
            self.info,
            admission.deadline_ms(deadline_ms, user),
            hold_s=self.request_timeout_s,
            max_tokens=params.max_tokens,
        )
        req = Prepared(
            request_id,
            token_ids,
            params,
            timings,
            plan=plan,
            priority=admission.priority(priority, user),
        )
        try:
            await self.orchestrator.reserve(
                plan,
                request_id,
                token_ids,
                params.model_dump(exclude_defaults=True),
                req.priority,
                timings,
            )
        except BaseException:
            plan.release()
            raise
        return req

    async def run(self, req: Prepared) -> AsyncIterator[dict[str, Any]]:
        """Token items from the cluster; updates `req` (usage, finish) and logs one line at the end."""
        outcome = "cancelled"
        try:
            async with asyncio.timeout(self.request_timeout_s):
                assert req.plan is not None
                async for item in self.orchestrator.generate(
                    req.request_id,
                    req.prompt_token_ids,
                    req.params.model_dump(exclude_defaults=True),
                    req.timings,
                    req.plan,
                    req.priority,
                ):
                    req.completion_tokens += len(item["token_ids"])
                    req.token_ids.extend(item["token_ids"])
                    req.text += item["text"]
                    if item.get("finish_reason") is not None:
                        req.finish_reason = item["finish_reason"]
                        req.stop_reason = item.get("stop_reason")
                        req.num_cached_tokens = int(item.get("num_cached_tokens", 0))
                        req.num_transferred_blocks = int(item.get("num_transferred_blocks", 0))
                        outcome = f"finished({req.finish_reason})"
                    yield item
        except TimeoutError:
            outcome = "failed(timeout)"
            raise APIError(
                504, f"request timed out after {self.request_timeout_s}s", type="timeout"
            ) from None
        except APIError as exc:
            outcome = f"failed({exc.code})"
            raise
        finally:
            self._log(req, outcome)

    @staticmethod
    def _log(req: Prepared, outcome: str) -> None:
        stages = " ".join(f"{k}={v:.1f}ms" for k, v in req.timings.stages_ms().items())
        logger.info(
            "request %s %s prompt=%d completion=%d cached=%d transferred_blocks=%d route=%s %s",
            req.request_id,
            outcome,
            len(req.prompt_token_ids),
            req.completion_tokens,
            req.num_cached_tokens,
            req.num_transferred_blocks,
            _route(req.plan),
            stages,
        )


def _route(plan: RoutePlan | None) -> str:
    if plan is None:
        return "-"
    if plan.prefill is None:
        return f"local@{plan.decode.worker_id}(hit={plan.decode_hit_blocks})"
    return (
        f"{plan.prefill.worker_id}(hit={plan.prefill_hit_blocks})"
        f"->{plan.decode.worker_id}(hit={plan.decode_hit_blocks})"
    )
