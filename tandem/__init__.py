"""tandem: disaggregated prefill/decode LLM serving on Ray, built on an exact paged engine.

`from tandem import LLM, SamplingParams` is the offline API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tandem.engine.llm import LLM
    from tandem.engine.outputs import RequestOutput
    from tandem.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy so that `import tandem.kernels` does not pull in the whole engine.
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tandem.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from tandem.engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
