"""What the cluster adds per request: TTFT and TPOT at concurrency 1, cluster vs in-process `LLM`.

Starts a local Ray cluster, deploys 1 prefill + 1 decode worker on the same checkpoint, and sends
requests one at a time through gRPC (one message per token, so every token's arrival is seen)
and through the HTTP API (SSE; TTFT to the first chunk; through Ray Serve's Python proxy as
`tandem serve` does by default, or `--ingress haproxy`, and on the router's own port,
`direct_port`, which skips Serve's proxy). The baseline runs the same prompts in
this process with `LLMEngine.step()`, back to back, and again with the engine idle before each
request as long as the cluster's prefill worker idles between requests (the decode time of the
previous one): an engine that just woke computes a prefill about twice as slowly here (cold
caches), which the cluster pays and a back-to-back loop does not. Last, a bare gRPC server with
the same pause (`bench/grpc_floor.py`): the floor under any Python gRPC front end here. Prints
p50/p99 of each and the differences; the JSON summary is the last line. Target: <= 2 ms p50
added per request.

    python bench/overhead.py                       # embedded tiny model, 40 requests
    python bench/overhead.py --model PATH --requests 100 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.bench import grpc_floor  # noqa: E402
from tandem.deploy.ingress import DEFAULT_INGRESS, Ingress, ingress_environment  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(ttft: list[float], tpot: list[float]) -> dict[str, float]:
    return {
        "ttft_p50_ms": round(pct(ttft, 50) * 1e3, 3),
        "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 3),
        "tpot_p50_ms": round(pct(tpot, 50) * 1e3, 3),
        "tpot_p99_ms": round(pct(tpot, 99) * 1e3, 3),
    }


def prompts_for(llm: LLM, n: int, length: int, offset: int = 0) -> list[list[int]]:
    base = llm.tokenizer.encode("tandem measures what the cluster adds to every request " * 64)
    return [[(t * (offset + 1) + i) % 400 + 10 for t in base[:length]] for i in range(n)]


def in_process(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, idle_s: float = 0.0, tag: str = ""
) -> tuple[list, list]:
    """Requests one after another; with `idle_s`, the engine first sits idle that long (as the
    cluster's prefill worker does between requests at concurrency 1: caches go cold)."""
    engine = llm.engine
    ttft, tpot = [], []
    for i, prompt in enumerate(prompts):
        if idle_s:
            time.sleep(idle_s)
        start = time.perf_counter()
        engine.add_request(prompt, params, request_id=f"base{tag}-{i}")
        stamps = []
        while engine.has_unfinished_requests():
            for _ in engine.step():
                stamps.append(time.perf_counter())
        ttft.append(stamps[0] - start)
        tpot.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
    return ttft, tpot


def through_grpc(port: int, prompts: list[list[int]], max_tokens: int) -> tuple[list, list]:
    import grpc

    from tandem.router.grpc import generation_pb2, generation_pb2_grpc

    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    ttft, tpot = [], []
    for prompt in prompts:
        request = generation_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=generation_pb2.SamplingOptions(
                temperature=0, max_tokens=max_tokens, ignore_eos=True
            ),
        )
        start = time.perf_counter()
        stamps = [time.perf_counter() for r in stub.Generate(request) for _ in r.token_ids]
        ttft.append(stamps[0] - start)
        tpot.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
    return ttft, tpot


def through_http(
    port: int, prompts: list[list[int]], max_tokens: int, stages: dict[str, list[float]]
) -> list[float]:
    """TTFT to the first SSE chunk; collects the router's per-stage timings into `stages`."""
    import requests

    session = requests.Session()
    ttft = []
    for prompt in prompts:
        body: dict[str, Any] = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        start = time.perf_counter()
        first = None
        with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body, stream=True) as r:
            # chunk_size=None: lines as they arrive (the default waits for 512 bytes)
            for line in r.iter_lines(chunk_size=None):  # type: ignore[call-overload]
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter()
                if b"tandem_timings" in line:
                    for k, v in json.loads(line[6:])["tandem_timings"].items():
                        stages.setdefault(k, []).append(v)
        ttft.append((first or time.perf_counter()) - start)
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="checkpoint (default: the embedded tiny model)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--transport", default="shm")
    parser.add_argument(
        "--transport-option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a transport option for every worker, e.g. pull=false (repeatable)",
    )
    parser.add_argument(
        "--ingress",
        choices=[i.value for i in Ingress],
        default=DEFAULT_INGRESS.value,
        help="HTTP front of the cluster, as `tandem serve --ingress` (default proxy)",
    )
    args = parser.parse_args()

    import ray
    from ray import serve

    from tandem.deploy.app_builder import build_app, resolve_model
    from tandem.deploy.cluster_config import ClusterConfig

    cache = Path(tempfile.gettempdir()) / "tandem-bench"
    options = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.transport_option)}
    config = ClusterConfig(model=args.model, cache_dir=str(cache), transport=args.transport,
                           transport_options=options, served_model_name="bench", grpc_port=50151,
                           direct_port=28001,
                           engine={"num_kv_blocks": 1024},
                           # every request takes the PD path (no local prefill on decode)
                           decode_routing={"conditional_prefill_max_tokens": 0})  # fmt: skip
    torch.set_num_threads(1)  # as each worker runs (RoleConfig.torch_threads)
    model = resolve_model(config)
    config = config.model_copy(update={"model": model})
    llm = LLM(model=model, num_kv_blocks=1024)
    prompts = prompts_for(llm, args.requests + 3, args.prompt_len)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    in_process(llm, prompts[:3], params)  # warm-up
    base = summary(*in_process(llm, prompts[3:], params))
    print(f"in-process LLM: {base}", flush=True)

    os.environ.update(ingress_environment(Ingress(args.ingress), os.environ))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 28999})
    try:
        serve.run(build_app(config), name="bench", route_prefix="/")
        through_grpc(50151, prompts[:3], args.max_tokens)  # warm-up
        grpc_ttft, grpc_tpot = through_grpc(50151, prompts[3:], args.max_tokens)
        cluster = summary(grpc_ttft, grpc_tpot)
        stages: dict[str, list[float]] = {}
        fresh = prompts_for(llm, args.requests, args.prompt_len, offset=7)  # no prefix hits
        http_ttft = through_http(28999, fresh, args.max_tokens, stages)
        fresh = prompts_for(llm, args.requests, args.prompt_len, offset=11)
        direct_ttft = through_http(28001, fresh, args.max_tokens, {})  # the router's own port
    finally:
        serve.shutdown()
        ray.shutdown()
    # The prefill worker idles while decode runs the previous request: the same pause here.
    idle_s = statistics.median(stages.get("decode_stream") or [0.0]) / 1e3
    idle = summary(*in_process(llm, prompts[3:], params, idle_s=idle_s, tag="-idle"))
    print(f"in-process LLM, idle {idle_s * 1e3:.1f} ms before each request: {idle}", flush=True)
    floor_ms = round(
        statistics.median(grpc_floor.measure(prompts[3], args.requests, idle_s)) * 1e3, 3
    )
    print(f"bare gRPC round trip (no cluster), same pause: p50 {floor_ms} ms", flush=True)
    cluster["http_ttft_p50_ms"] = round(pct(http_ttft, 50) * 1e3, 3)
    cluster["http_ttft_p99_ms"] = round(pct(http_ttft, 99) * 1e3, 3)
    cluster["direct_http_ttft_p50_ms"] = round(pct(direct_ttft, 50) * 1e3, 3)
    cluster["direct_http_ttft_p99_ms"] = round(pct(direct_ttft, 99) * 1e3, 3)
    print(f"cluster (gRPC, 1 prefill + 1 decode, {args.transport}): {cluster}", flush=True)
    stage_p50 = {k: round(statistics.median(v), 3) for k, v in stages.items()}
    print(f"router stage timings over HTTP, p50 ms: {stage_p50}", flush=True)
    added = {
        "ttft_p50_ms": round(cluster["ttft_p50_ms"] - base["ttft_p50_ms"], 3),
        "tpot_p50_ms": round(cluster["tpot_p50_ms"] - base["tpot_p50_ms"], 3),
        "http_ttft_p50_ms": round(cluster["http_ttft_p50_ms"] - base["ttft_p50_ms"], 3),
        "direct_http_ttft_p50_ms": round(
            cluster["direct_http_ttft_p50_ms"] - base["ttft_p50_ms"], 3
        ),
    }
    added_vs_idle = {
        "ttft_p50_ms": round(cluster["ttft_p50_ms"] - idle["ttft_p50_ms"], 3),
        "http_ttft_p50_ms": round(cluster["http_ttft_p50_ms"] - idle["ttft_p50_ms"], 3),
    }
    print(f"added by the cluster (p50): {added}  (target <= 2 ms)", flush=True)
    print(f"added vs the idle-paced in-process engine (p50): {added_vs_idle}", flush=True)
    beyond = round(added_vs_idle["ttft_p50_ms"] - floor_ms, 3)
    print(f"added beyond that engine and the bare gRPC round trip (p50): {beyond} ms", flush=True)
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "model": Path(model).name,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "transport": args.transport,
        "transport_options": options,
        "ingress": args.ingress,
        "in_process": base,
        "cluster": cluster,
        "added_p50_ms": added,
        "target_met": added["ttft_p50_ms"] <= 2.0 and added["tpot_p50_ms"] <= 2.0,
        "in_process_idle": {"idle_ms": round(idle_s * 1e3, 3), **idle},
        "added_vs_idle_p50_ms": added_vs_idle,
        "grpc_floor_idle_p50_ms": floor_ms,
        "added_beyond_idle_engine_and_grpc_floor_p50_ms": beyond,
        "router_stages_p50_ms": stage_p50,
        "statistics": {"ttft_stdev_ms": round(statistics.pstdev(grpc_ttft) * 1e3, 3)},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
