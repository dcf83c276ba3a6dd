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
