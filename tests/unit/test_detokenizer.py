"""Tests of tandem.engine.detokenizer.IncrementalDetokenizer."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tandem.engine import detokenizer as detok_module
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.tokenizer import Tokenizer

FFFD = "\ufffd"
TEXTS = [
    "Hello world! café naïve 中文 模型 🚀🎉 done.",
    "龘𠜎 畑🫠👍🏽 ❤️ Ελληνικά привет",
    " leading space, then 12345 and\nnew lines\n\n",
]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_checkpoint())


def _run(
    tok: Tokenizer,
    prompt: Sequence[int],
    output: Sequence[int],
    skip: bool = True,
    chunks: Sequence[int] | None = None,
) -> list[str]:
    """Feed ``output`` in chunks; check the hold-back invariant after every step."""
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas: list[str] = []
    sizes = list(chunks) if chunks is not None else [1] * len(output)
    pos = 0
    for size in sizes:
        deltas.append(det.step(output[pos : pos + size]))
        pos += size
        so_far = tok.decode(output[:pos], skip)
        assert det.text == "".join(deltas)
        assert so_far.startswith(det.text)
        # Text is only held back while the decode so far ends in an incomplete character.
        if det.text != so_far:
            assert so_far.endswith(FFFD)
    assert pos == len(output)
    deltas.append(det.flush())
    assert det.flush() == ""
    assert det.pending_token_count == 0
    assert "".join(deltas) == det.text == tok.decode(output, skip)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_text_one_token_at_a_time(tok: Tokenizer, text: str) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "say it"}])
    output = tok.encode(text)
    deltas = _run(tok, prompt, output)
    assert "".join(deltas) == text
    assert not any(FFFD in d for d in deltas)


def test_token_splitting_a_multibyte_char(tok: Tokenizer) -> None:
    output = tok.encode("a龘b")
    assert len(output) == 5  # 'a', three byte tokens of 龘, 'b'
    det = IncrementalDetokenizer(tok, tok.encode("prompt: "))
    assert det.step(output[:1]) == "a"
    assert det.step(output[1:2]) == ""
    assert det.step(output[2:3]) == ""
    assert det.pending_token_count == 2
    assert det.step(output[3:4]) == "龘"
    assert det.step(output[4:]) == "b"
    assert det.flush() == ""
    assert det.text == "a龘b"


def test_incomplete_char_at_the_end_is_flushed(tok: Tokenizer) -> None:
    output = tok.encode("ok 龘")[:-1]
    det = IncrementalDetokenizer(tok, [])
    streamed = "".join(det.step([t]) for t in output)
    assert FFFD not in streamed
    assert streamed + det.flush() == tok.decode(output)
    assert det.text.endswith(FFFD)


def test_prompt_ending_in_a_partial_char(tok: Tokenizer) -> None:
    ids = tok.encode("x龘y")
    prompt, output = ids[:2], ids[2:]  # the prompt ends with the first byte of 龘
    deltas = _run(tok, prompt, output)
    assert "".join(deltas) == tok.decode(output)
    assert "".join(deltas).startswith(FFFD)


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234 + skip)
    for _ in range(150):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(8))]
        output = [rng.randrange(tok.vocab_size + 8) for _ in range(rng.randrange(40))]
        chunks: list[int] = []
        while sum(chunks) < len(output):
            chunks.append(min(rng.randint(1, 4), len(output) - sum(chunks)))
        _run(tok, prompt, output, skip=skip, chunks=chunks)


def test_random_byte_heavy_sequences(tok: Tokenizer) -> None:
    # Runs of single-byte tokens (ids 3..258 are the byte alphabet) split characters often.
    rng = random.Random(7)
    for _ in range(100):
        output = [rng.randrange(3, 259) for _ in range(rng.randrange(1, 30))]
        _run(tok, [], output)


def test_special_tokens_in_output(tok: Tokenizer) -> None:
    output = tok.encode("hi <|im_end|>") + tok.encode("龘")[:2] + [0] + tok.encode("龘")[2:]
    for skip in (True, False):
        _run(tok, [1], output, skip=skip)


def test_cost_per_step_is_bounded(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded_lengths: list[int] = []
    real_decode = tok.decode

    def counting_decode(
        ids: Sequence[int], skip_special_tokens: bool = True, clean_up: bool = True
    ) -> str:
        decoded_lengths.append(len(ids))
        return real_decode(ids, skip_special_tokens, clean_up)

    monkeypatch.setattr(tok, "decode", counting_decode)
    output = tok.encode("the model serves tokens fast and slow " * 100)
    det = IncrementalDetokenizer(tok, tok.encode("prompt"))
    for token in output:
        det.step([token])
    det.flush()
    monkeypatch.undo()
    assert det.text == tok.decode(output)
    assert len(output) > 300
    assert max(decoded_lengths) <= detok_module.MAX_WINDOW + 1
    assert len(decoded_lengths) <= 1.25 * len(output)
