"""A request's KV blocks as one contiguous array (the seam for kv_transfer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVBlocks:
    """KV of the first `num_tokens` tokens of `token_ids`, in ceil(num_tokens / block_size) blocks.

    `data` has the pool's block layout: (n_blocks, num_layers, 2, block_size, kv_heads, head_dim).
    (No block hashes: an importer hashes the tokens under its request's own `cache_salt`.)
    """

    namespace: str
    block_size: int
    num_tokens: int
    token_ids: list[int]
    data: torch.Tensor
    sampler_state: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0])
