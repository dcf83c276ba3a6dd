"""Logit bias, allowed tokens, repetition, presence and frequency penalties on a batch's logits,
before sampling.

- `logit_bias` (OpenAI's): added to the logits of its token ids (ids beyond the vocabulary are
  left out; the router refuses them).
- `allowed_token_ids` (vLLM's): every other token is masked out.
- `bad_words` (vLLM's): for each word's token sequence (`bad_word_sequences`), the token that
  would complete it after the output so far is masked out (a one-token word: always).
- `repetition_penalty` (transformers' and vLLM's): the logit of every token seen in the prompt or
  the output so far is divided by the penalty when positive and multiplied when negative.
- `presence_penalty` and `frequency_penalty` (OpenAI's): from the logit of every token the
  output holds, subtract `presence_penalty` once and `frequency_penalty` per occurrence.

They change the distribution that is sampled (greedy too), not the logprobs a request gets back,
which are of the model's own logits (`logprobs`). Rows of requests without penalties are
left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tandem.engine.request import Request


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[int]) -> None:
    """Penalizes, in place, those of `rows` of `logits` (fp32, (B, vocab)) whose requests ask."""
    vocab = logits.shape[-1]
    for i in rows:
        req = requests[i]
        if not req.params.penalized:
            continue
        p, row = req.params, logits[i]
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype)
        if req.bad_words_ids:
            banned = [
                seq[-1]
                for seq in req.bad_words_ids
                if seq[-1] < vocab and _ends_with(req.sampled_token_ids, seq[:-1])
            ]
            row[banned] = float("-inf")
        if p.allowed_token_ids:
            allowed = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long)
            kept = row[allowed]
            row.fill_(float("-inf"))
            row[allowed] = kept
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in req.token_ids if t < vocab}), dtype=torch.long)
            scores = row[seen]
            penalized = torch.where(
                scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty
            )
            row[seen] = penalized
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            output = [t for t in req.sampled_token_ids if t < vocab]
            if not output:
                continue
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
            counts = counts.to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def bad_word_sequences(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token sequences of `words` as vLLM bans them: each word as written and, where it
    makes a word token of its own (a first token of its own, and as many tokens), after a space
    (a word inside the text), without duplicates."""
    sequences: list[list[int]] = []
    for word in words:
        bare, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        own_word = not bare or (spaced[:1] != bare[:1] and len(spaced) == len(bare))
        for ids in (bare, spaced) if own_word else (bare,):
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def _ends_with(tokens: Sequence[int], tail: Sequence[int]) -> bool:
    return not tail or (len(tokens) >= len(tail) and list(tokens[-len(tail) :]) == list(tail))
