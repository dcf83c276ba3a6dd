"""Options of `vllm bench serve` that `tandem bench serve` takes as well, so that a vLLM
benchmark command line runs as it is: each means what it means to vLLM, or is refused with why."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from tandem.deploy.vllm_arg_forms import dashed, repeat_values, rewriting

BACKENDS = ("openai", "vllm")  # (both: streamed /v1/completions with usage, as vLLM sends)

Backend = Annotated[
    str,
    typer.Option(help="openai or vllm: both stream /v1/completions (vLLM's completions backends)."),
]
Host = Annotated[
    str | None, typer.Option(help="Server host, with --port, when --base-url is not given.")
]
Port = Annotated[int | None, typer.Option(min=1, max=65535, help="Server port (default 8000).")]
NumWarmups = Annotated[
    int,
    typer.Option(min=0, help="Requests of the first prompt sent before the run, not counted."),
]
ServedModelName = Annotated[
    str | None,
    typer.Option(
        help="Model name the requests carry, when --model names the tokenizer's checkpoint."
    ),
]
TopP = Annotated[float | None, typer.Option(help="Sent as the requests' top_p.")]
TopK = Annotated[int | None, typer.Option(help="Sent as the requests' top_k.")]
MinP = Annotated[float | None, typer.Option(help="Sent as the requests' min_p.")]
Label = Annotated[
    str | None, typer.Option(help="The result file's name prefix (default: the backend).")
]
Metadata = Annotated[
    list[str] | None,
    typer.Option(help="KEY=VALUE pairs added to the saved result: --metadata a=1 b=2."),
]
TrustRemoteCode = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        show_default=False,
        help="Taken for vLLM command lines: tokenizers load without running a checkpoint's code.",
    ),
]


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise typer.BadParameter(
            f"{backend!r}: tandem bench serve streams /v1/completions ({' or '.join(BACKENDS)})",
            param_hint="--backend",
        )


def server_root(base_url: str | None, host: str | None, port: int | None) -> str:
    """--base-url (over --host / --port, as vLLM takes them), else http://HOST:PORT (vLLM's
    defaults 127.0.0.1 and 8000)."""
    if base_url is not None:
        if host is not None or port is not None:
            typer.echo(f"[bench] --host / --port ignored: --base-url {base_url} given", err=True)
        return base_url
    host = (host or "127.0.0.1").strip("[]")
    return f"http://{f'[{host}]' if ':' in host else host}:{port or 8000}"


def sampling_fields(**given: Any) -> dict[str, Any]:
    """The request fields given (None: the server's default)."""
    return {name: value for name, value in given.items() if value is not None}


def metadata_fields(pairs: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in (item for text in pairs or [] for item in text.split()):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--metadata")
        out[key.strip()] = value.strip()
    return out


SAVE_RESULT = "--save-result"
NARGS = ("--metadata", "--goodput")  # (vLLM's options with several values after one flag)


def vllm_forms(args: list[str]) -> list[str]:
    """`args` in forms typer reads: vLLM's `--save-result` flag (the last argument, or another
    option next) given an empty value, `--save-result=` (the file the other options name;
    followed by a path, as tandem also takes it, it is left as it is); vLLM's `--metadata a=1
    b=2` and `--goodput ttft:50 tpot:10` (several values) as the option repeated."""
    out: list[str] = []
    for i, arg in enumerate(args):
        following = args[i + 1] if i + 1 < len(args) else None
        alone = following is None or following.startswith("-")
        out.append(f"{SAVE_RESULT}=" if dashed(arg) == SAVE_RESULT and alone else arg)
    return repeat_values(out, NARGS)


VllmForms = rewriting(vllm_forms)
"""`tandem bench serve`'s command class: it reads vLLM's forms (`vllm_forms`)."""
