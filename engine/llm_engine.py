"""The step-level engine both roles run: add requests, step, abort, export/import KV blocks."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tandem.engine import kv_io
from tandem.engine.block_manager import BlockManager
from tandem.engine.checkpoint import build_namespace, model_revision
from tandem.engine.config import EngineConfig
from tandem.engine.errors import (
    InvalidRequestError,
    PromptTooLongError,
    StepFailedError,
)
from tandem.engine.guided import GrammarBook
from tandem.engine.kv_blocks import KVBlocks
from tandem.engine.kv_memory import MemoryBaseline
from tandem.engine.kv_pool_size import kv_bytes_by_utilization, pool_blocks, sizing_memory
from tandem.engine.logprobs import add_prompt_logprobs, token_logprobs, token_ranks
from tandem.engine.model import CausalLM
from tandem.engine.model_config import ModelSpec, load_model_spec
from tandem.engine.model_runner import ModelRunner
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.output_text import OutputText
from tandem.engine.outputs import RequestOutput, StepOutput
from tandem.engine.penalties import bad_word_sequences
from tandem.engine.request import Request, RequestStatus
from tandem.engine.request_output import request_output
from tandem.engine.sampler import NO_TOKEN
from tandem.engine.sampling_params import SamplingParams, truncated_prompt
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.engine.step_sampling import sample_step
from tandem.engine.tokenizer import Tokenizer, ids_outside_vocab
from tandem.engine.weights import load_weights
from tandem.kernels.kv_cache import KVCachePool

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
KVPoolFactory = Callable[[int, int, int, int, int, torch.dtype], KVCachePool]


class LLMEngine:
    """Owns model, KV pool, block manager and scheduler; `step()` runs one batch."""

    def __init__(
        self, config: EngineConfig, *, kv_pool_factory: KVPoolFactory | None = None
    ) -> None:
        """`kv_pool_factory(num_blocks, num_layers, block_size, kv_heads, head_dim, dtype)` lets
        a KV transport place the pool in memory it can share (e.g. a shared-memory region)."""
        self.config = config
        model_dir = Path(config.model)
        self.spec: ModelSpec = load_model_spec(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or model_dir, model_dir)
        # The tokenizer's eos and generation_config.json's (config.json's without that file),
        # as vLLM stops; config.json's eos is not added when generation_config.json has its own.
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.device = config.resolved_device()
        self.model = CausalLM(self.spec, attention_backend=config.attention_backend)
        memory = sizing_memory(config, self.device)  # (`kv_pool_size`)
        baseline = MemoryBaseline.take(memory) if memory is not None else None
        load_weights(self.model, model_dir, config.torch_dtype)
        self.model.to(self.device).eval()
        kv_bytes = None
        if memory is not None and baseline is not None:
            kv_bytes = kv_bytes_by_utilization(
                config, self.spec, self.model, self.device, memory, baseline
            )
        num_blocks, self.max_model_len = pool_blocks(config, self.spec, kv_bytes)
        self.kv_pool = self._allocate_kv_pool(num_blocks, kv_pool_factory)
        self.namespace = build_namespace(
            self.spec,
            revision=config.model_revision or model_revision(model_dir),
            tokenizer_digest=self.tokenizer.digest(),
            kv_dtype=config.dtype,
        )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            enable_kv_events=config.enable_kv_events,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            self.namespace.root_hash(),
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.runner = ModelRunner(self.model, self.kv_pool)
        self.output_processor = OutputProcessor(
            self.max_model_len, getattr(self.tokenizer.hf, "eos_token_id", None)
        )
        self.grammars = GrammarBook(self.tokenizer.hf, self.spec.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.last_step_tokens = 0  # tokens the last `step()` ran through the model
        self.last_step_prompt_tokens = 0  # of them, in prompt chunks (a sampled token is 1)
        self._ids = itertools.count()
        torch.manual_seed(config.seed)
        logger.info(
            "engine ready: %s (%s, %d layers) on %s dtype=%s kv_blocks=%d x %d tokens "
            "max_model_len=%d",
            model_dir.name,
            self.spec.architecture,
            self.spec.num_layers,
            self.device,
            config.dtype,
            num_blocks,
            config.block_size,
            self.max_model_len,
        )

    def _allocate_kv_pool(self, num_blocks: int, factory: KVPoolFactory | None) -> KVCachePool:
        """On the CPU a transport's factory may place the pool (e.g. in shared memory); on a GPU
        the pool is plain device memory, which the torch transport sends over NCCL."""
        dims = (
            num_blocks,
            self.spec.num_layers,
            self.config.block_size,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.config.torch_dtype,
        )
        if self.device.type == "cpu":
            return (factory or KVCachePool)(*dims)
        if factory is not None:
            logger.info("KV pool on %s: the transport's host-memory pool is not used", self.device)
        return KVCachePool(*dims, device=self.device)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        stream_text: bool = False,
        keep_kv: bool = False,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Validates and queues a request. `stream_text` fills `StepOutput.text_delta`;
        `keep_kv` holds the request's blocks after it finishes until `release_kv`."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequestError(
                f"n={params.n}: an engine request is one sample; add one per sample "
                "(LLM.generate does)"
            )
        token_ids = self._tokenize(prompt, params.truncate_prompt_tokens)
        self._check_token_fields(params)
        if params.max_tokens is None:  # up to the end of the context
            room = max(1, self.max_model_len - len(token_ids))
            params = params.model_copy(update={"max_tokens": max(room, params.min_tokens)})
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        output_text = None
        if (stream_text or params.stop) and params.detokenize:
            output_text = OutputText.after(self.tokenizer, token_ids, params=params)
        req = Request(
            request_id,
            token_ids,
            params,
            self.eos_token_ids,
            arrival_time=arrival_time,
            output_text=output_text,
            keep_kv=keep_kv,
            priority=priority,
        )
        self.attach_constraints(req)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def attach_constraints(self, req: Request, matcher: Any = None) -> None:
        """Gives a request what constrains its sampling, made with this engine's tokenizer:
        its `bad_words` as token sequences, and with structured output its grammar matcher,
        advanced past the output it already has (a request that was prefilled elsewhere;
        `matcher`: one already past it). InvalidRequestError for an unusable grammar, or an
        output it refuses."""
        if req.params.bad_words:
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            req.bad_words_ids = bad_word_sequences(req.params.bad_words, encode)
        structure = req.params.structure
        if structure is None:
            return
        if matcher is not None:
            req.matcher = matcher
            return
        req.matcher = self.grammars.matcher_for(req.params, req.prompt_token_ids)
        for token in req.output_token_ids:
            if not req.matcher.accept_token(token):
                raise InvalidRequestError(
                    f"token {token} does not follow the request's {structure[0]}"
                )

    def _check_token_fields(self, params: SamplingParams) -> None:
        """The token ids `allowed_token_ids` and `logit_bias` name are the model's (as vLLM
        refuses others: an allowed set of unknown ids would end the request at once)."""
        vocab = self.spec.vocab_size
        for name, ids in (
            ("allowed_token_ids", params.allowed_token_ids),
            ("logit_bias", list(params.logit_bias or ())),
        ):
            if ids and (bad := ids_outside_vocab(ids, vocab)):
                raise InvalidRequestError(
                    f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab})", name
                )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) == -1:  # (LLM's spelling, which it turns into the count)
                raise InvalidRequestError(f"{name} -1: ask for a count (at most {vocab})", name)

    def _tokenize(self, prompt: Prompt, keep: int | None = None) -> list[int]:
        """The prompt's token ids, checked; `keep` (vLLM's `truncate_prompt_tokens`): only its
        last that many (-1: as many as fit, one generated token after them)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.spec.vocab_size
        if bad := ids_outside_vocab(token_ids, vocab):  # (text too: a larger tokenizer)
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        if keep is not None:
            token_ids = truncated_prompt(token_ids, keep, self.max_model_len)
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        return token_ids

    def abort(self, request_id: str) -> bool:
        """Cancels a request; its blocks are freed (also when it keeps KV). False if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        req.keep_kv = False
        self.scheduler.remove(req)
        if not req.is_finished:
            req.set_status(RequestStatus.CANCELLED)
            req.finish_reason = "abort"
        return True

    def release_kv(self, request_id: str) -> None:
        """Frees the blocks a finished `keep_kv` request still holds (one still running is
        refused: `abort` it; its blocks would go while the scheduler still ran it)."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        if not req.is_finished:
            raise ValueError(f"request {request_id!r} has not finished: abort it instead")
        del self.requests[request_id]
        req.keep_kv = False
        self.scheduler.free_blocks(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedules and runs one batch; returns the new token of every request that got one."""
        out = self.scheduler.schedule()
        self.last_step_tokens = out.num_batched_tokens
        self.last_step_prompt_tokens = sum(n for _, n in out.scheduled if n > 1)
        if out.is_empty:
            return []
        try:
            return self._run_batch(out)
        except Exception as exc:
            ids = tuple(req.request_id for req, _ in out.scheduled)
            raise StepFailedError(ids, exc) from exc

    def _run_batch(self, out: SchedulerOutput) -> list[StepOutput]:
        logits, to_sample, spans = self.runner.run(out)  # (on the model's device)
        self.scheduler.advance(out)
        if spans:  # (prompt logprobs are worked out on the host)
            logits = logits.cpu()
            add_prompt_logprobs(logits, spans)
        if not to_sample:
            return []
        extra = [i for i, r in enumerate(to_sample) if r.sampling_extras]
        tokens, raw, rows = sample_step(logits[: len(to_sample)], to_sample, extra)
        for i in extra:
            matcher = to_sample[i].matcher
            if tokens[i] == NO_TOKEN:
                logger.warning("request %s allows no token: it ends here", to_sample[i])
            elif matcher is not None and not matcher.accept_token(tokens[i]):
                logger.error("request %s: its grammar refused a token it allowed", to_sample[i])
        outputs = self.output_processor.process(to_sample, tokens)
        if raw is not None:
            self._add_logprobs(raw, rows, to_sample, tokens, outputs)
        for req, result in zip(to_sample, outputs, strict=True):
            if result.finished:
                self._finish(req)
        return outputs

    @staticmethod
    def _add_logprobs(
        raw: torch.Tensor,
        rows: list[int],
        requests: list[Request],
        tokens: list[int],
        outputs: list[StepOutput],
    ) -> None:
        keep = [j for j, i in enumerate(rows) if tokens[i] != NO_TOKEN]
        if len(keep) < len(rows):  # (a request that allowed no token got none)
            raw, rows = raw[keep], [rows[j] for j in keep]
            if not rows:
                return
        picked = [requests[i] for i in rows]
        chosen = [tokens[i] for i in rows]
        entries = token_logprobs(raw, chosen, [r.params.logprobs or 0 for r in picked])
        ranks = token_ranks(raw, chosen)
        for i, req, entry, rank in zip(rows, picked, entries, ranks, strict=True):
            assert req.logprobs is not None
            req.logprobs.append(entry)
            req.logprob_ranks.append(rank)
            outputs[i] = outputs[i]._replace(logprobs=[entry])

    def _finish(self, req: Request) -> None:
        req.set_status(RequestStatus.FINISHED)
        self.scheduler.remove(req)
        if not req.keep_kv:
            del self.requests[req.request_id]

    def make_output(self, req: Request, prompt: str | None = None) -> RequestOutput:
        """The result of `req` as vLLM's `RequestOutput` (`request_output.py`)."""
        return request_output(req, self.tokenizer, prompt)

    def make_samples_output(self, samples: list[Request], prompt: str | None) -> RequestOutput:
        """One prompt's samples (engine requests) as one `RequestOutput`, as vLLM's: each
        sample in `outputs`, indexed; the flat fields the first's."""
        first, *others = [self.make_output(req, prompt) for req in samples]
        first.outputs = [replace(out.outputs[0], index=i) for i, out in enumerate([first, *others])]
        return first

    # ---- KV hand-off between engines (prefill -> decode) -------------------------------------------
    def export_kv(self, request_id: str) -> KVBlocks:
        """The request's computed KV blocks as one contiguous array, with their block hashes."""
        return kv_io.export_kv(self, request_id)

    def import_request(
        self,
        request_id: str,
        kv: KVBlocks,
        output_token_ids: list[int],
        params: SamplingParams,
        *,
        stream_text: bool = False,
    ) -> Request:
        """Commits a request prefilled elsewhere into this engine's running batch."""
        return kv_io.import_request(
            self, request_id, kv, output_token_ids, params, stream_text=stream_text
        )

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def check_integrity(self) -> None:
        """Block-manager invariants, with ref counts matched against live requests' tables."""
        tables = [r.block_table for r in self.requests.values() if r.block_table]
        self.block_manager.check_integrity(tables)
