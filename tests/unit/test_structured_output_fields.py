"""Which structured output an OpenAI-style request asks for (`router/structured_output.py`):
OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*` fields, one at a time."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.router.errors import APIError
from tandem.router.openai_protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


def _completion(**fields: Any) -> dict[str, Any]:
    return CompletionRequest(model="m", prompt="p", **fields).sampling_dict()


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({}, {}),
        ({"response_format": {"type": "text"}}, {}),
        ({"response_format": {"type": "json_object"}}, {"json_schema": {"type": "object"}}),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            {"json_schema": SCHEMA},
        ),
        ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}),
        ({"guided_json": '{"type": "string"}'}, {"json_schema": {"type": "string"}}),
        ({"guided_regex": "[ab]+"}, {"regex": "[ab]+"}),
        ({"guided_choice": ["x", "y"]}, {"choice": ["x", "y"]}),
        ({"guided_grammar": 'root ::= "z"'}, {"grammar": 'root ::= "z"'}),
        ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
        ({"structured_outputs": {"json_object": True}}, {"json_schema": {"type": "object"}}),
        ({"structured_outputs": {"regex": "a|b"}}, {"regex": "a|b"}),
        ({"structured_outputs": {"choice": ["p", "q"]}}, {"choice": ["p", "q"]}),
        ({"structured_outputs": {"grammar": 'root ::= "y"'}}, {"grammar": 'root ::= "y"'}),
        ({"structured_outputs": {"regex": None, "choice": ["p"]}}, {"choice": ["p"]}),
        (  # (vLLM's options that change nothing here)
            {
                "structured_outputs": {
                    "json": SCHEMA,
                    "disable_any_whitespace": True,
                    "disable_fallback": True,
                    "disable_additional_properties": True,
                }
            },
            {"json_schema": SCHEMA},
        ),  # fmt: skip
    ],
)
def test_each_field_becomes_the_engines_structure(
    fields: dict[str, Any], want: dict[str, Any]
) -> None:
    got = _completion(**fields)
    kinds = ("json_schema", "regex", "choice", "grammar")
    assert {k: v for k, v in got.items() if k in kinds} == want


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one field"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            "response_format, structured_outputs.regex",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice", ""),
        ({"guided_regex": "(unclosed"}, "guided_regex", "unusable regular expression"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "unusable grammar"),
        ({"guided_json": {"type": 5}}, "guided_json", "unusable JSON schema"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_json": "[1]"}, "guided_json", "must be a JSON schema"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", ""),
        (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " *"}},
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ],
)
def test_bad_or_conflicting_fields_are_a_400_naming_the_field(
    fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(APIError) as caught:
        _completion(**fields)
    assert caught.value.status == 400 and caught.value.param == param
    assert message in caught.value.message
    assert ".cc:" not in caught.value.message and "/project/" not in caught.value.message


def test_a_forced_tool_excludes_other_structures() -> None:
    def chat(**fields: Any) -> dict[str, Any]:
        request = ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], **fields
        )
        return request.sampling_dict()

    forced = chat(tools=[TOOL], tool_choice="required")["json_schema"]
    assert forced["properties"]["name"] == {"const": "f"}
    with pytest.raises(APIError) as caught:
        chat(tools=[TOOL], tool_choice="required", guided_regex="a")
    assert caught.value.param == "guided_regex" and "forced tool_choice" in caught.value.message
    assert chat(tools=[TOOL], guided_choice=["a", "b"])["choice"] == ["a", "b"]  # auto: allowed
    # A forced call's grammar is built at the router: a tool whose parameters xgrammar cannot
    # use is the client's 400 there, not a decode worker's failure after prefill.
    unusable = {"type": "object", "properties": {"x": {"type": "bogus"}}}
    bogus = {"type": "function", "function": {"name": "g", "parameters": unusable}}
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        with pytest.raises(APIError) as caught:
            chat(tools=[bogus], tool_choice=choice)
        assert (caught.value.status, caught.value.param) == (400, "tools")
        assert "unusable JSON schema" in caught.value.message
    assert "json_schema" not in chat(tools=[bogus], tool_choice="auto")  # not forced: free text


def test_a_constrained_requests_grammar_is_checked_off_the_event_loop(monkeypatch: Any) -> None:
    """Checking a grammar (xgrammar converting a schema) can take seconds: never on the router's
    event loop, which streams every other request meanwhile."""
    import asyncio
    import threading

    from tandem.router import structured_output
    from tandem.router.request_prep import sampling_fields

    threads: list[str] = []
    check = structured_output.check_structure

    def recording(*args: Any, **kwargs: Any) -> None:
        threads.append(threading.current_thread().name)
        check(*args, **kwargs)

    monkeypatch.setattr(structured_output, "check_structure", recording)
    loop_thread: list[str] = []

    async def run(body: Any) -> dict[str, Any]:
        loop_thread.append(threading.current_thread().name)
        return await sampling_fields(body)

    free = asyncio.run(run(CompletionRequest(model="m", prompt="p")))
    constrained = CompletionRequest(model="m", prompt="p", guided_json=SCHEMA)
    assert asyncio.run(run(constrained)) == constrained.sampling_dict()
    assert "json_schema" not in free and len(threads) == 2
    assert threads[0] != loop_thread[1] and threads[0].startswith("tokenize")
