"""`tandem.LLM`: offline batched generation on the engine (vLLM-style API)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from tqdm import tqdm

from tandem.engine.config import EngineConfig
from tandem.engine.errors import InvalidRequestError
from tandem.engine.generation_defaults import sampling_defaults
from tandem.engine.guided import check_enforceable
from tandem.engine.llm_engine import KVPoolFactory, LLMEngine
from tandem.engine.llm_inputs import (
    Prompts,
    engine_samples,
    params_per_prompt,
    parse_prompts,
    salted,
    template_message,
)
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from tandem.engine.vllm_engine import VllmStyleEngine

logger = logging.getLogger(__name__)


class LLM:
    """Loads a local Hugging Face checkpoint and generates for a batch of prompts, on a CUDA
    GPU when there is one (`device="auto"`, as vLLM uses the GPU; `device="cpu"` stays off it).

    >>> llm = LLM(model="/path/to/checkpoint")
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    >>> out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))

    Prompts are texts, token id lists, or vLLM's dicts (`{"prompt": ...}` or
    `{"prompt_token_ids": [...]}`, either with a `"cache_salt"`: see `SamplingParams`).
    """

    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        kv_pool_factory: KVPoolFactory | None = None,
        **kwargs: Any,
    ) -> None:
        self._max_logprobs = _max_logprobs(kwargs.pop("max_logprobs", MAX_LOGPROBS))
        kwargs = _without_vllm_only(kwargs)
        config = EngineConfig(
            model=str(model),
            dtype=str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype,
            device=device,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            **kwargs,
        )
        self.engine = LLMEngine(config, kv_pool_factory=kv_pool_factory)
        self._vllm_engine = VllmStyleEngine(
            self.engine, self._prepared, self.get_default_sampling_params
        )
        self._sampling_defaults = sampling_defaults(config.model, config.generation_config)

    def _prepared(self, params: SamplingParams) -> SamplingParams:
        """`params` checked for this engine, with logprobs -1 (the whole vocabulary, as vLLM)
        as the vocabulary's size; InvalidRequestError for more than `max_logprobs` (-1 there:
        no bound) or a structure the grammar engine cannot hold the output to."""
        check_enforceable(params.structure)
        vocab = self.engine.spec.vocab_size
        bound = vocab if self._max_logprobs is None else self._max_logprobs
        whole = {}
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked == -1:
                asked = whole[name] = vocab
            if asked is not None and asked > bound:
                raise InvalidRequestError(
                    f"{name}: requested {asked}, more than max_logprobs ({bound})", name
                )
        return params.model_copy(update=whole) if whole else params

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no `SamplingParams`: the model's own
        sampling settings from its generation_config.json (`generation_config="none"`: none),
        over SamplingParams' defaults, as vLLM's `LLM` does."""
        return SamplingParams(**self._sampling_defaults)

    @property
    def llm_engine(self) -> VllmStyleEngine:
        """vLLM's `LLMEngine` over this one (`add_request(request_id, prompt, params)`,
        `step()`, `get_tokenizer()`, `model_config`: `vllm_engine.py`)."""
        return self._vllm_engine

    def reset_prefix_cache(self) -> bool:
        """Forgets the cached prefixes of the blocks no request holds (vLLM's: benchmarks run
        it between repeats so that none hits the last one's prompts); True, as vLLM's."""
        self.engine.block_manager.reset_prefix_cache()
        return True

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedTaskError("beam search is not supported by tandem: use n > 1 samples")

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedTaskError(
            "pooling (encode, embed, classify, score, reward) is not supported by tandem: "
            "it serves generative models"
        )

    embed = classify = score = reward = encode

    def sleep(self, level: int = 1) -> None:
        raise NotImplementedError("sleep mode is not supported by tandem")

    wake_up = sleep

    def get_tokenizer(self) -> Any:
        """The engine's Hugging Face tokenizer (the checkpoint's, or `tokenizer=`'s), as vLLM's
        `get_tokenizer()` returns (`apply_chat_template(..., tokenize=False)` and all;
        `tokenizer` is tandem's own)."""
        return self.engine.tokenizer.hf

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """`generate` for one conversation or a list of them, each rendered with the
        checkpoint's chat template (as the chat completions API renders it), or with
        `chat_template` (Jinja text) instead; `tools` (OpenAI's function specs) go to the
        template, as vLLM's `LLM.chat` passes them. A message's content may be OpenAI's list of
        text parts (joined with newlines, as the API and vLLM join them, whatever
        `chat_template_content_format`). `chat_template_kwargs` are more template variables
        (`documents` among them), and may set the other template arguments too, as vLLM's.
        The arguments come in vLLM's order."""
        _no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise InvalidRequestError(
                "chat_template_content_format: one of 'auto', 'string', 'openai'"
            )
        if mm_processor_kwargs:
            raise InvalidRequestError("mm_processor_kwargs: this model takes text only")
        # (as vLLM's: `chat_template_kwargs` may set the other arguments too, and win)
        template_kwargs = dict(chat_template_kwargs or {})
        render: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": tools,
            "chat_template": chat_template,
        }
        render.update({k: template_kwargs.pop(k) for k in render if k in template_kwargs})
        if render["chat_template"] is None and not self.engine.tokenizer.hf.chat_template:
            raise InvalidRequestError(
                "the checkpoint's tokenizer has no chat template: pass one as chat_template= "
                "(Jinja text), or use generate() with a prompt"
            )
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(
            "list[list[dict[str, Any]]]", [messages] if one else [list(c) for c in messages]
        )
        if not all(isinstance(m, Mapping) for c in conversations for m in c):
            raise InvalidRequestError(
                "messages: a conversation is a list of dicts with 'role' and 'content' "
                "(or give a list of such conversations)"
            )
        prompts = [
            self.engine.tokenizer.apply_chat_template(
                [template_message(m) for m in conversation],
                template_kwargs=template_kwargs,
                **render,
            )
            for conversation in conversations
        ]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for out in outputs:  # the rendered conversation, as vLLM's `prompt` holds it
            out.prompt = self.engine.tokenizer.decode(
                out.prompt_token_ids, skip_special_tokens=False
            )
        return outputs

    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one `RequestOutput` per prompt, in input order,
        with `SamplingParams.n` samples in its `outputs` (sample i seeded `seed + i`).
        `priority`: one per prompt; lower values are scheduled first (vLLM's)."""
        _no_lora(lora_request)
        prompt_list, salts = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        param_list = salted(params_per_prompt(sampling_params, len(prompt_list)), salts)
        priorities = [0] * len(prompt_list) if priority is None else [int(p) for p in priority]
        if len(priorities) != len(prompt_list):
            raise InvalidRequestError(
                f"got {len(priorities)} priorities for {len(prompt_list)} prompts"
            )
        engine = self.engine
        requests: list[Request] = []
        try:
            for index, (prompt, p) in enumerate(zip(prompt_list, param_list, strict=True)):
                try:
                    for sample in engine_samples(self._prepared(p)):
                        requests.append(
                            engine.add_request(prompt, sample, priority=priorities[index])
                        )
                except InvalidRequestError as exc:
                    if len(prompt_list) == 1:
                        raise
                    # say which prompt of the batch (vLLM's message does not)
                    raise type(exc)(f"prompt {index}: {exc}", exc.param) from exc
        except Exception:
            for req in requests:
                engine.abort(req.request_id)
            raise
        # (as vLLM's: a bar on stderr unless use_tqdm is False; a callable makes the bar)
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        bar = make_bar(total=len(requests), desc="Processed prompts", disable=not use_tqdm)
        remaining = len(requests)
        own = {req.request_id for req in requests}  # (the engine may run others' requests too)
        try:
            while remaining:
                for result in engine.step():
                    if result.finished and result.request_id in own:
                        remaining -= 1
                        bar.update(1)
        except BaseException:  # a failed step (or Ctrl-C): none of these stays in the engine
            for req in requests:
                engine.abort(req.request_id)
            raise
        finally:
            bar.close()
        results = []
        samples = iter(requests)
        for prompt, p in zip(prompt_list, param_list, strict=True):
            text = prompt if isinstance(prompt, str) else None
            results.append(engine.make_samples_output([next(samples) for _ in range(p.n)], text))
        return results


# vLLM's engine arguments that mean nothing to this engine (no CUDA graphs, no remote code,
# no CPU swap)
_VLLM_IGNORED = (
    "trust_remote_code",
    "enforce_eager",
    "disable_log_stats",
    "swap_space",
    "max_seq_len_to_capture",
    "disable_custom_all_reduce",
    "task",
    "tokenizer_mode",
    "disable_async_output_proc",
    "distributed_executor_backend",
    "compilation_config",
    "download_dir",
    "runner",
    "load_format",
    "limit_mm_per_prompt",
)


def _max_logprobs(value: Any) -> int | None:
    """vLLM's `max_logprobs` (-1: no bound, the whole vocabulary may be asked for)."""
    value = MAX_LOGPROBS if value is None else int(value)
    if value < -1:
        raise ValueError(f"max_logprobs: 0 or more (or -1: no bound), got {value}")
    return None if value == -1 else value


class UnsupportedTaskError(ValueError, NotImplementedError):
    """A task of vLLM's `LLM` this engine does not do: a ValueError as vLLM raises for a task
    the model does not support (and a NotImplementedError)."""


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported")


def _without_vllm_only(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` less vLLM's arguments: those that change nothing here are dropped (and logged);
    those asking for what this engine does not do are refused by name (ValueError)."""
    kwargs = dict(kwargs)
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if kwargs.pop(name, 1) != 1:
            raise ValueError(f"{name} > 1 is not supported: an engine runs on one device")
    if kwargs.pop("quantization", None) is not None:
        raise ValueError("quantization is not supported: weights load as float32/16 or bfloat16")
    if kwargs.pop("kv_cache_dtype", "auto") != "auto":
        raise ValueError("kv_cache_dtype: the KV cache has the model's dtype ('auto' only)")
    kv_bytes = kwargs.pop("kv_cache_memory_bytes", None)
    if kv_bytes is not None:  # vLLM's exact size of the pool
        kwargs.setdefault("kv_cache_memory_gb", int(kv_bytes) / (1 << 30))
    if kwargs.get("tokenizer") is not None:  # (a directory, or a repo id the cache holds)
        kwargs["tokenizer"] = str(kwargs["tokenizer"])
    if kwargs.pop("scheduling_policy", "fcfs") not in ("fcfs", "priority"):
        raise ValueError("scheduling_policy: 'fcfs' or 'priority' (a request's priority counts)")
    if kwargs.get("runner", "auto") not in ("auto", "generate"):
        raise ValueError(f"runner={kwargs['runner']!r}: only text generation ('generate')")
    if kwargs.get("load_format", "auto") not in ("auto", "safetensors", "pt"):
        raise ValueError(
            f"load_format={kwargs['load_format']!r}: 'auto', 'safetensors' or 'pt' (the "
            "checkpoint's safetensors, else its .bin files)"
        )
    mode = kwargs.pop("logprobs_mode", "raw_logprobs")
    if mode != "raw_logprobs":  # (vLLM's default, what this engine returns)
        raise ValueError(
            f"logprobs_mode={mode!r}: logprobs are the model's own ('raw_logprobs' only)"
        )
    if "seed" in kwargs and kwargs["seed"] is None:  # (vLLM's "no seed": the engine's default)
        del kwargs["seed"]
    for name in _VLLM_IGNORED:
        if name in kwargs:
            logger.info("LLM: %s=%r is vLLM's and changes nothing here", name, kwargs.pop(name))
    for name in [n for n in kwargs if n not in EngineConfig.model_fields]:
        value = kwargs.pop(name)
        if value not in _NO_OP_VALUES:  # (vLLM's arguments at their defaults pass)
            raise ValueError(f"{name}={value!r}: vLLM's argument is not supported by tandem")
    return kwargs


_NO_OP_VALUES: tuple[Any, ...] = (None, False, 0, "auto", "main", {}, [])
"""The values with which an engine argument tandem does not know asks for nothing (vLLM's
defaults: `revision="main"`, `enable_lora=False`, `cpu_offload_gb=0`, `load_format="auto"`)."""
