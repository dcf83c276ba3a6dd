"""Admission control: deadlines (request, tenant, default), queue caps, 429 with Retry-After."""

from __future__ import annotations

import pytest

from tandem.router.admission import Admission, AdmissionConfig, TenantPolicy
from tandem.router.errors import APIError


def admission(**kw: object) -> Admission:
    return Admission(AdmissionConfig.model_validate(kw))


def test_deadline_and_priority_come_from_request_then_tenant_then_default() -> None:
    a = admission(
        default_deadline_ms=500,
        tenants={"gold": TenantPolicy(deadline_ms=100, priority=-5)},
    )
    assert a.deadline_ms(42, "gold") == 42
    assert a.deadline_ms(None, "gold") == 100
    assert a.deadline_ms(None, "someone") == 500
    assert admission().deadline_ms(None, None) is None
    assert (a.priority(3, "gold"), a.priority(None, "gold"), a.priority(None, None)) == (3, -5, 0)


def test_prediction_is_queue_over_throughput_plus_transfer_and_overhead() -> None:
    a = admission(transfer_ms_per_block=0.5, overhead_ms=10, safety_factor=2.0)
    # (1000 queued + 1000 new) / 10000 tok/s = 200 ms, + 4 blocks * 0.5 ms, + 10 ms; x 2
    assert a.predicted_ttft_ms(1000, 1000, 10000.0, 4) == pytest.approx(424.0)
    assert a.check(
        queued_tokens=0, new_tokens=1000, tokens_per_s=10000.0, blocks=4, deadline_ms=None
    ) == pytest.approx(224.0)


def test_unmeetable_deadline_is_429_with_retry_after() -> None:
    a = admission(transfer_ms_per_block=0, overhead_ms=0, safety_factor=1.0)
    a.check(queued_tokens=0, new_tokens=1000, tokens_per_s=10000.0, blocks=1, deadline_ms=100)
    with pytest.raises(APIError) as info:
        a.check(
            queued_tokens=30000, new_tokens=1000, tokens_per_s=10000.0, blocks=1, deadline_ms=100
        )
    err = info.value
    assert (err.status, err.code) == (429, "deadline_unmeetable")
    assert err.headers == {"Retry-After": "3"}  # (3100 - 100) ms, in whole seconds (rounded up)


def test_queue_caps_refuse_but_an_empty_worker_always_takes_one() -> None:
    a = admission(max_queued_prefill_tokens=2000, max_decode_tokens=3000)
    a.check(queued_tokens=0, new_tokens=5000, tokens_per_s=None, blocks=1, deadline_ms=None)
    with pytest.raises(APIError) as info:
        a.check(queued_tokens=1500, new_tokens=600, tokens_per_s=None, blocks=1, deadline_ms=None)
    assert (info.value.status, info.value.code) == (429, "queue_full")
    a.check_decode(0, 9000)
    a.check_decode(2000, 1000)
    with pytest.raises(APIError) as info:
        a.check_decode(2000, 1001)
    assert (info.value.status, info.value.code) == (429, "decode_queue_full")
