"""The decode role without Ray: an engine, a `KVReceiver` and per-request async token streams.

`generate()` is one async stream per request: it reserves blocks for the prompt (reusing the
prefix this engine already caches), yields the reservation grant for the router to hand to a
prefill worker, then yields token events once the pages are committed, until the request ends.
Closing the stream early (client gone, router cancelled) cancels the request here and, through
the transfer protocol, on the prefill side.

With no KV room for a prompt now, its reservation waits its turn (`ReservationQueue`): the
stream yields ``{"type": "queued"}`` first, then the grant once it is made, or an error
("no_capacity") after `reserve_wait_s` (0: at once).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from tandem.decode_workers.reservation_queue import ReservationQueue, WaitEnded
from tandem.decode_workers.token_streams import StreamOutbox, TokenStream, merge_token_items
from tandem.engine.engine_stats import engine_queue_stats, scheduling_stages
from tandem.engine.errors import StepFailedError
from tandem.engine.guided import compile_ahead
from tandem.engine.kv_io import NoFreeBlocksError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.output_text import OutputText
from tandem.engine.outputs import StepOutput
from tandem.engine.prefill_rate import PrefillRate
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.worker_drain import DRAINING
from tandem.engine.worker_loop import WorkerLoop
from tandem.kv_transfer.base import KVTransport
from tandem.kv_transfer.events import TransferEvent
from tandem.kv_transfer.receiver import KVReceiver

logger = logging.getLogger(__name__)


def _error(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "code": code, "error": message}


DECODE_RATE_MIN_TOKENS = 64
"""Prompt tokens a decode worker's step must prefill to count in its prefill rate (a short
tail's step times mostly the batch's sampled tokens)."""


class DecodeService(WorkerLoop):
    """Thread-confined engine + receiver; the async API is safe to call from asyncio."""

    def __init__(
        self,
        engine: LLMEngine,
        transport: KVTransport,
        *,
        lease_s: float = 30.0,
        stall_timeout_s: float = 10.0,
        reserve_wait_s: float = 60.0,
        stream_interval: int = 1,
        name: str = "decode",
        on_stats: Any = None,
    ) -> None:
        super().__init__(name, on_stats)
        self.engine = engine
        self.transport = transport
        self.stream_interval = max(1, stream_interval)  # tokens a stream gathers per item
        self.receiver = KVReceiver(
            engine, transport, lease_s=lease_s, stall_timeout_s=stall_timeout_s
        )
        self._streams: dict[str, TokenStream] = {}
        self._outbox = StreamOutbox()  # (a step's token items, handed over once the step ends)
        self.waiting = ReservationQueue(
            self._reserve, engine.block_manager, engine.config.block_size, reserve_wait_s
        )
        self.num_cancelled = 0
        self.prefill_rate = PrefillRate(min_tokens=DECODE_RATE_MIN_TOKENS)
        if engine.config.enable_kv_events:
            self.publish_kv_events(engine.block_manager, engine.namespace.digest())

    @property
    def address(self) -> str:
        return self.transport.address

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        local_prefill: bool = False,
        priority: int = 0,
        *,
        wait_for_room: bool = True,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Yields {"type": "grant"} ({"type": "queued"} before it when the reservation waits
        for room; not with `wait_for_room` false), then {"type": "tokens"} events (the last has
        a `finish_reason`), or a single {"type": "error"}. With `local_prefill` this engine
        prefills the prompt itself (reusing what it caches) and there is no grant: no transfer."""
        stream = TokenStream(asyncio.get_running_loop(), asyncio.Queue(), prompt_token_ids, params)
        finished = False
        try:
            await compile_ahead(self.engine.grammars, params)  # (not on the engine's thread)
            if local_prefill:
                await self.submit(lambda: self._add_local(request_id, stream, priority))
            else:
                granted: asyncio.Future[Any] = stream.loop.create_future()
                try:
                    grant = await self.submit(
                        lambda: self.waiting.reserve_or_wait(
                            request_id, len(prompt_token_ids), stream, granted, wait_for_room
                        )
                    )
                    if grant is None:  # no room now: it waits its turn
                        yield {"type": "queued"}
                        grant = await granted
                except NoFreeBlocksError as exc:
                    finished = True
                    yield _error("no_capacity", str(exc))
                    return
                except WaitEnded as exc:
                    finished = True
                    yield exc.item
                    return
                yield {
                    "type": "grant",
                    "grant": grant._asdict(),
                    "num_cached_tokens": grant.num_hit_blocks * self.engine.config.block_size,
                }
            carry: dict[str, Any] | None = None
            while not finished:
                item = carry if carry is not None else await stream.queue.get()
                carry = None
                # Token items already queued go out as one: a consumer slower than the engine
                # (a hop per item) then gets several tokens per hop instead of falling behind.
                while item["type"] == "tokens" and item.get("finish_reason") is None:
                    if stream.queue.empty():
                        break
                    nxt = stream.queue.get_nowait()
                    if nxt["type"] != "tokens":
                        carry = nxt
                        break
                    item = merge_token_items(item, nxt)
                finished = item["type"] == "error" or item.get("finish_reason") is not None
                yield item
        finally:
            if not finished:
                self.post(lambda: self._cancel(request_id))

    async def release_unwritten(self, request_id: str) -> int:
        """The router never handed `request_id`'s grant to a prefill worker (the client left
        during the reservation, or the worker refused the grant): no pages can come, so its
        blocks go back now rather than after the stall timeout. Ends the request here if its
        stream is still open. Returns how many blocks were released."""
        release = functools.partial(self.receiver.release_unwritten, request_id)
        return await self.submit(lambda: self._release(request_id, release, "never granted"))

    async def release_from_lost_sender(self, request_id: str, sender: str) -> int:
        """The router handed `request_id`'s grant to the prefill worker at KV address `sender`
        and lost that worker: its blocks go back as soon as the transport confirms the sender
        is gone (now, if it has), not after the stall timeout. Ends the request here if its
        stream is still open. Returns how many blocks were released now."""
        release = functools.partial(self.receiver.release_from_lost_sender, request_id, sender)
        why = f"its sender {sender} is gone"
        return await self.submit(lambda: self._release(request_id, release, why))

    # ---- the loop thread -----------------------------------------------------------------------
    def _release(self, request_id: str, release: Callable[[], int], why: str) -> int:
        self._cancel(request_id)  # (if the stream's close has not reached this thread yet)
        released = release()
        if released:
            logger.info("decode: %s's %d reserved blocks released (%s)", request_id, released, why)
        return released

    def _reserve(self, request_id: str, stream: TokenStream) -> Any:
        grant = self.receiver.reserve(request_id, stream.prompt_token_ids, stream.params)
        stream.num_cached_tokens = grant.num_hit_blocks * self.engine.config.block_size
        stream.num_transferred_blocks = len(grant.dst_block_ids)
        self._streams[request_id] = stream
        return grant

    def refuse_waiting(self) -> None:
        """Draining: reservations still waiting for room are answered "draining" (the router
        takes them to another worker)."""
        self.waiting.end_all(DRAINING, f"{self.name} is draining: retry on another worker")

    def _add_local(self, request_id: str, stream: TokenStream, priority: int) -> None:
        stream.request = self.engine.add_request(
            stream.prompt_token_ids,
            stream.params,
            request_id=request_id,
            stream_text=True,
            priority=priority,
        )
        stream.local = True
        stream.committed_at = time.time()
        self._streams[request_id] = stream

    def _cancel(self, request_id: str) -> bool:
        if self.waiting.cancel(request_id):
            self.num_cancelled += 1
            return True
        stream = self._streams.pop(request_id, None)
        if self.receiver.cancel(request_id, "cancelled by the client") or self.engine.abort(
            request_id
        ):
            self.num_cancelled += 1
            logger.info("decode: request %s cancelled", request_id)
            return True
        return stream is not None

    def run_once(self) -> None:
        if self.waiting:
            self.waiting.grant_ready()
        busy = self.engine.has_unfinished_requests()
        if not busy and not self.receiver.busy:
            self.wait_for_command()
            return
        for event in self.receiver.poll(timeout=0.0 if busy else 0.001):
            self._on_transfer_event(event)
        if self.engine.has_unfinished_requests():
            try:
                start = time.perf_counter()
                outputs = self.engine.step()
                # (the prompts it prefills itself: their rate, for the router's admission)
                elapsed = time.perf_counter() - start
                self.prefill_rate.add(
                    self.engine.last_step_prompt_tokens, elapsed, self.engine.last_step_tokens
                )
                for output in outputs:
                    self._on_output(output)
            finally:
                self._outbox.flush()  # (the step's items: one hand-over to the event loop)

    def _on_transfer_event(self, event: TransferEvent) -> None:
        stream = self._streams.get(event.request_id)
        if stream is None:
            return
        if event.kind == "committed":
            stream.committed_at = time.time()
            req = self.engine.requests[event.request_id]
            stream.request = req
            if req.output_text is None:
                req.output_text = OutputText.after(
                    self.engine.tokenizer,
                    req.prompt_token_ids,
                    req.output_token_ids,
                    params=req.params,
                )
            text = self.engine.output_processor.text_delta(req, finished=False)
            item = {"type": "tokens", "token_ids": list(event.token_ids), "text": text}
            if event.logprobs is not None:
                item["logprobs"] = event.logprobs
            stream.put(item)
        elif event.kind == "finished_early":
            del self._streams[event.request_id]
            stream.put(self._finish_early(event, stream))
        elif event.kind in ("failed", "cancelled"):
            del self._streams[event.request_id]
            code = "cancelled" if event.kind == "cancelled" else event.code or "transfer_failed"
            stream.put(_error(code, event.error or event.kind))

    def _finish_early(self, event: TransferEvent, stream: TokenStream) -> dict[str, Any]:
        """The first token already ended the request: apply the usual stop rules to it here."""
        req = Request(
            event.request_id,
            stream.prompt_token_ids,
            stream.params,
            self.engine.eos_token_ids,
            output_text=OutputText.after(
                self.engine.tokenizer,
                stream.prompt_token_ids,
                params=stream.params,
            ),
        )
        outputs = self.engine.output_processor.process(
            [req] * len(event.token_ids), event.token_ids
        )  # (none: the prefill's request allowed no token and ended with nothing)
        reason = outputs[-1].finish_reason if outputs else None
        return self._tokens_item(
            StepOutput(
                event.request_id,
                list(event.token_ids),
                "".join(o.text_delta for o in outputs),
                True,
                reason or "stop",
                event.logprobs,
            ),
            req.stop_reason,
            stream,
        )

    def _on_output(self, output: StepOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        stop_reason = None
        if output.finished:
            del self._streams[output.request_id]
            req = stream.request  # the engine already dropped a finished request
            stop_reason = req.stop_reason if req is not None else None
            if stream.local and req is not None:
                stream.num_cached_tokens = req.num_prefix_hit_tokens
        elif stream.local and not stream.counts_sent and stream.request is not None:
            stream.num_cached_tokens = stream.request.num_prefix_hit_tokens
        # A stream interval holds tokens back, but never a request's first (a local prefill's:
        # a transferred request's came with its commit).
        first = stream.local and not stream.counts_sent
        interval = 1 if first else self.stream_interval
        item = stream.gathered(self._tokens_item(output, stop_reason, stream), interval)
        if item is None:  # (held until the stream has `interval` tokens to send)
            return
        if not stream.counts_sent:  # (for usage reported while streaming)
            stream.counts_sent = True
            item["num_cached_tokens"] = stream.num_cached_tokens
            item["num_transferred_blocks"] = stream.num_transferred_blocks
        self._outbox.add(stream.loop, stream.queue, item)

    @staticmethod
    def _tokens_item(
        output: StepOutput, stop_reason: int | str | None, stream: TokenStream
    ) -> dict[str, Any]:
        item: dict[str, Any] = {
            "type": "tokens",
            "token_ids": output.new_token_ids,
            "text": output.text_delta,
        }
        if output.logprobs is not None:
            item["logprobs"] = output.logprobs
        if output.finished:
            now = time.time()
            committed = stream.committed_at or now
            item["finish_reason"] = output.finish_reason
            item["stop_reason"] = stop_reason
            item["num_cached_tokens"] = stream.num_cached_tokens
            item["num_transferred_blocks"] = stream.num_transferred_blocks
            item["local_prefill"] = stream.local
            item["timings"] = {"decode_s": now - committed}
            if not stream.local:  # (a prefill here waits for no pages)
                item["timings"]["transfer_wait_s"] = committed - stream.reserved_at
            if stream.local and stream.request is not None:
                item["timings"].update(scheduling_stages(stream.request))
                if stream.request.prompt_logprobs is not None:  # (prefilled here)
                    item["prompt_logprobs"] = stream.request.prompt_logprobs
        return item

    def stats(self) -> dict[str, Any]:
        bm = self.engine.block_manager
        queues = engine_queue_stats(self.engine)
        queues["num_requests_waiting"] += len(self.waiting)  # (and those waiting for KV room)
        return {
            "role": "decode",
            "address": self.transport.address,
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_requests": len(self.engine.requests),
            "num_reservations": len(self.receiver.reservations),
            "num_held_reservations": len(self.receiver.held),
            "num_waiting_reservations": len(self.waiting),
            "num_streams": len(self._streams),
            "prefix_cache_queried_blocks": bm.prefix_cache_stats.queried_blocks,
            "prefix_cache_hit_blocks": bm.prefix_cache_stats.hit_blocks,
            "num_cancelled": self.num_cancelled,
            "num_step_failures": self.num_step_failures,
            "prefill_tokens_per_s": round(self.prefill_rate.tokens_per_s or 0.0, 1),
            **queues,
        }

    def check_integrity(self) -> None:
        tables = [r.block_table for r in self.engine.requests.values() if r.block_table]
        self.engine.block_manager.check_integrity(tables + self.receiver.block_tables())

    def on_step_failed(self, exc: StepFailedError) -> None:
        for rid in exc.request_ids:
            self.engine.abort(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(_error("internal_error", f"decode worker: {exc}"))
        self.check_integrity()

    def on_death(self, exc: BaseException) -> None:
        self.waiting.end_all("worker_died", f"decode worker died: {exc}")
        for stream in self._streams.values():
            stream.put(_error("worker_died", f"decode worker died: {exc}"))
        self._streams.clear()

    def close(self) -> None:
        self.stop()
        self.transport.close()
