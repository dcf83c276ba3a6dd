"""A single-producer, single-consumer ring of byte records in a shared-memory region.

The shm transport's pull path (`_shm_pull`) uses one per link: the sending process appends a
record per message (its header and which of its blocks hold the pages) without a system call or
waking any thread, and the receiving process's reader polls the ring and copies the pages itself.

Layout: a 64-byte control block of little-endian uint64 words (0: bytes written in all, 1: bytes
consumed in all, 2: the reader's state, `AWAKE`, `ASLEEP` or `POLLING_SLOWLY`), then the data
area. A record is an 8-byte length and
its payload, padded to 8 bytes; a length of `_WRAP` means "continue at the start of the data
area". The writer stores the payload before the count that publishes it, and the reader reads
the count before the payload, which orders them on total-store-order CPUs (x86-64): `supported()`
says whether this is one. The writer runs once per chunk on a prefill's hot path, where every
line of Python is slow (cold caches), so it touches little: a memoryview and
`struct`, no numpy.
"""

from __future__ import annotations

import platform
import struct

CONTROL_BYTES = 64
_WRAP = (1 << 32) - 1
_HEAD, _TAIL, _STATE = 0, 8, 16
AWAKE, ASLEEP, POLLING_SLOWLY = 0, 1, 2
"""The reader's states: looking often, waiting to be woken, looking now and then (a stream)."""
_WORD = struct.Struct("<Q")


def supported() -> bool:
    """Whether stores reach other cores in program order here (x86-64), which the ring needs."""
    return platform.machine().lower() in ("x86_64", "amd64")


class RecordRing:
    """A ring over `buffer` (a writable memoryview of `CONTROL_BYTES` + a multiple of 8 bytes,
    zero-filled when new). One process writes, one reads."""

    def __init__(self, buffer: memoryview) -> None:
        buffer = buffer.cast("B")
        if buffer.nbytes <= CONTROL_BYTES or buffer.nbytes % 8:
            raise ValueError(f"a record ring needs 64 + 8n bytes, got {buffer.nbytes}")
        self._buf = buffer
        self.capacity = buffer.nbytes - CONTROL_BYTES
        self._head: int | None = None  # the writer's own count (only it writes it)
        self._tail_seen = 0  # the reader's count when the writer last looked

    # ---- writer
    def write(self, payload: bytes) -> bool:
        """Appends one record; False when it does not fit now (the reader has not caught up)."""
        buf, capacity, n = self._buf, self.capacity, len(payload)
        size = 8 + ((n + 7) & ~7)
        head = self._head
        if head is None:
            head = self._head = _WORD.unpack_from(buf, _HEAD)[0]
        at = head % capacity
        skip = capacity - at if at + size > capacity else 0
        if head + skip + size - self._tail_seen > capacity:  # look where the reader is now
            self._tail_seen = _WORD.unpack_from(buf, _TAIL)[0]
            if size > capacity or head + skip + size - self._tail_seen > capacity:
                return False
        if skip:
            _WORD.pack_into(buf, CONTROL_BYTES + at, _WRAP)
            head += skip
            at = 0
        start = CONTROL_BYTES + at
        buf[start + 8 : start + 8 + n] = payload
        _WORD.pack_into(buf, start, n)
        self._head = head = head + size
        _WORD.pack_into(buf, _HEAD, head)  # publishes the record
        return True

    @property
    def reader_state(self) -> int:
        """`AWAKE`, `ASLEEP` or `POLLING_SLOWLY`, as the reader last set it."""
        return self._buf[_STATE]

    # ---- reader
    def read(self) -> list[bytes]:
        """Every record written since the last call, oldest first."""
        buf, capacity = self._buf, self.capacity
        head = _WORD.unpack_from(buf, _HEAD)[0]
        tail = _WORD.unpack_from(buf, _TAIL)[0]
        out: list[bytes] = []
        while tail < head:
            at = tail % capacity
            start = CONTROL_BYTES + at
            length = _WORD.unpack_from(buf, start)[0]
            if length == _WRAP:
                tail += capacity - at
                continue
            out.append(bytes(buf[start + 8 : start + 8 + length]))
            tail += 8 + ((length + 7) & ~7)
        _WORD.pack_into(buf, _TAIL, tail)  # frees the space
        return out

    def has_records(self) -> bool:
        return _WORD.unpack_from(self._buf, _HEAD)[0] > _WORD.unpack_from(self._buf, _TAIL)[0]

    def set_state(self, state: int) -> None:
        self._buf[_STATE] = state
