"""A token's own bytes, as OpenAI's logprobs give them (`bytes`), so that a client can join
the bytes of tokens that each hold part of a character (an emoji, a CJK character split by
byte-level BPE or by SentencePiece's byte fallback) back into text. The token's decoded text
would give U+FFFD for each such part.

- Byte-level BPE (GPT-2, Llama 3, Qwen, Mistral's tekken): a vocabulary entry spells each
  byte as one printable character; mapping them back gives the bytes.
- SentencePiece (Llama 2, Mistral v0.1): the entry `<0xE2>` (byte fallback) is the byte 0xE2,
  and `▁` in an entry is a space (`▁model` is b" model"; its decoded text alone drops it).
- Anything else (whole-character pieces, added and special tokens): the UTF-8 of the token's
  own decoded text.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes, reversed: the printable Latin-1 bytes stand for
    themselves, the other 68 (controls, space, ...) for code points 256 onwards, in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = chr(256 + n)
    return {char: b for b, char in spelled.items()}


class TokenBytes:
    """`token_bytes(token_id)`: the token's bytes (cached; safe to share)."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        kinds = _decoder_kinds(getattr(hf, "backend_tokenizer", None))
        self._alphabet = byte_level_alphabet() if "ByteLevel" in kinds else None
        self._metaspace = "Metaspace" in kinds or "Replace:▁" in kinds
        self._added = set(getattr(hf, "added_tokens_decoder", None) or ())
        self._cache: dict[int, bytes] = {}
        self.byte_run_ids = _byte_run_ids(hf) if "ByteFallback" in kinds else frozenset()
        """Byte tokens (`<0xE2>`) a ByteFallback decoder decodes run by run: the text of a
        run of them is known only once it ends (an invalid run is one U+FFFD per byte)."""

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id not in self._added:
            piece = self._hf.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
                    return bytes([int(byte.group(1), 16)])
                alphabet = self._alphabet
                if alphabet is not None and piece and all(c in alphabet for c in piece):
                    return bytes(alphabet[c] for c in piece)
                if self._metaspace and piece:
                    return piece.replace("▁", " ").encode("utf-8")
        text: str = self._hf.decode([token_id], skip_special_tokens=False)
        return text.encode("utf-8")


def _decoder_kinds(backend: Any) -> set[str]:
    """The kinds of a `tokenizers` backend's decoder and of the decoders it chains (a Replace
    as "Replace:<what it replaces>")."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return set()
    kinds = set()
    for part in [spec, *(spec.get("decoders") or ())]:
        kind = str(part.get("type"))
        if kind == "Replace":
            kind += ":" + str((part.get("pattern") or {}).get("String"))
        kinds.add(kind)
    return kinds


def _byte_run_ids(hf: Any) -> frozenset[int]:
    vocab = hf.get_vocab() if hasattr(hf, "get_vocab") else {}
    return frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece))
