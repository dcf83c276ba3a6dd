"""The chat template's options in a request (chat completions, `/tokenize`): what
`chat_template_kwargs` may not set, and the combinations that are refused (a 400 naming the
field)."""

from __future__ import annotations

from typing import Any

from tandem.router.errors import bad_request

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tokenize", "return_dict", "chat_template"}
)  # fmt: skip
"""What `chat_template_kwargs` may not set: the conversation, the output's form, or a
client's own Jinja (`refuse_request_template`). It may set the template call's other options
(`add_generation_prompt`, `continue_final_message`, `tools`, `documents`), which win for the
rendering as in vLLM (`Tokenizer.apply_chat_template`); the reply's role and the checks go by
the request's own fields, as vLLM's do."""


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
