"""`chat_template` in the cluster config: the chat API renders with it instead of the
checkpoint's template, exactly as transformers renders that template."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tests.integration.conftest import Cluster
from tests.integration.openai_shared import client

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_the_configured_chat_template_renders_the_chat(cluster: Cluster) -> None:
    base_url = cluster.deploy(chat_template=TEMPLATE)
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
