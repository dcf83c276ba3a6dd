"""A script written for vLLM's offline API runs on tandem as it is: vLLM's types import from
`tandem`, `generate` and `chat` take their arguments in vLLM's order, and vLLM's checks hold
(`max_logprobs`, `best_of`, text-only prompts)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tandem import (
    LLM,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    TextPrompt,
    TokensPrompt,
)
from tandem.engine.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Any) -> LLM:
    return LLM(model=str(tiny_checkpoint()), num_kv_blocks=128, max_logprobs=3)


def test_vllms_types_import_from_tandem(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("hello there")
    want = llm.generate("hello there", GREEDY)[0].token_ids
    outs = llm.generate(
        [TextPrompt(prompt="hello there"), TokensPrompt(prompt_token_ids=ids)], GREEDY
    )
    assert [o.token_ids for o in outs] == [want, want]
    assert GuidedDecodingParams is StructuredOutputsParams
    choice = StructuredOutputsParams(choice=["yes", "no"])
    for params in (
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice),
        SamplingParams(
            temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"])
        ),
    ):
        assert params.choice == ["yes", "no"]
        assert llm.generate("answer:", params)[0].outputs[0].text in ("yes", "no")


def test_vllms_sampling_fields_are_taken(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0,
        max_tokens=5,
        ignore_eos=True,
        best_of=None,
        output_kind=RequestOutputKind.FINAL_ONLY,
        extra_args={"plugin": 1},
    )
    assert params.extra_args == {"plugin": 1}
    assert llm.generate("hello", params)[0].token_ids == llm.generate("hello", GREEDY)[0].token_ids
    assert SamplingParams(n=2, best_of=2).best_of == 2
    with pytest.raises(InvalidRequestError, match="best_of=3 is not supported"):
        SamplingParams(n=1, best_of=3)


def test_generate_and_chat_take_vllms_positional_order(llm: LLM) -> None:
    want = llm.generate("hello", GREEDY)[0].token_ids
    assert llm.generate("hello", GREEDY, False)[0].token_ids == want  # (use_tqdm third)
    chat = [{"role": "user", "content": "hi"}]
    by_name = llm.chat(chat, GREEDY, use_tqdm=False)[0].token_ids
    assert llm.chat(chat, GREEDY, False, None)[0].token_ids == by_name
    assert llm.chat(chat, GREEDY, chat_template_content_format="string")[0].token_ids == by_name
    with pytest.raises(InvalidRequestError, match="chat_template_content_format"):
        llm.chat(chat, GREEDY, chat_template_content_format="xml")
    with pytest.raises(InvalidRequestError, match="text only"):
        llm.chat(chat, GREEDY, mm_processor_kwargs={"num_crops": 4})


def test_priorities_order_the_waiting_prompts(llm: LLM) -> None:
    prompts = ["one", "two", "three"]
    plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    ranked = llm.generate(prompts, GREEDY, priority=[2, 0, 1])
    assert [o.token_ids for o in ranked] == plain  # (outputs stay in the prompts' order)
    with pytest.raises(InvalidRequestError, match="2 priorities for 3 prompts"):
        llm.generate(prompts, GREEDY, priority=[0, 1])


def test_max_logprobs_bounds_what_a_request_asks(llm: LLM) -> None:
    out = llm.generate("hello", SamplingParams(max_tokens=2, logprobs=3, prompt_logprobs=3))
    assert all(len(entry) >= 3 for entry in out[0].outputs[0].logprobs or [])
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(
            InvalidRequestError, match=f"{field}: requested 4, more than max_logprobs \\(3\\)"
        ):
            llm.generate("hello", SamplingParams(max_tokens=2, **{field: 4}))


def test_max_logprobs_may_be_raised_past_the_default_as_vllms(tiny_checkpoint: Any) -> None:
    """`LLM(max_logprobs=50)` (or -1: no bound) lets a request ask for more than the API's 20
    alternatives; by default 21 is refused."""
    path = str(tiny_checkpoint())
    params = SamplingParams(max_tokens=2, logprobs=30, prompt_logprobs=25)
    for bound in (50, -1):
        out = LLM(model=path, num_kv_blocks=16, max_logprobs=bound).generate("hello", params)
        assert all(len(entry) >= 30 for entry in out[0].outputs[0].logprobs or [None])
        assert all(len(e) >= 25 for e in (out[0].prompt_logprobs or [None])[1:])
    with pytest.raises(InvalidRequestError, match="more than max_logprobs \\(20\\)"):
        LLM(model=path, num_kv_blocks=16).generate("hello", params)
    # -1: the whole vocabulary, where max_logprobs is -1 (as vLLM's); the default bounds it
    whole = SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=-1)
    out = LLM(model=path, num_kv_blocks=16, max_logprobs=-1).generate("hello", whole)[0]
    vocab = len(out.outputs[0].logprobs[0])  # type: ignore[index]
    assert vocab == out.prompt_logprobs[1].__len__() > 30  # type: ignore[index]
    with pytest.raises(InvalidRequestError, match=f"logprobs: requested {vocab}, more than"):
        LLM(model=path, num_kv_blocks=16).generate("hello", whole)


def test_sampling_params_read_back_as_vllms() -> None:
    """Scripts add to the defaults' lists, and read vLLM's derived fields."""
    params = SamplingParams(stop=None, stop_token_ids=None, bad_words=None)
    assert (params.stop, params.stop_token_ids, params.bad_words, params.top_k) == ([], [], [], 0)
    params.stop_token_ids.append(7)
    assert params.all_stop_token_ids == {7} and SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=-1).top_k == -1  # (kept, as vLLM keeps it)
    kinds = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(seed=3)]
    assert [p.sampling_type.name for p in kinds] == ["GREEDY", "RANDOM", "RANDOM_SEED"]
    optional = SamplingParams.from_optional(n=None, temperature=None, logit_bias={"5": 300})
    assert (optional.n, optional.temperature, optional.logit_bias) == (1, 1.0, {5: 100.0})
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert choice.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams().structured_outputs is None
    with pytest.raises(InvalidRequestError, match="one constraint, got regex, choice"):
        StructuredOutputsParams(regex="a+", choice=["a"])


@pytest.mark.parametrize("ids", [[1.5, 2.7], ["5", "7"], b"hello", "57"])
def test_token_id_prompts_are_ints_only(llm: LLM, ids: Any) -> None:
    with pytest.raises(InvalidRequestError, match="token-id prompts are lists of ints"):
        llm.generate({"prompt_token_ids": ids}, GREEDY)


def test_chat_refuses_a_conversation_that_is_not_messages(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="a conversation is a list of dicts"):
        llm.chat(["hello"], GREEDY)  # type: ignore[list-item]


def test_multimodal_data_is_refused_not_dropped(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="multi_modal_data: this model takes text only"):
        llm.generate({"prompt": "describe", "multi_modal_data": {"image": object()}}, GREEDY)


def test_vllms_no_op_engine_arguments(tiny_checkpoint: Any) -> None:
    path = str(tiny_checkpoint())
    llm = LLM(
        model=path,
        num_kv_blocks=8,
        download_dir="/nowhere",
        load_format="safetensors",
        runner="generate",
        limit_mm_per_prompt={"image": 0},
        max_logprobs=-1,
        logprobs_mode="raw_logprobs",
    )
    assert llm.generate("hi", GREEDY)[0].token_ids
    for kwargs, match in [
        ({"runner": "pooling"}, "runner='pooling'"),
        ({"load_format": "dummy"}, "load_format='dummy'"),
        ({"max_logprobs": -5}, "max_logprobs"),
        ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode='processed_logprobs'"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(model=path, num_kv_blocks=8, **kwargs)


def test_logit_bias_takes_any_value_offline_and_minus_inf_bans(llm: LLM) -> None:
    first = llm.generate("hello", GREEDY)[0].token_ids[0]
    banned = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, logit_bias={first: -math.inf}
    )
    assert first not in llm.generate("hello", banned)[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={7: 1e4})
    assert llm.generate("hello", forced)[0].token_ids == [7, 7, 7]
    for bias in (math.inf, math.nan):
        with pytest.raises(InvalidRequestError, match="finite or -inf"):
            SamplingParams(logit_bias={7: bias})


def test_progress_bar_by_default_as_vllms(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(["a", "b"], GREEDY)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    made = []

    def bar(**kwargs: Any) -> Any:
        from tqdm import tqdm

        made.append(kwargs["total"])
        return tqdm(**kwargs)

    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=bar)
    assert made == [3]
