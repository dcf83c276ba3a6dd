"""Router options of the cluster config, on one deployment: `chat_template` (the chat API
renders with it instead of the checkpoint's, exactly as transformers renders that template)
and `router.reasoning_parser` (a reply's thoughts in `reasoning_content`)."""

from __future__ import annotations

import json

import pytest

from tandem import LLM, SamplingParams
from tests.integration.conftest import Cluster
from tests.integration.openai_shared import client

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def base_url(cluster: Cluster) -> str:
    return cluster.deploy(chat_template=TEMPLATE, router={"reasoning_parser": "qwen3"})


def test_the_configured_chat_template_renders_the_chat(cluster: Cluster, base_url: str) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is tandem?"},
    ]
    reference = LLM(model=str(cluster.model), num_kv_blocks=128)
    hf = reference.engine.tokenizer.hf
    ids = [
        int(t)
        for t in hf.apply_chat_template(
            messages,
            chat_template=TEMPLATE,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    ]
    want = reference.generate(
        [ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    out = client(base_url).chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == want.text


def test_thoughts_go_to_reasoning_content(base_url: str) -> None:
    """qwen3's parser: `<think>...</think>` (written here by a grammar) is the reply's
    reasoning_content, the rest its content; streamed, the same split delta by delta."""
    reply = "<think>two and two</think>Four."
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "2+2?"}],
        "max_tokens": 64,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"grammar": f"root ::= {json.dumps(reply)}"}},
    }
    c = client(base_url)
    message = c.chat.completions.create(**kwargs).choices[0].message  # type: ignore[call-overload]
    assert (message.reasoning_content, message.content) == ("two and two", "Four.")  # type: ignore[attr-defined]
    deltas = [
        ch.choices[0].delta for ch in c.chat.completions.create(stream=True, **kwargs) if ch.choices
    ]  # type: ignore[call-overload]
    thoughts = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]  # type: ignore[attr-defined]
    assert "".join(thoughts) == "two and two" and len(thoughts) > 1
    assert "".join(d.content or "" for d in deltas) == "Four."


def test_structured_output_waits_for_the_thoughts_to_end(cluster: Cluster, base_url: str) -> None:
    """With a reasoning parser the router lets the model think before the structure
    constrains it (`reasoning_tags`): a prompt that opens `<think>` gets the model's own
    greedy tokens, not the choice's; without one open, the choice."""
    reference = LLM(model=str(cluster.model), num_kv_blocks=128)
    tok = reference.tokenizer
    opened = tok.encode("2+2?") + tok.encode("<think>", add_special_tokens=False)
    free = reference.generate(
        [opened], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert "</think>" not in free.text
    c = client(base_url)
    choice = {"structured_outputs": {"choice": ["yes", "no"]}, "ignore_eos": True}
    thinking = c.completions.create(
        model="tiny", prompt=opened, max_tokens=6, temperature=0, extra_body=choice
    )
    assert thinking.choices[0].text == free.text
    answer = c.completions.create(
        model="tiny", prompt=tok.encode("2+2?"), max_tokens=6, temperature=0, extra_body=choice
    )
    assert answer.choices[0].text in ("yes", "no")
