"""Tests of tandem.engine.tokenizer.Tokenizer on tiny checkpoints."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.engine.errors import CheckpointError
from tandem.engine.tokenizer import Tokenizer

TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "Café naïve façade crème brûlée über señor",
    "中文 日本語 你好世界 畑 龘",
    "emoji 🚀🎉👍🏽 ❤️ 🫠 mixed with text",
    "line one\nline two\n\n\ttabbed 12345 3.14",
    "Ελληνικά привет مرحبا שלום नमस्ते",
]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_checkpoint())


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids == tok.hf.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_a_text_longer_than_the_tokenizers_config_limit_logs_no_warning(
    tiny_checkpoint: Callable[..., Path], capfd: pytest.CaptureFixture[str]
) -> None:
    """The engine checks lengths itself (`max_model_len`): the tokenizer's configured limit
    (2048 for the tiny checkpoint) must not log transformers' "indexing errors" warning."""
    fresh = Tokenizer.from_pretrained(tiny_checkpoint())  # (transformers warns once per object)
    ids = fresh.encode("hello world " * 1500)
    assert len(ids) > 2048
    assert "longer than the specified maximum" not in capfd.readouterr().err


def test_multibyte_chars_split_into_byte_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("龘")  # not in the training corpus: one token per UTF-8 byte
    assert len(ids) == 3
    assert tok.decode(ids[:1]) == "\ufffd"
    assert tok.decode(ids) == "龘"


def test_decode_matches_hf(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size + 20) for _ in range(rng.randrange(12))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode((1, 72, 2), skip_special_tokens=False) == tok.hf.decode([1, 72, 2])


def test_special_tokens(tok: Tokenizer) -> None:
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nhi"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_chat_template(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Привет 🙂"},
    ]
    ids = tok.apply_chat_template(messages)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nПривет 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert ids == tok.encode(expected)
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )
    started = [*messages, {"role": "assistant", "content": "Да, и"}]
    open_ended = tok.apply_chat_template(
        started, add_generation_prompt=False, continue_final_message=True
    )
    assert tok.decode(open_ended, skip_special_tokens=False) == expected + "Да, и"


def test_eos_and_vocab(tok: Tokenizer, tiny_checkpoint: Callable[..., Path]) -> None:
    assert tok.eos_token_ids == frozenset({0, 2})
    assert tok.vocab_size == len(tok.hf) == 512
    small = Tokenizer.from_pretrained(tiny_checkpoint(vocab=300))
    assert small.vocab_size == 300


def test_eos_from_int_or_config(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(), path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_pretrained(path).eos_token_ids == frozenset({0, 7})
    (path / "generation_config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = [0, 5]
    (path / "config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(path).eos_token_ids == frozenset({0, 5})


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):  # CheckpointError is a FileNotFoundError
        Tokenizer.from_pretrained(tmp_path)


def test_digest(tok: Tokenizer, tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    digest = tok.digest()
    assert len(digest) == 32 and int(digest, 16) >= 0
    assert tok.digest() == digest
    assert Tokenizer.from_pretrained(tiny_checkpoint()).digest() == digest
    # Same tokenizer files (the seed only changes weights) -> same digest.
    assert Tokenizer.from_pretrained(tiny_checkpoint(seed=1, layers=1)).digest() == digest
    assert Tokenizer.from_pretrained(tiny_checkpoint(vocab=300)).digest() != digest
    # A different chat template changes the digest.
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("assistant", "bot")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(path).digest() != digest
    # A tokenizer built in memory hashes its serialized form.
    in_memory = Tokenizer(tok.hf)
    assert in_memory.digest() == Tokenizer(tok.hf).digest() != digest
    assert in_memory.eos_token_ids == frozenset({0})


def test_chat_template_kwargs_reach_the_template(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """vLLM's `chat_template_kwargs` (e.g. Qwen3's `enable_thinking`) are template variables."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] += "{% if enable_thinking %}{{ '<think>' }}{% endif %}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "hi"}]
    plain = tok.apply_chat_template(messages)
    thinking = tok.apply_chat_template(messages, template_kwargs={"enable_thinking": True})
    assert thinking[: len(plain)] == plain and tok.decode(thinking[len(plain) :]) == "<think>"
    assert tok.apply_chat_template(messages, template_kwargs={"enable_thinking": False}) == plain


def test_a_bpe_tokenizer_asking_for_clean_up_keeps_the_fast_decode(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """Llama 3's tokenizer_config.json asks for `clean_up_tokenization_spaces`, which
    transformers 5 skips for BPE: the backend's decode (no Python per step) is hf.decode's."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_checkpoint(), local_files_only=True)
    hf.clean_up_tokenization_spaces = True
    tok = Tokenizer(hf)
    assert tok._backend is not None
    ids = tok.encode("a , b . c 's d ?", add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids) == "a , b . c 's d ?"
    hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert Tokenizer(hf)._backend is None  # (then hf.decode cleans up: it is the one used)
