"""OpenAI's Responses API request (`POST /v1/responses`) and the chat request it amounts to.

tandem answers a Responses request as a chat completion (`responses_api.py` turns the answer
back): `instructions` become a system message; `input` (text, or a list of messages and of
function calls with their outputs) the conversation; `max_output_tokens`, `tools` (function
tools), `tool_choice`, `parallel_tool_calls` and `text.format` their chat counterparts. The
sampling fields both APIs share, and vLLM's extensions (`top_k`, `seed`, ...), pass through.
With `previous_response_id`, the stored conversation (`responses_store.py`) comes before
`input`. `background` is refused with a 400, as are tools other than functions and content
other than text.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from tandem.engine.sampling_params import MAX_LOGPROBS
from tandem.router.errors import bad_request
from tandem.router.openai_protocol import ChatCompletionRequest
from tandem.router.request_body import RequestBody

TEXT_PARTS = ("input_text", "output_text", "text")
"""Content part types whose `text` is taken as it is."""
CHAT_ONLY = ("messages", "max_tokens", "max_completion_tokens", "n", "stream_options")
"""Chat fields a Responses request does not pass through (it has its own, or none)."""
OUTPUT_LOGPROBS = "message.output_text.logprobs"
"""The `include` entry that asks for the output's logprobs (with `top_logprobs`
alternatives)."""


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(extra="allow")

    model: str | None = None  # as vLLM: the served model when omitted
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None

    def check_supported(self) -> None:
        if self.background:
            raise bad_request("background responses are not supported", "background", "unsupported")

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as a list of items (a text is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def chat_request(self, history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
        """The chat completion this request amounts to (400 when it cannot be one), after the
        items of `history` (the conversation `previous_response_id` names)."""
        self.check_supported()
        chat: dict[str, Any] = {
            name: value for name, value in (self.model_extra or {}).items() if name not in CHAT_ONLY
        }
        chat.update(
            model=self.model,
            messages=self.messages(history or []),
            stream=self.stream,
            parallel_tool_calls=self.parallel_tool_calls,
        )
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "response_format": self.response_format(),
        }
        chat.update({k: v for k, v in optional.items() if v is not None})
        if self.top_logprobs is not None or OUTPUT_LOGPROBS in (self.include or ()):
            chat.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise bad_request(f"{where}: {first.get('msg', 'invalid')}", where or None) from None

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`instructions`, then the `history` items and `input`, as chat messages."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        for i, item in enumerate([*history, *self.input_items()], start=-len(history)):
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise bad_request(f"input[{i}].role {role!r} is not supported", "input")
                if "content" not in item:  # (OpenAI's: a message has content, maybe "")
                    raise bad_request(f"input[{i}] is a message without content", "input")
                out.append({"role": role, "content": _text(item.get("content"), i)})
            elif kind == "function_call":
                call = {
                    "id": str(item.get("call_id") or item.get("id") or f"call_{i}"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
                }
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id", "")),
                    "content": output if isinstance(output, str) else _text(output, i),
                })  # fmt: skip
            elif kind == "reasoning":
                continue  # a model's earlier thoughts: chat templates drop them too
            else:
                raise bad_request(f"input[{i}] of type {kind!r} is not supported", "input")
        if not out:
            raise bad_request("input holds no message", "input")
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise bad_request(
                    f"tools[{i}] of type {tool.get('type')!r} is not supported (function tools "
                    "only)",
                    "tools",
                    "unsupported",
                )
            spec = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            tools.append({"type": "function", "function": spec})
        return tools

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if not self.tools and choice in ("auto", "none"):  # (OpenAI's default, with no tools)
            return None
        if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise bad_request(
                "text.format must be an object whose type is text, json_object or json_schema",
                "text.format",
            )
        if kind == "text":
            return None
        if kind == "json_schema":
            schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": schema}
        return {"type": fmt.get("type")}


def _text(content: Any, index: int) -> str:
    """A message's content as text: a string, or text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"input[{index}].content must be text or a list of parts", "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"input[{index}]: content parts of type {kind!r} are not supported (text only)",
                "input",
                "unsupported",
            )
        parts.append(part["text"])
    return "\n".join(parts)  # (as the chat API and vLLM join text parts)
