"""Whether a prefill worker's first token already ends its request (`Outgoing.first_token_ends`,
the prefill engine runs without stop strings): by the engine's own stop rules, so that the
cluster stops where `LLM.generate` stops."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer
from tandem.kv_transfer._sender_records import Outgoing
from tests.unit.test_sentencepiece_tokenizer import _sentencepiece_checkpoint


def _ends(tok: Tokenizer, prompt: list[int], first: int, params: SamplingParams) -> bool:
    req = Request("r", prompt, params, frozenset())
    req.token_ids.append(first)
    return Outgoing(req, params, None, 0).first_token_ends(tok)


@pytest.fixture(scope="module")
def sp(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(_sentencepiece_checkpoint(tmp_path_factory.mktemp("sp")))


def test_a_stop_string_in_the_first_token_counts_only_without_min_tokens(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    tok = Tokenizer.from_pretrained(tiny_checkpoint())
    prompt = tok.encode("hello world")
    first = tok.encode(" the", add_special_tokens=False)[0]
    text = tok.decode([first])
    assert text.strip()
    params = SamplingParams(max_tokens=8, stop=[text.strip()])
    assert _ends(tok, prompt, first, params)
    # (the engine searches stop strings after the first `min_tokens` tokens only)
    assert not _ends(tok, prompt, first, params.model_copy(update={"min_tokens": 1}))
    assert not _ends(tok, prompt, first, params.model_copy(update={"stop": ["zzz"]}))


def test_a_stop_string_in_a_first_byte_token_ends_the_request(sp: Tokenizer) -> None:
    """ "\n" is a byte token (its text is held until its run ends): it still ends the request
    when the stop string is "\n", as `LLM.generate` stops on it."""
    newline = sp.encode("a\n", add_special_tokens=False)[-1]
    assert newline in sp.byte_run_ids
    params = SamplingParams(max_tokens=8, stop=["\n"])
    assert _ends(sp, sp.encode("hello"), newline, params)
    assert not _ends(sp, sp.encode("hello"), newline, params.model_copy(update={"stop": ["x"]}))
