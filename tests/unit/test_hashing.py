"""Block hashes and namespace digests: documented layout, fixed values, chain and determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from tandem.engine.cache_namespace import CacheNamespace, canonical_json, digest_json
from tandem.engine.hashing import hash_block, hash_full_blocks, root_hash, tokens_to_bytes

NAMESPACE = CacheNamespace(
    model_revision="rev-1",
    tokenizer_digest="tok-1",
    rope_digest=digest_json({"rope_theta": 10000.0, "rope_scaling": None}),
    kv_dtype="bfloat16",
)
TOKENS = list(range(100, 110))  # 2 full blocks of 4 and a partial one

# Computed once with this implementation; a change here breaks every router/worker pairing.
EXPECTED_NAMESPACE_DIGEST = "a820a8ed594cb830a6bd09a4aca2dfe2"
EXPECTED_ROOT = 0x3D1B113E91B729F8
EXPECTED_CHAIN = [0x9EB64AE09A2C5F54, 0x812D3110DDC2F591]


def test_byte_layout_matches_docstring() -> None:
    expected_bytes = (
        (1).to_bytes(8, "little") + (2).to_bytes(8, "little") + (3).to_bytes(8, "little") + b"x"
    )
    assert hash_block(1, [2, 3], b"x") == xxhash.xxh3_64_intdigest(expected_bytes)
    assert tokens_to_bytes([-1]) == b"\xff" * 8
    assert root_hash("abc") == xxhash.xxh3_64_intdigest(b"abc")


def test_known_values() -> None:
    assert NAMESPACE.digest() == EXPECTED_NAMESPACE_DIGEST
    assert NAMESPACE.root_hash() == EXPECTED_ROOT
    assert hash_full_blocks(EXPECTED_ROOT, TOKENS, 4) == EXPECTED_CHAIN


def test_chain_definition() -> None:
    root = NAMESPACE.root_hash()
    h0 = hash_block(root, TOKENS[0:4])
    h1 = hash_block(h0, TOKENS[4:8])
    assert hash_full_blocks(root, TOKENS, 4) == [h0, h1]


def test_only_full_blocks_are_hashed() -> None:
    root = NAMESPACE.root_hash()
    assert hash_full_blocks(root, TOKENS[:3], 4) == []
    assert len(hash_full_blocks(root, TOKENS[:8], 4)) == 2
    assert hash_full_blocks(root, TOKENS[:8], 4) == hash_full_blocks(root, TOKENS[:11], 4)


def test_changing_block_zero_changes_every_later_hash() -> None:
    root = NAMESPACE.root_hash()
    tokens = list(range(16))
    base = hash_full_blocks(root, tokens, 4)
    changed = hash_full_blocks(root, [999, *tokens[1:]], 4)
    assert len(base) == 4
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_different_roots_give_different_chains() -> None:
    other = NAMESPACE.model_copy(update={"adapter_id": "lora-a"})
    assert other.root_hash() != NAMESPACE.root_hash()
    a = hash_full_blocks(NAMESPACE.root_hash(), TOKENS, 4)
    b = hash_full_blocks(other.root_hash(), TOKENS, 4)
    assert not set(a) & set(b)


@pytest.mark.parametrize("split", [1, 2, 3, 5])
def test_incremental_extension_equals_full_hashing(split: int) -> None:
    root = NAMESPACE.root_hash()
    tokens = list(range(7, 30))  # 5 full blocks of 4 and 3 extra tokens
    full = hash_full_blocks(root, tokens, 4)
    prefix = hash_full_blocks(root, tokens[: split * 4 + 1], 4)
    assert len(prefix) == split
    rest = hash_full_blocks(root, tokens, 4, start_block=len(prefix), parent=prefix[-1])
    assert prefix + rest == full


def test_extension_needs_a_parent_and_a_block_size() -> None:
    with pytest.raises(ValueError, match="parent"):
        hash_full_blocks(1, TOKENS, 4, start_block=1)
    with pytest.raises(ValueError, match="block_size"):
        hash_full_blocks(1, TOKENS, 0)


def test_numpy_and_list_inputs_agree() -> None:
    root = NAMESPACE.root_hash()
    for dtype in (np.int32, np.int64):
        assert hash_full_blocks(root, np.array(TOKENS, dtype=dtype), 4) == hash_full_blocks(
            root, TOKENS, 4
        )
    assert hash_block(5, np.array([1, 2], dtype=np.int32)) == hash_block(5, (1, 2))


def test_hashes_are_equal_across_processes() -> None:
    script = (
        "import json\n"
        "from tandem.engine.cache_namespace import CacheNamespace\n"
        "from tandem.engine.hashing import hash_full_blocks\n"
        f"ns = CacheNamespace.model_validate_json({NAMESPACE.model_dump_json()!r})\n"
        f"print(json.dumps([ns.digest(), hash_full_blocks(ns.root_hash(), {TOKENS!r}, 4)]))\n"
    )
    local = [NAMESPACE.digest(), hash_full_blocks(NAMESPACE.root_hash(), TOKENS, 4)]
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        assert json.loads(out.stdout) == local


def test_namespace_digest_covers_every_field() -> None:
    digests = {NAMESPACE.digest()}
    for field, value in [
        ("model_revision", "rev-2"),
        ("tokenizer_digest", "tok-2"),
        ("rope_digest", digest_json({"rope_theta": 500000.0})),
        ("kv_dtype", "float8_e4m3fn"),
        ("adapter_id", "lora-a"),
        ("multimodal_digest", "img-1"),
    ]:
        digests.add(NAMESPACE.model_copy(update={field: value}).digest())
    assert len(digests) == 7
    assert NAMESPACE.model_copy(update={"adapter_id": ""}).digest() != NAMESPACE.digest()


def test_namespace_is_frozen_and_strict() -> None:
    with pytest.raises(ValueError):
        NAMESPACE.kv_dtype = "float16"
    with pytest.raises(ValueError):
        CacheNamespace.model_validate(
            {
                "model_revision": "r",
                "tokenizer_digest": "t",
                "rope_digest": "p",
                "kv_dtype": "d",
                "x": 1,
            }
        )


def test_canonical_json_ignores_key_order() -> None:
    assert canonical_json({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'
    assert digest_json({"b": 1, "a": 2}) == digest_json({"a": 2, "b": 1})
