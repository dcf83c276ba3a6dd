"""A client that leaves while it still sends its request body is no `invalid_json` failure (FastAPI
reports both as "There was an error parsing the body"); a body that is not JSON still is."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import TaskCancelledError

from tandem.router.deployment import api


class Tally:
    def __init__(self) -> None:
        self.codes: list[str] = []

    def failed(self, code: str) -> None:
        self.codes.append(code)

    def rejected(self, code: str) -> None:
        self.codes.append(code)


def _post(messages: list[Any], length: int) -> list[dict[str, Any]]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(length).encode()),
        ],
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
    }
    incoming = list(messages)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            message = incoming.pop(0)
            if isinstance(message, BaseException):
                raise message
            return message
        await asyncio.sleep(3600)  # (nothing more comes)
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(api(scope, receive, send), 10))
    return sent


@pytest.fixture
def tally(monkeypatch: pytest.MonkeyPatch) -> Tally:
    counted = Tally()
    monkeypatch.setattr(api.state, "metrics", counted, raising=False)
    return counted


@pytest.mark.parametrize("leaves", ["disconnect", "cancelled receive"])
def test_a_client_gone_mid_body_is_not_an_invalid_json_failure(tally: Tally, leaves: str) -> None:
    """Behind Serve's proxy the replica's `receive` is cancelled (TaskCancelledError) more
    often than it gets a disconnect message."""
    part = {"type": "http.request", "body": b'{"model": "tiny", "pro', "more_body": True}
    end: Any = {"type": "http.disconnect"} if leaves == "disconnect" else TaskCancelledError()
    _post([part, end], length=120)
    assert tally.codes == []


def test_a_body_that_is_not_utf8_json_is_one(tally: Tally) -> None:
    body = b'{"model": "\xff\xfe"}'
    sent = _post([{"type": "http.request", "body": body, "more_body": False}], len(body))
    assert sent[0]["status"] == 400
    assert tally.codes == ["invalid_json"]


def test_json_nested_too_deeply_says_so(tally: Tally) -> None:
    """Valid JSON deeper than Python's parser goes was "not valid JSON in UTF-8"."""
    import json

    body = b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    sent = _post([{"type": "http.request", "body": body, "more_body": False}], len(body))
    assert sent[0]["status"] == 400
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["message"] == "the request body's JSON is nested too deeply"
    assert tally.codes == ["invalid_json"]
