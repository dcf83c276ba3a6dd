"""One request's state: tokens, progress, KV blocks and its lifecycle (DESIGN §2).

Status lives here, on the request, and every transition is timestamped so that per-stage
latencies can be derived from `timestamps` alone.
"""

from __future__ import annotations

import time
from enum import IntEnum
from typing import Any

import torch

from tandem.engine.output_text import OutputText
from tandem.engine.outputs import PromptLogprob, TokenLogprob
from tandem.engine.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    """Ordered: everything after DECODING is terminal except the tool-call pair."""

    NEW = 0
    QUEUED = 1
    PREFIX_LOOKUP = 2
    PREFILLING = 3
    TRANSFERRING = 4
    READY_TO_DECODE = 5
    DECODING = 6
    TOOL_WAIT = 7
    RESUMED = 8
    FINISHED = 9
    CANCELLED = 10
    EVICTED = 11
    FAILED = 12

    @property
    def is_terminal(self) -> bool:
        return self >= RequestStatus.FINISHED


def request_stop_ids(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The tokens that end a request: its `stop_token_ids`, and the model's end tokens unless
    it ignores them."""
    stop_ids = frozenset(params.stop_token_ids or ())
    return stop_ids if params.ignore_eos else stop_ids | eos_token_ids


class Request:
    """Mutable per-request state shared by scheduler, runner and output processing.

    `num_computed_tokens` catches up with `num_tokens` under the scheduler's token budget: prefix
    hits advance it for free, prefill chunks by a chunk, decode by one token.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "token_ids",
        "params",
        "stop_ids",
        "min_tokens_ids",
        "status",
        "timestamps",
        "num_computed_tokens",
        "block_table",
        "block_hashes",
        "num_cached_blocks",
        "num_prefix_hit_tokens",
        "num_preemptions",
        "finish_reason",
        "stop_reason",
        "generator",
        "output_text",
        "keep_kv",
        "error",
        "priority",
        "logprobs",
        "logprob_ranks",
        "sampling_extras",
        "prompt_logprobs",
        "matcher",
        "bad_words_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        *,
        arrival_time: float | None = None,
        output_text: OutputText | None = None,
        keep_kv: bool = False,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.stop_ids = request_stop_ids(params, eos_token_ids)
        # (what `min_tokens` keeps out: EOS too with ignore_eos, as vLLM's min-tokens does)
        self.min_tokens_ids = self.stop_ids | eos_token_ids
        self.status = RequestStatus.NEW
        self.timestamps: dict[RequestStatus, float] = {
            RequestStatus.NEW: arrival_time if arrival_time is not None else time.monotonic()
        }
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.output_text = output_text
        self.keep_kv = keep_kv
        self.error: str | None = None
        self.priority = priority
        """Lower runs earlier among waiting requests (vLLM's convention); ties keep arrival order."""
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        """One entry per output token when `params.logprobs` asks (`outputs.TokenLogprob`)."""
        self.logprob_ranks: list[int] = []
        """The vocabulary rank of each token whose entry this engine computed: the last
        `len(logprob_ranks)` of `logprobs` (a request imported from a prefill engine has its
        first token's entry without one)."""
        self.prompt_logprobs: list[PromptLogprob | None] | None = None
        """Per prompt token when `params.prompt_logprobs` asks: None for the first (and for
        those not computed yet), else its `TokenLogprob` given the tokens before it."""
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt_token_ids)
        self.matcher: Any = None
        """The grammar matcher of a request with structured output (`guided.py`)."""
        self.bad_words_ids: list[list[int]] | None = None
        """`params.bad_words` as token sequences (`LLMEngine.attach_constraints`)."""
        self.sampling_extras = params.logprobs is not None or params.adjusts_logits
        """Logprobs, penalties or a logit bias: the sampler looks at this request's row (one
        flag, so that a batch without any costs one attribute read a request)."""

    def set_status(self, status: RequestStatus, now: float | None = None) -> None:
        self.status = status
        self.timestamps[status] = time.monotonic() if now is None else now

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def sampled_token_ids(self) -> list[int]:
        """What the sampler counts as this request's output: its output tokens, after the last
        `params.resumed_tokens` tokens of its prompt (a lost attempt's output)."""
        return self.token_ids[self._sampled_from :]

    @property
    def num_sampled_tokens(self) -> int:
        """`len(sampled_token_ids)`, without the copy."""
        return len(self.token_ids) - self._sampled_from

    @property
    def _sampled_from(self) -> int:
        return max(0, len(self.prompt_token_ids) - self.params.resumed_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not all computed yet (its prompt must be computed whole)."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) > 1 and any(lp is None for lp in lps[1:])

    @property
    def is_finished(self) -> bool:
        return self.status.is_terminal

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={self.block_table})"
        )
