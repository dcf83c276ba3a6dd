"""The KV pool of an engine on a CUDA GPU sized by `gpu_memory_utilization` (skipped without
CUDA): the engine stays inside its share, the pool takes what weights and activations leave,
and a share larger than what is free is refused with the figures."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_pool_fills_the_share_and_no_more(tiny_checkpoint: Any) -> None:
    from tandem import SamplingParams
    from tandem.engine.config import EngineConfig
    from tandem.engine.kv_memory import GIB, InsufficientMemoryError
    from tandem.engine.llm_engine import LLMEngine

    path = str(tiny_checkpoint())
    _, total = torch.cuda.mem_get_info()
    share = 0.04
    # Enough sequences that the cap (max_num_seqs requests of max_model_len) does not bind.
    config = EngineConfig(model=path, device="cuda", gpu_memory_utilization=share,
                          max_num_seqs=1_000_000)  # fmt: skip
    engine = LLMEngine(config)
    held = torch.cuda.memory_reserved()
    assert engine.kv_pool.nbytes > 0.5 * share * total, engine.kv_pool.nbytes / GIB
    assert held <= share * total, (held / GIB, share * total / GIB)
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # What is left free now is less than 0.99 of the GPU: a second engine asking that is refused.
    with pytest.raises(InsufficientMemoryError, match="were free when this engine started"):
        LLMEngine(config.model_copy(update={"gpu_memory_utilization": 0.99}))
