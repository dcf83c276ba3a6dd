"""PNG plots of the scenario results (matplotlib, the `bench` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values_s: list[float], label: str, **style: Any) -> None:
    ms = sorted(v * 1000 for v in values_s)
    if ms:
        ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post", label=label, **style)


def latency_cdfs(mixed: dict[str, Any], path: Path) -> Path:
    """Short-request TTFT (mixed load, and no load dashed) and pooled ITL, one line per config."""
    plt = _pyplot()
    fig, (ttft_ax, itl_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, res) in enumerate(mixed["configs"].items()):
        color = f"C{i}"
        _cdf(ttft_ax, res["short_ttfts_s"], name, color=color)
        _cdf(ttft_ax, res["no_load_ttfts_s"], f"{name} (no load)", color=color, linestyle="--")
        _cdf(itl_ax, res["itls_s"], name, color=color)
    ttft_ax.set(title="Short requests: TTFT CDF", xlabel="TTFT (ms)", ylabel="fraction")
    itl_ax.set(title="All requests: ITL CDF (gaps between chunks)", xlabel="ITL (ms)")
    itl_ax.set_xscale("log")
    ttft_ax.legend(fontsize=7)
    itl_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def goodput_vs_rate(sweep: dict[str, Any], path: Path) -> Path:
    """SLO attainment and request_goodput against the request rate, one line per config."""
    plt = _pyplot()
    fig, (att_ax, good_ax) = plt.subplots(1, 2, figsize=(11, 4))
    target = sweep["settings"]["attainment_target"]
    for name, res in sweep["configs"].items():
        rates = [r["rate"] for r in res["rows"]]
        att_ax.plot(rates, [100 * r["attainment"] for r in res["rows"]], marker="o", label=name)
        good_ax.plot(rates, [r["request_goodput"] for r in res["rows"]], marker="o", label=name)
    att_ax.axhline(100 * target, color="grey", linestyle=":", label=f"{target:.0%} target")
    good_ax.plot(rates, rates, color="grey", linestyle=":", label="offered rate")
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in sweep["settings"]["slos_ms"].items())
    att_ax.set(title=f"SLO attainment ({slos})", xlabel="request rate (req/s)", ylabel="%")
    good_ax.set(title="request_goodput", xlabel="request rate (req/s)", ylabel="good req/s")
    att_ax.legend(fontsize=8)
    good_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
