"""One streamed `/v1/completions` request, timed as `vllm bench serve` times it.

`StreamReader` turns the SSE lines of a response (with their arrival times) into a
`RequestRecord`: every chunk that carries `choices` is a token chunk (its time is a TTFT or an
ITL sample, even when its text is empty); a chunk with `usage` gives the token counts; an
`error` event, or one that is not an OpenAI chunk, fails the request. It needs no network, so
tests feed it lines directly.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from tandem.bench.serving.records import RequestRecord


class StreamReader:
    def __init__(self, record: RequestRecord, sent: float) -> None:
        self.record = record
        self.sent = sent
        self.chunk_times: list[float] = []
        self.text: list[str] = []
        self.done = False

    def feed(self, line: str | bytes, now: float) -> None:
        """One line of the response body, received at `now` (perf_counter seconds)."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.strip()
        if not line.startswith("data:"):
            return  # blank separator, comment or other SSE field
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if not isinstance(event, dict):  # (ValueError: the request fails, the run goes on)
            raise ValueError(f"an event that is not a JSON object: {data[:80]}")
        if "error" in event:
            err = event["error"]
            self.record.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        if choices := event.get("choices"):
            if not isinstance(choices, list) or not isinstance(choices[0], dict):
                raise ValueError(f"choices that are not a list of objects: {data[:80]}")
            self.chunk_times.append(now)
            self.text.append(str(choices[0].get("text") or ""))
        if usage := event.get("usage"):
            if not isinstance(usage, dict):
                raise ValueError(f"a usage that is not an object: {data[:80]}")
            self.record.output_tokens = int(usage.get("completion_tokens") or 0)
            self.record.output_tokens_from_usage = True
            if usage.get("prompt_tokens"):
                self.record.prompt_len = int(usage["prompt_tokens"])

    def finish(self) -> RequestRecord:
        """The record: successful when a token chunk came and no error did."""
        rec = self.record
        rec.generated_text = "".join(self.text)
        if self.chunk_times:
            rec.set_chunk_times(self.sent, self.chunk_times)
            if not rec.output_tokens:  # no usage chunk: one token per non-empty chunk (a
                # tokenizer's count replaces it: `count_output_tokens`)
                rec.output_tokens = sum(1 for t in self.text if t)
        if not rec.error and not self.chunk_times:
            rec.error = "never received a chunk with a token"
        rec.success = not rec.error
        return rec


def completion_payload(
    model: str, prompt: str | list[int], max_tokens: int, extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def send_completion(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    record: RequestRecord,
    bench_start: float,
) -> RequestRecord:
    """POSTs `payload` (a streaming completion) and records its timings; never raises for a
    failed request (the error is on the record)."""
    sent = time.perf_counter()
    record.start_time = sent - bench_start
    reader = StreamReader(record, sent)
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                record.error = f"HTTP {resp.status}: {body}"
                return reader.finish()
            async for line in resp.content:
                reader.feed(line, time.perf_counter())
    except (aiohttp.ClientError, TimeoutError, ValueError, TypeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return reader.finish()
