"""A checkpoint whose tokenizer is only a SentencePiece `tokenizer.model` (Llama 2 and Mistral
v0.1 ship them so) loads, tokenizes and generates as transformers does."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tandem import LLM, SamplingParams

# (transformers' models are imported in the tests, not here: importing them imports
# triton.language, which must first be imported under TRITON_INTERPRET by test_triton_kernels)

WORDS = ["the", "model", "cache", "block", "prefill", "decode", "hello", "world", "tandem"]


def _sentencepiece_checkpoint(root: Path) -> Path:
    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(0)
    corpus = root / "corpus.txt"
    lines = (" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(1000))
    corpus.write_text("\n".join(lines) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(root / "sp"), vocab_size=320, model_type="bpe",
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, byte_fallback=True, character_coverage=1.0,
        minloglevel=2,
    )  # fmt: skip
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "tokenizer.model").write_bytes((root / "sp.model").read_bytes())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": True}  # fmt: skip
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model_config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(model_config).save_pretrained(ckpt)
    return ckpt


def test_a_tokenizer_model_only_checkpoint_equals_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    ckpt = _sentencepiece_checkpoint(tmp_path)
    assert not (ckpt / "tokenizer.json").exists()
    hf_tokenizer = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    hf_model = LlamaForCausalLM.from_pretrained(ckpt).eval()
    llm = LLM(model=str(ckpt))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for text in ("hello world", "tandem decode é"):
        ids = hf_tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
        out = llm.generate(text, params)[0]
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.token_ids == ref[0, ids.shape[1] :].tolist()
        # The text is the one a stream or a stop string writes (the server's): the same tokens
        # decoded in the prompt's context (these random bytes decode alone to other U+FFFDs).
        cut = llm.generate(text, params.model_copy(update={"stop": ["@@@"]}))[0]
        assert out.text == cut.text


def test_the_text_keeps_the_first_tokens_leading_space_as_a_stream_does(tmp_path: Path) -> None:
    """SentencePiece's decoder strips the leading space of a text; after a prompt, the first
    output token's space is the text's (as vLLM writes it), with or without a stop string."""
    from transformers import AutoTokenizer

    ckpt = _sentencepiece_checkpoint(tmp_path)
    hf_tokenizer = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    world = hf_tokenizer.convert_tokens_to_ids("\u2581world")
    llm = LLM(model=str(ckpt))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, allowed_token_ids=[world])
    plain = llm.generate("hello", params)[0]
    cut = llm.generate("hello", params.model_copy(update={"stop": ["@@@"]}))[0]
    assert plain.token_ids == cut.token_ids == [world, world]
    assert hf_tokenizer.decode(plain.token_ids) == "world world"  # (alone: stripped)
    assert plain.text == cut.text == " world world"
    # logprobs name each token with its space (vLLM's `decoded_token`): they join into the text
    scored = llm.generate("hello", params.model_copy(update={"logprobs": 0}))[0].outputs[0]
    assert scored.logprobs is not None
    assert [entry[world].decoded_token for entry in scored.logprobs] == [" world", " world"]
