"""Faults over real transports: a prefill process and a decode process (one pair per transport,
shared by the cases), each case followed by integrity checks on both sides and an exact request.

Cases: the receiver cancels mid-stream (the sender unpins), a lease expires, a manifest that does
not match the decode model, a peer with the wrong cluster token, and last (it ends its pair) the
sender killed mid-stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer.process_pair import PDProcesses
from tandem.kv_transfer.registry import create_transport
from tests.unit.test_kv_transfer_two_process import TRANSPORTS, _available

PARAMS = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
LONG = [(5 * i) % 500 + 1 for i in range(16 * 60)]  # 60 blocks: 30 chunks of 2 blocks
NEXT = [(11 * i + 3) % 500 + 1 for i in range(16 * 9 + 5)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint(arch="llama", seed=13))


@pytest.fixture(scope="module")
def expected_next(model: str) -> list[int]:
    llm = LLM(model=model, num_kv_blocks=256)
    return llm.generate([NEXT], SamplingParams(**PARAMS))[0].token_ids


# Not ucx-push: a prefill killed during one of UCX's own copies between two processes of one
# machine aborts the decode process (docs/benchmarks.md, session 49); ucx pulls there.
@pytest.fixture(scope="module", params=[t for t in TRANSPORTS if t != "ucx-push"])
def pd(request: pytest.FixtureRequest, model: str) -> Iterator[PDProcesses]:
    name = str(request.param)
    if not _available(name):
        pytest.skip(f"transport {name!r} is not installed here")
    pair = PDProcesses(model, name, chunk_blocks=2, lease_s=1.5, stall_timeout_s=1.5)
    pair.transport_name = name  # type: ignore[attr-defined]
    yield pair
    pair.close()


def _settled_and_exact(pd: PDProcesses, expected: list[int], rid: str) -> None:
    """Both sides pass their integrity checks and end up holding nothing (held blocks come back
    within the stall timeout at the latest), and the next request is exact."""
    pd.wait_settled(15)
    assert pd.run(rid, NEXT, PARAMS) == expected


def _event(pd: PDProcesses, side: str, kind: str, rid: str) -> dict[str, Any]:
    conn = pd.prefill_conn if side == "prefill" else pd.decode_conn
    return pd.wait_event(conn, kind, rid, timeout=30)


@pytest.mark.slow
def test_receiver_cancels_mid_stream(pd: PDProcesses, expected_next: list[int]) -> None:
    pd.start("rc", LONG, PARAMS)
    pd.decode_conn.send(("cancel", "rc"))  # applied once the first chunk has arrived
    event = _event(pd, "prefill", "cancelled", "rc")  # the sender let go of its pins
    assert "decode" in (event["error"] or "")
    _settled_and_exact(pd, expected_next, "rc-next")


@pytest.mark.slow
def test_lease_expires(pd: PDProcesses, expected_next: list[int]) -> None:
    grant = pd.reserve("le", LONG, PARAMS)
    assert grant["dst_block_ids"]
    event = _event(pd, "decode", "failed", "le")  # nobody ever sends: the lease runs out
    assert "lease expired" in (event["error"] or "")
    _settled_and_exact(pd, expected_next, "le-next")


@pytest.mark.slow
def test_manifest_mismatch(pd: PDProcesses, expected_next: list[int]) -> None:
    pd.prefill_conn.send(("layout", "another-model"))
    try:
        pd.start("mm", LONG, PARAMS)
        decode_side = _event(pd, "decode", "failed", "mm")
        prefill_side = _event(pd, "prefill", "failed", "mm")
    finally:
        pd.prefill_conn.send(("layout", None))
    assert "namespace" in (decode_side["error"] or "")
    assert "namespace" in (prefill_side["error"] or "")
    _settled_and_exact(pd, expected_next, "mm-next")


@pytest.mark.slow
def test_wrong_cluster_token(pd: PDProcesses, expected_next: list[int]) -> None:
    name = pd.transport_name  # type: ignore[attr-defined]
    grant = pd.reserve("wt", LONG, PARAMS)
    options = {"hello_timeout_s": 1.0} if name == "ucx" else {}
    intruder = create_transport(name, "not-the-cluster-token", **options)
    try:
        intruder.register_pool(KVCachePool(8, 2, 16, 2, 16))
        manifest = {"request_id": "wt", "dst_block_ids": grant["dst_block_ids"][:2]}
        intruder.send(
            pd.decode_address, {"type": "pages", "request_id": "wt", "manifest": manifest}, [0, 1]
        )
        deadline, errors = time.monotonic() + 20, []
        while not errors and time.monotonic() < deadline:
            errors = [m for m in intruder.poll(0.1) if m.header["type"] == "transport_error"]
        assert errors, "the intruder's send did not fail"
    finally:
        intruder.close()
    # Nothing reached the receiver: the reservation just runs out, as if nobody had sent.
    event = _event(pd, "decode", "failed", "wt")
    assert "lease expired" in (event["error"] or "")
    _settled_and_exact(pd, expected_next, "wt-next")


@pytest.mark.slow
def test_sender_killed_mid_stream(pd: PDProcesses) -> None:
    """The last case of each pair: its prefill process dies."""
    prompt = [(3 * i) % 500 + 1 for i in range(16 * 120)]  # 120 blocks: 60 chunks
    pd.start("k", prompt, {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True})
    assert pd.wait_streaming("k"), "the reservation ended before its first chunk came"
    pd.prefill.kill()  # mid-stream: pages have come, more are due
    killed = time.monotonic()
    failed = _event(pd, "decode", "failed", "k")
    # Found by the stall timeout (1.5 s here) or the lost link: not by the lease, which ended
    # with the first chunk.
    assert failed["error"] and "lease" not in failed["error"], failed
    assert time.monotonic() - killed < 15, failed
    # Blocks a dead sender might still have been writing are held for the stall timeout.
    deadline = time.monotonic() + 10
    while (free_total := pd.check_decode())[0] != free_total[1]:
        assert time.monotonic() < deadline, f"decode holds blocks: {free_total}"
        time.sleep(0.1)
