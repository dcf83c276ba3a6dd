"""Reasoning parsers (`router/reasoning.py`, `router/reply_stream.py`): a reply's thoughts apart
from its answer, whole or streamed in pieces of any size, and before its tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.router.reasoning import ReasoningParser, ReasoningStream
from tandem.router.reply_stream import ReplyStream
from tandem.router.tool_parsers import HermesParser

CASES = [
    # (parser, reply, reasoning, content)
    ("qwen3", "<think>\nsum it\n</think>\n\n42", "\nsum it\n", "\n\n42"),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "no thoughts here", None, "no thoughts here"),
    ("qwen3", "<think>cut short", "cut short", None),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "a <think> in the middle", None, "a <think> in the middle"),
    ("deepseek_r1", "thoughts</think>answer", "thoughts", "answer"),
    ("deepseek_r1", "<think>thoughts</think>answer", "thoughts", "answer"),
    ("deepseek_r1", "only thoughts", "only thoughts", None),
    ("deepseek_r1", "</think>answer", None, "answer"),
]


@pytest.mark.parametrize(("name", "reply", "reasoning", "content"), CASES)
def test_a_reply_splits_into_thoughts_and_answer(
    name: str, reply: str, reasoning: str | None, content: str | None
) -> None:
    assert ReasoningParser(name).split(reply) == (reasoning, content)  # type: ignore[arg-type]


@pytest.mark.parametrize("piece", [1, 2, 5])
@pytest.mark.parametrize(("name", "reply", "reasoning", "content"), CASES)
def test_streamed_pieces_add_up_to_the_split(
    name: str, reply: str, reasoning: str | None, content: str | None, piece: int
) -> None:
    stream = ReasoningStream(ReasoningParser(name))  # type: ignore[arg-type]
    parts = [stream.feed(reply[i : i + piece]) for i in range(0, len(reply), piece)]
    parts.append(stream.finish())
    assert "".join(r for r, _ in parts) == (reasoning or "")
    assert "".join(c for _, c in parts) == (content or "")
    if name == "qwen3" and reply.startswith("<think>\nsum") and piece == 1:
        assert sum(1 for r, _ in parts if r) > 3  # thoughts went out as they came


def test_thoughts_then_a_tool_call() -> None:
    call = '<tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>'
    reply = f"<think>use f</think>Calling. {call}"
    stream = ReplyStream(ReasoningParser("qwen3"), HermesParser())
    parts = [stream.feed(ch, False) for ch in reply]
    last = stream.feed("", True)
    assert "".join(p[0] for p in parts) + last[0] == "use f"
    assert "".join(p[1] for p in parts) + last[1] == "Calling. "
    deltas = [d for p in [*parts, last] for d in p[2]]
    assert deltas[0]["function"] == {"name": "f", "arguments": ""}  # (streamed as written)
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"x": 2}
    assert {d["index"] for d in deltas} == {0} and stream.has_calls


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("granite")  # type: ignore[arg-type]


def test_a_reply_under_structured_output_is_split_like_any_other() -> None:
    """The engine lets the model think before the structure constrains its answer
    (`SamplingParams.reasoning_tags`), so deepseek_r1's parser reads such a reply as it reads
    any: inside the thoughts until `</think>`."""
    from tandem.engine.sampling_params import SamplingParams
    from tandem.router.openai_format import ResponseHead, full_body
    from tandem.router.prepared import Prepared
    from tandem.router.request_timings import RequestTimings

    parser = ReasoningParser("deepseek_r1")
    bodies = []
    cases = [
        ({}, '{"a": 1}'),
        ({"regex": ".*"}, '{"a": 1}'),
        ({"regex": ".*"}, 'x</think>{"a": 1}'),
    ]
    for fields, text in cases:
        req = Prepared("r", [1, 2], SamplingParams(**fields), RequestTimings(0.0))
        req.text = text
        head = ResponseHead.of(req, "m", "chat", reasoning=parser)
        message = full_body(head, [req], {})["choices"][0]["message"]
        bodies.append({k: message[k] for k in ("role", "reasoning_content", "content")})
    assert bodies[0] == {"role": "assistant", "reasoning_content": '{"a": 1}', "content": None}
    assert bodies[1] == bodies[0]
    assert bodies[2] == {"role": "assistant", "reasoning_content": "x", "content": '{"a": 1}'}


def test_a_prompt_that_opens_the_thoughts_starts_the_reply_inside_them(
    tiny_checkpoint: Any,
) -> None:
    """Qwen3's thinking-only checkpoints end the generation prompt in `<think>`: the reply is
    `thoughts</think>answer`, split as such (the engine's `ReasoningGate` reads the prompt so
    too); a prompt that closed them, or never opened them, leaves the parser as it is."""
    from tandem.engine.tokenizer import Tokenizer
    from tandem.router.serving import Serving

    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint())
    qwen3 = ReasoningParser("qwen3")
    serving = Serving(None, None, tokenizer, "tiny", reasoning_parser=qwen3)  # type: ignore[arg-type]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    reply = "The user asks for 6*7.\n</think>\n\n42"
    opened = serving.reasoning_after(encode("<|im_start|>assistant\n<think>\n"))
    assert opened is not None and opened.split(reply) == ("The user asks for 6*7.\n", "\n\n42")
    streamed = ReplyStream(opened, None)
    pieces = [streamed.feed(reply[i : i + 3], False) for i in range(0, len(reply), 3)]
    last = streamed.feed("", True)
    assert "".join(p[0] for p in [*pieces, last]) == "The user asks for 6*7.\n"
    assert "".join(p[1] for p in [*pieces, last]) == "\n\n42"
    closed = encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert serving.reasoning_after(closed) is qwen3
    assert serving.reasoning_after(encode("<|im_start|>assistant\n")) is qwen3
    assert qwen3.split(reply) == (None, reply)  # (the shared parser is untouched)


@pytest.mark.parametrize("include", [True, False])
def test_include_reasoning_false_leaves_the_thoughts_out(include: bool) -> None:
    """vLLM's `include_reasoning`: False gives no `reasoning_content` (whole or streamed), and
    the thoughts are not content either; it was ignored."""
    import asyncio
    from collections.abc import AsyncGenerator
    from types import SimpleNamespace

    from tandem.engine.sampling_params import SamplingParams
    from tandem.router.openai_format import ResponseHead, full_body
    from tandem.router.openai_stream import sse
    from tandem.router.prepared import Prepared
    from tandem.router.request_timings import RequestTimings

    pieces = ["<think>", "sum", " it</think>", "4", "2"]
    head = ResponseHead(
        "c", 0, "m", "chat", reasoning=ReasoningParser("qwen3"), include_reasoning=include
    )

    def request() -> Prepared:
        req = Prepared("r", [1], SamplingParams(max_tokens=5), RequestTimings(0.0))
        req.text, req.finish_reason = "".join(pieces), "length"
        return req

    message = full_body(head, [request()], {})["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (
        "sum it" if include else None,
        "42",
    )

    async def run(req: Prepared) -> AsyncGenerator[dict[str, Any], None]:
        for i, text in enumerate(pieces):
            yield {"token_ids": [i], "text": text, "finish_reason": "length" if i == 4 else None}

    serving = SimpleNamespace(sse_keepalive_s=None, run=run, model_name="m")

    async def events() -> list[str]:
        return [e async for e in sse(serving, request(), "chat", False, head)]  # type: ignore[arg-type]

    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in asyncio.run(events())[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == ("sum it" if include else "")
    assert "".join(d.get("content") or "" for d in deltas) == "42"
    assert all(d for d in deltas)  # (no empty chunk where only thoughts came)


@pytest.mark.parametrize("include", [True, False])
def test_a_forced_call_streams_its_thoughts_as_they_come(include: bool) -> None:
    """A forced tool call (tool_choice "required" or named) goes whole at the end; the model's
    thoughts before it stream as they come, as vLLM's (none were sent: the stream was silent
    while the model thought, and its thoughts never came)."""
    import asyncio
    from collections.abc import AsyncGenerator
    from types import SimpleNamespace

    from tandem.engine.sampling_params import SamplingParams
    from tandem.router.openai_format import ResponseHead
    from tandem.router.openai_stream import sse
    from tandem.router.prepared import Prepared
    from tandem.router.request_timings import RequestTimings
    from tandem.router.tool_calls import forced_call

    pieces = ["<think>", "use", " f</think>", '{"name": "f", ', '"arguments": {"x": 2}}']
    head = ResponseHead(
        "c", 0, "m", "chat", reasoning=ReasoningParser("qwen3"), include_reasoning=include,
        read_calls=forced_call,
    )  # fmt: skip
    req = Prepared("r", [1], SamplingParams(max_tokens=5), RequestTimings(0.0))
    req.text, req.finish_reason = "".join(pieces), "stop"

    async def run(req: Prepared) -> AsyncGenerator[dict[str, Any], None]:
        for i, text in enumerate(pieces):
            yield {"token_ids": [i], "text": text, "finish_reason": "stop" if i == 4 else None}

    serving = SimpleNamespace(sse_keepalive_s=None, run=run, model_name="m")

    async def events() -> list[str]:
        return [e async for e in sse(serving, req, "chat", False, head)]  # type: ignore[arg-type]

    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in asyncio.run(events())[:-1]]
    thoughts = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert thoughts == (["use", " f"] if include else [])
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x": 2}'}]
