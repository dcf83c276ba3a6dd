"""A streamed "auto" reply with tools: the content before a call as it comes, then each call
as it is written (its name, then its arguments piece by piece), for every parser; what a client
joins from the deltas is the call the whole reply parses to."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem.router.call_stream import CallStream
from tandem.router.tool_parsers import HermesParser, Llama3JsonParser, MistralParser, ToolParser

CALL = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'


def streamed(parser: ToolParser, text: str, piece: int) -> dict[str, Any]:
    """Feeds `text` in pieces of `piece` characters; returns the content pieces, the rest at the
    end, the deltas of each feed, and the calls a client joins from them (by index)."""
    stream = CallStream(parser)
    sent, deltas = [], []
    for i in range(0, len(text), piece):
        content, more = stream.feed(text[i : i + piece])
        sent.append(content)
        deltas.append(more)
    rest, last = stream.finish()
    deltas.append(last)
    calls: dict[int, dict[str, Any]] = {}
    for delta in (d for feed in deltas for d in feed):
        call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in delta:
            assert call["id"] is None, "one id per call"
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        call["arguments"] += delta["function"].get("arguments", "")
    joined = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return {"sent": sent, "rest": rest, "deltas": deltas, "calls": joined, "has": stream.has_calls}


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 7, 100])
def test_a_hermes_reply_streams_its_content_then_its_call(piece: int) -> None:
    out = streamed(HermesParser(), "Let me check. " + CALL + " done", piece)
    assert "".join(out["sent"]) == "Let me check. " and out["rest"] == "done"
    assert out["calls"] == [("a", {"x": 1})] and out["has"]
    if piece < 14:  # the content went out as it came, not at the end
        assert sum(1 for s in out["sent"] if s) > 1
    if piece == 1:  # the name, then the arguments piece by piece, before the reply ended
        feeds_with_calls = [d for d in out["deltas"][:-1] if d]
        assert len(feeds_with_calls) == len('{"x": 1}') + 1
        assert feeds_with_calls[0][0]["function"] == {"name": "a", "arguments": ""}


@pytest.mark.parametrize("piece", [1, 4, 100])
def test_several_calls_stream_one_after_another(piece: int) -> None:
    two = (
        CALL
        + '\n<tool_call>{"name": "b", "arguments": {"q": "a \\"}\\" b", "n": [1, {}]}}</tool_call>'
    )
    out = streamed(HermesParser(), two, piece)
    assert out["calls"] == [("a", {"x": 1}), ("b", {"q": 'a "}" b', "n": [1, {}]})]
    assert out["rest"] is None


@pytest.mark.parametrize("piece", [1, 4, 100])
def test_a_reply_without_a_call_is_all_content(piece: int) -> None:
    text = "a < b and <tool is not a call <tool_cal"
    out = streamed(HermesParser(), text, piece)
    assert "".join(out["sent"]) + (out["rest"] or "") == text and out["calls"] == []
    assert out["rest"] == "<tool_cal"  # (held back: it could have begun a call)
    out = streamed(HermesParser(), "<tool_call>{not json", piece)
    assert "".join(out["sent"]) == "" and out["rest"] == "<tool_call>{not json"
    assert out["calls"] == [] and not out["has"]


@pytest.mark.parametrize("piece", [1, 3, 100])
def test_calls_whose_head_cannot_be_read_early_come_whole_at_the_end(piece: int) -> None:
    late = '<tool_call>{"arguments": {"x": 1}, "name": "a"}</tool_call>'  # (name last)
    out = streamed(HermesParser(), late, piece)
    assert out["calls"] == [("a", {"x": 1})] and all(not d for d in out["deltas"][:-1])
    text_args = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>'  # (a string)
    out = streamed(HermesParser(), text_args, piece)
    assert out["calls"] == [("a", {"x": 2})]


@pytest.mark.parametrize("piece", [1, 3, 100])
def test_every_parser_streams_its_calls(piece: int) -> None:
    llama = streamed(
        Llama3JsonParser(),
        '  {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}',
        piece,
    )
    assert "".join(llama["sent"]) == "" and llama["rest"] is None  # (as its body: no content)
    assert llama["calls"] == [("a", {}), ("b", {"y": 2})]
    plain = streamed(Llama3JsonParser(), "Hello there, no call {here}", piece)
    assert "".join(plain["sent"]) == "Hello there, no call {here}" and plain["calls"] == []
    if piece == 1:
        assert sum(1 for s in plain["sent"] if s) > 10  # streamed as it came
    listed = (
        'Ok [TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"z": [3]}}]'
    )
    mistral = streamed(MistralParser(), listed, piece)
    assert "".join(mistral["sent"]) == "Ok " and mistral["rest"] is None
    assert mistral["calls"] == [("a", {}), ("b", {"z": [3]})]
    newer = streamed(MistralParser(), '[TOOL_CALLS]a[ARGS]{"q": "x"}[TOOL_CALLS]b[ARGS]{}', piece)
    assert newer["calls"] == [("a", {"q": "x"}), ("b", {})]
    cut = streamed(MistralParser(), "a [TOOL", piece)
    assert "".join(cut["sent"]) == "a " and cut["rest"] == "[TOOL" and cut["calls"] == []


@pytest.mark.parametrize("piece", [1, 5, 100])
def test_parallel_tool_calls_false_reads_the_first_call_only(piece: int) -> None:
    """OpenAI's `parallel_tool_calls: false`: one call, streamed or read whole."""
    two = CALL + '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    first = HermesParser().at_most(1)
    assert streamed(first, two, piece)["calls"] == [("a", {"x": 1})]
    content, calls = first(two)
    assert content is None and [c["function"]["name"] for c in calls] == ["a"]
    assert len(HermesParser()(two)[1]) == 2  # (the shared parser is untouched)


@pytest.mark.parametrize("piece", [1, 4, 100])
def test_a_call_that_does_not_parse_at_the_end_is_not_sent_again_as_content(piece: int) -> None:
    """Its head went out as it was written, but its arguments are not JSON: the pieces that
    went out end the stream, finish "tool_calls", as vLLM's (its text came again as content
    after them: the client held a call and the call's text)."""
    broken = 'Pre <tool_call>{"name": "a", "arguments": {"x": }}</tool_call>'
    stream = CallStream(HermesParser())
    fed = [stream.feed(broken[i : i + piece]) for i in range(0, len(broken), piece)]
    assert stream.has_calls  # (the name went out)
    rest, last = stream.finish()
    assert "".join(c for c, _ in fed) == "Pre " and rest is None
    pieces = [d for _, deltas in fed for d in deltas] + last
    assert pieces[0]["function"]["name"] == "a" and {d["index"] for d in pieces} == {0}
    assert stream.has_calls  # (finish "tool_calls")
    without_a_call = "Pre <tool_call>{not json</tool_call>"  # (no head went out: content)
    plain = CallStream(HermesParser())
    sent = [
        plain.feed(without_a_call[i : i + piece])[0] for i in range(0, len(without_a_call), piece)
    ]
    rest, _ = plain.finish()
    assert "".join(sent) + (rest or "") == without_a_call and not plain.has_calls


@pytest.mark.parametrize("piece", [1, 4, 100])
def test_a_call_cut_at_the_token_limit_is_not_sent_again_as_content(piece: int) -> None:
    """Cut short (finish "length"), the call's pieces that went out are the stream's, as
    vLLM's: its text came again as content after them (the client held both)."""
    cut = 'Pre <tool_call>{"name": "a", "arguments": {"x"'
    stream = CallStream(HermesParser())
    fed = [stream.feed(cut[i : i + piece]) for i in range(0, len(cut), piece)]
    rest, last = stream.finish(cut=True)
    assert "".join(c for c, _ in fed) == "Pre " and rest is None
    pieces = [d for _, deltas in fed for d in deltas] + last
    assert pieces[0]["function"]["name"] == "a" and {d["index"] for d in pieces} == {0}
    assert "".join(d["function"]["arguments"] for d in pieces) == '{"x"'
    assert not stream.has_calls  # (the finish reason stays "length")


@pytest.mark.parametrize("piece", [1, 6, 100])
def test_content_around_calls_reads_the_same_streamed_and_whole(piece: int) -> None:
    for text in (
        "Pre " + CALL + " post text",
        "A\n" + CALL + "\n B " + CALL + "  C ",
        CALL + "\n\nafter",
    ):
        content, _ = HermesParser()(text)
        out = streamed(HermesParser(), text, piece)
        joined = "".join(out["sent"]) + (out["rest"] or "")
        assert joined == content, (text, joined, content)  # (whitespace too)
    mistral_text = 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {}}]'
    out = streamed(MistralParser(), mistral_text, piece)
    joined = "".join(out["sent"]) + (out["rest"] or "")
    assert joined == MistralParser()(mistral_text)[0] == "Sure. "


@pytest.mark.parametrize("piece", [1, 2, 100])
def test_leading_whitespace_goes_out_with_text_and_not_before_a_call(piece: int) -> None:
    """A reply's leading whitespace (a reasoning model's "\n\n" after its thoughts) waits:
    before a call the body strips it (no content), before text it goes out with it."""
    before_call = streamed(HermesParser(), "\n\n" + CALL, piece)
    assert "".join(before_call["sent"]) == "" and before_call["rest"] is None
    assert HermesParser()("\n\n" + CALL)[0] is None
    text = "\n\n  Hello there"
    plain = streamed(HermesParser(), text, piece)
    assert "".join(plain["sent"]) + (plain["rest"] or "") == text == HermesParser()(text)[0]
    blank = streamed(HermesParser(), " \n", piece)
    assert "".join(blank["sent"]) + (blank["rest"] or "") == " \n"
