"""`POST /tokenize` with chat `messages` renders the `tools` as chat completions does, so its
count is the prompt a chat with those tools is charged."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.engine.tokenizer import Tokenizer
from tandem.router.serving import Serving
from tandem.router.tokenize_api import TokenizeRequest, tokenize
from tandem.router.tool_calls import ToolSpec, template_tools

SHOWS_TOOLS = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tokenize_shows_the_tools_to_the_template(tiny_checkpoint: Callable[..., Path]) -> None:
    tokenizer = Tokenizer.from_pretrained(tiny_checkpoint())
    tokenizer.hf.chat_template = SHOWS_TOOLS
    serving = Serving(None, None, tokenizer, "tiny")  # type: ignore[arg-type]

    async def limits() -> Any:
        return SimpleNamespace(max_model_len=2048)

    serving.limits = limits  # type: ignore[method-assign]
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    body: dict[str, Any] = {"model": "tiny", "messages": messages}
    plain = asyncio.run(tokenize(serving, TokenizeRequest.model_validate(body)))
    with_tools = asyncio.run(
        tokenize(serving, TokenizeRequest.model_validate({**body, "tools": [TOOL]}))
    )
    tools = template_tools([ToolSpec.model_validate(TOOL)])
    assert with_tools["tokens"] == serving.render_chat(messages, tools=tools)
    assert with_tools["count"] > plain["count"]


@pytest.mark.parametrize(
    "tool_choice",
    [None, "auto", "none", "required", {"type": "function", "function": {"name": "b"}}],
)
def test_a_chat_shows_every_tool_whatever_tool_choice_says(
    tiny_checkpoint: Callable[..., Path], tool_choice: Any
) -> None:
    """As vLLM shows them: the prompt (and its prompt_tokens) does not depend on tool_choice."""
    from tandem.router.errors import APIError
    from tandem.router.openai_api import create_chat_completion
    from tandem.router.openai_protocol import ChatCompletionRequest

    shown: list[Any] = []

    async def prepare(*args: Any, **kwargs: Any) -> Any:
        shown.append(kwargs["tools"])
        raise APIError(418, "seen")

    serving = Serving(None, None, Tokenizer.from_pretrained(tiny_checkpoint()), "tiny")  # type: ignore[arg-type]
    serving.prepare = prepare  # type: ignore[method-assign]
    second = {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}}
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [TOOL, second],
    }
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    request = ChatCompletionRequest.model_validate(body)
    with pytest.raises(APIError, match="seen"):
        asyncio.run(create_chat_completion(serving, request))
    assert [t["function"]["name"] for t in shown[0]] == ["get_weather", "b"]


def test_a_chat_template_in_the_request_is_refused_as_chat_refuses_it(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """It was taken silently and the server's own template rendered the messages."""
    from tandem.router.errors import APIError

    serving = Serving(None, None, Tokenizer.from_pretrained(tiny_checkpoint()), "tiny")  # type: ignore[arg-type]

    async def limits() -> Any:
        return SimpleNamespace(max_model_len=2048)

    serving.limits = limits  # type: ignore[method-assign]
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"}
    with pytest.raises(APIError) as refused:
        asyncio.run(tokenize(serving, TokenizeRequest.model_validate(body)))
    assert (refused.value.status, refused.value.param) == (400, "chat_template")


def test_a_tool_reaches_the_template_as_vllm_dumps_it_nulls_included() -> None:
    """vLLM hands templates `tool.model_dump()`: fields a tool leaves out come as null (a
    template's `tojson` writes them), and extra ones as sent (the prompt differed from vLLM's)."""
    bare = {"type": "function", "function": {"name": "get_time", "strict": None}}
    assert template_tools([ToolSpec.model_validate(bare)]) == [
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": None,
                "parameters": None,
                "strict": None,
            },
        }
    ]
