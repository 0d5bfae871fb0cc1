"""The data plane: a 256 MiB batch through a chain of groups, with and without ``BatchRef``.

Three groups A (2 ranks) -> B (3 ranks, so the batch splits unevenly and is
padded) -> C (2 ranks). A makes the batch in its workers from a few row ids
(the payload never starts at the controller), B makes a new tensor of the same
size from it, C reduces it to one number per row. Measured:

- **controller bytes**: bytes podium's serializer writes and reads in the
  controller for B's call with a ``BatchRef`` argument and ``output="ref"``,
  as a share of the payload (target <= 1%);
- **controller peak RSS growth** over the whole ``BatchRef`` chain (sampled
  every 2 ms; target < 32 MiB), and the same for the chain through the
  controller (``DataProto`` results), for contrast;
- **chain throughput**: payload bytes / chain time, ``BatchRef`` vs through the
  controller (median of ``rounds``);
- **bytes per consumer rank**: what each rank of B read from the producers,
  vs its share of the batch;
- **1-row latency**: the median of a call whose argument is a 1-row
  ``BatchRef`` minus that of the same call with a 1-row ``DataProto``
  (target < 100 us on torchrun).

``measure(backend, mib=..., rounds=..., calls=...)`` returns the numbers as a
dict, for a harness; ``python -m benchmarks`` reports the chain throughput both ways (its ``chain`` measure);
run as a module this prints all of them::

    .venv/bin/python -m benchmarks.dataplane [--backend torchrun] [--mib 256]

``--shard-network`` (torchrun) sends every ``BatchRef`` read through the
producers' shard servers (TCP and CURVE, as between hosts) instead of shared
memory, to measure the cross-host path on one machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks._common import timed
from podium import (
    BatchRef,
    ClassWithInitArgs,
    DataProto,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    load_backend,
    register,
)
from podium.core.backend import Backend

COLS = 16384  # float32: 64 KiB per row
__all__ = ["measure", "serialized_bytes"]


class ChainWorker(Worker):
    @staticmethod
    def _make(seed: DataProto) -> DataProto:
        ids = seed.batch["i"].to(torch.float32)
        return DataProto.from_dict({"y": ids[:, None].expand(-1, COLS).clone()}, auto_padding=True)

    @staticmethod
    def _transform(data: DataProto) -> DataProto:
        return DataProto.from_dict({"z": data.batch["y"] + 1}, auto_padding=True)

    @register(Dispatch.DP_COMPUTE_PROTO, output="ref")
    def produce_ref(self, seed: DataProto) -> DataProto:
        return self._make(seed)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def produce(self, seed: DataProto) -> DataProto:
        return self._make(seed)

    @register(Dispatch.DP_COMPUTE_PROTO, output="ref")
    def transform_ref(self, data: DataProto) -> DataProto:
        return self._transform(data)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def transform(self, data: DataProto) -> DataProto:
        return self._transform(data)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def reduce(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"s": data.batch["z"][:, 0].clone()})

    @register(Dispatch.ONE_TO_ALL)
    def rows(self, data: DataProto) -> int:
        return len(data)

    @register(Dispatch.ONE_TO_ALL)
    def stats(self, reset: bool = False) -> dict[str, int]:
        from podium.core.dataplane import transfer_stats

        return transfer_stats(reset)


@contextmanager
def serialized_bytes(*, writes_only: bool = False) -> Iterator[list[int]]:
    """Count the bytes podium's serializer writes (and, unless ``writes_only``, reads) in this
    process (the controller)."""
    from podium.core import serialization

    total = [0]
    swapped: list[tuple[Any, str, Any]] = []

    def nbytes(header: Any, buffers: Any) -> int:
        return len(memoryview(header)) + sum(memoryview(b).nbytes for b in buffers)

    def wrap(name: str, original: Any) -> Any:
        if name == "loads":

            def counting_loads(header: Any, buffers: Any = (), *a: Any, **k: Any) -> Any:
                total[0] += nbytes(header, buffers)
                return original(header, buffers, *a, **k)

            return counting_loads

        def counting_dumps(*a: Any, **k: Any) -> Any:
            header, buffers = original(*a, **k)
            total[0] += nbytes(header, buffers)
            return header, buffers

        return counting_dumps

    names = ("dumps", "dumps_in_process") if writes_only else ("dumps", "dumps_in_process", "loads")
    for name in names:
        original = getattr(serialization, name)
        counting = wrap(name, original)
        for mod in list(sys.modules.values()):
            if (
                getattr(mod, "__name__", "").startswith("podium")
                and getattr(mod, name, None) is original
            ):
                swapped.append((mod, name, original))
                setattr(mod, name, counting)
    try:
        yield total
    finally:
        for mod, name, original in swapped:
            setattr(mod, name, original)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@contextmanager
def _peak_rss() -> Iterator[list[int]]:
    """The growth of this process's RSS above its value at entry, at its peak (sampled every 2 ms)."""
    base = _rss()
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss() - base)
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], _rss() - base)


def measure(
    backend: str | Backend = "torchrun", *, mib: int = 256, rounds: int = 3, calls: int = 300
) -> dict[str, float]:
    """Run the data-plane measures on ``backend``; return them by name (see the module docstring)."""
    import gc

    n = mib * 16  # rows of 64 KiB
    payload = n * COLS * 4
    seed = DataProto.from_dict({"i": torch.arange(n)}, auto_padding=True)
    out: dict[str, float] = {"payload_mib": float(mib)}
    pool = lambda k: ResourcePool([k], use_gpu=False)  # noqa: E731
    cwa = ClassWithInitArgs(ChainWorker)
    with (
        WorkerGroup(pool(2), cwa, backend=backend) as a,
        WorkerGroup(pool(3), cwa, backend=backend) as b,
        WorkerGroup(pool(2), cwa, backend=backend) as c,
    ):

        def chain_ref() -> DataProto:
            ref_a = a.produce_ref(seed)
            ref_b = b.transform_ref(ref_a)
            result = c.reduce(ref_b)
            ref_a.release()
            ref_b.release()
            return result

        def chain_controller() -> DataProto:
            return c.reduce(b.transform(a.produce(seed)))

        want = chain_controller()
        got = chain_ref()
        if not torch.equal(got.batch["s"], want.batch["s"]):
            raise RuntimeError("the BatchRef chain and the chain through the controller disagree")
        del want, got
        gc.collect()

        # Bytes through the controller for one call with a BatchRef in and out, and per consumer rank.
        ref_a = a.produce_ref(seed)
        b.stats(reset=True)
        with serialized_bytes() as counted:
            ref_b = b.transform_ref(ref_a)
        per_rank = [s["fetched_bytes"] for s in b.stats()]
        out["controller_bytes_per_call"] = float(counted[0])
        out["controller_bytes_pct"] = 100.0 * counted[0] / payload
        out["consumer_rank_mib"] = max(per_rank) / 2**20
        out["consumer_share_mib"] = payload / 3 / 2**20
        ref_a.release()
        ref_b.release()

        # Controller memory over a whole chain, each way.
        gc.collect()
        with _peak_rss() as grew:
            chain_ref()
        out["controller_rss_growth_mib_batchref"] = grew[0] / 2**20
        gc.collect()
        with _peak_rss() as grew:
            chain_controller()
        out["controller_rss_growth_mib_through_controller"] = grew[0] / 2**20
        gc.collect()

        # Throughput of the chain, each way.
        t_ref = timed(chain_ref, rounds)
        t_ctl = timed(chain_controller, rounds)
        out["chain_gbps_batchref"] = payload / t_ref / 1e9
        out["chain_gbps_through_controller"] = payload / t_ctl / 1e9
        out["chain_speedup"] = t_ctl / t_ref

        # Added latency of a 1-row BatchRef argument over a 1-row DataProto.
        one = DataProto.from_dict({"i": torch.arange(1)})
        one_ref = a.produce_ref(DataProto.from_dict({"i": torch.arange(2)}))[:1]
        one_value = one_ref.materialize()
        assert isinstance(one_ref, BatchRef)
        # Interleaved, best median of 5 each: the two differ by tens of us, the noise is larger.
        t_proto = t_batchref = float("inf")
        for _ in range(5):
            t_proto = min(t_proto, timed(lambda: c.rows(one_value), calls, 20))
            t_batchref = min(t_batchref, timed(lambda: c.rows(one_ref), calls, 20))
        out["latency_us_dataproto"] = t_proto * 1e6
        out["latency_us_batchref"] = t_batchref * 1e6
        out["latency_us_added"] = (t_batchref - t_proto) * 1e6
        del one
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="torchrun")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument(
        "--shard-network",
        action="store_true",
        help="torchrun: read BatchRefs through the producers' shard servers, not shared memory",
    )
    args = parser.parse_args()
    backend: str | Backend = args.backend
    where = ""
    if args.shard_network:
        from podium.backends.torchrun.dataplane import NETWORK_ENV

        os.environ[NETWORK_ENV] = "1"  # the controller's materialize() too
        backend = load_backend(args.backend, shard_network=True)
        where = " (BatchRef reads through the shard servers)"
    results = measure(backend, mib=args.mib, rounds=args.rounds, calls=args.calls)
    width = max(map(len, results))
    print(f"data plane on {args.backend!r}{where}:")
    for key, value in results.items():
        print(f"  {key:<{width}}  {value:12.3f}")


if __name__ == "__main__":
    main()
