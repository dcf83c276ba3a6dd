"""Build tiny, random, fully deterministic Hugging Face checkpoints for tests and demos.

`build_tiny_checkpoint` writes a directory that `transformers.AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load offline:

- ``config.json`` (Llama / Qwen2 / Qwen3 / Mistral ``*ForCausalLM``, ``head_dim`` explicit, rotary
  settings in transformers 5.x ``rope_parameters``),
- ``model.safetensors`` (random weights; byte-identical for the same arguments),
- ``generation_config.json`` (eos = ``<|endoftext|>`` and ``<|im_end|>``),
- ``tokenizer.json`` + ``tokenizer_config.json`` (a byte-level BPE trained here on a fixed corpus,
  with a ChatML chat template).

The tokenizer does not depend on ``seed`` (only on ``vocab``), so checkpoints that differ only in
their seed share a tokenizer. It adds no BOS token when encoding (Qwen-style).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
"""Supported ``arch`` values and the transformers class each one writes."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens, with ids 0, 1, 2 in this order."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then the assistant header."""

PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Pre-tokenizer split pattern (Qwen2's): words with one leading non-letter, single digits, etc."""

NORM_WEIGHT_STD = 0.1
"""Norm weights are drawn from 1 + normal(0, NORM_WEIGHT_STD) so that a missed norm is visible."""

_CORPUS_SEED = 20240611
_WORDS = (  # noqa: SIM905 - a word list reads better as one string
    "the a an of to and in is it that for on with as by at from this be are was not or but all we "
    "you they model token tokens cache prefix decode prefill serve serving engine request batch "
    "block page kernel attention layer head rotary paged queue worker router stream fast slow "
    "river mountain cloud light night day blue green red yellow one two three four five hello "
    "world question answer system user assistant time memory 0 1 2 3 42 100 2048 3.14 "
    "café naïve über señor façade crème brûlée déjà vu garçon Zürich São Paulo ñandú smørrebrød "
    "Ελληνικά γλώσσα привет мир спасибо 中文 日本語 你好 世界 模型 東京 北京 学习 计算机 "
    "こんにちは ありがとう 한국어 안녕하세요 مرحبا שלום नमस्ते 🙂 🚀 🎉 👍🏽 ❤️ 🌍 🤖 ✨ 🐍 🍣"
).split()
_SYLLABLES = "ka to ri ne mo su la pe chi zu ba do gi ho ku mi na se ta yo ré ça ü 語 界 ñ".split()  # noqa: SIM905
_PUNCT = (".", "!", "?", ",", ";", ":", "", "", "...")


def tiny_corpus() -> list[str]:
    """Return the fixed training corpus of the tiny tokenizer (the same on every call)."""
    rng = random.Random(_CORPUS_SEED)
    lines: list[str] = []
    for _ in range(600):
        words: list[str] = []
        for _ in range(rng.randint(3, 14)):
            if rng.random() < 0.25:
                words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
            else:
                words.append(rng.choice(_WORDS))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        line = " ".join(words) + rng.choice(_PUNCT)
        if rng.random() < 0.1:
            line = f"  {line}\n\n\t{rng.randint(0, 99999)}"
        lines.append(line)
    return lines


def train_tiny_tokenizer(vocab: int, model_max_length: int = 2048) -> Any:
    """Train a byte-level BPE of at most ``vocab`` tokens and wrap it as a fast HF tokenizer.

    The result is a ``transformers.PreTrainedTokenizerFast`` with ``<|endoftext|>`` as bos, eos
    and pad, ``<|im_start|>``/``<|im_end|>`` as further special tokens, and a ChatML chat template.
    Raises ValueError if ``vocab`` cannot hold the 256 byte tokens plus the special tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab < minimum:
        raise ValueError(
            f"vocab={vocab} is too small: a byte-level tokenizer needs at least {minimum} tokens "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    backend = Tokenizer(models.BPE())
    # The same normalizer and pre-tokenizer that transformers' Qwen2Tokenizer rebuilds when
    # AutoTokenizer loads a checkpoint whose model_type is qwen2, so every arch behaves the same.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def rope_parameters(rope_theta: float, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Return transformers 5.x ``rope_parameters`` for a base theta and optional scaling.

    ``rope_scaling`` uses the same keys as the config, e.g. for Llama 3.1-style scaling
    ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}``; the legacy key ``type`` is accepted for
    ``rope_type``.
    """
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        scaling = dict(rope_scaling)
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
        params.update(scaling)
    return params


def _make_config(
    arch: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    intermediate: int,
    tie_embeddings: bool,
    max_position: int,
    dtype: str,
    rope: dict[str, Any],
    init_std: float,
    sliding_window: int | None,
) -> Any:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position,
        "rope_parameters": rope,
        "tie_word_embeddings": tie_embeddings,
        "initializer_range": init_std,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "architectures": [ARCHITECTURES[arch]],
        "dtype": dtype,
    }
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common)
    return transformers.MistralConfig(**common, sliding_window=sliding_window)


@torch.no_grad()
def _reinit_parameters(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Overwrite every parameter from a generator seeded with ``seed``.

    Matrices, embeddings and biases get normal(0, init_std); norm weights (1-D parameters whose
    name contains ``norm``) get 1 + normal(0, NORM_WEIGHT_STD). Nothing is left at zero or one.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if param.ndim == 1 and "norm" in name:
            values = 1.0 + NORM_WEIGHT_STD * values
        else:
            values = init_std * values
        param.copy_(values.to(param.dtype))


def build_tiny_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    vocab: int = 512,
    intermediate: int | None = None,
    seed: int = 0,
    tie_embeddings: bool = False,
    max_position: int = 2048,
    dtype: str = "float32",
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    init_std: float = 0.1,
    sliding_window: int | None = None,
) -> Path:
    """Write a random Hugging Face checkpoint of the given shape to ``out_dir`` and return it.

    ``vocab`` is the model's vocab size; the tokenizer gets min(vocab, what BPE training yields)
    tokens, so ids at or above ``len(tokenizer)`` exist in the model only. ``head_dim`` defaults
    to ``hidden // heads``, ``intermediate`` to ``2 * hidden``. ``sliding_window`` is only
    accepted for ``mistral`` (None, the default, means full attention in every layer).
    Files with the same names in ``out_dir`` are overwritten; other files are left alone.
    The same arguments give byte-identical files. Raises ValueError for bad arguments.
    """
    import transformers
    from huggingface_hub.errors import StrictDataclassError  # config validation errors
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r} is not supported; choose one of {sorted(ARCHITECTURES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    for label, value in (("layers", layers), ("hidden", hidden), ("heads", heads)):
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"heads={heads} must be a positive multiple of kv_heads={kv_heads}")
    if head_dim is None and hidden % heads != 0:
        raise ValueError(f"hidden={hidden} must be a multiple of heads={heads} (or pass head_dim)")
    if sliding_window is not None and arch != "mistral":
        raise ValueError(f"sliding_window is only supported for arch='mistral', not {arch!r}")
    head_dim = hidden // heads if head_dim is None else head_dim
    intermediate = 2 * hidden if intermediate is None else intermediate
    if head_dim < 2 or head_dim % 2 != 0:
        raise ValueError(
            f"head_dim must be an even number >= 2 for rotary embeddings, got {head_dim}"
        )

    tokenizer = train_tiny_tokenizer(vocab, model_max_length=max_position)
    if len(tokenizer) > vocab:  # cannot happen with BPE training, kept as a guard
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab={vocab}")

    try:
        config = _make_config(
            arch,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=vocab,
            intermediate=intermediate,
            tie_embeddings=tie_embeddings,
            max_position=max_position,
            dtype=dtype,
            rope=rope_parameters(rope_theta, rope_scaling),
            init_std=init_std,
            sliding_window=sliding_window,
        )
    except (ValueError, TypeError, StrictDataclassError) as exc:
        raise ValueError(f"invalid {arch} config: {exc}") from exc
    model_cls = getattr(transformers, ARCHITECTURES[arch])
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG state alone
        torch.manual_seed(seed)
        model = model_cls(config)
    _reinit_parameters(model, seed, init_std)
    model = model.to(DTYPES[dtype]).eval()
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_END)]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if progress_was_enabled:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out, save_jinja_files=False)
    return out
