"""Rotary position embeddings, computed the way transformers computes them (fp32, then cast)."""

from __future__ import annotations

import math

import torch

from tandem.engine.model_config import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies for `default`, `linear`, `llama3`, `yarn` and `dynamic` rope types.
    `dynamic` (NTK-aware) is the default's: transformers raises its base only for a sequence
    past `max_position_embeddings`, which is as long as the context is let run here
    (`ModelSpec.context_length`)."""
    dim = int(head_dim * rope.partial_rotary_factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_blend(inv_freq, 1.0 / (rope.factor * rope.theta**exponents), rope, dim)
    return inv_freq


def attention_scaling(rope: RopeSpec) -> float:
    """What cos and sin are multiplied by: 1, except for yarn (its `attention_factor`, or the
    paper's 0.1 ln(factor) + 1, with DeepSeek's `mscale` / `mscale_all_dim` when given)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(weight: float) -> float:
        return 1.0 if rope.factor <= 1 else 0.1 * weight * math.log(rope.factor) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.mscale) / mscale(rope.mscale_all_dim)
    return mscale(1.0)


def _yarn_blend(
    inv_freq: torch.Tensor, interpolated: torch.Tensor, rope: RopeSpec, dim: int
) -> torch.Tensor:
    """YaRN: high frequencies kept (extrapolated), low ones divided by the factor
    (interpolated), a linear ramp between the dimensions where a wavelength makes `beta_fast`
    and `beta_slow` turns over the original context."""

    def dim_at(turns: float) -> float:
        length = rope.original_max_position_embeddings / (turns * 2 * math.pi)
        return dim * math.log(length) / (2 * math.log(rope.theta))

    low, high = dim_at(rope.beta_fast), dim_at(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (as trained), 0: interpolate
    return interpolated * (1 - keep) + inv_freq * keep


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin for arbitrary (flattened) positions; applied to (T, heads, head_dim) tensors."""

    inv_freq: torch.Tensor

    def __init__(self, rope: RopeSpec, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.scaling = attention_scaling(rope)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        head, tail = x[..., :rot], x[..., rot:]
        return torch.cat((_rotate(head, cos, sin), tail), dim=-1)
    return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)
