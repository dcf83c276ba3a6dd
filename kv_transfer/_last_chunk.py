"""What a chunk of a transfer must be for the decode side to take it (`receiver.py`): the next
one, on the next reserved blocks, with its pages; and what the last one must carry before its
request commits: the first sampled tokens (ids the model has), their logprobs when asked for,
tokens that start output following the request's structure, every reserved block filled, the
whole prompt (a sampler state a generator does not take fails the commit: `receiver.py`)."""

from __future__ import annotations

from typing import Any

from tandem.engine.errors import InvalidRequestError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.logprobs import parse_entries
from tandem.engine.outputs import TokenLogprob
from tandem.kv_transfer._receiver_records import Reservation
from tandem.kv_transfer.base import Message
from tandem.kv_transfer.manifest import ChunkManifest, pages_checksum


def chunk_problem(
    engine: LLMEngine,
    res: Reservation,
    manifest: ChunkManifest,
    message: Message,
    verify_checksums: bool,
) -> str | None:
    """Why the chunk `message` carries cannot be taken into `res` (None: it can)."""
    index = manifest.chunk_index
    if index > res.next_chunk:
        return f"chunk {index} arrived out of order (expected {res.next_chunk})"
    expected = res.block_table[res.next_block : res.next_block + len(manifest.dst_block_ids)]
    if manifest.dst_block_ids != expected:
        return f"chunk {index} targets blocks {manifest.dst_block_ids}, expected {expected}"
    pages = message.pages
    if pages is None and manifest.dst_block_ids and not message.header.get("direct"):
        return f"chunk {index} carries no pages"
    if pages is not None and tuple(pages.shape) != engine.kv_pool.blocks_shape(len(expected)):
        return f"chunk {index} pages have shape {tuple(pages.shape)}"
    if manifest.checksum and verify_checksums:
        written = pages if pages is not None else engine.kv_pool.export_blocks(expected)
        if pages_checksum(written) != manifest.checksum:
            return f"chunk {index} failed its checksum"
    if manifest.last:
        return last_chunk_problem(engine, res, manifest, message.header, len(expected))
    return None


def last_chunk_problem(
    engine: LLMEngine,
    res: Reservation,
    manifest: ChunkManifest,
    header: dict[str, Any],
    num_blocks: int,
) -> str | None:
    """Why the last chunk (of `num_blocks` blocks) cannot commit `res` (None: it can; a
    structured request's matcher, past the first tokens, is kept on `res` for the commit)."""
    if not manifest.first_token_ids and not header.get("finished"):
        return "the last chunk must carry the first sampled token"
    vocab = engine.spec.vocab_size
    if not all(0 <= t < vocab for t in manifest.first_token_ids):
        return f"the first tokens {manifest.first_token_ids} are not all in [0, {vocab})"
    if res.params.logprobs is not None and first_logprobs(res, manifest, header) is None:
        return "the last chunk's first_token_logprobs are missing or malformed"
    if res.params.structure is not None:
        problem = _grammar_problem(engine, res, manifest.first_token_ids)
        if problem:
            return problem
    if res.next_block + num_blocks != len(res.block_table):
        return "last chunk arrived before all reserved blocks were filled"
    if manifest.num_tokens != len(res.prompt_token_ids):
        return f"last chunk covers {manifest.num_tokens} tokens, prompt has {len(res.prompt_token_ids)}"
    return None


def first_logprobs(
    res: Reservation, manifest: ChunkManifest, header: dict[str, Any]
) -> list[TokenLogprob] | None:
    """The first tokens' logprobs the last chunk carries (None: not asked, or malformed)."""
    if res.params.logprobs is None:
        return None
    return parse_entries(
        header.get("first_token_logprobs"), len(manifest.first_token_ids), res.params.logprobs
    )


def _grammar_problem(engine: LLMEngine, res: Reservation, tokens: list[int]) -> str | None:
    """Why the first tokens cannot start output that follows the request's structure (None:
    they can; the matcher, past them, is kept on `res` for the commit)."""
    structure = res.params.structure
    assert structure is not None
    try:
        matcher = engine.grammars.matcher_for(res.params, res.prompt_token_ids)
    except InvalidRequestError as exc:
        return str(exc)
    if not all(matcher.accept_token(t) for t in tokens):
        return f"the first tokens {tokens} do not follow the request's {structure[0]}"
    res.matcher = matcher
    return None
