"""The incremental detokenizer on SentencePiece's byte fallback (Llama 2, Mistral v0.x): a run
of byte tokens (`<0xF0><0x9F><0x99><0x82>`) decodes as one, so its text is held until the run
ends, and the window is never cut inside a character; the streamed text is the decode of the
whole output, valid or not."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tandem.engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from tandem.engine.output_text import OutputText
from tandem.engine.tokenizer import Tokenizer
from tests.unit.test_sentencepiece_tokenizer import _sentencepiece_checkpoint

TEXTS = ["🙂🙂🙂🙂🙂🙂 ok", "日本語のテキストです。これは長い文章です。", "😀😃😄😁😆😅 the model"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(_sentencepiece_checkpoint(tmp_path_factory.mktemp("sp")))


def _streamed(tok: Tokenizer, prompt: Sequence[int], ids: Sequence[int], skip: bool) -> str:
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return "".join(det.step([i]) for i in ids) + det.flush()


def _in_context(tok: Tokenizer, prompt: Sequence[int], ids: Sequence[int], skip: bool) -> str:
    """The output's text as it reads after the prompt's last tokens (the server's text)."""
    context = list(prompt[-CONTEXT_TOKENS:])
    before = tok.decode(context, skip)
    return tok.decode(context + list(ids), skip)[len(before) :]


@pytest.mark.parametrize("text", TEXTS)
def test_characters_written_in_byte_tokens_come_out_whole(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert sum(i in tok.byte_run_ids for i in ids) > 16  # (longer than the window)
    assert _streamed(tok, [], ids, True) == tok.decode(ids) == text
    prompt = tok.encode("hello world")
    assert _streamed(tok, prompt, ids, True) == _in_context(tok, prompt, ids, True) == " " + text


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_stream_the_text_of_the_whole_output(tok: Tokenizer, skip: bool) -> None:
    """Invalid runs (a U+FFFD per byte, decided at the run's end), runs across skipped special
    tokens, runs cut by the end: the text equals one decode of the output."""
    rng = random.Random(5)
    bytes_ = sorted(tok.byte_run_ids)
    prompt = tok.encode("hello world")
    for _ in range(60):
        ids = [
            rng.choice(bytes_) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randrange(1, 50))
        ]
        assert _streamed(tok, [], ids, skip) == tok.decode(ids, skip)
        assert _streamed(tok, prompt, ids, skip) == _in_context(tok, prompt, ids, skip)


def test_a_prompt_ending_in_byte_tokens_is_still_context(tok: Tokenizer) -> None:
    """ "\n" is a byte token here: the first output token after it keeps its leading space, as
    it reads after the prompt (vLLM's text), not as at the start of a text."""
    prompt = tok.encode("hello world\n")
    assert prompt[-1] in tok.byte_run_ids
    ids = tok.encode("the model", add_special_tokens=False)
    assert _streamed(tok, prompt, ids, True) == " the model"
    assert tok.decode(prompt + ids)[len(tok.decode(prompt)) :] == " the model"


def test_a_stop_string_ending_in_a_byte_token_stops_on_that_token(tok: Tokenizer) -> None:
    """The text of a run of byte tokens is held until the run ends, but a stop string is
    searched in it as soon as it is whole characters: the request stops on the token that
    completes the stop string, not on the next token that is not a byte token."""
    newline = tok.encode("a\n", add_special_tokens=False)[-1]
    assert newline in tok.byte_run_ids
    words = tok.encode("the model", add_special_tokens=False)
    for keep in (False, True):
        text = OutputText.after(tok, tok.encode("hello"))
        for token in words:
            text.add(token)
            assert text.find_stop(["\n"], keep=keep) is None
        text.add(newline)
        assert text.find_stop(["\n"], keep=keep) == "\n"
        assert text.text == " the model" + ("\n" if keep else "")
    text = OutputText.after(tok, tok.encode("hello"))
    for token in [*words, newline, newline]:
        text.add(token)
    # (a stop string not in the held run: nothing found, and the run is still held)
    assert text.find_stop(["x"]) is None and text.text == " the model"


def test_held_text_of_tokens_before_min_tokens_is_not_searched_later(tok: Tokenizer) -> None:
    """Stop strings count after the first `min_tokens` tokens: a "\n" written by the first
    token (a byte token, its text held until the next token) does not stop the request when
    the second token comes (vLLM searches only the text of the tokens after them)."""
    newline = tok.encode("a\n", add_special_tokens=False)[-1]
    word = tok.encode("the", add_special_tokens=False)[-1]
    text = OutputText.after(tok, tok.encode("hello"))
    text.add(newline)
    assert text.find_stop(["\n"], counting=False) is None
    text.add(word)
    assert text.find_stop(["\n"]) is None and text.text == "\n the"


def test_a_byte_run_begun_before_min_tokens_stays_searched(tok: Tokenizer) -> None:
    """A run still held over several counting tokens: its text written before `min_tokens`
    (here "é") was searched again once a counting check had moved the mark back to the text
    let out, and the request stopped on it."""
    ids = tok.encode("éè", add_special_tokens=False)
    assert len(ids) >= 4 and all(
        tok.hf.convert_ids_to_tokens(i).startswith("<0x") for i in ids[-4:]
    )
    text = OutputText.after(tok, tok.encode("hello"))
    found = []
    for n, token in enumerate(ids[-4:], start=1):  # <C3><A9> (é) <C3><A8> (è), one run
        text.add(token)
        found.append(text.find_stop(["é"], counting=n > 2))
    assert found == [None] * 4
