"""Compact binary records for the chunks of a stream, on the shm transport's pull ring (and as
the UCX transport's frames on a link whose receiver pulls, `_ucx_frames.send_chunk_record`).

A prefill engine streams a request's pages as a chunk after every step, and every chunk but the
last says the same things: which request, its index, how many tokens are complete, and which
blocks go where. Writing that as JSON on a prefill's hot path (cold caches) costs tens of
microseconds, so a header that
`PagesHeaderWriter` marks as such a plain chunk (`EncodedHeader.plain_chunk_layout`) travels as
one `struct` record instead, and the receiving side rebuilds exactly the header its JSON text
would have given. The layout's JSON, the same for every chunk of a sender, goes once per link in
a layout record that the chunk records name by index.

Records (little-endian): a layout record is ``b"L"`` and the layout's JSON text. A chunk record
is ``b"C"``, the layout's index (uint16), the request id's length in bytes (uint16), the chunk
index, the token count and the block count n (uint32 each), the request id (UTF-8), then n
source and n destination block ids (int32 each).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.kv_transfer.base import EncodedHeader

CHUNK = b"C"[0]
LAYOUT = b"L"[0]
_FIXED = struct.Struct("<cHHIII")
_STRUCTS: dict[tuple[int, int], struct.Struct] = {}
_MAX_STRUCTS = 512
MAX_LAYOUTS = 64
"""Layouts one link announces for compact records (a sender has one; beyond these, JSON)."""
_PLAIN_KEYS = frozenset({"type", "request_id", "manifest"})  # all a plain chunk's header has


class RecordError(ValueError):
    """A compact record that is malformed or names a layout not announced before it."""


def layout_record(layout_text: str) -> bytes:
    return b"L" + layout_text.encode()


def chunk_record(layout_index: int, manifest: dict[str, Any], src: Sequence[int]) -> bytes:
    """The record of a plain chunk's `manifest` whose layout was announced as `layout_index`.
    `struct.error` when a field does not fit its slot (the caller sends JSON instead)."""
    rid = manifest["request_id"].encode()
    key = (len(rid), len(src))
    shape = _STRUCTS.get(key)
    if shape is None:
        if len(_STRUCTS) >= _MAX_STRUCTS:
            _STRUCTS.clear()
        shape = _STRUCTS[key] = struct.Struct(f"<cHHIII{key[0]}s{2 * key[1]}i")
    chunk, tokens, dst = manifest["chunk_index"], manifest["num_tokens"], manifest["dst_block_ids"]
    return shape.pack(b"C", layout_index, key[0], chunk, tokens, key[1], rid, *src, *dst)


def plain_chunk_records(
    header: dict[str, Any], src: Sequence[int], announced: Mapping[str, int]
) -> tuple[str | None, list[bytes]] | None:
    """The records that carry `header`, a plain chunk (`EncodedHeader.plain_chunk_layout`) sent
    with source blocks `src`, on a link that announced the layouts `announced` (JSON text ->
    index): the layout's text where it is new (the caller gives it index ``len(announced)``
    once its record is sent) else None, and the records, the layout's first where it is new.
    None where the header must go as JSON: not a plain chunk, a header with more in it (e.g.
    ``"direct": False``), ids other than its manifest's, `MAX_LAYOUTS` announced, or a field
    that does not fit its slot."""
    layout = header.plain_chunk_layout if type(header) is EncodedHeader else None
    if layout is None or header.keys() != _PLAIN_KEYS:
        return None
    manifest = header["manifest"]
    if manifest.get("src_block_ids") != (src if isinstance(src, list) else list(src)):
        return None  # (the record carries the ids sent)
    index = announced.get(layout)
    if index is None and len(announced) >= MAX_LAYOUTS:
        return None
    try:
        chunk = chunk_record(len(announced) if index is None else index, manifest, src)
    except (struct.error, KeyError, TypeError, AttributeError):  # a field that does not fit
        return None
    return (None, [chunk]) if index is not None else (layout, [layout_record(layout), chunk])


def parse_layout(record: bytes) -> dict[str, Any]:
    """The layout a layout record announces (a JSON object)."""
    try:
        layout = json.loads(record[1:])
    except (UnicodeDecodeError, ValueError) as exc:
        raise RecordError(f"layout record is not JSON: {exc}") from None
    if not isinstance(layout, dict):
        raise RecordError("layout record is not a JSON object")
    return layout


def parse_chunk(record: bytes, layouts: list[dict[str, Any]]) -> tuple[dict[str, Any], list[int]]:
    """The header a chunk record stands for (equal to what its JSON text would load as) and its
    source block ids. `layouts` are the link's layout records so far, in order."""
    if len(record) < _FIXED.size:
        raise RecordError("chunk record too short")
    _, index, rid_len, chunk_index, num_tokens, n = _FIXED.unpack_from(record)
    ids_at = _FIXED.size + rid_len
    if len(record) != ids_at + 8 * n:
        raise RecordError("chunk record's length does not match its counts")
    if index >= len(layouts):
        raise RecordError(f"chunk record names layout {index}, not announced")
    try:
        request_id = record[_FIXED.size : ids_at].decode()
    except UnicodeDecodeError as exc:
        raise RecordError(f"chunk record's request id is not UTF-8: {exc}") from None
    ids = list(struct.unpack_from(f"<{2 * n}i", record, ids_at))
    manifest = {
        "request_id": request_id,
        "layout": dict(layouts[index]),
        "chunk_index": chunk_index,
        "last": False,
        "num_tokens": num_tokens,
        "src_block_ids": ids[:n],
        "dst_block_ids": ids[n:],
        "checksum": None,
        "first_token_ids": [],
        "sampler_state": None,
    }
    return {"type": "pages", "request_id": request_id, "manifest": manifest}, ids[:n]
