"""KV-transfer throughput between two processes, and a memcpy measured the same way.

`measure_throughput(name, chunk_bytes, repeats)` spawns a receiving process holding an endpoint of
transport `name` (pools as the workers allocate them: for "shm" the receiver's private on huge
pages and written by cross-memory attach where the kernel allows it, else in shared memory, so
pages land directly; the sender's private, on huge pages), sends `repeats`
messages of `chunk_bytes` of pages from this process, and returns GB/s (1e9 bytes/s) from the
first send until the receiver reports it has them all. Chunks cycle through a pool of at least
256 MiB on both sides (as real transfers do, they miss the caches); each message's source and
destination blocks are one consecutive run. `"memcpy"` times ``numpy.copyto`` between two
preallocated buffers of that size with the same chunk cycle, in this process; `"memcpy-shm"`
does the same from a private buffer on huge pages into a shared-memory region, the buffers the
shm transport copies between (numpy's own buffers get transparent huge pages, shared memory
does not). `"shm-region"` is shm with the receiving pool in shared memory whatever the kernel
allows (`cross_memory=False`), `"shm-staged"` shm with no manifest (pages staged).

Run ``python -m bench.kv_transfer_common`` for the table at 64 KiB, 1 MiB, 16 MiB and 64 MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

BLOCK: dict[str, Any] = {"num_layers": 2, "block_size": 16, "num_kv_heads": 4, "head_dim": 64}
"""One block is 64 KiB of float32 KV (2 layers x K,V x 16 slots x 4 heads x 64 dims)."""
BLOCK_BYTES = 64 * 1024
POOL_BYTES = 256 << 20
TOKEN = "bench-token"
NAMES = ("memcpy", "memcpy-shm", "shm", "shm-region", "shm-staged", "torch")
OPTIONS: dict[str, dict[str, Any]] = {
    "shm-region": {"cross_memory": False},
    "ucx-onelane": {"split_min_bytes": 0},  # every message on lane 0 (as before session 24)
    "ucx-push": {"pull": False},  # UCX moves the pages, as between machines (`ucx.py`)
}
"""Options of the receiving endpoint for bench names that are variants of a transport."""


def _geometry(chunk_bytes: int) -> tuple[int, int]:
    """(blocks per chunk, blocks per pool) for a chunk size."""
    if chunk_bytes <= 0 or chunk_bytes % BLOCK_BYTES:
        raise ValueError(f"chunk_bytes must be a positive multiple of {BLOCK_BYTES}")
    chunk_blocks = chunk_bytes // BLOCK_BYTES
    return chunk_blocks, max(POOL_BYTES // BLOCK_BYTES, 4 * chunk_blocks)


def default_repeats(chunk_bytes: int) -> int:
    """Enough messages for about 2 GiB (between 8 and 4000 of them)."""
    return max(8, min(4000, (2 << 30) // chunk_bytes))


def _memcpy(chunk_bytes: int, repeats: int, into_shm: bool = False) -> float:
    chunk_blocks, num_blocks = _geometry(chunk_bytes)
    size = num_blocks * BLOCK_BYTES
    slots = num_blocks // chunk_blocks
    region = None
    if into_shm:  # the buffers the shm transport copies between: a private pool -> shared memory
        from tandem.kv_transfer._hugepages import hugepage_buffer
        from tandem.kv_transfer._shm_region import ShmRegion, new_endpoint_id

        region = ShmRegion.create(f"tandem-kv-{new_endpoint_id()}-b0", size)
        src = hugepage_buffer(size).numpy()
        src.fill(1)
        dst = region.tensor(torch.uint8, (size,)).numpy()
        dst.fill(1)
    else:
        src, dst = np.ones(size, np.uint8), np.ones(size, np.uint8)

    def run(count: int) -> None:
        for i in range(count):
            off = (i % slots) * chunk_bytes
            np.copyto(dst[off : off + chunk_bytes], src[off : off + chunk_bytes])

    try:
        run(min(repeats, slots))
        start = time.perf_counter()
        run(repeats)
        return repeats * chunk_bytes / (time.perf_counter() - start) / 1e9
    finally:
        if region is not None:
            region.unlink()


def _pool(transport: Any, num_blocks: int, *, send_only: bool = False) -> Any:
    """The pool an engine would use with this transport (`allocate_pool` where it has one, as
    the workers and `process_pair` do: for shm, the receiver's in shared memory and the
    sender's, `send_only`, in private memory on huge pages)."""
    from tandem.kernels.kv_cache import KVCachePool
    from tandem.kv_transfer.registry import pool_factory

    factory = pool_factory(transport, send_only=send_only)
    return (factory or KVCachePool)(num_blocks, **BLOCK)


def _receiver_main(
    pipe: Connection, transport_name: str, num_blocks: int, options: dict[str, Any]
) -> None:
    from tandem.kv_transfer.registry import create_transport

    torch.set_num_threads(1)
    transport = create_transport(transport_name, TOKEN, **options)
    pool = _pool(transport, num_blocks)
    transport.register_pool(pool)
    pipe.send(transport.address)
    try:
        while not pipe.poll():
            for message in transport.poll(0.1):
                if message.header.get("type") == "transport_error":
                    pipe.send(message.header)
                elif message.header.get("last"):
                    transport.send(message.peer, {"type": "done", "phase": message.header["phase"]})
    finally:
        transport.close()


def measure_throughput(
    transport_name: str, chunk_bytes: int, repeats: int, *, direct: bool = True
) -> float:
    """GB/s moving `repeats` chunks of `chunk_bytes` to another process (see module docstring).

    `direct=False` (or the name "shm-staged") leaves the manifest out of the headers, so
    transports that can write into the receiver's pool stage the pages instead.
    """
    if transport_name in ("memcpy", "memcpy-shm"):
        return _memcpy(chunk_bytes, repeats, into_shm=transport_name == "memcpy-shm")
    options = OPTIONS.get(transport_name, {})
    if transport_name == "shm-staged":
        transport_name, direct = "shm", False
    elif transport_name in OPTIONS:
        transport_name = transport_name.partition("-")[0]
    from tandem.kv_transfer.registry import create_transport

    chunk_blocks, num_blocks = _geometry(chunk_bytes)
    slots = num_blocks // chunk_blocks
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    process = ctx.Process(
        target=_receiver_main, args=(child, transport_name, num_blocks, options), daemon=True
    )
    process.start()
    child.close()
    transport = create_transport(transport_name, TOKEN)
    try:
        pool = _pool(transport, num_blocks, send_only=True)
        pool.tensor.fill_(1.0)
        transport.register_pool(pool)
        if not pipe.poll(60):
            raise RuntimeError("the receiving process did not start")
        peer: str = pipe.recv()

        def phase(name: str, count: int) -> float:
            start = time.perf_counter()
            for i in range(count):
                ids = list(range((i % slots) * chunk_blocks, (i % slots + 1) * chunk_blocks))
                header: dict[str, Any] = {"phase": name, "last": i == count - 1}
                if direct:
                    header["manifest"] = {"request_id": "bench", "dst_block_ids": ids}
                transport.send(peer, header, ids)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                for message in transport.poll(0.05):
                    if message.header.get("type") == "done" and message.header["phase"] == name:
                        return time.perf_counter() - start
                    raise RuntimeError(f"unexpected message {message.header}")
                if pipe.poll():
                    raise RuntimeError(f"receiver reported {pipe.recv()}")
            raise TimeoutError(f"{transport_name}: no answer for phase {name!r}")

        phase("warm", min(repeats, slots))
        elapsed = phase("timed", repeats)
        return repeats * chunk_bytes / elapsed / 1e9
    finally:
        transport.close()
        with contextlib.suppress(OSError):
            pipe.send("exit")
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
        pipe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--names", default=",".join(NAMES))
    parser.add_argument("--sizes", default="64K,1M,16M,64M")
    parser.add_argument("--rounds", type=int, default=3, help="best of this many measurements")
    parser.add_argument(
        "--wait-quiet", type=float, default=0.0, help="wait up to this many s for idle CPUs"
    )
    args = parser.parse_args()
    from bench.common import wait_for_quiet

    units = {"K": 1 << 10, "M": 1 << 20}
    sizes = [int(s[:-1]) * units[s[-1]] for s in args.sizes.split(",")]
    names = args.names.split(",")
    print("| chunk | " + " | ".join(f"{n} (GB/s)" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for size in sizes:
        cells = []
        for name in names:
            results = []
            for _ in range(args.rounds):
                wait_for_quiet(args.wait_quiet)
                results.append(measure_throughput(name, size, default_repeats(size)))
            cells.append(f"{max(results):.2f}")
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
