"""Several choices in one request (`router/multi_choice.py`, `openai_format.py`): admitted all
or none, run at once, one error ends them all, and nothing stays reserved on a worker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.seeds import SEED_MAX, SEED_MIN
from tandem.router import multi_choice, openai_stream
from tandem.router.errors import APIError
from tandem.router.openai_format import ResponseHead, full_body, merged_usage
from tandem.router.openai_protocol import CompletionRequest
from tandem.router.prepared import Prepared
from tandem.router.request_timings import RequestTimings


class FakeServing:
    """Choice i streams tokens 10*i, 10*i+1 ... (`tokens` of them); `refuse` choices fail
    to prepare with a 429, `fail_at` fails choice i's run after that many tokens."""

    model_name = "tiny"
    sse_keepalive_s = None

    def __init__(
        self,
        refuse: tuple[int, ...] = (),
        fail_at: dict[int, int] | None = None,
        tokens: int = 3,
        step_s: float = 0.01,
    ) -> None:
        self.refuse, self.fail_at, self.tokens, self.step_s = refuse, fail_at or {}, tokens, step_s
        self.admitted: list[str] = []
        self.abandoned: list[str] = []
        self.refusals: list[APIError | None] = []  # what each abandoned choice was told
        self.ended: dict[str, str] = {}
        self.siblings: list[Any] = []  # what each choice was planned beside

    async def prepare(self, index: int, siblings: Any = None) -> Prepared:
        self.siblings.append(siblings)
        await asyncio.sleep(0.01 * (index % 3))
        if index in self.refuse:
            raise APIError(429, "no room", code="decode_full")
        plan = SimpleNamespace(prefill=None, decode=SimpleNamespace(worker_id="decode/x"))
        params = SamplingParams(max_tokens=self.tokens)
        req = Prepared(f"r-{index}", [1, 2, 3], params, RequestTimings(), plan=plan)  # type: ignore[arg-type]
        self.admitted.append(req.request_id)
        return req

    async def abandon(self, req: Prepared, refused: APIError | None = None) -> None:
        if not req.started:
            req.started = True
            self.abandoned.append(req.request_id)
            self.refusals.append(refused)

    async def run(self, req: Prepared) -> AsyncGenerator[dict[str, Any], None]:
        req.started = True
        index = int(req.request_id.split("-")[1])
        try:
            for k in range(self.tokens):
                await asyncio.sleep(self.step_s)
                if self.fail_at.get(index) == k:
                    raise APIError(503, f"decode worker died under {index}", code="decode_failed")
                last = k == self.tokens - 1
                item: dict[str, Any] = {
                    "token_ids": [10 * index + k],
                    "text": f"<{10 * index + k}>",
                }
                if last:
                    item["finish_reason"] = "length"
                req.token_ids += item["token_ids"]
                req.text += item["text"]
                req.completion_tokens += 1
                if last:
                    req.finish_reason = "length"
                yield item
            self.ended[req.request_id] = "finished"
        except (asyncio.CancelledError, GeneratorExit):
            self.ended[req.request_id] = "cancelled"
            raise


def _prepare_all(serving: FakeServing, count: int) -> list[Prepared]:
    return asyncio.run(multi_choice.prepare_all(serving, count, serving.prepare))  # type: ignore[arg-type]


def test_all_choices_are_admitted_in_order() -> None:
    serving = FakeServing()
    reqs = _prepare_all(serving, 5)
    assert [r.request_id for r in reqs] == [f"r-{i}" for i in range(5)]
    assert serving.abandoned == []
    # (one request's choices are admitted as one: they share their plans, `sibling_load`)
    assert serving.siblings[0] is not None and all(
        s is serving.siblings[0] for s in serving.siblings
    )


def test_one_refused_choice_abandons_the_admitted_ones() -> None:
    serving = FakeServing(refuse=(3,))
    with pytest.raises(APIError) as info:
        _prepare_all(serving, 5)
    assert info.value.status == 429
    assert sorted(serving.abandoned) == sorted(serving.admitted) == ["r-0", "r-1", "r-2", "r-4"]
    assert serving.refusals == [info.value] * 4  # (each counted as refused, not as an abort)


def test_a_choice_abandoned_with_its_refused_request_counts_as_refused_not_aborted() -> None:
    from prometheus_client import generate_latest

    from tandem.router.serving import Serving

    class Orchestrator:
        async def abandon(self, *args: Any) -> None:
            pass

    serving = Serving(Orchestrator(), None, None, "tiny")  # type: ignore[arg-type]
    plan = SimpleNamespace(prefill=None, decode=SimpleNamespace(worker_id="decode/x"),
                           decode_hit_blocks=0, grant=None)  # fmt: skip
    for refused in (APIError(429, "no room", code="decode_full"), None):
        req = Prepared("r", [1, 2], SamplingParams(max_tokens=2), RequestTimings(), plan=plan)  # type: ignore[arg-type]
        asyncio.run(serving.abandon(req, refused))
    text = generate_latest(serving.metrics.registry).decode()
    counted = [line for line in text.splitlines() if line.startswith("tandem:") and
               ("decode_full" in line or 'finished_reason="abort"' in line)]  # fmt: skip
    assert any("admission_rejections_total" in c and c.endswith(" 1.0") for c in counted), counted
    assert any('finished_reason="abort"' in c and c.endswith(" 1.0") for c in counted), counted


def test_the_first_refused_choice_in_order_is_reported() -> None:
    serving = FakeServing(refuse=(1, 4))
    serving.prepare = _renamed(serving.prepare)  # type: ignore[method-assign]
    with pytest.raises(APIError) as info:
        _prepare_all(serving, 5)
    assert info.value.message == "choice 1: no room"


def _renamed(prepare: Any) -> Any:
    async def wrapped(index: int, siblings: Any = None) -> Prepared:
        try:
            return await prepare(index, siblings)
        except APIError as exc:
            exc.message = f"choice {index}: {exc.message}"
            raise

    return wrapped


def test_run_all_runs_every_choice_to_its_end() -> None:
    serving = FakeServing()

    async def main() -> list[Prepared]:
        reqs = await multi_choice.prepare_all(serving, 4, serving.prepare)  # type: ignore[arg-type]
        await multi_choice.run_all(serving, reqs)  # type: ignore[arg-type]
        return reqs

    reqs = asyncio.run(main())
    assert [r.token_ids for r in reqs] == [[10 * i, 10 * i + 1, 10 * i + 2] for i in range(4)]
    assert serving.ended == {f"r-{i}": "finished" for i in range(4)}


def test_an_error_in_one_choice_ends_the_others() -> None:
    serving = FakeServing(fail_at={2: 1}, tokens=50)

    async def main() -> None:
        reqs = await multi_choice.prepare_all(serving, 4, serving.prepare)  # type: ignore[arg-type]
        await multi_choice.run_all(serving, reqs)  # type: ignore[arg-type]

    with pytest.raises(APIError) as info:
        asyncio.run(main())
    assert info.value.message == "decode worker died under 2"
    assert serving.ended == {"r-0": "cancelled", "r-1": "cancelled", "r-3": "cancelled"}


def _stream(serving: FakeServing, count: int, n: int, kind: str = "completion") -> list[Any]:
    async def main() -> list[str]:
        reqs = await multi_choice.prepare_all(serving, count, serving.prepare)  # type: ignore[arg-type]
        head = ResponseHead("cmpl-x", 0, "tiny", kind)  # type: ignore[arg-type]
        gen = openai_stream.sse_choices(serving, head, reqs, n, True)  # type: ignore[arg-type]
        return [event async for event in gen]

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_a_stream_of_several_choices_names_each_chunk_s_choice() -> None:
    serving = FakeServing()
    data = _stream(serving, 4, n=2)
    texts: dict[int, str] = {}
    for d in data[:-1]:
        assert d["id"] == "cmpl-x" and len(d["choices"]) == 1
        choice = d["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {i: f"<{10 * i}><{10 * i + 1}><{10 * i + 2}>" for i in range(4)}
    finishes = [d["choices"][0]["index"] for d in data[:-1] if d["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2, 3]
    usage = data[-1]["usage"]
    assert data[-1]["choices"] == []
    # 2 prompts x n=2: each prompt's 3 tokens count once, all 12 completion tokens count
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (6, 12)


def test_a_chat_stream_opens_every_choice_with_the_role() -> None:
    data = _stream(FakeServing(), 3, n=3, kind="chat")
    roles = [d["choices"][0]["index"] for d in data[:3]]
    assert roles == [0, 1, 2]
    assert all(d["choices"][0]["delta"] == {"role": "assistant", "content": ""} for d in data[:3])


def test_an_error_mid_stream_is_one_error_event_and_ends_every_choice() -> None:
    serving = FakeServing(fail_at={1: 1}, tokens=50)
    data = _stream(serving, 3, n=1)
    assert data[-1] == {
        "error": {
            "message": "decode worker died under 1",
            "type": "invalid_request_error",
            "param": None,
            "code": "decode_failed",
        }
    }
    assert serving.ended == {"r-0": "cancelled", "r-2": "cancelled"}


def test_closing_a_stream_early_cancels_every_choice() -> None:
    serving = FakeServing(tokens=50)

    async def main() -> None:
        reqs = await multi_choice.prepare_all(serving, 3, serving.prepare)  # type: ignore[arg-type]
        gen = multi_choice.merged(serving, reqs)  # type: ignore[arg-type]
        await anext(gen)
        await gen.aclose()

    asyncio.run(main())
    assert serving.ended == {f"r-{i}": "cancelled" for i in range(3)}


def test_merged_usage_counts_each_prompt_once() -> None:
    reqs = [
        Prepared(
            f"r{i}",
            [1] * (4 + i // 2),
            SamplingParams(),
            RequestTimings(),
            completion_tokens=i + 1,
            num_cached_tokens=i // 2,
        )  # fmt: skip
        for i in range(4)
    ]
    usage = merged_usage(reqs, n=2)
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        9,
        10,
        19,
    )
    assert usage["prompt_tokens_details"] == {"cached_tokens": 1}


def test_samples_get_successive_seeds_wrapped_into_the_range() -> None:
    fields = {"seed": SEED_MAX - 1, "temperature": 1.0}
    seeds = [multi_choice.sample_fields(fields, j).get("seed") for j in range(4)]
    assert seeds == [SEED_MAX - 1, SEED_MAX, SEED_MIN, SEED_MIN + 1]
    assert multi_choice.sample_fields({"temperature": 0.0}, 3) == {"temperature": 0.0}


def test_the_sample_seeded_minus_one_stays_seeded() -> None:
    """Seed -2, n = 3: sample 1 is seeded -1, which checking its params again took as vLLM's
    "no seed" (it came back different each time through the cluster, unlike `LLM`'s)."""
    fields = {"seed": -2, "temperature": 1.0}
    seeds = [SamplingParams(**multi_choice.sample_fields(fields, j)).seed for j in range(3)]
    assert seeds == [-2, SEED_MAX, 0]
    a, b = (torch.Generator().manual_seed(s) for s in (-1, SEED_MAX))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_batch_prompts_and_the_choice_limit() -> None:
    def prompts(prompt: Any) -> list[Any]:
        return CompletionRequest(model="m", prompt=prompt).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    multi_choice.check_count(2, multi_choice.MAX_CHOICES // 2)
    with pytest.raises(APIError) as info:
        multi_choice.check_count(3, multi_choice.MAX_CHOICES // 2)
    assert info.value.status == 400 and info.value.param == "prompt"
    with pytest.raises(APIError):
        CompletionRequest(model="m", prompt="a", n=2, best_of=3).check_supported()
    CompletionRequest(model="m", prompt="a", n=2, best_of=2).check_supported()


def test_echoed_prompts_open_each_choice_s_stream_and_body() -> None:
    serving = FakeServing()

    async def main() -> tuple[list[str], dict[str, Any]]:
        reqs = await multi_choice.prepare_all(serving, 2, serving.prepare)  # type: ignore[arg-type]
        for i, req in enumerate(reqs):
            req.echo = f"prompt{i}:"
        head = ResponseHead("cmpl-x", 0, "tiny", "completion")
        gen = openai_stream.sse_choices(serving, head, reqs, 1, False)  # type: ignore[arg-type]
        events = [event async for event in gen]
        return events, full_body(head, reqs, merged_usage(reqs, 1))

    events, body = asyncio.run(main())
    data = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [d["choices"][0]["text"] for d in data[:2]] == ["prompt0:", "prompt1:"]
    assert [c["text"] for c in body["choices"]] == ["prompt0:<0><1><2>", "prompt1:<10><11><12>"]


def _continuous_usage_chunks(count: int, kind: Any) -> list[dict[str, Any]]:
    """The chunks of `count` choices streamed with continuous usage stats (not `[DONE]`)."""
    serving = FakeServing()

    async def main() -> list[str]:
        reqs = await multi_choice.prepare_all(serving, count, serving.prepare)  # type: ignore[arg-type]
        head = ResponseHead("x", 0, "tiny", kind)
        gen = openai_stream.sse_choices(serving, head, reqs, 1, False, True)  # type: ignore[arg-type]
        return [event async for event in gen]

    return [json.loads(e.removeprefix("data: ")) for e in asyncio.run(main())[:-1]]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk() -> None:
    """As vLLM's: each chunk's usage is its own choice's (its tokens so far)."""
    data = _continuous_usage_chunks(2, "completion")
    by_choice: dict[int, list[int]] = {}
    for d in data:
        by_choice.setdefault(d["choices"][0]["index"], []).append(d["usage"]["completion_tokens"])
    assert by_choice == {0: [1, 2, 3], 1: [1, 2, 3]}  # one token a chunk each
    assert {d["usage"]["prompt_tokens"] for d in data} == {3}  # (its own prompt's)


def test_continuous_usage_stats_start_with_the_chat_role_chunk() -> None:
    """As vLLM: the role chunk carries the usage too (prompt tokens, none generated)."""
    data = _continuous_usage_chunks(1, "chat")
    assert data[0]["choices"][0]["delta"].get("role") == "assistant"
    assert [d["usage"]["completion_tokens"] for d in data] == [0, 1, 2, 3]


def test_a_chat_echo_opens_each_choice_s_stream_and_body() -> None:
    """vLLM's chat `echo`: after the role, the echoed message, then the reply; in a body, the
    content is the echo and the reply (it was ignored: the reply alone)."""
    serving = FakeServing()

    async def main() -> tuple[list[str], dict[str, Any]]:
        reqs = await multi_choice.prepare_all(serving, 2, serving.prepare)  # type: ignore[arg-type]
        head = ResponseHead("chatcmpl-x", 0, "tiny", "chat", echo="Hel")
        gen = openai_stream.sse_choices(serving, head, reqs, 2, False)  # type: ignore[arg-type]
        events = [event async for event in gen]
        return events, full_body(head, reqs, merged_usage(reqs, 2))

    events, body = asyncio.run(main())
    data = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    deltas = [(d["choices"][0]["index"], d["choices"][0]["delta"]) for d in data[:4]]
    assert deltas == [
        (0, {"role": "assistant", "content": ""}),
        (0, {"content": "Hel"}),
        (1, {"role": "assistant", "content": ""}),
        (1, {"content": "Hel"}),
    ]
    contents = [c["message"]["content"] for c in body["choices"]]
    assert contents == ["Hel<0><1><2>", "Hel<10><11><12>"]
