"""KV-transfer benchmark: transport throughput next to memcpy, and how much of a transfer
hides behind prefill compute.

1. For each transport, GB/s moving chunks of 64 KiB ... 64 MiB of KV pages from one process into
   another's pool, next to `numpy.copyto` into a preallocated buffer measured in the same run,
   with the ratio (targets: best CPU transport >= 80 % of memcpy at >= 1 MiB; ucx >= 60 %).
2. For a 2,048-token prompt on the ~40M benchmark model: TTFT in one process (colocated) and
   with prefill and decode in two processes joined by the best transport (time until the request
   is committed on the decode side), and the share of the transfer time hidden behind prefill,
   1 - (TTFT_disaggregated - TTFT_colocated) / transfer_time (target >= 80 %).

Usage: python bench/kv_transfer.py [--quick]. Progress on stderr; a JSON summary is the last
line on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ModelShape, ensure_checkpoint, log, wait_for_quiet  # noqa: E402
from bench.kv_transfer_common import default_repeats, measure_throughput  # noqa: E402

SIZES = {
    "64K": 64 << 10,
    "256K": 256 << 10,
    "1M": 1 << 20,
    "4M": 4 << 20,
    "16M": 16 << 20,
    "64M": 64 << 20,
}
TRANSPORTS = ("shm", "torch", "ucx")


def throughput_table(
    sizes: list[str], rounds: int, quiet_s: float
) -> dict[str, dict[str, float | None]]:
    table: dict[str, dict[str, float | None]] = {}
    for name in ("memcpy", *TRANSPORTS):
        table[name] = {}
        for label in sizes:
            chunk = SIZES[label]
            best: float | None = None
            for _ in range(rounds):
                wait_for_quiet(quiet_s)
                try:
                    gbs = measure_throughput(name, chunk, default_repeats(chunk))
                except Exception as exc:  # a transport that is not installed here
                    log(f"{name} {label}: unavailable ({type(exc).__name__}: {exc})")
                    break
                best = gbs if best is None else max(best, gbs)
            table[name][label] = best
            if best is not None:
                log(f"{name:6s} {label:>4s}: {best:6.2f} GB/s")
    return table


def ratios(table: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for name in TRANSPORTS:
        out[name] = {}
        for label, gbs in table.get(name, {}).items():
            base = table["memcpy"].get(label)
            out[name][label] = round(gbs / base, 3) if gbs and base else None
    return out


def hidden_share(
    model_dir: Path, transport: str, gbs: float, threads: int, chunk_blocks: int
) -> dict[str, Any]:
    import torch

    from tandem import LLM, SamplingParams
    from tandem.kv_transfer.process_pair import PDProcesses

    torch.set_num_threads(threads)
    rng = random.Random(0)
    prompt = [rng.randrange(1, 32000) for _ in range(2048)]
    warm = [rng.randrange(1, 32000) for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm = LLM(model=str(model_dir), num_kv_blocks=512, max_num_batched_tokens=16 * chunk_blocks)
    llm.generate([warm], params)
    start = time.perf_counter()
    llm.generate([prompt], params)
    ttft_colocated = time.perf_counter() - start
    kv_bytes = llm.engine.kv_pool.bytes_per_block * -(-len(prompt) // 16)
    del llm
    pd = PDProcesses(
        str(model_dir), transport, chunk_blocks=chunk_blocks, threads=threads, checksums=False
    )
    try:
        pd.run("warm", warm, {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True})
        t0 = time.perf_counter()
        pd.start("big", prompt, {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True})
        arrivals = _arrivals(pd, {("first_token", "big"), ("committed", "big")})
    finally:
        pd.close()
    ttft_disaggregated = arrivals[("committed", "big")] - t0
    prefill_first_token = arrivals[("first_token", "big")] - t0
    transfer_s = kv_bytes / (gbs * 1e9)
    exposed = ttft_disaggregated - prefill_first_token
    log(
        f"2048-token prompt: colocated TTFT {ttft_colocated * 1e3:.1f} ms; two processes over {transport}: "
        f"first token {prefill_first_token * 1e3:.1f} ms, committed on decode {ttft_disaggregated * 1e3:.1f} ms; "
        f"transfer alone {transfer_s * 1e3:.2f} ms ({kv_bytes / 2**20:.1f} MiB)"
    )
    return {
        "transport": transport,
        "prompt_tokens": len(prompt),
        "kv_mib": round(kv_bytes / 2**20, 2),
        "chunk_blocks": chunk_blocks,
        "ttft_colocated_ms": round(ttft_colocated * 1e3, 2),
        "prefill_first_token_ms": round(prefill_first_token * 1e3, 2),
        "ttft_disaggregated_ms": round(ttft_disaggregated * 1e3, 2),
        "transfer_ms": round(transfer_s * 1e3, 3),
        # Same run: the prefill process's own first-token time stands for the colocated TTFT, so
        # the figure is not blurred by two processes sharing two cores.
        "hidden_share": round(1 - exposed / transfer_s, 3),
        # As the issue writes it, against a separate colocated run (noisy on 2 shared cores).
        "hidden_share_vs_separate_colocated_run": round(
            1 - (ttft_disaggregated - ttft_colocated) / transfer_s, 3
        ),
    }


def _arrivals(
    pd: Any, wanted: set[tuple[str, str]], timeout: float = 120.0
) -> dict[tuple[str, str], float]:
    """Driver-side arrival times of protocol events from either process."""
    seen: dict[tuple[str, str], float] = {}
    deadline = time.perf_counter() + timeout
    while len(seen) < len(wanted):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"events {wanted - set(seen)} did not arrive")
        for conn in (pd.prefill_conn, pd.decode_conn):
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "event":
                    key = (msg[1]["kind"], msg[1]["request_id"])
                    if key in wanted and key not in seen:
                        seen[key] = time.perf_counter()
        time.sleep(0.0002)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="sizes 1M and 16M only, one round")
    parser.add_argument(
        "--rounds", type=int, default=2, help="timed rounds per size (best is kept)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument(
        "--chunk-blocks", type=int, default=16, help="prefill chunk in blocks of 16 tokens"
    )
    parser.add_argument(
        "--wait-quiet", type=float, default=20.0, help="wait up to this long for idle CPUs"
    )
    parser.add_argument("--cache-dir", type=Path, default=Path(".tandem/bench-models"))
    args = parser.parse_args()
    sizes = ["1M", "16M"] if args.quick else list(SIZES)
    table = throughput_table(sizes, 1 if args.quick else args.rounds, args.wait_quiet)
    rel = ratios(table)
    best = max(
        (n for n in TRANSPORTS if table[n].get("16M")),
        key=lambda n: table[n]["16M"] or 0.0,
        default="shm",
    )
    model_dir = ensure_checkpoint(args.cache_dir, ModelShape(max_position=4096))  # 2,048 tokens fit
    chunk_bytes_label = "1M"
    gbs = table[best].get(chunk_bytes_label) or table[best].get("16M") or 1.0
    hidden = hidden_share(model_dir, best, gbs, args.threads, args.chunk_blocks)
    summary = {
        "bench": "kv_transfer",
        "gb_per_s": table,
        "ratio_to_memcpy": rel,
        "targets": {
            "best_cpu_transport_ge_1MiB_ratio_min": 0.8,
            "ucx_ge_1MiB_ratio_min": 0.6,
            "hidden_share_min": 0.8,
        },
        "hidden_behind_prefill": hidden,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
