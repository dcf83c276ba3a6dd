"""Where `OutputText.find_stop` looks for stop strings, token by token (vLLM's
`check_stop_strings`): each stop string must end in the text not searched yet, and the first of
the list found there wins."""

from __future__ import annotations

from tandem.engine.output_text import OutputText


class _TextPerToken:
    """A detokenizer whose token i writes `pieces[i]`."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def step(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def peek(self) -> str:
        return ""

    def flush(self) -> str:
        return ""


def test_two_stop_strings_ending_in_one_step_the_first_listed_wins() -> None:
    """vLLM's order: the first stop string of the list found in the new text (it was the one
    that starts first in the text)."""
    for stops, text, reason in ((["b", "a"], "xa", "b"), (["a", "b"], "x", "a")):
        out = OutputText(_TextPerToken(["x", "ab"]))  # type: ignore[arg-type]
        out.add(0)
        assert out.find_stop(stops) is None
        out.add(1)
        assert (out.find_stop(stops), out.text) == (reason, text)
