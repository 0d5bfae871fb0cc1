"""How Ray groups stop: shutdown, a dropped group, the controller's exit, timed-out calls."""

from __future__ import annotations

import atexit
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from _raytools import eventually, live_actor_names, live_placement_groups, restart_ray, stop_ray

from podium import ClassWithInitArgs, Dispatch, ResourcePool, Worker, WorkerGroup, get, register
from podium.errors import CallTimeoutError, GroupShutdownError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    restart_ray(num_cpus=8)
    yield
    stop_ray()


class Hooked(Worker):
    """Leaves a file from its shutdown() hook and one from an atexit handler."""

    def __init__(self, out: str) -> None:
        self.out = out
        rank = self.rank
        atexit.register(lambda: Path(out, f"atexit-{rank}").write_text("ran"))

    def shutdown(self) -> None:
        Path(self.out, f"hook-{self.rank}").write_text("ran")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False, timeout=1.0)
    def sleep_1s_deadline(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, timeout=1.0)
    def until_cancelled(self, limit: float) -> str:
        start = time.monotonic()
        while time.monotonic() - start < limit:
            if ray.get_runtime_context().is_canceled():
                return "cancelled"
            time.sleep(0.05)
        return "ran to the end"


def _files(out: Path, kind: str) -> list[str]:
    return sorted(p.name for p in out.glob(f"{kind}-*"))


def test_shutdown_runs_the_hook_and_atexit_handlers(tmp_path: Path) -> None:
    wg = WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(Hooked, str(tmp_path)), backend="ray"
    )
    assert wg.ping() == [0, 1]
    wg.shutdown()
    assert _files(tmp_path, "hook") == ["hook-0", "hook-1"]
    assert _files(tmp_path, "atexit") == ["atexit-0", "atexit-1"]
    assert live_placement_groups() == []


def test_dropped_group_releases_its_slots_like_shutdown(tmp_path: Path) -> None:
    pool = ResourcePool([2], use_gpu=False)  # max_colocate_count=1: one group at a time
    wg = WorkerGroup(
        pool, ClassWithInitArgs(Hooked, str(tmp_path)), backend="ray", name_prefix="dropped"
    )
    assert wg.ping() == [0, 1]
    del wg
    gc.collect()
    with WorkerGroup(pool, ClassWithInitArgs(Hooked, str(tmp_path / "..")), backend="ray") as again:
        assert again.ping() == [0, 1]
    assert _files(tmp_path, "hook") == ["hook-0", "hook-1"]
    assert _files(tmp_path, "atexit") == ["atexit-0", "atexit-1"]
    assert eventually(lambda: live_actor_names("dropped") == [])
    assert eventually(lambda: live_placement_groups() == [])


CONTROLLER = textwrap.dedent(
    """
    import sys
    from podium import ClassWithInitArgs, ResourcePool, WorkerGroup
    from test_lifecycle import Hooked

    wg = WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(Hooked, sys.argv[1]),
                     backend="ray", name_prefix="exiting")
    assert wg.ping() == [0, 1]
    sys.exit(0)  # no shutdown(): the controller's exit stops the group
    """
)


def test_controller_exit_stops_its_groups_gracefully(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = subprocess.run(
        [sys.executable, "-c", CONTROLLER, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _files(tmp_path, "hook") == ["hook-0", "hook-1"]
    assert _files(tmp_path, "atexit") == ["atexit-0", "atexit-1"]
    assert eventually(lambda: live_actor_names("exiting") == [])


def test_shutdown_from_another_thread_cuts_calls_short(tmp_path: Path) -> None:
    wg = WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(Hooked, str(tmp_path)),
        backend="ray",
        backend_options={"stop_timeout": 3.0},
    )
    running = wg.sleep(60)
    queued = wg.sleep(60)
    errors: list[tuple[BaseException, float]] = []

    def wait(futures: Any) -> None:
        try:
            get(futures)
        except BaseException as exc:
            errors.append((exc, time.monotonic()))

    waiters = [threading.Thread(target=wait, args=(f,)) for f in (running, queued)]
    for t in waiters:
        t.start()
    time.sleep(1.0)
    start = time.monotonic()
    wg.shutdown()
    assert time.monotonic() - start < 3.0 + 10  # bounded by stop_timeout, not by the calls
    for t in waiters:
        t.join(timeout=30)
    assert len(errors) == 2
    for exc, when in errors:
        assert isinstance(exc, GroupShutdownError), repr(exc)
        assert when - start < 5
    assert eventually(lambda: live_placement_groups() == [])


def test_timed_out_call_is_cancelled(tmp_path: Path) -> None:
    with WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(Hooked, str(tmp_path)),
        backend="ray",
    ) as wg:
        # A method that looks at Ray's cancellation flag stops when its call times out.
        with pytest.raises(CallTimeoutError) as info:
            wg.until_cancelled(60)
        assert info.value.ranks == [0, 1]
        assert "may still run it: [0, 1]" in str(info.value)
        start = time.monotonic()
        assert wg.ping() == [0, 1]
        assert time.monotonic() - start < 10  # not the 60 s the timed-out call would have run
        # One that does not runs to its end, but calls queued behind it are dropped.
        first, second = wg.sleep_1s_deadline(6), wg.sleep_1s_deadline(6)
        with pytest.raises(CallTimeoutError):
            get(first)
        with pytest.raises(CallTimeoutError):
            get(second)
        start = time.monotonic()
        assert wg.ping() == [0, 1]
        assert time.monotonic() - start < 8.5  # waited for `first` only, not `second` too


@pytest.mark.timeout(300)
def test_waiting_for_placement_does_not_block_other_threads(tmp_path: Path) -> None:
    # 8 CPUs, 4 per slot: a group holds all 8, a second one waits for them in another thread.
    options = {"cpus_per_worker": 4, "placement_timeout": 120.0}
    busy = WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(Hooked, str(tmp_path)),
        backend="ray",
        backend_options=options,
    )
    started: list[Any] = []

    def start_waiting() -> None:
        try:
            started.append(
                WorkerGroup(
                    ResourcePool([1], use_gpu=False),
                    ClassWithInitArgs(Hooked, str(tmp_path)),
                    backend="ray",
                    backend_options=options,
                )
            )
        except BaseException as exc:
            started.append(exc)

    waiter = threading.Thread(target=start_waiting)
    waiter.start()
    time.sleep(2.0)  # the waiter is now waiting for its placement group
    begin = time.monotonic()
    busy.shutdown()  # releases its placement group: must not wait for the other thread
    assert time.monotonic() - begin < 20
    waiter.join(timeout=200)
    assert len(started) == 1 and isinstance(started[0], WorkerGroup), started
    assert started[0].ping() == [0]
    started[0].shutdown()


KILLED_CONTROLLER = textwrap.dedent(
    """
    import sys, time
    from podium import ClassWithInitArgs, ResourcePool, WorkerGroup
    from test_lifecycle import Hooked

    import os
    from podium import Dispatch, register

    class Ranks(Hooked):
        @register(Dispatch.ALL_TO_ALL)
        def pid(self):
            return os.getpid()

    wg = WorkerGroup(ResourcePool([2], use_gpu=False), ClassWithInitArgs(Ranks, sys.argv[1]),
                     backend="ray")  # podium starts a local Ray for this controller
    print("ready", *wg.pid(), flush=True)
    time.sleep(600)
    """
)


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment carries ``marker``: everything the controller started."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return found


def _stat(pid: int | str) -> list[str]:
    """``/proc/<pid>/stat`` from its third field (the state) on; [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot): with its pid, names it uniquely."""
    fields = _stat(pid)
    return fields[19] if fields and fields[0] != "Z" else None


def _descendants(root: int) -> dict[int, str]:
    """Every live process below ``root``, as pid -> start time. Unlike an environment
    mark this finds a process that rewrote its environment (a process title does)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(entry)):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        started = _start_time(pid)
        if started is not None:
            found[pid] = started
        todo.extend(children.get(pid, []))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through /proc")
def test_nothing_outlives_a_killed_controller(tmp_path: Path) -> None:
    marker = f"PODIUM_TEST_CONTROLLER={uuid.uuid4().hex}"
    env = {
        **os.environ,
        marker.split("=")[0]: marker.split("=")[1],
        "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CONTROLLER, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, *pids = proc.stdout.readline().split()
        assert ready == "ready"
        ranks = [int(p) for p in pids]
        started = _processes_with(marker)
        assert set(ranks) < set(started)  # and the controller, Ray's own processes
        # Ray's agents start with the raylet, a little after ray.init returns.
        time.sleep(3)
        tree = _descendants(proc.pid)
        assert len(tree) > len(ranks)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    # All of it goes within seconds: the ranks, and Ray's own daemons -- its agents too,
    # which on their own poll for their dead raylet and GCS for about a minute.
    def left() -> list[int]:
        return [p for p, t in tree.items() if _start_time(p) == t] + [
            p for p in _processes_with(marker) if p not in tree
        ]

    assert eventually(lambda: not set(ranks) & set(left()), timeout=15)
    assert eventually(lambda: left() == [], timeout=20), [
        Path(f"/proc/{pid}/cmdline").read_bytes()[:60] for pid in left()
    ]
