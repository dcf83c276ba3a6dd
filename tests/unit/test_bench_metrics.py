"""`tandem bench serve` metrics against hand-computed values (vLLM's definitions), and its JSON."""

from __future__ import annotations

import math

import pytest

from tandem.bench.serving.client import StreamReader
from tandem.bench.serving.metrics import calculate_metrics, is_good, parse_goodput
from tandem.bench.serving.records import RequestRecord
from tandem.bench.serving.result import result_json, summary_text


def record(chunks: list[float], output_tokens: int, prompt_len: int = 10) -> RequestRecord:
    """A successful request sent at t=0 whose chunks arrived at `chunks` (seconds)."""
    rec = RequestRecord(prompt_len, max_tokens=output_tokens, success=True)
    rec.set_chunk_times(0.0, chunks)
    rec.output_tokens = output_tokens
    return rec


def workload() -> list[RequestRecord]:
    a = record([0.10, 0.15, 0.25], 5, prompt_len=10)  # multi-token chunks: 5 tokens in 3 chunks
    b = record([0.20], 1, prompt_len=20)  # a single output token: no TPOT
    c = RequestRecord(30, 8, error="HTTP 429: busy")  # failed
    d = record([0.05, 0.10, 0.20], 3, prompt_len=40)
    return [a, b, c, d]


def test_per_request_timings() -> None:
    a, b, _, d = workload()
    assert a.ttft == pytest.approx(0.10) and a.latency == pytest.approx(0.25)
    assert a.itl == pytest.approx([0.05, 0.10])  # gaps between chunks, not per token
    assert a.tpot == pytest.approx((0.25 - 0.10) / 4)  # (E2EL - TTFT) / (tokens - 1)
    assert (b.ttft, b.itl, b.latency, b.tpot) == (0.20, [], 0.20, 0.0)
    assert d.tpot == pytest.approx(0.075)


def test_summary_metrics() -> None:
    m = calculate_metrics(workload(), duration=2.0, percentiles=(90, 99))
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (70, 9)  # the failed request counts for neither
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(39.5)
    assert m.request_goodput is None
    ttft = m.stats["ttft"]  # [100, 200, 50] ms
    assert ttft.mean == pytest.approx(350 / 3)
    assert ttft.median == pytest.approx(100)
    assert ttft.std == pytest.approx(math.sqrt(3888.888889))
    assert ttft.percentiles[90] == pytest.approx(180)  # 100 + 0.8 * (200 - 100)
    assert ttft.percentiles[99] == pytest.approx(198)
    tpot = m.stats["tpot"]  # [37.5, 75] ms; the one-token request is left out
    assert (tpot.mean, tpot.median, tpot.std) == pytest.approx((56.25, 56.25, 18.75))
    assert tpot.percentiles[99] == pytest.approx(74.625)
    itl = m.stats["itl"]  # pooled [50, 100, 50, 100] ms
    assert (itl.mean, itl.median, itl.std) == pytest.approx((75, 75, 25))
    assert itl.percentiles[90] == pytest.approx(100)
    e2el = m.stats["e2el"]  # [250, 200, 200] ms
    assert (e2el.mean, e2el.median) == pytest.approx((650 / 3, 200))


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ("ttft:150 tpot:60", 1),  # a only: b's TTFT and d's TPOT miss
        ("ttft:250 tpot:60", 2),  # b is good: a one-token request's TPOT counts as 0
        ("e2el:210", 2),  # b and d
        ("ttft:200", 3),  # bounds are inclusive
    ],
)
def test_goodput(slos: str, good: int) -> None:
    m = calculate_metrics(workload(), duration=2.0, slos=parse_goodput([slos]))
    assert m.request_goodput == pytest.approx(good / 2.0)
    assert m.good_fraction == pytest.approx(good / 4)  # the failed request misses


def test_a_failed_request_is_never_good_and_bad_slos_are_named() -> None:
    assert not is_good(workload()[2], {"ttft": 1e9})
    with pytest.raises(ValueError, match="ttfx"):
        parse_goodput(["ttfx:5"])
    assert parse_goodput(["ttft:5", "tpot:1 e2el:9"]) == {"ttft": 5, "tpot": 1, "e2el": 9}


def test_no_successful_request_gives_zeros_not_errors() -> None:
    m = calculate_metrics([RequestRecord(5, 5, error="x")], duration=1.0, slos={"ttft": 1})
    assert (m.completed, m.failed, m.request_goodput, m.stats["ttft"].mean) == (0, 1, 0, 0)


def test_stream_reader_times_every_chunk_with_choices_and_reads_usage() -> None:
    reader = StreamReader(RequestRecord(3, 4), sent=10.0)
    lines = [
        (b'data: {"choices":[{"text":"Hel"}]}', 10.1),
        (b"", 10.1),
        (b'data: {"choices":[{"text":"lo"}]}', 10.3),
        (b'data: {"choices":[{"text":"","finish_reason":"length"}]}', 10.4),  # still a chunk
        (b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":4}}', 10.5),
        (b"data: [DONE]", 10.5),
    ]
    for line, t in lines:
        reader.feed(line, t)
    rec = reader.finish()
    assert rec.success and rec.generated_text == "Hello"
    assert (rec.prompt_len, rec.output_tokens) == (7, 4)
    assert rec.ttft == pytest.approx(0.1) and rec.latency == pytest.approx(0.4)
    assert rec.itl == pytest.approx([0.2, 0.1])


def test_stream_reader_error_event_and_empty_stream_fail() -> None:
    reader = StreamReader(RequestRecord(3, 4), sent=0.0)
    reader.feed('data: {"choices":[{"text":"a"}]}', 0.1)
    reader.feed('data: {"error":{"message":"decode worker died","code":503}}', 0.2)
    rec = reader.finish()
    assert not rec.success and rec.error == "decode worker died"
    empty = StreamReader(RequestRecord(3, 4), sent=0.0).finish()
    assert not empty.success and "never received" in empty.error


@pytest.mark.parametrize(
    "event", ["null", "[1, 2]", '"text"', '{"choices": ["x"]}', '{"choices": [{}], "usage": 3}']
)
def test_an_event_that_is_not_an_openai_chunk_fails_its_request_only(event: str) -> None:
    """It stopped the whole run (TypeError / AttributeError out of the reader): as vLLM's
    client, it is that request's failure (`send_completion` records a ValueError)."""
    reader = StreamReader(RequestRecord(3, 4), sent=0.0)
    reader.feed('data: {"choices":[{"text":"a"}]}', 0.1)
    with pytest.raises(ValueError, match="not"):
        reader.feed(f"data: {event}", 0.2)


def test_without_usage_a_tokenizer_counts_the_output_tokens() -> None:
    """Chunks may carry several tokens: with no usage from the server, vLLM's client counts the
    text's tokens (a chunk was counted as one token, halving output throughput and doubling
    TPOT for two-token chunks); a count the server sent stays."""
    from tandem.bench.serving.records import count_output_tokens

    reader = StreamReader(RequestRecord(3, 4), sent=0.0)
    for i, text in enumerate(["ab", "cd"]):
        reader.feed(f'data: {{"choices":[{{"text":"{text}"}}]}}', 0.1 * (i + 1))
    counted = reader.finish()
    served = record([0.1, 0.2], 7)
    served.output_tokens_from_usage = True
    assert counted.output_tokens == 2  # (one a chunk, until a tokenizer counts)
    count_output_tokens([counted, served], len)  # (a character a token here)
    assert (counted.output_tokens, served.output_tokens) == (4, 7)
    assert counted.tpot == pytest.approx(0.1 / 3)


VLLM_KEYS = {
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
}  # fmt: skip
DETAILED_KEYS = {"ttfts", "itls", "latencies", "input_lens", "output_lens", "errors"}


def test_result_json_has_vllms_keys() -> None:
    records = workload()
    records[1].category = "short"
    m = calculate_metrics(records, 2.0, {"ttft": 150}, percentiles=(90, 99))
    info = {"model_id": "tiny", "request_rate": math.inf, "burstiness": 1.0}
    plain = result_json(m, records, info, slos={"ttft": 150})
    assert set(plain) >= VLLM_KEYS and "p90_ttft_ms" in plain
    assert not DETAILED_KEYS & set(plain)
    assert plain["request_rate"] == "inf" and plain["request_goodput"] == pytest.approx(
        1.0
    )  # a and d
    assert plain["p99_ttft_ms"] == pytest.approx(198)
    assert plain["error_counts"] == {"HTTP 429: busy": 1}
    assert set(plain["categories"]) == {"default", "short"}
    assert plain["categories"]["short"]["completed"] == 1
    detailed = result_json(m, records, info, detailed=True)
    assert set(detailed) >= DETAILED_KEYS
    assert detailed["output_lens"] == [5, 1, 0, 3] and detailed["errors"][2] == "HTTP 429: busy"
    assert detailed["itls"][0] == pytest.approx([0.05, 0.10])
    assert detailed["latencies"][3] == pytest.approx(0.2)
    text = summary_text(m, detailed["errors"])
    assert "Request goodput (req/s):" in text and "1 x HTTP 429: busy" in text


def test_peak_chunks_per_second_and_peak_concurrency() -> None:
    """vLLM's `max_output_tokens_per_s` and `max_concurrent_requests`, by whole seconds from
    the first request sent (chunks counted a token each, as vLLM counts them)."""
    from tandem.bench.serving.result import peaks

    a = record([0.1, 0.5, 0.9, 1.2], 4)  # 3 chunks in second 0, 1 in second 1
    b = record([1.1, 1.3], 2)  # (its chunks 1.1 and 1.3 s after it was sent)
    b.start_time = 1.0  # (sent at 1.0: chunks at 2.1 and 2.3, second 2; under way in 1 and 2)
    failed = RequestRecord(5, 5, error="HTTP 500")
    assert peaks([a, b, failed]) == (3.0, 2)
    assert peaks([failed]) == (0.0, 0)
    plain = result_json(calculate_metrics([a, b], 3.0), [a, b], {"model_id": "m"})
    assert (plain["max_output_tokens_per_s"], plain["max_concurrent_requests"]) == (3.0, 2)
    text = summary_text(calculate_metrics([a, b], 3.0), [], [a, b])
    rows = {line[:40].strip(): line[40:].strip() for line in text.splitlines()}
    assert rows["Peak output token throughput (tok/s):"] == "3.00"
    assert rows["Peak concurrent requests:"] == "2"
