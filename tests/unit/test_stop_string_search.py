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


def test_text_kept_with_its_stop_string_streams_as_it_comes() -> None:
    """vLLM holds text back (what could start a stop string) only where the stop string is cut
    out; kept in the output (`include_stop_str_in_output`), the text streams at once, never
    past the stop string's end."""
    stops = ["XYZ"]
    for keep, streamed in ((False, ["", "a", "abcd", "abcdef"]), (True, ["ab", "abc", "abcdef", "abcdefXYZ"])):  # fmt: skip
        out = OutputText(_TextPerToken(["ab", "c", "def", "XYZxyz"]))  # type: ignore[arg-type]
        sent = []
        for token in range(4):
            out.add(token)
            stop = out.find_stop(stops, keep=keep)
            done = stop is not None
            sent.append(out.delta(stops, finished=done, cut=done, keep=keep))
        assert ["".join(sent[: i + 1]) for i in range(4)] == streamed, keep
