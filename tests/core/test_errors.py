"""Errors pickle with their fields; remote errors are both RemoteError and the original class."""

from __future__ import annotations

import pickle

import pytest

from podium.core.host import RemoteFailure
from podium.errors import (
    CallTimeoutError,
    RemoteError,
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerStartupError,
    make_remote_error,
)


class Custom(Exception):
    def __init__(self, a: int, b: str) -> None:
        super().__init__(f"{a}/{b}")
        self.a = a
        self.b = b


@pytest.mark.parametrize(
    "err",
    [
        WorkerDiedError(3, signal=9, log_tail="oom"),
        CallTimeoutError("step", 2.0, [1, 2]),
        ResourceUnavailableError("too big", demand={"GPU": 8}, supply={"GPU": 4}),
        WorkerStartupError("no start", rank=0, log_tail="trace"),
    ],
)
def test_errors_pickle_with_fields(err: Exception) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__


def test_dead_worker_message_names_rank_signal_and_logs() -> None:
    text = str(WorkerDiedError(3, signal=9, exit_code=None, log_tail="last words"))
    assert "rank 3" in text and "signal 9" in text and "last words" in text


def test_remote_error_is_the_original_class_and_pickles() -> None:
    try:
        raise Custom(4, "x")
    except Custom as exc:
        failure = RemoteFailure.capture(exc, rank=2, method="step")
    err = pickle.loads(pickle.dumps(failure)).to_exception()
    assert isinstance(err, RemoteError) and isinstance(err, Custom)
    assert (err.a, err.b, err.rank, err.method) == (4, "x", 2, "step")
    assert "raise Custom(4" in err.remote_traceback
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, Custom) and isinstance(again, RemoteError) and again.rank == 2
    with pytest.raises(Custom):
        raise err


def test_builtin_exception_args_are_kept() -> None:
    err = make_remote_error(KeyError("missing"), rank=0, method="m", remote_traceback="")
    assert isinstance(err, KeyError) and err.args == ("missing",)
    assert "KeyError" in str(err) and "rank 0" in str(err)


def test_unpicklable_exception_still_reports() -> None:
    class Local(Exception):
        pass

    failure = RemoteFailure("Local", "m", "Local", "boom", "tb", None)
    failure.rank = 1
    err = failure.to_exception()
    assert isinstance(err, RemoteError) and "boom" in str(err) and err.rank == 1
