"""KV pool layout, write_kv exactness, export/import byte-exactness."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.kv_cache import KVCachePool, num_blocks_for_memory
from tandem.kernels.kv_write import write_kv

NL, BS, KVH, HD = 3, 4, 2, 8


def _pool(num_blocks: int = 10, dtype: torch.dtype = torch.float32) -> KVCachePool:
    return KVCachePool(num_blocks, NL, BS, KVH, HD, dtype=dtype)


def _fill_random_bits(pool: KVCachePool, seed: int) -> None:
    """Arbitrary bit patterns, NaNs and infs included: only bytes must survive."""
    gen = torch.Generator().manual_seed(seed)
    raw = pool.tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_layout_and_views() -> None:
    pool = _pool()
    t = pool.tensor
    assert t.shape == (10, NL, 2, BS, KVH, HD) and t.is_contiguous()
    assert not t.any()  # zero-filled
    assert pool.bytes_per_block == NL * 2 * BS * KVH * HD * 4 == t[0].nbytes
    assert pool.nbytes == t.nbytes == KVCachePool.bytes_for(10, NL, BS, KVH, HD)
    assert pool.num_slots == 10 * BS
    k, v = pool.layer_cache(1)
    assert k.shape == v.shape == (10, BS, KVH, HD)
    assert k.stride() == (NL * 2 * BS * KVH * HD, KVH * HD, HD, 1)
    assert k.data_ptr() == t[0, 1, 0].data_ptr() and v.data_ptr() == t[0, 1, 1].data_ptr()
    k[3, 2, 1, 5] = 7.0
    assert t[3, 1, 0, 2, 1, 5] == 7.0  # a view: writes land in the pool
    blk = pool.block_view(3)
    assert blk.is_contiguous() and blk.shape == pool.block_shape
    assert blk.data_ptr() == t.data_ptr() + 3 * pool.bytes_per_block
    with pytest.raises(IndexError):
        pool.layer_cache(NL)
    with pytest.raises(ValueError):
        pool.block_view(10)
    with pytest.raises(ValueError):
        KVCachePool(0, NL, BS, KVH, HD)


def test_as_bytes_aliases_the_block() -> None:
    pool = _pool(dtype=torch.bfloat16)
    _fill_random_bits(pool, 1)
    mv = pool.as_bytes(4)
    assert len(mv) == pool.bytes_per_block == pool.tensor[4].nbytes
    assert bytes(mv) == pool.tensor[4].view(torch.uint8).numpy().tobytes()
    pool.tensor[4].zero_()
    assert bytes(mv) == bytes(pool.bytes_per_block)


def test_memory_sizing() -> None:
    per_block = KVCachePool.bytes_for(1, NL, BS, KVH, HD, torch.bfloat16)
    assert per_block == NL * 2 * BS * KVH * HD * 2
    assert num_blocks_for_memory(per_block * 7 + 5, NL, BS, KVH, HD, torch.bfloat16) == 7
    assert num_blocks_for_memory(per_block - 1, NL, BS, KVH, HD, torch.bfloat16) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv_touches_exactly_the_slots(dtype: torch.dtype, block_size: int) -> None:
    pool = KVCachePool(9, NL, block_size, KVH, HD, dtype=dtype)
    _fill_random_bits(pool, block_size)
    before = pool.tensor.clone()
    gen = torch.Generator().manual_seed(0)
    n = min(11, pool.num_slots)
    slots = torch.randperm(pool.num_slots, generator=gen)[:n]
    key = torch.randn(n, KVH, HD, generator=gen).to(dtype)
    value = torch.randn(n, KVH, HD, generator=gen).to(dtype)
    layer = 2
    k_cache, v_cache = pool.layer_cache(layer)
    write_kv(k_cache, v_cache, key, value, slots)
    expected = before.clone()
    for i, s in enumerate(slots.tolist()):
        blk, off = divmod(s, block_size)
        expected[blk, layer, 0, off] = key[i]
        expected[blk, layer, 1, off] = value[i]
    assert _bytes_equal(pool.tensor, expected)
    for i, s in enumerate(slots.tolist()):  # and the written rows are the inputs' bytes
        blk, off = divmod(s, block_size)
        assert _bytes_equal(k_cache[blk, off], key[i])
        assert _bytes_equal(v_cache[blk, off], value[i])


def test_write_kv_int32_slots_empty_and_errors() -> None:
    pool = _pool()
    k_cache, v_cache = pool.layer_cache(0)
    key = torch.arange(2 * KVH * HD, dtype=torch.float32).view(2, KVH, HD)
    write_kv(k_cache, v_cache, key, -key, torch.tensor([5, 0], dtype=torch.int32))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[0, 0], -key[1])
    snapshot = pool.tensor.clone()
    empty = key[:0]
    write_kv(k_cache, v_cache, empty, empty, torch.empty(0, dtype=torch.int64))
    assert torch.equal(pool.tensor, snapshot)
    with pytest.raises(ValueError):
        write_kv(k_cache, v_cache, key, key, torch.tensor([1]))
    with pytest.raises(ValueError):
        write_kv(k_cache, v_cache, key[:, :1], key[:, :1], torch.tensor([1, 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_export_import_round_trip_is_byte_exact(dtype: torch.dtype) -> None:
    src, dst = _pool(dtype=dtype), _pool(num_blocks=6, dtype=dtype)
    _fill_random_bits(src, 2)
    _fill_random_bits(dst, 3)
    dst_before = dst.tensor.clone()
    data = src.export_blocks([7, 2, 9])
    assert data.shape == (3, NL, 2, BS, KVH, HD) and data.is_contiguous()
    assert data.data_ptr() != src.tensor.data_ptr()
    dst.import_blocks([4, 0, 1], data)
    for s, d in zip([7, 2, 9], [4, 0, 1], strict=True):
        assert bytes(dst.as_bytes(d)) == bytes(src.as_bytes(s))
    for untouched in (2, 3, 5):
        assert _bytes_equal(dst.tensor[untouched], dst_before[untouched])
    # a copy: later changes to the source do not leak into the exported tensor
    exported = data.clone()
    src.tensor.zero_()
    assert _bytes_equal(data, exported)
    assert src.export_blocks([]).shape == (0, NL, 2, BS, KVH, HD)


def test_import_rejects_bad_input() -> None:
    pool = _pool()
    good = pool.export_blocks([1, 2])
    with pytest.raises(ValueError, match="shape"):
        pool.import_blocks([1, 2, 3], good)
    with pytest.raises(ValueError, match="shape"):
        pool.import_blocks([1, 2], good[:, :, :, :2])
    with pytest.raises(ValueError, match="dtype"):
        pool.import_blocks([1, 2], good.to(torch.float64))
    with pytest.raises(ValueError, match="duplicates"):
        pool.import_blocks([1, 1], good)
    with pytest.raises(ValueError, match="out of range"):
        pool.import_blocks([1, 10], good)
    with pytest.raises(ValueError, match="out of range"):
        pool.export_blocks([-1])
