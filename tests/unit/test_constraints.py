"""`scripts/constraints.txt` (the versions the set-up installs) agrees with pyproject.toml: every
direct dependency is pinned there, to a version its range allows, and torch is left to its own
pin. A range moved in pyproject without the constraints would fail the install, or pin nothing."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "scripts" / "constraints.txt"


def pinned() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert match, f"not a plain pin: {line!r}"
        name = canonicalize_name(match.group(1))
        assert name not in pins, f"{name} pinned twice"
        pins[name] = match.group(2)
    return pins


def direct_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in ("dev", "ucx", "gpu", "bench"):
        lines += project["optional-dependencies"][extra]
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if r.marker is None or r.marker.evaluate()]


def test_every_direct_dependency_is_pinned_within_its_range() -> None:
    pins = pinned()
    for requirement in direct_requirements():
        name = canonicalize_name(requirement.name)
        if name == "torch":
            assert name not in pins, "torch has its own pin (torch==2.13.0, installed first)"
            continue
        assert name in pins, f"{requirement} is not pinned in {CONSTRAINTS.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} is outside pyproject's {requirement}"
        )


def test_the_set_up_installs_with_the_constraints() -> None:
    setup = (REPO / "scripts" / "setup_env.sh").read_text()
    assert "-c scripts/constraints.txt -e '.[dev]'" in setup
    assert "scripts/constraints.txt" in setup.split("sha256sum")[0]  # a change re-installs
