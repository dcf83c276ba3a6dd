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
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.vllm_compat import RequestOutputKind


@dataclass
class _Added:
    """A request added through this API: its samples' engine requests, and what was reported
    of each (tokens, characters)."""

    prompt: str | None
    params: SamplingParams
    samples: list[Request]
    reported: list[tuple[int, int]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(req.is_finished for req in self.samples)


class VllmStyleEngine:
    """`llm.llm_engine`. `prepare` checks a request's params as `LLM.generate` does (and may
    return them changed: logprobs -1 as the vocabulary's size); `default_params`: what a
    request given none samples with (the model's generation_config, as `LLM`'s)."""

    def __init__(
        self,
        engine: LLMEngine,
        prepare: Callable[[SamplingParams], SamplingParams],
        default_params: Callable[[], SamplingParams],
    ) -> None:
        self.engine = engine
        self._prepare = prepare
        self._default_params = default_params
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
        written as it streams: an unfinished output holds back what may yet be cut, a stop
        string's start or a character's first bytes.)"""
        if lora_request is not None:
            raise InvalidRequestError("lora_request: LoRA adapters are not supported")
        if not isinstance(request_id, str) or isinstance(prompt, SamplingParams):
            raise InvalidRequestError(
                "add_request takes (request_id, prompt, params), as vLLM's: request_id is a string"
            )
        if request_id in self._added:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompts, salts = parse_prompts([prompt])
        params = salted([self._prepare(params or self._default_params())], salts)[0]
        samples: list[Request] = []
        try:
            for i, sample in enumerate(engine_samples(params)):
                samples.append(
                    self.engine.add_request(
                        prompts[0],
                        sample,
                        request_id=request_id if params.n == 1 else f"{i}_{request_id}",
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
        part only (DELTA), or the finished ones only (FINAL_ONLY). A failed step ends every
        request added here (as `LLM.generate` ends its own)."""
        try:
            self.engine.step()
        except BaseException:
            self.abort_request(list(self._added))
            raise
        outputs = []
        for request_id, added in list(self._added.items()):
            out = self._output(request_id, added)
            if out is not None:
                outputs.append(out)
            if added.finished:
                del self._added[request_id]
        return outputs

    def _output(self, request_id: str, added: _Added) -> RequestOutput | None:
        finished, kind = added.finished, added.params.output_kind
        sent = [(len(r.output_token_ids), _sent_text(r)) for r in added.samples]
        moved = any(
            n != seen or len(text) != chars
            for (n, text), (seen, chars) in zip(sent, added.reported, strict=True)
        )
        if not (moved or finished) or (kind == RequestOutputKind.FINAL_ONLY and not finished):
            return None
        out = self.engine.make_samples_output(added.samples, added.prompt)
        out.request_id, out.finished = request_id, finished
        if not finished:  # (what may yet be cut stays back, as a stream's text)
            texts = [text for _, text in sent]
            out.outputs = [replace(s, text=t) for s, t in zip(out.outputs, texts, strict=True)]
        if kind == RequestOutputKind.DELTA:
            before = added.reported
            out.outputs = [_new_part(s, *b) for s, b in zip(out.outputs, before, strict=True)]
            out.logprobs = None if out.logprobs is None else out.logprobs[before[0][0] :]
            # (the prompt's with the first output only: one went out once anything was reported)
            if any(tokens or chars for tokens, chars in before):
                out.prompt_logprobs = out.prompt_logprob_entries = None
        out.text, out.token_ids = out.outputs[0].text, out.outputs[0].token_ids
        added.reported = [(n, len(text)) for n, text in sent]
        return out

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(self._added)

    def get_num_unfinished_requests(self) -> int:
        """The requests not reported finished: the samples of those added here (as vLLM's
        counts a request of n samples n times) and the engine's others."""
        ours = {req.request_id for added in self._added.values() for req in added.samples}
        others = [r for r in self.engine.requests.values() if r.request_id not in ours]
        return len(ours) + sum(1 for r in others if not r.is_finished)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Cancels requests by their ids (one or several, as vLLM's); unknown ids are ignored."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            added = self._added.pop(request_id, None)
            for req in added.samples if added else []:
                self.engine.abort(req.request_id)
            if added is None:
                self.engine.abort(request_id)

    def get_tokenizer(self) -> Any:
        """The engine's Hugging Face tokenizer (the checkpoint's, or `tokenizer=`'s)."""
        return self.engine.tokenizer.hf

    @cached_property
    def model_config(self) -> SimpleNamespace:
        """What scripts read of vLLM's `model_config`: `model`, `max_model_len`, `dtype` (the
        weights'), `hf_config` (the checkpoint's transformers config, else tandem's reading of
        it), `get_vocab_size()`."""
        from transformers import AutoConfig

        engine = self.engine
        try:
            hf_config: Any = AutoConfig.from_pretrained(engine.config.model)
        except (OSError, ValueError):  # (one transformers cannot read, as no model_type)
            hf_config = engine.spec
        return SimpleNamespace(
            model=engine.config.model,
            max_model_len=engine.max_model_len,
            dtype=engine.config.torch_dtype,
            hf_config=hf_config,
            get_vocab_size=lambda: engine.spec.vocab_size,
        )

    def get_model_config(self) -> SimpleNamespace:
        return self.model_config

    def __getattr__(self, name: str) -> Any:
        # (tandem's own engine methods: `abort`, `check_integrity`, ...)
        return getattr(self.engine, name)


def _sent_text(req: Request) -> str:
    """The text of `req` a stream would have sent so far: all of a finished request's, else
    what the engine let out (`OutputText.emitted_len`: not what a stop string may yet cut)."""
    text = req.output_text
    if text is None:
        return ""
    return text.text if req.is_finished else text.text[: text.emitted_len]


def _new_part(sample: CompletionOutput, tokens: int, chars: int) -> CompletionOutput:
    """`sample` less its first `tokens` tokens and `chars` characters (reported before)."""
    return replace(
        sample,
        token_ids=sample.token_ids[tokens:],
        text=sample.text[chars:],
        logprobs=None if sample.logprobs is None else sample.logprobs[tokens:],
    )
