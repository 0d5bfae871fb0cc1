"""Conformance: errors in user code, bad input, failed constructors, dead workers."""

from __future__ import annotations

import time

import pytest

from podium import (
    ClassWithInitArgs,
    RemoteError,
    ResourcePool,
    WorkerDiedError,
    WorkerGroup,
    register,
)
from podium.core.backend import Backend
from podium.testing.conformance.base import WORLD, BackendFixtures, skip_unless
from podium.testing.conformance.workers import ConformanceWorker, FailingInitWorker, SuiteError


class ErrorTests(BackendFixtures):
    def test_user_exception_keeps_its_class_rank_and_traceback(self, wg: WorkerGroup) -> None:
        with pytest.raises(ValueError) as info:
            wg.fail(on_rank=2)
        err = info.value
        assert isinstance(err, RemoteError)
        assert err.rank == 2 and err.method == "fail"
        assert "bad value on rank 2" in str(err)
        assert "def fail" in err.remote_traceback or "in fail" in err.remote_traceback
        assert [o["rank"] for o in wg.whoami()] == list(range(WORLD))  # still usable

    def test_custom_exception_class_round_trips(self, wg: WorkerGroup) -> None:
        with pytest.raises(SuiteError) as info:
            wg.fail(on_rank=1, kind="custom")
        assert isinstance(info.value, RemoteError)
        assert info.value.code == 7 and info.value.rank == 1

    def test_unregistered_method_says_how_to_fix_it(self, wg: WorkerGroup) -> None:
        with pytest.raises(AttributeError, match="@register"):
            wg.not_registered()
        with pytest.raises(AttributeError, match="whoami"):
            wg.whoam()

    def test_failing_constructor_raises_at_the_controller(self, backend: Backend) -> None:
        with pytest.raises(RuntimeError, match="constructor refused on rank 1") as info:
            WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(FailingInitWorker, 1), backend=backend)
        assert isinstance(info.value, RemoteError) and info.value.rank == 1

    def test_bad_register_arguments_fail_at_decoration(self) -> None:
        with pytest.raises(ValueError, match="unknown dispatch mode"):
            register(dispatch_mode="no_such_mode")
        with pytest.raises(ValueError, match="execute_mode"):
            register(execute_mode="everyone")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="dispatch_fn"):
            register(dispatch_mode={"dispatch_fn": print})

    def test_dead_worker_is_an_error_within_seconds(self, backend: Backend) -> None:
        skip_unless(backend, "detects_dead_workers")
        group = WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(ConformanceWorker), backend=backend)
        try:
            futures = group.execute_all_async("die", 1)  # rank 0 sleeps 30 s; rank 1 dies
            start = time.monotonic()
            # A death fails every pending call of the group, not only the dead rank's:
            # rank 0's future does not wait for its own call.
            for future in futures:
                with pytest.raises(WorkerDiedError) as info:
                    future.result(60)
                assert info.value.rank == 1
            assert time.monotonic() - start < 15
            start = time.monotonic()
            with pytest.raises(WorkerDiedError):
                group.whoami()
            assert time.monotonic() - start < 5  # later calls fail fast
        finally:
            group.shutdown()
