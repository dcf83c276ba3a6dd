"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, min_tokens,
penalties.

Greedy rows are an argmax over the batch. Other rows are filtered together (row by row, so
that a row's distribution does not depend on the others) and drawn one by one; a row with a
seed draws from its own `torch.Generator`, seeded before each draw from the seed and the
token's place in the output (`draw_seed`: its tokens depend on neither the batch nor the
worker that draws them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.greedy_argmax import greedy_argmax
from tandem.engine.guided import mask_disallowed
from tandem.engine.penalties import apply_penalties
from tandem.engine.request import Request
from tandem.engine.sampling_candidates import CANDIDATES, candidate_probabilities, nucleus_drop
from tandem.engine.seeds import draw_seed

NO_TOKEN = -1
"""The "token" of a row whose request allows none (its constraints exclude every token: e.g.
`allowed_token_ids` none of which its grammar accepts). The request ends there."""


def sample(
    logits: torch.Tensor, requests: Sequence[Request], extra_rows: Sequence[int] = ()
) -> list[int]:
    """One token per row of `logits` (fp32, (B, vocab)); row i belongs to requests[i].
    `extra_rows`: the rows of requests with `sampling_extras` (penalties are looked for there);
    such a row that allows no token gets `NO_TOKEN`. `logits` is changed in place (masks,
    penalties, temperature): take what else needs them first.

    Without `extra_rows` the logits may be on any device (a GPU's): the filters run there and
    only token ids, and each sampled row's candidates (or its whole distribution where they do
    not hold its kept tokens), cross to the host, where the draws are made. With them, the
    logits must be on the host (penalties and grammars are applied there)."""
    _suppress_stops_before_min_tokens(logits, requests)
    stuck: list[int] = []
    if extra_rows:
        apply_penalties(logits, requests, extra_rows)
        mask_disallowed(logits, requests, extra_rows)
        masked = [i for i in extra_rows if requests[i].params.adjusts_logits]  # (not logprobs)
        stuck = _allowing_nothing(logits, masked) if masked else []
        for i in stuck:  # (a harmless distribution: its token is replaced below)
            logits[i] = 0.0
    tokens = [NO_TOKEN] * len(requests)
    greedy_rows = [i for i, r in enumerate(requests) if r.params.greedy]
    if greedy_rows:  # (over every row: the model's vocab-major layout is the fast one)
        picked = greedy_argmax(logits).tolist()
        for i in greedy_rows:
            tokens[i] = picked[i]
    drawn_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if drawn_rows:
        drawn = _draw_rows(rows_of(logits, drawn_rows), [requests[i] for i in drawn_rows])
        for i, token in zip(drawn_rows, drawn, strict=True):
            tokens[i] = token
    for i in stuck:
        tokens[i] = NO_TOKEN
    return tokens


def rows_of(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """`logits` when `rows` is every row, else a copy of those rows."""
    if len(rows) == len(logits):
        return logits
    return logits.index_select(0, torch.tensor(list(rows), device=logits.device))


def _generator(request: Request) -> torch.Generator | None:
    """A seeded request's generator, seeded for its next draw from its seed and the draw's
    place in its output (so that its tokens depend on neither the batch nor the worker);
    None (the global one) for any other."""
    seed, generator = request.params.seed, request.generator
    if seed is None or generator is None:
        return None
    return generator.manual_seed(draw_seed(seed, request.num_sampled_tokens))


def _draw_rows(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """A token drawn for each row, over its candidates where its kept tokens all lie among
    them (`sampling_candidates`), else over the whole vocabulary; filtered together (each row
    alone: its tokens do not depend on the others), drawn one by one."""
    generators = [_generator(r) for r in requests]
    scaled = _scaled(logits, requests)
    short = candidate_probabilities(scaled, requests)
    tokens = [NO_TOKEN] * len(requests)
    fitting = [j for j, fits in enumerate(short.fits.tolist()) if fits]
    if fitting:  # (the draws are made on the host, from its generators)
        ids, probs = short.ids.cpu(), short.probs.cpu()
        for j in fitting:
            i = short.rows[j]
            tokens[i] = int(ids[j, draw(probs[j], generators[i])])
    rest = sorted(set(range(len(requests))) - {short.rows[j] for j in fitting})
    if rest:
        filtered = _filtered(rows_of(scaled, rest), [requests[i] for i in rest]).cpu()
        for i, row in zip(rest, filtered, strict=True):
            tokens[i] = draw(row, generators[i])
    return tokens


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """A token drawn from `probs` (one row; non-negative, zeros allowed, summing to ~1): the
    first whose cumulative probability (in float64) exceeds a uniform draw in [0, total). The
    same distribution as `torch.multinomial(probs, 1)`, which is not vectorized on the CPU:
    ~0.7 ms against ~0.09 ms for a 32k vocabulary here, 3.1 against 0.2 ms for 152k."""
    cdf = probs.double().cumsum(dim=0)
    total = cdf[-1:]
    u = torch.rand(1, generator=generator, dtype=cdf.dtype, device=cdf.device) * total
    # A zero-probability token adds nothing to the cumulative sum, so it is never the first to
    # exceed u; `last` (the first index reaching the total) guards u rounding up to the total.
    picked, last = torch.searchsorted(cdf, u, right=True), torch.searchsorted(cdf, total)
    return int(torch.minimum(picked, last).item())


def _allowing_nothing(logits: torch.Tensor, rows: Sequence[int]) -> list[int]:
    """Those of `rows` in which every token is masked out (-inf)."""
    index = torch.tensor(list(rows), dtype=torch.long)
    best = logits.index_select(0, index).amax(dim=-1)
    return [rows[j] for j in torch.nonzero(best == float("-inf")).flatten().tolist()]


def _probabilities(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Each row's sampling distribution over the whole vocabulary."""
    return _filtered(_scaled(logits, requests), requests)


def _scaled(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """`logits` over each row's temperature (`_finite_above`), in place (a new tensor of a
    whole batch's rows costs its page faults: as much as the division itself here)."""
    temps = _like(logits, [r.params.temperature for r in requests])
    return _finite_above(logits.div_(temps[:, None]))


def _filtered(scaled: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """min-p, top-k and top-p over the whole vocabulary, then the softmax."""
    min_ps = [r.params.min_p for r in requests]
    if any(p > 0.0 for p in min_ps):
        scaled = _apply_min_p(scaled, _like(scaled, min_ps))
    top_ks = [r.params.top_k for r in requests]
    if any(k > 0 for k in top_ks):
        scaled = _apply_top_k(scaled, top_ks)
    top_ps = [r.params.top_p for r in requests]
    if any(p < 1.0 for p in top_ps):
        scaled = _apply_top_p(scaled, _like(scaled, top_ps))
    return torch.softmax(scaled, dim=-1)


def _like(
    tensor: torch.Tensor,
    values: Sequence[float] | Sequence[int] | Sequence[bool],
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`values` as a tensor on `tensor`'s device (of its dtype unless `dtype` is given)."""
    return torch.tensor(values, dtype=dtype or tensor.dtype, device=tensor.device)


def _finite_above(scaled: torch.Tensor) -> torch.Tensor:
    """`scaled`, in place, with +inf (a logit over a small temperature, or one a repetition
    penalty near 0 divided) as the dtype's largest value and NaN as -inf: softmax then gives
    the largest tokens the mass instead of NaNs, which would poison the cumulative sum `draw`
    searches."""
    top = torch.finfo(scaled.dtype).max
    return scaled.nan_to_num_(nan=float("-inf"), posinf=top, neginf=float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drops the tokens less likely than min_p times the most likely one (after temperature,
    as vLLM and transformers' MinPLogitsWarper do)."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keeps each row's `k` largest logits (ties with the k-th too); k <= 0 or >= the
    vocabulary keeps all. One `topk` of the widest k, not a sort of the whole vocabulary
    (0.2 against 2.4 ms a row at 32k here)."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_ks]
    widest = max(ks)
    if widest == 0:
        return logits
    largest = logits.topk(widest, dim=-1).values  # (descending)
    kth = largest.gather(1, _like(largest, [max(k, 1) - 1 for k in ks], torch.long)[:, None])
    kth = kth.masked_fill(_like(kth, [k == 0 for k in ks], torch.bool)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


TOP_P_CANDIDATES = CANDIDATES
"""The most likely tokens `_apply_top_p` looks among first: a row whose nucleus lies within
them (as a trained model's does) needs no sort of its whole vocabulary."""


def _apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose probability reaches top_p (dropping
    the least likely tokens whose cumulative probability, from the least likely up, is at most
    1 - top_p, as transformers' TopPLogitsWarper and vLLM do); top_p >= 1 keeps all."""
    width = min(logits.shape[-1], TOP_P_CANDIDATES)
    top_probs, top_ids = logits.softmax(dim=-1).topk(width, dim=-1)
    outside = (1.0 - top_probs.sum(dim=-1)).clamp_(min=0.0)  # the mass of all the others
    kept = _top_p_among(logits, top_ids.flip(-1), top_probs.flip(-1), outside, top_ps)
    wide = ((1.0 - outside) < top_ps).nonzero().flatten()  # nuclei reaching past them
    if len(wide):
        kept[wide] = _top_p_sorted(logits.index_select(0, wide), top_ps[wide])
    return torch.where((top_ps >= 1.0)[:, None], logits, kept)


def _top_p_among(
    logits: torch.Tensor,
    ids: torch.Tensor,
    probs: torch.Tensor,
    outside: torch.Tensor,
    top_ps: torch.Tensor,
) -> torch.Tensor:
    """`_apply_top_p` when the nucleus lies within the candidates `ids` (ascending, with their
    `probs`): every other token is dropped (the mass `outside` counts first)."""
    kept = logits.gather(1, ids).masked_fill(nucleus_drop(probs, top_ps, outside), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, kept)


def _top_p_sorted(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """`_apply_top_p` over the whole vocabulary, sorted."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    drop = nucleus_drop(sorted_logits.softmax(dim=-1), top_ps)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _suppress_stops_before_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows: list[int] = []
    ids: list[int] = []
    for i, req in enumerate(requests):
        if (
            req.params.min_tokens
            and req.num_output_tokens < req.params.min_tokens
            and req.min_tokens_ids
        ):
            stops = [t for t in req.min_tokens_ids if t < logits.shape[-1]]
            rows.extend([i] * len(stops))
            ids.extend(stops)
    if ids:
        where = (_like(logits, rows, torch.long), _like(logits, ids, torch.long))
        logits.index_put_(where, _like(logits, [float("-inf")]))
