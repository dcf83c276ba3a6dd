"""One request as the client saw it, and how its timings follow from the streamed chunks.

Definitions (vLLM's): TTFT is the time from sending the request to the first streamed chunk that
carries choices; each later chunk adds one inter-token latency (ITL), the gap since the previous
chunk, whatever number of tokens it carries; E2EL (`latency`) runs to the last such chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """Times are seconds. `output_tokens` is the server's `usage.completion_tokens` when it sent
    one, else a count made by the client. A failed request keeps `success=False` and `error`."""

    prompt_len: int
    max_tokens: int
    category: str = "default"
    start_time: float = 0.0  # seconds since the benchmark started, when the request was sent
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    output_tokens_from_usage: bool = False  # (else counted by the client)
    generated_text: str = ""

    def set_chunk_times(self, sent: float, chunk_times: Sequence[float]) -> None:
        """TTFT, ITLs and E2EL from the send time and the arrival time of each chunk."""
        if not chunk_times:
            raise ValueError("a request with no streamed chunk has no timings")
        self.ttft = chunk_times[0] - sent
        self.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
        self.latency = chunk_times[-1] - sent

    @property
    def tpot(self) -> float:
        """(E2EL - TTFT) / (output tokens - 1); 0 for a request with at most one output token."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def count_output_tokens(records: Sequence[RequestRecord], count: Callable[[str], int]) -> None:
    """Where the server sent no usage, each successful request's output tokens as `count`
    (a tokenizer) counts its text, as `vllm bench serve` counts them (chunks may carry
    several tokens)."""
    for rec in records:
        if rec.success and not rec.output_tokens_from_usage:
            rec.output_tokens = count(rec.generated_text)
