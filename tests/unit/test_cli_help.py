"""`tandem ... --help` reads well in an 80-column terminal: every option's name whole, the
commands' paragraphs reflowed rather than broken where the docstring's lines end."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from tandem.deploy.cli import app

COMMANDS = (["serve"], ["generate"], ["tiny-model"], ["bench", "serve"])


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_names_every_option_whole_at_80_columns(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output  # (rich's panels cut long option names at 80 columns)
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_serve_help_keeps_long_options_and_angle_brackets() -> None:
    text = CliRunner().invoke(app, ["serve", "--help"], terminal_width=80).output
    assert "--gpu-memory-utilization" in text
    assert "<think>...</think>" in text  # (markdown rendering would swallow it as HTML)
    assert "Bearer <key>" in text
    flat = re.sub(r"\s+", " ", text)
    assert "deploys a router, the prefill workers and the decode workers" in flat


def test_version_prints_the_package_version() -> None:
    from tandem import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert (result.exit_code, result.output) == (0, f"tandem {__version__}\n")
