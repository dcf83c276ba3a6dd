"""The repository root is on ``sys.path`` whenever Python starts there (``python -m``, pytest,
Ray workers of a driver started from the checkout). Its folders are also ``tandem``'s parts
(``tandem/<part> -> ../<part>``), so none of them may hide an installed module of the same
name: transformers 5.25 imports Hugging Face's ``kernels`` and broke on ``kernels/``."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = sorted(p.name for p in (ROOT / "tandem").iterdir() if p.is_symlink() and p.is_dir())


def test_every_part_of_tandem_is_a_folder_at_the_root() -> None:
    assert "kernels" in PARTS and "router" in PARTS
    for part in PARTS:
        assert (ROOT / "tandem" / part).resolve() == ROOT / part


def test_no_part_that_is_a_regular_package_shares_a_name_with_an_installed_module() -> None:
    elsewhere = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != ROOT]
    clashes = {}
    for part in PARTS:
        if not (ROOT / part / "__init__.py").exists():
            continue  # a namespace portion: a regular package of that name elsewhere wins
        spec = importlib.machinery.PathFinder.find_spec(part, elsewhere)
        if spec is not None:
            clashes[part] = spec.origin or list(spec.submodule_search_locations or [])
    assert clashes == {}


def test_kernels_from_the_root_is_hugging_faces_and_transformers_loads() -> None:
    """``python -c`` puts the current folder first on ``sys.path``, as ``python -m`` does."""
    code = "import kernels, transformers; transformers.LlamaConfig(); print(kernels.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert not Path(out.stdout.strip()).resolve().is_relative_to(ROOT / "kernels")
