"""`POST /tokenize` with chat `messages` renders the `tools` as chat completions does, so its
count is the prompt a chat with those tools is charged."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
