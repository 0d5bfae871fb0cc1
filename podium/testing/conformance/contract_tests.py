"""Conformance: the rules of :mod:`podium.backend_api` a backend can get subtly wrong.

Worker classes that must travel by value, the environment at interpreter
start, targets without ``@register``, and ``submit`` on a busy rank. (A dead
rank failing the whole group's futures is checked in ``errors_tests``; no
process left after ``shutdown()`` in ``lifecycle_tests``.)
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from podium import ClassWithInitArgs, RemoteError, ResourcePool, WorkerGroup, get
from podium.backend_api import RESERVED_ENV, Backend
from podium.testing.conformance.base import WORLD, BackendFixtures, skip_unless
from podium.testing.conformance.workers import ConformanceWorker

# A module the test writes to a directory on the controller's sys.path only (as
# a script's sibling module is): workers cannot import it, so it must travel by value.
SCRIPT_MODULE = """
from podium import Dispatch, Worker, register


class ScriptWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def apply(self, func, value):
        return type(self).__name__, self.rank, func(value)
"""


class ContractTests(BackendFixtures):
    @pytest.mark.timeout(180)
    def test_a_worker_class_from_a_script_travels_by_value(
        self, backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        name = f"podium_script_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(SCRIPT_MODULE)
        monkeypatch.syspath_prepend(str(tmp_path))  # not on PYTHONPATH: workers cannot import it
        module = importlib.import_module(name)
        offset = 40

        def add_offset(value: int) -> int:  # a closure: by value as well
            return value + offset

        with WorkerGroup(
            ResourcePool([2], use_gpu=False),
            ClassWithInitArgs(module.ScriptWorker),
            backend=backend,
        ) as group:
            assert group.apply(add_offset, 2) == [("ScriptWorker", 0, 42), ("ScriptWorker", 1, 42)]

    def test_rank_variables_are_set_before_the_constructor(
        self, backend: Backend, wg: WorkerGroup
    ) -> None:
        skip_unless(backend, "process_group")
        for rank, env in enumerate(wg.init_env()):
            assert set(env) == set(RESERVED_ENV) and all(env.values()), env
            assert env["RANK"] == str(rank)

    def test_worker_env_is_there_when_the_interpreter_starts(self, backend: Backend) -> None:
        skip_unless(backend, "worker_env")
        if not sys.platform.startswith("linux"):
            pytest.skip("reads the starting environment from /proc/self/environ (Linux)")
        with WorkerGroup(
            ResourcePool([1], use_gpu=False),
            ClassWithInitArgs(ConformanceWorker),
            backend=backend,
            worker_env={"PODIUM_SUITE_AT_START": "yes", "OMP_NUM_THREADS": "3"},
        ) as group:
            assert group.start_env("PODIUM_SUITE_AT_START", "OMP_NUM_THREADS") == [
                {"PODIUM_SUITE_AT_START": "yes", "OMP_NUM_THREADS": "3"}
            ]

    def test_targets_without_register_and_unknown_targets(self, wg: WorkerGroup) -> None:
        assert wg.execute_all_sync("not_registered") == list(range(WORLD))
        with pytest.raises(AttributeError) as info:
            wg.execute_all_sync("no_such_method")
        assert isinstance(info.value, RemoteError)
        assert [o["rank"] for o in wg.whoami()] == list(range(WORLD))  # still usable

    @pytest.mark.timeout(120)
    def test_submit_does_not_wait_for_a_busy_rank(self, wg: WorkerGroup) -> None:
        busy = threading.Thread(target=wg.execute_rank_zero_sync, args=("sleep", 4.0))
        busy.start()
        try:
            time.sleep(0.5)  # rank 0 is in its 4 s call
            start = time.monotonic()
            futures = wg.execute_all_async("echo", "queued")
            submitted = time.monotonic() - start
            assert submitted < 2.0, f"submit waited {submitted:.1f} s for the busy rank"
            assert [r for r, _, _ in get(futures, timeout=60)] == list(range(WORLD))
        finally:
            busy.join(60)
