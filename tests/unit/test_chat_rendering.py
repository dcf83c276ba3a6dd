"""Chat requests become prompts as vLLM renders them: template text, then tokens (so
`chat_template_kwargs` are template variables only), `documents`, `continue_final_message` of
any role, the reply's role, text-like content parts, `add_special_tokens`, and a rendered prompt
that is empty or outside the vocabulary refused at once. Also `LLM.chat`'s vLLM conventions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers.processors import TemplateProcessing

from tandem import LLM, SamplingParams
from tandem.router import openai_api
from tandem.router.errors import APIError
from tandem.router.openai_protocol import ChatCompletionRequest
from tandem.router.serving import Serving
from tests.unit.fake_serving import OneTokenServing, fake_serving

DOCS_TEMPLATE = (
    "{% for d in documents or [] %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% if not loop.last or not continue_final_message %}</{{ m.role }}>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SKIPS_SYSTEM = (
    "{% for m in messages %}{% if m.role != 'system' %}{{ m.content }}{% endif %}{% endfor %}"
)
USER = {"role": "user", "content": "the river"}


def _chat(serving: OneTokenServing, **body: Any) -> tuple[list[int], dict[str, Any]]:
    request = ChatCompletionRequest.model_validate({"max_tokens": 1, **body})
    response = asyncio.run(openai_api.create_chat_completion(serving, request))
    if body.get("stream"):
        events = response.body_iterator  # type: ignore[attr-defined]

        async def first() -> Any:
            async for chunk in events:
                return chunk

        text = asyncio.run(first())
        text = text.decode() if isinstance(text, bytes) else text
        return serving.last.prompt_token_ids, json.loads(text.removeprefix("data: "))
    return serving.last.prompt_token_ids, json.loads(response.body)


def _text(serving: Serving, ids: list[int]) -> str:
    return serving.tokenizer.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"truncation": True, "max_length": 3},
        {"padding": "max_length", "max_length": 40},
        {"tokenizer_kwargs": {"add_special_tokens": True}},
        {"return_assistant_tokens_mask": True},
    ],
)
def test_tokenizing_options_in_template_kwargs_change_nothing(
    path: Path, kwargs: dict[str, Any]
) -> None:
    serving = fake_serving(path, DOCS_TEMPLATE)
    plain, _ = _chat(serving, messages=[USER])
    ids, _ = _chat(serving, messages=[USER], chat_template_kwargs=kwargs)
    assert ids == plain and _text(serving, ids) == "<user>the river</user><assistant>"


def test_documents_reach_the_template(path: Path) -> None:
    serving = fake_serving(path, DOCS_TEMPLATE)
    docs = [{"title": "Oslo", "text": "cold"}]
    ids, _ = _chat(serving, messages=[USER], documents=docs)
    assert _text(serving, ids) == "[doc Oslo: cold]<user>the river</user><assistant>"
    again, _ = _chat(serving, messages=[USER], chat_template_kwargs={"documents": docs})
    assert again == ids
    other = [{"title": "Bergen", "text": "wet"}]  # (both given: the kwargs' win, as vLLM's)
    both, _ = _chat(
        serving, messages=[USER], documents=other, chat_template_kwargs={"documents": docs}
    )
    assert both == ids


def test_a_user_message_can_be_continued_and_the_reply_takes_its_role(path: Path) -> None:
    serving = fake_serving(path, DOCS_TEMPLATE)
    body = {"messages": [USER], "add_generation_prompt": False, "continue_final_message": True}
    ids, reply = _chat(serving, **body, echo=True)
    assert _text(serving, ids) == "<user>the river"
    assert reply["choices"][0]["message"] == {
        **reply["choices"][0]["message"],
        "role": "user",
        "content": "the riverX",
    }
    _, first_chunk = _chat(serving, **body, stream=True)
    assert first_chunk["choices"][0]["delta"]["role"] == "user"
    _, reply = _chat(serving, messages=[USER])
    assert reply["choices"][0]["message"]["role"] == "assistant"


def test_template_kwargs_set_the_template_options_and_win(path: Path) -> None:
    """As vLLM's: `chat_template_kwargs` over the request's own options for the rendering (the
    reply's role goes by the request's fields, as vLLM's `get_chat_request_role`); `tools`
    there reach the template."""
    serving = fake_serving(path, DOCS_TEMPLATE)
    options = {"add_generation_prompt": False, "continue_final_message": True}
    ids, reply = _chat(serving, messages=[USER], chat_template_kwargs=options)
    assert _text(serving, ids) == "<user>the river"
    assert reply["choices"][0]["message"]["role"] == "assistant"
    ids, _ = _chat(serving, messages=[USER], chat_template_kwargs={"add_generation_prompt": False})
    assert _text(serving, ids) == "<user>the river</user>"
    both = {"add_generation_prompt": True, "continue_final_message": True}
    with pytest.raises(APIError) as clash:  # (transformers refuses what the template is given)
        _chat(serving, messages=[USER], add_generation_prompt=False, chat_template_kwargs=both)
    assert (clash.value.status, clash.value.param) == (400, "messages")
    tools = [{"type": "function", "function": {"name": "dig"}}]
    lists_tools = fake_serving(path, "{{ tools[0].function.name }}{{ messages[0].content }}")
    ids, _ = _chat(lists_tools, messages=[USER], chat_template_kwargs={"tools": tools})
    assert _text(lists_tools, ids) == "digthe river"


def test_refusal_input_output_text_and_thinking_parts_are_text(path: Path) -> None:
    """As vLLM's parts parser takes them (a 400 refused `output_text` and `thinking`)."""
    serving = fake_serving(path, DOCS_TEMPLATE)
    parts = [{"type": "input_text", "text": "a"}, {"type": "refusal", "refusal": "no"},
             {"type": "output_text", "text": "b"}, {"type": "thinking", "thinking": "c"}]  # fmt: skip
    ids, _ = _chat(serving, messages=[{"role": "assistant", "content": parts}])
    assert _text(serving, ids) == "<assistant>a\nno\nb\nc</assistant><assistant>"


def test_add_special_tokens_adds_the_tokenizer_s_to_the_template_s_text(path: Path) -> None:
    serving = fake_serving(path, DOCS_TEMPLATE)
    hf = serving.tokenizer.hf
    bos = hf.convert_tokens_to_ids("<|endoftext|>")
    hf.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    plain, _ = _chat(serving, messages=[USER])
    assert plain[0] != bos  # (vLLM's default: only what the template writes)
    with_bos, _ = _chat(serving, messages=[USER], add_special_tokens=True)
    assert with_bos == [bos, *plain]


def test_an_empty_or_out_of_vocabulary_rendering_is_a_400(path: Path) -> None:
    serving = fake_serving(path, SKIPS_SYSTEM)
    with pytest.raises(APIError) as empty:
        _chat(serving, messages=[{"role": "system", "content": "x"}], add_generation_prompt=False)
    assert (empty.value.status, empty.value.param) == (400, "messages")
    assert "empty" in str(empty.value)
    small = fake_serving(path, SKIPS_SYSTEM, vocab_size=50)
    with pytest.raises(APIError) as outside:
        _chat(small, messages=[{"role": "user", "content": "zebra quartz"}])
    assert (outside.value.status, outside.value.param) == (400, "messages")
    assert "outside the vocabulary" in str(outside.value)


def test_llm_chat_takes_vllm_s_conventions(path: Path) -> None:
    llm = LLM(model=str(path), num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=2)
    tok = llm.get_tokenizer()
    no_content = llm.chat([{"role": "user"}], params)[0]  # content missing: ""
    assert no_content.prompt == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    kw = llm.chat([USER], params, chat_template_kwargs={"add_generation_prompt": False})[0]
    assert kw.prompt_token_ids == tok.encode("<|im_start|>user\nthe river<|im_end|>\n")
    docs = llm.chat(
        [USER],
        params,
        chat_template=DOCS_TEMPLATE,
        chat_template_kwargs={"documents": [{"title": "t", "text": "x"}]},
    )[0]
    assert docs.prompt == "[doc t: x]<user>the river</user><assistant>"
