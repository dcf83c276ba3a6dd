"""Digests of a checkpoint that go into the prefix-cache namespace."""

from __future__ import annotations

import struct
from pathlib import Path

import xxhash

from tandem.engine.cache_namespace import CacheNamespace, digest_json
from tandem.engine.model_config import ModelSpec
from tandem.engine.weights import checkpoint_files


def model_revision(model_dir: Path) -> str:
    """Digest of config.json and each weight file's size, mtime and safetensors header.

    Cheap (no full read of the weights) yet changes whenever a weight file is rewritten.
    Pass `model_revision` in the engine config to pin an explicit revision instead.
    """
    h = xxhash.xxh3_128()
    h.update((model_dir / "config.json").read_bytes())
    for file in checkpoint_files(model_dir):
        stat = file.stat()
        h.update(file.name.encode())
        h.update(struct.pack("<qq", stat.st_size, stat.st_mtime_ns))
        if file.suffix == ".safetensors":  # (a .bin file: its size and mtime)
            with file.open("rb") as handle:
                (header_len,) = struct.unpack("<Q", handle.read(8))
                h.update(handle.read(min(header_len, 1 << 24)))
    return h.hexdigest()


def build_namespace(
    spec: ModelSpec,
    *,
    revision: str,
    tokenizer_digest: str,
    kv_dtype: str,
    adapter_id: str | None = None,
) -> CacheNamespace:
    return CacheNamespace(
        model_revision=revision,
        tokenizer_digest=tokenizer_digest,
        rope_digest=digest_json({"rope": spec.rope.as_dict(), "head_dim": spec.head_dim}),
        kv_dtype=kv_dtype,
        adapter_id=adapter_id,
    )
