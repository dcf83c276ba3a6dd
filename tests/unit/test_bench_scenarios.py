"""The scenario helpers that need no cluster: the DistServe max rate, the docs section, plots."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.bench.scenarios.goodput_sweep import max_rate_meeting
from tandem.bench.scenarios.report import BEGIN, END, replace_section


def test_max_rate_interpolates_where_attainment_crosses_the_target() -> None:
    points = [(1.0, 1.0), (2.0, 0.95), (4.0, 0.75), (3.0, 0.85)]
    rate, how = max_rate_meeting(points, 0.9)
    assert rate == pytest.approx(2.5) and how == "interpolated"  # 0.95 -> 0.85 between 2 and 3
    top, how = max_rate_meeting([(1.0, 0.95), (2.0, 0.99)], 0.9)
    assert (top, how) == (2.0, "met at every measured rate (a lower bound)")
    assert max_rate_meeting([(1.0, 0.5), (2.0, 0.99)], 0.9)[0] == 0.0  # must hold from the start


def test_the_docs_section_is_replaced_in_place(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nearlier section\n")
    replace_section(doc, "first run")
    replace_section(doc, "second run")
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nearlier section\n")
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    assert "second run" in text and "first run" not in text
