"""The cache namespace: everything that changes a block's KV besides its tokens.

Two requests share a cached block only if their namespaces are equal, because the namespace's
digest is the root of every block-hash chain (see `tandem.engine.hashing`). Digests are XXH3-128
hex strings over canonical JSON, so they are stable across processes and machines.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash
from pydantic import BaseModel, ConfigDict

from tandem.engine import hashing

__all__ = ["CacheNamespace", "canonical_json", "digest_bytes", "digest_json"]


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys, no whitespace and ASCII-only output: one text per value."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def digest_json(obj: Any) -> str:
    """XXH3-128 hex digest of `canonical_json(obj)` (e.g. of a rope-scaling config)."""
    return digest_bytes(canonical_json(obj).encode("utf-8"))


def digest_bytes(data: bytes) -> str:
    """XXH3-128 hex digest of raw bytes (e.g. of an image's contents)."""
    return xxhash.xxh3_128_hexdigest(data)


class CacheNamespace(BaseModel):
    """What a cached block's KV depends on, besides its token ids.

    `model_revision`: weights revision (commit hash or checkpoint digest). `tokenizer_digest`:
    tokenizer and chat template. `rope_digest`: rope type, theta and scaling (`digest_json` of the
    config). `kv_dtype`: KV-cache dtype, e.g. "bfloat16". `adapter_id`: LoRA adapter, if any.
    `multimodal_digest`: content hash plus preprocessing parameters of multimodal inputs, if any.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_revision: str
    tokenizer_digest: str
    rope_digest: str
    kv_dtype: str
    adapter_id: str | None = None
    multimodal_digest: str | None = None

    def digest(self) -> str:
        """XXH3-128 hex digest of the canonical JSON of all fields (None included as null)."""
        return digest_json(self.model_dump(mode="json"))

    def root_hash(self) -> int:
        """Parent hash of block 0 for requests in this namespace."""
        return hashing.root_hash(self.digest())

    def request_root(self, cache_salt: str | None) -> int:
        """Parent hash of block 0 for a request with `cache_salt` (`hashing.salted_root`)."""
        return hashing.salted_root(self.root_hash(), cache_salt)
