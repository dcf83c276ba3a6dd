"""A chat template that refuses a conversation (Jinja's `raise_exception`, as Mistral's and
Gemma's templates do for roles they do not take) is the client's 400, as vLLM answers it, not
a 500."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.engine.tokenizer import Tokenizer
from tandem.router.errors import APIError
from tandem.router.serving import Serving

REFUSES_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ m['content'] + m['extra']['x'] }}{% endfor %}"
)


def test_a_template_s_own_error_is_a_400(tiny_checkpoint: Callable[..., Path]) -> None:
    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint())
    tokenizer.hf.chat_template = REFUSES_SYSTEM
    serving = Serving(None, None, tokenizer, "tiny")  # type: ignore[arg-type]
    cases: list[tuple[list[dict[str, Any]], str]] = [
        ([{"role": "system", "content": "be brief"}], "System role not supported"),
        ([{"role": "user", "content": "hi"}], "'dict object' has no attribute 'extra'"),
    ]
    for messages, message in cases:
        with pytest.raises(APIError) as info:
            serving.render_chat(messages)
        assert info.value.status == 400 and info.value.param == "messages"
        assert info.value.message == f"cannot apply the chat template: {message}"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for k, v in messages[0]['content'] | dictsort %}{{ k }}{% endfor %}", "items"),
        ("{{ 1 // 0 }}", "division"),
    ],
)
def test_what_a_template_raises_on_odd_messages_is_a_400(
    tiny_checkpoint: Callable[..., Path], template: str, message: str
) -> None:
    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint())
    tokenizer.hf.chat_template = template
    serving = Serving(None, None, tokenizer, "tiny")  # type: ignore[arg-type]
    with pytest.raises(APIError) as info:
        serving.render_chat([{"role": "user", "content": "a string"}])
    assert info.value.status == 400 and message in info.value.message


MISTRAL_IDS = (  # (as Mistral v0.3's template checks its ids; `[TOOL_CALLS]` marks it)
    "{% for m in messages %}"
    "{% if m.tool_calls is defined %}[TOOL_CALLS]{% for c in m.tool_calls %}"
    "{% if c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}{{ c.id }}:{{ c.function.arguments|tojson }}"
    "{% endfor %}{% elif m.role == 'tool' %}{% if m.tool_call_id|length != 9 %}"
    "{{ raise_exception('bad id') }}{% endif %}[TOOL_RESULTS]{{ m.tool_call_id }}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"
)


def test_a_mistral_template_gets_nine_character_call_ids(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """Ids of OpenAI's form go to a Mistral template as 9 letters and digits derived from
    them, the same for a call and its answer; 9-character ids and other templates keep theirs."""
    from tandem.engine.chat_content import nine_character_call_ids

    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint())
    arguments = '{"city": "Paris"}'
    call = {"id": "call_a5c7b1d25a064bb5b1160c0e", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}  # type: ignore[assignment]
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "21"},
    ]
    ids = tokenizer.apply_chat_template(messages, chat_template=MISTRAL_IDS)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    short = nine_character_call_ids(messages)[2]["tool_call_id"]
    assert len(short) == 9 and short.isalnum()
    assert f"[TOOL_CALLS]{short}:" in text and text.endswith(f"[TOOL_RESULTS]{short}")
    assert nine_character_call_ids(messages)[1]["tool_calls"][0]["id"] == short
    native = [{**messages[2], "tool_call_id": "Ab3dE6gH9"}]
    assert nine_character_call_ids(native) == native
    assert messages[2]["tool_call_id"] == call["id"]  # (a copy: the request keeps its ids)
