"""Structured output (`SamplingParams.json_schema`, `regex`, `choice`, `grammar`; xgrammar): what
comes out follows the constraint and ends when it is complete; across a transfer it is the
colocated engine's output."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.errors import InvalidRequestError
from tests.kv_protocol_pair import (  # noqa: F401 - fixtures
    Pair,
    colocated,
    model,
    next_request_is_exact,
    prompt_of,
)

CHOICE = {"type": "string", "enum": ["yes", "no"]}
RECORD = {
    "type": "object",
    "properties": {
        "digit": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["digit", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> LLM:
    return LLM(model=str(tiny_checkpoint()), num_kv_blocks=256)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_output_follows_the_schema_and_ends_with_it(llm: LLM, temperature: float) -> None:
    prompts = ["pick one", "a b c", "tandem"]
    for schema, check in ((CHOICE, lambda v: v in ("yes", "no")), (RECORD, _is_record)):
        params = SamplingParams(
            temperature=temperature, seed=3, max_tokens=40, json_schema=schema, ignore_eos=True
        )
        for out in llm.generate(prompts, params):
            assert out.finish_reason == "stop", out.text
            assert check(json.loads(out.text)), out.text
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert not any(_parses(o.text) for o in plain)  # (the tiny model writes no JSON unasked)


def _is_record(value: Any) -> bool:
    return (
        set(value) == {"digit", "ok"} and 0 <= value["digit"] <= 9 and isinstance(value["ok"], bool)
    )


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_properties_come_in_the_schemas_order(llm: LLM) -> None:
    """As OpenAI and vLLM: the schema's order, not the alphabet's (a schema that puts its
    "reasoning" before its "answer" means it)."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=30, json_schema=schema)
    for out in llm.generate(["one", "two", "three"], params):
        assert list(json.loads(out.text)) == ["zeta", "alpha"], out.text


def test_bounded_strings_hold_no_raw_control_characters(llm: LLM) -> None:
    """xgrammar lets control characters into a string with `maxLength`; JSON does not allow
    them raw, so the grammar is mended (`without_raw_control_characters`) and every sampled
    answer parses."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    matcher = llm.engine.grammars.matcher(("json_schema", schema))
    assert matcher.accept_string('{"name": "ab')
    assert not matcher.accept_string("\x07")
    assert not matcher.accept_string("\x1f")
    assert matcher.accept_string('c", "ok": true}')
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=60, json_schema=schema)
        for seed in range(16)
    ]
    outs = llm.generate(["hi"] * 16, params)
    assert [list(json.loads(o.text)) for o in outs] == [["name", "ok"]] * 16
    assert not any(ch < " " for o in outs for ch in o.text)


def test_an_unusable_schema_is_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="JSON schema"):
        llm.generate(["x"], SamplingParams(json_schema={"type": 5}))


CHOICES = ["red", "green", "blue sky", 'say "hi"\n', "中文"]
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= [a-c] | [0-9] [0-9]?'


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_grammar_outputs_match_them_whole(llm: LLM, temperature: float) -> None:
    prompts = ["pick one", "a b c", "tandem", "0 1 2 3"]
    grammar = re.compile(r"\(([a-c]|[0-9]{1,2})(,([a-c]|[0-9]{1,2}))?\)")
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"regex": DATE}, lambda t: re.fullmatch(DATE, t)),
        ({"choice": CHOICES}, lambda t: t in CHOICES),
        ({"grammar": GRAMMAR}, grammar.fullmatch),
    ]
    for fields, check in cases:
        params = SamplingParams(
            temperature=temperature, seed=5, max_tokens=30, ignore_eos=True, **fields
        )
        outs = llm.generate(prompts, params)
        for out in outs:
            assert check(out.text) and out.finish_reason == "stop", (fields, out.text)
    picked = {
        o.text
        for o in llm.generate(
            prompts * 4, SamplingParams(temperature=1.0, max_tokens=30, choice=CHOICES)
        )
    }
    assert len(picked) > 1  # sampling picks among the choices, not always the first


def test_unusable_or_conflicting_structures_are_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="regular expression"):
        llm.generate(["x"], SamplingParams(regex="(unclosed"))
    with pytest.raises(InvalidRequestError, match="grammar"):
        llm.generate(["x"], SamplingParams(grammar="root ::= missing_rule"))
    with pytest.raises(InvalidRequestError, match="at most one of"):
        SamplingParams(regex="a+", choice=["a"])
    with pytest.raises(InvalidRequestError, match="choice"):
        SamplingParams(choice=["a", ""])
    with pytest.raises(InvalidRequestError, match="choice"):
        SamplingParams(choice=[])
    assert SamplingParams(choice=["a"]).structure == ("choice", ["a"])
    assert SamplingParams().structure is None


@pytest.mark.parametrize(
    "fields",
    [{"json_schema": RECORD}, {"regex": DATE}, {"choice": CHOICES}],
    ids=["json_schema", "regex", "choice"],
)
def test_structured_output_continues_exactly_across_a_transfer(
    model: str,  # noqa: F811
    colocated: LLM,  # noqa: F811
    fields: dict[str, Any],
) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **fields)
    prompt = prompt_of(16 * 3 + 4, start=11)
    pair = Pair(model)
    pair.start("j", prompt, params)
    events = pair.pump()
    first = next(e.token_ids for e in events if e.kind == "first_token")
    tokens = list(first) + pair.decode_all()["j"]
    want = colocated.generate([prompt], params)[0]
    assert tokens == want.token_ids and want.finish_reason == "stop"
    if "json_schema" in fields:
        assert _is_record(json.loads(want.text))
    pair.idle()


def test_a_request_that_allows_no_token_ends_without_failing_others(
    llm: LLM,
    model: str,  # noqa: F811
    colocated: LLM,  # noqa: F811
) -> None:
    """allowed_token_ids none of which the grammar accepts: no token can come next. The request
    ends there ("stop", no token) instead of failing the step, in one engine and across a
    transfer (the last chunk then carries no token and says the request finished); the batch
    it shares goes on, and both sides free everything."""
    stuck = SamplingParams(
        temperature=1.0, max_tokens=8, allowed_token_ids=[40, 41], json_schema={"type": "object"}
    )
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["x y", "x y"], [stuck, plain])
    assert (outs[0].token_ids, outs[0].text, outs[0].finish_reason) == ([], "", "stop")
    assert outs[1].token_ids == llm.generate(["x y"], plain)[0].token_ids
    # min_tokens past a complete grammar: only a stop token would follow, and it is held back
    done = llm.generate(["x"], SamplingParams(max_tokens=40, min_tokens=30, choice=["yes", "no"]))
    assert done[0].text in ("yes", "no") and done[0].finish_reason == "stop"
    pair = Pair(model)
    pair.start("s", prompt_of(16 * 2 + 3, start=3), stuck.model_copy(update={"logprobs": 1}))
    events = [(e.kind, e.token_ids) for e in pair.pump() if e.request_id == "s"]
    assert ("first_token", ()) in events and ("finished_early", ()) in events, events
    next_request_is_exact(pair, colocated)


def test_vllm_s_offline_spellings_of_structured_output() -> None:
    """`SamplingParams(structured_outputs=...)` (vLLM >= 0.11) and `guided_decoding=` (older),
    as a dict or an object with json / regex / choice / grammar / json_object."""
    from types import SimpleNamespace

    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structure == (
        "choice",
        ["a", "b"],
    )
    spec = SimpleNamespace(json='{"type": "string"}', regex=None, choice=None, grammar=None)
    assert SamplingParams(structured_outputs=spec).json_schema == {"type": "string"}
    assert SamplingParams(guided_decoding={"regex": "a+"}).regex == "a+"
    assert SamplingParams(guided_decoding={"json_object": True}).json_schema == {"type": "object"}
    for bad in ({}, {"json": "{oops"}, {"regex": "a", "choice": ["b"]},
                {"json": {"type": "string"}, "json_object": True}):  # fmt: skip
        with pytest.raises(InvalidRequestError):
            SamplingParams(structured_outputs=bad)


def test_a_stop_token_cannot_cut_a_structure_short(llm: LLM) -> None:
    """The model's other end token (<|im_end|>, 2: generation_config.json's) and a request's
    stop_token_ids end a request, so the grammar holds them back until the structure is whole
    (they were text to it: pushed, one ended a JSON string half written, finishing "stop")."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
              "required": ["s"], "additionalProperties": False}  # fmt: skip
    a = llm.get_tokenizer().convert_tokens_to_ids("a")
    for stop, extra in ((2, {}), (a, {"stop_token_ids": [a]})):
        params = SamplingParams(temperature=0, max_tokens=40, json_schema=schema,
                                logit_bias={stop: 100}, **extra)  # fmt: skip
        out = llm.generate([[10, 11, 12]], params)[0]
        assert json.loads(out.text).keys() == {"s"}, out.text
        assert (out.finish_reason, out.stop_reason, out.token_ids[-1]) == ("stop", stop, stop)
