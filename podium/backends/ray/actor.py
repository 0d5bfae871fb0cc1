"""The Ray actor behind every rank: a thin shell around :class:`podium.core.host.WorkerHost`.

Users never see it; their worker class stays a plain ``Worker``. Each method
returns a payload (see :mod:`podium.backends.ray.wire`) holding an
:class:`podium.core.host.Outcome`, so a user exception comes back as podium's
own ``RemoteFailure`` and Ray never wraps it.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import ray

from podium.backends.ray import wire
from podium.core.host import Outcome, RemoteFailure, WorkerHost, release_process_groups
from podium.core.worker import RankInfo

__all__ = ["ASYNC_GROUP", "actor_class", "method_name"]


class _RankActor:
    def __init__(self) -> None:
        self.host: WorkerHost | None = None
        self.rank: int | None = None

    def where(self) -> tuple[str, int, int, str, str]:
        """This node's address, a free TCP port on it (rank 0's hosts the rendezvous), the pid,
        the files this process's stderr and stdout go to (``os.pathsep``-separated), and
        the id of the node Ray placed this actor on."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        node = ray.get_runtime_context().get_node_id()
        return ray.util.get_node_ip_address(), port, os.getpid(), _log_files(), node

    def setup(self, info: RankInfo, env: dict[str, str], cls_payload: wire.Payload) -> wire.Payload:
        self.rank = info.rank
        os.environ.update(env)
        from podium.backends.ray.dataplane import RayExporter
        from podium.core.dataplane import set_exporter

        set_exporter(RayExporter())  # output="ref" shards go into the object store
        try:
            cls_with_init = wire.decode(cls_payload)
        except BaseException as exc:  # the user's class may fail to unpickle
            return self._failure(exc, "__init__")
        self.host, outcome = WorkerHost.start(info, cls_with_init)
        return self._encode(outcome, "__init__")

    def call(
        self, message: wire.Payload, *shared: wire.Payload, deadline: float | None = None
    ) -> wire.Payload:
        """Run ``(target, args, kwargs)``; ``shared`` are the values several ranks received."""
        target = "?"
        if _expired(deadline):
            return _SKIPPED
        try:
            target, args, kwargs = wire.decode_own(message)
        except BaseException as exc:  # user objects may fail to unpickle
            return self._failure(exc, target)
        return self._run(target, args, kwargs, shared)

    def _call_target(
        self,
        target: str,
        message: wire.Payload | None,
        shared: tuple[wire.Payload, ...],
        deadline: float | None,
    ) -> wire.Payload:
        if _expired(deadline):
            return _SKIPPED
        if message is None:
            return self._run(target, (), {}, ())
        try:
            args, kwargs = wire.decode_own(message)
        except BaseException as exc:  # user objects may fail to unpickle
            return self._failure(exc, target)
        return self._run(target, args, kwargs, shared)

    def _run(
        self,
        target: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        shared: tuple[wire.Payload, ...],
    ) -> wire.Payload:
        if self.host is None:
            raise RuntimeError("podium worker called before setup")
        if shared:
            try:
                values = [wire.decode(p) for p in shared]
            except BaseException as exc:  # user objects may fail to unpickle
                return self._failure(exc, target)
            args = tuple(values[a.index] if isinstance(a, wire.Shared) else a for a in args)
            kwargs = {
                k: values[v.index] if isinstance(v, wire.Shared) else v for k, v in kwargs.items()
            }
        return self._encode(self.host.run(target, args, kwargs), target)

    def _failure(self, exc: BaseException, target: str) -> wire.Payload:
        """``exc`` (user objects that failed to unpickle) as a failed outcome for ``target``."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        return wire.encode(Outcome(False, RemoteFailure.capture(exc, self.rank, target)))

    def _encode(self, outcome: Outcome, target: str) -> wire.Payload:
        if outcome.ok and outcome.value is None:
            return None  # the common "returns nothing": Ray moves None cheaper than bytes
        try:
            return wire.encode(outcome)
        except Exception as exc:  # the user's return value does not pickle
            failure = RemoteFailure.capture(
                TypeError(f"the return value of {target!r} cannot be sent back: {exc}"),
                self.rank,
                target,
            )
            return wire.encode(Outcome(False, failure))

    def stop(self) -> None:
        """Stop gracefully: the worker's ``shutdown()`` hook, then a normal process exit.

        ``exit_actor`` ends the process the way Python ends, so the worker's
        ``atexit`` handlers run; the controller kills the actor if this does
        not finish in time. A failing hook is reported in the worker's log.
        """
        host, self.host = self.host, None
        if host is not None:
            failure = host.close()
            if failure is not None:
                print(
                    f"podium: rank {self.rank}: the worker's shutdown() failed:\n{failure.traceback}",
                    file=sys.stderr,
                    flush=True,
                )
        left = release_process_groups()  # before Python's teardown: see there
        if left is not None:
            print(
                f"podium: rank {self.rank} could not destroy its process group: {left}",
                file=sys.stderr,
                flush=True,
            )
        ray.actor.exit_actor()


# What a call that starts past its deadline returns instead of running. Ray
# (2.60) still runs a sync actor's queued call after ray.cancel once the
# running one ends; the controller has already raised CallTimeoutError and
# cancelled it, so nobody reads this value.
_SKIPPED = wire.encode(
    Outcome(False, RemoteFailure.capture(TimeoutError("skipped: past its deadline"), None, "?"))
)


def _expired(deadline: float | None) -> bool:
    """Did the call's deadline (wall-clock time, ``time.time()``) pass before it started?"""
    return deadline is not None and time.time() > deadline


def _log_files() -> str:
    """Where Ray sends this worker's stderr and stdout: the files behind fds 2 and 1.

    Read from the process itself, so podium needs neither Ray's private node
    object nor the dashboard-backed state API to show a dead rank's last lines.
    """
    paths = []
    for fd in (2, 1):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # not Linux: no log tail
            continue
        if os.path.isfile(path):
            paths.append(path)
    return os.pathsep.join(paths)


def method_name(target: str) -> str:
    """The actor method that runs ``target`` (``"method"`` or ``"role:method"``) directly."""
    return "podium__" + target.replace(":", "__")


def _target_method(target: str) -> Any:
    def run_target(
        self: _RankActor,
        message: wire.Payload | None = None,
        *shared: wire.Payload,
        deadline: float | None = None,
    ) -> wire.Payload:
        return self._call_target(target, message, shared, deadline)

    run_target.__name__ = method_name(target)
    return run_target


_classes: dict[tuple[frozenset[str], int], Any] = {}
_lock = threading.Lock()

# The concurrency group ``async def`` calls run in: each waits in one of its
# threads while its coroutine runs on the rank's event loop, so a rank takes
# its next calls meanwhile. Every other call runs in Ray's default group, one
# at a time, in order (max_concurrency=1).
ASYNC_GROUP = "podium_async"


def actor_class(targets: Iterable[str], async_slots: int = 0) -> Any:
    """The Ray actor class for a worker class whose registered targets are ``targets``.

    Each target gets its own actor method, so a call without arguments (the
    common ``init_model()``, ``save()``) crosses with no payload at all, as a
    hand-written Ray actor's would; other targets go through ``call``.
    ``async_slots`` threads serve :data:`ASYNC_GROUP` (the worker's ``max_async_calls``);
    a worker without ``async def`` methods gets none, and stays a plain sync actor.
    """
    key = (frozenset(targets), async_slots)
    with _lock:
        cls = _classes.get(key)
        if cls is None:
            body = {method_name(t): _target_method(t) for t in sorted(key[0])}
            body["__module__"] = __name__
            options: dict[str, Any] = {"max_restarts": 0, "max_task_retries": 0}
            if async_slots:
                options["concurrency_groups"] = {ASYNC_GROUP: async_slots}
            cls = ray.remote(**options)(type("PodiumRank", (_RankActor,), body))
            _classes[key] = cls
        return cls
