"""`tandem generate`: offline generation with `tandem.LLM` on a local checkpoint."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

DEFAULT_PROMPTS = [
    "The quick brown fox",
    "Prefill and decode run on different workers because",
    "A paged KV cache stores",
]


def generate(
    model: Annotated[Path, typer.Option(help="Local Hugging Face checkpoint directory.")],
    prompt: Annotated[
        list[str] | None,
        typer.Option(
            "--prompt", "-p", help="A prompt (repeat for several). Default: three demo prompts."
        ),
    ] = None,
    prompts_file: Annotated[
        Path | None,
        typer.Option(
            "--prompts-file",
            help="A text file of prompts, one per line (blank lines skipped; '-' reads stdin). "
            "Its prompts come after any --prompt.",
        ),
    ] = None,
    chat: Annotated[
        bool, typer.Option(help="Wrap each prompt as a user message in the chat template.")
    ] = False,
    max_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt.")] = 32,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 (or -1) = disabled.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Per-request sampling seed.")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating past EOS.")] = False,
    dtype: Annotated[
        str, typer.Option(help="auto (the checkpoint's) | float32 | bfloat16 | float16.")
    ] = "auto",
    device: Annotated[
        str, typer.Option(help="auto (CUDA when available) | cpu | cuda | cuda:N.")
    ] = "auto",
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV block.")] = 16,
    num_kv_blocks: Annotated[
        int | None,
        typer.Option(min=1, help="KV pool size in blocks (default: sized from memory)."),
    ] = None,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="Token budget per step.")
    ] = 2048,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Max running requests.")] = 256,
    max_model_len: Annotated[
        int | None, typer.Option(min=2, help="Context length (default: the model's).")
    ] = None,
    prefix_caching: Annotated[
        bool, typer.Option(help="Reuse KV of shared prompt prefixes.")
    ] = True,
    threads: Annotated[
        int | None, typer.Option(min=1, help="torch CPU threads (default: torch's choice).")
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="A tokenizer directory to use instead of the checkpoint's own."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object per prompt.")
    ] = False,
) -> None:
    """Generate completions for prompts with the paged engine (no cluster needed)."""
    import torch
    from pydantic import ValidationError

    from tandem import LLM, SamplingParams
    from tandem.engine.errors import TandemError, summarize_validation

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if threads:
        torch.set_num_threads(threads)
    try:
        texts = [*(prompt or []), *read_prompts(prompts_file)] or DEFAULT_PROMPTS
        params = SamplingParams(  # (checked before the model loads)
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
        )
        llm = LLM(
            model=str(model),
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=prefix_caching,
            tokenizer=str(tokenizer) if tokenizer else None,
        )
        if chat and not llm.engine.tokenizer.hf.chat_template:
            raise ValueError(f"{model} has no chat template (its tokenizer's): drop --chat")
        start = time.perf_counter()
        if chat:
            conversations = [[{"role": "user", "content": t}] for t in texts]
            outputs = llm.chat(conversations, params, use_tqdm=True)
        else:
            outputs = llm.generate(texts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    except ValidationError as exc:
        typer.echo(f"Error: {summarize_validation(exc)}", err=True)
        raise typer.Exit(code=2) from None
    except (TandemError, ValueError, OSError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    for text, out in zip(texts, outputs, strict=True):
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        "prompt": text,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                    }
                )
            )
        else:
            typer.echo(
                f"--- prompt: {text!r}\n{out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]"
            )
    total = sum(len(o.token_ids) for o in outputs)
    typer.echo(
        f"generated {total} tokens for {len(outputs)} prompts in {elapsed:.2f}s ({total / elapsed:.1f} tok/s)",
        err=True,
    )


def read_prompts(path: Path | None) -> list[str]:
    """The prompts of a `--prompts-file`: one per non-blank line, without its line break
    ('-': standard input). An unreadable file is an `OSError`; one with no prompt a
    `ValueError` (both end the command with one line)."""
    if path is None:
        return []
    if str(path) == "-":
        text = sys.stdin.read()
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"--prompts-file {path} is not UTF-8 text") from None
        except OSError as exc:
            raise OSError(f"cannot read --prompts-file {path}: {exc.strerror or exc}") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts-file {path} has no prompt (no non-blank line)")
    return prompts
