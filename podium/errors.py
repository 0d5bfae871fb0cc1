"""podium's exceptions: one base class, specific subclasses with fields.

Every exception here pickles (it may be raised in a worker and re-raised at the
controller) and keeps its fields across that trip. Messages say what to do next.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = [
    "CallTimeoutError",
    "DataLostError",
    "DataProtoError",
    "DispatchError",
    "GroupShutdownError",
    "PodiumError",
    "RemoteError",
    "ResourceUnavailableError",
    "UnknownBackendError",
    "WorkerDiedError",
    "WorkerStartupError",
]


def _rebuild(cls: type[PodiumError], message: str, fields: dict[str, Any]) -> PodiumError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(fields)
    return err


class PodiumError(Exception):
    """Base class of every error podium raises itself."""

    def __reduce__(self) -> Any:
        message = self.args[0] if self.args else ""
        return (_rebuild, (type(self), message, dict(self.__dict__)))


class UnknownBackendError(PodiumError, LookupError):
    """The requested backend is not installed (or its plugin failed to load)."""

    def __init__(
        self,
        name: str,
        installed: list[str],
        failed: dict[str, str] | None = None,
        suggestion: str | None = None,
        extra: str | None = None,
    ) -> None:
        self.name = name
        self.installed = list(installed)
        self.failed = dict(failed or {})
        self.suggestion = suggestion
        self.extra = extra
        lines = [f"unknown podium backend {name!r}."]
        if suggestion:
            lines.append(f"Did you mean {suggestion!r}?")
        lines.append("Installed backends: " + (", ".join(sorted(self.installed)) or "none") + ".")
        for plugin, reason in sorted(self.failed.items()):
            lines.append(f"Plugin {plugin!r} is declared but failed to load: {reason}")
        if extra:
            lines.append(f"To install it: pip install '{extra}'")
        super().__init__(" ".join(lines))


class ResourceUnavailableError(PodiumError):
    """A pool the cluster cannot hold (now, or ever)."""

    def __init__(self, message: str, *, demand: Any = None, supply: Any = None) -> None:
        self.demand = demand
        self.supply = supply
        super().__init__(message)


class DispatchError(PodiumError, ValueError, AssertionError):
    """Input a dispatch mode cannot split or route.

    Also an ``AssertionError``: verl checks these conditions with ``assert``,
    so ported code that catches ``AssertionError`` keeps working.
    """


class DataProtoError(PodiumError, ValueError, AssertionError):
    """Input a :class:`podium.DataProto` operation refuses (sizes that disagree, a batch that
    does not split evenly, ``meta_info`` values that conflict in ``concat`` or ``union``).

    Also an ``AssertionError``, because verl checks these conditions with ``assert``:
    ported code that catches ``AssertionError`` keeps working, and podium code
    catches ``ValueError`` (or this class).
    """


class WorkerStartupError(PodiumError):
    """A worker process or its user class failed to start."""

    def __init__(self, message: str, *, rank: int | None = None, log_tail: str = "") -> None:
        self.rank = rank
        self.log_tail = log_tail
        text = message if not log_tail else f"{message}\n--- last log lines ---\n{log_tail}"
        super().__init__(text)


class WorkerDiedError(PodiumError):
    """A worker process died; the group it belonged to is no longer usable."""

    def __init__(
        self,
        rank: int | None,
        *,
        exit_code: int | None = None,
        signal: int | None = None,
        log_tail: str = "",
        detail: str = "",
    ) -> None:
        self.rank = rank
        self.exit_code = exit_code
        self.signal = signal
        self.log_tail = log_tail
        how = []
        if signal is not None:
            how.append(f"killed by signal {signal}")
        if exit_code is not None:
            how.append(f"exit code {exit_code}")
        text = f"worker rank {rank} died" + (f" ({', '.join(how)})" if how else "")
        if detail:
            text += f": {detail}"
        text += ". The group is unusable now; shut it down and start a new one."
        if log_tail:
            text += f"\n--- last log lines of rank {rank} ---\n{log_tail}"
        super().__init__(text)


class DataLostError(PodiumError):
    """A :class:`podium.BatchRef` names data whose producer is gone (died, or its group stopped).

    Raised at the controller -- by the call that needed the data, or by
    ``materialize()`` -- within seconds, never a hang and never partial data.
    ``ref`` is the reference's id, ``rank`` the producer rank that held the rows.
    """

    def __init__(self, ref: str, rank: int | None, *, group: str = "", detail: str = "") -> None:
        self.ref = ref
        self.rank = rank
        self.group = group
        where = f" of group {group!r}" if group else ""
        text = f"the data of BatchRef {ref} held by rank {rank}{where} is lost"
        if detail:
            text += f": {detail}"
        text += ". Recompute it (run the producing call again) on a live group."
        super().__init__(text)


class GroupShutdownError(PodiumError, RuntimeError):
    """A call was cut short because its group was shut down while it ran (or before it ran).

    Every backend raises this one type for calls in flight when ``shutdown()``
    runs, promptly and without waiting for them; ``shutdown()`` itself does
    not wait on them either.
    """

    def __init__(self, group: str, *, method: str = "", ranks: list[int] | None = None) -> None:
        self.group = group
        self.method = method
        self.ranks = list(ranks or [])
        what = f"call {method!r}" if method else "a call"
        where = f" on ranks {self.ranks}" if self.ranks else ""
        super().__init__(
            f"{what}{where} was cut short: group {group!r} was shut down while it was pending. "
            "Wait for the call's result before shutting the group down, or expect this error."
        )


class CallTimeoutError(PodiumError, TimeoutError):
    """A call (or a wait on futures) passed its deadline."""

    def __init__(self, method: str, timeout: float, ranks: list[int], *, detail: str = "") -> None:
        self.method = method
        self.timeout = timeout
        self.ranks = list(ranks)
        self.detail = detail  # what became of the call (still running, interrupted)
        super().__init__(
            f"{method!r} did not finish within {timeout:g} s; ranks that did not answer: "
            f"{self.ranks}" + (f" ({detail})" if detail else "") + ". Raise the deadline with "
            "register(..., timeout=...), WorkerGroup(..., call_timeout=...) or get(..., timeout=...)."
        )


class RemoteError(PodiumError):
    """An exception raised by user code in a worker.

    What the controller catches is an instance of both ``RemoteError`` and the
    original exception class (``except ValueError`` still works), with ``rank``,
    ``method``, ``remote_traceback`` and ``cause`` (the original exception).
    """

    rank: int | None
    method: str
    remote_traceback: str
    cause: BaseException | None

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        method: str = "",
        remote_traceback: str = "",
        cause: BaseException | None = None,
    ) -> None:
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        self.cause = cause
        super().__init__(message)

    def __str__(self) -> str:
        if self.cause is not None:
            what = f"{type(self.cause).__name__}: {self.cause}"
        else:
            what = str(self.args[0]) if self.args else ""
        head = f"rank {self.rank} raised in {self.method!r}: {what}"
        if self.remote_traceback:
            return f"{head}\n--- remote traceback (rank {self.rank}) ---\n{self.remote_traceback}"
        return head

    def __reduce__(self) -> Any:
        cause = exception_parts(self.cause) if self.cause is not None else None
        return (
            _remote_error_from_parts,
            (cause, str(self.args[0]) if self.args else "", self.rank, self.method, self.remote_traceback),
        )


_dual_classes: dict[type, type] = {}
_dual_lock = threading.Lock()


def _dual_class(cause_type: type[BaseException]) -> type[RemoteError]:
    with _dual_lock:
        cls = _dual_classes.get(cause_type)
        if cls is None:
            cls = type(
                f"RemoteError[{cause_type.__name__}]",
                (RemoteError, cause_type),
                {"__module__": __name__, "__qualname__": f"RemoteError[{cause_type.__qualname__}]"},
            )
            _dual_classes[cause_type] = cls
        return cls


def exception_parts(exc: BaseException) -> tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]:
    """``exc`` as (class, args, state): rebuilt without calling the class's ``__init__``,
    whose signature need not match ``exc.args`` (user exceptions often differ)."""
    return type(exc), exc.args, dict(getattr(exc, "__dict__", {}))


def rebuild_exception(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


def _remote_error_from_parts(
    cause: tuple[type[BaseException], tuple[Any, ...], dict[str, Any]] | None,
    message: str,
    rank: int | None,
    method: str,
    tb: str,
) -> RemoteError:
    if cause is None:
        return RemoteError(message, rank=rank, method=method, remote_traceback=tb)
    return make_remote_error(rebuild_exception(*cause), rank=rank, method=method, remote_traceback=tb)


def make_remote_error(
    cause: BaseException, *, rank: int | None, method: str, remote_traceback: str
) -> RemoteError:
    """Wrap ``cause`` in an exception that is both a ``RemoteError`` and ``type(cause)``."""
    if isinstance(cause, RemoteError):
        return cause
    message = str(cause) or type(cause).__name__
    try:
        cls = _dual_class(type(cause))
        # Build without calling the user's __init__ (its signature is unknown),
        # then carry over its state so fields and args read as on the worker.
        err: RemoteError = cls.__new__(cls)
        try:
            err.__dict__.update(cause.__dict__)
        except AttributeError:
            pass
        BaseException.__init__(err, message)
    except TypeError:
        # Layout conflicts (e.g. some C-level exception types) cannot be mixed in.
        err = RemoteError.__new__(RemoteError)
        BaseException.__init__(err, message)
    err.args = cause.args
    err.rank = rank
    err.method = method
    err.remote_traceback = remote_traceback
    err.cause = cause
    return err
