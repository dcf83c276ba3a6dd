"""`tandem.LLM` takes vLLM's calls: `generate(prompts, sampling_params=...)` with texts, token
ids or vLLM's prompt dicts, `chat(...)` with the checkpoint's chat template, `get_tokenizer()`."""

from __future__ import annotations

from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> LLM:
    return LLM(model=str(tiny_checkpoint()), num_kv_blocks=128)


def test_prompt_forms_give_the_same_tokens(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("hello there")
    want = llm.generate("hello there", GREEDY)[0].token_ids
    forms: list[Any] = [
        ["hello there"],
        [ids],
        {"prompt": "hello there"},
        [{"prompt_token_ids": ids}],
    ]
    for form in forms:
        outs = llm.generate(form, sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == [want], form
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate([{"text": "x"}], GREEDY)


def test_chat_renders_the_template_as_the_api_does(llm: LLM) -> None:
    messages = [{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}]
    rendered = llm.get_tokenizer().apply_chat_template(messages)
    want = llm.generate([rendered], GREEDY)[0]
    one = llm.chat(messages, GREEDY)
    assert [o.token_ids for o in one] == [want.token_ids]
    assert one[0].prompt_token_ids == rendered
    two = llm.chat([messages, messages[1:]], sampling_params=GREEDY)
    assert len(two) == 2 and two[0].token_ids == want.token_ids
    assert two[1].prompt_token_ids == llm.get_tokenizer().apply_chat_template(messages[1:])
