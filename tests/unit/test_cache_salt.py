"""`cache_salt` (vLLM's): a request shares prefix-cache blocks only with requests of the same
salt, in the engine, on the decode side of a PD pair and in the router's affinity."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import xxhash

from tandem import LLM, SamplingParams
from tandem.engine.errors import InvalidRequestError
from tandem.engine.hashing import hash_full_blocks, root_hash, salted_root
from tandem.router.grpc import generation_pb2
from tandem.router.grpc.server import GenerationServicer
from tandem.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from tandem.router.prefix_index import KVEventBatch
from tests import pd_pair as pd_pair_module
from tests.pd_pair import run_pd, wait_idle
from tests.unit.test_route_planner import INFO, NS, ROOT, WORKERS, directory, planner

model = pd_pair_module.model  # the shared fixtures
services = pd_pair_module.services

PROMPT = list(range(1, 71))  # four full blocks of 16 and 6 tokens


def test_a_salted_root_hashes_the_namespace_root_and_the_salt() -> None:
    root = root_hash("ns")
    assert salted_root(root, None) == root
    expected = xxhash.xxh3_64_intdigest(root.to_bytes(8, "little") + b"cache_salt" + b"t\xc3\xa9")
    assert salted_root(root, "té") == expected
    assert salted_root(root, "a") != salted_root(root, "b")


def test_the_engine_shares_blocks_only_within_a_salt(model: str) -> None:
    llm = LLM(model=model, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    order = [None, "a", "a", "b", None]
    outs = [
        llm.generate({"prompt_token_ids": PROMPT, **({"cache_salt": s} if s else {})}, params)[0]
        for s in order
    ]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 64, 0, 64]
    assert all(o.outputs[0].token_ids == outs[0].outputs[0].token_ids for o in outs)
    engine = llm.engine
    salted = salted_root(engine.namespace.root_hash(), "a")
    req_hashes = hash_full_blocks(salted, PROMPT, 16)
    assert all(engine.block_manager.match_prefix(req_hashes, PROMPT, record=False))
    engine.check_integrity()
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        llm.generate({"prompt": "hi", "cache_salt": ""}, params)


def test_decode_reuses_its_blocks_only_within_a_salt(services: Any) -> None:
    prefill, decode = services
    base = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    salts = [None, "a", "a", None, "b"]

    async def main() -> list[tuple[list[int], int]]:
        results = []
        for i, salt in enumerate(salts):
            params = base.model_copy(update={"cache_salt": salt})
            tokens, _, last, _ = await run_pd(prefill, decode, f"s{i}", PROMPT, params)
            results.append((tokens, last["num_cached_tokens"]))
        await wait_idle(prefill, decode)
        return results

    results = asyncio.run(main())
    assert [cached for _, cached in results] == [0, 0, 64, 64, 0]
    assert all(tokens == results[0][0] for tokens, _ in results)
    decode.post(decode.check_integrity)


def test_the_router_matches_a_worker_s_blocks_only_within_a_salt() -> None:
    d = directory(*WORKERS)
    unsalted = hash_full_blocks(ROOT, PROMPT, 16)
    salted = hash_full_blocks(salted_root(ROOT, "a"), PROMPT, 16)
    assert d.index.apply(KVEventBatch(worker_id="d0", seq=0, namespace=NS, stored=unsalted))
    assert d.index.apply(KVEventBatch(worker_id="d1", seq=0, namespace=NS, stored=salted))

    def plan(salt: str | None) -> Any:
        async def main() -> Any:
            return await planner(d).plan(PROMPT, INFO, None, hold_s=60, cache_salt=salt)

        route = asyncio.run(main())
        route.release()
        return route.decode.worker_id, route.decode_hit_blocks

    assert plan(None) == ("d0", 4)
    assert plan("a") == ("d1", 4)
    assert plan("b")[1] == 0


def test_the_apis_pass_the_salt_on_and_refuse_an_empty_one() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "cache_salt": "tenant-1"})
    assert body.sampling_dict()["cache_salt"] == "tenant-1"
    chat = {"messages": [{"role": "user", "content": "x"}], "cache_salt": "t"}
    assert ChatCompletionRequest.model_validate(chat).sampling_dict()["cache_salt"] == "t"
    assert "cache_salt" not in CompletionRequest.model_validate({"prompt": "x"}).sampling_dict()
    with pytest.raises(ValueError, match="cache_salt"):
        CompletionRequest.model_validate({"prompt": "x", "cache_salt": ""})


def test_grpc_passes_the_salt_on() -> None:
    seen: dict[str, Any] = {}

    class Serving:
        async def prepare(self, *args: Any, **kwargs: Any) -> None:
            seen["fields"] = args[4]

    front = GenerationServicer(Serving())  # type: ignore[arg-type]
    asyncio.run(front._prepare(generation_pb2.GenerateRequest(prompt="x", cache_salt="t"), ""))
    assert seen["fields"]["cache_salt"] == "t"
    asyncio.run(front._prepare(generation_pb2.GenerateRequest(prompt="x"), ""))
    assert "cache_salt" not in seen["fields"]


def test_an_import_matches_blocks_under_its_own_salt(model: str) -> None:
    """The hashes an export carries are its exporter's: matched as given, a request salted
    "c" reused blocks another imported under "a"."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_salt="a")
    prefill = LLM(model=model, num_kv_blocks=64).engine
    decode = LLM(model=model, num_kv_blocks=64).engine

    def handed_over(rid: str, import_params: SamplingParams) -> int:
        prefill.add_request(
            PROMPT, params.model_copy(update={"max_tokens": 1}), request_id=rid, keep_kv=True
        )
        first = [t for _ in range(8) for out in prefill.step() for t in out.new_token_ids]
        req = decode.import_request(rid, prefill.export_kv(rid), first[:1], import_params)
        prefill.release_kv(rid)
        while decode.has_unfinished_requests():
            decode.step()
        return req.num_prefix_hit_tokens

    assert handed_over("a1", params) == 0
    assert handed_over("c1", params.model_copy(update={"cache_salt": "c"})) == 0
    assert handed_over("a2", params) == 64
    decode.check_integrity()
