"""A worker lost before the request sent its caller anything: the request starts over once,
under a new worker-side id, on a new plan. Lost after tokens went out (its decode worker died),
a request goes on from those tokens, once, with its text and stop strings handled in the router
across the seam and the tokens sent counted as its output on the new worker (`resumed_tokens`:
seeded draws, penalties); a structured output fails (its grammar's state died with the worker)
when it is streamed, and starts again from none when its caller gets the answer at its end; a
second loss fails (a worker that was draining and left when its drain ran out is not counted
as one, up to MAX_DRAINED_MOVES)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.router import worker_failures
from tandem.router.errors import WorkerLost
from tandem.router.prepared import Prepared
from tandem.router.request_timings import RequestTimings
from tandem.router.serving import Serving, run_to_end


class FakePlan(SimpleNamespace):
    released: bool = False

    def release(self) -> None:
        self.released = True


class FakePlanner:
    policy_name = "least_loaded"

    def __init__(self) -> None:
        self.plans: list[FakePlan] = []

    async def plan(self, *args: Any, **kwargs: Any) -> FakePlan:
        plan = FakePlan(prefill=None, decode=SimpleNamespace(worker_id="decode/b"),
                        decode_hit_blocks=0, grant=None)  # fmt: skip
        self.plans.append(plan)
        return plan


PROMPT = [1, 2, 3]
ANSWER = [7, 8, 9, 10, 11]
"""What the fake model generates after `PROMPT`, whatever part of it a prompt already holds."""


class FakeOrchestrator:
    """`generate` streams `ANSWER` one token per item, from where its prompt leaves off, and
    loses its worker on the calls listed in `lose` (by call number), before or after its first
    item ("drained": after, a worker that was draining)."""

    def __init__(self, lose: dict[int, str]) -> None:
        self.lose = lose
        self.generated: list[str] = []
        self.prompts: list[list[int]] = []
        self.params: list[dict[str, Any]] = []
        self.reserved: list[tuple[str, list[int]]] = []
        self.texts: dict[int, str] = {}  # a token's text other than ``<id>``

    async def reserve(self, plan: Any, request_id: str, prompt: list[int], *args: Any) -> None:
        self.reserved.append((request_id, list(prompt)))

    async def generate(
        self, request_id: str, prompt: list[int], params: dict[str, Any], *args: Any
    ) -> AsyncIterator[dict[str, Any]]:
        call = len(self.generated)
        self.generated.append(request_id)
        self.prompts.append(list(prompt))
        self.params.append(params)
        when = self.lose.get(call)
        if when == "before":
            raise WorkerLost("prefill/a", "connection to prefill/a lost", "prefill_failed")
        start, count = len(prompt) - len(PROMPT), params.get("max_tokens", 16)
        for i, token in enumerate(ANSWER[start : start + count]):
            last = i == count - 1
            yield {"token_ids": [token], "text": self.texts.get(token, f"<{token}>"),
                   "finish_reason": "length" if last else None}  # fmt: skip
            if when in ("after", "drained") and not last:
                raise WorkerLost("decode/b", "connection to decode/b lost", "decode_failed",
                                 drained=when == "drained")  # fmt: skip


class FakeTokenizer:
    """Token 300 is the first byte of a two-byte character that token 301 completes (the
    worker holds the text of 300 back); every other token is ``<id>``."""

    byte_run_ids: frozenset[int] = frozenset()  # (no SentencePiece byte fallback)
    special_ids: frozenset[int] = frozenset()

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, clean_up: bool = True
    ) -> str:
        out, i = "", 0
        while i < len(ids):
            if ids[i] == 300:
                out += "é" if i + 1 < len(ids) and ids[i + 1] == 301 else "\ufffd"
                i += 2 if i + 1 < len(ids) and ids[i + 1] == 301 else 1
                continue
            out += f"<{ids[i]}>"
            i += 1
        return out


def _serving(orchestrator: FakeOrchestrator) -> tuple[Serving, FakePlanner]:
    planner = FakePlanner()
    serving = Serving(orchestrator, planner, FakeTokenizer(), "tiny")  # type: ignore[arg-type]
    return serving, planner


def _prepared(planner: FakePlanner, params: SamplingParams | None = None) -> Prepared:
    plan = asyncio.run(planner.plan())
    return Prepared(
        "cmpl-1",
        list(PROMPT),
        params or SamplingParams(max_tokens=2),
        RequestTimings(),
        plan=plan,  # type: ignore[arg-type]
    )


async def _collect(serving: Serving, req: Prepared) -> list[list[int]]:
    return [item["token_ids"] async for item in serving.run(req)]


def test_a_worker_lost_before_the_first_token_starts_the_request_over() -> None:
    orchestrator = FakeOrchestrator({0: "before"})
    serving, planner = _serving(orchestrator)
    req = _prepared(planner)
    assert asyncio.run(_collect(serving, req)) == [[7], [8]]
    assert orchestrator.generated == ["cmpl-1", "cmpl-1~1"]  # a new id for the workers
    assert orchestrator.reserved == [("cmpl-1~1", PROMPT)]  # a fresh reservation, new plan
    assert len(planner.plans) == 2 and planner.plans[1] is req.plan
    assert (req.completion_tokens, req.finish_reason, req.attempt) == (2, "length", 1)


def test_a_greedy_request_whose_decode_worker_dies_goes_on_from_the_tokens_sent() -> None:
    orchestrator = FakeOrchestrator({0: "after"})
    serving, planner = _serving(orchestrator)
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=3, seed=5)
    req = _prepared(planner, params)
    assert asyncio.run(_collect(serving, req)) == [[7], [8], [9], [10]]
    assert orchestrator.generated == ["cmpl-1", "cmpl-1~1"]
    # The new attempt prefills the prompt and the token already sent, and asks for the rest.
    assert orchestrator.reserved == [("cmpl-1~1", [*PROMPT, 7])]
    assert orchestrator.prompts[1] == [*PROMPT, 7]
    assert (orchestrator.params[1]["max_tokens"], orchestrator.params[1]["min_tokens"]) == (3, 2)
    assert (req.token_ids, req.text) == ([7, 8, 9, 10], "<7><8><9><10>")
    assert req.usage()["prompt_tokens"] == 3 and req.usage()["completion_tokens"] == 4
    assert (req.finish_reason, req.attempt, req.resumed_tokens) == ("length", 1, 1)


def test_an_unseeded_sampling_request_goes_on_too() -> None:
    orchestrator = FakeOrchestrator({0: "after"})
    serving, planner = _serving(orchestrator)
    req = _prepared(planner, SamplingParams(temperature=0.8, max_tokens=3))
    assert asyncio.run(_collect(serving, req)) == [[7], [8], [9]]
    assert orchestrator.prompts[1] == [*PROMPT, 7]


def test_text_held_back_by_the_lost_worker_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lost worker streamed token 300 without its text (half a character); the new
    attempt's worker sees 300 in its prompt. The router's own detokenizer writes "é" once 301
    comes, as one worker would have."""
    monkeypatch.setattr(sys.modules[__name__], "ANSWER", [300, 301, 9])
    orchestrator = FakeOrchestrator({0: "after"})
    orchestrator.texts = {300: ""}  # the first worker holds the half character back
    serving, planner = _serving(orchestrator)
    req = _prepared(planner, SamplingParams(temperature=0, max_tokens=3))
    assert asyncio.run(_collect(serving, req)) == [[300], [301], [9]]
    assert req.text == "é<9>"


def test_a_stop_string_across_the_seam_is_found_by_the_router() -> None:
    """The lost worker held back the text of token 7 (it could start the stop string); the new
    attempt's worker sees 7 in its prompt and "<8>" alone holds no stop. The router searches
    the request's whole text: it stops at 8, cuts the text before the stop string and ends the
    stream, as one worker would have."""
    orchestrator = FakeOrchestrator({0: "after"})
    orchestrator.texts = {7: ""}  # held back by the first worker
    serving, planner = _serving(orchestrator)
    params = SamplingParams(temperature=0, max_tokens=4, stop=["7><8"])
    req = _prepared(planner, params)
    assert asyncio.run(_collect(serving, req)) == [[7], [8]]  # 9 and 10 never come
    assert (req.text, req.finish_reason, req.stop_reason) == ("<", "stop", "7><8")
    assert req.completion_tokens == 2 and len(orchestrator.generated) == 2


def test_no_stop_before_min_tokens_after_the_seam() -> None:
    """As in the engine's output processor: a stop string written before `min_tokens` tokens
    were out does not count, then or later."""
    orchestrator = FakeOrchestrator({0: "after"})
    orchestrator.texts = {7: ""}
    serving, planner = _serving(orchestrator)
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=3, stop=["7><8"])
    req = _prepared(planner, params)
    assert asyncio.run(_collect(serving, req)) == [[7], [8], [9], [10]]
    assert (req.text, req.finish_reason) == ("<7><8><9><10>", "length")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=3, max_tokens=3),
    SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, max_tokens=3),
])  # fmt: skip
def test_a_seeded_or_penalized_request_goes_on_counting_the_tokens_sent_as_output(
    params: SamplingParams,
) -> None:
    """The new attempt's worker is told how many of its prompt's tokens were the lost
    attempt's output: its seeded draws and its penalties go on from them."""
    orchestrator = FakeOrchestrator({0: "after"})
    serving, planner = _serving(orchestrator)
    req = _prepared(planner, params)
    assert asyncio.run(_collect(serving, req)) == [[7], [8], [9]]
    assert orchestrator.prompts[1] == [*PROMPT, 7]
    assert (orchestrator.params[1]["resumed_tokens"], orchestrator.params[1]["max_tokens"]) == (
        1,
        2,
    )
    assert "resumed_tokens" not in orchestrator.params[0]


def test_a_streamed_structured_output_whose_decode_worker_dies_fails() -> None:
    """Its grammar's state died with the worker."""
    orchestrator = FakeOrchestrator({0: "after"})
    serving, planner = _serving(orchestrator)
    req = _prepared(planner, SamplingParams(temperature=0, choice=["x", "y"], max_tokens=3))
    with pytest.raises(WorkerLost) as lost:
        asyncio.run(_collect(serving, req))
    assert orchestrator.generated == ["cmpl-1"] and req.completion_tokens == 1
    assert lost.value.body()["error"]["message"].endswith(
        "(its grammar's state was lost with it): send it again"
    )
    assert lost.value.headers == {"Retry-After": "1"}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=3, max_tokens=3, logprobs=1, regex="[a-z]+"),
    SamplingParams(temperature=0, choice=["x", "y"], max_tokens=3),
])  # fmt: skip
def test_a_request_answered_at_its_end_starts_again_from_none_when_it_cannot_go_on(
    params: SamplingParams,
) -> None:
    """Not streamed (`run_to_end`), nothing of the lost attempt reached the caller: the request
    starts again from its prompt alone (the grammar starts from its beginning), and
    answers with the new attempt's tokens only."""
    orchestrator = FakeOrchestrator({0: "after"})
    serving, planner = _serving(orchestrator)
    req = _prepared(planner, params)
    asyncio.run(run_to_end(serving, req))
    assert orchestrator.generated == ["cmpl-1", "cmpl-1~1"]
    assert orchestrator.prompts == [PROMPT, PROMPT]  # (not [*PROMPT, 7]: from none)
    assert orchestrator.params[1]["max_tokens"] == 3
    assert (req.token_ids, req.text, req.completion_tokens) == ([7, 8, 9], "<7><8><9>", 3)
    assert req.logprobs == ([] if params.logprobs is not None else None)  # (the fake has none)
    assert (req.finish_reason, req.resumed_tokens, req.attempt) == ("length", 0, 1)


def test_a_request_goes_on_mid_stream_once_at_most() -> None:
    orchestrator = FakeOrchestrator({0: "after", 1: "after"})
    serving, planner = _serving(orchestrator)
    req = _prepared(planner, SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(WorkerLost):
        asyncio.run(_collect(serving, req))
    assert orchestrator.generated == ["cmpl-1", "cmpl-1~1"] and req.token_ids == [7, 8]


def test_a_request_starts_over_once_at_most() -> None:
    orchestrator = FakeOrchestrator({0: "before", 1: "before"})
    serving, planner = _serving(orchestrator)
    with pytest.raises(WorkerLost):
        asyncio.run(_collect(serving, _prepared(planner)))
    assert orchestrator.generated == ["cmpl-1", "cmpl-1~1"]


def test_workers_whose_drain_ran_out_do_not_use_up_the_one_loss_a_request_survives() -> None:
    # A rolling update: the stream's decode worker drains out, and so does the next one; then
    # a worker dies: the request still ends, exactly.
    orchestrator = FakeOrchestrator({0: "drained", 1: "drained", 2: "after"})
    serving, planner = _serving(orchestrator)
    req = _prepared(planner, SamplingParams(temperature=0, max_tokens=5))
    assert asyncio.run(_collect(serving, req)) == [[7], [8], [9], [10], [11]]
    assert orchestrator.generated == ["cmpl-1", "cmpl-1~1", "cmpl-1~2", "cmpl-1~3"]
    assert (req.token_ids, req.finish_reason, req.resumed_tokens) == (ANSWER, "length", 3)


def test_drained_moves_are_bounded_too() -> None:
    drains = dict.fromkeys(range(worker_failures.MAX_DRAINED_MOVES + 1), "drained")
    orchestrator = FakeOrchestrator({**drains, worker_failures.MAX_DRAINED_MOVES + 1: "after"})
    serving, planner = _serving(orchestrator)
    params = SamplingParams(temperature=0, max_tokens=worker_failures.MAX_DRAINED_MOVES + 4)
    orchestrator_answer = ANSWER + list(range(12, 12 + worker_failures.MAX_DRAINED_MOVES))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules[__name__], "ANSWER", orchestrator_answer)
        with pytest.raises(WorkerLost):
            asyncio.run(_collect(serving, _prepared(planner, params)))
    # MAX_DRAINED_MOVES drained moves; the next one spends the one loss a request survives,
    # and the death after it fails the request
    assert len(orchestrator.generated) == worker_failures.MAX_DRAINED_MOVES + 2


def test_requests_that_go_on_without_a_lost_worker_are_counted() -> None:
    """`tandem:request_retries_total{lost_role, how}`: a cluster that keeps losing workers
    shows in its metrics, not only in its logs."""
    from prometheus_client import generate_latest

    def retries(serving: Serving) -> dict[tuple[str, str], float]:
        text = generate_latest(serving.metrics.registry).decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("tandem:request_retries_total{"):
                labels = dict(
                    part.split("=")
                    for part in line[line.index("{") + 1 : line.index("}")].split(",")
                )
                key = (labels["lost_role"].strip('"'), labels["how"].strip('"'))
                out[key] = float(line.rsplit(" ", 1)[1])
        return out

    for lose, want in (("before", ("prefill", "restarted")), ("after", ("decode", "resumed"))):
        serving, planner = _serving(FakeOrchestrator({0: lose}))
        asyncio.run(_collect(serving, _prepared(planner, SamplingParams(max_tokens=3))))
        counts = retries(serving)
        assert counts.pop(want) == 1.0
        assert set(counts.values()) == {0.0} and len(counts) == 3  # the other series, at 0
