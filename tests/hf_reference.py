"""Hugging Face transformers as the oracle: greedy continuations and logits of tiny checkpoints."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch


def random_prompts(
    n: int,
    vocab: int,
    *,
    seed: int = 0,
    min_len: int = 1,
    max_len: int = 300,
    shared_prefix: int = 64,
) -> list[list[int]]:
    """`n` prompts of `min_len`..`max_len` random token ids; every other one after the first
    quarter starts with a shared prefix so that prefix caching has something to hit."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(shared_prefix)]
    prompts = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        tokens = [rng.randrange(1, vocab) for _ in range(length)]
        if i >= n // 4 and i % 2 == 0 and length > shared_prefix:
            tokens[:shared_prefix] = prefix
        prompts.append(tokens)
    prompts[0] = prompts[0][:1]  # always include a one-token prompt
    return prompts


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`generate(do_sample=False)` one prompt at a time (no padding in the reference)."""
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


def hf_last_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].float()
