"""A tokenizer whose decode cleans up tokenization spaces (" ," to ",": transformers does it for
non-BPE tokenizers that ask for it) streams every character: the output text is written without
that clean-up, as vLLM's detokenizer writes it (it rewrote text already sent, and the stream lost
each "," and "." that followed a space)."""

from __future__ import annotations

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.tokenizer import Tokenizer

WORDS = ["<unk>", "</s>", "hello", ",", "world", ".", "it", "'s", "n't", "!", "ok"]


def _cleaning_tokenizer() -> Tokenizer:
    rust = RustTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=rust,
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=True,
    )
    return Tokenizer(hf)


def test_every_character_is_streamed_without_the_clean_up() -> None:
    tok = _cleaning_tokenizer()
    output = tok.encode("hello , world . it 's ok !", add_special_tokens=False)
    assert tok.decode(output) == "hello, world. it's ok!"  # (hf.decode's clean-up)
    raw = tok.decode(output, clean_up=False)
    assert raw == "hello , world . it 's ok !"
    for step in (1, 2, 3):
        det = IncrementalDetokenizer(tok, tok.encode("ok", add_special_tokens=False))
        deltas = [det.step(output[i : i + step]) for i in range(0, len(output), step)]
        deltas.append(det.flush())
        assert "".join(deltas) == det.text == " " + raw  # (after the prompt's "ok")
