"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

The forward pass works on a flat batch: the new tokens of every scheduled request concatenated
(T tokens), their positions, and an `AttentionMetadata` saying which request owns which rows and
where their KV lives in the pool. Operations mirror transformers' modeling code (same dtype casts,
same order) so that greedy tokens match it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model_config import ModelSpec
from tandem.engine.rotary import RotaryEmbedding, apply_rotary
from tandem.kernels.backends import KernelBackend, get_kernel_backend
from tandem.kernels.kv_cache import KVCachePool


@dataclass
class AttentionMetadata:
    """Where the batch's tokens go in the KV pool and what they attend to."""

    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # (B, max_blocks) int64, padded
    context_lens: torch.Tensor  # (B,) tokens in cache per request, new ones included
    query_start_loc: torch.Tensor  # (B + 1,) cumulative row offsets of each request in T
    max_query_len: int | None = None  # host-side hints: spare GPU kernels a device sync
    max_context_len: int | None = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, kernels: KernelBackend) -> None:
        super().__init__()
        self.layer = layer
        self.kernels = kernels
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.scale = spec.head_dim**-0.5
        self.sliding_window = spec.sliding_windows[layer]
        self.qkv_proj = nn.Linear(
            spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias
        )
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: KVCachePool,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache, v_cache = kv_pool.layer_cache(self.layer)
        self.kernels.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = self.kernels.attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            self.scale,
            sliding_window=self.sliding_window,
            max_query_len=meta.max_query_len,
            max_context_len=meta.max_context_len,
        )
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.intermediate = spec.intermediate_size
        self.gate_up_proj = nn.Linear(
            spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias
        )
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Feature-major: W @ x.T runs faster than x @ W.T on CPU BLAS for decode-sized batches,
        # and the (features, tokens) layout keeps gate/up halves contiguous.
        gate_up = torch.mm(self.gate_up_proj.weight, x.t())
        if self.gate_up_proj.bias is not None:
            gate_up += self.gate_up_proj.bias[:, None]
        gate, up = gate_up.split([self.intermediate, self.intermediate], dim=0)
        out = torch.mm(self.down_proj.weight, F.silu(gate) * up)
        if self.down_proj.bias is not None:
            out += self.down_proj.bias[:, None]
        return out.t()


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, kernels: KernelBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer, kernels)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: KVCachePool,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_pool)
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; logits only for the rows asked for."""

    def __init__(self, spec: ModelSpec, attention_backend: str = "auto") -> None:
        super().__init__()
        self.spec = spec
        kernels = get_kernel_backend(attention_backend)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, kernels) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # With tied embeddings the loader copies embed_tokens into lm_head.
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: KVCachePool,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Runs the batch, writes its KV into the pool, returns fp32 logits of `logits_indices`."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, meta, kv_pool)
        h = self.norm(h.index_select(0, logits_indices))
        rows = h.shape[0]
        if rows == 1:
            h = torch.cat([h, h])  # W @ h.T with two columns runs ~3x faster than a gemv
        logits_t = torch.mm(self.lm_head.weight, h.t())  # (vocab, rows): the fast layout
        return logits_t[:, :rows].t().float()
