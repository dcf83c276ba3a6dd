"""A request's output text as it grows token by token (for stop strings and streaming)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tandem.engine.sampling_params import SamplingParams


class OutputText:
    """Finalized text so far, plus how much of it was searched for stops and streamed."""

    __slots__ = ("detokenizer", "text", "checked_len", "emitted_len")

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self.detokenizer = detokenizer
        self.text = ""
        self.checked_len = 0
        self.emitted_len = 0

    @classmethod
    def after(
        cls,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int] = (),
        *,
        params: SamplingParams | None = None,
    ) -> OutputText:
        """The text of `token_ids` generated after the prompt (nothing streamed yet), written
        as `params` ask (None: the defaults): special tokens (EOS, chat markers) write nothing
        unless `skip_special_tokens` is False, then with spaces between them unless
        `spaces_between_special_tokens` is False too."""
        detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens if params is not None else True,
            spaces_between_special_tokens=(
                params.spaces_between_special_tokens if params is not None else True
            ),
        )
        text = cls(detokenizer)
        for token in token_ids:
            text.add(token)
        return text

    def add(self, token_id: int) -> None:
        self.text += self.detokenizer.step([token_id])

    def flush(self) -> None:
        self.text += self.detokenizer.flush()

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]
        self.emitted_len = min(self.emitted_len, length)

    def find_stop(
        self, stops: Sequence[str], *, counting: bool = True, keep: bool = False
    ) -> str | None:
        """The first of `stops` (in list order, as vLLM's) that ends in the text not searched
        yet (it may start in the searched text); the text is cut just before it (`keep`: just
        after it).
        Not `counting` (before `min_tokens` are out): the text so far is marked searched, so
        a stop string written there does not count later either."""
        if not counting:  # (held text too: it is written by the tokens before `min_tokens`)
            self.checked_len = len(self.text) + len(self.detokenizer.peek())
            return None
        # (with the text the detokenizer holds back where it is whole characters already: a
        # stop string that ends in a run of byte tokens is found on the token that ends it)
        held = self.detokenizer.peek()
        text = self.text + held
        best: tuple[int, str] | None = None
        for stop in stops:  # (each must end in the new text: vLLM's window, per stop string)
            idx = text.find(stop, max(0, self.checked_len - len(stop) + 1))
            if idx != -1:  # (the first in list order, as vLLM's, where two end in one step)
                best = (idx, stop)
                break
        # (not back before held text a check before `min_tokens` marked searched)
        self.checked_len = max(self.checked_len, len(self.text))
        if best is None:
            return None
        if held and best[0] + len(best[1]) > len(self.text):
            self.flush()  # (the request ends here: so does the run, and its text is `held`)
        self.truncate(best[0] + (len(best[1]) if keep else 0))
        return best[1]

    def delta(
        self, stops: Sequence[str] | None, *, finished: bool, cut: bool = False, keep: bool = False
    ) -> str:
        """Text not streamed yet, holding back what could start one of `stops` unless
        `finished` or the stop string is to be `keep`t in the output (what is sent then is
        never past one's end: stops are looked for first, as vLLM's); marks it streamed. A
        finished text not `cut` at a stop string first takes the detokenizer's pending bytes."""
        if finished and not cut:
            self.flush()
        hold = max(len(s) for s in stops) - 1 if stops and not (finished or keep) else 0
        end = max(self.emitted_len, len(self.text) - hold)
        out = self.text[self.emitted_len : end]
        self.emitted_len = end
        return out
