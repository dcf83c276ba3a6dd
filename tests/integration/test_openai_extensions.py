"""The OpenAI API beyond one plain completion, end to end through the real `openai` client on
1 prefill + 1 decode and 2 + 2: several choices, logprobs, echo, penalties and vLLM's sampling
and text fields, each as the colocated engine gives it (structured output and tool calls:
test_openai_tools.py)."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tests.integration.openai_shared import (
    MAX_TOKENS,
    PROMPTS,
    client,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_batch_of_prompts_with_n_choices_each(base_url: str, expected: list[Any]) -> None:
    """Choice i is sample i % n of prompt i // n; each is exact (greedy), and usage counts
    each prompt once."""
    c = client(base_url)
    extra = {"ignore_eos": True}
    out = c.completions.create(
        model="tiny",
        prompt=PROMPTS[:3],
        n=2,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body=extra,
    )
    assert [ch.index for ch in out.choices] == list(range(6))
    assert [ch.text for ch in out.choices] == [expected[i // 2].text for i in range(6)]
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected[:3])
    assert out.usage.completion_tokens == 6 * MAX_TOKENS
    stream = c.completions.create(
        model="tiny",
        prompt=[PROMPTS[4], PROMPTS[14]],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    texts = ["", ""]
    chunks = list(stream)
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == [expected[4].text, expected[14].text]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2 * MAX_TOKENS


def test_logprobs_through_the_cluster_equal_the_colocated_engine_s(
    base_url: str, reference: LLM
) -> None:
    """Completions (streamed and not) and chat: each token's logprob and alternatives as the
    in-process engine computes them; the first token's come from the prefill worker."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    want = reference.generate([PROMPTS[6]], params, use_tqdm=False)[0]
    assert want.logprobs is not None
    want_lps = [lp for lp, _ in want.logprobs]
    tok = reference.engine.tokenizer
    c = client(base_url)
    common: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPTS[6],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    out = c.completions.create(**common)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert lp.token_logprobs == pytest.approx(want_lps, abs=1e-4)
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp.top_logprobs is not None and all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    as_ids = (
        c.completions.create(
            **{**common, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
        )
        .choices[0]
        .logprobs
    )
    assert as_ids is not None and as_ids.tokens == [f"token_id:{t}" for t in want.token_ids]
    assert as_ids.top_logprobs is not None and all(
        k.startswith("token_id:") for top in as_ids.top_logprobs for k in top
    )
    stream = c.completions.create(**common, stream=True)
    streamed: list[float] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert streamed == pytest.approx(want_lps, abs=1e-4)
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPTS[6]}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


def test_echo_penalties_and_logit_bias(base_url: str, reference: LLM, expected: list[Any]) -> None:
    """`echo` puts the prompt's text before the completion (token id prompts too, streamed or
    not); penalties and `logit_bias` give the colocated engine's tokens."""
    c = client(base_url)
    extra = {"ignore_eos": True}
    out = c.completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=MAX_TOKENS,
        temperature=0,
        echo=True,
        extra_body=extra,
    )
    assert out.choices[0].text == PROMPTS[2] + expected[2].text
    ids = expected[3].prompt_token_ids
    stream = c.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        echo=True,
        stream=True,
        extra_body=extra,
    )
    texts = [ch.choices[0].text for ch in stream if ch.choices]
    prompt_text = reference.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert texts[0] == prompt_text and "".join(texts[1:]) == expected[3].text
    params = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        presence_penalty=0.8,
        frequency_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias={7: 2.5},
    )
    want = reference.generate([PROMPTS[5]], params, use_tqdm=False)[0]
    got = c.completions.create(
        model="tiny",
        prompt=PROMPTS[5],
        max_tokens=MAX_TOKENS,
        temperature=0,
        presence_penalty=0.8,
        frequency_penalty=0.3,
        logit_bias={"7": 2.5},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )
    assert got.choices[0].text == want.text and want.text != expected[5].text


def test_echo_with_logprobs_scores_the_prompt(base_url: str, reference: LLM) -> None:
    """lm-eval's loglikelihood request (echo, logprobs=1, max_tokens=1): the prompt's tokens
    with their logprobs (the first null), then the completion's, as the in-process engine
    computes them; twice, the second time with the prompt cached on the workers."""
    prompt = "score this prompt token by token, as an evaluation harness does"
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    want = reference.generate([prompt], params, use_tqdm=False)[0]
    assert want.prompt_logprob_entries is not None and want.logprobs is not None
    want_lps = [None if e is None else e[0] for e in want.prompt_logprob_entries] + [
        want.logprobs[0][0]
    ]
    tok = reference.engine.tokenizer
    for _ in range(2):
        out = client(base_url).completions.create(
            model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        choice = out.choices[0]
        assert choice.text == prompt + want.text
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(want_lps[1:], abs=1e-4)
        ids = want.prompt_token_ids + want.token_ids
        assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
        assert lp.text_offset is not None and lp.text_offset[-1] == len(prompt)
    # max_tokens 0 (vLLM's; lm-eval sends it): the prompt and its logprobs, nothing generated
    only = client(base_url).completions.create(
        model="tiny", prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    choice = only.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert only.usage is not None and only.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None
    assert len(lp.token_logprobs) == len(want.prompt_token_ids)
    assert lp.token_logprobs[1:] == pytest.approx(want_lps[1:-1], abs=1e-4)
    resp = requests.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 1, "stream": True},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"


def test_prompt_logprobs_are_vllms_field(base_url: str, reference: LLM) -> None:
    """vLLM's `prompt_logprobs` (completions: per choice; chat: at the top): per prompt token
    (the first null) its logprob, rank and text, then the most likely alternatives', as the
    in-process engine computes them; refused when streaming."""
    prompt = "the prompt tokens, each scored"
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    want = reference.generate([prompt], params, use_tqdm=False)[0]
    assert want.prompt_logprob_entries is not None
    tok = reference.engine.tokenizer
    c = client(base_url)
    body = {"prompt_logprobs": 2}
    out = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, extra_body=body
    )
    got = out.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert out.choices[0].logprobs is None and got[0] is None
    assert len(got) == len(want.prompt_token_ids)
    scored = want.prompt_logprob_entries[1:]
    for token, entry, (lp, top, rank) in zip(
        want.prompt_token_ids[1:], got[1:], scored, strict=True
    ):  # type: ignore[misc]
        mine = entry[str(token)]
        assert mine["rank"] == rank and mine["logprob"] == pytest.approx(lp, abs=1e-4)
        assert mine["decoded_token"] == tok.decode([token], skip_special_tokens=False)
        for i, (alt, alt_lp) in enumerate(top):
            if alt != token:
                assert entry[str(alt)]["rank"] == i + 1
                assert entry[str(alt)]["logprob"] == pytest.approx(alt_lp, abs=1e-4)
        assert len(entry) == len({token, *(t for t, _ in top)})
    messages = [{"role": "user", "content": "hi"}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=body)  # type: ignore[arg-type]
    scored = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert scored[0] is None and len(scored) == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(len(e) >= 1 for e in scored[1:])
    resp = requests.post(
        f"{base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "prompt_logprobs": 1, "stream": True},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"


def test_return_token_ids_gives_the_ids_next_to_the_text(
    base_url: str, expected: list[Any], reference: LLM
) -> None:
    """vLLM's `return_token_ids`: the prompt's and the output's token ids; streamed, the
    prompt's in a choice's first chunk and each chunk's own ids."""
    c = client(base_url)
    tok = reference.engine.tokenizer
    body = {"return_token_ids": True, "ignore_eos": True}
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[1], "temperature": 0}
    kwargs.update(max_tokens=MAX_TOKENS, extra_body=body)
    choice = c.completions.create(**kwargs).choices[0].model_extra or {}
    assert choice["prompt_token_ids"] == tok.encode(PROMPTS[1])
    assert choice["token_ids"] == expected[1].token_ids
    chunks = [ch.choices[0].model_extra or {} for ch in c.completions.create(stream=True, **kwargs)]
    assert chunks[0]["prompt_token_ids"] == tok.encode(PROMPTS[1])
    assert all("prompt_token_ids" not in ch for ch in chunks[1:])
    assert [t for ch in chunks for t in ch["token_ids"]] == expected[1].token_ids
    messages = [{"role": "user", "content": "ids, please"}]
    chat_kwargs: dict[str, Any] = {"model": "tiny", "messages": messages, "temperature": 0}
    chat_kwargs.update(max_tokens=6, extra_body=body)
    chat = c.chat.completions.create(**chat_kwargs)
    prompt_ids = (chat.model_extra or {})["prompt_token_ids"]
    assert prompt_ids == tok.apply_chat_template(messages)
    want = reference.generate(
        [prompt_ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )[0]
    assert (chat.choices[0].model_extra or {})["token_ids"] == want.token_ids
    events = list(c.chat.completions.create(stream=True, **chat_kwargs))
    assert (events[0].model_extra or {})["prompt_token_ids"] == prompt_ids
    streamed = [
        t for ev in events if ev.choices for t in (ev.choices[0].model_extra or {})["token_ids"]
    ]
    assert streamed == want.token_ids


def test_stop_string_kept_with_include_stop_str_in_output(
    base_url: str, expected: list[Any]
) -> None:
    """vLLM's `include_stop_str_in_output`: the text ends with the stop string, streamed or not."""
    c = client(base_url)
    full = expected[2].text
    stop = full[len(full) // 3 : len(full) // 3 + 4]
    want = full[: full.find(stop) + len(stop)]
    body = {"include_stop_str_in_output": True, "ignore_eos": True}
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[2], "temperature": 0}
    kwargs.update(max_tokens=MAX_TOKENS, stop=[stop], extra_body=body)
    out = c.completions.create(**kwargs)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (want, "stop")
    stream = c.completions.create(stream=True, **kwargs)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want


def test_special_tokens_in_the_text_only_when_not_skipped(base_url: str, reference: LLM) -> None:
    """vLLM's `skip_special_tokens`: EOS (forced by a bias, generated past with `ignore_eos`)
    writes nothing by default and its own text with False; streamed or not."""
    hf = reference.engine.tokenizer.hf
    c = client(base_url)
    body = {"ignore_eos": True}
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPTS[0], "temperature": 0}
    kwargs.update(max_tokens=3, logit_bias={str(hf.eos_token_id): 100})
    assert c.completions.create(extra_body=body, **kwargs).choices[0].text == ""
    body["skip_special_tokens"] = False
    out = c.completions.create(extra_body=body, **kwargs)
    assert out.choices[0].text == hf.eos_token * 3
    stream = c.completions.create(stream=True, extra_body=body, **kwargs)
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == hf.eos_token * 3


def test_truncate_prompt_tokens_keeps_the_prompts_end(base_url: str, reference: LLM) -> None:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens are the prompt (usage counts
    them), as the engine continues them; -1 keeps what fits next to max_tokens."""
    ids = reference.engine.tokenizer.encode(PROMPTS[3])
    assert len(ids) > 6
    want = reference.generate(
        [ids[-6:]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    c = client(base_url)
    body = {"truncate_prompt_tokens": 6, "ignore_eos": True}
    out = c.completions.create(
        model="tiny", prompt=PROMPTS[3], max_tokens=8, temperature=0, extra_body=body
    )
    assert out.choices[0].text == want.text
    assert out.usage is not None and out.usage.prompt_tokens == 6
    whole = c.completions.create(
        model="tiny",
        prompt=PROMPTS[3],
        max_tokens=8,
        temperature=0,
        extra_body={"truncate_prompt_tokens": -1},
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)


def test_allowed_token_ids_and_bad_words_through_the_cluster(base_url: str, reference: LLM) -> None:
    """vLLM's `allowed_token_ids`: the prefill's first token and decode's others stay in the
    set, as the engine picks them."""
    allowed = [40, 41, 42, 97, 98]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
    want = reference.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    body = {"allowed_token_ids": allowed, "ignore_eos": True}
    out = client(base_url).completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=0, extra_body=body
    )
    assert out.choices[0].text == want.text and set(want.token_ids) <= set(allowed)
    words = [want.text[1:3]] if want.text[1:3].strip() else ["ab"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=words)
    want = reference.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    out = client(base_url).completions.create(
        model="tiny",
        prompt=PROMPTS[2],
        max_tokens=6,
        temperature=0,
        extra_body={"bad_words": words, "ignore_eos": True},
    )
    assert out.choices[0].text == want.text  # (vLLM's bad_words, the same through the cluster)


def test_x_request_id_names_the_response(base_url: str, expected: list[Any]) -> None:
    """vLLM's `X-Request-Id`: the response's id is `cmpl-<id>` / `chatcmpl-<id>` and the
    header comes back; the same id sent twice at once gives two exact answers (its requests
    get ids of their own on the workers); an id of over 256 characters is a 400. On Serve's
    proxy and on the router's own port alike."""
    from concurrent.futures import ThreadPoolExecutor

    url = f"{base_url}/v1/completions"
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0}
    body["ignore_eos"] = True
    headers = {"X-Request-Id": "trace-42"}
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: requests.post(url, json=body, headers=headers), [0, 1]))
    for answer in answers:
        assert answer.status_code == 200 and answer.headers["x-request-id"] == "trace-42"
        assert answer.json()["id"] == "cmpl-trace-42"
        assert answer.json()["choices"][0]["text"] == expected[2].text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with requests.post(
        f"{base_url}/v1/chat/completions",
        json={**chat, "stream": True},
        headers=headers,
        stream=True,
    ) as streamed:
        assert streamed.headers["x-request-id"] == "trace-42"
        events = [line for line in streamed.iter_lines() if line.startswith(b"data: {")]
    assert events and all(b'"id":"chatcmpl-trace-42"' in e for e in events)
    long_id = requests.post(url, json=body, headers={"X-Request-Id": "x" * 257})
    assert long_id.status_code == 400 and long_id.json()["error"]["param"] == "x-request-id"
    plain = requests.post(url, json=body)  # (one is made for it, as Serve's proxy makes one)
    assert plain.json()["id"] == f"cmpl-{plain.headers['x-request-id']}"
