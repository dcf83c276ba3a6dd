"""A finished (or cut) request as vLLM's `RequestOutput`: its text, its sample in `outputs`
with logprobs in vLLM's shape, and tandem's flat fields (the first sample's)."""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.output_text import OutputText
from tandem.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprob,
    RequestOutput,
    TokenLogprob,
)
from tandem.engine.request import Request
from tandem.engine.tokenizer import Tokenizer


def request_output(req: Request, tokenizer: Tokenizer, prompt: str | None = None) -> RequestOutput:
    if not req.params.detokenize:  # token ids only (vLLM's `detokenize=False`)
        text = ""
    elif req.output_text is not None:
        text = req.output_text.text
    else:  # the text after the prompt, as a stream or a stop string writes it (and vLLM):
        # in the prompt's context, so a decoder that strips a leading space (SentencePiece's
        # Metaspace) keeps the first token's
        after = OutputText.after(
            tokenizer,
            req.prompt_token_ids,
            _written(req),
            params=req.params,
        )
        after.flush()
        text = after.text
    logprobs = None if req.logprobs is None else list(req.logprobs)
    entries = None if req.prompt_logprobs is None else list(req.prompt_logprobs)
    sample = CompletionOutput(
        index=0,
        text=text,
        token_ids=req.output_token_ids,
        cumulative_logprob=None if logprobs is None else sum(lp for lp, _ in logprobs),
        logprobs=None if logprobs is None else vllm_logprobs(req, logprobs, tokenizer),
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
    )
    return RequestOutput(
        request_id=req.request_id,
        prompt=prompt,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=req.output_token_ids,
        text=text,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        num_cached_tokens=req.num_prefix_hit_tokens,
        finished=req.is_finished,
        logprobs=logprobs,
        prompt_logprobs=None if entries is None else vllm_prompt_logprobs(req, entries, tokenizer),
        prompt_logprob_entries=entries,
        outputs=[sample],
    )


def vllm_logprobs(
    req: Request, entries: list[TokenLogprob], tokenizer: Tokenizer
) -> list[dict[int, Logprob]]:
    """vLLM's shape of a request's logprobs: per token, itself with its rank in the vocabulary,
    then its alternatives (rank i + 1). A token prefilled by another engine has a rank only
    when it is one of its alternatives."""

    text = _token_text(req, tokenizer)
    computed = req.logprob_ranks  # (the last entries' ranks: see `Request.logprob_ranks`)
    unranked = len(entries) - len(computed)
    out = []
    for n, (token, (logprob, top)) in enumerate(zip(req.output_token_ids, entries, strict=False)):
        ranks = {alt: i + 1 for i, (alt, _) in enumerate(top)}
        rank = computed[n - unranked] if n >= unranked else ranks.get(token)
        found = {token: Logprob(logprob, rank, text(token))}
        for alt, alt_logprob in top:
            found.setdefault(alt, Logprob(alt_logprob, ranks[alt], text(alt)))
        out.append(found)
    return out


def vllm_prompt_logprobs(
    req: Request, entries: list[PromptLogprob | None], tokenizer: Tokenizer
) -> list[dict[int, Logprob] | None]:
    """vLLM's shape of a request's prompt logprobs: per prompt token (the first None), the token
    itself with its rank in the vocabulary, then its alternatives (rank i + 1)."""
    text = _token_text(req, tokenizer)
    out: list[dict[int, Logprob] | None] = []
    for token, entry in zip(req.prompt_token_ids, entries, strict=False):
        if entry is None:
            out.append(None)
            continue
        logprob, top, rank = entry
        found = {token: Logprob(logprob, rank, text(token))}
        for i, (alt, alt_logprob) in enumerate(top):
            found.setdefault(alt, Logprob(alt_logprob, i + 1, text(alt)))
        out.append(found)
    return out


def _written(req: Request) -> list[int]:
    """The output tokens whose text the request's text holds: not the stop token (EOS, a
    `stop_token_ids` one) it ended on, unless `include_stop_str_in_output` (vLLM's rule)."""
    ids = req.output_token_ids
    stopped_on_token = (
        req.finish_reason == "stop"
        and bool(ids)
        and ids[-1] in req.stop_ids
        and not isinstance(req.stop_reason, str)
    )
    return ids[:-1] if stopped_on_token and not req.params.include_stop_str_in_output else ids


def _token_text(req: Request, tokenizer: Tokenizer) -> Callable[[int], str | None]:
    """One token's text, as vLLM's `decoded_token` (None with `detokenize=False`)."""

    def text(token: int) -> str | None:
        if not req.params.detokenize:
            return None
        return tokenizer.token_text(token)

    return text
