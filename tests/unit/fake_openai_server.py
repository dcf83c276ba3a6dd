"""A small fake OpenAI-compatible completions server (aiohttp, in a thread) for client tests.

It streams `max_tokens` tokens as "w0 w1 ..." two tokens per chunk, `delay_s` apart, then a
usage chunk (prompt tokens: the prompt's words, or its ids). `max_tokens` 13 is refused with a
429; 14 fails with an error event after the first chunk. It records every prompt it received, the
`Authorization` headers, and the most requests it had in flight at once. `/tokenize` counts two
tokens a word (three for a word of more than five letters), when `tokenize` is on.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web


class FakeServer:
    def __init__(
        self, delay_s: float = 0.01, tokenize: bool = False, models: tuple[str, ...] = ()
    ) -> None:
        self.delay_s = delay_s
        self.tokenize = tokenize
        self.models = models  # (listed by /v1/models; none: no such route)
        self.models_asked: list[str | None] = []  # each request's `model`
        self.prompts: list[Any] = []
        self.bodies: list[dict[str, Any]] = []  # each completion request's JSON
        self.authorizations: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        if self.models:
            app.router.add_get("/v1/models", self._models)
        if self.tokenize:
            app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": m} for m in self.models]})

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        self.authorizations.append(request.headers.get("Authorization"))
        words = str((await request.json())["prompt"]).split()
        count = sum(3 if len(w) > 5 else 2 for w in words)
        return web.json_response({"count": count, "max_model_len": 2048, "tokens": []})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.authorizations.append(request.headers.get("Authorization"))
        body = await request.json()
        self.bodies.append(body)
        prompt, n = body["prompt"], int(body["max_tokens"])
        self.prompts.append(prompt)
        self.models_asked.append(body.get("model"))
        if n == 13:
            return web.json_response({"error": {"message": "queue full"}}, status=429)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            words = [f"w{i}" for i in range(n)]
            for i in range(0, n, 2):
                await asyncio.sleep(self.delay_s)
                text = "".join(f" {w}" for w in words[i : i + 2])
                await resp.write(_event({"choices": [{"index": 0, "text": text}]}))
                if n == 14:
                    await resp.write(_event({"error": {"message": "decode worker died"}}))
                    break
            if body.get("stream_options", {}).get("include_usage"):
                prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
                await resp.write(_event({"choices": [], "usage": usage}))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()
