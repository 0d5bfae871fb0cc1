"""Worker classes the conformance suite runs on every backend.

They live in an installed module (not a test file) so every backend can import
them by reference; the suite also checks by-value classes separately.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import torch

from podium import (
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    Execute,
    Worker,
    create_colocated_worker_raw_cls,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from podium.backend_api import RESERVED_ENV


class SuiteError(Exception):
    """A user exception with a constructor of its own."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code
        self.detail = detail


def _refuse(what: str) -> Any:
    raise ValueError(f"{what} refuses to be unpickled")


class Unloadable:
    """Pickles fine; unpickling it raises, on whichever side receives it."""

    def __reduce__(self) -> Any:
        return (_refuse, ("Unloadable",))


class Unsendable:
    """Cannot be pickled at all."""

    def __reduce__(self) -> Any:
        raise TypeError("Unsendable cannot be pickled")


class SubWorker(Worker):
    """A worker that a rank's method builds; it takes that rank's place."""


class ConformanceWorker(Worker):
    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.rank_at_init = (self.rank, self.world_size, self.local_rank, self.local_world_size)
        self.calls = 0
        self.running = 0
        self.most_running = 0
        self.guard = threading.Lock()
        self.ticks = 0
        self.ticker: Any = None
        self.async_running = 0
        self.async_most = 0
        # What the constructor saw: the rank variables must be set before it runs.
        self.env_at_init = {name: os.environ.get(name) for name in RESERVED_ENV}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self, tag: Any = None) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "at_init": self.rank_at_init,
            "pid": os.getpid(),
            "tag": tag,
            "offset": self.offset,
            "host": socket.gethostname(),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self, *names: str) -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in names}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_env(self, *names: str) -> dict[str, str | None]:
        """The variables as the process's interpreter started with them (Linux: /proc/self/environ)."""
        with open("/proc/self/environ", "rb") as f:
            entries = [e.decode(errors="replace").partition("=") for e in f.read().split(b"\0") if e]
        initial = {k: v for k, _, v in entries}
        return {name: initial.get(name) for name in names}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_env(self) -> dict[str, str | None]:
        return dict(self.env_at_init)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def echo(self, *args: Any, **kwargs: Any) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
        return self.rank, args, kwargs

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def rank_zero_echo(self, value: Any) -> tuple[int, Any]:
        return self.rank, value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self, value: Any) -> tuple[int, Any]:
        return self.rank, value

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def dp_compute(self, value: Any, *, scale: int = 1) -> tuple[int, Any]:
        return self.rank, value * scale

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_rank(self, data: DataProto, bias: float = 0.0) -> DataProto:
        """The quickstart's scoring: each row gets its rank (plus ``bias``) added."""
        out = data.select(batch_keys=["x"], deepcopy=True)
        out.batch["x"] += self.rank + bias
        out.batch["rank"] = torch.full((len(out),), self.rank)
        # Per-rank values go under "metrics": concat merges them into lists and
        # refuses other meta_info keys whose values differ between ranks.
        out.meta_info = {"metrics": {"rank": self.rank, "rows": len(data)}}
        data.meta_info["touched_by"] = self.rank  # must never reach the caller's object
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def change_in_place(self, data: DataProto) -> DataProto:
        """verl's in-place operations on the received shard; the caller's object must not change."""
        extra = DataProto.from_dict({"w": torch.full((len(data),), float(self.rank))})
        return data.to("cpu").rename("x", "z").union(extra)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_rank_td(self, td: Any) -> Any:
        out = td.clone()
        out["x"] = out["x"] + self.rank
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def add_rank_async(self, data: DataProto) -> DataProto:
        return _add(self, data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def future_type(self, data: Any) -> str:
        return type(data).__name__

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> dict[str, Any]:
        return {"rank": self.rank, "rows": len(data), "sum": float(data.batch["x"].sum())}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def async_double(self, value: int, delay: float = 0.0) -> tuple[int, int]:
        await asyncio.sleep(delay)
        return self.rank, value * 2

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def start_ticking(self, interval: float) -> None:
        """Start a task on the rank's loop that counts until stop_ticking()."""

        async def tick() -> None:
            while True:
                self.ticks += 1
                await asyncio.sleep(interval)

        self.ticks = 0
        self.ticker = asyncio.get_running_loop().create_task(tick())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ticks_now(self) -> int:
        return self.ticks

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def stop_ticking(self) -> int:
        self.ticker.cancel()
        return self.ticks

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def hold_async(self, seconds: float) -> int:
        """Await ``seconds``; the most async calls this rank ran at once so far."""
        with self.guard:
            self.async_running += 1
            self.async_most = max(self.async_most, self.async_running)
        try:
            await asyncio.sleep(seconds)
        finally:
            with self.guard:
                self.async_running -= 1
        return self.async_most

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def nonblocking(self, value: int) -> tuple[int, int]:
        return self.rank, value + 1

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, timeout=1.0)
    def sleep_with_deadline(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail(self, on_rank: int, kind: str = "value") -> int:
        if self.rank == on_rank:
            if kind == "value":
                raise ValueError(f"bad value on rank {self.rank}")
            raise SuiteError(7, f"custom failure on rank {self.rank}")
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def count(self) -> int:
        self.calls += 1
        return self.calls

    # Calls without arguments, in every mode that has a shorter path for them.
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_bare(self) -> int:
        raise ValueError(f"bare failure on rank {self.rank}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, timeout=0.5)
    def hang_bare(self) -> int:
        time.sleep(3.0)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def rank_zero_bare(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def later_bare(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def build_bare(self) -> tuple[int, int]:
        inner = SubWorker()  # built inside a call, as verl's init_model builds its engine
        return inner.rank, inner.world_size

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def coroutine_bare(self) -> Any:
        async def answer() -> int:
            return self.rank

        return answer()  # a plain method that returns an awaitable: awaited like an async one

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return float(t.item())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def die(self, on_rank: int, how: str = "kill") -> int:
        if self.rank == on_rank:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        time.sleep(30)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exit(self, on_rank: int, code: int) -> int:
        if self.rank == on_rank:
            sys.exit(code)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def overlap(self, seconds: float) -> int:
        """Sleeps; returns the most calls this rank ever ran at the same time."""
        with self.guard:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            time.sleep(seconds)
        finally:
            with self.guard:
                self.running -= 1
        return self.most_running

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def bad_return(self, on_rank: int, kind: str) -> Any:
        if self.rank != on_rank:
            return self.rank
        return Unloadable() if kind == "unloadable" else Unsendable()

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def take(self, value: Any) -> int:
        return self.rank

    def not_registered(self) -> int:
        return self.rank

    # -- data plane -------------------------------------------------------------

    def _stage(self, data: DataProto, scale: float) -> DataProto:
        batch = data.batch
        if batch is None:
            raise ValueError("a data-plane stage needs a batch with 'x' or 'y'")
        src = batch["y"] if "y" in batch.keys() else batch["x"]
        out = data.select()
        out.batch["y"] = src * scale + self.rank
        out.batch["length"] = torch.full((len(data),), 10 + self.rank)
        out.meta_info["stage"] = scale
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, output="ref", row_meta=["length"])
    def ref_stage(self, data: DataProto, scale: float = 2.0) -> DataProto:
        return self._stage(data, scale)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def value_stage(self, data: DataProto, scale: float = 2.0) -> DataProto:
        return self._stage(data, scale)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, output="ref")
    def bump_ref(self, data: DataProto, by: float = 1.0) -> DataProto:
        """Adds ``by`` to its input's ``w`` in place (a rank owns what it reads) and returns it."""
        w = data.batch["w"]
        self.last_w = {"file": mapped_file(w.data_ptr()), "rows": len(w)}
        w.add_(by)
        return data

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def last_input(self) -> dict[str, Any]:
        """Where the ``w`` of this rank's last ``bump_ref`` input lay: the file mapped there, if any."""
        return dict(getattr(self, "last_w", {}))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def received(self, data: Any) -> dict[str, Any]:
        """What this rank was handed: its type, keys and row values."""
        batch = data.batch if isinstance(data, DataProto) else data
        keys = sorted(map(str, batch.keys())) if batch is not None else []
        return {
            "rank": self.rank,
            "type": type(data).__name__,
            "keys": keys + sorted(getattr(data, "non_tensor_batch", {})),
            "len": len(data),
            "uid": [str(u) for u in getattr(data, "non_tensor_batch", {}).get("uid", [])],
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def dataplane_stats(self, reset: bool = False) -> dict[str, int]:
        from podium.core.dataplane import held_shards, transfer_stats

        return {**transfer_stats(reset), **held_shards()}


def mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= address < hi:
                    return fields[5] if len(fields) > 5 else None
    except OSError:
        pass
    return None


class LifecycleWorker(ConformanceWorker):
    """Appends ``shutdown <rank>`` to ``marker`` from its shutdown() hook, and
    ``atexit <rank> gloo <n>`` from an atexit handler when it runs in its own
    process, ``n`` being how many gloo threads the process still has then."""

    def __init__(self, marker: str, controller_pid: int) -> None:
        super().__init__()
        self.marker = marker
        if os.getpid() != controller_pid:
            atexit.register(_append_at_exit, marker, self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shard_a_module(self) -> int:
        """Train one step of a module sharded with FSDP2 over a gloo group it leaves open,
        as user code does; returns the gloo threads running now."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = torch.nn.Linear(8, 8)
        fully_shard(model, mesh=mesh)
        model(torch.ones(2, 8)).sum().backward()
        return len(gloo_threads())

    def shutdown(self) -> None:
        _append(self.marker, f"shutdown {self.rank}")


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (none where there is no ``/proc``)."""
    if not os.path.isdir("/proc/self/task"):
        return []
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return [n for n in names if "gloo" in n]


def _append_at_exit(path: str, rank: int) -> None:
    _append(path, f"atexit {rank} gloo {len(gloo_threads())}")


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def _add(worker: ConformanceWorker, data: DataProto) -> DataProto:
    out = data.select(batch_keys=["x"], deepcopy=True)
    out.batch["x"] += worker.rank
    return out


class FailingInitWorker(Worker):
    def __init__(self, fail_rank: int) -> None:
        super().__init__()
        if self.rank == fail_rank:
            raise RuntimeError(f"constructor refused on rank {self.rank}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank


MESH = "suite_mesh"


class MeshWorker(Worker):
    """Ranks laid out as DP x TP with TP fastest: rank = dp * tp_size + tp."""

    def __init__(self, tp_size: int) -> None:
        super().__init__()
        self.tp_rank = self.rank % tp_size
        self.dp_rank = self.rank // tp_size
        self._register_dispatch_collect_info(MESH, dp_rank=self.dp_rank, is_collect=self.tp_rank == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(MESH))
    def shard(self, data: DataProto) -> DataProto:
        out = data.select(batch_keys=["x"], deepcopy=True)
        out.batch["dp"] = torch.full((len(out),), self.dp_rank)
        out.batch["tp"] = torch.full((len(out),), self.tp_rank)
        return out

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(MESH), output="ref")
    def shard_ref(self, data: DataProto) -> DataProto:
        return self.shard(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def mesh_stats(self, reset: bool = False) -> dict[str, int]:
        from podium.core.dataplane import held_shards, transfer_stats

        return {"dp": self.dp_rank, "tp": self.tp_rank, **transfer_stats(reset), **held_shards()}

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(MESH), blocking=False)
    def shard_async(self, data: DataProto) -> DataProto:
        out = data.select(batch_keys=["x"], deepcopy=True)
        out.batch["dp"] = torch.full((len(out),), self.dp_rank)
        return out


class ActorRole(Worker):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> tuple[str, int, int, float]:
        return "actor", self.rank, os.getpid(), self.lr

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def score(self, data: DataProto) -> DataProto:
        out = data.select(batch_keys=["x"], deepcopy=True)
        out.batch["x"] *= 2
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, output="ref")
    def score_ref(self, data: DataProto) -> DataProto:
        return self.score(data)


class CriticRole(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> tuple[str, int, int]:
        return "critic", self.rank, os.getpid()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def value(self, data: DataProto) -> DataProto:
        out = data.select(batch_keys=["x"], deepcopy=True)
        out.batch["x"] += 100
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def shares_memory(self, data: DataProto) -> dict[str, Any]:
        """Whether the rows handed to this role are the very tensors a shard of this process holds."""
        from podium.core.dataplane import held_data_ptrs

        same = data.batch["x"].data_ptr() in held_data_ptrs()
        return {"rank": self.rank, "same": same, "x": data.batch["x"].tolist()}


_FusedBase = create_colocated_worker_raw_cls(
    {"actor": ClassWithInitArgs(ActorRole, lr=0.25), "critic": ClassWithInitArgs(CriticRole)}
)


class FusedActorCritic(_FusedBase):  # type: ignore[misc,valid-type]  # a class made at import
    """A user subclass of a raw fused class (verl's fused worker): its own method reaches a role."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def actor_lr(self) -> tuple[int, float, int]:
        return self.rank, self.roles["actor"].lr, os.getpid()
