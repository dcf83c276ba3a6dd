"""Completion request fields through `router/openai_api.py`, as vLLM's server reads them: `echo`
(the prompt the model saw comes back before the output, also when `truncate_prompt_tokens` cut
it), `stream_options` (usage on every chunk only with `include_usage` too) and
`add_special_tokens` (False: a text prompt gets no BOS)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.router import openai_api
from tandem.router.errors import APIError
from tandem.router.openai_protocol import CompletionRequest
from tandem.router.prepared import Prepared
from tandem.router.request_prep import ModelLimits, prompt_token_ids
from tandem.router.request_timings import RequestTimings

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class LetterServing:
    """Token i is the letter LETTERS[i]; a prompt is cut to its last `truncate_prompt_tokens`;
    every request generates token 25 ("z")."""

    model_name = "tiny"
    sse_keepalive_s = None
    reasoning_parser = None
    tool_parser = None

    async def prepare(
        self,
        request_id: str,
        model: Any,
        prompt: Any,
        max_tokens: Any,
        fields: dict[str, Any],
        timings: RequestTimings,
        **kw: Any,
    ) -> Prepared:
        self.special = kw.get("add_special_tokens")
        ids = [LETTERS.index(c) for c in prompt] if isinstance(prompt, str) else list(prompt)
        if (keep := kw.get("truncate_prompt_tokens")) is not None:
            ids = ids[-keep:]
        params = SamplingParams(max_tokens=max_tokens, **fields)
        return Prepared(request_id, ids, params, timings)

    async def run(self, req: Prepared) -> AsyncGenerator[dict[str, Any], None]:
        req.started, req.token_ids, req.text = True, [25], "z"
        req.completion_tokens, req.finish_reason = 1, "length"
        req.logprobs = [[-0.5, [[25, -0.5]]]] if req.params.logprobs is not None else None
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] + [(-1.0, [], 1)] * (len(req.prompt_token_ids) - 1)
        yield {"token_ids": [25], "text": "z", "finish_reason": "length"}

    async def abandon(self, req: Prepared, refused: Any = None) -> None:
        pass  # (every request here runs to its end)

    def prompt_text(self, token_ids: list[int]) -> str:
        return "".join(LETTERS[t] for t in token_ids)

    def token_text(self, token_id: int) -> str:
        return LETTERS[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        return LETTERS[token_id].encode()


def _complete(serving: LetterServing | None = None, **fields: Any) -> dict[str, Any]:
    body = CompletionRequest.model_validate({"max_tokens": 1, "echo": True, **fields})
    response = asyncio.run(openai_api.create_completion(serving or LetterServing(), body))  # type: ignore[arg-type]
    return json.loads(response.body)["choices"][0]


def _stream(**fields: Any) -> list[dict[str, Any]]:
    body = CompletionRequest.model_validate({"max_tokens": 1, "stream": True, **fields})

    async def main() -> list[str]:
        response = await openai_api.create_completion(LetterServing(), body)  # type: ignore[arg-type]
        return [e if isinstance(e, str) else e.decode() async for e in response.body_iterator]

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_echo_is_the_prompt_the_model_saw() -> None:
    assert _complete(prompt="abcde")["text"] == "abcdez"
    assert _complete(prompt=[0, 1, 2, 3, 4])["text"] == "abcdez"
    # cut to its last 3 tokens, as vLLM echoes a token prompt (the text was the whole prompt)
    assert _complete(prompt=[0, 1, 2, 3, 4], truncate_prompt_tokens=3)["text"] == "cdez"
    choice = _complete(prompt="abcde", truncate_prompt_tokens=3, logprobs=0)
    assert choice["text"] == "cdez"
    assert choice["logprobs"]["tokens"] == ["c", "d", "e", "z"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3]  # (offsets into `text`)


def test_continuous_usage_stats_need_include_usage() -> None:
    """vLLM puts the usage on every chunk only when `include_usage` asks for usage at all; as
    vLLM's, `stream_options` given without it (or with it null) asks for it."""
    off = {"continuous_usage_stats": True, "include_usage": False}
    for options in (off, {"continuous_usage_stats": True, "include_usage": None}):
        chunks = _stream(prompt="ab", stream_options=options)
        assert [("usage" in d, d["choices"][0]["text"]) for d in chunks] == [(False, "z")]
    chunks = _stream(prompt="ab", stream_options={})
    assert [("usage" in d, len(d["choices"])) for d in chunks] == [(False, 1), (True, 0)]
    both = {"continuous_usage_stats": True, "include_usage": True}
    chunks = _stream(prompt="ab", stream_options=both)
    assert [d["usage"]["completion_tokens"] for d in chunks] == [1, 1]
    assert chunks[-1]["choices"] == []


class _BosTokenizer:
    """Letters as token ids 1.., and BOS (0) first when special tokens are added."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * add_special_tokens + [LETTERS.index(c) + 1 for c in text]


def test_add_special_tokens_false_tokenizes_a_text_prompt_without_bos() -> None:
    """vLLM's completions field (default true): false for a prompt that has its BOS already,
    e.g. a chat template applied by the client (it was ignored: BOS twice)."""
    serving = LetterServing()
    _complete(serving, prompt="ab")
    assert serving.special is True
    _complete(serving, prompt="ab", add_special_tokens=False)
    assert serving.special is False
    limits = ModelLimits(2048, 512)
    tokenizer: Any = _BosTokenizer()
    with_bos = asyncio.run(prompt_token_ids(tokenizer, "ab", limits, False))
    without = asyncio.run(prompt_token_ids(tokenizer, "ab", limits, False, False))
    assert (with_bos, without) == ([0, 1, 2], [1, 2])
    long_text = "a" * 5000  # (tokenized off the event loop)
    assert asyncio.run(prompt_token_ids(tokenizer, long_text, limits, True, False)) == [1] * 5000


class RefusingServing(LetterServing):
    """Admission refuses every request, 30 ms after it arrives."""

    async def prepare(self, *args: Any, **kw: Any) -> Prepared:
        await asyncio.sleep(0.03)
        raise APIError(429, "no room", code="queue_full", headers={"Retry-After": "2"})


def test_a_refusal_carries_the_time_from_arrival_to_it() -> None:
    body = CompletionRequest.model_validate({"max_tokens": 1, "prompt": "ab"})
    with pytest.raises(APIError) as refused:
        asyncio.run(openai_api.create_completion(RefusingServing(), body))  # type: ignore[arg-type]
    headers = refused.value.headers or {}
    assert (refused.value.status, headers["Retry-After"]) == (429, "2")
    assert set(json.loads(headers["x-tandem-timings"])) == {"e2e"}
    assert 30.0 <= json.loads(headers["x-tandem-timings"])["e2e"] < 30_000.0


def test_prompt_logprobs_alone_give_no_choice_logprobs() -> None:
    """vLLM fills a choice's `logprobs` only when `logprobs` asks for them: `echo` with
    `prompt_logprobs` alone gave one covering the prompt only (the output's were missing)."""
    choice = _complete(prompt="abc", prompt_logprobs=0)
    assert choice["text"] == "abcz" and choice["logprobs"] is None
    assert [e and next(iter(e.values()))["logprob"] for e in choice["prompt_logprobs"]] == [
        None, -1.0, -1.0,
    ]  # fmt: skip
    both = _complete(prompt="abc", prompt_logprobs=0, logprobs=0)["logprobs"]
    assert both["tokens"] == ["a", "b", "c", "z"]


def test_continuous_usage_counts_each_chunks_own_choice() -> None:
    """vLLM's `continuous_usage_stats`: a chunk's usage is its own choice's (its prompt, its
    tokens so far), not the sum over every choice sent so far."""
    both = {"continuous_usage_stats": True, "include_usage": True}
    chunks = _stream(prompt=["ab", "abcd"], n=2, stream_options=both)
    per_choice = [
        (d["choices"][0]["index"], d["usage"]["prompt_tokens"], d["usage"]["completion_tokens"])
        for d in chunks[:-1]
    ]
    assert sorted(per_choice) == [(0, 2, 1), (1, 2, 1), (2, 4, 1), (3, 4, 1)]
    assert chunks[-1]["usage"]["prompt_tokens"] == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(d["choices"][0]["stop_reason"] is None for d in chunks[:-1])  # (finished: None)


def test_echo_with_logprobs_fills_the_prompt_logprobs_field_too() -> None:
    """vLLM's `prompt_logprobs` is `logprobs` for an echo request that does not set it: its
    reply carries `choices[i].prompt_logprobs` next to the echoed tokens' logprobs."""
    choice = _complete(prompt="abc", logprobs=0)
    assert choice["logprobs"]["tokens"] == ["a", "b", "c", "z"]
    assert [e and next(iter(e.values()))["logprob"] for e in choice["prompt_logprobs"]] == [
        None, -1.0, -1.0,
    ]  # fmt: skip
    assert "prompt_logprobs" not in _complete(prompt="abc", echo=False, logprobs=0)
    assert "prompt_logprobs" not in _complete(prompt="abc")  # (echo alone: no logprobs)
