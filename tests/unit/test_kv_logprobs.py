"""Logprobs across the transfer: the prefill's first token's logprobs travel in the last chunk's
header, so decode's stream carries them for every token, as the colocated engine computes
them; a last chunk whose logprobs are missing or malformed fails the transfer, and frees it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.kv_transfer.base import EncodedHeader
from tests.kv_protocol_pair import Pair, colocated, model, prompt_of  # noqa: F401 - fixtures

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def test_logprobs_of_every_token_equal_the_colocated_engine_s(
    model: str,  # noqa: F811
    colocated: LLM,  # noqa: F811
) -> None:
    pair = Pair(model)
    prompt = prompt_of(16 * 9 + 5, start=3)
    pair.start("lp", prompt, PARAMS)
    events = pair.pump()
    committed = next(e for e in events if e.kind == "committed")
    first = next(e for e in events if e.kind == "first_token")
    assert committed.logprobs is not None and len(committed.logprobs) == 1
    assert committed.token_ids == first.token_ids
    logprobs = list(committed.logprobs)
    tokens = list(committed.token_ids)
    while pair.decode.has_unfinished_requests():
        for out in pair.decode.step():
            tokens += out.new_token_ids
            assert out.logprobs is not None
            logprobs += out.logprobs
    want = colocated.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert tokens == want.token_ids and want.logprobs is not None
    assert len(logprobs) == len(want.logprobs) == 6
    for (lp, top), (want_lp, want_top) in zip(logprobs, want.logprobs, strict=True):
        assert lp == pytest.approx(want_lp, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in want_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)
    pair.idle()


@pytest.mark.parametrize(
    "bad",
    [None, [], [[0.5, [[1, 0.1]] * 4]], [["x", []]], [[-1.0, [[1.5, -2.0]]]]],
    ids=["missing", "too few", "too many alternatives", "not a number", "id not an int"],
)
def test_a_last_chunk_with_bad_logprobs_fails_the_transfer(model: str, bad: Any) -> None:  # noqa: F811
    pair = Pair(model)
    send = pair.p_transport.send

    def tamper(peer: str, header: dict[str, Any], src_block_ids: Any = ()) -> None:
        if header.get("type") == "pages" and header["manifest"]["last"]:
            body = json.loads(header.text) if isinstance(header, EncodedHeader) else dict(header)
            body.pop("first_token_logprobs")
            if bad is not None:
                body["first_token_logprobs"] = bad
            header = body
        send(peer, header, src_block_ids)

    pair.p_transport.send = tamper  # type: ignore[method-assign]
    pair.start("bad", prompt_of(16 * 3 + 1), PARAMS)
    events = pair.pump()
    failed = [e for e in events if e.kind == "failed"]
    assert failed and "first_token_logprobs are missing or malformed" in (failed[0].error or "")
    assert not [e for e in events if e.kind == "committed"]
    pair.clock.now += 10
    pair.pump()
    pair.idle()


def test_coalesced_token_items_keep_every_token_s_logprobs() -> None:
    """A decode stream merges the token items a slow reader left queued: their logprobs too."""
    from tandem.decode_workers.token_streams import merge_token_items as _merge

    a = {"type": "tokens", "token_ids": [1], "text": "a", "logprobs": [[-0.1, []]]}
    b = {"type": "tokens", "token_ids": [2, 3], "text": "bc", "logprobs": [[-0.2, []], [-0.3, []]]}
    merged = _merge(
        _merge(a, b), {"type": "tokens", "token_ids": [4], "text": "d", "logprobs": [[-0.4, []]]}
    )
    assert merged["token_ids"] == [1, 2, 3, 4]
    assert [lp for lp, _ in merged["logprobs"]] == [-0.1, -0.2, -0.3, -0.4]
    plain = {"type": "tokens", "token_ids": [5], "text": "e"}
    assert "logprobs" not in _merge(plain, plain)
