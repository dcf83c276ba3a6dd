"""Request bodies with a lone UTF-16 surrogate are refused up front, naming where."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tandem.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tandem.router.tokenize_api import TokenizeRequest
from tandem.router.unicode_text import lone_surrogate_at


def test_where_the_lone_surrogate_is() -> None:
    body = json.loads('{"messages": [{"role": "user", "content": "hi \\ud83d"}], "n": 1}')
    assert lone_surrogate_at(body) == "body.messages.0.content"
    assert lone_surrogate_at(json.loads('{"a\\udc00": 1}')) == "body"  # a key
    paired = json.loads('{"prompt": "smile \\ud83d\\ude00", "ids": [1, 2, 3]}')  # an emoji
    assert paired["prompt"].endswith("\U0001f600") and lone_surrogate_at(paired) is None
    assert lone_surrogate_at([1, 2, [3, "\ud800"]]) == "body.2.1"


def test_the_api_bodies_refuse_it() -> None:
    with pytest.raises(ValidationError, match=r"prompt.1 holds a lone UTF-16 surrogate"):
        CompletionRequest.model_validate({"model": "m", "prompt": ["ok", "x\udfff"]})
    with pytest.raises(ValidationError, match="messages.0.content"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}
        )
    with pytest.raises(ValidationError, match="lone UTF-16 surrogate"):
        TokenizeRequest.model_validate({"prompt": "\ud800"})
    assert CompletionRequest(model="m", prompt="smile \U0001f600").prompt == "smile \U0001f600"
