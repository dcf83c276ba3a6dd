"""What `UcxTransport` puts on the wire for one message (`ucx.py`): the pages it carries, read
from the pool (`message_pages`), or the runs of blocks a receiver reads itself (`pages_to_read`),
and its frames, a JSON header then the pages, in two shares over two lanes when they are large
(`send_frames`).

Address `ucx:<hex worker address>[.<hex worker address>]`: lane 0, and lane 1 where there is one
(a second UCX worker, progressed by the same thread, whose rendezvous has the receiver read).
A link to a peer draws a random 48-bit `conn`; tags are `conn << 16 | low`: `low` 0 for JSON
frames (`{"hello": {"token", "address", "process", "pull"?}}` first, then `{"seq", "header",
"pages": null | {"shape", "dtype", "direct", "dst_start", "split"? | "runs"?}}`), `0x8000 | seq %
32768` for the pages of header `seq` (the pool slice for one run of src blocks, else a gather),
0x4000 for a welcome (0x4001: the peer reads our pages, and our frames carry `runs` instead of
pages). Pages of `split_min_bytes` or more go in two shares, the first on lane 0 (the sender's
thread copies it into the receiver) and the second on lane 1 (the receiver's thread copies it
out of the sender) at the same time.

On a pull link a plain chunk (a stream's chunk other than its last,
`EncodedHeader.plain_chunk_layout`) goes as the shm pull ring's compact binary records
(`_chunk_records`) instead of JSON, on the same tag as JSON frames (a record starts with ``C`` or
``L``, a JSON frame with ``{``): its layout once per link, then one record per chunk, from which
the receiver rebuilds the header and the runs to read. It is the one frame a prefill sends on its
hot path, where writing the JSON cost ~45 of ~235 us per chunk here (cold caches).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tandem.kernels.kv_cache import KVCachePool
from tandem.kv_transfer._chunk_records import plain_chunk_records
from tandem.kv_transfer._socket_channel import consecutive_runs, dtype_name
from tandem.kv_transfer._ucx_lanes import Array, tag_of
from tandem.kv_transfer._ucx_records import _Link, _Out, _run_start

_PAGES = 0x8000  # the low tag bits of page frames (`| seq % _PAGES`)


def message_pages(
    link: _Link, msg: _Out, pool: KVCachePool | None, pool_rows: np.ndarray | None
) -> tuple[Any, dict[str, Any] | None]:
    """`msg`'s pages (raw bytes, a view of the pool's rows for one run of blocks, else a gather
    into the link's spare staging buffer, kept on `msg` until sent) and their description for
    the header frame; (None, None) for a message without blocks."""
    n = len(msg.block_ids)
    if not n or pool is None or pool_rows is None:
        return None, None
    pages: Any
    if (start := _run_start(msg.block_ids)) is not None:
        pages = pool_rows[start : start + n].reshape(-1)  # numpy: no torch calls
    else:  # gather, reusing the last staging buffer (fresh memory page-faults: slow)
        nbytes, spare, link.spare = n * pool.bytes_per_block, link.spare, None
        if spare is None or spare.numel() < nbytes:
            spare = torch.empty(nbytes, dtype=torch.uint8)
        msg.staging = spare
        pages = spare[:nbytes].view(pool.dtype).view(pool.blocks_shape(n))
        torch.index_select(pool.tensor, 0, torch.tensor(msg.block_ids), out=pages)
    return pages, _describe(msg, pool)


def pages_to_read(msg: _Out, pool: KVCachePool | None) -> dict[str, Any] | None:
    """The description of `msg`'s pages for a receiver that reads them out of the pool itself
    (the pull path): `_describe`'s, with the runs of source blocks (`block_runs`); None for a
    message without blocks."""
    if not msg.block_ids or pool is None:
        return None
    return {**_describe(msg, pool), "runs": block_runs(msg.block_ids)}


def block_runs(ids: list[int]) -> list[list[int]]:
    """`ids` as runs of consecutive blocks, ``[[first, count], ...]`` in order."""
    return [[s, n] for s, _, n in consecutive_runs(ids, ids)]


def pages_meta(
    n: int, block_shape: Sequence[int], dtype: torch.dtype, direct: bool, dst: Any
) -> dict[str, Any]:
    """How `n` blocks' pages are described in a header frame: shape and dtype, whether they may
    land in the receiver's pool, and where (``dst_start``: the first of the manifest's dst ids
    `dst` when they are one run of `n`)."""
    start = _run_start(dst) if isinstance(dst, list) and len(dst) == n else None
    return {"shape": [n, *block_shape], "dtype": dtype_name(dtype), "direct": direct,
            "dst_start": start}  # fmt: skip


def _describe(msg: _Out, pool: KVCachePool) -> dict[str, Any]:
    """`pages_meta` of `msg`'s pages in `pool` (``direct`` unless its header opts out)."""
    manifest = msg.header.get("manifest")
    dst = manifest.get("dst_block_ids") if isinstance(manifest, dict) else None
    direct = msg.header.get("direct") is not False
    return pages_meta(len(msg.block_ids), pool.block_shape, pool.dtype, direct, dst)


def send_frames(
    link: _Link,
    out: _Out,
    body: dict[str, Any],
    pages: Any,
    split_min_bytes: int,
    timeout_s: float,
) -> _Out:
    """The JSON frame of `body`, then the pages: in two shares, one on each lane, when they
    are `split_min_bytes` or more and the peer has a second lane (`body["pages"]["split"]`:
    where the second share starts). The sends go on `out`, due within `timeout_s`."""
    out.deadline = time.monotonic() + timeout_s
    sends: list[tuple[Any, np.ndarray, int]] = []
    if pages is not None:
        raw = (
            pages if isinstance(pages, np.ndarray) else pages.reshape(-1).view(torch.uint8).numpy()
        )
        low = _PAGES | body["seq"] % _PAGES
        if link.ep_second is not None and raw.nbytes >= split_min_bytes:
            cut = body["pages"]["split"] = raw.nbytes // 2 // 4096 * 4096
            sends += [(link.ep, raw[:cut], low), (link.ep_second, raw[cut:], low)]
        else:
            sends.append((link.ep, raw, low))
    header = np.frombuffer(bytearray(json.dumps(body).encode()), dtype=np.uint8)
    for ep, data, low in [(link.ep, header, 0), *sends]:
        out.keep.append(data)
        out.requests.append(ep.tag_send(Array(data), tag_of(link.conn, low)))
    return out


def send_chunk_record(link: _Link, out: _Out, timeout_s: float) -> _Out | None:
    """Sends `out`, a plain chunk with pages, as compact records on a pull link (preceded by its
    layout's record the first time the link sends that layout); None, having sent nothing, for
    any other message (the caller sends it as JSON)."""
    plain = plain_chunk_records(out.header, out.block_ids, link.layouts)
    if plain is None or not out.block_ids or not link.compact:
        return None
    layout, records = plain
    out.deadline = time.monotonic() + timeout_s
    try:
        for record in records:  # (bytes: UCX only reads them)
            out.keep.append(record)
            out.requests.append(link.ep.tag_send(Array(record), tag_of(link.conn, 0)))
    except Exception:  # (the peer may hold a layout we did not count: JSON from now on)
        link.compact = False
        raise
    if layout is not None:
        link.layouts[layout] = len(link.layouts)
    return out
