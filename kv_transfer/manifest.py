"""What travels with every page transfer, and the check that refuses pages of another model.

Headers are JSON (never pickle): a manifest names the request, the cache namespace and the exact
KV layout of the pages, which source blocks they came from and which reserved blocks they go to.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.errors import TandemError
from tandem.engine.outputs import TokenLogprob
from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer.base import EncodedHeader

POOL_LAYOUT = "block,layer,kv,slot,head,dim"
"""The order of a block's dimensions in `KVCachePool` (one block = one contiguous region)."""


class TransferError(TandemError):
    """A KV transfer failed (refused manifest, timeout, peer gone, cancelled)."""


class ManifestMismatchError(TransferError):
    """Pages were computed for another model, tokenizer, dtype or layout than the receiver's."""


class KVLayout(BaseModel):
    """Everything that must be equal on both sides for pages to mean the same thing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: str = POOL_LAYOUT

    @classmethod
    def of_pool(cls, pool: KVCachePool, namespace: str) -> KVLayout:
        return cls(
            namespace=namespace,
            block_size=pool.block_size,
            num_layers=pool.num_layers,
            num_kv_heads=pool.num_kv_heads,
            head_dim=pool.head_dim,
            dtype=str(pool.dtype).removeprefix("torch."),
        )

    def check_matches(self, expected: KVLayout) -> None:
        """Raises `ManifestMismatchError` naming every field that differs."""
        diffs = [
            f"{name}: sent {getattr(self, name)!r}, expected {getattr(expected, name)!r}"
            for name in type(self).model_fields
            if getattr(self, name) != getattr(expected, name)
        ]
        if diffs:
            raise ManifestMismatchError("KV pages do not match this model: " + "; ".join(diffs))


class ChunkManifest(BaseModel):
    """One chunk of a request's pages: src blocks on the sender, reserved dst blocks on the receiver.

    `num_tokens` counts the tokens whose KV is complete once this chunk has landed. The last chunk
    carries the first sampled token(s) and the sampler state, and commits the request; only one
    whose header says the request `finished` may carry none (its constraints allowed no token:
    the receiver checks that).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    layout: KVLayout
    chunk_index: int = Field(ge=0)
    last: bool
    num_tokens: int = Field(ge=0)
    src_block_ids: list[int]
    dst_block_ids: list[int]
    checksum: str | None = None
    first_token_ids: list[int] = Field(default_factory=list)
    sampler_state: str | None = None  # base64 of torch.Generator state bytes

    def model_post_init(self, __context: Any) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError("src_block_ids and dst_block_ids differ in length")


class PagesHeaderWriter:
    """Writes the header of a chunk of pages (``{"type": "pages", "request_id", "manifest"[,
    "finished"]}``, the manifest a `ChunkManifest` as JSON) together with its JSON text.

    This runs once per chunk on a prefill's hot path (its publishing thread, `ChunkPublisher`,
    or its engine's thread right after a forward pass), where caches are cold. The text is written on first use, from pieces (the layout's
    JSON written once, integer lists by `str`): a third of what `json.dumps` costs there
    (measured ~35 against ~100 us for a 16-block chunk), and nothing for the chunks that the shm
    and ucx transports' pull paths send as compact records (`EncodedHeader.plain_chunk_layout`).
    """

    PREFIXES = 256
    """Requests whose header text up to the chunk index is kept (a stream's chunks share it)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._layout_dict = layout.model_dump(mode="json")
        self._layout_text = json.dumps(self._layout_dict, separators=(",", ":"))
        self._prefixes: dict[str, str] = {}

    def _prefix(self, request_id: str) -> str:
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            if len(self._prefixes) >= self.PREFIXES:
                self._prefixes.clear()
            rid = encode_basestring_ascii(request_id)
            prefix = (
                f'{{"type":"pages","request_id":{rid},"manifest":{{"request_id":{rid},'
                f'"layout":{self._layout_text},"chunk_index":'
            )
            self._prefixes[request_id] = prefix
        return prefix

    def write(
        self,
        request_id: str,
        chunk_index: int,
        *,
        last: bool,
        num_tokens: int,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        checksum: str | None = None,
        first_token_ids: Sequence[int] = (),
        sampler_state: str | None = None,
        finished: bool | None = None,
        first_token_logprobs: Sequence[TokenLogprob] | None = None,
    ) -> EncodedHeader:
        src, dst, first = list(src_block_ids), list(dst_block_ids), list(first_token_ids)
        if not set(map(type, src + dst + first)) <= {int}:  # (then `str` of a list is its JSON)
            raise TypeError(f"block and token ids must be ints, got {src!r} {dst!r} {first!r}")
        header = self.plain_chunk(request_id, int(chunk_index), int(num_tokens), src, dst)
        if last or checksum is not None or first or sampler_state is not None:
            header["manifest"].update(
                last=last, checksum=checksum, first_token_ids=first, sampler_state=sampler_state
            )
            header.plain_chunk_layout = None
        if finished is not None:  # (not in a compact record either)
            header["finished"] = finished
            header.plain_chunk_layout = None
        if first_token_logprobs is not None:  # (outside the manifest: not about the pages)
            header["first_token_logprobs"] = [
                [lp, [list(t) for t in top]] for lp, top in first_token_logprobs
            ]
            header.plain_chunk_layout = None
        return header

    def plain_chunk(
        self,
        request_id: str,
        chunk_index: int,
        num_tokens: int,
        src_block_ids: list[int],
        dst_block_ids: list[int],
    ) -> EncodedHeader:
        """`write` of a chunk other than the request's last, with no checksum, in fewer steps
        (the publishing thread's GIL time is what the engine's thread may wait for). The lists are kept as they are (the caller does not
        change them), and checked when the text is written: a transport that sends the chunk
        as a compact record (`_chunk_records`) needs no text."""
        manifest = {
            "request_id": request_id,
            "layout": self._layout_dict,
            "chunk_index": chunk_index,
            "last": False,
            "num_tokens": num_tokens,
            "src_block_ids": src_block_ids,
            "dst_block_ids": dst_block_ids,
            "checksum": None,
            "first_token_ids": [],
            "sampler_state": None,
        }
        header = {"type": "pages", "request_id": request_id, "manifest": manifest}
        return EncodedHeader(header, self._text, self._layout_text)

    def _text(self, header: EncodedHeader) -> str:
        """The JSON text of a header `write` made, from pieces (on first use)."""
        m = header["manifest"]
        ids = m["src_block_ids"] + m["dst_block_ids"]
        if not set(map(type, ids)) <= {int}:  # (`plain_chunk` leaves the check to here)
            raise TypeError(f"block ids must be ints, got {ids!r}")
        checksum, sampler_state = m["checksum"], m["sampler_state"]
        parts = [
            self._prefix(m["request_id"]),
            str(m["chunk_index"]),
            ',"last":true' if m["last"] else ',"last":false',
            ',"num_tokens":',
            str(m["num_tokens"]),
            ',"src_block_ids":',
            str(m["src_block_ids"]),
            ',"dst_block_ids":',
            str(m["dst_block_ids"]),
            ',"checksum":',
            "null" if checksum is None else encode_basestring_ascii(checksum),
            ',"first_token_ids":',
            str(m["first_token_ids"]),
            ',"sampler_state":',
            "null" if sampler_state is None else encode_basestring_ascii(sampler_state),
            "}",
        ]
        if "finished" in header:
            parts.append(',"finished":true' if header["finished"] else ',"finished":false')
        if "first_token_logprobs" in header:
            parts += (',"first_token_logprobs":', json.dumps(header["first_token_logprobs"]))
        parts.append("}")
        return "".join(parts)


def pages_checksum(pages: torch.Tensor) -> str:
    """xxh3-64 hex digest of the raw bytes of a contiguous page tensor (on any device)."""
    raw = pages.contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
    return xxhash.xxh3_64_hexdigest(raw.tobytes())


def encode_state(state: torch.Tensor | None) -> str | None:
    if state is None:
        return None
    return base64.b64encode(state.numpy().tobytes()).decode()


def decode_state(text: str | None) -> torch.Tensor | None:
    if text is None:
        return None
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
