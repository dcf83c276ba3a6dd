"""What killed processes leave (shm control sockets, shared-memory regions) is removed; what
live ones hold is kept."""

from __future__ import annotations

import contextlib
import os
import socket
import time

from tandem.kv_transfer._leftovers import remove_stale_regions, remove_stale_sockets
from tandem.kv_transfer._shm_region import ShmRegion, new_endpoint_id
from tandem.kv_transfer.shm import ShmTransport


def _bound(path: str, listen: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    if listen:
        sock.listen(4)
    return sock


def _age(path: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_only_old_sockets_nobody_listens_on_are_removed(tmp_path) -> None:
    dead = str(tmp_path / "tandem-kv-00112233aabbccdd.sock")
    young_dead = str(tmp_path / "tandem-kv-0011223344556677.sock")
    live = str(tmp_path / "tandem-kv-ffeeddccbbaa9988.sock")
    other = str(tmp_path / "someone-else.sock")
    socks = [
        _bound(dead, False),
        _bound(young_dead, False),
        _bound(live, True),
        _bound(other, False),
    ]
    socks[0].close()  # the process that owned it is gone: its file stays
    socks[1].close()
    for path in (dead, live, other):
        _age(path, 3600)
    try:
        assert remove_stale_sockets(str(tmp_path)) == 1
        assert sorted(os.listdir(tmp_path)) == sorted(
            os.path.basename(p) for p in (young_dead, live, other)
        )
    finally:
        for sock in socks:
            sock.close()


def test_a_new_shm_endpoint_sweeps_its_socket_dir_and_a_probe_is_not_an_intruder(
    tmp_path, caplog
) -> None:
    live = ShmTransport("token", socket_dir=str(tmp_path))
    try:
        stale = str(tmp_path / "tandem-kv-0123456789abcdef.sock")
        _bound(stale, False).close()
        _age(stale, 3600)
        _age(live._owned.socket_path, 3600)
        with caplog.at_level("INFO"):
            second = ShmTransport("token", socket_dir=str(tmp_path))
            time.sleep(0.2)  # the live endpoint's thread reads the probe's connection
        try:
            assert not os.path.exists(stale)
            assert os.path.exists(live._owned.socket_path)
            assert "refused a connection" not in caplog.text
        finally:
            second.close()
    finally:
        live.close()


def test_only_old_regions_no_process_holds_are_removed() -> None:
    live = ShmRegion.create(f"tandem-kv-{new_endpoint_id()}-b0", 4096)
    # Regions no process holds, as a process killed with its resource tracker leaves them:
    orphan, young = (f"/dev/shm/tandem-kv-{new_endpoint_id()}-r{i}" for i in (1, 2))
    for path in (orphan, young):
        with open(path, "wb") as file:
            file.write(b"\0" * 4096)
    try:
        for path in (f"/dev/shm/{live.name}", orphan):
            _age(path, 3600)
        assert remove_stale_regions() >= 1
        assert not os.path.exists(orphan)
        assert os.path.exists(f"/dev/shm/{live.name}") and os.path.exists(young)
    finally:
        live.unlink()
        for path in (orphan, young):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
