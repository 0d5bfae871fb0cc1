"""Liveness under stalls and load, failure reports that name the cause, and shutdown.

A controller that pauses is not a dead group; a worker that dies, hangs or
is torn down is reported with the rank and cause that started it; calls cut
short by ``shutdown()`` end at once with :class:`GroupShutdownError`.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from podium import (
    ClassWithInitArgs,
    ResourcePool,
    Worker,
    WorkerGroup,
    get,
    load_backend,
    register,
)
from podium.backends.torchrun.channel import ControlChannel
from podium.core.decorator import Dispatch
from podium.errors import (
    CallTimeoutError,
    GroupShutdownError,
    WorkerDiedError,
    WorkerStartupError,
)


class LiveWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def noop(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False, timeout=1.0)
    def sleep_with_deadline(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def spawn_holder(self) -> int:
        """Start a child that keeps this worker's stdout and stderr open after it exits."""
        child = subprocess.Popen(["sleep", "120"])
        return child.pid

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def exit_on(self, rank: int, code: int) -> None:
        if self.rank == rank:
            sys.stdout.flush()
            os._exit(code)


def _group(**options: object) -> WorkerGroup:
    return WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(LiveWorker),
        backend="torchrun",
        backend_options=options or None,
    )


def _hold_the_gil(seconds: float) -> None:
    """Block this process's Python threads: a C call made without releasing the GIL."""
    ctypes.PyDLL(None).sleep(int(seconds))


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _proc_state(pid: int) -> str:
    try:
        return _stat(pid)[0]
    except OSError:
        return "gone"


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def _cpu_ticks(pid: int) -> int:
    return int(_stat(pid)[11]) + int(_stat(pid)[12])


@pytest.fixture(scope="module")
def shared() -> WorkerGroup:
    wg = _group()
    yield wg
    wg.shutdown()


# -- a controller that pauses or is busy is not a dead group ------------------------------


@pytest.mark.timeout(120)
def test_a_controller_holding_the_gil_for_7_s_keeps_its_group(shared) -> None:
    assert len(shared.pid()) == 2
    _hold_the_gil(7)
    assert len(shared.pid()) == 2
    time.sleep(2)  # the supervisors' orphan timers must not fire either
    assert len(shared.pid()) == 2


@pytest.mark.timeout(60)
def test_a_supervisor_knows_of_a_link_made_before_it_next_ran(monkeypatch) -> None:
    """A supervisor descheduled right after it connects (a loaded host) finds the handshake
    done when it runs again; it must still count the connection as up, or a controller
    busy for ``orphan_timeout`` reads as gone and its workers are stopped."""
    import zmq

    from podium.backends.torchrun import worker

    chan = _channel([])
    chan.start()
    for name in ("PODIUM_TR_IPC", "PODIUM_TR_CONTROLLER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PODIUM_TR_SERVER_KEY", chan.keys.server_public.decode())
    monkeypatch.setenv("PODIUM_TR_ADDR", chan.address)
    monkeypatch.setenv("PODIUM_TR_ORPHAN_TIMEOUT", "3")
    connect = zmq.Socket.connect

    def connect_then_stall(sock: zmq.Socket, address: str) -> None:
        connect(sock, address)
        if address.startswith("tcp://"):
            time.sleep(1.0)  # the CURVE handshake completes meanwhile

    monkeypatch.setattr(zmq.Socket, "connect", connect_then_stall)
    fds = [os.pipe() for _ in range(3)]
    sup = worker._Supervisor(0, os.getpid(), fds[0][0], fds[1][0], fds[2][1], chan.keys.clients[0])
    try:
        sup.monitor.poll(5000)
        sup.read_link()
        assert sup.linked
        assert sup.controller_gone(time.monotonic(), time.monotonic() - 10) is None
    finally:
        sup.monitor.close(linger=0)
        sup.sock.close(linger=0)
        sup.ctx.term()
        chan.close()
        for r, w in fds:
            os.close(r)
            os.close(w)


@pytest.mark.timeout(120)
def test_workers_that_cannot_see_the_controller_process_keep_a_busy_one(monkeypatch, procs) -> None:
    """As on another host: the supervisors go by the connection, which a held GIL keeps up."""
    from podium.backends.torchrun import group

    monkeypatch.setattr(group, "_this_process", lambda: "", raising=False)
    wg = _group(orphan_timeout=3.0)
    gid = wg._group.gid
    try:
        assert len(wg.pid()) == 2
        _hold_the_gil(6)
        assert len(wg.pid()) == 2
    finally:
        wg.shutdown()
    assert procs.wait_gone(gid, 15) == []


@pytest.mark.timeout(120)
def test_a_stopped_controller_keeps_its_group(tmp_path) -> None:
    """SIGSTOP of the controller for longer than the supervisors' orphan timeout."""
    script = tmp_path / "controller.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_liveness import _group\n"
        "wg = _group()\n"
        "print('READY', *wg.pid(), flush=True)\n"
        "sys.stdin.readline()\n"
        "print('AFTER', *wg.pid(), flush=True)\n"
        "wg.shutdown()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        pids = [int(p) for p in line.split()[1:]]
        proc.send_signal(signal.SIGSTOP)
        time.sleep(12)
        assert all(_proc_state(p) not in ("gone", "Z") for p in pids), "workers were killed"
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line.split() == ["AFTER", *map(str, pids)]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()


@pytest.mark.timeout(120)
def test_workers_on_another_host_leave_a_controller_that_stopped_answering(tmp_path, procs) -> None:
    """As when the controller's host is lost: its connection goes silent (ZMTP heartbeats)."""
    script = tmp_path / "controller.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from podium.backends.torchrun import group\n"
        "group._this_process = lambda: ''\n"  # the supervisors cannot see this process
        "from test_liveness import _group\n"
        "wg = _group(orphan_timeout=3.0)\n"
        "print('READY', wg._group.gid, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        gid = line.split()[1]
        proc.send_signal(signal.SIGSTOP)
        assert procs.wait_gone(gid, 30) == [], "workers outlived a silent controller"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


@pytest.mark.timeout(120)
def test_ten_seconds_of_submissions_without_waiting(shared) -> None:
    futures = []
    end = time.monotonic() + 10
    while time.monotonic() < end:
        futures.append(shared.noop())
        time.sleep(0.01)
    assert len(futures) > 300
    assert all(get(f, timeout=60) == [0, 1] for f in futures)


# -- timeouts ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_get_timeout_is_not_doubled(shared) -> None:
    futures = shared.slow(8)
    start = time.monotonic()
    with pytest.raises(CallTimeoutError) as info:
        get(futures, timeout=3)
    assert time.monotonic() - start < 5  # not 2 x 3 s
    assert info.value.timeout == 3 and "still running" in str(info.value)
    assert get(futures, timeout=30) == [0, 1]  # the call itself goes on


@pytest.mark.timeout(120)
def test_a_timed_out_call_does_not_delay_the_next_one(shared) -> None:
    futures = shared.sleep_with_deadline(30)
    with pytest.raises(CallTimeoutError) as info:
        get(futures)
    assert "still running" in str(info.value)
    start = time.monotonic()
    assert shared.pid() and time.monotonic() - start < 5


# -- deaths and hangs name the rank and the cause -----------------------------------------------


@pytest.mark.timeout(120)
def test_worker_exit_while_a_child_holds_its_output(procs) -> None:
    wg = _group()
    gid = wg._group.gid
    holder = None
    try:
        holder = wg.spawn_holder()[1]
        supervisor = _parent(wg.pid()[1])
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            get(wg.exit_on(1, 3), timeout=30)
        assert time.monotonic() - start < 10
        assert info.value.rank == 1 and info.value.exit_code == 3
        # What the worker left running goes with it.
        deadline = time.monotonic() + 10
        while _proc_state(holder) not in ("gone", "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _proc_state(holder) in ("gone", "Z")
        # The supervisor does not spin on the pipe the child still holds.
        time.sleep(1)
        if _proc_state(supervisor) not in ("gone", "Z"):
            before = _cpu_ticks(supervisor)
            time.sleep(2)
            assert _cpu_ticks(supervisor) - before < 50  # < 25% of a core
        start = time.monotonic()
        wg.shutdown()
        assert time.monotonic() - start < 10
    finally:
        wg.shutdown()
        if holder:
            try:
                os.kill(holder, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert procs.wait_gone(gid, 15) == []


@pytest.mark.timeout(120)
def test_a_killed_supervisor_is_blamed_not_the_rank_torn_down_after_it(procs) -> None:
    wg = _group()
    gid = wg._group.gid
    try:
        worker = wg.pid()[1]
        supervisor = _parent(worker)
        futures = wg.slow(60)
        os.kill(supervisor, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            get(futures, timeout=30)
        assert info.value.rank == 1, str(info.value)
        assert "supervisor" in str(info.value)
    finally:
        wg.shutdown()
    assert procs.wait_gone(gid, 15) == []


@pytest.mark.timeout(120)
def test_a_killed_agent_is_reported_as_such(procs) -> None:
    wg = _group()
    gid = wg._group.gid
    try:
        worker = wg.pid()[0]
        supervisor = _parent(worker)
        agent = _parent(supervisor)
        futures = wg.slow(60)
        os.kill(agent, signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            get(futures, timeout=30)
        assert "agent" in str(info.value), str(info.value)
    finally:
        wg.shutdown()
    assert procs.wait_gone(gid, 15) == []


@pytest.mark.timeout(120)
def test_a_stopped_worker_is_reported_with_rank_and_pid(procs) -> None:
    wg = _group()
    gid = wg._group.gid
    try:
        worker = wg.pid()[1]
        os.kill(worker, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            get(wg.slow(0), timeout=30)
        assert time.monotonic() - start < 15
        assert info.value.rank == 1 and str(worker) in str(info.value)
        assert "stopped" in str(info.value)
    finally:
        wg.shutdown()
    assert procs.wait_gone(gid, 15) == []


@pytest.mark.timeout(120)
def test_a_start_up_failure_shows_its_traceback(tmp_path, monkeypatch) -> None:
    (tmp_path / "zmq.py").write_text(
        "raise ImportError('pyzmq is broken on this host (podium test)')\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    with pytest.raises(WorkerStartupError) as info:
        WorkerGroup(
            ResourcePool([1], use_gpu=False),
            ClassWithInitArgs(LiveWorker),
            backend="torchrun",
            worker_env={"PYTHONPATH": path},
        )
    assert "pyzmq is broken on this host (podium test)" in str(info.value)


# -- shutdown -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_shutdown_from_another_thread_cuts_calls_short(procs) -> None:
    wg = _group()
    gid = wg._group.gid
    futures = [wg.slow(30) for _ in range(20)]  # 10 min of work queued
    errors: list[BaseException] = []

    def waiter(fut: object) -> None:
        try:
            get(fut, timeout=60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waiter, args=(f,)) for f in futures]
    for t in threads:
        t.start()
    time.sleep(0.5)
    start = time.monotonic()
    stopper = threading.Thread(target=wg.shutdown)
    stopper.start()
    for t in threads:
        t.join(10)
    ended = time.monotonic() - start
    stopper.join(30)
    took = time.monotonic() - start
    assert len(errors) == 20 and all(isinstance(e, GroupShutdownError) for e in errors), errors[:2]
    assert ended < 2.0, f"calls ended {ended:.1f} s after shutdown()"
    assert took < 10.0, f"shutdown() took {took:.1f} s"
    assert procs.wait_gone(gid, 15) == []


class HookWorker(Worker):
    def __init__(self, out: str) -> None:
        super().__init__()
        import atexit

        self.out = out
        atexit.register(self._write, "atexit")

    def _write(self, what: str) -> None:
        with open(os.path.join(self.out, f"{what}-{self.rank}"), "w") as f:
            f.write(what)

    def shutdown(self) -> None:
        self._write("hook")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


@pytest.mark.timeout(120)
def test_shutdown_runs_the_hook_and_atexit_on_every_rank(tmp_path) -> None:
    wg = WorkerGroup(
        ResourcePool([2], use_gpu=False),
        ClassWithInitArgs(HookWorker, str(tmp_path)),
        backend="torchrun",
    )
    futures = wg.slow(30)  # a busy rank is interrupted, then stops cleanly
    time.sleep(0.5)
    start = time.monotonic()
    wg.shutdown()
    assert time.monotonic() - start < 10
    with pytest.raises(GroupShutdownError):
        get(futures)
    assert sorted(os.listdir(tmp_path)) == ["atexit-0", "atexit-1", "hook-0", "hook-1"]


@pytest.mark.timeout(120)
def test_a_dropped_group_releases_its_pool(procs) -> None:
    pool = ResourcePool([1], use_gpu=False, max_colocate_count=1)
    wg = WorkerGroup(pool, ClassWithInitArgs(LiveWorker), backend="torchrun")
    gid = wg._group.gid
    assert wg.pid()
    del wg
    gc.collect()
    wg2 = WorkerGroup(pool, ClassWithInitArgs(LiveWorker), backend="torchrun")
    try:
        assert wg2.pid()
        assert procs.wait_gone(gid, 15) == []
    finally:
        wg2.shutdown()


# -- the control channel and the group's own resources ---------------------------------------


def _channel(ticks: list[float]) -> ControlChannel:
    return ControlChannel(
        world_size=1,
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        on_message=lambda *_: None,
        on_tick=ticks.append,
        tick=0.05,
    )


def test_a_late_wake_up_never_writes_into_a_reused_fd() -> None:
    channel = _channel([])
    channel.start()
    wake_w = channel._wake_w
    channel.close()
    r, w = os.pipe()
    os.dup2(w, wake_w)  # the fd number is reused, as by a file the process opens next
    try:
        os.set_blocking(r, False)
        channel._wake()  # what a sender racing with close() does
        with pytest.raises(BlockingIOError):
            os.read(r, 10)
    finally:
        for fd in (r, w, wake_w):
            os.close(fd)


def test_the_io_thread_survives_an_error_in_its_loop() -> None:
    ticks: list[float] = []
    channel = _channel(ticks)
    real = channel._poller

    class Failing:
        failed = False

        def poll(self, timeout: int = 0) -> list:
            if not Failing.failed:
                Failing.failed = True
                raise RuntimeError("a one-off failure")
            return real.poll(timeout)

    channel._poller = Failing()  # type: ignore[assignment]
    channel.start()
    try:
        time.sleep(1.0)
        assert Failing.failed and channel._thread.is_alive()
        seen = len(ticks)
        time.sleep(0.5)
        assert len(ticks) > seen, "the I/O thread stopped ticking"
    finally:
        channel.close()


def _group_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("podium-torchrun")}


def test_a_group_that_fails_to_construct_leaves_nothing() -> None:
    from podium.backends.torchrun.group import TorchrunGroup
    from podium.core.backend import GroupSpec

    backend = load_backend("torchrun")
    spec = GroupSpec(
        pool=ResourcePool([1], use_gpu=False),
        cls_with_init=ClassWithInitArgs(LiveWorker),
        name_prefix="broken",
    )
    config = dict(backend.config, controller_host="192.0.2.1")  # TEST-NET: not this host's
    shm_before = set(os.listdir("/dev/shm"))
    threads_before = _group_threads()
    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="cannot bind the control socket to '192.0.2.1'"):
        TorchrunGroup(spec, config)
    assert set(os.listdir("/dev/shm")) - shm_before == set()
    assert _group_threads() == threads_before
    assert len(os.listdir("/proc/self/fd")) <= fds_before


@pytest.mark.timeout(120)
def test_stop_workers_waits_for_them() -> None:
    wg = _group()
    try:
        pids = wg.pid()
        assert wg._group.stop_workers(20) is True
        assert all(_proc_state(p) in ("gone", "Z") for p in pids)
    finally:
        wg.shutdown()
