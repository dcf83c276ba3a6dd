"""Moving one request's KV between engines: export from prefill, import into decode.

Export copies the blocks that hold the request's computed tokens into one contiguous tensor with
their chained hashes. Import reuses whatever full blocks the receiving engine already caches
(decode-side prefix reuse), copies only the rest, and commits the request into the running batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from tandem.engine.errors import InvalidRequestError, TandemError
from tandem.engine.hashing import hash_full_blocks
from tandem.engine.kv_blocks import KVBlocks
from tandem.engine.output_text import OutputText
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.llm_engine import LLMEngine


class NoFreeBlocksError(TandemError):
    """The engine has no room for the imported request's KV right now (retry later)."""


def export_kv(engine: LLMEngine, request_id: str) -> KVBlocks:
    req = engine.requests.get(request_id)
    if req is None:
        raise KeyError(f"unknown request {request_id!r} (finished requests need keep_kv=True)")
    num_tokens = req.num_computed_tokens
    if num_tokens == 0:
        raise InvalidRequestError(f"request {request_id!r} has no computed KV yet")
    bs = engine.config.block_size
    blocks = req.block_table[: math.ceil(num_tokens / bs)]
    token_ids = req.token_ids[:num_tokens]
    return KVBlocks(
        namespace=engine.namespace.digest(),
        block_size=bs,
        num_tokens=num_tokens,
        token_ids=token_ids,
        data=engine.kv_pool.export_blocks(blocks),
        sampler_state=req.generator.get_state() if req.generator is not None else None,
    )


def import_request(
    engine: LLMEngine,
    request_id: str,
    kv: KVBlocks,
    output_token_ids: list[int],
    params: SamplingParams,
    *,
    stream_text: bool = False,
) -> Request:
    """Commits a prefilled request (KV of its prompt + its first sampled tokens) for decoding."""
    _check_compatible(engine, kv)
    if not output_token_ids:
        raise InvalidRequestError("an imported request needs its first sampled token")
    if request_id in engine.requests:
        raise InvalidRequestError(f"request id {request_id!r} is already in use")
    bm = engine.block_manager
    # (hashed under this request's own cache_salt: a hit never crosses salts)
    root = engine.namespace.request_root(params.cache_salt)
    hashes = hash_full_blocks(root, kv.token_ids, engine.config.block_size)
    hits = bm.match_prefix(hashes, kv.token_ids)
    block_table: list[int] = []
    if not bm.allocate(block_table, kv.num_tokens, hits):
        raise NoFreeBlocksError(f"no room for {kv.num_blocks} blocks ({kv.num_tokens} tokens)")
    fresh = block_table[len(hits) :]
    if fresh:
        engine.kv_pool.import_blocks(fresh, kv.data[len(hits) :])
    return commit_request(
        engine,
        request_id,
        list(kv.token_ids),
        output_token_ids,
        params,
        block_table,
        num_hit_blocks=len(hits),
        sampler_state=kv.sampler_state,
        stream_text=stream_text,
        block_hashes=hashes,
    )


def commit_request(
    engine: LLMEngine,
    request_id: str,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    params: SamplingParams,
    block_table: list[int],
    *,
    num_hit_blocks: int = 0,
    sampler_state: torch.Tensor | None = None,
    stream_text: bool = False,
    matcher: Any = None,
    block_hashes: list[int] | None = None,
) -> Request:
    """Turns blocks that hold the prompt's KV (already referenced by `block_table`) into a
    running request that continues after `output_token_ids`. The request owns the blocks now."""
    bs = engine.config.block_size
    output_text = None
    if stream_text or params.stop:
        output_text = OutputText.after(
            engine.tokenizer,
            prompt_token_ids,
            output_token_ids,
            params=params,
        )
        if params.stop:  # (the sender judged those tokens' text: searched, as the engine's own)
            output_text.find_stop(params.stop, counting=False)
    req = Request(
        request_id, prompt_token_ids, params, engine.eos_token_ids, output_text=output_text
    )
    req.token_ids.extend(output_token_ids)
    req.prompt_logprobs = None  # (computed, if asked, where the prompt was)
    engine.attach_constraints(req, matcher)
    if req.generator is not None and sampler_state is not None:
        req.generator.set_state(sampler_state)
    req.block_table = block_table
    req.num_computed_tokens = len(prompt_token_ids)
    req.num_prefix_hit_tokens = num_hit_blocks * bs
    if block_hashes is None:  # (the prompt's full blocks, under the request's cache_salt)
        block_hashes = hash_full_blocks(
            engine.namespace.request_root(params.cache_salt), prompt_token_ids, bs
        )
    req.block_hashes = block_hashes
    req.num_cached_blocks = engine.block_manager.cache_blocks(
        block_table, req.block_hashes, req.token_ids, num_hit_blocks
    )
    req.set_status(RequestStatus.READY_TO_DECODE)
    engine.requests[request_id] = req
    engine.scheduler.add_running(req)
    return req


def _check_compatible(engine: LLMEngine, kv: KVBlocks) -> None:
    if kv.namespace != engine.namespace.digest():
        raise InvalidRequestError(
            "KV blocks come from another cache namespace (model, tokenizer, rope or KV dtype differ)"
        )
    if kv.block_size != engine.config.block_size:
        raise InvalidRequestError(
            f"block size {kv.block_size} != this engine's {engine.config.block_size}"
        )
    expected = engine.kv_pool.blocks_shape(math.ceil(kv.num_tokens / kv.block_size))
    if tuple(kv.data.shape) != expected or kv.data.dtype != engine.kv_pool.dtype:
        raise InvalidRequestError(
            f"KV data {tuple(kv.data.shape)} {kv.data.dtype} != expected {expected} {engine.kv_pool.dtype}"
        )
    if len(kv.token_ids) != kv.num_tokens:
        raise InvalidRequestError("KV token ids do not match num_tokens")
    if kv.num_tokens + 1 >= engine.max_model_len:
        raise InvalidRequestError(f"{kv.num_tokens} tokens leave no room below max_model_len")
