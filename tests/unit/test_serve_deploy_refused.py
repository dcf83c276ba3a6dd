"""A deploy Serve refuses on a joined cluster (another application serves the route prefix
"/": a second `tandem serve` with another app_name) ends in one line, not a traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from tandem.deploy.cli import app


def test_a_deploy_serve_refuses_is_said_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[..., Path]
) -> None:
    import ray.serve
    from ray.serve.exceptions import RayServeException

    import tandem.deploy.app_builder as app_builder
    import tandem.deploy.serve_cmd as serve_cmd

    def refused(*args: Any, **kwargs: Any) -> None:
        raise RayServeException(
            'Prefix / is being used by application "tandem". Failed to deploy application '
            '"tandem2".'
        )

    stopped: list[tuple[Any, ...]] = []
    monkeypatch.setattr(app_builder, "build_app", lambda cfg: object())
    joined = (SimpleNamespace(address_info={"gcs_address": "10.0.0.1:6379"}), False)
    monkeypatch.setattr(serve_cmd, "start_ray", lambda *args, **kwargs: joined)
    for name in ("refuse_running_app", "warn_if_short", "fail_if"):
        monkeypatch.setattr(serve_cmd, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(serve_cmd, "_on_serves_port", lambda cfg: cfg)
    monkeypatch.setattr(serve_cmd, "shutdown", lambda *args, **kwargs: stopped.append(args))
    monkeypatch.setattr(serve_cmd.signal, "signal", lambda *args: None)
    monkeypatch.setattr(ray.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(ray.serve, "run", refused)
    model = str(tiny_checkpoint())
    res = CliRunner().invoke(app, ["serve", model, "--address", "10.0.0.1:6379"])
    assert res.exit_code == 1, res.output
    assert 'Error: Prefix / is being used by application "tandem"' in res.output
    assert "Traceback" not in res.output and stopped  # (what it started is stopped)
