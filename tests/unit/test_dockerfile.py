"""deploy/Dockerfile, without a Docker engine: its structure, and its install steps run by `sh`
with a stand-in `pip` that records what it was asked to install."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / "Dockerfile.dockerignore"

Instruction = tuple[str, str]


def instructions(text: str) -> list[Instruction]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + "\n"
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def stages(parsed: list[Instruction]) -> list[list[Instruction]]:
    found: list[list[Instruction]] = []
    for ins in parsed:
        if ins[0] == "FROM":
            found.append([])
        if found:
            found[-1].append(ins)
    return found


PARSED = instructions(DOCKERFILE.read_text())
BUILD, RUNTIME = stages(PARSED)


def _run_index(stage: list[Instruction], needle: str) -> int:
    (index,) = [i for i, (word, args) in enumerate(stage) if word == "RUN" and needle in args]
    return index


def test_two_stages_from_one_python_base() -> None:
    assert PARSED[0] == ("ARG", "PYTHON_VERSION=3.11")
    assert BUILD[0] == ("FROM", "python:${PYTHON_VERSION}-slim-bookworm AS build")
    assert RUNTIME[0] == ("FROM", "python:${PYTHON_VERSION}-slim-bookworm")
    assert ("ARG", "VARIANT=cpu") in BUILD
    assert ("ARG", "TORCH_VERSION=2.13.0") in BUILD


INSTALL = 'pip install -c "$pins" ".'


def test_torch_is_installed_before_tandem() -> None:
    torch = _run_index(BUILD, "torch==${TORCH_VERSION}")
    tandem = _run_index(BUILD, INSTALL)
    copies = [i for i, (word, args) in enumerate(BUILD) if word == "COPY"]
    (pins,) = [i for i in copies if "constraints" in BUILD[i][1]]
    sources = [i for i in copies if i != pins]
    # Source changes do not invalidate the torch layer; the versions both installs take do.
    assert pins < torch < min(sources) < tandem


def test_both_installs_take_the_pinned_versions() -> None:
    (copied,) = [args for word, args in BUILD if word == "COPY" and "constraints" in args]
    assert copied == "scripts/constraints.txt deploy/constraints-cuda.txt constraints/"
    for path in copied.split()[:-1]:
        assert (REPO / path).is_file()


def test_every_package_folder_is_copied_and_in_the_build_context() -> None:
    linked = {p.name for p in (REPO / "tandem").iterdir() if p.is_symlink()}
    sources = {
        src.rstrip("/") for word, args in BUILD if word == "COPY" for src in args.split()[:-1]
    }
    assert linked | {"tandem", "pyproject.toml", "README.md"} <= sources
    allowed = {line[1:] for line in DOCKERIGNORE.read_text().splitlines() if line[:1] == "!"}
    for source in sources:  # (in the context: itself, or a folder above it, is let in)
        parts = Path(source).parts
        assert any("/".join(parts[:n]) in allowed for n in range(1, len(parts) + 1)), source


def test_runtime_stage_is_lean_and_not_root() -> None:
    assert ("COPY", "--from=build /opt/tandem /opt/tandem") in RUNTIME
    (user,) = [args for word, args in RUNTIME if word == "USER"]
    assert not user.startswith(("0", "root"))
    text = DOCKERFILE.read_text()
    assert not re.search(r"\[.*dev.*\]|pip install -e|COPY tests", text)


def _install(tmp_path: Path, variant: str, extras: str = "") -> tuple[int, list[str]]:
    """Runs the build stage's two pip steps under `sh` with a recording `pip`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "pip.log"
    log.write_text("")
    fake = bin_dir / "pip"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    steps = [BUILD[_run_index(BUILD, "torch==")][1], BUILD[_run_index(BUILD, INSTALL)][1]]
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "VARIANT": variant,
        "TORCH_VERSION": "2.13.0",
        "EXTRAS": extras,
    }
    done = subprocess.run(["sh", "-ec", "\n".join(steps)], env=env, capture_output=True)
    return done.returncode, log.read_text().splitlines()


CPU_TORCH = "install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
CUDA_TORCH = "install torch==2.13.0 -c constraints/constraints-cuda.txt"
CPU_PINS, CUDA_PINS = (
    "install -c constraints/constraints.txt",
    "install -c constraints/constraints-cuda.txt",
)


@pytest.mark.parametrize(
    ("variant", "extras", "want"),
    [
        ("cpu", "", [CPU_TORCH, f"{CPU_PINS} ."]),
        ("cuda", "", [CUDA_TORCH, f"{CUDA_PINS} .[gpu]"]),
        ("cuda", "ucx", [CUDA_TORCH, f"{CUDA_PINS} .[gpu,ucx-cu13]"]),
        ("cuda", "bench,ucx", [CUDA_TORCH, f"{CUDA_PINS} .[gpu,bench,ucx-cu13]"]),
        ("cuda", "ucx-cu13", [CUDA_TORCH, f"{CUDA_PINS} .[gpu,ucx-cu13]"]),
        ("cpu", "ucx", [CPU_TORCH, f"{CPU_PINS} .[ucx]"]),
    ],
)  # fmt: skip
def test_variants_install_the_right_torch_and_extras(
    tmp_path: Path, variant: str, extras: str, want: list[str]
) -> None:
    assert _install(tmp_path, variant, extras) == (0, want)


def test_an_unknown_variant_stops_the_build(tmp_path: Path) -> None:
    code, calls = _install(tmp_path, "rocm")
    assert code != 0 and calls == []
