"""vLLM's `LLMEngine` as scripts drive it through `llm.llm_engine`: `add_request(request_id,
prompt, params)`, then `step()` until `has_unfinished_requests()` is false, each step returning
`RequestOutput`s (vLLM's `llm_engine_example.py` loop). Over tandem's engine, whose own requests
are one sample each: a request of `n` samples is `n` engine requests, reported together."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import SimpleNamespace
from typing import Any

from tandem.engine.errors import InvalidRequestError
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.llm_inputs import engine_samples, parse_prompts, salted
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.vllm_compat import RequestOutputKind


@dataclass
class _Added:
    """A request added through this API: its samples' engine requests, and what was reported."""

    prompt: str | None
    params: SamplingParams
    samples: list[Request]
    reported: list[tuple[int, int]] = field(default_factory=list)  # (tokens, text) per sample
    finished: bool = False


class VllmStyleEngine:
    """`llm.llm_engine`. `prepare` checks a request's params as `LLM.generate` does (and may
    return them changed: logprobs -1 as the vocabulary's size)."""

    def __init__(self, engine: LLMEngine, prepare: Callable[[SamplingParams], SamplingParams]):
        self.engine = engine
        self._prepare = prepare
        self._added: dict[str, _Added] = {}

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
    ) -> None:
        """Queues `prompt` (a text, token ids, or a prompt dict) under `request_id`. (Its text is
        written as it streams: an unfinished output holds back a character's first bytes.)"""
        if lora_request is not None:
            raise InvalidRequestError("lora_request: LoRA adapters are not supported")
        if not isinstance(request_id, str) or isinstance(prompt, SamplingParams):
            raise InvalidRequestError(
                "add_request takes (request_id, prompt, params), as vLLM's: request_id is a string"
            )
        if request_id in self._added:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompts, salts = parse_prompts([prompt])
        params = salted([self._prepare(params or SamplingParams())], salts)[0]
        samples: list[Request] = []
        try:
            for i, sample in enumerate(engine_samples(params)):
                sample_id = request_id if params.n == 1 else f"{i}_{request_id}"
                samples.append(
                    self.engine.add_request(
                        prompts[0],
                        sample,
                        request_id=sample_id,
                        stream_text=True,
                        arrival_time=arrival_time,
                        priority=priority,
                    )
                )
        except Exception:
            for req in samples:
                self.engine.abort(req.request_id)
            raise
        text = prompts[0] if isinstance(prompts[0], str) else None
        self._added[request_id] = _Added(text, params, samples, [(0, 0)] * len(samples))

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the added requests that moved on (or finished, also
        in another caller's step), as their `output_kind` asks: whole outputs so far, the new
        part only (DELTA), or the finished ones only (FINAL_ONLY)."""
        self.engine.step()
        outputs = []
        for request_id, added in list(self._added.items()):
            out = self._output(request_id, added)
            if out is not None:
                outputs.append(out)
            if added.finished:
                del self._added[request_id]
        return outputs

    def _output(self, request_id: str, added: _Added) -> RequestOutput | None:
        progress = [(len(r.output_token_ids), r.is_finished) for r in added.samples]
        added.finished = all(done for _, done in progress)
        kind = added.params.output_kind
        moved = any(n != seen for (n, _), (seen, _) in zip(progress, added.reported, strict=True))
        if (kind == RequestOutputKind.FINAL_ONLY and not added.finished) or not (
            moved or added.finished
        ):
            return None
        outs = [self.engine.make_output(req, added.prompt) for req in added.samples]
        samples = [replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
        if kind == RequestOutputKind.DELTA:
            cut = [replace(s, token_ids=s.token_ids[n:], text=s.text[chars:],
                           logprobs=None if s.logprobs is None else s.logprobs[n:])
                   for s, (n, chars) in zip(samples, added.reported, strict=True)]  # fmt: skip
            added.reported = [(len(s.token_ids), len(s.text)) for s in samples]
            samples = cut
        else:
            added.reported = [(len(s.token_ids), len(s.text)) for s in samples]
        first = outs[0]
        first.request_id, first.outputs, first.finished = request_id, samples, added.finished
        return first

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(self._added)

    def get_num_unfinished_requests(self) -> int:
        return sum(1 for r in self.engine.requests.values() if not r.is_finished)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Cancels requests by their ids (one or several, as vLLM's); unknown ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            added = self._added.pop(request_id, None)
            for req in added.samples if added else []:
                self.engine.abort(req.request_id)
            if added is None:
                self.engine.abort(request_id)

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    @cached_property
    def model_config(self) -> SimpleNamespace:
        """What scripts read of vLLM's `model_config`: `model`, `max_model_len`, `dtype`,
        `hf_config` (the checkpoint's transformers config), `get_vocab_size()`."""
        from transformers import AutoConfig

        own = self.engine.model_config
        try:
            hf_config = AutoConfig.from_pretrained(own.model)
        except (OSError, ValueError):  # (a config transformers cannot read: the parsed spec)
            hf_config = own.hf_config
        return SimpleNamespace(
            **{**vars(own), "hf_config": hf_config},
            get_vocab_size=lambda: self.engine.spec.vocab_size,
        )

    def get_model_config(self) -> SimpleNamespace:
        return self.model_config

    def __getattr__(self, name: str) -> Any:
        # (tandem's own engine methods: `abort`, `check_integrity`, ...)
        return getattr(self.engine, name)
