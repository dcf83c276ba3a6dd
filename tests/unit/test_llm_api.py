"""`tandem.LLM` takes vLLM's calls: `generate(prompts, sampling_params=...)` with texts, token
ids or vLLM's prompt dicts, `chat(...)` with the checkpoint's chat template, `get_tokenizer()`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.errors import InvalidRequestError, PromptTooLongError

GREEDY_FIELDS: dict[str, Any] = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
GREEDY = SamplingParams(**GREEDY_FIELDS)


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
    rendered = llm.tokenizer.apply_chat_template(messages)
    hf = llm.get_tokenizer()  # the Hugging Face tokenizer, as vLLM's
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and hf.encode(text, add_special_tokens=False) == rendered
    want = llm.generate([rendered], GREEDY)[0]
    one = llm.chat(messages, GREEDY)
    assert [o.token_ids for o in one] == [want.token_ids]
    assert one[0].prompt_token_ids == rendered
    assert one[0].prompt == text and one[0].metrics is None  # (vLLM's fields)
    two = llm.chat([messages, messages[1:]], sampling_params=GREEDY)
    assert len(two) == 2 and two[0].token_ids == want.token_ids
    assert two[1].prompt_token_ids == llm.tokenizer.apply_chat_template(messages[1:])


def test_chat_takes_a_template_and_tools_as_vllm_does(llm: LLM) -> None:
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    template = (
        "{% for t in tools or [] %}[tool {{ t['function']['name'] }}]{% endfor %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    hf = llm.get_tokenizer()
    want = hf.apply_chat_template(
        messages, chat_template=template, tools=tools, tokenize=True, return_dict=False
    )
    out = llm.chat(messages, GREEDY, chat_template=template, tools=tools)[0]
    assert out.prompt_token_ids == list(want)
    assert hf.decode(out.prompt_token_ids).startswith("[tool get_weather]<user>weather")
    plain = llm.chat(messages, GREEDY, chat_template=template)[0]
    assert hf.decode(plain.prompt_token_ids).startswith("<user>weather")


def test_outputs_hold_n_samples_as_vllms_do(llm: LLM) -> None:
    """vLLM's `RequestOutput.outputs`: `n` samples per prompt, sample i seeded `seed + i`;
    the flat fields are the first sample's."""
    params = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True)
    outs = llm.generate(["hello there", "a b c"], params)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    for prompt, out in zip(["hello there", "a b c"], outs, strict=True):
        for i, sample in enumerate(out.outputs):
            one = SamplingParams(temperature=0.9, seed=5 + i, max_tokens=6, ignore_eos=True)
            want = llm.generate(prompt, one)[0]
            assert sample.index == i and sample.token_ids == want.token_ids
            assert sample.text == want.text and sample.finish_reason == "length"
        assert out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
        assert out.prompt == prompt
    assert len({tuple(s.token_ids) for s in outs[0].outputs}) > 1  # (different seeds)
    assert llm.engine.requests == {}
    with pytest.raises(InvalidRequestError, match="one sample"):
        llm.engine.add_request("x", SamplingParams(n=2))


def test_sample_logprobs_in_vllms_shape(llm: LLM) -> None:
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, logprobs=2))[0]
    sample = out.outputs[0]
    assert out.logprobs is not None and sample.logprobs is not None
    assert sample.cumulative_logprob == pytest.approx(sum(lp for lp, _ in out.logprobs))
    tok = llm.get_tokenizer()
    for token, entry, (lp, top) in zip(
        sample.token_ids, sample.logprobs, out.logprobs, strict=True
    ):
        assert entry[token].logprob == lp and entry[token].rank == 1  # (greedy: the most likely)
        assert entry[token].decoded_token == tok.decode([token], skip_special_tokens=False)
        assert [(t, entry[t].logprob, entry[t].rank) for t, _ in top] == [
            (t, alt, i + 1) for i, (t, alt) in enumerate(top)
        ]
    plain = llm.generate("hello", GREEDY)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_vllms_engine_arguments(tiny_checkpoint: Any, tmp_path: Any) -> None:
    """vLLM's constructor arguments: dtype "auto" (the checkpoint's) and its aliases; those
    that change nothing here are taken; those asking for what tandem does not do are refused."""
    path = str(tiny_checkpoint())
    vllm_style = LLM(
        model=path,
        dtype="auto",
        num_kv_blocks=64,
        gpu_memory_utilization=0.9,
        enforce_eager=True,
        trust_remote_code=True,
        tensor_parallel_size=1,
        tokenizer=path + "/",  # (the model's directory, however spelled)
        scheduling_policy="priority",  # (vLLM's switch for `generate(priority=...)`)
    )
    assert vllm_style.engine.config.dtype == "float32"  # (the tiny checkpoint's)
    assert vllm_style.generate("hi", GREEDY)[0].token_ids
    assert LLM(model=path, dtype="half", num_kv_blocks=8).engine.config.dtype == "float16"
    as_torch = LLM(model=path, dtype=torch.bfloat16, num_kv_blocks=8, task="generate", seed=0)
    assert as_torch.engine.config.dtype == "bfloat16"
    bf16 = str(tiny_checkpoint(dtype="bfloat16"))
    assert EngineConfig(model=bf16, dtype="auto").dtype == "bfloat16"
    for kwargs, match in [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
        ({"quantization": "awq"}, "quantization"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        ({"max_logprobs": -2}, "max_logprobs"),
        ({"enable_lora": True}, "enable_lora=True: vLLM's argument is not supported"),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(model=path, num_kv_blocks=8, **kwargs)
    # (vLLM's arguments at their defaults ask for nothing: an `LLM(**vars(args))` script)
    at_defaults = {"revision": "main", "download_dir": None, "load_format": "auto", "seed": None,
                   "enable_lora": False, "cpu_offload_gb": 0, "max_logprobs": 20}  # fmt: skip
    assert LLM(model=path, num_kv_blocks=8, **at_defaults).generate("hi", GREEDY)[0].token_ids


def test_vllms_llm_members(llm: LLM) -> None:
    """`llm_engine` (its tokenizer and model_config), `reset_prefix_cache()`; what tandem does
    not do (beam search, pooling, sleep) says so."""
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()
    assert llm.llm_engine.model_config.max_model_len == llm.engine.max_model_len
    prompt = {"prompt_token_ids": list(range(10, 60))}
    llm.generate([prompt], GREEDY)
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    for name in ("beam_search", "encode", "embed", "score", "sleep", "wake_up"):
        with pytest.raises(NotImplementedError, match="not supported by tandem"):
            getattr(llm, name)(["hi"])
    for name in ("beam_search", "encode", "embed", "classify", "score", "reward"):
        with pytest.raises(ValueError, match="not supported by tandem"):  # (vLLM's type)
            getattr(llm, name)(["hi"])


def test_the_default_dtype_is_the_checkpoints(tiny_checkpoint: Any) -> None:
    """As vLLM's and transformers 5's `dtype="auto"`: a bf16 checkpoint runs in bf16 unless
    told otherwise, a float32 one in float32; a config naming no readable checkpoint, float32."""
    bf16 = str(tiny_checkpoint(dtype="bfloat16"))
    assert EngineConfig(model=bf16).dtype == "bfloat16"
    assert LLM(model=bf16, num_kv_blocks=8).engine.config.dtype == "bfloat16"
    assert EngineConfig(model=bf16, dtype="float32").dtype == "float32"
    assert EngineConfig(model=str(tiny_checkpoint())).dtype == "float32"
    assert EngineConfig(model="/nonexistent/checkpoint").dtype == "float32"


def test_the_default_device_is_the_gpu_when_there_is_one(llm: LLM) -> None:
    """As vLLM, which always uses the accelerator: `device="auto"` (a cluster's engines stay
    on "cpu" unless their role asks Ray for a GPU)."""
    assert llm.engine.config.device == "auto"
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert llm.engine.device.type == want
    assert EngineConfig(model="/nonexistent/checkpoint").device == "cpu"


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm: LLM) -> None:
    ids = list(range(10, 40))
    out = llm.generate([ids], SamplingParams(truncate_prompt_tokens=5, **GREEDY_FIELDS))[0]
    assert out.prompt_token_ids == ids[-5:]
    assert out.token_ids == llm.generate([ids[-5:]], GREEDY)[0].token_ids
    small = LLM(model=llm.engine.config.model, num_kv_blocks=16, max_model_len=20)
    whole = small.generate([ids], SamplingParams(truncate_prompt_tokens=-1, **GREEDY_FIELDS))[0]
    assert whole.prompt_token_ids == ids[-19:]  # (room for one generated token)
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    assert SamplingParams(spaces_between_special_tokens=False).skip_special_tokens  # (taken)


def test_chat_takes_content_parts_as_the_api_does(llm: LLM) -> None:
    """OpenAI's list of text parts, joined with a newline (as vLLM and the chat API do)."""
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    as_parts = llm.chat([{"role": "user", "content": parts}], GREEDY)[0]
    as_text = llm.chat([{"role": "user", "content": "hi\nthere"}], GREEDY)[0]
    assert as_parts.prompt_token_ids == as_text.prompt_token_ids
    assert as_parts.token_ids == as_text.token_ids
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(InvalidRequestError, match="image_url"):
        llm.chat([{"role": "user", "content": image}], GREEDY)
    with pytest.raises(InvalidRequestError, match="'text' string"):
        llm.chat([{"role": "user", "content": [{"type": "text"}]}], GREEDY)
    # a reply sent back with its empty `tool_calls` list is a message without calls (vLLM
    # drops it: templates that test `'tool_calls' in message` took it for a call)
    reply = {"role": "assistant", "content": "hello", "tool_calls": []}
    calls = "{% for m in messages %}{% if 'tool_calls' in m %}CALLS {% endif %}{{ m.content }}{% endfor %}"
    user = {"role": "user", "content": "hi"}
    back = llm.chat([user, reply], GREEDY, chat_template=calls, add_generation_prompt=False)
    plain = llm.chat(
        [user, {"role": "assistant", "content": "hello"}],
        GREEDY,
        chat_template=calls,
        add_generation_prompt=False,
    )
    assert back[0].prompt_token_ids == plain[0].prompt_token_ids


def test_vllms_sampling_conventions(llm: LLM) -> None:
    """top_k 0 is "disabled", max_tokens None runs to the end of the context, `clone()`,
    and `lora_request=None` is taken."""
    assert (SamplingParams().top_k, SamplingParams(top_k=-1).top_k) == (0, -1)  # as vLLM
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], params, lora_request=None)[0]
    assert len(out.token_ids) == llm.engine.max_model_len - 3
    assert out.outputs[0].finish_reason == "length"
    copy = GREEDY.clone()
    assert copy == GREEDY and copy is not GREEDY
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate("hi", GREEDY, lora_request=object())


def test_detokenize_false_gives_token_ids_only(llm: LLM) -> None:
    want = llm.generate("hello there", GREEDY)[0]
    fields = {**GREEDY_FIELDS, "logprobs": 2, "detokenize": False}
    out = llm.generate("hello there", SamplingParams(**fields))[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert out.outputs[0].text == "" and out.text == ""
    assert want.outputs[0].text != ""
    entries = out.outputs[0].logprobs
    assert entries is not None and len(entries) == len(want.outputs[0].token_ids)
    assert all(lp.decoded_token is None for entry in entries for lp in entry.values())
    with pytest.raises(InvalidRequestError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_logits_processors_none_or_empty_only() -> None:
    assert SamplingParams(logits_processors=[]).logits_processors is None
    with pytest.raises(InvalidRequestError, match="logits processors") as err:
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    assert err.value.param == "logits_processors"


def test_every_sampled_token_has_its_rank(llm: LLM) -> None:
    params = SamplingParams(temperature=1.5, seed=4, max_tokens=24, logprobs=3, ignore_eos=True)
    out = llm.generate("hello there", params)[0]
    sample, entries = out.outputs[0], out.logprobs
    assert sample.logprobs is not None and entries is not None
    outside = 0
    for token, entry, (_, top) in zip(sample.token_ids, sample.logprobs, entries, strict=True):
        rank = entry[token].rank
        alternatives = [t for t, _ in top]
        assert rank is not None
        if token in alternatives:
            assert rank == alternatives.index(token) + 1
        else:
            assert rank > 3
            outside += 1
    assert outside > 0  # (at this temperature some tokens are not among the 3 most likely)
    greedy = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    ranks = [e[t].rank for t, e in zip(*_sample(llm.generate("hi", greedy)[0]), strict=True)]
    assert ranks == [1, 1, 1, 1]


def _sample(out: Any) -> tuple[list[int], list[Any]]:
    return out.outputs[0].token_ids, out.outputs[0].logprobs


def test_a_refused_prompt_of_a_batch_is_named(llm: LLM) -> None:
    """In a batch, the error says which prompt it refused, and nothing of the batch stays in
    the engine (the next batch runs in full)."""
    too_long = [10 + i % 100 for i in range(llm.engine.max_model_len)]
    with pytest.raises(PromptTooLongError, match=r"^prompt 1: prompt has \d+ tokens"):
        llm.generate([[10, 11], too_long, [12]], GREEDY)
    with pytest.raises(InvalidRequestError, match=r"^prompt 2: prompt is empty"):
        llm.generate(["a", "b", ""], GREEDY)
    with pytest.raises(PromptTooLongError, match=r"^prompt has"):  # (one prompt: as it was)
        llm.generate([too_long], GREEDY)
    assert not llm.engine.requests
    assert [len(o.token_ids) for o in llm.generate([[10, 11], [12]], GREEDY)] == [5, 5]


def test_sampling_params_take_assignments_as_vllms_do(llm: LLM) -> None:
    """vLLM's own example sets fields of `get_default_sampling_params()`; an assignment is
    checked as the constructor checks it."""
    params = llm.get_default_sampling_params()
    params.max_tokens, params.temperature, params.ignore_eos = 5, 0.0, True
    assert (
        llm.generate([[10, 11]], params)[0].token_ids
        == llm.generate([[10, 11]], GREEDY)[0].token_ids
    )
    with pytest.raises(InvalidRequestError, match="top_p") as refused:
        params.top_p = 5.0
    assert "\n" not in str(refused.value)  # (the constructor's one-line error)
    params.min_tokens = 3
    with pytest.raises(InvalidRequestError, match=r"min_tokens \(3\) must be <= max_tokens \(2\)"):
        params.max_tokens = 2
    with pytest.raises(ValueError, match="unknown"):
        params.unknown = 1  # type: ignore[attr-defined]


def test_vllm_script_habits_work_or_say_what_to_do(llm: LLM) -> None:
    """A tokenized chat from transformers 5 (a BatchEncoding) is its input_ids; an assistant
    turn with content None renders as ""; a dict of sampling fields, or no prompt, is a
    one-line ValueError; a sample says whether it `finished()`."""
    conversation = [{"role": "user", "content": "hi"}]
    encoded = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True)
    ids = list(encoded["input_ids"]) if not isinstance(encoded, list) else encoded
    for prompt in ({"prompt_token_ids": encoded}, encoded):
        assert llm.generate([prompt], GREEDY)[0].prompt_token_ids == ids
    turns = [
        *conversation,
        {"role": "assistant", "content": None},
        {"role": "user", "content": "x"},
    ]
    with_none = llm.chat(turns, GREEDY)[0]
    with_empty = llm.chat([*turns[:1], {"role": "assistant", "content": ""}, turns[2]], GREEDY)[0]
    assert with_none.prompt_token_ids == with_empty.prompt_token_ids
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\(\*\*fields\)"):
        llm.generate("hi", {"temperature": 0})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="give a text"):
        llm.generate(None)  # type: ignore[arg-type]
    sample = llm.generate("hi", GREEDY)[0].outputs[0]
    assert sample.finished() and sample.lora_request is None


def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    """As vLLM refuses them (an allowed set of unknown ids would end the request at once)."""
    vocab = llm.engine.spec.vocab_size
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids has token ids \[\d+\]"):
        llm.generate("hi", SamplingParams(allowed_token_ids=[vocab + 5], **GREEDY_FIELDS))
    with pytest.raises(InvalidRequestError, match="logit_bias has token ids"):
        llm.generate("hi", SamplingParams(logit_bias={vocab: 5.0}, **GREEDY_FIELDS))
    assert not llm.engine.requests


def test_generate_waits_for_its_own_requests_only(tiny_checkpoint: Any) -> None:
    """A request added to the engine beforehand (vLLM's `llm.llm_engine.add_request`) that
    finishes during `generate` is not one of generate's: generate returned its own unfinished."""
    llm = LLM(model=str(tiny_checkpoint()), num_kv_blocks=128)
    alone = llm.generate([[5, 6, 7]], SamplingParams(**{**GREEDY_FIELDS, "max_tokens": 10}))[0]
    llm.llm_engine.add_request("x", [9, 9], SamplingParams(**{**GREEDY_FIELDS, "max_tokens": 1}))
    out = llm.generate([[5, 6, 7]], SamplingParams(**{**GREEDY_FIELDS, "max_tokens": 10}))[0]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert (
        out.outputs[0].token_ids == alone.outputs[0].token_ids
        and len(alone.outputs[0].token_ids) == 10
    )
