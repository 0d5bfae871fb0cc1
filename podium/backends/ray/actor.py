"""The Ray actor behind every rank: a thin shell around :class:`podium.core.host.WorkerHost`.

Users never see it; their worker class stays a plain ``Worker``. Each method
returns a payload (see :mod:`podium.backends.ray.wire`) holding an
:class:`podium.core.host.Outcome`, so a user exception comes back as podium's
own ``RemoteFailure`` and Ray never wraps it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray

from podium.backends.ray import wire
from podium.core.host import Outcome, RemoteFailure, WorkerHost
from podium.core.worker import RankInfo

__all__ = ["RankActor"]


class _RankActor:
    def __init__(self) -> None:
        self.host: WorkerHost | None = None
        self.rank: int | None = None

    def where(self) -> tuple[str, int]:
        """This node's address and a free TCP port on it (rank 0 hosts the rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, info: RankInfo, env: dict[str, str], cls_payload: wire.Payload) -> wire.Payload:
        self.rank = info.rank
        os.environ.update(env)
        try:
            cls_with_init = wire.decode(cls_payload)
        except BaseException as exc:  # the user's class may fail to unpickle
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return wire.encode(Outcome(False, RemoteFailure.capture(exc, info.rank, "__init__")))
        self.host, outcome = WorkerHost.start(info, cls_with_init)
        return self._encode(outcome, "__init__")

    def call(self, target: str, message: wire.Payload, *shared: wire.Payload) -> wire.Payload:
        if self.host is None:
            raise RuntimeError("podium worker called before setup")
        try:
            args, kwargs = wire.decode(message)
            if shared:
                values = [wire.decode(p) for p in shared]
                args = tuple(values[a.index] if isinstance(a, wire.Shared) else a for a in args)
                kwargs = {
                    k: values[v.index] if isinstance(v, wire.Shared) else v
                    for k, v in kwargs.items()
                }
        except BaseException as exc:  # user objects may fail to unpickle
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return wire.encode(Outcome(False, RemoteFailure.capture(exc, self.rank, target)))
        return self._encode(self.host.run(target, args, kwargs), target)

    def _encode(self, outcome: Outcome, target: str) -> wire.Payload:
        try:
            return wire.encode(outcome)
        except Exception as exc:  # the user's return value does not pickle
            failure = RemoteFailure.capture(
                TypeError(f"the return value of {target!r} cannot be sent back: {exc}"),
                self.rank,
                target,
            )
            return wire.encode(Outcome(False, failure))

    def close(self) -> None:
        if self.host is not None:
            self.host.close()


RankActor: Any = ray.remote(max_restarts=0, max_task_retries=0)(_RankActor)
