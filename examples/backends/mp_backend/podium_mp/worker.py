"""The worker process of the ``mp`` example backend: one per rank.

Started as ``python worker.py`` with the group's environment (``worker_env``
and the rank variables are there from the first instruction). It connects back
to the controller, builds its :class:`WorkerHost`, and then runs calls in the
order they arrive while a reader thread keeps receiving, so the controller
never waits to send.

Messages (each one ``send_bytes`` of a :func:`dumps` header, buffers inline):

- controller -> worker: ``("init", RankInfo, ClassWithInitArgs)``, then
  ``("call", call_id, target)`` followed by a second message with
  ``(args, kwargs)``, and finally ``("close",)``;
- worker -> controller: ``(call_id, pickled Outcome)``; call id ``-1`` answers init.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from multiprocessing.connection import Client
from typing import Any

from podium.backend_api import (
    ARGUMENT_NOT_LOADED,
    RESULT_NOT_SENT,
    Outcome,
    WorkerHost,
    crossing_failure,
    dumps,
    loads,
    release_process_groups,
)

CLOSE = object()


def send(conn: Any, lock: threading.Lock, call_id: int, outcome: Outcome) -> None:
    """Send ``(call_id, pickled outcome)``: the id always unpickles, so a result that does not is that call's failure."""
    header = dumps((call_id, dumps(outcome, out_of_band=False)[0]), out_of_band=False)[0]
    with lock:
        conn.send_bytes(header)


def main() -> None:
    address = (os.environ["PODIUM_MP_HOST"], int(os.environ["PODIUM_MP_PORT"]))
    conn = Client(address, authkey=bytes.fromhex(os.environ.pop("PODIUM_MP_AUTHKEY")))
    conn.send_bytes(os.environ["RANK"].encode())
    lock = threading.Lock()
    _, info, cls_with_init = loads(conn.recv_bytes())
    host, outcome = WorkerHost.start(info, cls_with_init)
    send(conn, lock, -1, outcome)
    if host is None:
        return
    calls: queue.Queue[Any] = queue.Queue()
    closing = threading.Event()

    def read() -> None:
        # Receive everything as it comes; a call that fails to unpickle is that call's failure.
        try:
            while True:
                meta = loads(conn.recv_bytes())
                if meta[0] == "close":
                    closing.set()
                    calls.put(CLOSE)
                    return
                _, call_id, target = meta
                raw = conn.recv_bytes()
                try:
                    args, kwargs = loads(raw)
                except Exception as exc:
                    calls.put(
                        (
                            call_id,
                            target,
                            crossing_failure(exc, info.rank, target, ARGUMENT_NOT_LOADED),
                        )
                    )
                    continue
                calls.put((call_id, target, (args, kwargs)))
        except (EOFError, OSError):  # the controller is gone: stop as on close
            closing.set()
            calls.put(CLOSE)

    threading.Thread(target=read, daemon=True, name="podium-mp-reader").start()
    while True:
        item = calls.get()
        if item is CLOSE:
            break
        if closing.is_set():
            continue  # shut down: queued calls do not run
        call_id, target, work = item
        outcome = (
            work if isinstance(work, Outcome) else host.run(target, *work)
        )  # SystemExit ends the rank
        try:
            send(conn, lock, call_id, outcome)
        except Exception as exc:
            send(conn, lock, call_id, crossing_failure(exc, info.rank, target, RESULT_NOT_SENT))
    failure = host.close()  # the worker's shutdown() hook, once
    if failure is not None:
        print(
            f"podium-mp rank {info.rank}: shutdown() failed: {failure.to_exception()}",
            file=sys.stderr,
        )
    left = release_process_groups()  # a process group the user left, before Python's teardown
    if left is not None:
        print(f"podium-mp rank {info.rank}: {left}", file=sys.stderr)
    conn.close()


if __name__ == "__main__":
    main()
