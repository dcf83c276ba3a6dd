"""`spaces_between_special_tokens` false (with `skip_special_tokens` false) writes an added token
right after another without the space a decoder puts before it, as vLLM's detokenizer does
(Llama 2's decoder puts one before an added, normalized token); the flag was taken and unused."""

from __future__ import annotations

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.output_text import OutputText
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    corpus = ["the model reads the cache", "hello world model", "the cache of the model"] * 20
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)  # fmt: skip
    raw.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")  # fmt: skip
    hf.add_tokens(["<tool>"])
    hf.add_special_tokens({"additional_special_tokens": ["<|sp1|>"]})
    return Tokenizer(hf)


def _text(tok: Tokenizer, ids: list[int], one_by_one: bool, **flags: bool) -> str:
    det = IncrementalDetokenizer(tok, tok.encode("hello"), **flags)
    steps = [det.step([i]) for i in ids] if one_by_one else [det.step(ids)]
    return "".join(steps) + det.flush()


def test_added_tokens_in_a_row_are_written_bare(tok: Tokenizer) -> None:
    tool, sp1 = tok.hf.convert_tokens_to_ids("<tool>"), tok.hf.convert_tokens_to_ids("<|sp1|>")
    model = tok.encode("model", add_special_tokens=False)
    ids = [tool, tool, tool, sp1, *model, sp1, sp1, tool, *model, tool]
    spaced = " <tool> <tool> <tool><|sp1|> model<|sp1|><|sp1|> <tool> model <tool>"
    bare = " <tool><tool><tool><|sp1|> model<|sp1|><|sp1|><tool> model <tool>"
    for one_by_one in (True, False):
        assert _text(tok, ids, one_by_one, skip_special_tokens=False) == spaced
        flags = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
        assert _text(tok, ids, one_by_one, **flags) == bare
        # (special tokens skipped: spaces stay, as vLLM writes them)
        skipped = _text(tok, ids, one_by_one, spaces_between_special_tokens=False)
        assert skipped == " <tool> <tool> <tool> model <tool> model <tool>"
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    text = OutputText.after(tok, tok.encode("hello"), ids, params=params)
    text.flush()
    assert text.text == bare


def test_the_http_field_reaches_the_sampling_params() -> None:
    """It was dropped as an unknown field (vLLM's completions and chat take it)."""
    from tandem.router.openai_protocol import ChatCompletionRequest, CompletionRequest

    off = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    completion = CompletionRequest(model="m", prompt="p", **off).sampling_dict()
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "p"}], **off)
    for fields in (completion, chat.sampling_dict()):
        assert SamplingParams(**fields).spaces_between_special_tokens is False
    assert CompletionRequest(model="m", prompt="p").sampling_dict()["spaces_between_special_tokens"]
