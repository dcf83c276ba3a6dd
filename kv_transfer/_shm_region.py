"""Named POSIX shared-memory regions mapped as torch tensors (used by the shm transport).

`ShmRegion.create` makes a new region and registers it with multiprocessing's resource tracker,
so a process killed before `unlink()` still gets its regions removed when the tracker exits.
The owner also takes a shared `flock` on the region, held while its mapping lives (the mmap
keeps a duplicate of the descriptor): a region nobody holds is one whose owner died with its
tracker (`_leftovers.remove_stale_regions`).
`ShmRegion.attach` maps a peer's region *without* registering it (an attaching process must
never unlink or "clean up" someone else's region, which `SharedMemory` on Python < 3.13 does).

Mappings are never unmapped while a tensor views them: `close()` only drops this object's
reference, and the mapping goes away with the last tensor that uses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
from multiprocessing import resource_tracker

import torch

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms have no shm transport
    _posixshmem = None

REGION_PREFIX = "tandem-kv-"
_NAME_RE = re.compile(r"^tandem-kv-[0-9a-f]{8,32}-[a-z][0-9]{1,9}$")


def new_endpoint_id() -> str:
    """A random id naming one endpoint's regions (`tandem-kv-<id>-<kind><n>`)."""
    return secrets.token_hex(8)


def is_region_name(name: object) -> bool:
    """Whether `name` is a region name this module would create (peers may name no other)."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def _shm_open(name: str, flags: int) -> int:
    if _posixshmem is None:  # pragma: no cover
        raise OSError("POSIX shared memory is not available on this platform")
    return int(_posixshmem.shm_open("/" + name, flags, mode=0o600))


class ShmRegion:
    """One mapped region; `owner` regions are unlinked by `unlink()` (idempotent)."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        self._unlinked = not owner

    @classmethod
    def create(cls, name: str, size: int) -> ShmRegion:
        """A new zero-filled region of `size` bytes (`FileExistsError` if the name is taken)."""
        if not is_region_name(name) or size <= 0:
            raise ValueError(f"bad shared-memory region {name!r} of {size} bytes")
        fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        try:
            resource_tracker.register("/" + name, "shared_memory")
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # (the mmap's copy of `fd` keeps it held)
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
            except BaseException:
                _unlink(name)
                raise
        finally:
            os.close(fd)
        return cls(name, mm, size, owner=True)

    @classmethod
    def attach(cls, name: str, populate: bool = False) -> ShmRegion:
        """Maps an existing region read-write; `populate` pre-faults its page tables."""
        if not is_region_name(name):
            raise ValueError(f"refusing to map shared-memory region {name!r}")
        fd = _shm_open(name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise ValueError(f"shared-memory region {name!r} is empty")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            mm = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        return cls(name, mm, size, owner=False)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A tensor of `shape` viewing the region's bytes from `offset` (writes are shared)."""
        if self._mm is None:
            raise ValueError(f"shared-memory region {self.name} is closed")
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"{nbytes} bytes at {offset} do not fit region of {self.size}")
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=offset)
        return flat.view(dtype).view(shape)

    def buffer(self) -> memoryview:
        """The region's bytes as a writable memoryview (writes are shared)."""
        if self._mm is None:
            raise ValueError(f"shared-memory region {self.name} is closed")
        return memoryview(self._mm)

    def unlink(self) -> None:
        """Removes the name (owner only); mappings stay valid until released."""
        if not self._unlinked:
            self._unlinked = True
            _unlink(self.name)

    def close(self) -> None:
        """Drops this object's reference to the mapping.

        The mapping is never closed explicitly: `torch.frombuffer` tensors keep the mmap object
        alive but do not pin its buffer, so `mmap.close()` would unmap memory they still view.
        It is unmapped when the last tensor viewing it goes.
        """
        self._mm = None


def _unlink(name: str) -> None:
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
    finally:
        with contextlib.suppress(Exception):  # the tracker may be gone at interpreter exit
            resource_tracker.unregister("/" + name, "shared_memory")
