"""`consecutive_runs`: the copies a message's pages take (one per run of consecutive ids on both
sides), with its one-run fast path."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.kv_transfer._socket_channel import consecutive_runs


@pytest.mark.parametrize(
    ("src", "dst", "runs"),
    [
        ([4, 5, 6], [10, 11, 12], [(4, 10, 3)]),
        (range(3, 7), range(4), [(3, 0, 4)]),
        ([4, 5, 6], range(3), [(4, 0, 3)]),
        ([7], [2], [(7, 2, 1)]),
        ([], [], []),
        ([4, 6, 6], [0, 1, 2], [(4, 0, 1), (6, 1, 1), (6, 2, 1)]),  # ends as a run's, a hole
        ([4, 5, 6], [0, 1, 3], [(4, 0, 2), (6, 3, 1)]),
        ([6, 5, 4], [0, 1, 2], [(6, 0, 1), (5, 1, 1), (4, 2, 1)]),
        ([1, 2, 3, 9, 10], [5, 6, 7, 0, 1], [(1, 5, 3), (9, 0, 2)]),
        (list(np.arange(2, 5)), [0, 1, 2], [(2, 0, 3)]),  # numpy ints: the loop
    ],
)
def test_runs(src: list[int], dst: list[int], runs: list[tuple[int, int, int]]) -> None:
    assert consecutive_runs(src, dst) == runs


def test_lists_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        consecutive_runs([1, 2, 3], [1, 2])
