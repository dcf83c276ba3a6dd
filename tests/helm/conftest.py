"""Renders the chart once per values file for the whole session (Helm fetched on first use)."""

from __future__ import annotations

import pytest

from tests.helm.chart import Manifest, ci_values_files, render, serve_config
from tests.helm.semantics import ServeDeployment, build_deployments


@pytest.fixture(scope="session")
def renders() -> dict[str, list[Manifest]]:
    """Render name ("default", or a ci values file's name without -values.yaml) -> manifests."""
    return {name: render(path) for name, path in ci_values_files().items()}


@pytest.fixture(scope="session")
def deployments(renders: dict[str, list[Manifest]]) -> dict[str, list[ServeDeployment]]:
    """Render name -> the Serve deployments tandem's app builder makes of its serveConfigV2."""
    return {name: build_deployments(serve_config(m)) for name, m in renders.items()}
