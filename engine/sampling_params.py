"""Sampling parameters of one request (vLLM-compatible names and defaults)."""

from __future__ import annotations

import logging
import math
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tandem.engine.errors import InvalidRequestError, summarize_validation
from tandem.engine.seeds import SEED_MAX, SEED_MIN, no_seed_as_none
from tandem.engine.vllm_compat import (
    RequestOutputKind,
    SamplingType,
    StructuredOutputsParams,
    structure_fields,
)

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20
"""Most alternatives a request may ask log-probabilities of, per token, by default (vLLM's
`max_logprobs`): the API's bound, and `LLM`'s unless it is given another."""
MAX_BAD_WORDS = 1024
"""Most `bad_words` a request may give: each is tokenized when the request starts and checked
at every step it runs (40,000 held a prefill worker's loop for 20 s: its other requests
failed as if it were gone)."""
STRUCTURE_KINDS = ("json_schema", "regex", "choice", "grammar")
"""The fields that constrain the output's structure; a request sets at most one."""


def truncated_prompt(
    token_ids: list[int], keep: int, max_model_len: int, room: int = 1
) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens; -1: as many as fit in
    `max_model_len` with `room` left to generate. ValueError when that leaves none."""
    if keep == -1:
        keep = max_model_len - room
    if keep < 1:
        raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
    return token_ids[-keep:]


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop.

    `n` samples per prompt (`LLM.generate`; an engine request is one sample: the router and
    `LLM` add one per sample, seeded `seed`, `seed + 1`, ...). `temperature` 0 means greedy
    (one above 0 but under 0.01 samples at 0.01, as vLLM). Sampling applies temperature, then
    `min_p` (drops tokens less likely than `min_p` times the most likely; 0 disables), `top_k`,
    `top_p`. `seed` makes
    sampling reproducible for this request whatever else shares the batch (-1: no seed, as
    vLLM). `stop` strings are
    cut from the returned text (kept, and what follows cut, with `include_stop_str_in_output`);
    Special tokens (EOS, chat markers) add nothing to the text unless `skip_special_tokens` is
    False. `truncate_prompt_tokens` keeps the prompt's last k tokens (-1: as many as the context
    holds). `stop_token_ids` and the model's EOS end generation (EOS unless `ignore_eos`),
    never before `min_tokens` tokens.
    `logprobs` (None: none) returns, for each generated token, its log-probability and those of
    the `logprobs` most likely tokens, under the model's distribution (its logits before
    temperature, top-k, top-p and `min_tokens`, as vLLM returns them). `prompt_logprobs` does the
    same for each prompt token after the first (the request then computes its whole prompt:
    no prefix-cache hits). The penalties are
    transformers' `repetition_penalty` (prompt and output) and OpenAI's `presence_penalty` and
    `frequency_penalty` (output only); see `penalties.py`. `logit_bias` adds to the logits of
    the given token ids (OpenAI's, -100 to 100) before sampling; `allowed_token_ids` masks
    out every other token; `bad_words` are never completed (the token that would end one is
    masked out, `penalties.py`). Structured output (`guided.py`),
    at most one of: `json_schema` (JSON that follows it), `regex` (text the regular expression
    matches whole), `choice` (exactly one of these strings), `grammar` (text of an EBNF grammar,
    xgrammar's dialect, whose start rule is `root`). `reasoning_tags` (open, close), e.g.
    `("<think>", "</think>")`, let a reasoning model think freely before the structure
    constrains its answer (`reasoning_gate.py`; the router sets them when it has a reasoning
    parser). `resumed_tokens`: the prompt's last tokens are this request's own output, streamed
    by an attempt whose worker was lost (the router sets it): the seeded sampler's draws, the
    presence and frequency penalties and `bad_words` go on from them as one attempt would have.
    `cache_salt` (vLLM's, which takes it with the prompt): the request shares prefix-cache blocks
    only with requests of the same salt (`hashing.salted_root`); None shares with all unsalted.
    """

    # (mutable, as vLLM's: scripts set fields of `get_default_sampling_params()`; each
    # assignment is checked as the constructor checks it)
    model_config = ConfigDict(validate_assignment=True, extra="forbid", allow_inf_nan=False)

    n: int = Field(1, ge=1, le=128)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled (vLLM's default 0, and it keeps a given -1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: int | None = 16  # None: up to the end of the context (as vLLM)
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)  # (None given: [], as vLLM)
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # (vLLM's: false, with special tokens kept,
    # an added token right after another is written without the space a decoder puts first)
    detokenize: bool = True  # False: token ids only, `text` stays "" (vLLM's)
    logits_processors: list[Any] | None = None  # vLLM's; only None or [] (none are run here)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    ignore_eos: bool = False
    # (-1: the whole vocabulary, where `LLM(max_logprobs=-1)`; bounded by it, and the API's)
    logprobs: int | None = Field(None, ge=-1)
    prompt_logprobs: int | None = Field(None, ge=-1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[int, Annotated[float, Field(allow_inf_nan=True)]] | None = None
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    json_schema: dict[str, Any] | None = None
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    reasoning_tags: tuple[str, str] | None = None
    resumed_tokens: int = Field(0, ge=0)
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's, for scripts that set them: `best_of` only n (no ranking), `output_kind`
    # (`RequestOutputKind`: `LLM.generate` returns finished outputs whatever it is),
    # `extra_args` (kept for whoever reads them; no sampling step does, as in vLLM)
    best_of: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None

    def __init__(self, **data: object) -> None:
        for name in ("structured_outputs", "guided_decoding"):  # vLLM's offline spellings
            if name in data:
                data.update(structure_fields(name, data.pop(name)))
        try:
            super().__init__(**data)
        except ValidationError as exc:
            where = exc.errors()[0]["loc"] if exc.errors() else ()
            raise InvalidRequestError(
                f"invalid sampling parameters: {summarize_validation(exc)}",
                str(where[0]) if where and isinstance(where[0], str) else None,
            ) from None

    def __setattr__(self, name: str, value: object) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:  # (the constructor's one-line error)
            raise InvalidRequestError(
                f"invalid sampling parameters: {summarize_validation(exc)}", name
            ) from None

    @field_validator("seed")
    @classmethod
    def _no_seed(cls, value: int | None) -> int | None:
        return no_seed_as_none(value)

    @field_validator("temperature")
    @classmethod
    def _not_near_zero(cls, value: float) -> float:
        """A temperature above 0 but under `MIN_SAMPLING_TEMPERATURE` samples at that one, as
        vLLM raises it (logits divided by less overflow)."""
        if 0.0 < value < MIN_SAMPLING_TEMPERATURE:
            logger.warning(
                "temperature %g raised to %g (a smaller one overflows the logits; 0 is greedy)",
                value,
                MIN_SAMPLING_TEMPERATURE,
            )
            return MIN_SAMPLING_TEMPERATURE
        return value

    @field_validator("stop", "stop_token_ids", "bad_words", mode="before")
    @classmethod
    def _none_as_empty(cls, value: object, info: ValidationInfo) -> object:
        """None is [] and one stop string a list of it, as vLLM reads them back (scripts add
        to `params.stop_token_ids`)."""
        if value is None:
            return []
        if info.field_name == "stop" and isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is not None:
            # (any bias, as vLLM's offline API: -inf bans a token; the API's range is checked
            # by the router)
            bad = {t: b for t, b in value.items() if t < 0 or not b < math.inf}
            if bad:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and finite or -inf biases: {bad}"
                )
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words_not_blank(cls, value: list[str]) -> list[str]:
        if any(not w.strip() for w in value):
            raise ValueError("bad_words must be non-blank strings")
        return value

    @field_validator("allowed_token_ids", "stop_token_ids")
    @classmethod
    def _token_ids(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError(f"{info.field_name} must be token ids (>= 0)")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {value}")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int) -> int:
        if value < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {value}")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_tokens must be >= 1, got {value}")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        return value

    @field_validator("reasoning_tags")
    @classmethod
    def _tags_not_empty(cls, value: tuple[str, str] | None) -> tuple[str, str] | None:
        if value is not None and not all(value):
            raise ValueError("reasoning tags must be non-empty strings")
        return value

    @field_validator("choice")
    @classmethod
    def _choices_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(c == "" for c in value):
            raise ValueError("choice strings must be non-empty")
        return value

    @model_validator(mode="after")
    def _one_structure(self) -> SamplingParams:
        given = [k for k in STRUCTURE_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(STRUCTURE_KINDS)} may be set: {given}")
        return self

    @model_validator(mode="after")
    def _best_of_is_n(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of={self.best_of} is not supported (no ranking of samples): use n"
            )
        return self

    @field_validator("logits_processors")
    @classmethod
    def _no_logits_processors(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError(
                "per-request logits processors are not supported (as in vLLM's V1 engine): "
                "use logit_bias, allowed_token_ids, bad_words or structured output"
            )
        return None

    @model_validator(mode="after")
    def _stops_need_text(self) -> SamplingParams:
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are found in the text)")
        return self

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens_within_max(cls, value: int, info: ValidationInfo) -> int:
        # (a field check, so that the error names min_tokens: max_tokens is read before it)
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"min_tokens ({value}) must be <= max_tokens ({max_tokens})")
        return value

    @model_validator(mode="after")
    def _max_tokens_above_min(self) -> SamplingParams:
        # (`_min_tokens_within_max` at construction; this one when max_tokens is assigned)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        return self

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `SamplingParams.clone`)."""
        return self.model_copy(deep=True)

    @staticmethod
    def from_optional(**fields: Any) -> SamplingParams:
        """vLLM's: None for a field means its default; `logit_bias` keys may be numeric text,
        and biases are held to OpenAI's [-100, 100]."""
        given = {name: value for name, value in fields.items() if value is not None}
        if "logit_bias" in given:
            try:
                bias = {
                    int(t): min(100.0, max(-100.0, float(b)))
                    for t, b in given["logit_bias"].items()
                }
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    "logit_bias keys must be token ids", "logit_bias"
                ) from None
            given["logit_bias"] = bias
        return SamplingParams(**given)

    @property
    def sampling_type(self) -> SamplingType:
        """vLLM's: greedy, random, or random with a seed."""
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> set[int]:
        """vLLM's: the token ids that end this request besides the model's EOS, which the
        engine adds."""
        return set(self.stop_token_ids)

    @property
    def structured_outputs(self) -> StructuredOutputsParams | None:
        """vLLM's `structured_outputs` read back from the structure fields (None: free text)."""
        kind_value = self.structure
        if kind_value is None:
            return None
        kind, value = kind_value
        return StructuredOutputsParams(**{"json" if kind == "json_schema" else kind: value})

    @property
    def penalized(self) -> bool:
        """Penalties or a logit bias add to this request's logits before sampling."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
        )

    @property
    def adjusts_logits(self) -> bool:
        """Penalties, a logit bias or a grammar change this request's logits before sampling."""
        return self.penalized or self.structure is not None

    @property
    def structure(self) -> tuple[str, Any] | None:
        """The structured output asked for, as (kind, value): one of `STRUCTURE_KINDS` and that
        field's value; None for free text."""
        for kind in STRUCTURE_KINDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or top_k 1."""
        return self.temperature == 0.0 or self.top_k == 1


MIN_SAMPLING_TEMPERATURE = 1e-2
"""The lowest temperature that samples (vLLM's): one above 0 but under it is raised to it."""
