"""Logprobs in OpenAI's completions and chat shapes (`router/openai_logprobs.py`), and in
streamed chunks, whose completions offsets go on from chunk to chunk."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.router import openai_stream
from tandem.router.openai_format import ResponseHead
from tandem.router.openai_logprobs import chat_logprobs, completion_logprobs
from tandem.router.prepared import Prepared
from tandem.router.request_timings import RequestTimings

NAMES = {1: "a", 2: "bc", 3: "é", 4: "<s>"}


def text(token_id: int) -> str:
    return NAMES[token_id]


ENTRIES = [(-0.5, [(2, -0.3), (1, -0.5)]), (-1.25, [(3, -0.75)])]


def test_completion_shape_adds_the_sampled_token_to_its_alternatives() -> None:
    got = completion_logprobs([1, 4], ENTRIES, text, text_offset=10)
    assert got == {
        "tokens": ["a", "<s>"],
        "token_logprobs": [-0.5, -1.25],
        "top_logprobs": [{"bc": -0.3, "a": -0.5}, {"é": -0.75, "<s>": -1.25}],
        "text_offset": [10, 11],
    }
    # the sampled token first, then the alternatives (vLLM's order)
    assert [list(top) for top in got["top_logprobs"]] == [["a", "bc"], ["<s>", "é"]]


def test_chat_shape_names_tokens_with_their_utf8_bytes() -> None:
    got = chat_logprobs([3], [(-0.1, [(3, -0.1), (4, -2.0)])], text)
    assert got == {
        "content": [
            {
                "token": "é",
                "logprob": -0.1,
                "bytes": [195, 169],
                "top_logprobs": [
                    {"token": "é", "logprob": -0.1, "bytes": [195, 169]},
                    {"token": "<s>", "logprob": -2.0, "bytes": [60, 115, 62]},
                ],
            }
        ]
    }


class FakeServing:
    model_name = "tiny"
    sse_keepalive_s = None

    async def run(self, req: Prepared) -> AsyncGenerator[dict[str, Any], None]:
        yield {"token_ids": [2], "text": "bc", "logprobs": [[-0.3, [[2, -0.3]]]]}
        yield {"token_ids": [3], "text": "", "logprobs": [[-0.7, [[1, -0.2]]]]}  # text held back
        yield {
            "token_ids": [1],
            "text": "éa",
            "logprobs": [[-0.9, [[1, -0.9]]]],
            "finish_reason": "length",
        }


def test_a_stream_carries_each_token_s_logprobs_once_with_running_offsets() -> None:
    plan = SimpleNamespace(prefill=None, decode=SimpleNamespace(worker_id="decode/x"))
    params = SamplingParams(max_tokens=3, logprobs=1)
    req = Prepared("cmpl-1", [1], params, RequestTimings(), plan=plan)  # type: ignore[arg-type]
    head = ResponseHead.of(req, "tiny", "completion", token_text=text)

    async def main() -> list[str]:
        gen = openai_stream.sse(FakeServing(), req, "completion", False, head)  # type: ignore[arg-type]
        return [e async for e in gen]

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]\n\n"
    choices = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-1]]
    assert [c["text"] for c in choices] == ["bc", "", "éa"]  # a chunk for the held-back token
    assert [c["logprobs"]["tokens"] for c in choices] == [["bc"], ["é"], ["a"]]
    assert [c["logprobs"]["text_offset"] for c in choices] == [[0], [2], [3]]
    assert [c["logprobs"]["token_logprobs"] for c in choices] == [[-0.3], [-0.7], [-0.9]]


def test_an_echoed_prompt_has_as_many_alternatives_as_the_output() -> None:
    """echo + logprobs=1 with prompt_logprobs=2: the echoed tokens carry one alternative each
    (the prompt's entries were computed with two, for the `prompt_logprobs` field), and vLLM's
    `prompt_logprobs` field holds as many alternatives as it asked for."""
    from tandem.router.openai_format import full_body

    plan = SimpleNamespace(prefill=None, decode=SimpleNamespace(worker_id="decode/x"))
    params = SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=2)
    req = Prepared("cmpl-1", [1, 2], params, RequestTimings(), plan=plan)  # type: ignore[arg-type]
    req.echo, req.text, req.token_ids, req.finish_reason = "abc", "é", [3], "length"
    req.prompt_logprobs = [None, (-0.4, [(3, -0.2), (1, -0.3)], 3)]
    req.logprobs = [(-0.7, [(3, -0.7)])]
    head = ResponseHead.of(req, "tiny", "completion", token_text=text, prompt_logprobs=2)
    choice = full_body(head, [req], req.usage())["choices"][0]
    assert choice["logprobs"]["tokens"] == ["a", "bc", "é"]
    assert choice["logprobs"]["top_logprobs"] == [None, {"é": -0.2, "bc": -0.4}, {"é": -0.7}]
    ranked = {"2": {"logprob": -0.4, "rank": 3, "decoded_token": "bc"},
              "3": {"logprob": -0.2, "rank": 1, "decoded_token": "é"},
              "1": {"logprob": -0.3, "rank": 2, "decoded_token": "a"}}  # fmt: skip
    assert choice["prompt_logprobs"] == [None, ranked]
    # vLLM's field holds what it asked for: one alternative, or none asked (echo only)
    head = ResponseHead.of(req, "tiny", "completion", token_text=text, prompt_logprobs=1)
    field = full_body(head, [req], req.usage())["choices"][0]["prompt_logprobs"]
    assert field == [None, {k: ranked[k] for k in ("2", "3")}]
    head = ResponseHead.of(req, "tiny", "completion", token_text=text)
    assert "prompt_logprobs" not in full_body(head, [req], req.usage())["choices"][0]
