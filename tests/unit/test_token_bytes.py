"""Chat logprobs' `bytes` are a token's own bytes: the bytes of the tokens of a text join back
into it, also where a token holds part of a character (its text alone is U+FFFD)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.engine.token_bytes import byte_level_alphabet
from tandem.engine.tokenizer import Tokenizer
from tandem.router.openai_logprobs import chat_logprobs

TEXT = "café 日本 model 😀"


def test_byte_level_alphabet_spells_every_byte_once() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert (alphabet["A"], alphabet["Ġ"], alphabet["Ċ"], alphabet["é"]) == (65, 32, 10, 0xE9)


def test_byte_level_bpe_tokens_join_back_into_the_text(tiny_checkpoint: Any) -> None:
    tok = Tokenizer.from_pretrained(tiny_checkpoint())
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert "\ufffd" in [tok.decode([i]) for i in ids]  # (some token holds part of a character)
    assert b"".join(tok.token_bytes(i) for i in ids) == TEXT.encode()
    assert [tok.token_text(i) for i in ids] == [tok.decode([i]) for i in ids]
    eos = next(iter(tok.eos_token_ids))
    assert tok.token_text(eos) == tok.decode([eos], skip_special_tokens=False)
    assert tok.token_bytes(eos) == tok.decode([eos], skip_special_tokens=False).encode()


def test_sentencepiece_byte_fallback_and_spaces(tmp_path: Path) -> None:
    from tests.unit.test_sentencepiece_tokenizer import _sentencepiece_checkpoint

    tok = Tokenizer.from_pretrained(_sentencepiece_checkpoint(tmp_path))
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = tok.hf.convert_ids_to_tokens(ids)
    assert "<0xE6>" in pieces and "▁model" in pieces
    # (SentencePiece writes the text's leading space itself; decoding drops it again)
    assert b"".join(tok.token_bytes(i) for i in ids) == b" " + TEXT.encode()
    model = ids[pieces.index("▁model")]  # (logprobs name it with its space, as vLLM does)
    assert (tok.token_text(model), tok.decode([model])) == (" model", "model")
    assert tok.token_text(ids[pieces.index("<0xE6>")]) == "\ufffd"


def test_chat_logprobs_carry_the_token_bytes(tiny_checkpoint: Any) -> None:
    tok = Tokenizer.from_pretrained(tiny_checkpoint())
    ids = tok.encode("😀", add_special_tokens=False)
    entries = [(-0.5, [(i, -0.5)]) for i in ids]
    text = lambda i: tok.decode([i], skip_special_tokens=False)  # noqa: E731
    got = chat_logprobs(ids, entries, text, tok.token_bytes)["content"]
    assert b"".join(bytes(e["bytes"]) for e in got) == "😀".encode()
    assert [e["top_logprobs"][0]["bytes"] for e in got] == [e["bytes"] for e in got]
    assert any(e["token"] == "\ufffd" for e in got)
