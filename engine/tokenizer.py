"""The engine's tokenizer: a thin, typed wrapper over a local Hugging Face fast tokenizer.

`Tokenizer.from_pretrained(path)` loads with `transformers.AutoTokenizer` (offline, local files
only), so encodings are exactly Hugging Face's. Decoding takes a fast path straight into the Rust
`tokenizers` backend when that gives the same result as `hf.decode` (no clean-up of tokenization
spaces), because the incremental detokenizer calls it once per generated token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import xxhash

from tandem.engine.chat_content import nine_character_call_ids
from tandem.engine.errors import CheckpointError
from tandem.engine.token_bytes import TokenBytes

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""Files that define a tokenizer's behaviour; `Tokenizer.digest` hashes those present."""

_MODEL_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
NO_TOKENIZER_LIMIT = int(1e30)
"""`model_max_length` of loaded tokenizers (transformers' own spelling of "no limit")."""


def ids_outside_vocab(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The ids of `token_ids` outside [0, vocab_size) (a tokenizer may have more than the
    model; a caller may send any); [] at the cost of a min and a max when there are none."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return []
    return [t for t in token_ids if not 0 <= t < vocab_size]


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def generation_eos_token_ids(model_dir: str | Path) -> set[int]:
    """Return the eos ids a checkpoint asks generation to stop at (possibly empty).

    Read from ``generation_config.json`` when present, else from ``config.json`` (as transformers
    does when it builds a generation config from the model config). Either may hold an int or a
    list of ints.
    """
    root = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        if (root / name).is_file():
            return _as_id_set(_read_json(root / name).get("eos_token_id"))
    return set()


def check_tokenizer_files(root: Path) -> None:
    """CheckpointError unless `root` is a directory with a tokenizer's model file: the check
    `Tokenizer.from_pretrained` starts with, cheap for a process that loads no tokenizer."""
    if not root.is_dir():
        raise CheckpointError(f"tokenizer directory {str(root)!r} does not exist")
    if not any((root / name).is_file() for name in _MODEL_FILES):
        raise CheckpointError(
            f"no tokenizer in {str(root)!r}: expected one of {', '.join(_MODEL_FILES)}"
        )


_TOKENIZING_OPTIONS = frozenset(
    {"truncation", "max_length", "padding", "return_tensors", "return_dict", "tokenizer_kwargs",
     "return_assistant_tokens_mask", "tokenize"}
)  # fmt: skip
"""transformers' `apply_chat_template` options about tokenizing its text: not template
variables (vLLM renders text and tokenizes it apart, so none of them changes its prompt)."""


class Tokenizer:
    """A loaded tokenizer plus the checkpoint facts the engine needs (eos ids, digest).

    Instances are immutable after construction and safe to share between requests.
    """

    def __init__(
        self,
        hf: Any,
        *,
        source_dir: str | Path | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        """Wrap an already-loaded HF tokenizer.

        ``source_dir`` (where its files are) is used for `digest`; ``extra_eos_token_ids`` are
        added to the tokenizer's own eos id (e.g. those of ``generation_config.json``).
        """
        self._hf = hf
        self._source_dir = Path(source_dir) if source_dir is not None else None
        eos = _as_id_set(extra_eos_token_ids)
        if getattr(hf, "eos_token_id", None) is not None:
            eos.add(int(hf.eos_token_id))
        self._eos_token_ids = frozenset(eos)
        self._vocab_size = len(hf)
        self._digest: str | None = None
        self._raw_backend = self._fast_backend()  # (decodes without the clean-up)
        cleans = self._raw_backend is not None and (
            getattr(hf, "clean_up_tokenization_spaces", False) and not _cleanup_skipped(hf)
        )
        self._backend = None if cleans else self._raw_backend  # (decodes as hf.decode)
        self._token_bytes = TokenBytes(hf)
        added = getattr(hf, "added_tokens_decoder", None) or {}
        self._added_token_texts = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        specials = {i for i, t in added.items() if getattr(t, "special", False)}
        self._special_ids = frozenset(specials | set(getattr(hf, "all_special_ids", ())))

    @classmethod
    def from_pretrained(cls, path: str | Path, model_dir: str | Path | None = None) -> Tokenizer:
        """Load the tokenizer in the local directory ``path`` (never touches the network).
        The generation eos ids come from ``model_dir``'s config (default: ``path``), for a
        tokenizer kept apart from its checkpoint.

        Raises CheckpointError if the directory or its tokenizer files are missing or unreadable.
        """
        root = Path(path)
        check_tokenizer_files(root)
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        except Exception as exc:  # (also transformers' own refusal of a config.json it checks)
            why = " ".join(str(exc).split())
            raise CheckpointError(f"cannot load the tokenizer in {str(root)!r}: {why}") from exc
        # The engine checks prompt lengths against its own `max_model_len`; the tokenizer's
        # config limit (often the training context) would only log a misleading "Token indices
        # sequence length is longer than ..." warning for a long text that the model takes.
        hf.model_max_length = NO_TOKENIZER_LIMIT
        eos = generation_eos_token_ids(root if model_dir is None else model_dir)
        return cls(hf, source_dir=root, extra_eos_token_ids=eos)

    @property
    def hf(self) -> Any:
        """The underlying transformers tokenizer."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added/special tokens included (``len(hf)``).

        A model's vocab may be larger (padded); ids beyond this decode to nothing.
        """
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's eos plus the checkpoint's generation eos."""
        return self._eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, exactly as ``hf.encode`` gives them."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (part of a character for a byte token: `TokenBytes`)."""
        return self._token_bytes(token_id)

    @property
    def added_token_texts(self) -> dict[int, str]:
        """Each added token's own text (special or not), by id."""
        return self._added_token_texts

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (`skip_special_tokens` leaves them out of the text)."""
        return self._special_ids

    @property
    def byte_run_ids(self) -> frozenset[int]:
        """SentencePiece's byte-fallback tokens, whose text is known once their run ends
        (`TokenBytes.byte_run_ids`; empty for other tokenizers)."""
        return self._token_bytes.byte_run_ids

    def token_text(self, token_id: int) -> str:
        """A token's own text, as logprobs name it (vLLM's `decoded_token`): its bytes as
        UTF-8, so a SentencePiece token keeps its leading space (`▁model` is " model", which
        decoding it alone drops) and part of a character is U+FFFD; special tokens kept."""
        return self._token_bytes(token_id).decode("utf-8", errors="replace")

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, clean_up: bool = True
    ) -> str:
        """Text of ``ids``, exactly as ``hf.decode`` gives it (unknown ids decode to nothing);
        not `clean_up`: without the tokenizer's `clean_up_tokenization_spaces` (which rewrites
        text already written, " ," to ","), as vLLM's detokenizer writes outputs."""
        id_list = ids if isinstance(ids, list) else list(ids)
        backend = self._backend if clean_up else self._raw_backend
        if backend is not None:
            text: str = backend.decode(id_list, skip_special_tokens=skip_special_tokens)
            return text
        raw = {} if clean_up else {"clean_up_tokenization_spaces": False}
        return str(self._hf.decode(id_list, skip_special_tokens=skip_special_tokens, **raw))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Render ``messages`` with the tokenizer's chat template and return the token ids.

        As vLLM: the template writes text, which is then encoded without the tokenizer's
        special tokens (the template writes its own BOS) unless `add_special_tokens`; so
        `template_kwargs` are the template's variables (e.g. Qwen3's `enable_thinking`;
        transformers' tokenizing options such as `truncation` or `max_length` change nothing),
        and may set this call's options (`add_generation_prompt`, `continue_final_message`,
        `tools`, `documents`), which they win over, as vLLM's. `continue_final_message`
        leaves the last message open, for the model to go on with it; `tools` are function specs and `documents` retrieved
        texts for templates that present them; `chat_template` (Jinja text) renders instead
        of the tokenizer's own. transformers raises ValueError if the tokenizer has no chat
        template. A Mistral template (one that writes `[TOOL_CALLS]`) gets tool-call ids of
        its own 9-character form (`nine_character_call_ids`).
        """
        template = chat_template or self._hf.chat_template
        if isinstance(template, str) and "[TOOL_CALLS]" in template:
            messages = nine_character_call_ids(messages)
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _TOKENIZING_OPTIONS}
        options: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": tools,
            "documents": documents,
        }
        options.update({k: kwargs.pop(k) for k in list(options) if k in kwargs})  # (vLLM's win)
        text = self._hf.apply_chat_template(
            messages, tokenize=False, chat_template=chat_template, **options, **kwargs
        )
        return self.encode(str(text), add_special_tokens=add_special_tokens)

    def digest(self) -> str:
        """A stable hex digest (xxh3_128) of what determines tokenization and decoding.

        For a tokenizer loaded from a directory: the content of the files in TOKENIZER_FILES that
        exist there (tokenizer.json, tokenizer_config.json with its chat template, special tokens,
        ...). Otherwise: the backend's serialized JSON, the chat template and the special tokens.
        """
        if self._digest is None:
            h = xxhash.xxh3_128()
            for name, data in self._digest_parts():
                h.update(name.encode())
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
            self._digest = h.hexdigest()
        return self._digest

    def _digest_parts(self) -> list[tuple[str, bytes]]:
        if self._source_dir is not None:
            parts = [
                (name, (self._source_dir / name).read_bytes())
                for name in TOKENIZER_FILES
                if (self._source_dir / name).is_file()
            ]
            if parts:
                return parts
        backend = getattr(self._hf, "backend_tokenizer", None)
        special = json.dumps(
            [str(t) for t in getattr(self._hf, "all_special_tokens", [])], ensure_ascii=False
        )
        template = getattr(self._hf, "chat_template", None)
        return [
            ("backend", (backend.to_str() if backend is not None else repr(self._hf)).encode()),
            ("chat_template", json.dumps(template, ensure_ascii=False, sort_keys=True).encode()),
            ("special_tokens", special.encode()),
        ]

    def _fast_backend(self) -> Any | None:
        """The Rust backend if its decode is ``hf.decode``'s but for the clean-up of
        tokenization spaces, else None."""
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # pragma: no cover - transformers layout changed
            return None
        hf = self._hf
        if (
            not isinstance(hf, TokenizersBackend)
            or type(hf)._decode is not TokenizersBackend._decode
        ):
            return None
        return hf.backend_tokenizer

    def __repr__(self) -> str:
        where = f", source_dir={str(self._source_dir)!r}" if self._source_dir is not None else ""
        return f"Tokenizer(vocab_size={self._vocab_size}{where})"


def _cleanup_skipped(hf: Any) -> bool:
    """Whether transformers 5 skips `clean_up_tokenization_spaces` in this tokenizer's decode
    (a BPE model, as Llama 3's, whose tokenizer_config.json still asks for it: transformers
    warns once and decodes as the backend does), so the backend's own decode is hf.decode's."""
    model = type(hf.backend_tokenizer.model).__name__
    forced = getattr(
        hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
    )
    return model == "BPE" and not forced
