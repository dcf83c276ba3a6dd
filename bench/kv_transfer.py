"""KV-transfer benchmark: transport throughput next to memcpy, and how much of a transfer
hides behind prefill compute.

1. For each transport, GB/s moving chunks of 64 KiB ... 64 MiB of KV pages from one process into
   another's pool, next to `numpy.copyto` into a preallocated buffer measured in the same run
   (interleaved with the transports, size by size), with the ratio (targets: best CPU
   transport >= 80 % of memcpy at >= 1 MiB; ucx >= 60 %).
2. For a 2,048-token prompt on the ~40M benchmark model, per transport: TTFT in one process
   (colocated) and with prefill and decode in two processes, and the share of the transfer
   time hidden behind prefill, 1 - (TTFT_disaggregated - TTFT_colocated) / transfer_time
   (target >= 80 %). The disaggregated TTFT is the prefill's first token (tandem streams it to
   the client before the last chunk goes). Separate runs differ by far more than a transfer
   here, so the difference is taken in the same run: the time the prefill's engine thread
   spent handing pages over, plus how much longer it stalled (wall minus CPU time in its
   steps: waiting for the GIL or a core) than in the same prefill with nothing sent. The
   prefill sends as its workers do: chunks other than the last leave from a publishing thread
   (`KVSender(hand_off=True)`), whose use of the GIL shows up as that stall. The hop
   from the first token to the commit on decode is reported too (`hidden_share_until_commit`).

Transports: shm, torch, ucx (which on one machine reads the pages out of the sender's pool itself,
as shm does) and ucx-push (UCX moves the pages, as it does between machines; its figures are
judged against the ucx target too, `ucx_push_ge_1MiB`).

Usage: python bench/kv_transfer.py [--quick]. Progress on stderr; a JSON summary is the last
line on stdout. Part 2 runs for every transport that is installed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ModelShape, ensure_checkpoint, log, wait_for_quiet  # noqa: E402
from bench.kv_transfer_common import OPTIONS, default_repeats, measure_throughput  # noqa: E402

SIZES = {
    "64K": 64 << 10,
    "256K": 256 << 10,
    "1M": 1 << 20,
    "4M": 4 << 20,
    "16M": 16 << 20,
    "64M": 64 << 20,
}
TRANSPORTS = ("shm", "torch", "ucx", "ucx-push")
"""`ucx` pulls pages on one machine (the receiver reads them); `ucx-push` has UCX move them."""


def throughput_table(
    sizes: list[str], rounds: int, quiet_s: float, transports: tuple[str, ...] = TRANSPORTS
) -> dict[str, dict[str, float | None]]:
    """Best GB/s per (name, size). The measurements are interleaved: for each size, `rounds`
    times memcpy then every transport, so a transport's ratio is to a memcpy taken within the
    same half minute. (Measured name by name, memcpy and ucx were minutes apart, and this
    machine's memcpy moves from 9 to 16 GB/s between such moments.)"""
    names = ("memcpy", *transports)
    table: dict[str, dict[str, float | None]] = {name: {} for name in names}
    unavailable: set[str] = set()
    for label in sizes:
        chunk = SIZES[label]
        for _ in range(rounds):
            for name in names:
                if name in unavailable:
                    continue
                wait_for_quiet(quiet_s)
                try:
                    gbs = measure_throughput(name, chunk, default_repeats(chunk))
                except Exception as exc:  # a transport that is not installed here
                    log(f"{name} {label}: unavailable ({type(exc).__name__}: {exc})")
                    unavailable.add(name)
                    continue
                best = table[name].get(label)
                table[name][label] = gbs if best is None else max(best, gbs)
        for name in names:
            table[name].setdefault(label, None)
            best = table[name][label]
            if best is not None:
                base = table["memcpy"][label]
                ratio = f" ({best / base:.2f} of memcpy)" if base and name != "memcpy" else ""
                log(f"{name:6s} {label:>4s}: {best:6.2f} GB/s{ratio}")
    return table


def ratios(table: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for name in [n for n in table if n != "memcpy"]:
        out[name] = {}
        for label, gbs in table.get(name, {}).items():
            base = table["memcpy"].get(label)
            out[name][label] = round(gbs / base, 3) if gbs and base else None
    return out


def hidden_share(
    model_dir: Path,
    transport: str,
    gbs: float,
    threads: int,
    chunk_blocks: int,
    rounds: int = 3,
    hand_off: bool = True,
) -> dict[str, Any]:
    """Medians over `rounds` distinct 2,048-token prompts (no prefix hits). The processes stamp
    their own events (`time.perf_counter()`, one clock on a machine), so the hop from the
    prefill's first token to the commit on decode is timed without pipe or polling jitter."""
    import torch

    from tandem import LLM, SamplingParams
    from tandem.kv_transfer.process_pair import PDProcesses

    torch.set_num_threads(threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32000) for _ in range(2048)] for _ in range(rounds)]
    alone = [[rng.randrange(1, 32000) for _ in range(2048)] for _ in range(rounds)]
    warm = [rng.randrange(1, 32000) for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm = LLM(model=str(model_dir), num_kv_blocks=512, max_num_batched_tokens=16 * chunk_blocks)
    llm.generate([warm], params, use_tqdm=False)
    colocated = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        colocated.append(time.perf_counter() - start)
    kv_bytes = llm.engine.kv_pool.bytes_per_block * -(-2048 // 16)
    del llm
    pd = PDProcesses(
        str(model_dir),
        transport.partition("-")[0],
        OPTIONS.get(transport),
        chunk_blocks=chunk_blocks,
        threads=threads,
        checksums=False,
        hand_off=hand_off,
    )
    first, committed, send_work, stall_pd, stall_alone = [], [], [], [], []
    greedy = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}
    try:
        pd.run("warm", warm, greedy)
        work = max(e.get("send_work_s", 0.0) for e in pd.events)
        stall = max(e.get("stall_s", 0.0) for e in pd.events)
        for i, prompt in enumerate(prompts):
            # The same prefill with nothing sent: how long the engine thread stalls anyway.
            pd.prefill_only(f"alone{i}", alone[i], greedy)
            seen = _wait(pd, f"alone{i}", {"first_token"})
            stall_alone.append(seen["first_token"]["stall_s"] - stall)
            stall = seen["first_token"]["stall_s"]
            pd.cancel_prefill(f"alone{i}")
            _wait(pd, f"alone{i}", {"cancelled"})
            rid = f"big{i}"
            t0 = time.perf_counter()
            pd.start(rid, prompt, greedy)
            stamps = _wait(pd, rid, {"first_token", "committed", "sent", "done"})
            first.append(stamps["first_token"]["at"] - t0)
            committed.append(stamps["committed"]["at"] - t0)
            send_work.append(stamps["first_token"]["send_work_s"] - work)
            stall_pd.append(stamps["first_token"]["stall_s"] - stall)
            work = stamps["sent"]["send_work_s"]
            stall = stamps["first_token"]["stall_s"]
    finally:
        pd.close()
    transfer_s = kv_bytes / (gbs * 1e9)
    tail = [c - f for c, f in zip(committed, first, strict=True)]
    med = statistics.median
    extra_stall = max(0.0, med(stall_pd) - med(stall_alone))
    exposed = med(send_work) + extra_stall
    log(
        f"2048-token prompt, {rounds} rounds, medians: colocated TTFT {med(colocated) * 1e3:.1f} ms "
        f"(spread {(max(colocated) - min(colocated)) * 1e3:.1f} ms); two processes over "
        f"{transport}: first token {med(first) * 1e3:.1f} ms after "
        f"{med(send_work) * 1e3:.3f} ms of send work on the prefill thread and "
        f"{extra_stall * 1e3:.3f} ms more stall (GIL, preemption) than a prefill alone "
        f"({med(stall_alone) * 1e3:.3f} ms), committed on decode "
        f"{med(tail) * 1e3:.3f} ms later (rounds: {', '.join(f'{t * 1e3:.3f}' for t in tail)}); "
        f"transfer alone {transfer_s * 1e3:.2f} ms ({kv_bytes / 2**20:.1f} MiB at {gbs:.2f} GB/s)"
    )
    return {
        "transport": transport,
        "prompt_tokens": 2048,
        "kv_mib": round(kv_bytes / 2**20, 2),
        "chunk_blocks": chunk_blocks,
        "hand_off": hand_off,
        "torch_threads": threads,
        "rounds": rounds,
        "transfer_ms": round(transfer_s * 1e3, 3),
        "ttft_colocated_ms": round(med(colocated) * 1e3, 2),
        "ttft_colocated_spread_ms": round((max(colocated) - min(colocated)) * 1e3, 2),
        # tandem streams the first token from the prefill worker as soon as it is sampled
        # (before the last chunk goes), so this is the disaggregated TTFT a client sees.
        "ttft_disaggregated_ms": round(med(first) * 1e3, 2),
        "send_work_before_first_token_ms": round(med(send_work) * 1e3, 3),
        "committed_after_first_token_ms": round(med(tail) * 1e3, 3),
        "engine_stall_ms": round(med(stall_pd) * 1e3, 3),
        "engine_stall_alone_ms": round(med(stall_alone) * 1e3, 3),
        # Same run, so not blurred by run-to-run spread: the transfer time on the first token's
        # path is what the prefill's engine thread spent handing pages over plus how much longer
        # it stalled (runnable but not running: the GIL held by the send or transport threads,
        # or preempted by them) than the same prefill with nothing to send.
        "hidden_share": round(1 - exposed / transfer_s, 3),
        # Stricter: also the last chunk and its commit, until decode can go on (token 2).
        "hidden_share_until_commit": round(1 - (exposed + med(tail)) / transfer_s, 3),
        # As the issue writes it, against separate colocated runs: on a CPU the transfer is a
        # few ms of a ~1 s prefill, far inside the run-to-run spread, so this one is noise.
        "hidden_share_vs_separate_colocated_run": round(
            1 - (med(first) - med(colocated)) / transfer_s, 3
        ),
    }


def _wait(pd: Any, rid: str, kinds: set[str], timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    """`rid`'s events of `kinds` as the processes stamped them (`at`, and the prefill's work
    counters); "done" stands for decode having finished the request."""
    seen: dict[str, dict[str, Any]] = {}
    deadline = time.perf_counter() + timeout
    while not kinds <= seen.keys():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{rid}: saw only {sorted(seen)}")
        # Blocks until a process writes (no polling loop: on 2 cores its wake-ups would take
        # the CPU from the prefill that is being measured).
        for ready in wait_for_any([pd.prefill_conn, pd.decode_conn], timeout=1.0):
            conn: Connection = ready  # type: ignore[assignment]
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "event" and msg[1]["request_id"] == rid:
                    if msg[1]["kind"] == "failed":
                        raise RuntimeError(f"{rid}: transfer failed: {msg[1]['error']}")
                    seen.setdefault(msg[1]["kind"], msg[1])
                if msg[0] == "done" and msg[1] == rid:
                    seen["done"] = {}
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="sizes 1M and 16M only, one round")
    parser.add_argument(
        "--rounds", type=int, default=2, help="timed rounds per size (best is kept)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per process (workers run 1)"
    )
    parser.add_argument(
        "--hidden-rounds",
        type=int,
        default=25,
        help="2,048-token prompts in part 2 (medians: a prefill's steps here are preempted for "
        "0.1-0.4 ms at random, against a ~1.3 ms transfer; with 9 the figure moved by ~0.1)",
    )
    parser.add_argument(
        "--inline-send",
        action="store_true",
        help="part 2: the prefill's engine thread sends every chunk itself (no publishing "
        "thread, as before session 10), for an A/B",
    )
    parser.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help="comma-separated transports to measure (default: all installed)",
    )
    parser.add_argument(
        "--chunk-blocks", type=int, default=16, help="prefill chunk in blocks of 16 tokens"
    )
    parser.add_argument(
        "--wait-quiet", type=float, default=20.0, help="wait up to this long for idle CPUs"
    )
    parser.add_argument("--cache-dir", type=Path, default=Path(".tandem/bench-models"))
    args = parser.parse_args()
    sizes = ["1M", "16M"] if args.quick else list(SIZES)
    transports = tuple(n.strip() for n in args.transports.split(",") if n.strip())
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown:
        parser.error(f"unknown transports {unknown}; choose from {', '.join(TRANSPORTS)}")
    table = throughput_table(sizes, 1 if args.quick else args.rounds, args.wait_quiet, transports)
    rel = ratios(table)
    model_dir = ensure_checkpoint(args.cache_dir, ModelShape(max_position=4096))  # 2,048 tokens fit
    hidden: dict[str, Any] = {}
    for name in transports:
        # The transport's best rate at >= 1 MiB: the shortest transfer, so the hidden share
        # is not flattered by a slow figure.
        rates = [v for k, v in table.get(name, {}).items() if v and SIZES[k] >= 1 << 20]
        if rates:
            hidden[name] = hidden_share(
                model_dir,
                name,
                max(rates),
                args.threads,
                args.chunk_blocks,
                args.hidden_rounds,
                hand_off=not args.inline_send,
            )
    summary = {
        "bench": "kv_transfer",
        "gb_per_s": table,
        "ratio_to_memcpy": rel,
        "targets": {
            "best_cpu_transport_ge_1MiB_ratio_min": 0.8,
            "ucx_ge_1MiB_ratio_min": 0.6,
            "hidden_share_min": 0.8,
        },
        "hidden_behind_prefill": hidden,  # per transport
    }
    summary["targets_met"] = targets_met(rel, hidden)
    log(f"targets met: {summary['targets_met']}")
    print(json.dumps(summary))


def targets_met(rel: dict[str, dict[str, float | None]], hidden: dict[str, Any]) -> dict[str, Any]:
    """Each target against this run: some CPU transport at >= 0.8 of memcpy at every size
    >= 1 MiB; ucx at >= 0.6 at every such size (None: not measured in this run); and per
    transport, its hidden share >= 0.8 (a slow transport's is flattered by its long transfer:
    torch's here)."""

    def at_least(name: str, floor: float) -> bool | None:
        values = [v for k, v in rel.get(name, {}).items() if SIZES[k] >= 1 << 20]
        known = [v for v in values if v is not None]
        return None if not known or len(known) < len(values) else min(known) >= floor

    judged = [
        v for v in (at_least(name, 0.8) for name in TRANSPORTS if name in rel) if v is not None
    ]
    return {
        "best_cpu_transport_ge_1MiB": any(judged) if judged else None,
        "ucx_ge_1MiB": at_least("ucx", 0.6),
        "ucx_push_ge_1MiB": at_least("ucx-push", 0.6),
        "hidden_share": {name: h["hidden_share"] >= 0.8 for name, h in hidden.items()},
    }


if __name__ == "__main__":
    main()
