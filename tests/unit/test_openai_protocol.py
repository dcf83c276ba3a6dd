"""The OpenAI request bodies take what vLLM's take: no `model` (the served one), and a
message's text parts joined with a newline."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tandem.router.errors import APIError, invalid_body
from tandem.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tandem.router.responses_protocol import ResponsesRequest


def test_model_may_be_omitted() -> None:
    assert CompletionRequest.model_validate({"prompt": "hi"}).model is None
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(chat).model is None
    assert ResponsesRequest.model_validate({"input": "hi"}).model is None


def test_text_parts_join_with_a_newline() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    assert body.messages[0].text() == "a\nb"
    no_text = {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
    with pytest.raises(APIError, match="needs a 'text' string"):
        ChatCompletionRequest.model_validate(no_text).messages[0].text()


def test_a_request_chat_template_is_refused_not_ignored() -> None:
    """vLLM refuses one unless its server trusts request templates; it was silently ignored."""
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"}
    )
    with pytest.raises(APIError) as refused:
        body.check_supported()
    assert refused.value.status == 400 and refused.value.param == "chat_template"


def test_sampling_errors_name_their_field() -> None:
    from tandem.router.request_prep import ModelLimits, sampling_params

    limits = ModelLimits(max_model_len=64, vocab_size=100)
    with pytest.raises(APIError) as refused:
        sampling_params(4, 8, {"top_k": -5}, limits)
    assert refused.value.param == "top_k"
    with pytest.raises(Exception, match="finite number"):
        CompletionRequest.model_validate({"prompt": "x", "temperature": float("nan")})


def test_max_completion_tokens_below_one_names_itself() -> None:
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=-2
    )
    with pytest.raises(APIError) as err:
        request.check_supported()
    assert err.value.param == "max_completion_tokens" and "got -2" in err.value.message


def test_audio_output_is_refused_by_name() -> None:
    messages = [{"role": "user", "content": "hi"}]
    for extra in ({"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy"}}):
        request = ChatCompletionRequest(model="m", messages=messages, **extra)
        with pytest.raises(APIError) as err:
            request.check_supported()
        assert err.value.status == 400 and err.value.param == "modalities"
    ChatCompletionRequest(model="m", messages=messages, modalities=["text"]).check_supported()


def test_seed_minus_one_means_unseeded() -> None:
    """vLLM's SamplingParams take seed -1 as no seed (each request samples anew); it was a
    fixed seed here, so `seed: -1` gave the same text every time, and n > 1 seeded 0, 1, ..."""
    from tandem.engine.sampling_params import SamplingParams
    from tandem.router.multi_choice import sample_fields

    body = CompletionRequest.model_validate({"prompt": "hi", "seed": -1, "temperature": 1.0})
    fields = body.sampling_dict()
    assert body.seed is None and "seed" not in fields
    assert "seed" not in sample_fields(fields, 1)
    chat = {"messages": [{"role": "user", "content": "hi"}], "seed": -1}
    assert ChatCompletionRequest.model_validate(chat).seed is None
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert CompletionRequest.model_validate({"prompt": "hi", "seed": -2}).seed == -2


def test_chat_echo_is_the_last_message_when_it_has_the_reply_s_role() -> None:
    """vLLM's chat `echo`: the reply's content starts with the last message when that message
    has the reply's role (assistant; with add_generation_prompt false, the last one's own)."""
    user, partial = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}

    def echoed(messages: list[dict[str, str]], **fields: object) -> str:
        body = {"messages": messages, "echo": True, **fields}
        return ChatCompletionRequest.model_validate(body).echoed_text()

    cont = {"add_generation_prompt": False, "continue_final_message": True}
    assert echoed([user, partial], **cont) == "Hel"
    assert echoed([user, partial]) == "Hel"
    assert echoed([user]) == "" and echoed([user], add_generation_prompt=False) == "Hi"
    assert echoed([user, {"role": "assistant", "content": None}]) == ""
    no_echo = ChatCompletionRequest.model_validate({"messages": [user, partial]})
    assert no_echo.echoed_text() == ""


def test_chat_echo_asks_for_the_prompts_logprobs_as_vllm() -> None:
    """vLLM's chat: `prompt_logprobs` is `top_logprobs` (0 unset) for an echo request that
    does not set it; not streamed (a streamed reply has no such field)."""

    def asked(**fields: object) -> tuple[int | None, int | None]:
        body = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "a"}], **fields}
        )
        return body.prompt_logprobs_field(), body.sampling_dict().get("prompt_logprobs")

    assert asked(echo=True) == (0, 0)
    assert asked(echo=True, logprobs=True, top_logprobs=3) == (3, 3)
    assert asked(echo=True, prompt_logprobs=1) == (1, 1)
    assert asked(echo=True, stream=True) == (None, None)
    assert asked() == (None, None)


def test_beam_search_is_refused_not_ignored() -> None:
    """vLLM's `use_beam_search`: tandem samples, so it is a 400 naming the field (it was
    accepted and ignored); false is fine."""
    for request in (
        CompletionRequest(model="m", prompt="a", use_beam_search=True),
        ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "a"}], use_beam_search=True
        ),
    ):
        with pytest.raises(APIError) as refused:
            request.check_supported()
        assert (refused.value.status, refused.value.param, refused.value.code) == (
            400,
            "use_beam_search",
            "unsupported",
        )
    CompletionRequest(model="m", prompt="a", use_beam_search=False).check_supported()


def test_prompt_logprobs_zero_is_taken_when_streaming() -> None:
    """vLLM refuses only prompt logprobs a stream cannot send (more than 0); 0 asks nothing."""
    zero = CompletionRequest(model="m", prompt="a", stream=True, prompt_logprobs=0)
    zero.check_supported()
    assert "prompt_logprobs" not in zero.sampling_dict()
    with pytest.raises(APIError) as refused:
        CompletionRequest(model="m", prompt="a", stream=True, prompt_logprobs=1).check_supported()
    assert refused.value.param == "prompt_logprobs"
    whole = CompletionRequest(model="m", prompt="a", prompt_logprobs=0).sampling_dict()
    assert whole["prompt_logprobs"] == 0


def test_an_explicit_null_means_the_default() -> None:
    """OpenAI's `n`, `stream`, `logprobs`, `echo` are nullable: clients that send every unset
    field as null got a 400 ("n: Input should be a valid integer"). A field that takes None
    keeps it: `max_tokens: null` is the rest of the context, not the default 16."""
    nulls = {"n": None, "stream": None, "echo": None, "ignore_eos": None, "min_tokens": None}
    body = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": None, **nulls})
    assert (body.n, body.stream, body.echo, body.ignore_eos, body.min_tokens) == (1, 0, 0, 0, 0)
    assert body.max_tokens is None and "max_tokens" in body.model_fields_set
    assert "n" not in body.model_fields_set
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": None, "n": None}
    chat |= {"parallel_tool_calls": None, "add_generation_prompt": None, "stream": None}
    reply = ChatCompletionRequest.model_validate(chat)
    assert (reply.logprobs, reply.n, reply.parallel_tool_calls) == (False, 1, True)
    assert reply.add_generation_prompt is True and reply.stream is False
    with pytest.raises(ValidationError):  # (required: no default to fall back on)
        ChatCompletionRequest.model_validate({"messages": None})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": 123}, "prompt"),  # (not "prompt.str", the first type it may take)
        ({"prompt": "hi", "stop": ["a", None]}, "stop"),
        ({"prompt": "hi", "n": "two"}, "n"),
        ({}, "prompt"),  # missing
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"content": "hi"}]}, "messages.0.role"),  # missing, nested
    ],
)
def test_a_refused_body_names_the_field(body: dict[str, Any], param: str) -> None:
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(ValidationError) as refused:
        model.model_validate(body)
    error = invalid_body(refused.value.errors(), body)
    assert (error.status, error.param) == (400, param)


def test_legacy_function_llama_ipython_and_custom_roles_go_to_the_template() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "function", "name": "get_weather", "content": "sunny"},
                {"role": "ipython", "content": "21 C"},
            ]
        }
    )
    assert [(m["role"], m["content"]) for m in body.template_messages()] == [
        ("user", "weather?"),
        ("function", "sunny"),
        ("ipython", "21 C"),
    ]
    # any other role too, as vLLM's (a template that does not know it refuses it: a 400)
    custom = {"messages": [{"role": "observation", "content": "x"}]}
    assert ChatCompletionRequest.model_validate(custom).template_messages()[0]["role"] == (
        "observation"
    )
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "", "content": "x"}]})
