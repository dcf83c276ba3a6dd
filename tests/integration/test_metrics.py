"""`GET /metrics` on a running PD cluster: scraped counters agree exactly with the traffic sent."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.ray
DEPLOYMENT = "1x1"  # (conftest groups the tests by deployment)

Samples = dict[str, float]


def scrape(base_url: str) -> Samples:
    """Every sample, keyed ``name{label=value,...}`` (labels sorted), model/replica dropped."""
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "replica")}
            key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
            out[key] = out.get(key, 0.0) + s.value  # summed over replicas of a role
            if s.labels.get("role") in ("prefill", "decode"):  # and per worker replica
                out[key[:-1] + f",replica={s.labels.get('replica')}}}"] = s.value
    return out


def delta(before: Samples, after: Samples, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_until(check: Callable[[], bool], timeout: float = 10.0, what: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"condition not met in time: {what}"
        time.sleep(0.2)


def complete(base_url: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    resp = requests.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_scraped_counters_equal_the_traffic(cluster: Any) -> None:
    base = cluster.deploy_pd(1)
    rng = random.Random(20261129)
    shared = [rng.randrange(10, 500) for _ in range(40)]  # 40 tokens: 2 full blocks of 16
    prompts = [shared, [rng.randrange(10, 500) for _ in range(23)], list(shared)]
    max_tokens = [5, 1, 7]
    before = scrape(base)
    usages = [complete(base, p, n)["usage"] for p, n in zip(prompts, max_tokens, strict=True)]
    # The repeat of `shared` reuses its 2 full blocks (on decode or prefill, wherever routed).
    assert usages[2]["prompt_tokens_details"]["cached_tokens"] == 32

    def worker_hits(after: Samples) -> float:
        """Prefix hits since `before`, per worker replica: replicas of an earlier deployment
        that leave the registry meanwhile take their counters with them."""
        return sum(
            v - before.get(k, 0.0)
            for k, v in after.items()
            if k.startswith("tandem:prefix_cache_hits_total{") and "replica=" in k
        )

    seen: list[float] = []
    seen: list[float] = []
    wait_until(lambda: seen.append(worker_hits(scrape(base))) or seen[-1] == 2, what=seen)
    after = scrape(base)
    assert worker_hits(after) == 2
    assert (
        delta(before, after, "tandem:request_success_total{finished_reason=length,role=router}")
        == 3
    )
    assert delta(before, after, "tandem:prompt_tokens_total{role=router}") == 40 + 23 + 40
    assert delta(before, after, "tandem:generation_tokens_total{role=router}") == 5 + 1 + 7
    assert delta(before, after, "tandem:time_to_first_token_seconds_count{role=router}") == 3
    assert delta(before, after, "tandem:e2e_request_latency_seconds_count{role=router}") == 3
    # TPOT only for requests with 2+ tokens.
    assert (
        delta(before, after, "tandem:request_time_per_output_token_seconds_count{role=router}") == 2
    )
    assert (
        delta(before, after, "tandem:slo_met_requests_total{role=router,slo=all}")
        + delta(before, after, "tandem:slo_missed_requests_total{role=router,slo=all}")
        == 3
    )
    decisions = sum(
        delta(before, after, k) for k in after if k.startswith("tandem:router_decisions_total")
    )
    assert decisions == 3
    assert after["tandem:role_replicas{role=prefill}"] == 1
    assert after["tandem:role_replicas{role=decode}"] == 1
    # Admission refusal and a bad request are counted, not as successes.
    refused = requests.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": prompts[1], "max_tokens": 2, "deadline_ms": 0.001},
        timeout=30,
    )
    assert refused.status_code == 429
    bad = requests.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert bad.status_code == 404
    final = scrape(base)
    assert (
        sum(
            delta(after, final, k)
            for k in final
            if k.startswith("tandem:admission_rejections_total")
        )
        == 1
    )
    assert (
        delta(after, final, "tandem:request_failure_total{code=model_not_found,role=router}") == 1
    )
    assert (
        delta(after, final, "tandem:request_success_total{finished_reason=length,role=router}") == 0
    )
    # Refusals before the request path (body validation, unsupported options, malformed JSON)
    # count too, each once.
    for body in ({**BAD_TYPE}, {**UNSUPPORTED}):
        assert requests.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 400
    malformed = requests.post(
        f"{base}/v1/completions", data=b"{nope", headers={"content-type": "application/json"},
        timeout=30,
    )  # fmt: skip
    assert malformed.status_code == 400
    last = scrape(base)
    key = "tandem:request_failure_total{code=invalid_request_error,role=router}"
    assert delta(final, last, key) == 1
    assert delta(final, last, "tandem:request_failure_total{code=unsupported,role=router}") == 1
    assert delta(final, last, "tandem:request_failure_total{code=invalid_json,role=router}") == 1
    assert last["tandem:role_replicas{role=router}"] == 1


BAD_TYPE = {"model": "tiny", "prompt": "x", "max_tokens": "many"}
UNSUPPORTED = {"model": "tiny", "prompt": "x", "max_tokens": 2, "suffix": "z"}


def test_replica_states_read_from_serve_s_details_match_serve_status(cluster: Any) -> None:
    # (the router reads them every 2 s for `tandem:role_target_replicas`: `serve.status()`
    # held its GIL ~100 ms a call under load, stalling every stream)
    from collections import Counter

    from ray import serve

    from tandem.router.serve_replicas import replica_states
    from tests.integration.conftest import APP

    base = cluster.deploy_pd(1)
    states = replica_states(APP)
    status = serve.status().applications[APP].deployments
    assert states == {name: Counter(d.replica_states) for name, d in status.items()}
    assert {name: dict(c) for name, c in states.items()} == {
        "router": {"RUNNING": 1},
        "prefill": {"RUNNING": 1},
        "decode": {"RUNNING": 1},
    }
    assert replica_states("no-such-app") == {}
    wait_until(lambda: scrape(base).get("tandem:role_target_replicas{role=decode}") == 1)
