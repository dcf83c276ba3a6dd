"""`tandem bench serve`: the typer command (registered on the `tandem` app as `bench`)."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from tandem.bench.serving import vllm_options as vllm
from tandem.bench.serving.result_file import check_result_file

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks against a running server.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain help: paragraphs reflowed, option names never cut at 80 columns
)


@bench_app.callback()
def bench() -> None:
    """Benchmarks against a running server."""


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        pcts = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--percentiles") from None
    if not all(0 <= p <= 100 for p in pcts):
        raise typer.BadParameter("each must be in [0, 100]", param_hint="--percentiles")
    return pcts


def _percentile_metrics(text: str) -> tuple[str, ...]:
    from tandem.bench.serving.metrics import METRICS

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise typer.BadParameter(
            f"{', '.join(unknown) or 'none given'}: name some of {','.join(METRICS)}",
            param_hint="--percentile-metrics",
        )
    return names


def _check_options(request_rate: float, burstiness: float, tokenizer: Path | None) -> None:
    """Refuses what would fail only after the run (or in the middle of it), in one line."""
    for hint, value in (("--request-rate", request_rate), ("--burstiness", burstiness)):
        if not value > 0:
            raise typer.BadParameter(f"{value} is not > 0", param_hint=hint)
    if tokenizer is not None and not tokenizer.is_dir():
        raise typer.BadParameter(
            f"{tokenizer} is not a tokenizer or checkpoint directory", param_hint="--tokenizer"
        )


def _served_models(base_url: str, headers: dict[str, str]) -> list[str] | None:
    """The model ids the server lists, asked before the run as vLLM's bench asks: a server
    that is not there fails here, in one line, instead of every request of the run failing.
    None: it answers, but lists none (no /v1/models, or it wants a key: the run tells)."""
    try:
        request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/models", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as answer:
            body = answer.read()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        typer.echo(f"Error: no server answers at {base_url}: {reason}", err=True)
        raise typer.Exit(code=2) from None
    try:
        cards = json.loads(body).get("data")
        return [str(card["id"]) for card in cards] if isinstance(cards, list) else None
    except (ValueError, AttributeError, KeyError, TypeError):  # (not OpenAI's list)
        return None


def _model(model: str | None, served: list[str] | None) -> str:
    """`--model`, checked against what the server lists; none given: the first it lists (as
    vLLM's bench takes it)."""
    if model is None:
        if not served:
            raise typer.BadParameter("the server lists no model: give it", param_hint="--model")
        typer.echo(f"[bench] --model {served[0]} (the server's)", err=True)
        return served[0]
    if served and model not in served:
        raise typer.BadParameter(
            f"the server serves {', '.join(served)}, not {model!r}", param_hint="--model"
        )
    return model


@bench_app.command("serve", cls=vllm.VllmForms)
def serve(
    model: Annotated[
        str | None,
        typer.Option(
            help="Model name the server serves (the request's model; default: the first "
            "/v1/models lists)."
        ),
    ] = None,
    base_url: Annotated[
        str | None,
        typer.Option(help="Server root, e.g. http://127.0.0.1:8000 (no /v1; the default)."),
    ] = None,
    host: vllm.Host = None,
    port: vllm.Port = None,
    backend: vllm.Backend = "openai",
    served_model_name: vllm.ServedModelName = None,
    endpoint: Annotated[str, typer.Option(help="Completions endpoint path.")] = "/v1/completions",
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="OPENAI_API_KEY",
            show_envvar=True,
            help="Sent as 'Authorization: Bearer KEY' (a server started with --api-key).",
        ),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="Local tokenizer/checkpoint directory: prompts become token ids of exact "
            "lengths. Default: --model when it is a local directory, else word prompts, as "
            "many words as make the lengths asked for by the server's /tokenize count."
        ),
    ] = None,
    dataset_name: Annotated[
        str, typer.Option(help="random | shared-prefix | multi-turn | mixed.")
    ] = "random",
    num_prompts: Annotated[
        int,
        typer.Option(
            min=1, help="Requests to send (shared-prefix sends groups x prompts per group)."
        ),
    ] = 100,
    request_rate: Annotated[
        float,
        typer.Option(
            help="Mean arrivals per second (of conversations for multi-turn traffic); inf sends "
            "everything at once."
        ),
    ] = math.inf,
    burstiness: Annotated[
        float,
        typer.Option(
            help="Shape of the gamma inter-arrival times: 1 is Poisson, < 1 burstier, > 1 "
            "more regular."
        ),
    ] = 1.0,
    max_concurrency: Annotated[
        int | None, typer.Option(min=1, help="Most requests in flight at once (default: no cap).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of prompts and arrival times.")] = 0,
    random_input_len: Annotated[
        int, typer.Option("--random-input-len", "--input-len", min=1, help="random: prompt tokens.")
    ] = 128,
    random_output_len: Annotated[
        int,
        typer.Option("--random-output-len", "--output-len", min=1, help="random: output tokens."),
    ] = 64,
    random_prefix_len: Annotated[
        int, typer.Option(min=0, help="random: tokens of a prefix every prompt shares, first.")
    ] = 0,
    random_range_ratio: Annotated[
        float,
        typer.Option(
            min=0, max=1, help="random: lengths uniform in len * (1 - r) ... len * (1 + r)."
        ),
    ] = 0.0,
    sp_num_groups: Annotated[int, typer.Option(min=1, help="shared-prefix: groups.")] = 4,
    sp_prompts_per_group: Annotated[
        int, typer.Option(min=1, help="shared-prefix: prompts per group.")
    ] = 8,
    sp_system_prompt_len: Annotated[
        int, typer.Option(min=1, help="shared-prefix: tokens of each group's system prompt.")
    ] = 256,
    sp_question_len: Annotated[
        int, typer.Option(min=1, help="shared-prefix: tokens of each question.")
    ] = 32,
    sp_output_len: Annotated[int, typer.Option(min=1, help="shared-prefix: output tokens.")] = 32,
    mt_num_turns: Annotated[
        int, typer.Option(min=1, help="multi-turn: turns per conversation.")
    ] = 4,
    mt_first_len: Annotated[
        int, typer.Option(min=1, help="multi-turn: tokens of the first user message.")
    ] = 128,
    mt_turn_len: Annotated[
        int, typer.Option(min=1, help="multi-turn: tokens of each later user message.")
    ] = 32,
    mt_output_len: Annotated[
        int, typer.Option(min=1, help="multi-turn: output tokens per turn.")
    ] = 32,
    mixed_scale: Annotated[
        float,
        typer.Option(
            min=0.01,
            help="mixed: multiplies every length of the mix (70% short chats 32-96 -> 16-32 "
            "tokens, 10% RAG 768 -> 16, 10% agent 128 -> 128, 10% 3-turn chats on a shared "
            "512-token prefix).",
        ),
    ] = 1.0,
    goodput: Annotated[
        list[str] | None,
        typer.Option(
            help="SLOs as NAME:MS with NAME ttft, tpot or e2el: --goodput ttft:50 --goodput "
            "tpot:10, or quoted: --goodput 'ttft:50 tpot:10'; "
            "request_goodput counts requests that meet all of them."
        ),
    ] = None,
    percentiles: Annotated[
        str,
        typer.Option(
            "--percentiles",
            "--metric-percentiles",
            help="Comma-separated percentiles to report, e.g. 50,90,99.",
        ),
    ] = "90,99",
    percentile_metrics: Annotated[
        str,
        typer.Option(
            help="Comma-separated metrics whose statistics are reported: ttft,tpot,itl,e2el."
        ),
    ] = "ttft,tpot,itl,e2el",
    ignore_eos: Annotated[
        bool, typer.Option(help="Ask for exactly the output lengths (ignore_eos).")
    ] = True,
    temperature: Annotated[float, typer.Option(min=0, help="Sampling temperature.")] = 0.0,
    top_p: vllm.TopP = None,
    top_k: vllm.TopK = None,
    min_p: vllm.MinP = None,
    num_warmups: vllm.NumWarmups = 0,
    save_result: Annotated[
        str | None,
        typer.Option(
            metavar="[FILE]",
            help="Write the result JSON (vLLM's keys) to FILE; alone, as vLLM's flag, to "
            "--result-dir / --result-filename or vLLM's name "
            "(openai-{rate}qps[-concurrency{N}]-{model}-{date}.json).",
        ),
    ] = None,
    result_dir: Annotated[
        Path | None, typer.Option(help="Directory of the result file (made if missing).")
    ] = None,
    result_filename: Annotated[
        str | None, typer.Option(help="Name of the result file (instead of vLLM's).")
    ] = None,
    append_result: Annotated[
        bool, typer.Option(help="Append the result to the file, one JSON a line.")
    ] = False,
    save_detailed: Annotated[
        bool,
        typer.Option(
            help="Add the per-request arrays (ttfts, itls, latencies, input_lens, output_lens, "
            "errors, ...) to the saved result."
        ),
    ] = False,
    label: vllm.Label = None,
    metadata: vllm.Metadata = None,
    disable_tqdm: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    trust_remote_code: vllm.TrustRemoteCode = False,
) -> None:
    """Open-loop serving benchmark with `vllm bench serve`'s metrics and result keys.

    Streams /v1/completions requests (with usage) at gamma-distributed arrival times and prints
    TTFT, TPOT, ITL and E2EL (mean, median, std, percentiles), throughputs and goodput.
    """
    from tandem.bench.serving.benchmark import (
        DatasetOptions,
        make_conversations,
        prompt_maker,
        run_benchmark,
        server_token_counter,
    )
    from tandem.bench.serving.datasets import DATASETS, MixedSpec
    from tandem.bench.serving.metrics import parse_goodput
    from tandem.bench.serving.result import summary_text
    from tandem.bench.serving.result_file import result_path, write_result
    from tandem.bench.serving.runner import LoadConfig, bearer_headers

    if dataset_name not in DATASETS:
        raise typer.BadParameter(f"one of {', '.join(DATASETS)}", param_hint="--dataset-name")
    try:
        slos = parse_goodput(goodput or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    pcts = _percentiles(percentiles)
    shown = _percentile_metrics(percentile_metrics)
    _check_options(request_rate, burstiness, tokenizer)
    vllm.check_backend(backend)
    meta = vllm.metadata_fields(metadata)
    base_url = vllm.server_root(base_url, host, port)
    started = datetime.now()
    if base_url.rstrip("/").endswith("/v1") and endpoint.startswith("/v1/"):
        base_url = base_url.rstrip("/").removesuffix("/v1")  # (the endpoint has it)
        typer.echo(f"[bench] --base-url is the server's root: using {base_url}", err=True)
    checkpoint = model if served_model_name is not None else None  # (--model: the tokenizer's)
    model = _model(served_model_name or model, _served_models(base_url, bearer_headers(api_key)))
    try:
        name_parts = {"model": checkpoint or model, "request_rate": request_rate,
                      "label": label or backend,
                      "max_concurrency": max_concurrency, "started": started}  # fmt: skip
        result_file = result_path(
            save_result, result_dir, result_filename, append_result, name_parts
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--result-filename") from None
    if result_file is not None:
        check_result_file(result_file)
    if tokenizer is None and Path(checkpoint or model).is_dir():
        tokenizer = Path(checkpoint or model)
    maker = prompt_maker(tokenizer, server_token_counter(base_url, model, bearer_headers(api_key)))
    options = DatasetOptions(
        dataset_name,
        num_prompts,
        random_input_len,
        random_output_len,
        random_range_ratio,
        sp_num_groups,
        sp_prompts_per_group,
        sp_system_prompt_len,
        sp_question_len,
        sp_output_len,
        mt_num_turns,
        mt_first_len,
        mt_turn_len,
        mt_output_len,
        MixedSpec(scale=mixed_scale),
        random_prefix_len,
    )
    conversations = make_conversations(options, maker, seed)
    load = LoadConfig(
        base_url=base_url,
        model=model,
        endpoint=endpoint,
        request_rate=request_rate,
        burstiness=burstiness,
        max_concurrency=max_concurrency,
        seed=seed,
        extra_body=vllm.sampling_fields(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, ignore_eos=ignore_eos
        ),
        progress=not disable_tqdm,
        api_key=api_key,
    )
    typer.echo(
        f"[bench] {dataset_name}: {sum(len(c.turns) for c in conversations)} requests, "
        f"rate {request_rate}/s, burstiness {burstiness}, max concurrency {max_concurrency}",
        err=True,
    )
    run = run_benchmark(
        load,
        conversations,
        maker,
        slos=slos or None,
        percentiles=pcts,
        info={
            "backend": backend,
            "model_id": checkpoint or model,  # (vLLM's: --model, whatever the requests name)
            "tokenizer_id": str(tokenizer) if tokenizer else None,
            "dataset_name": dataset_name,
            **meta,
        },
        warmups=num_warmups,
        detailed=save_detailed,
        shown=shown,
    )
    typer.echo(summary_text(run.metrics, [r.error for r in run.records], run.records, shown))
    if result_file is not None:
        write_result(result_file, run.result, append_result)
        typer.echo(f"[bench] result written to {result_file}", err=True)
    if run.metrics.completed == 0:
        raise typer.Exit(code=1)
