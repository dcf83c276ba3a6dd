"""Compact ring records for plain chunks (`_chunk_records`): the receiving side must rebuild
exactly the header the chunk's JSON text says, and refuse a record it cannot read."""

from __future__ import annotations

import json
import struct

import pytest

from tandem.kv_transfer import _chunk_records as records
from tandem.kv_transfer.manifest import KVLayout, PagesHeaderWriter

LAYOUT = KVLayout(
    namespace="ns-1", block_size=16, num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32"
)


def plain_chunk(request_id: str, chunk_index: int, src: list[int], dst: list[int]) -> dict:
    header = PagesHeaderWriter(LAYOUT).write(
        request_id,
        chunk_index,
        last=False,
        num_tokens=16 * (chunk_index + 1) * len(src),
        src_block_ids=src,
        dst_block_ids=dst,
    )
    assert header.plain_chunk_layout is not None
    return header


@pytest.mark.parametrize("request_id", ["r-1", "", 'quote"and\\back', "caf\u00e9 \u2603 \n\t"])
@pytest.mark.parametrize(
    ("src", "dst"), [([7, 8, 9, 40, 2], [100, 101, 0, 5, 2**31 - 1]), ([], [])]
)
def test_a_chunk_record_rebuilds_the_header_its_text_says(
    request_id: str, src: list[int], dst: list[int]
) -> None:
    header = plain_chunk(request_id, 3, src, dst)
    layouts = [records.parse_layout(records.layout_record(header.plain_chunk_layout))]
    record = records.chunk_record(0, header["manifest"], tuple(src))
    rebuilt, got_src = records.parse_chunk(record, layouts)
    assert rebuilt == json.loads(header.text) == header
    assert got_src == src
    assert len(record) == 17 + len(request_id.encode()) + 8 * len(src)


def test_only_plain_chunks_are_marked_for_compact_records() -> None:
    writer = PagesHeaderWriter(LAYOUT)
    common = {"num_tokens": 20, "src_block_ids": [1, 2], "dst_block_ids": [3, 4]}
    assert writer.write("r", 0, last=False, **common).plain_chunk_layout == json.dumps(
        LAYOUT.model_dump(mode="json"), separators=(",", ":")
    )
    last = writer.write("r", 1, last=True, first_token_ids=[5], **common)
    summed = writer.write("r", 0, last=False, checksum="00ff", **common)
    assert last.plain_chunk_layout is None and summed.plain_chunk_layout is None


@pytest.mark.parametrize(
    "fields",
    [{"chunk_index": -1}, {"num_tokens": 2**32}, {"dst_block_ids": [2**31]}],
    ids=["negative-index", "too-many-tokens", "id-beyond-int32"],
)
def test_a_field_out_of_range_is_not_packed(fields: dict) -> None:
    manifest = dict(plain_chunk("r", 0, [1], [2])["manifest"], **fields)
    with pytest.raises(struct.error):
        records.chunk_record(0, manifest, (1,))


def good_record() -> bytes:
    return records.chunk_record(0, plain_chunk("r", 0, [1, 2], [3, 4])["manifest"], (1, 2))


@pytest.mark.parametrize(
    ("record", "layouts", "error"),
    [
        (b"C\x00", 1, "too short"),
        (good_record()[:-1], 1, "length does not match"),
        (good_record() + b"\x00" * 8, 1, "length does not match"),
        (good_record(), 0, "not announced"),
        (good_record().replace(b"r", b"\xff", 1), 1, "not UTF-8"),
    ],
    ids=["short", "truncated", "trailing", "unknown-layout", "bad-utf8"],
)
def test_a_malformed_chunk_record_is_refused(record: bytes, layouts: int, error: str) -> None:
    known = [LAYOUT.model_dump(mode="json")] * layouts
    with pytest.raises(records.RecordError, match=error):
        records.parse_chunk(record, known)


@pytest.mark.parametrize("record", [b"L{not json", b"L[1,2]"], ids=["not-json", "not-object"])
def test_a_malformed_layout_record_is_refused(record: bytes) -> None:
    with pytest.raises(records.RecordError):
        records.parse_layout(record)
