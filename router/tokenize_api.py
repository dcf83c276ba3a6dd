"""vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer over HTTP.

`/tokenize` takes a `prompt` (text) or chat `messages` (rendered with the chat template, its
two options and the `tools`, as `/v1/chat/completions` renders them) and answers ``{"count",
"max_model_len", "tokens"}``; `/detokenize` takes `tokens` and answers ``{"prompt"}``. Clients use them to count
tokens exactly as the server will, e.g. to fit a prompt to the context.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from tandem.router.chat_template_options import (
    check_template_kwargs,
    check_template_options,
    refuse_request_template,
)
from tandem.router.errors import bad_request
from tandem.router.openai_protocol import ChatMessage, template_messages
from tandem.router.request_body import RequestBody
from tandem.router.request_prep import check_token_ids, off_the_loop_if_long
from tandem.router.serving import Serving
from tandem.router.tool_calls import ToolSpec, template_tools


class TokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # (for `messages`, False unless given, as vLLM's)
    add_generation_prompt: bool = True  # for `messages`
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # (refused, as chat refuses it)
    tools: list[ToolSpec] | None = None  # for `messages`: shown to the template, as chat does
    documents: list[dict[str, Any]] | None = None  # for `messages`, as chat takes them
    return_token_strs: bool = False  # vLLM's: also each token as the vocabulary spells it


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


async def tokenize(serving: Serving, body: TokenizeRequest) -> dict[str, Any]:
    serving.check_model(body.model)
    limits = await serving.limits()
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages", "prompt")
    if body.messages is not None:
        check_template_options(body.add_generation_prompt, body.continue_final_message)
        check_template_kwargs(body.chat_template_kwargs)
        refuse_request_template(body.chat_template)
        tokens = serving.render_chat(
            template_messages(body.messages),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
            tools=template_tools(body.tools) if body.tools else None,
            documents=body.documents,
            # (vLLM's default for messages: none but what the template writes)
            add_special_tokens="add_special_tokens" in body.model_fields_set
            and body.add_special_tokens,
        )
    else:
        assert body.prompt is not None
        tokens = await off_the_loop_if_long(
            len(body.prompt),
            serving.tokenizer.encode,
            body.prompt,
            add_special_tokens=body.add_special_tokens,
        )
    token_strs = (
        serving.tokenizer.hf.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    )  # (null unless asked for, as in vLLM's reply)
    return {"count": len(tokens), "max_model_len": limits.max_model_len, "tokens": tokens,
            "token_strs": token_strs}  # fmt: skip


async def detokenize(serving: Serving, body: DetokenizeRequest) -> dict[str, Any]:
    serving.check_model(body.model)
    limits = await serving.limits()
    check_token_ids(body.tokens, limits.vocab_size, "tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}
