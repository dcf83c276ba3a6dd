"""`scripts/constraints.txt` (the versions the set-up installs) and `deploy/constraints-cuda.txt`
(those of the CUDA image) agree with pyproject.toml: every direct dependency is pinned there, to
a version its range allows, and torch is left to its own pin. A range moved in pyproject without
the constraints would fail the install, or pin nothing."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "scripts" / "constraints.txt"
CUDA_CONSTRAINTS = REPO / "deploy" / "constraints-cuda.txt"


def pinned(path: Path = CONSTRAINTS) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert match, f"not a plain pin: {line!r}"
        name = canonicalize_name(match.group(1))
        assert name not in pins, f"{name} pinned twice"
        pins[name] = match.group(2)
    return pins


def direct_requirements(
    extras: tuple[str, ...] = ("dev", "ucx", "gpu", "bench"),
) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if r.marker is None or r.marker.evaluate()]


@pytest.mark.parametrize(
    ("path", "extras"),
    [(CONSTRAINTS, ("dev", "ucx", "gpu", "bench")), (CUDA_CONSTRAINTS, ("gpu", "ucx-cu13"))],
    ids=["set-up", "cuda-image"],
)
def test_every_direct_dependency_is_pinned_within_its_range(
    path: Path, extras: tuple[str, ...]
) -> None:
    pins = pinned(path)
    for requirement in direct_requirements(extras):
        name = canonicalize_name(requirement.name)
        if name == "torch":
            assert name not in pins, "torch has its own pin (torch==2.13.0, installed first)"
            continue
        assert name in pins, f"{requirement} is not pinned in {path.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} is outside pyproject's {requirement}"
        )


def test_the_set_up_installs_with_the_constraints() -> None:
    setup = (REPO / "scripts" / "setup_env.sh").read_text()
    assert "-c scripts/constraints.txt -e '.[dev]'" in setup
    assert "scripts/constraints.txt" in setup.split("sha256sum")[0]  # a change re-installs


def test_the_cuda_image_pins_agree_with_the_set_up_where_torch_does_not_decide() -> None:
    """Built from scripts/constraints.txt (scripts/freeze_cuda_constraints.sh): what both
    install is the same version, but for torch's CUDA companions (triton, the CUDA and UCX
    libraries, which the CUDA wheel of torch chooses)."""
    cpu, cuda = pinned(), pinned(CUDA_CONSTRAINTS)
    torch_decides = (
        "triton",
        "cuda-",
        "nvidia-",
        "ucxx-",
        "libucxx-",
        "libucx-",
        "rmm-",
        "librmm-",
    )
    differ = {
        name: (cpu[name], cuda[name])
        for name in cpu.keys() & cuda.keys()
        if cpu[name] != cuda[name] and not name.startswith(torch_decides)
    }
    assert differ == {}
    assert "ucxx-cu13" in cuda and "ucxx-cu12" not in cuda
    assert cuda["cuda-bindings"].startswith("13.")  # (torch 2.13's CUDA wheel needs 13)
