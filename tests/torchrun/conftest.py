"""Helpers for the torchrun backend's tests: finding a group's processes."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("torchx")
pytest.importorskip("zmq")


def group_processes(gid: str) -> list[int]:
    """Live (non-zombie) processes started for the group ``gid``: agents, supervisors, workers."""
    marker = f"PODIUM_TR_GROUP={gid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in env.split(b"\0") and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def wait_no_processes(gid: str, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = group_processes(gid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = group_processes(gid)
    return left


class Processes:
    """Fixture object: ``find(gid)`` and ``wait_gone(gid, timeout)``."""

    find = staticmethod(group_processes)
    wait_gone = staticmethod(wait_no_processes)
    listening = staticmethod(lambda pids: listening_sockets(pids))


@pytest.fixture
def procs() -> Processes:
    return Processes()


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket in LISTEN state held by one of ``pids``.

    Sockets are matched to processes by inode (``/proc/PID/fd`` links against
    ``/proc/net/tcp`` and ``tcp6``); addresses are printed as ``ipaddress`` does.
    """
    import ipaddress

    inodes: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[int(target[8:-1])] = pid
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # The kernel prints each 32-bit word in host (little-endian) order.
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            addr = ipaddress.ip_address(packed)
            found.append((inodes[inode], str(addr), int(hex_port, 16)))
    return found
