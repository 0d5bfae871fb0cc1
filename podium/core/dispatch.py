"""The built-in dispatch and collect functions.

A dispatch function turns the caller's arguments into per-rank arguments:
``dispatch_fn(worker_group, *args, **kwargs) -> (args, kwargs)``, where each
returned argument is a list of length ``world_size`` when it differs by rank
(the per-rank slicing rule). A collect function turns the list of per-rank
outputs into the call's result: ``collect_fn(worker_group, outputs)``.

Batch arguments (``DataProto``, ``TensorDict``, ``DataProtoFuture``, and any
type registered in :mod:`podium.core.batching`) are split into DP shards;
everything else goes whole to every rank. Dispatch never mutates the caller's
objects: padding builds a new object. A mode that pads returns
:class:`podium.core.modes.Dispatched` with the number of padded rows, which the
group removes from the collected result, blocking or not.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from podium.core import batching
from podium.core.futures import DataProtoFuture
from podium.core.modes import (
    Dispatch,
    Dispatched,
    DispatchGroup,
    DispatchMode,
    register_builtin_modes,
)
from podium.core.protocol_config import DataProtoConfig
from podium.errors import DispatchError

__all__ = [
    "Dispatched",
    "collect_all_to_all",
    "collect_dp_compute_data_proto",
    "collect_rank_zero",
    "dispatch_all_to_all",
    "dispatch_dp_compute",
    "dispatch_dp_compute_data_proto",
    "dispatch_dp_compute_data_proto_with_func",
    "dispatch_dp_compute_metric",
    "dispatch_one_to_all",
    "make_nd_compute_dataproto_dispatch_fn",
]


# -- padding a future's shards in the worker ----------------------------------
#
# A DataProtoFuture passed into a DP call on a backend with
# ``worker_to_worker_futures`` is not resolved at the controller, so its length
# (and the padding it needs) is unknown when dispatch splits it. Dispatch then
# sends each rank a lazy pick (:class:`PaddedChunkPick`); the rank resolves the
# future itself, pads exactly as the controller would have (same rows as
# ``pad_dataproto_to_divisor``, only with ``auto_padding``), and its host returns
# the pad count with the result (:class:`PaddedResult`). The collect of the call,
# blocking or not, removes that many rows (:func:`strip_pads`). The data still
# moves worker to worker; the controller never holds it.

_worker_pads: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "podium_worker_pads", default=None
)


@dataclass
class PaddedResult:
    """One rank's return value of a call whose data a :class:`PaddedChunkPick` padded by ``pad`` rows."""

    value: Any
    pad: int


def start_worker_pads() -> contextvars.Token[list[int] | None]:
    """Start recording the rows that picks pad during one call in a worker."""
    return _worker_pads.set([])


def finish_worker_pads(token: contextvars.Token[list[int] | None]) -> int:
    """Stop recording; the rows padded into every padded shard of the call (0: none)."""
    pads = _worker_pads.get() or []
    _worker_pads.reset(token)
    return pads[0] if pads else 0


def strip_pads(outputs: Sequence[Any]) -> tuple[list[Any], int]:
    """``(values, pad)``: the ranks' values without :class:`PaddedResult` wrappers, and the rows padded."""
    pad = max((o.pad for o in outputs if isinstance(o, PaddedResult)), default=0)
    return [o.value if isinstance(o, PaddedResult) else o for o in outputs], pad


class PaddedChunkPick:
    """Shard ``index`` of ``chunks`` of a resolved future, padded in the worker when allowed.

    ``before`` is the future's own pick (when it is itself a shard), applied
    first. A batch that does not divide is padded when it has ``auto_padding``
    and ``pad`` is true, and the pad count is recorded for the rank's result;
    with ``pad`` false (DP_COMPUTE_METRIC, which never pads) it is split into
    shards whose sizes differ by at most one. Without ``auto_padding`` it fails
    with the same :class:`DispatchError` the controller gives.
    """

    def __init__(
        self,
        index: int,
        chunks: int,
        before: Callable[[Any], Any] | None,
        mode: str,
        pad: bool,
        padding_enabled: bool = False,
    ) -> None:
        self.index = index
        self.chunks = chunks
        self.before = before
        self.mode = mode
        self.pad = pad
        # The controller's global switch (DataProtoConfig.auto_padding) when it split
        # the future: the worker's own process may not have it set.
        self.padding_enabled = padding_enabled

    def __call__(self, data: Any) -> Any:
        if self.before is not None:
            data = self.before(data)
        n = batching.length(data)
        pad = -n % self.chunks if n is not None else 0
        if pad:
            if not (self.padding_enabled or batching.auto_padding(data)):
                raise DispatchError(_not_divisible(self.mode, n or 0, self.chunks))
            if not self.pad:  # DP_COMPUTE_METRIC: shards whose sizes differ by at most one
                return batching.split(data, _uneven_sizes(self.mode, n or 0, self.chunks))[self.index]
            data = batching.pad(data, self.chunks)
            pads = _worker_pads.get()
            if pads is not None:
                if pads and pads[0] != pad:
                    raise DispatchError(
                        f"{self.mode}: the data arguments have different batch sizes (they need "
                        f"{pads[0]} and {pad} rows of padding); they must match"
                    )
                pads.append(pad)
        return batching.chunk(data, self.chunks)[self.index]


def _uneven_sizes(mode: str, size: int, n: int) -> list[int]:
    if size < n:
        raise DispatchError(
            f"{mode}: batch size {size} is smaller than the DP size {n}; every rank needs at least one row"
        )
    return [size // n + (1 if i < size % n else 0) for i in range(n)]


def _not_divisible(mode: str, n: int, shards: int) -> str:
    return (
        f"{mode}: batch size {n} does not divide by the DP size {shards}. Make the batch "
        f"a multiple of {shards}, or enable padding with DataProto.from_dict(..., "
        "auto_padding=True), data.auto_padding = True or, for every batch, "
        "DataProtoConfig.auto_padding = True: rows are padded for the call "
        "and removed from the result."
    )


# -- data helpers --------------------------------------------------------------
# The batch operations themselves live in podium.core.batching (public as
# podium.batching), where other batch types register.



def _data_args(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    return [a for a in list(args) + list(kwargs.values()) if batching.is_batch(a)]


def _shard(
    shards: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mode: str,
    pad_futures: bool = True,
) -> tuple[list[list[Any]], dict[str, list[Any]], int]:
    """Split every data argument into ``shards`` pieces, padding if allowed; also the rows padded.

    An unresolved :class:`DataProtoFuture` is split lazily into
    :class:`PaddedChunkPick` shards that pad in the worker (unless
    ``pad_futures`` is false); the collect removes what they padded.
    """
    data = _data_args(args, kwargs)
    if not data:
        raise DispatchError(
            f"{mode} needs at least one DataProto or TensorDict argument to split over {shards} "
            "ranks; use Dispatch.ONE_TO_ALL to send the same arguments to every rank"
        )
    lengths = {n for n in (batching.length(d) for d in data) if n is not None}
    if len(lengths) > 1:
        raise DispatchError(f"{mode}: data arguments have different batch sizes {sorted(lengths)}; they must match")
    pad = 0
    if lengths:
        (n,) = lengths
        if n % shards:
            if not any(batching.auto_padding(d) for d in data):
                raise DispatchError(_not_divisible(mode, n, shards))
            fixed = [type(d).__qualname__ for d in data if batching.length(d) is not None and not batching.can_pad(d)]
            if fixed:
                raise DispatchError(
                    f"{mode}: batch size {n} does not divide by the DP size {shards}, and "
                    f"{', '.join(sorted(set(fixed)))} cannot be padded (its batch type registered no "
                    "pad=/unpad=); make the batch a multiple of the DP size"
                )
            pad = -n % shards

    def split(x: Any) -> Any:
        if not batching.is_batch(x):
            return [x] * shards
        if isinstance(x, DataProtoFuture):
            # Its length is known only once resolved, in the worker: pad there.
            return [
                DataProtoFuture(
                    x.collect_fn,
                    x.futures,
                    PaddedChunkPick(
                        i, shards, x.dispatch_fn, mode, pad_futures, DataProtoConfig.auto_padding
                    ),
                )
                for i in range(shards)
            ]
        if pad:
            x = batching.pad(x, shards)
        return batching.chunk(x, shards)

    return [split(a) for a in args], {k: split(v) for k, v in kwargs.items()}, pad


# -- built-in modes -------------------------------------------------------------


def dispatch_one_to_all(wg: DispatchGroup, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    n = wg.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def dispatch_all_to_all(wg: DispatchGroup, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def collect_all_to_all(wg: DispatchGroup, outputs: list[Any]) -> list[Any]:
    return outputs


def collect_rank_zero(wg: DispatchGroup, outputs: list[Any]) -> Any:
    return outputs[0]


def dispatch_dp_compute(wg: DispatchGroup, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    n = wg.world_size
    for name, value in [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items()):
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"a {type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else repr(type(value).__name__)
            raise DispatchError(
                f"DP_COMPUTE: {name} must be a list with one element per rank (length {n}), got {got}"
            )
    return tuple(list(a) for a in args), {k: list(v) for k, v in kwargs.items()}


def dispatch_dp_compute_data_proto(
    wg: DispatchGroup, *args: Any, **kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    split_args, split_kwargs, pad = _shard(wg.world_size, args, kwargs, "DP_COMPUTE_PROTO")
    return Dispatched(tuple(split_args), split_kwargs, pad)


def dispatch_dp_compute_data_proto_with_func(
    wg: DispatchGroup, *args: Any, **kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not args or not callable(args[0]):
        raise DispatchError("DP_COMPUTE_PROTO_WITH_FUNC: the first argument must be the function to run")
    func, rest = args[0], args[1:]
    split_args, split_kwargs, pad = _shard(wg.world_size, rest, kwargs, "DP_COMPUTE_PROTO_WITH_FUNC")
    return Dispatched(([func] * wg.world_size, *split_args), split_kwargs, pad)


def dispatch_dp_compute_metric(
    wg: DispatchGroup, *args: Any, **kwargs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Like DP_COMPUTE_PROTO, but never pads: metrics must not count duplicated rows.

    A batch that does not divide (with ``auto_padding``) is split into shards
    whose sizes differ by at most one; every rank's result is kept.
    """
    n = wg.world_size
    data = _data_args(args, kwargs)
    lengths = {n for n in (batching.length(d) for d in data) if n is not None}
    if len(lengths) == 1:
        (size,) = lengths
        if size % n and any(batching.auto_padding(d) for d in data):
            sizes = _uneven_sizes("DP_COMPUTE_METRIC", size, n)
            split = lambda x: batching.split(x, sizes) if batching.is_batch(x) else [x] * n  # noqa: E731
            return tuple(split(a) for a in args), {k: split(v) for k, v in kwargs.items()}
    split_args, split_kwargs, pad = _shard(n, args, kwargs, "DP_COMPUTE_METRIC", pad_futures=False)
    return Dispatched(tuple(split_args), split_kwargs, pad)


def collect_dp_compute_data_proto(wg: DispatchGroup, outputs: list[Any]) -> Any:
    return batching.concat(outputs)


register_builtin_modes(
    {
        Dispatch.ONE_TO_ALL: DispatchMode("ONE_TO_ALL", dispatch_one_to_all, collect_all_to_all),
        Dispatch.ALL_TO_ALL: DispatchMode("ALL_TO_ALL", dispatch_all_to_all, collect_all_to_all),
        Dispatch.RANK_ZERO: DispatchMode("RANK_ZERO", dispatch_all_to_all, collect_rank_zero),
        Dispatch.DP_COMPUTE: DispatchMode("DP_COMPUTE", dispatch_dp_compute, collect_all_to_all),
        Dispatch.DP_COMPUTE_PROTO: DispatchMode(
            "DP_COMPUTE_PROTO", dispatch_dp_compute_data_proto, collect_dp_compute_data_proto, dp=True
        ),
        Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: DispatchMode(
            "DP_COMPUTE_PROTO_WITH_FUNC",
            dispatch_dp_compute_data_proto_with_func,
            collect_dp_compute_data_proto,
            dp=True,
        ),
        Dispatch.DP_COMPUTE_METRIC: DispatchMode("DP_COMPUTE_METRIC", dispatch_dp_compute_metric, collect_all_to_all),
    }
)


# -- nd-mesh ------------------------------------------------------------------


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> DispatchMode:
    """A dispatch mode for a DP x TP x PP mesh registered by the workers.

    Each worker calls ``self._register_dispatch_collect_info(mesh_name, dp_rank,
    is_collect)``. Data is split into one shard per DP rank; every rank of a
    replica receives the same shard object (backends send it once); the result
    is gathered from the ``is_collect`` ranks in DP order. Data may be passed
    positionally or by keyword.
    """
    if not isinstance(mesh_name, str) or not mesh_name:
        raise ValueError(f"mesh_name must be a non-empty string, got {mesh_name!r}")

    def dispatch_fn(wg: DispatchGroup, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        layout = wg.mesh_layout(mesh_name)
        shard_args, shard_kwargs, pad = _shard(layout.dp_size, args, kwargs, f"nd-mesh {mesh_name!r}")
        per_rank = layout.dp_ranks
        return Dispatched(
            tuple([shards[d] for d in per_rank] for shards in shard_args),
            {k: [shards[d] for d in per_rank] for k, shards in shard_kwargs.items()},
            pad,
        )

    def collect_fn(wg: DispatchGroup, outputs: list[Any]) -> Any:
        layout = wg.mesh_layout(mesh_name)
        return batching.concat([outputs[r] for r in layout.collect_ranks])

    return DispatchMode(f"nd_compute[{mesh_name}]", dispatch_fn, collect_fn, dp=True, mesh_name=mesh_name)


# -- collecting a non-blocking DP call ----------------------------------------


class PortableCollect:
    """Collect for a ``DataProtoFuture``: picks ranks, concatenates, removes padding.

    Holds no reference to the worker group, so a future can be resolved in a
    worker (backends with ``worker_to_worker_futures``).
    """

    def __init__(self, ranks: Sequence[int] | None, pad: int) -> None:
        self.ranks = list(ranks) if ranks is not None else None
        self.pad = pad

    def __call__(self, outputs: list[Any]) -> Any:
        outputs, worker_pad = strip_pads(outputs)
        picked = outputs if self.ranks is None else [outputs[r] for r in self.ranks]
        return batching.unpad(batching.concat(picked), self.pad or worker_pad)


class BoundCollect:
    """Collect for a ``DataProtoFuture`` of a mode with a custom collect function."""

    def __init__(self, collect_fn: Callable[[Any, list[Any]], Any], wg: DispatchGroup, pad: int) -> None:
        self.collect_fn = collect_fn
        self.wg = wg
        self.pad = pad

    def __call__(self, outputs: list[Any]) -> Any:
        outputs, worker_pad = strip_pads(outputs)
        return batching.unpad(self.collect_fn(self.wg, outputs), self.pad or worker_pad)
