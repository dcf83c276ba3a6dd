"""OpenAI-compatible request schemas (completions and chat) and what they mean for the engine.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; known fields are
type-checked. Features tandem does not implement (`suffix`, `best_of` other than `n`, ...)
are refused with a 400 that names the field rather than silently ignored. Function calling:
`tool_calls.py`. Several choices (`n` > 1, a batch of
prompts) run as requests of their own (`multi_choice`). Log-probabilities: `logprobs` (0-20
alternatives) for completions, `logprobs` and `top_logprobs` for chat. `response_format`
(`json_object`, `json_schema`) and vLLM's `structured_outputs` and `guided_*` fields become the
engine's structured output (`structured_output.py`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.engine.chat_content import content_text, template_tool_calls
from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling_params import MAX_LOGPROBS
from tandem.engine.seeds import SEED_MAX, SEED_MIN, no_seed_as_none
from tandem.router.chat_template_options import (
    check_template_kwargs,
    check_template_options,
    refuse_request_template,
)
from tandem.router.errors import bad_request
from tandem.router.request_body import RequestBody
from tandem.router.structured_output import (
    Structure,
    StructuredOutputs,
    from_guided_fields,
    from_response_format,
    from_structured_outputs,
    one_structure,
)
from tandem.router.tool_calls import (
    ReplyParser,
    ToolSpec,
    call_schema,
    forced_tools,
    reply_parser,
)
from tandem.router.tool_parsers import ToolParser

MAX_TEMPERATURE = 2.0
"""The highest temperature a request may ask for (OpenAI's bound; gRPC keeps it too)."""

MAX_CLIENT_ID = 256
"""The longest request id a client may give (`X-Request-Id`, gRPC's `request_id`)."""


class StreamOptions(BaseModel):
    """vLLM's: given at all, a stream ends with its usage unless `include_usage` is false (or
    null); `continuous_usage_stats` puts the usage so far on every chunk too."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(RequestBody):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # (NaN: "finite number")

    model: str | None = None  # as vLLM: the served model when omitted
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's extension
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False  # vLLM's
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: keep the last k tokens
    skip_special_tokens: bool = True  # vLLM's
    spaces_between_special_tokens: bool = True  # vLLM's
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    deadline_ms: float | None = Field(
        None, gt=0, description="time-to-first-token deadline; refused with 429 if unmeetable"
    )
    priority: int | None = Field(None, description="lower runs earlier (default: the tenant's)")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    repetition_penalty: float | None = None  # vLLM's extension
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # vLLM's older fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    return_token_ids: bool = False  # vLLM's: token ids next to the text
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"

    use_beam_search: bool = False  # vLLM's: refused, not ignored (tandem samples)
    cache_salt: str | None = Field(  # vLLM's
        None, min_length=1, description="prefix-cache blocks are shared only with this salt"
    )

    @field_validator("seed")
    @classmethod
    def _no_seed(cls, value: int | None) -> int | None:
        return no_seed_as_none(value)  # (-1: unseeded, as vLLM's; n > 1 adds nothing to it)

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options needs stream=true", "stream_options")
        if self.use_beam_search:
            raise bad_request(
                "use_beam_search is not supported: tandem samples (greedy with temperature 0)",
                "use_beam_search",
                "unsupported",
            )
        if self.prompt_logprobs and self.stream:  # (0 is taken, as vLLM's: nothing to send)
            raise bad_request(
                "prompt_logprobs is not supported when streaming", "prompt_logprobs", "unsupported"
            )

    def sampling_dict(self) -> dict[str, Any]:
        """SamplingParams fields but max_tokens (validated later, with the prompt length known)."""
        params: dict[str, Any] = {
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
        }
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids")
        penalties = ("presence_penalty", "frequency_penalty", "repetition_penalty")
        for name in names + penalties:
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        if (logprobs := self.num_logprobs()) is not None:
            params["logprobs"] = logprobs
        if self.logit_bias:
            params["logit_bias"] = self.token_bias()
        if self.allowed_token_ids is not None:
            params["allowed_token_ids"] = self.allowed_token_ids
        if self.bad_words:
            params["bad_words"] = self.bad_words
        if (structure := self.output_structure()) is not None:
            params[structure[0]] = structure[1]
        if (k := self.prompt_logprobs_field()) is not None and not self.stream:
            params["prompt_logprobs"] = k
        if self.cache_salt is not None:
            params["cache_salt"] = self.cache_salt
        return params

    def prompt_logprobs_field(self) -> int | None:
        """How many alternatives the reply's `prompt_logprobs` field has (None: no field)."""
        return self.prompt_logprobs

    def structure_sources(self) -> list[tuple[str, Structure]]:
        """(field, structure) for each field of the request that constrains the output."""
        found: list[tuple[str, Structure]] = []
        if (fmt := from_response_format(self.response_format)) is not None:
            found.append(("response_format", fmt))
        if self.structured_outputs is not None:
            found += from_structured_outputs(self.structured_outputs)
        guided = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        return found + from_guided_fields({name: getattr(self, name) for name in guided})

    def output_structure(self) -> Structure | None:
        """The structured output asked for, as the engine's (kind, value); None: free text.
        400 for an unsupported format, two constraining fields, or an unusable one."""
        return one_structure(self.structure_sources())

    def constrains_output(self) -> bool:
        """Whether the output is constrained (`sampling_dict` then checks a grammar)."""
        return bool(self.structure_sources())

    def token_bias(self) -> dict[int, float]:
        """`logit_bias` with its keys as token ids (OpenAI sends them as strings)."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise bad_request(
                    f"logit_bias keys are token ids, got {key!r}", "logit_bias"
                ) from None
        return bias

    def num_logprobs(self) -> int | None:
        """Alternatives per token to return log-probabilities of (None: no logprobs)."""
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: False, a text prompt gets no BOS from here
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and (self.logprobs is not None or self.max_tokens == 0) and self.stream:
            raise bad_request(
                "echo with logprobs or max_tokens 0 is not supported when streaming",
                "echo",
                "unsupported",
            )
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(
                f"best_of={self.best_of} is not supported (only best_of = n, no ranking)",
                "best_of",
                "unsupported",
            )

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 (vLLM's, as lm-eval's loglikelihood requests send): the
        prompt, and its logprobs when asked, with nothing generated."""
        return self.echo and self.max_tokens == 0

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_field(self) -> int | None:
        """vLLM's: echo with logprobs fills the field too, with `logprobs` alternatives."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def sampling_dict(self) -> dict[str, Any]:
        params = super().sampling_dict()
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs too
            params["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return params

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a batch (texts or token id lists)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]  # type: ignore[list-item]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    # (any role, as vLLM's: OpenAI's, its legacy `function`, `ipython`, which Llama 3's
    # templates and vLLM's clients give a tool's output, and those of other templates, e.g.
    # `observation`; a template that does not know one refuses it: a 400)
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines); other parts: 400."""
        content = self.content
        try:
            if isinstance(content, list):
                return content_text([part.model_dump() for part in content])
            return content_text(content)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), "messages") from None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables
    chat_template: str | None = None  # vLLM's; refused, as vLLM does by default (below)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: the reply opens with the last message if it is the reply's role
    include_reasoning: bool = True  # vLLM's: False leaves a reasoning parser's thoughts out
    documents: list[dict[str, Any]] | None = None  # vLLM's: for templates that present them
    add_special_tokens: bool = False  # vLLM's: True adds BOS etc. to what the template writes

    def echoed_text(self) -> str:
        """With `echo`, the text the reply's content starts with: the last message's, when its
        role is the reply's (assistant after a generation prompt, else the last one's), as
        vLLM's; otherwise ""."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.reply_role() else ""

    def reply_role(self) -> str:
        """The reply's role, as vLLM's: assistant after a generation prompt, else the last
        message's (the model goes on with it)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_field(self) -> int | None:
        """vLLM's: `echo` fills the field too (not streamed), with `top_logprobs` alternatives."""
        if self.prompt_logprobs is None and self.echo and not self.stream:
            return self.top_logprobs or 0
        return self.prompt_logprobs

    def forced_tools(self) -> list[ToolSpec] | None:
        """The tools the reply must call one of (`tool_calls`), or None."""
        return forced_tools(self.tools, self.tool_choice)

    def constrains_output(self) -> bool:
        return super().constrains_output() or self.forced_tools() is not None

    def reply_parser(self, parser: ToolParser | None = None) -> ReplyParser | None:
        """How the reply's tool calls are read (None: no tools in play)."""
        return reply_parser(self.tools, self.tool_choice, parser, self.parallel_tool_calls)

    def output_structure(self) -> Structure | None:
        forced = self.forced_tools()
        if forced is None:
            return super().output_structure()
        if sources := self.structure_sources():
            field = sources[0][0]
            raise bad_request(f"{field} and a forced tool_choice exclude each other", field)
        return one_structure([("tools", ("json_schema", call_schema(forced)))])

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        self.forced_tools()
        extra = self.model_extra or {}
        if "audio" in (extra.get("modalities") or ()) or extra.get("audio") is not None:
            raise bad_request("audio output is not supported: the reply is text", "modalities")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise bad_request(
                f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}",
                "max_completion_tokens",
            )
        refuse_request_template(self.chat_template)
        check_template_options(self.add_generation_prompt, self.continue_final_message)
        check_template_kwargs(self.chat_template_kwargs)

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them: role and text, and for a function-calling
    conversation an assistant's `tool_calls` (`template_tool_calls`: arguments as objects) and
    a tool message's `tool_call_id` and `name`;
    an assistant's earlier thoughts (`reasoning`, or its older name `reasoning_content`),
    which templates such as Qwen3's render, go back under both names, as vLLM's.
    OpenAI's `developer` role (its newer name for system instructions) goes to the template
    as `system`: open models' templates know that one (some refuse other roles)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": m.text()}
        extra = m.model_extra or {}
        for key in ("tool_calls", "tool_call_id"):
            if extra.get(key) is not None and extra[key] != []:  # (a reply's empty list: none)
                message[key] = extra[key]
        thoughts = extra.get("reasoning", extra.get("reasoning_content"))
        if thoughts is not None:
            message["reasoning"] = message["reasoning_content"] = thoughts
        if "tool_calls" in message:
            message["tool_calls"] = template_tool_calls(message["tool_calls"])
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out
