"""The acks a UCX endpoint waits for. An ack rings no bell (`ucx.UNHURRIED`: a ring would wake
a prefill's thread mid-compute), yet the ack of a request's last chunk unpins the request's
blocks and ends its transfer. So from that chunk until its ack, or another answer about the
request, or `REPLY_WINDOW_S`, the endpoint's thread polls instead of sleeping long."""

from __future__ import annotations

from typing import Any

REPLY_WINDOW_S = 0.1


class AwaitedReplies:
    """Last chunks handed to UCX whose answer has not come (used under the transport's lock)."""

    def __init__(self) -> None:
        self._due: dict[str, tuple[float, int]] = {}  # request id -> (until, last chunk index)

    def sent(self, header: dict[str, Any], now: float) -> bool:
        """Notes `header` if it is a request's last chunk; whether it was."""
        manifest = header.get("manifest") if header.get("type") == "pages" else None
        if not (isinstance(manifest, dict) and manifest.get("last")):
            return False
        index = manifest.get("chunk_index")
        self._due[str(header.get("request_id"))] = (
            now + REPLY_WINDOW_S,
            index if isinstance(index, int) else 0,
        )
        return True

    def answered(self, header: dict[str, Any]) -> None:
        """A message came: an ack up to the last chunk, or any other answer about the request,
        ends its wait (an ack of an earlier chunk does not)."""
        rid = str(header.get("request_id"))
        if (due := self._due.get(rid)) is None:
            return
        acked = header.get("chunk_index")
        if header.get("type") != "ack" or (isinstance(acked, int) and acked >= due[1]):
            del self._due[rid]

    def pending(self, now: float) -> bool:
        """Whether an answer is still awaited (those past their window are dropped)."""
        if self._due:
            self._due = {rid: due for rid, due in self._due.items() if due[0] > now}
        return bool(self._due)
