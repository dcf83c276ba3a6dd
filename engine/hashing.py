"""Chained block hashes: the one definition shared by the engine's prefix cache and the router.

The hash of a block depends on its tokens and on everything before it, so equal hashes mean equal
prefixes (up to 64-bit collisions, which the block manager guards with a token comparison). The
functions here are pure functions of bytes; any implementation that follows this layout produces the
same values, in any process, on any machine.

Byte layout (all integers little-endian; hash = XXH3-64 with seed 0, as an unsigned 64-bit integer):

- root hash of a cache namespace:
  ``root = XXH3_64(namespace_digest.encode("utf-8"))``, where ``namespace_digest`` is the hex string
  returned by ``CacheNamespace.digest()``.
- root of a request with a ``cache_salt`` (its blocks are shared only with requests of the same
  namespace and salt, as vLLM's ``cache_salt``):
  ``salted = XXH3_64(u64le(root) || b"cache_salt" || salt.encode("utf-8"))``; without a salt the
  request's root is the namespace's ``root``.
- hash of one block:
  ``h = XXH3_64(u64le(parent) || i64le(t_0) || ... || i64le(t_{n-1}) || extra)``, where ``parent``
  is the previous block's hash (the root hash for block 0), ``t_i`` are the block's token ids as
  signed 64-bit integers, and ``extra`` is optional raw bytes (empty by default).
- a sequence of ``N`` tokens with block size ``B`` has ``N // B`` full blocks; block ``k`` covers
  tokens ``[k*B, (k+1)*B)`` and its parent is block ``k-1`` (the root for ``k == 0``). A trailing
  partial block has no hash.

Example: with ``parent = 1`` and tokens ``[2, 3]`` the hashed bytes are
``01 00 00 00 00 00 00 00 | 02 00 00 00 00 00 00 00 | 03 00 00 00 00 00 00 00``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["hash_block", "hash_full_blocks", "root_hash", "salted_root", "tokens_to_bytes"]

_LITTLE_ENDIAN = sys.byteorder == "little"


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as a little-endian int64 array (8 bytes per token)."""
    if isinstance(token_ids, np.ndarray):
        return np.ascontiguousarray(token_ids, dtype="<i8").tobytes()
    packed = array("q", token_ids)  # 'q' is a signed 64-bit integer in native byte order
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def root_hash(namespace_digest: str) -> int:
    """The parent hash of block 0 for a cache namespace: XXH3-64 of the digest's UTF-8 bytes."""
    return xxhash.xxh3_64_intdigest(namespace_digest.encode("utf-8"))


def salted_root(root: int, cache_salt: str | None) -> int:
    """The parent hash of block 0 for a request with `cache_salt` (None: `root` itself)."""
    if cache_salt is None:
        return root
    return xxhash.xxh3_64_intdigest(
        root.to_bytes(8, "little") + b"cache_salt" + cache_salt.encode("utf-8")
    )


def hash_block(parent_hash: int, token_ids: Sequence[int] | np.ndarray, extra: bytes = b"") -> int:
    """Hash of one block: XXH3-64 over the parent hash, the token ids and `extra` (layout above)."""
    return xxhash.xxh3_64_intdigest(
        parent_hash.to_bytes(8, "little") + tokens_to_bytes(token_ids) + extra
    )


def hash_full_blocks(
    root: int,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    start_block: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Hashes of the full blocks `start_block, start_block + 1, ...` of `token_ids`.

    `token_ids` is the whole sequence (not just the new part). To extend an existing chain, pass
    `start_block = len(chain)` and `parent = chain[-1]`; the result is the continuation, so
    `chain + hash_full_blocks(root, ids, B, len(chain), chain[-1])` equals
    `hash_full_blocks(root, ids, B)`. With `parent=None`, `start_block` must be 0 and the chain
    starts at `root`. A trailing partial block is not hashed; the result may be empty.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if parent is None:
        if start_block != 0:
            raise ValueError("parent is required when start_block > 0")
        parent = root
    num_full = len(token_ids) // block_size
    if start_block >= num_full:
        return []
    data = tokens_to_bytes(token_ids[start_block * block_size : num_full * block_size])
    stride = 8 * block_size
    digest = xxhash.xxh3_64_intdigest
    hashes: list[int] = []
    for offset in range(0, len(data), stride):
        parent = digest(parent.to_bytes(8, "little") + data[offset : offset + stride])
        hashes.append(parent)
    return hashes
