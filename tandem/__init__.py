"""tandem: disaggregated prefill/decode LLM serving on Ray, built on an exact paged engine.

`from tandem import LLM, SamplingParams` is the offline API (vLLM's names: also
`RequestOutput`, `CompletionOutput`, `RequestOutputKind`, `StructuredOutputsParams` / `GuidedDecodingParams`,
`TokensPrompt`, `TextPrompt`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "tandem.engine.llm",
    "SamplingParams": "tandem.engine.sampling_params",
    "RequestOutput": "tandem.engine.outputs",
    "CompletionOutput": "tandem.engine.outputs",
    "RequestOutputKind": "tandem.engine.vllm_compat",
    "StructuredOutputsParams": "tandem.engine.vllm_compat",
    "GuidedDecodingParams": "tandem.engine.vllm_compat",
    "TokensPrompt": "tandem.engine.vllm_compat",
    "TextPrompt": "tandem.engine.vllm_compat",
}
__all__ = [*_LAZY, "__version__"]

if TYPE_CHECKING:
    from tandem.engine.llm import LLM
    from tandem.engine.outputs import CompletionOutput, RequestOutput
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.vllm_compat import (
        GuidedDecodingParams,
        RequestOutputKind,
        StructuredOutputsParams,
        TextPrompt,
        TokensPrompt,
    )


def __getattr__(name: str) -> Any:
    # Lazy so that `import tandem.kernels` does not pull in the whole engine.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
