"""Rendering the chart with a real Helm, and reading what it rendered.

Values files under `helm/tandem/ci/` may start with comment lines that steer the tests:
`# helm-args: ...` (extra `helm template` arguments, e.g. `--api-versions` for a CRD the chart
looks for) and, in `ci/negative/`, `# expect: ...` (a text the failing render must print).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.helm.helm_binary import REPO, helm_path

CHART = REPO / "helm" / "tandem"
CI_DIR = CHART / "ci"
NEGATIVE_DIR = CI_DIR / "negative"
RELEASE = "tandem"
DEFAULT = "default"  # the name of the render with the chart's own values

Manifest = dict[str, Any]


def ci_values_files() -> dict[str, Path | None]:
    """Render name -> values file: the chart's defaults, then every `ci/*-values.yaml`."""
    files: dict[str, Path | None] = {DEFAULT: None}
    for path in sorted(CI_DIR.glob("*-values.yaml")):
        files[path.name.removesuffix("-values.yaml")] = path
    return files


def negative_values_files() -> list[Path]:
    return sorted(NEGATIVE_DIR.glob("*.yaml"))


def header(path: Path, key: str) -> str:
    """The value of a leading `# key: value` comment line ("" when absent)."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        name, _, value = line.lstrip("# ").partition(":")
        if name.strip() == key:
            return value.strip()
    return ""


def run_helm(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Runs helm offline (HOME and Helm's dirs in .tandem, never the user's)."""
    home = REPO / ".tandem" / "helm-home"
    env = {
        **os.environ,
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    return subprocess.run(
        [str(helm_path()), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def template_args(values: Path | None, chart: Path = CHART) -> list[str]:
    args = ["template", RELEASE, str(chart)]
    if values is not None:
        args += ["-f", str(values), *shlex.split(header(values, "helm-args"))]
    return args


def render(values: Path | None) -> list[Manifest]:
    """`helm template` with the values file (None: defaults): the manifests, in order."""
    done = run_helm(*template_args(values))
    if done.returncode != 0:
        raise AssertionError(f"helm template {values} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def the(manifests: list[Manifest], kind: str) -> Manifest:
    (found,) = [m for m in manifests if m["kind"] == kind]
    return found


def serve_config(manifests: list[Manifest]) -> dict[str, Any]:
    """The RayService's serveConfigV2, parsed."""
    config = yaml.safe_load(the(manifests, "RayService")["spec"]["serveConfigV2"])
    assert isinstance(config, dict)
    return config


def ray_groups(manifests: list[Manifest]) -> dict[str, dict[str, Any]]:
    """The RayService's Ray groups by name: "head" and each worker group's `groupName`."""
    cluster = the(manifests, "RayService")["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]} | {
        g["groupName"]: g for g in cluster["workerGroupSpecs"]
    }


def app_args(manifests: list[Manifest]) -> dict[str, Any]:
    """The Serve application's `args` (the cluster config the chart rendered)."""
    args = serve_config(manifests)["applications"][0]["args"]
    assert isinstance(args, dict)
    return args
