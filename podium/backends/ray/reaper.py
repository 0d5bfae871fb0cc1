"""Fate-sharing for the local Ray that podium starts: nothing it started outlives the controller.

Ray's own processes of a local instance (GCS, raylet, workers) end with the
controller, but its agents (dashboard agent, runtime-env agent) can linger for
about a minute after the controller is killed, retrying the dead GCS. podium
marks every process of the Ray it starts with an environment variable (set
only while ``ray.init`` starts them, inherited by everything they start) and
runs a small watcher that waits for the controller to end -- the end of a pipe
only the controller holds -- and then kills the processes that carry the mark.
Only that Ray's processes carry it, so nothing else on the host is touched.

A process title overwrites the environment it sits next to, and Ray titles its
agents (``ray::DashboardAgent``): their mark would be gone, and they would live
out their minute. ``SPT_NOENV``, honoured by the title code Ray carries, keeps
the environment and shortens a title to the length of the original command line,
which for Ray's processes is far longer than any title.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

__all__ = ["MARK_ENV", "start_watcher"]

MARK_ENV = "PODIUM_LOCAL_RAY"
_TITLE_KEEPS_ENV = "SPT_NOENV"

# Run by the watcher process: wait for EOF on stdin (the controller is gone, or
# podium shut its Ray down), give Ray's processes a moment to end, kill the rest.
# A process that forks while a pass runs can leave a child the pass has gone by:
# passes repeat until one finds nothing.
_WATCHER = """
import os, signal, sys, time
mark = sys.argv[1].encode()
sys.stdin.buffer.read()
time.sleep(float(sys.argv[2]))
spare = {os.getpid(), int(sys.argv[3])}
for _ in range(10):
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in spare:
            continue
        try:
            with open("/proc/%s/environ" % entry, "rb") as f:
                if mark in f.read().split(b"\\0"):
                    os.kill(int(entry), signal.SIGKILL)
                    killed += 1
        except OSError:
            pass
    if not killed:
        break
    time.sleep(0.1)
"""

_watchers: list[subprocess.Popen[bytes]] = []


def start_watcher(grace_s: float = 1.0) -> dict[str, str]:
    """Start a watcher for a local Ray about to be started; the environment to start it with.

    Returns ``{}`` where processes cannot be found by their environment (no ``/proc``).
    """
    if not os.path.isdir("/proc"):
        return {}
    mark = uuid.uuid4().hex
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, f"{MARK_ENV}={mark}", str(grace_s), str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C meant for the controller does not end it first
    )
    _watchers.append(watcher)  # held for the process's life: its stdin is the pipe it watches
    return {MARK_ENV: mark, _TITLE_KEEPS_ENV: "1"}


def stop_watchers() -> None:
    """podium shut its local Ray down: let the watchers clean up after it and exit."""
    while _watchers:
        watcher = _watchers.pop()
        _close(watcher)


def _close(watcher: Any) -> None:
    try:
        if watcher.stdin is not None:
            watcher.stdin.close()
        watcher.wait(timeout=30)
    except Exception:  # it is on its own now; it exits after its scan
        pass
