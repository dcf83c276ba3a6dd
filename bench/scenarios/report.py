"""Markdown tables of the scenario results, and the docs section they replace in place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BEGIN = "<!-- scenarios:begin (written by bench/scenarios/run_all.py) -->"
END = "<!-- scenarios:end -->"


def mixed_table(mixed: dict[str, Any]) -> str:
    rows = [
        "| configuration | short TTFT p99, no load | short TTFT p99, mixed | ratio (target <= 2) "
        "| ITL p99, short | ITL p99, all | TPOT p99, short | tokens/chunk | completed / failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in mixed["configs"].items():
        rows.append(
            f"| {name} | {r['no_load_short']['ttft_p99_ms']:.0f} ms "
            f"| {r['mixed_short']['ttft_p99_ms']:.0f} ms | {r['ttft_p99_ratio']:.2f} "
            f"| {r['mixed_short']['itl_p99_ms']:.0f} ms | {r['itl_p99_all_ms']:.0f} ms "
            f"| {r['mixed_short']['tpot_p99_ms']:.1f} ms | {r['tokens_per_chunk']:.1f} "
            f"| {r['completed']} / {r['failed']} |"
        )
    return "\n".join(rows)


def goodput_table(sweep: dict[str, Any]) -> str:
    names = list(sweep["configs"])
    rates = [row["rate"] for row in sweep["configs"][names[0]]["rows"]]
    head = "| rate (req/s) | " + " | ".join(
        f"{n}: attainment / goodput / p90 TTFT / p90 TPOT" for n in names
    )
    rows = [head + " |", "|---|" + "---|" * len(names)]
    for i, rate in enumerate(rates):
        cells = []
        for n in names:
            r = sweep["configs"][n]["rows"][i]
            cells.append(
                f"{100 * r['attainment']:.0f}% / {r['request_goodput']:.2f} / "
                f"{r['p90_ttft_ms']:.0f} ms / {r['p90_tpot_ms']:.1f} ms"
            )
        rows.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    rows.append(
        "| **max rate at >= 90%** | "
        + " | ".join(
            f"**{sweep['configs'][n]['max_rate']:.2f} req/s** ({sweep['configs'][n]['max_rate_how']})"
            for n in names
        )
        + " |"
    )
    return "\n".join(rows)


def throughput_table(tp: dict[str, Any]) -> str:
    return "\n".join(
        [
            "| engine | output tok/s | ratio | greedy tokens equal |",
            "|---|---|---|---|",
            f"| tandem `LLM.generate` (continuous batching) | {tp['tandem_tok_s']:.1f} "
            f"| {tp['ratio']:.2f}x | {'yes' if tp['spot_check_passed'] else 'NO'} |",
            f"| transformers `generate`, static batches of {tp['workload']['hf_batch']} "
            f"| {tp['hf_tok_s']:.1f} | 1x | |",
        ]
    )


def replace_section(doc: Path, body: str) -> None:
    """Puts `body` between the scenario markers of `doc` (appended with them when absent)."""
    text = doc.read_text() if doc.exists() else ""
    block = f"{BEGIN}\n{body.rstrip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
