"""The Triton kernels under the Triton interpreter (CPU tensors) vs the torch reference.

CI has no GPU: ``TRITON_INTERPRET=1`` makes ``triton.jit`` kernels run in numpy on the CPU, so
the kernels' indexing, masking, online softmax and split-K merge are checked here on small
shapes. ``triton`` is a dev dependency: these tests run (never skip) wherever the test command
installed the project.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # while triton.jit decorates the kernels
for _name in (  # the jit kernels first: the launcher imports them by name
    "tandem.kernels.triton_attention_kernels",
    "tandem.kernels.triton_attention",
    "tandem.kernels.triton_kv_write",
):
    if _name in sys.modules:  # imported earlier without the interpreter: decorate again
        importlib.reload(sys.modules[_name])

from tandem.kernels.backends import KERNEL_BACKENDS  # noqa: E402
from tandem.kernels.dispatch import triton_kernels  # noqa: E402
from tandem.kernels.kv_cache import KVCachePool  # noqa: E402
from tandem.kernels.kv_write import write_kv  # noqa: E402
from tandem.kernels.paged_attention import paged_attention, paged_attention_reference  # noqa: E402
from tandem.kernels.testing import PagedBatch, dense_attention, make_paged_batch  # noqa: E402
from tandem.kernels.triton_attention import paged_attention_triton  # noqa: E402
from tandem.kernels.triton_kv_write import write_kv_triton  # noqa: E402


def _restore_interpret_env() -> None:
    if _SAVED_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


_restore_interpret_env()  # the rest of the test run (and its subprocesses) is unaffected


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreter() -> Iterator[None]:
    """The interpreter must also be on while the kernels run; the engine's "triton" backend
    must resolve to these interpreted kernels, not to compiled ones cached earlier."""
    os.environ["TRITON_INTERPRET"] = "1"
    triton_kernels.cache_clear()
    KERNEL_BACKENDS.pop("triton", None)
    yield
    triton_kernels.cache_clear()
    KERNEL_BACKENDS.pop("triton", None)
    _restore_interpret_env()


# Max abs error vs the float32 reference, per input dtype.
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (context_lens, q_lens): ragged; 32 and 48 end exactly on a block boundary for blocks 4/8/16.
SCENARIOS: dict[str, tuple[list[int], list[int]]] = {
    "decode": ([1, 7, 32, 50, 17], [1, 1, 1, 1, 1]),
    "prefill_no_prefix": ([13, 48, 1], [13, 48, 1]),
    "prefill_with_prefix": ([29, 48], [9, 20]),
    "mixed": ([21, 5, 32, 64, 3, 19], [1, 5, 10, 1, 1, 19]),
}


def _run(fn: Callable[..., Any], batch: PagedBatch, scale: float, **kw: Any) -> torch.Tensor:
    out = fn(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        batch.query_start_loc,
        scale,
        **kw,
    )
    assert isinstance(out, torch.Tensor)
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _batch(scenario: str, group: int, block_size: int, dtype: torch.dtype, **kw: Any) -> PagedBatch:
    ctx, q_lens = SCENARIOS[scenario]
    return make_paged_batch(
        ctx, q_lens, num_heads=2 * group, num_kv_heads=2, head_dim=24,
        block_size=block_size, dtype=dtype, seed=block_size * 7 + group, **kw,
    )  # fmt: skip


GROUPS, BLOCK_SIZES = [1, 3, 4], [1, 5, 16, 32]
# Every (scenario, block size), (scenario, group) and (group, block size) pair once or more, in
# 16 cases instead of the 48 of the whole grid (each runs ~1 s under the interpreter).
FP32_CASES = [
    (scenario, GROUPS[(b + s) % len(GROUPS)], block_size)
    for s, scenario in enumerate(sorted(SCENARIOS))
    for b, block_size in enumerate(BLOCK_SIZES)
]


@pytest.mark.parametrize(("scenario", "group", "block_size"), FP32_CASES)
def test_attention_matches_reference_fp32(scenario: str, group: int, block_size: int) -> None:
    batch = _batch(scenario, group, block_size, torch.float32)
    scale = 1 / math.sqrt(24)
    got = _run(paged_attention_triton, batch, scale)
    assert got.dtype == torch.float32
    assert _diff(got, _run(paged_attention_reference, batch, scale)) < TOL[torch.float32]
    assert _diff(got, dense_attention(batch, scale)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scenario", ["decode", "mixed", "prefill_with_prefix"])
def test_attention_half_precision(dtype: torch.dtype, scenario: str) -> None:
    batch = _batch(scenario, 4, 16, dtype)
    scale = 1 / math.sqrt(24)
    got = _run(paged_attention_triton, batch, scale)
    assert got.dtype == dtype
    pool32 = KVCachePool(batch.pool.num_blocks, 2, 16, 2, 24, dtype=torch.float32)
    pool32.tensor.copy_(batch.pool.tensor)  # the same half-representable values, in fp32
    exact = _run(
        paged_attention_reference,
        PagedBatch(**{**batch.__dict__, "pool": pool32, "query": batch.query.float()}),
        scale,
    )
    assert _diff(got, exact) < TOL[dtype]
    # The torch path rounds the probabilities the same way: a few ulps apart at most.
    assert _diff(got, _run(paged_attention, batch, scale)) < TOL[dtype]


@pytest.mark.parametrize("window", [1, 4, 9, 1000])
@pytest.mark.parametrize("scenario", ["decode", "prefill_with_prefix", "mixed"])
def test_sliding_window(window: int, scenario: str) -> None:
    batch = _batch(scenario, 2, 4, torch.float32)
    want = dense_attention(batch, 0.3, sliding_window=window)
    assert _diff(_run(paged_attention_triton, batch, 0.3, sliding_window=window), want) < 1e-5


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("window", [None, 37])
def test_decode_split_k(splits: int, window: int | None) -> None:
    """Each split walks its share of the context; the combine kernel merges them. More splits
    than tiles leaves empty splits, which must contribute nothing; 40 splits take the combine
    kernel through more than one chunk of 32 (5,000 positions are 79 tiles of 64: 2 per split)."""
    ctx = [1, 16, 33, 150, 97] + ([5000] if splits > 32 else [])
    batch = make_paged_batch(
        ctx, [1] * len(ctx), num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
        pad_value=-1, table_dtype=torch.int32, seed=splits,
    )  # fmt: skip
    tables = batch.block_tables.clone()
    want = dense_attention(batch, 0.2, sliding_window=window)
    got = _run(paged_attention_triton, batch, 0.2, sliding_window=window, num_splits=splits)
    assert _diff(got, want) < 1e-5
    assert torch.equal(batch.block_tables, tables)  # inputs are never modified


def test_zero_length_queries_hints_and_empty_batch() -> None:
    batch = make_paged_batch(
        [10, 70, 7, 60], [0, 1, 0, 40], num_heads=4, num_kv_heads=1, head_dim=8,
        block_size=16,
    )  # fmt: skip
    want = dense_attention(batch, 0.5)
    assert _diff(_run(paged_attention_triton, batch, 0.5), want) < 1e-5
    hinted = _run(paged_attention_triton, batch, 0.5, max_query_len=40, max_context_len=70)
    assert torch.equal(hinted, _run(paged_attention_triton, batch, 0.5))
    decodes = make_paged_batch([5, 9, 3], [1, 0, 1], num_heads=2, num_kv_heads=2, head_dim=16,
                               block_size=4)  # fmt: skip
    assert _diff(_run(paged_attention_triton, decodes, 0.5), dense_attention(decodes, 0.5)) < 1e-5
    empty = make_paged_batch([], [], num_heads=2, num_kv_heads=1, head_dim=8, block_size=4)
    assert _run(paged_attention_triton, empty, 1.0).shape == (0, 2, 8)


def test_attention_shape_errors_are_the_torch_ones() -> None:
    batch = _batch("decode", 2, 4, torch.float32)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention_triton(
            batch.query[:, :3], batch.k_cache, batch.v_cache, batch.block_tables,
            batch.context_lens, batch.query_start_loc, 1.0,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_kv_write_is_byte_exact(dtype: torch.dtype, block_size: int) -> None:
    """Same bytes as the torch write; every other byte of the pool untouched; -1 slots skipped."""
    gen = torch.Generator().manual_seed(block_size)
    pool = KVCachePool(9, 3, block_size, 3, 24, dtype=dtype)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen))
    expected = pool.tensor.clone()
    tokens = 2 * block_size + 3
    slots = torch.randperm(pool.num_slots, generator=gen)[:tokens]
    key = torch.randn(tokens, 3, 24, generator=gen)  # float32: cast to the cache dtype
    value = torch.randn(tokens, 3, 24, generator=gen)
    write_kv(*_wrap(pool, expected).layer_cache(1), key, value, slots)
    padded = torch.cat([slots[:2], torch.tensor([-1]), slots[2:]])
    key_p = torch.cat([key[:2], torch.full((1, 3, 24), 9.0), key[2:]])
    value_p = torch.cat([value[:2], torch.full((1, 3, 24), 9.0), value[2:]])
    write_kv_triton(*pool.layer_cache(1), key_p, value_p, padded)
    assert torch.equal(pool.tensor.view(torch.uint8), expected.view(torch.uint8))


def _wrap(pool: KVCachePool, tensor: torch.Tensor) -> KVCachePool:
    return KVCachePool(
        pool.num_blocks, pool.num_layers, pool.block_size, pool.num_kv_heads, pool.head_dim,
        dtype=pool.dtype, tensor=tensor,
    )  # fmt: skip


@pytest.mark.parametrize(
    "arch_case",
    [
        dict(arch="llama", seed=1),  # GQA 4:2
        dict(arch="mistral", seed=4, kv_heads=1, sliding_window=24),  # GQA 4:1, window
    ],
    ids=["llama", "mistral"],
)
def test_engine_on_triton_kernels_equals_hf(
    tiny_checkpoint: Any, arch_case: dict[str, Any]
) -> None:
    """The whole engine with the Triton backend (interpreted): chunked prefill over a cached
    prefix, mixed prefill/decode steps, decode, prefix-cache hits; greedy tokens equal HF's."""
    from tandem import LLM, SamplingParams
    from tests.hf_reference import hf_greedy, load_hf_model, random_prompts

    path = tiny_checkpoint(**arch_case)
    hf = load_hf_model(path)
    prompts = random_prompts(6, hf.config.vocab_size, seed=5, max_len=90, shared_prefix=40)
    ref = hf_greedy(hf, prompts, 6)
    llm = LLM(
        model=str(path), attention_backend="triton", num_kv_blocks=128, block_size=8,
        max_num_batched_tokens=48,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    again = llm.generate(prompts[-2:], params)  # served from the prefix cache
    assert [o.token_ids for o in again] == ref[-2:]
    assert all(o.num_cached_tokens > 0 for o in again)


def test_tandem_works_without_triton(tiny_checkpoint: Any) -> None:
    """A process where `import triton` fails: tandem imports, the CPU path generates, and asking
    for the Triton backend says which extra to install."""
    import subprocess

    path = tiny_checkpoint(arch="llama", seed=1)
    code = f"""
import sys
sys.modules["triton"] = None  # as if not installed: import fails, find_spec returns None
import tandem
from tandem import LLM, SamplingParams
from tandem.kernels.backends import get_kernel_backend
llm = LLM(model={str(path)!r}, num_kv_blocks=64)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print("tokens", out[0].token_ids)
try:
    get_kernel_backend("triton")
except ImportError as exc:
    print("error", exc)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "error the Triton kernels need the 'triton' package" in proc.stdout
    assert "tandem-serve[gpu]" in proc.stdout
    from tandem import LLM, SamplingParams

    want = LLM(model=str(path), num_kv_blocks=64, attention_backend="cpu").generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    assert f"tokens {want[0].token_ids}" in proc.stdout


def test_importing_tandem_does_not_import_triton() -> None:
    import subprocess

    code = "import sys, tandem, tandem.kernels, tandem.engine.llm_engine; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gpu_check_without_a_gpu_says_so_and_exits_0() -> None:
    import json
    import subprocess
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bench/gpu_check.py would run the full check")
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "gpu": None,
        "skipped": "no CUDA GPU",
    }
