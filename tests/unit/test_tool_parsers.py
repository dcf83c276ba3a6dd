"""Tool-call formats of free replies (`router/tool_parsers.py`): Llama 3's JSON and Mistral's
`[TOOL_CALLS]` read into OpenAI's `tool_calls`, their content streamed before a call, and the
parser a chat template asks for (Hermes' own cases are in test_tool_calls.py)."""

from __future__ import annotations

import json

import pytest

from tandem.router.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    pick_tool_parser,
)


def _named(calls: list[dict[str, object]]) -> list[tuple[object, object]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))  # type: ignore[index]
        for c in calls
    ]


def test_llama3_json_calls() -> None:
    parse = Llama3JsonParser().parse
    content, calls = parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content is None and _named(calls) == [("get_weather", {"city": "Oslo"})]
    two = '<|python_tag|>{"name": "a", "arguments": {}}; {"name": "b", "parameters": {"x": 1}}'
    assert _named(parse(two)[1]) == [("a", {}), ("b", {"x": 1})]
    for text in ("The weather is fine.", '{"name": "a", "param', '{"x": 1}', "{not json}"):
        assert parse(text) == (text, [])  # plain text, cut short, not a call: content


def test_mistral_calls_both_formats() -> None:
    parse = MistralParser().parse
    listed = 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": "{}"}]'
    content, calls = parse(listed)
    assert content == "Sure. " and _named(calls) == [("a", {"q": "x"}), ("b", {})]
    newer = '[TOOL_CALLS]a[ARGS]{"q": "x"}[TOOL_CALLS]b[ARGS]{}'
    assert parse(newer)[0] is None and _named(parse(newer)[1]) == [("a", {"q": "x"}), ("b", {})]
    for text in ("no call", "[TOOL_CALLS][{bad", '[TOOL_CALLS]{"name": "a"}', "[TOOL_CALLS][]"):
        assert parse(text) == (text, [])
    assert MistralParser.keeps_specials and not HermesParser.keeps_specials


LLAMA3_TEMPLATE = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}"


@pytest.mark.parametrize(
    ("name", "template", "want"),
    [
        ("auto", "{% for m in messages %}<tool_call>{% endfor %}", HermesParser),
        ("auto", LLAMA3_TEMPLATE + "<|python_tag|>", Llama3JsonParser),
        ("auto", LLAMA3_TEMPLATE, Llama3JsonParser),
        ("auto", "[INST] {{ m }} [/INST][TOOL_CALLS]", MistralParser),
        ("auto", "<|im_start|>{{ m }}<|im_end|>", HermesParser),
        ("auto", None, HermesParser),
        ("mistral", "<tool_call>", MistralParser),
        ("llama3_json", None, Llama3JsonParser),
    ],
)
def test_the_parser_a_template_asks_for(name: str, template: str | None, want: type) -> None:  # type: ignore[type-arg]
    assert type(pick_tool_parser(name, template)) is want


def test_an_unknown_parser_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser"):
        pick_tool_parser("pythonic", None)


def test_the_cluster_config_offers_each_parser() -> None:
    from typing import get_args

    from pydantic import ValidationError

    from tandem.deploy.cluster_config import ClusterConfig, RouterConfig
    from tandem.router.tool_parsers import TOOL_CALL_PARSERS

    field = RouterConfig.model_fields["tool_call_parser"]
    assert get_args(field.annotation) == TOOL_CALL_PARSERS and field.default == "auto"
    config = ClusterConfig.model_validate({"router": {"tool_call_parser": "llama3_json"}})
    assert config.router.tool_call_parser == "llama3_json"
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate({"router": {"tool_call_parser": "pythonic"}})
