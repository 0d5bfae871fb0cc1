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


@pytest.fixture
def procs() -> Processes:
    return Processes()
