"""A request's grammar is compiled off the engine's thread on prefill and decode workers: a slow
compile (a large schema with a large vocabulary takes seconds) stalls no other request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tandem import LLM
from tandem.engine.sampling_params import SamplingParams
from tests import pd_pair as pd_pair_module
from tests.pd_pair import PROMPTS, run_pd, wait_idle

model = pd_pair_module.model  # the shared fixtures
reference = pd_pair_module.reference
services = pd_pair_module.services

COMPILE_S = 1.0


def test_a_slow_grammar_compile_stalls_no_other_request(
    services: Any, reference: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode = services
    compiled_at: list[float] = []
    for service in (prefill, decode):
        book = service.engine.grammars
        real_compile = book._compile

        def slow_compile(kind: str, text: str, real: Any = real_compile) -> Any:
            time.sleep(COMPILE_S)
            compiled = real(kind, text)
            compiled_at.append(time.monotonic())
            return compiled

        monkeypatch.setattr(book, "_compile", slow_compile)
    tok = reference.tokenizer
    schema = {
        "type": "object",
        "properties": {"slow_compile_probe": {"type": "integer"}},
        "required": ["slow_compile_probe"],
    }
    guided = SamplingParams(temperature=0, max_tokens=16, json_schema=schema)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    guided_ids, plain_ids = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[1])

    async def main() -> tuple[Any, Any, float]:
        slow = asyncio.create_task(run_pd(prefill, decode, "guided", guided_ids, guided))
        await asyncio.sleep(0.2)  # (both compiles have begun)
        fast = await run_pd(prefill, decode, "plain", plain_ids, plain)
        plain_done = time.monotonic()
        return await slow, fast, plain_done

    slow, fast, plain_done = asyncio.run(main())
    assert len(compiled_at) == 2  # one compile per worker, none on the engine's thread again
    assert plain_done < min(compiled_at)  # the plain request never waited for a compile
    assert fast[0] == reference.generate([plain_ids], plain)[0].token_ids
    expected = reference.generate([guided_ids], guided)[0]
    assert slow[0] == expected.token_ids
    assert slow[1] == expected.text
    asyncio.run(wait_idle(prefill, decode))
