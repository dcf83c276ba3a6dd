"""What `UcxTransport` puts on the wire for one message (`ucx.py`'s docstring has the tags): the
pages it carries, read from the pool (`message_pages`), and its frames, a JSON header then the
pages, in two shares over two lanes when they are large (`send_frames`)."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import torch

from tandem.kernels.kv_cache import KVCachePool
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
    manifest = msg.header.get("manifest")
    dst = manifest.get("dst_block_ids") if isinstance(manifest, dict) else None
    meta: dict[str, Any] = {"shape": pool.blocks_shape(n), "dtype": str(pool.dtype)[6:]}
    meta["direct"] = msg.header.get("direct") is not False
    meta["dst_start"] = _run_start(dst) if isinstance(dst, list) and len(dst) == n else None
    return pages, meta


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
