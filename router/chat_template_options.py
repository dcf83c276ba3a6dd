"""The chat template's options in a request (chat completions, `/tokenize`): what
`chat_template_kwargs` may set and what wins, and the combinations that are refused (a 400
naming the field)."""

from __future__ import annotations

from typing import Any, Protocol

from tandem.router.errors import bad_request

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tokenize", "return_dict", "chat_template"}
)  # fmt: skip
"""What `chat_template_kwargs` may not set: the conversation, the output's form, or a
client's own Jinja (`refuse_request_template`)."""
TEMPLATE_OPTIONS = ("add_generation_prompt", "continue_final_message")
"""The template call's options that `chat_template_kwargs` may set, winning over the
request's own fields as in vLLM (`lift_template_options`); `tools` and `documents` there go to
the template alone (`Tokenizer.apply_chat_template`)."""


class _TemplateOptions(Protocol):
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any] | None


def lift_template_options(body: _TemplateOptions) -> None:
    """Moves `TEMPLATE_OPTIONS` that `chat_template_kwargs` sets into the request's own fields
    (vLLM renders with its kwargs over them), so that the checks and the reply's role see what
    the template is given; a value that is not a boolean is a 400."""
    kwargs = body.chat_template_kwargs or {}
    for name in TEMPLATE_OPTIONS:
        if name not in kwargs:
            continue
        if not isinstance(kwargs[name], bool):
            raise bad_request(
                f"chat_template_kwargs.{name} must be a boolean, got {kwargs[name]!r:.100}",
                "chat_template_kwargs",
            )
        setattr(body, name, kwargs[name])
    if body.chat_template_kwargs is not None:
        body.chat_template_kwargs = {
            k: v for k, v in body.chat_template_kwargs.items() if k not in TEMPLATE_OPTIONS
        }


def refuse_request_template(chat_template: str | None) -> None:
    """A chat template given in a request is refused (a client's Jinja would run in the
    server): a 400 naming it."""
    if chat_template is not None:
        raise bad_request(
            "a chat_template in the request is not accepted: the server renders with its "
            "own (tandem serve --chat-template)",
            "chat_template",
            "unsupported",
        )


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """`chat_template_kwargs` may set the template's own variables, not the call's options."""
    clash = sorted(set(kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
    if clash:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs"
        )


def check_template_options(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """`continue_final_message` leaves the last message open (any role's, as transformers
    and vLLM do): no generation prompt after it."""
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "continue_final_message needs add_generation_prompt=false", "continue_final_message"
        )
