"""The ``tandem`` command line (entry point ``tandem = "tandem.deploy.cli:app"``).

Subcommands register on `app` with ``@app.command()``; the app callback keeps ``tandem
<subcommand>`` working even while there is a single subcommand.
"""

from __future__ import annotations

import enum
import time
from pathlib import Path
from typing import Annotated

import typer

from tandem.bench.serving.cli import bench_app
from tandem.deploy.generate_cmd import generate
from tandem.deploy.serve_cmd import serve
from tandem.deploy.serve_vllm_flags import ServeForms
from tandem.deploy.vllm_arg_forms import UNDERSCORES

app = typer.Typer(
    name="tandem",
    help="tandem: disaggregated prefill/decode LLM serving on Ray.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain help: paragraphs reflowed, option names never cut at 80 columns
    context_settings={"help_option_names": ["-h", "--help"], **UNDERSCORES},
)


def _print_version(value: bool) -> None:
    if value:
        from tandem import __version__

        typer.echo(f"tandem {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """tandem: disaggregated prefill/decode LLM serving on Ray."""


class Arch(enum.StrEnum):
    """Architectures `tiny-model` can write."""

    llama = "llama"
    qwen2 = "qwen2"
    qwen3 = "qwen3"
    mistral = "mistral"


class DType(enum.StrEnum):
    """Weight dtypes `tiny-model` can write."""

    float32 = "float32"
    bfloat16 = "bfloat16"


@app.command("tiny-model")
def tiny_model(
    out_dir: Annotated[
        Path, typer.Argument(help="Directory to write the checkpoint into (created if missing).")
    ],
    arch: Annotated[Arch, typer.Option(help="Model architecture (config + *ForCausalLM).")] = (
        Arch.llama
    ),
    layers: Annotated[int, typer.Option(min=1, help="Number of decoder layers.")] = 2,
    hidden: Annotated[int, typer.Option(min=1, help="Hidden size.")] = 64,
    heads: Annotated[int, typer.Option(min=1, help="Attention (query) heads.")] = 4,
    kv_heads: Annotated[
        int, typer.Option(min=1, help="Key/value heads (GQA); must divide --heads.")
    ] = 2,
    head_dim: Annotated[
        int | None, typer.Option(min=2, help="Per-head dimension (default: hidden / heads).")
    ] = None,
    vocab: Annotated[
        int,
        typer.Option(
            min=259,
            help="Model vocab size; the tokenizer gets min(vocab, what BPE training yields).",
        ),
    ] = 512,
    intermediate: Annotated[
        int | None, typer.Option(min=1, help="MLP intermediate size (default: 2 * hidden).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    tie_embeddings: Annotated[
        bool, typer.Option(help="Tie lm_head to the input embeddings.")
    ] = False,
    max_position: Annotated[int, typer.Option(min=1, help="max_position_embeddings.")] = 2048,
    dtype: Annotated[DType, typer.Option(help="Weight dtype.")] = DType.float32,
    rope_theta: Annotated[float, typer.Option(help="Rotary base (rope_parameters.rope_theta).")] = (
        10000.0
    ),
    init_std: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Std of the random weights; larger than HF's 0.02 so greedy argmax ties are rare.",
        ),
    ] = 0.1,
    force: Annotated[
        bool, typer.Option("--force", help="Write even if OUT_DIR exists and is not empty.")
    ] = False,
) -> None:
    """Write a tiny random Hugging Face checkpoint (weights, config, tokenizer) to OUT_DIR.

    Deterministic for a given seed; loads offline with AutoModelForCausalLM / AutoTokenizer.

    With --force, files of the same names are overwritten; other files are left alone.
    """
    from tandem.deploy.tiny_model import build_tiny_checkpoint

    if rope_theta <= 0:
        raise typer.BadParameter(f"must be > 0, got {rope_theta}", param_hint="--rope-theta")
    if out_dir.exists() and not out_dir.is_dir():
        raise typer.BadParameter(f"{out_dir} exists and is not a directory", param_hint="OUT_DIR")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise typer.BadParameter(
            f"{out_dir} is not empty; pass --force to overwrite", param_hint="OUT_DIR"
        )
    start = time.perf_counter()
    try:
        path = build_tiny_checkpoint(
            out_dir,
            arch=arch.value,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=vocab,
            intermediate=intermediate,
            seed=seed,
            tie_embeddings=tie_embeddings,
            max_position=max_position,
            dtype=dtype.value,
            rope_theta=rope_theta,
            init_std=init_std,
        )
    except (ValueError, OSError) as exc:  # (e.g. a directory that cannot be made there)
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    files = ", ".join(sorted(p.name for p in path.iterdir() if p.is_file()))
    typer.echo(
        f"wrote tiny {arch.value} checkpoint (layers={layers}, hidden={hidden}, heads={heads}, "
        f"kv_heads={kv_heads}, vocab={vocab}, seed={seed}, dtype={dtype.value}) to {path} "
        f"in {time.perf_counter() - start:.1f}s: {files}"
    )


app.command("generate")(generate)
app.command("serve", cls=ServeForms)(serve)
app.add_typer(bench_app, name="bench")


if __name__ == "__main__":  # pragma: no cover
    app()
