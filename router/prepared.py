"""A request the router has validated, and its state across attempts: the tokens and text it
sent its caller, and, after a worker was lost mid-stream, what the next attempt prefills and
generates, with the text after the seam detokenized here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.output_text import OutputText
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.router.request_timings import RequestTimings
from tandem.router.route_planner import RoutePlan
from tandem.router.sibling_load import SiblingPlans


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
    siblings: SiblingPlans | None = None  # the plans of its request's other choices
    priority: int = 0
    num_transferred_blocks: int = 0
    user: str | None = None
    started: bool = False  # `Serving.run` began (it releases the request from then on)
    deadline_ms: float | None = None  # admission's deadline (planning again keeps it)
    attempt: int = 0  # times it started over after losing a worker
    resumed_tokens: int = 0  # generated tokens the current attempt takes as part of its prompt
    resumed_text: OutputText | None = None  # the text of a resumed request, detokenized here
    stopped_here: bool = False  # the router found a stop string the new attempt's worker missed
    logprobs: list[Any] | None = None  # per token of `token_ids` when asked (`TokenLogprob`s)
    echo: str | None = None  # the prompt's text, for a completion that echoes it
    prompt_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) alone;
    # one token is generated to run the request through the workers, and dropped here
    prompt_logprobs: list[Any] | None = None  # per prompt token (the first None), when asked
    buffered: bool = False  # its caller gets the answer at the end (not streamed): after a lost
    # worker, an attempt that cannot go on from the tokens so far may start again from none

    @property
    def resumable(self) -> bool:
        """Whether a new attempt from the tokens streamed so far gives what the lost one would
        have: it does unless the output follows a structure (the grammar's state died with
        the worker). The new attempt's worker counts the tokens streamed as output
        (`SamplingParams.resumed_tokens`): a seeded sampler draws as the lost one would have
        (each draw's seed is the request's and the token's place), and the presence and
        frequency penalties and `bad_words` see them."""
        return self.params.structure is None

    def attempt_prompt(self) -> list[int]:
        """What the current attempt prefills: the prompt, and the tokens streamed before its
        decode worker was lost."""
        return self.prompt_token_ids + self.token_ids[: self.resumed_tokens]

    def attempt_params(self) -> SamplingParams:
        """The sampling parameters of the current attempt (what is left to generate)."""
        done = self.resumed_tokens
        if not done:
            return self.params
        limit = self.params.max_tokens
        assert limit is not None, "the router always sets max_tokens"
        update = {
            "max_tokens": limit - done,
            "min_tokens": max(0, self.params.min_tokens - done),
            "resumed_tokens": done,
        }
        return self.params.model_copy(update=update)

    @property
    def worker_request_id(self) -> str:
        """The id its workers know it by: a new one when it starts over, so that no worker
        mistakes it for the calls of the attempt before (still being cancelled)."""
        return self.request_id if self.attempt == 0 else f"{self.request_id}~{self.attempt}"

    def usage(self) -> dict[str, Any]:
        prompt = len(self.prompt_token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
            "kv_transferred_blocks": self.num_transferred_blocks,
        }

    def forget_output(self) -> None:
        """Drops what the attempts so far generated (none of it reached the caller: `buffered`),
        so the next attempt starts from the prompt alone."""
        self.completion_tokens, self.token_ids, self.text = 0, [], ""
        self.logprobs = None
        self.finish_reason = self.stop_reason = None
        self.resumed_tokens, self.resumed_text = 0, None

    def start_over(self, tokenizer: Tokenizer) -> None:
        """A new attempt after a lost worker, from the tokens sent so far (none: from the
        start). The new attempt's worker detokenizes after a prompt that ends with tokens whose
        text the lost worker may have held back (part of a UTF-8 character, or what could start
        a stop string), and it searches stop strings in its own text only: the text goes on
        here, from the request's own prompt, and stops are found here (`retext`)."""
        self.attempt += 1
        self.resumed_tokens = len(self.token_ids)
        if self.resumed_tokens:
            text = OutputText.after(
                tokenizer, self.prompt_token_ids, self.token_ids, params=self.params
            )
            text.emitted_len = len(self.text)  # what the caller has
            text.checked_len = len(text.text)  # (the lost worker found no stop in it)
            self.resumed_text = text

    def take(self, item: dict[str, Any]) -> str | None:
        """Adds a token item of the cluster's to this request; the outcome to log when it is the
        last one. A resumed request's item gets the text detokenized here, and ends at a stop
        string found here."""
        if self.resumed_text is not None:
            self.retext(item)
        if self.prompt_only:  # (what was generated is not part of the answer)
            item = {**item, "token_ids": [], "text": "", "logprobs": None}
            if item.get("finish_reason") is not None:
                item["finish_reason"], item["stop_reason"] = "length", None
        self.completion_tokens += len(item["token_ids"])
        self.token_ids.extend(item["token_ids"])
        if self.params.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(item.get("logprobs") or ())
        if item.get("prompt_logprobs") is not None and self.prompt_logprobs is None:
            # (a resumed attempt's prompt holds tokens generated before: the request's own)
            self.prompt_logprobs = item["prompt_logprobs"][: len(self.prompt_token_ids)]
        self.text += item["text"]
        if "num_cached_tokens" in item:  # (decode's first item has them, and its last)
            # (of the last attempt's prompt: at most the request's own when it went on)
            self.num_cached_tokens = min(int(item["num_cached_tokens"]), len(self.prompt_token_ids))
            self.num_transferred_blocks = int(item.get("num_transferred_blocks", 0))
        if item.get("finish_reason") is None:
            return None
        self.finish_reason = item["finish_reason"]
        self.stop_reason = item.get("stop_reason")
        return f"finished({self.finish_reason})"

    def retext(self, item: dict[str, Any]) -> None:
        """Replaces the text of a resumed request's `item` with the text of its tokens after
        the request's own prompt and output so far; cuts the item at a stop string (the output
        processor's rules: not before `min_tokens`, the text cut just before it)."""
        text = self.resumed_text
        assert text is not None
        params, tokens = self.params, item["token_ids"]
        keep = params.include_stop_str_in_output
        for n, token in enumerate(tokens, start=1):
            text.add(token)
            counting = len(self.token_ids) + n > params.min_tokens
            stop = (
                text.find_stop(params.stop, counting=counting, keep=keep) if params.stop else None
            )
            if stop is not None:
                item.update(token_ids=tokens[:n], finish_reason="stop", stop_reason=stop)
                if item.get("logprobs") is not None:
                    item["logprobs"] = item["logprobs"][:n]
                self.stopped_here = True
                break
        finished = item.get("finish_reason") is not None
        cut = isinstance(item.get("stop_reason"), str)
        item["text"] = text.delta(params.stop, finished=finished, cut=cut, keep=keep)
