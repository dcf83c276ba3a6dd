"""Request seeds: the range a `torch.Generator` takes, vLLM's -1, and the seeds of a request's
samples and of each token it draws."""

from __future__ import annotations

import struct

import xxhash

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""The seeds a `torch.Generator` takes (a signed or unsigned 64-bit integer)."""


def no_seed_as_none(seed: int | None) -> int | None:
    """vLLM's reading of a seed: -1 means none (the request samples anew each time)."""
    return None if seed == -1 else seed


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample `sample` (0-based) of a request seeded `seed`: `seed + sample`,
    wrapped into the seed range (None: unseeded). -1 comes out as its equal 2**64 - 1 (torch
    and `draw_seed` read seeds modulo 2**64), so that checking the sample's params again does
    not take it as vLLM's "no seed"."""
    if seed is None:
        return None
    span = SEED_MAX - SEED_MIN + 1
    wrapped = (seed + sample - SEED_MIN) % span + SEED_MIN
    return SEED_MAX if wrapped == -1 else wrapped


def draw_seed(seed: int, draw: int) -> int:
    """The seed of a seeded request's `draw`-th sampled token (0-based): its tokens depend on
    the seed and their position only, so an attempt that goes on from the tokens of a lost one
    (`SamplingParams.resumed_tokens`) draws what the lost one would have."""
    return xxhash.xxh64_intdigest(struct.pack("<QQ", seed % 2**64, draw))
