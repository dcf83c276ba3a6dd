"""Bad requests get a 4xx with an OpenAI-style error body, never a 500; the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

from tests.integration.conftest import Cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]
DEPLOYMENT = "1x1"  # (conftest groups the tests by deployment)

OK = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
}


@pytest.fixture(scope="module")
def base_url(cluster: Cluster) -> str:
    return cluster.deploy_pd(1)


def post(base_url: str, path: str, **kwargs: Any) -> requests.Response:
    return requests.post(f"{base_url}{path}", timeout=30, **kwargs)


def assert_error(resp: requests.Response, status: int, param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["type"]
    if param is not None:
        assert body["error"]["param"] == param, body
    assert "Traceback" not in resp.text


CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-9"}, 404, "model"),
    ("unknown chat model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("max_tokens 0", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {**OK, "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens beyond limit", "/v1/completions", {**OK, "max_tokens": 10**6}, 400, "max_tokens"),
    ("prompt too long", "/v1/completions", {**OK, "prompt": "word " * 3000}, 400, "prompt"),
    ("max_tokens wrong type", "/v1/completions", {**OK, "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature wrong type", "/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("temperature out of range", "/v1/completions", {**OK, "temperature": -1}, 400, "temperature"),
    ("top_p out of range", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_k below -1", "/v1/completions", {**OK, "top_k": -2}, 400, "top_k"),
    ("min_p out of range", "/v1/completions", {**OK, "min_p": 1.5}, 400, "min_p"),
    (
        "allowed_token_ids outside the vocabulary",
        "/v1/completions",
        {**OK, "allowed_token_ids": [1, 10**7]},
        400,
        "allowed_token_ids",
    ),
    (
        "stop_token_ids outside the vocabulary",
        "/v1/completions",
        {**OK, "stop_token_ids": [2, 10**7]},
        400,
        "stop_token_ids",
    ),
    (
        "truncate_prompt_tokens zero",
        "/v1/completions",
        {**OK, "truncate_prompt_tokens": 0},
        400,
        "truncate_prompt_tokens",
    ),
    (
        "truncate_prompt_tokens beyond the context",
        "/v1/completions",
        {**OK, "truncate_prompt_tokens": 10**6},
        400,
        "truncate_prompt_tokens",
    ),
    ("prompt wrong type", "/v1/completions", {**OK, "prompt": {"text": "hi"}}, 400, "prompt"),
    ("prompt missing", "/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("token id outside vocab", "/v1/completions", {**OK, "prompt": [1, 2, 999999]}, 400, "prompt"),
    ("n zero", "/v1/completions", {**OK, "n": 0}, 400, "n"),
    ("too many choices", "/v1/completions", {**OK, "prompt": ["hi"] * 65, "n": 2}, 400, "prompt"),
    ("best_of beyond n", "/v1/completions", {**OK, "n": 2, "best_of": 3}, 400, "best_of"),
    (
        "one prompt of a batch too long",
        "/v1/completions",
        {**OK, "prompt": ["hi", "word " * 3000]},
        400,
        "prompt",
    ),
    ("seed beyond 64 bits", "/v1/completions", {**OK, "seed": 2**70}, 400, "seed"),
    ("min_tokens > max_tokens", "/v1/completions", {**OK, "min_tokens": 9}, 400, None),
    ("repetition_penalty zero", "/v1/completions", {**OK, "repetition_penalty": 0}, 400, None),
    ("presence_penalty beyond 2", "/v1/completions", {**OK, "presence_penalty": 2.5}, 400, None),
    ("logprobs beyond 20", "/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs"),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {**CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("logit_bias key", "/v1/completions", {**OK, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit_bias id", "/v1/completions", {**OK, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("logit_bias beyond 100", "/v1/completions", {**OK, "logit_bias": {"5": 101}}, 400, None),
    ("stream wrong type", "/v1/completions", {**OK, "stream": "maybe"}, 400, "stream"),
    ("stop wrong type", "/v1/completions", {**OK, "stop": 5}, 400, "stop"),
    ("messages missing", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("messages empty", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    (  # (any role name goes to the template, as vLLM's custom roles; a role must be a name)
        "bad role",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "", "content": "x"}]},
        400,
        None,
    ),
    ("chat max_tokens 0", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    (
        "chat response_format unknown",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "yaml"}},
        400,
        "response_format",
    ),
    (
        "json_schema without a schema",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format",
    ),
    (
        "unusable json schema",
        "/v1/completions",
        {**OK, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
        400,
        "response_format",
    ),
    (
        "unusable guided_regex",
        "/v1/completions",
        {**OK, "guided_regex": "(unclosed"},
        400,
        "guided_regex",
    ),
    (
        "two structured output fields",
        "/v1/chat/completions",
        {**CHAT, "guided_choice": ["a"], "structured_outputs": {"regex": "b"}},
        400,
        "guided_choice",
    ),
    (
        "guided_choice of the wrong type",
        "/v1/completions",
        {**OK, "guided_choice": "abc"},
        400,
        "guided_choice",
    ),
    (
        "tool_choice naming an unknown function",
        "/v1/chat/completions",
        {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "zz"}}},
        400,
        "tool_choice",
    ),
    (
        "chat_template_kwargs setting a call option",
        "/v1/chat/completions",
        {**CHAT, "chat_template_kwargs": {"tokenize": False}},
        400,
        "chat_template_kwargs",
    ),
    (
        "continue_final_message with a generation prompt",
        "/v1/chat/completions",
        {**CHAT, "continue_final_message": True},
        400,
        "continue_final_message",
    ),
    (
        "chat tool_choice required",
        "/v1/chat/completions",
        {**CHAT, "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    ("body is a list", "/v1/completions", [1, 2, 3], 400, None),
    ("lone surrogate in a prompt", "/v1/completions", {**OK, "prompt": "a\ud800b"}, 400, None),
    (
        "lone surrogate in a batch",
        "/v1/completions",
        {**OK, "prompt": ["fine", "x\udfff"], "stream": True},
        400,
        None,
    ),
    (
        "lone surrogate in a message",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "hi \ud83d"}]},
        400,
        None,
    ),
    ("lone surrogate in the model", "/v1/completions", {**OK, "model": "tiny\ud800"}, 400, None),
    ("lone surrogate to tokenize", "/tokenize", {"prompt": "\udc00"}, 400, None),
    (
        "lone surrogate in a response",
        "/v1/responses",
        {"model": "tiny", "input": "\ud800"},
        400,
        None,
    ),
    (
        "forced tool with an unusable schema",
        "/v1/chat/completions",
        {
            **CHAT,
            "tools": [{"type": "function", "function": {"name": "g", "parameters": {"type": "x"}}}],
            "tool_choice": "required",
        },
        400,
        "tools",
    ),
    ("deadline wrong type", "/v1/completions", {**OK, "deadline_ms": "soon"}, 400, "deadline_ms"),
    ("deadline not positive", "/v1/completions", {**OK, "deadline_ms": 0}, 400, "deadline_ms"),
    (
        "deadline unmeetable",
        "/v1/completions",
        {**OK, "prompt": "nobody meets this deadline", "deadline_ms": 0.001},
        429,
        None,
    ),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request_is_refused(
    base_url: str, name: str, path: str, body: Any, status: int, param: str | None
) -> None:
    assert_error(post(base_url, path, json=body), status, param)


def test_malformed_json_and_unknown_route(base_url: str) -> None:
    headers = {"content-type": "application/json"}
    assert_error(
        post(base_url, "/v1/completions", data=b'{"model": "tiny", ', headers=headers), 400
    )
    assert_error(post(base_url, "/v1/chat/completions", data=b"not json", headers=headers), 400)
    latin1 = post(base_url, "/v1/completions", data=b'{"prompt": "caf\xe9"}', headers=headers)
    assert_error(latin1, 400)  # (bytes that are not UTF-8)
    assert latin1.json()["error"]["code"] == "invalid_json"
    missing = post(base_url, "/v1/nothing", json=OK)
    assert_error(missing, 404)
    assert missing.json()["error"]["message"] == "Not Found: POST /v1/nothing"
    body = json.dumps(OK).encode()  # (curl -d sends a form's Content-Type)
    assert requests.head(f"{base_url}/health", timeout=10).status_code == 200
    # (text/json and application/jsonx too: FastAPI reads neither as JSON)
    for kind in (
        "application/x-www-form-urlencoded",
        "text/plain",
        "text/json",
        "application/jsonx",
    ):
        form = post(base_url, "/v1/completions", data=body, headers={"content-type": kind})
        assert_error(form, 400)
        assert form.json()["error"]["code"] == "invalid_content_type"
        assert "Content-Type: application/json" in form.json()["error"]["message"]
    wrong_method = requests.get(f"{base_url}/v1/completions", timeout=10)
    assert_error(wrong_method, 405)
    assert wrong_method.headers["allow"] == "POST"  # (RFC 9110 asks for it)


def test_version_is_tandems(base_url: str) -> None:
    from tandem import __version__

    resp = requests.get(f"{base_url}/version", timeout=30)
    assert resp.status_code == 200 and resp.json() == {"version": __version__}


def test_chat_template_options_shape_the_prompt(base_url: str) -> None:
    """add_generation_prompt=false leaves the assistant header out; continue_final_message
    leaves the last assistant message open (the tiny model's ChatML-like template)."""

    def prompt_tokens(**extra: Any) -> int:
        resp = post(base_url, "/v1/chat/completions", json={**CHAT, **extra})
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["prompt_tokens"])

    with_header = prompt_tokens()
    without = prompt_tokens(add_generation_prompt=False)
    assert without < with_header
    reply = {"role": "assistant", "content": "Sure"}
    opened = prompt_tokens(
        messages=[*CHAT["messages"], reply],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    closed = prompt_tokens(messages=[*CHAT["messages"], reply], add_generation_prompt=False)
    assert with_header < opened < closed  # the open one lacks the message's end marker


def test_tokenize_counts_as_the_completions_do(base_url: str) -> None:
    """vLLM's /tokenize and /detokenize: the counts match what a completion reports as its
    prompt_tokens, text and chat alike, and the ids decode back to the text."""
    text = "Count me exactly, déjà vu 🙂"
    tok = post(base_url, "/tokenize", json={"model": "tiny", "prompt": text})
    assert tok.status_code == 200, tok.text
    body = tok.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] is None  # (as in vLLM's reply)
    spelled = post(base_url, "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert spelled["tokens"] == body["tokens"] and len(spelled["token_strs"]) == body["count"]
    assert all(isinstance(t, str) and t for t in spelled["token_strs"])
    done = post(base_url, "/v1/completions", json={**OK, "prompt": text}).json()
    assert done["usage"]["prompt_tokens"] == body["count"]
    back = post(base_url, "/detokenize", json={"model": "tiny", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"].endswith(text), back.text
    chat = post(base_url, "/tokenize", json={"model": "tiny", "messages": CHAT["messages"]})
    chat_done = post(base_url, "/v1/chat/completions", json=CHAT).json()
    assert chat.json()["count"] == chat_done["usage"]["prompt_tokens"]
    assert_error(post(base_url, "/tokenize", json={"model": "tiny"}), 400, "prompt")
    both = {"model": "tiny", "prompt": "x", "messages": CHAT["messages"]}
    assert_error(post(base_url, "/tokenize", json=both), 400, "prompt")
    assert_error(post(base_url, "/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    outside = {"model": "tiny", "tokens": [1, 10**9]}
    assert_error(post(base_url, "/detokenize", json=outside), 400, "tokens")
    assert_error(post(base_url, "/detokenize", json={"model": "tiny", "tokens": "12"}), 400)


def test_unknown_fields_are_ignored_and_server_keeps_serving(base_url: str) -> None:
    resp = post(base_url, "/v1/completions", json={**OK, "surprise": {"nested": [1, 2]}, "x": None})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
    resp = post(base_url, "/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200, resp.text
    plain = {**CHAT, "response_format": {"type": "text"}, "tools": [TOOL], "tool_choice": "none"}
    resp = post(base_url, "/v1/chat/completions", json=plain)
    assert resp.status_code == 200, resp.text


def test_streaming_bad_request_is_refused_before_streaming(base_url: str) -> None:
    resp = post(base_url, "/v1/completions", json={**OK, "stream": True, "max_tokens": 0})
    assert_error(resp, 400, "max_tokens")


def test_a_browsers_preflight_is_answered(base_url: str) -> None:
    """CORS, as vLLM by default: any origin may call the API from a browser."""
    preflight = requests.options(
        f"{base_url}/v1/chat/completions",
        headers={
            "Origin": "http://ui.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
        timeout=30,
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"
    answer = post(base_url, "/v1/completions", json=OK, headers={"Origin": "http://ui.example"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"


def test_an_explicit_null_is_the_default_over_http(base_url: str) -> None:
    """Clients that send unset fields as null (OpenAI's `n`, `stream`, `logprobs` are nullable)."""
    nulls = {"n": None, "stream": None, "echo": None, "min_tokens": None}
    done = post(base_url, "/v1/completions", json={**OK, **nulls})
    assert done.status_code == 200, done.text
    assert len(done.json()["choices"]) == 1 and done.json()["usage"]["completion_tokens"] == 4
    chat = {**CHAT, "max_tokens": 2, "n": None, "logprobs": None, "stream": None}
    replied = post(base_url, "/v1/chat/completions", json=chat)
    assert replied.status_code == 200, replied.text
    assert replied.json()["choices"][0]["logprobs"] is None
