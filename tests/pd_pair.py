"""A prefill and a decode service (no Ray) joined by the local transport, and how tests drive
a request through them (`run_pd`) and wait for both to hold nothing (`wait_idle`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tandem import LLM
from tandem.decode_workers.decode_service import DecodeService
from tandem.kv_transfer.local import LocalHub, LocalTransport
from tandem.kv_transfer.receiver import ReservationGrant
from tandem.prefill_workers.prefill_service import PrefillService

PROMPTS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog " * 6,
    "a",
    "tandem serves prefill and decode apart " * 3,
]
"""Prompts the service tests share (text; encoded with the reference's tokenizer)."""


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint())


@pytest.fixture(scope="module")
def reference(model: str) -> LLM:
    return LLM(model=model, num_kv_blocks=128)


@pytest.fixture()
def services(model: str) -> Iterator[tuple[PrefillService, DecodeService]]:
    """A started pair on the module's tiny model (fixtures for the modules that use this)."""
    with pd_pair(model) as pair:
        yield pair


@contextmanager
def pd_pair(
    model: str, num_kv_blocks: int = 128, prefill_batch_tokens: int = 32
) -> Iterator[tuple[PrefillService, DecodeService]]:
    """Started services on `model`; the prefill computes `prefill_batch_tokens` a step."""
    hub = LocalHub("token")
    prefill = PrefillService(
        LLM(
            model=model, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=prefill_batch_tokens
        ).engine,
        LocalTransport("token", hub=hub),
    )
    decode = DecodeService(
        LLM(model=model, num_kv_blocks=num_kv_blocks).engine, LocalTransport("token", hub=hub)
    )
    prefill.start()
    decode.start()
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


async def run_pd(
    prefill: PrefillService, decode: DecodeService, rid: str, prompt: list[int], params: Any
) -> tuple[list[int], str, dict[str, Any], dict[str, Any]]:
    stream: AsyncIterator[dict[str, Any]] = decode.generate(rid, prompt, params)
    first = await anext(stream)
    assert first["type"] == "grant", first
    task = asyncio.create_task(
        prefill.prefill(rid, prompt, params, ReservationGrant(**first["grant"]))
    )
    tokens: list[int] = []
    text = ""
    last: dict[str, Any] = {}
    async for item in stream:
        assert item["type"] == "tokens", item
        tokens += item["token_ids"]
        text += item["text"]
        last = item
    return tokens, text, last, await task


async def wait_idle(prefill: PrefillService, decode: DecodeService) -> tuple[dict, dict]:
    for _ in range(200):
        p, d = await prefill.get_stats(), await decode.get_stats()
        if (
            p["num_free_blocks"] == p["num_blocks"]
            and d["num_free_blocks"] == d["num_blocks"]
            and p["num_requests"] == d["num_requests"] == d["num_reservations"] == 0
        ):
            return p, d
        await asyncio.sleep(0.02)
    raise AssertionError(f"workers did not return to baseline: {p} {d}")
