"""`PagesHeaderWriter`: the chunk header's JSON text is written from pieces on the prefill's hot
path, so it must say exactly what its dict says, and refuse what it cannot write."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from tandem.kv_transfer.base import EncodedHeader, header_json
from tandem.kv_transfer.manifest import ChunkManifest, KVLayout, PagesHeaderWriter

LAYOUT = KVLayout(
    namespace="ns-1", block_size=16, num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32"
)


@pytest.mark.parametrize(
    ("request_id", "last", "finished"),
    [
        ("r-1", False, None),
        ('quote"and\\back slash', True, True),
        ("caf\u00e9 \u2603 \n tab\t", True, False),
        ("", False, None),
    ],
)
def test_the_text_is_the_json_of_the_dict(request_id: str, last: bool, finished: bool) -> None:
    header = PagesHeaderWriter(LAYOUT).write(
        request_id,
        3,
        last=last,
        num_tokens=83,
        src_block_ids=[7, 8, 9, 40, 2],
        dst_block_ids=range(100, 105),
        checksum="00ff" if last else None,
        first_token_ids=[31999] if last else (),
        sampler_state="AAEC" if last else None,
        finished=finished,
    )
    assert isinstance(header, EncodedHeader)
    assert json.loads(header.text) == header
    assert header_json(header) == header.text
    assert header["request_id"] == request_id and header["type"] == "pages"
    assert ("finished" in header) is (finished is not None)
    manifest = header["manifest"]
    assert manifest["src_block_ids"] == [7, 8, 9, 40, 2]
    assert manifest["dst_block_ids"] == [100, 101, 102, 103, 104]
    assert ChunkManifest.model_validate(manifest).model_dump(mode="json") == manifest


@pytest.mark.parametrize(
    "ids", [[1, True], [1, np.int64(2)], [1.0], ["3"]], ids=["bool", "numpy", "float", "str"]
)
def test_ids_that_are_not_plain_ints_are_refused(ids: list[Any]) -> None:
    with pytest.raises(TypeError, match="must be ints"):
        PagesHeaderWriter(LAYOUT).write(
            "r",
            0,
            last=False,
            num_tokens=16,
            src_block_ids=ids,
            dst_block_ids=ids,
        )


def test_a_plain_header_is_encoded_compactly() -> None:
    assert header_json({"type": "ack", "chunk_index": 2}) == '{"type":"ack","chunk_index":2}'


def test_interleaved_streams_each_get_their_own_text() -> None:
    """The text up to the chunk index is kept per request (bounded): streams that interleave,
    more of them than are kept, still each get exactly their own header."""
    writer = PagesHeaderWriter(LAYOUT)
    ids = [f'req-{i}"{i % 7}' for i in range(PagesHeaderWriter.PREFIXES + 44)]
    for chunk in range(2):
        for n, rid in enumerate(ids):
            header = writer.write(
                rid, chunk, last=False, num_tokens=16 * (chunk + 1), src_block_ids=[n],
                dst_block_ids=[chunk],
            )  # fmt: skip
            assert json.loads(header.text) == header
            assert header["request_id"] == rid and header["manifest"]["chunk_index"] == chunk


def test_a_plain_chunk_is_what_write_makes_of_it() -> None:
    writer = PagesHeaderWriter(LAYOUT)
    plain = writer.plain_chunk('r"1', 4, 80, [7, 8], [9, 10])
    full = writer.write(
        'r"1', 4, last=False, num_tokens=80, src_block_ids=[7, 8], dst_block_ids=[9, 10]
    )
    assert plain == full and plain.text == full.text
    assert plain.plain_chunk_layout == full.plain_chunk_layout is not None
    bad = writer.plain_chunk("r", 0, 16, [np.int64(1)], [2])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="must be ints"):
        header_json(bad)
