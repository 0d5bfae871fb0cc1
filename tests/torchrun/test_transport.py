"""The control channel's fast paths: message layout, shared-segment references, batched waits."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from podium import ClassWithInitArgs, RemoteError, ResourcePool, Worker, WorkerGroup, get, register
from podium.backends.torchrun import wire, worker
from podium.backends.torchrun.backend import TorchrunBackend
from podium.backends.torchrun.shm import SegmentMap, SegmentPool, tune_malloc, unlink_prefix
from podium.core.backend import RankCall
from podium.core.decorator import Dispatch
from podium.core.host import Outcome

# -- message layout (no processes) ------------------------------------------------


def test_head_round_trip() -> None:
    assert wire.split_head(wire.head(wire.STOP)) == (wire.STOP, None)
    meta = (7, "noop", (("v", None), ("b", b"\x80")), (0,), {"k": 0}, ("seg", "\ud800"))
    assert wire.split_head(wire.head(wire.CALL, meta)) == (wire.CALL, meta)
    # lists travel as tuples (msgpack arrays)
    assert wire.split_head(wire.head(wire.FREE, ["a", "b"])) == (wire.FREE, ("a", "b"))


def test_supervisor_kinds_match_the_wire() -> None:
    # The supervisor spells its kinds out so that it does not import torch.
    assert (worker._BEAT, worker._LOG, worker._EXIT) == (wire.BEAT, wire.LOG, wire.EXIT)
    kinds = [wire.HELLO, wire.READY, wire.RESULT, wire.BEAT, wire.LOG, wire.EXIT]
    kinds += [wire.INIT, wire.CALL, wire.FREE, wire.STOP, wire.PING]
    kinds += [wire.CALL_BARE, wire.RESULT_NONE, wire.CANCEL, wire.QUIT, wire.STALL]
    assert len(set(kinds)) == len(kinds) and all(len(k) == 1 for k in kinds)


def test_bare_call_and_none_reply_heads() -> None:
    # The two fixed layouts that skip msgpack: kind, call id (8 bytes LE), target.
    for call_id, target in [(0, "noop"), ((1 << 64) - 1, "stép_ünïcode")]:
        head = wire.bare_call(call_id, target)
        assert head[:1] == wire.CALL_BARE
        assert wire.split_bare_call(head) == (call_id, target)
    assert wire.result_none(5) == wire.RESULT_NONE + (5).to_bytes(8, "little")
    with pytest.raises(ValueError, match="malformed b'c' message head: 5 bytes"):
        wire.split_bare_call(wire.bare_call(1, "x")[:5])


@pytest.mark.parametrize(
    "value", [None, True, 3, -(1 << 63), 2.5, "text", "\udcff", b"bytes", Outcome(True, 4)]
)
def test_plain_values_travel_in_meta(value: object) -> None:
    desc, frames = wire.place(wire.encode(value), None)
    assert desc[0] in "vo" and frames == []
    head = wire.head(wire.RESULT, (0, desc, []))
    (_, back, _) = wire.split_head(head)[1]
    assert wire.decode_objects([back], [], SegmentMap()) == [value]


def test_integers_beyond_64_bits_keep_pickle() -> None:
    for value in (1 << 64, -(1 << 63) - 1, Outcome(True, 1 << 100)):
        desc, _ = wire.place(wire.encode(value), None)
        assert desc[0] == "b"
        (_, back, _) = wire.split_head(wire.head(wire.RESULT, (0, desc, [])))[1]
        assert wire.decode_objects([back], [], SegmentMap()) == [value]


def test_other_values_keep_cloudpickle() -> None:
    # A failed outcome, a class and a small tensor are not "plain": cloudpickle
    # (in meta when small and without buffers, else as frames).
    failed = Outcome(False, None)
    for value in (failed, Worker, [1, 2]):
        desc, frames = wire.place(wire.encode(value), None)
        assert desc[0] == "b" and frames == []
        assert wire.decode_objects([desc], [], SegmentMap()) == [value]
    t = torch.arange(4.0)
    desc, frames = wire.place(wire.encode(t), None)
    assert desc[0] == "i" and len(frames) == 2
    (back,) = wire.decode_objects([desc], [bytes(f) for f in frames], SegmentMap())
    assert torch.equal(back, t)


def test_a_shared_segment_stays_held_until_every_peer_released_it() -> None:
    prefix = "podium-testtransport-c-"
    pool = SegmentPool(prefix)
    try:
        enc = wire.encode(torch.zeros(1 << 17))  # 512 KiB: above SHM_MIN_BYTES
        descs = [wire.place(enc, pool)[0] for _ in range(3)]
        assert all(d[0] == "s" for d in descs) and len({d[1] for d in descs}) == 1
        seg = enc.shared[0]  # type: ignore[index]
        pool.release([seg.name])  # one peer is done early, while the others still read
        wire.done_placing(enc, pool)
        assert pool.acquire(1 << 19) is not seg  # still held by two peers
        pool.release([seg.name, seg.name])
        assert pool.acquire(1 << 19) is seg  # now free for reuse
    finally:
        pool.close()
        unlink_prefix(prefix)


def test_tune_malloc_is_an_option_and_applies() -> None:
    option = {o.name: o for o in TorchrunBackend.options}["tune_malloc"]
    assert option.default is True and "RSS" in option.help
    assert tune_malloc() in (True, False)  # False only off glibc


# -- with workers ------------------------------------------------------------------


class TransportWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total(self, t: torch.Tensor, extra: int) -> float:
        return float(t.sum()) + extra

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def rank_zero_fails(self, seconds: float) -> int:
        if self.rank == 0:
            raise ValueError("rank 0 failed at once")
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def rank_zero_first(self, seconds: float) -> int:
        if self.rank != 0:
            time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def big(self) -> torch.Tensor:
        return torch.full((256, 1024), float(self.rank))  # 1 MiB: through shared memory

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nothing(self) -> None:
        return None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def which(self) -> str:
        return "method"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rebind_which(self) -> None:
        self.which = lambda: f"rebound on {self.rank}"  # type: ignore[method-assign]

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def count(self, *args: int) -> int:
        return len(args) * 10 + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def thread_policies(self) -> list[tuple[str, bool, int]]:
        """(name, is the main thread, scheduling policy) of each thread of this rank."""
        out = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            out.append((name, int(tid) == os.getpid(), os.sched_getscheduler(int(tid))))
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def dynamo_state(self) -> tuple[bool, bool, float]:
        loaded = "torch._dynamo" in sys.modules
        from tensordict.utils import _lock_warn

        compiled = torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
        # tensordict's import-time assume_constant_result, replayed when Dynamo loaded.
        marked = getattr(_lock_warn, "_dynamo_marked_constant", False)
        return loaded, marked, float(compiled.sum())


@pytest.fixture(scope="module")
def wg():
    group = WorkerGroup(
        ResourcePool([2], use_gpu=False), ClassWithInitArgs(TransportWorker), backend="torchrun"
    )
    yield group
    group.shutdown()


def test_workers_on_this_host_use_the_unix_socket(wg: WorkerGroup) -> None:
    # Same socket as the TCP port (same CURVE keys and ZAP check), private directory.
    address = wg._group.channel.ipc_address
    assert address.startswith("ipc://")
    path = address[len("ipc://") :]
    assert os.path.exists(path) and os.stat(os.path.dirname(path)).st_mode & 0o077 == 0
    with open("/proc/net/unix") as f:
        ends = [line for line in f if line.rstrip().endswith(path)]
    # The listener, then the controller's end of each worker's and supervisor's connection.
    assert len(ends) >= 1 + 2 * wg.world_size


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.timeout(60)
def test_a_ranks_zeromq_thread_does_not_preempt_its_main_thread(wg: WorkerGroup) -> None:
    for threads in wg.thread_policies():
        (main,) = [policy for _, is_main, policy in threads if is_main]
        assert main == os.SCHED_OTHER  # the rank's own threads keep the default
        # The call socket's I/O thread: woken by each reply's send, it waits for
        # the main thread to block instead of preempting it.
        io = [policy for name, _, policy in threads if name.startswith("ZMQbg/IO")]
        assert io.count(os.SCHED_BATCH) == 1, threads


@pytest.mark.timeout(120)
def test_one_tensor_to_all_ranks_through_one_segment(wg: WorkerGroup) -> None:
    # Every rank reads the same segment; its references must outlive the
    # fastest rank's release, call after call.
    for i in range(20):
        t = torch.full((256, 1024), float(i))  # 1 MiB
        assert wg.total(t, i) == [float(t.sum()) + i] * 2


@pytest.mark.timeout(120)
def test_a_failed_rank_ends_the_wait_for_its_call(wg: WorkerGroup) -> None:
    start = time.monotonic()
    with pytest.raises(RemoteError, match="rank 0 failed at once"):
        get(wg.rank_zero_fails(20.0), timeout=60)
    assert time.monotonic() - start < 10


@pytest.mark.timeout(120)
def test_waiting_for_some_ranks_does_not_wait_for_the_others(wg: WorkerGroup) -> None:
    futures = wg.rank_zero_first(3.0)
    start = time.monotonic()
    assert get(futures[:1], timeout=30) == [0]
    assert time.monotonic() - start < 2.5
    assert get(futures, timeout=30) == [0, 1]


@pytest.mark.timeout(120)
def test_calls_without_arguments_carry_the_segments_the_controller_freed(wg: WorkerGroup) -> None:
    # A rank's 1 MiB result lives in its own segment until the controller lets
    # go. The controller notes the release when the next reply comes in (the
    # first ``nothing``); the call after that (a CALL_BARE one) hands it back,
    # so the rank reuses the segment instead of making a new one every round.
    maps = wg._group._segments._maps
    for _ in range(15):
        assert [float(t[0, 0]) for t in wg.big()] == [0.0, 1.0]
        assert wg.nothing() == [None, None]
        assert wg.nothing() == [None, None]
        assert wg._group._ranks[0].freed == [] and wg._group._ranks[1].freed == []
    assert len([name for name in maps if "-w0-" in name]) <= 3


@pytest.mark.timeout(120)
def test_a_method_the_worker_rebinds_is_the_one_its_next_call_runs(wg: WorkerGroup) -> None:
    # After its first call a rank keeps the verdict that ``which`` is a plain
    # method and calls it directly, but still looks the attribute up each time.
    assert wg.which() == ["method", "method"]
    assert wg.which() == ["method", "method"]
    wg.rebind_which()
    assert wg.which() == ["rebound on 0", "rebound on 1"]


@pytest.mark.timeout(120)
def test_a_call_with_arguments_for_some_ranks_only(wg: WorkerGroup) -> None:
    # Ranks without arguments take the bare head while others get theirs.
    calls = [RankCall(0, (1, 2), {}), RankCall(1, (), {})]
    assert get(wg._group.submit("count", calls, timeout=30)) == [20, 1]
    calls = [RankCall(0, (), {}), RankCall(1, (), {})]
    assert get(wg._group.submit("count", calls, timeout=30)) == [0, 1]


@pytest.mark.timeout(120)
def test_workers_import_dynamo_only_when_something_compiles(wg: WorkerGroup) -> None:
    # The worker defers torch._dynamo (lazy_dynamo): not loaded by podium's
    # imports, and tensordict's registrations replayed once torch.compile loads it.
    assert wg.dynamo_state() == [(False, True, 4.0)] * 2
