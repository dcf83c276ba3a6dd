"""Log-probabilities in OpenAI's two shapes: completions' (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`) and chat's (`content`: one entry per token with its
`top_logprobs`). Entries come from the workers as `[logprob, [[token id, logprob], ...]]`
(`engine.outputs.TokenLogprob`); a token is named by its own text (the tokenizer's decode of
that token alone, special tokens kept), as vLLM names them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Any],
    token_text: TokenText,
    text_offset: int = 0,
) -> dict[str, Any]:
    """Completions' shape. `top_logprobs` holds the sampled token, then the alternatives (so up
    to `logprobs + 1` of them, as OpenAI documents, in vLLM's order); `text_offset` counts
    from `text_offset`.
    An entry may be None (an echoed prompt's first token): null logprob and alternatives."""
    tokens: list[str] = []
    offsets: list[int] = []
    logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprob, top = entry[0], entry[1]  # (a prompt token's has its rank too)
        alternatives = {text: logprob}  # (the sampled token first, as vLLM's)
        alternatives.update((token_text(t), lp) for t, lp in top)
        logprobs.append(logprob)
        tops.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Any],
    token_text: TokenText,
    token_bytes: TokenBytes | None = None,
) -> dict[str, Any]:
    """Chat's shape: `{"content": [{token, logprob, bytes, top_logprobs}]}`. `bytes` are the
    token's own (`token_bytes`: a byte token's byte, where its text is U+FFFD), else its
    text's UTF-8."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        raw = token_bytes(token_id) if token_bytes is not None else text.encode("utf-8")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = []
    for token_id, (logprob, top) in zip(token_ids, entries, strict=False):
        content.append(
            {**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
        )
    return {"content": content}


def text_length(token_ids: Sequence[int], token_text: TokenText) -> int:
    """How far completions' `text_offset` moves over these tokens."""
    return sum(len(token_text(t)) for t in token_ids)


def prompt_logprobs_field(
    token_ids: Sequence[int], entries: Sequence[Any], token_text: TokenText
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first None), its own entry then the
    alternatives', by token id: `{"logprob", "rank", "decoded_token"}` (alternative i: rank i + 1)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            out.append(None)
            continue
        logprob, top, rank = entry
        found = {str(token_id): _ranked(logprob, rank, token_text(token_id))}
        for i, (alt, alt_logprob) in enumerate(top):
            found.setdefault(str(alt), _ranked(alt_logprob, i + 1, token_text(alt)))
        out.append(found)
    return out


def _ranked(logprob: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": text}
