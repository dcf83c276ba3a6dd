"""What the last chunk of a transfer must carry before the decode side commits its request
(`receiver.py`): the first sampled tokens, their logprobs when asked for, tokens that start
output following the request's structure, every reserved block filled, the whole prompt."""

from __future__ import annotations

from typing import Any

from tandem.engine.errors import InvalidRequestError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.logprobs import parse_entries
from tandem.engine.outputs import TokenLogprob
from tandem.kv_transfer._receiver_records import Reservation
from tandem.kv_transfer.manifest import ChunkManifest


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
