"""Resource pools: logical specs of where a group's ranks run.

Glossary (used the same way across podium):

- **pool**: a list of nodes, each with a number of process slots
  (``process_on_nodes=[4, 4]`` is two nodes of four slots). Creating one starts
  nothing; a backend turns it into placement when a group starts on it.
- **slot**: one rank's place in a pool: ``(root pool, node index, local index)``.
  A pool split in two keeps the slots (and so the GPUs) of its parent; a merged
  pool is the concatenation of its parts' slots.
- **rank**: a worker's index in its group, ``0 .. world_size - 1``, ordered by
  node, then by slot within the node.
- **bundle**: on Ray, the placement-group entry backing one slot.
- **colocation**: several groups on one pool share its slots;
  ``max_colocate_count`` is how many may.

A pool is a pure spec: it holds no backend state. A backend that builds
something per pool (Ray's placement groups) keeps it itself, keyed by the pool
(weakly, so it goes with the pool), and every group on the pool shares it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ResourcePool",
    "Slot",
    "merge_resource_pool",
    "split_resource_pool",
]

_pool_ids = itertools.count()


@dataclass(frozen=True)
class Slot:
    """One rank's place: node ``node`` of the root pool ``root``, position ``local`` on it."""

    root: ResourcePool
    node: int
    local: int


class ResourcePool:
    """A logical pool of process slots over nodes.

    The positional order is verl's ``RayResourcePool``: ``(process_on_nodes,
    use_gpu, name_prefix, max_colocate_count, detached, accelerator_type)``.
    ``detached`` and ``accelerator_type`` are accepted at their defaults only:
    a pool outlives its controller through named workers
    (``WorkerGroup.attach``), and a backend chooses devices by its own options.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool = True,
        name_prefix: str | None = None,
        max_colocate_count: int = 1,
        detached: bool = False,
        accelerator_type: str | None = None,
        *,
        _slots: list[Slot] | None = None,
    ) -> None:
        if detached is not False:
            raise ValueError(
                "ResourcePool(detached=True) is not supported: start the group with a name_prefix on a "
                "backend with named workers (Ray) and reach it from another controller with "
                "WorkerGroup.attach(name_prefix, WorkerClass)"
            )
        if accelerator_type is not None:
            raise ValueError(
                f"ResourcePool(accelerator_type={accelerator_type!r}) is not supported: pools ask for "
                "GPUs with use_gpu=True; which accelerator a rank gets is the cluster's and backend's "
                "setting (CUDA_VISIBLE_DEVICES, the nodes you start)"
            )
        nodes = list(process_on_nodes)
        if not nodes or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in nodes):
            raise ValueError(
                f"process_on_nodes must be a non-empty list of positive ints, got {process_on_nodes!r}"
            )
        if not isinstance(use_gpu, bool):
            raise TypeError(
                f"use_gpu must be a bool, got {use_gpu!r}; ResourcePool's positional order is "
                "(process_on_nodes, use_gpu, name_prefix, max_colocate_count), as verl's "
                "RayResourcePool; pass max_colocate_count= by keyword"
            )
        if name_prefix is not None and not isinstance(name_prefix, str):
            raise TypeError(f"name_prefix must be a str or None, got {name_prefix!r}")
        if not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be an int >= 1, got {max_colocate_count!r}")
        self._store = nodes
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.uid = next(_pool_ids)
        self.name_prefix = name_prefix or f"pool{self.uid}"
        if _slots is None:
            _slots = [Slot(self, node, local) for node, n in enumerate(nodes) for local in range(n)]
        self._slots = _slots

    @property
    def store(self) -> list[int]:
        """Processes per node, as given."""
        return list(self._store)

    @property
    def process_on_nodes(self) -> list[int]:
        return list(self._store)

    @property
    def world_size(self) -> int:
        return sum(self._store)

    @property
    def slots(self) -> list[Slot]:
        """Each rank's slot, in rank order."""
        return list(self._slots)

    @property
    def is_root(self) -> bool:
        return all(s.root is self for s in self._slots)

    def local_world_size_list(self) -> list[int]:
        """For each rank, how many ranks share its node."""
        return [n for n in self._store for _ in range(n)]

    def local_rank_list(self) -> list[int]:
        """For each rank, its index on its node."""
        return [i for n in self._store for i in range(n)]

    def __repr__(self) -> str:
        return (
            f"ResourcePool({self._store}, use_gpu={self.use_gpu}, "
            f"max_colocate_count={self.max_colocate_count}, name_prefix={self.name_prefix!r})"
        )


def _pool_from_slots(slots: list[Slot], template: ResourcePool, name_prefix: str) -> ResourcePool:
    counts: list[int] = []
    last: tuple[int, int] | None = None
    for slot in slots:
        key = (slot.root.uid, slot.node)
        if key != last:
            counts.append(0)
            last = key
        counts[-1] += 1
    return ResourcePool(
        counts,
        use_gpu=template.use_gpu,
        max_colocate_count=template.max_colocate_count,
        name_prefix=name_prefix,
        _slots=slots,
    )


def split_resource_pool(pool: ResourcePool, split_size: int | Sequence[int]) -> list[ResourcePool]:
    """Split ``pool`` into consecutive pieces that keep the parent's slots.

    ``split_size`` is the size of every piece (it must divide the world size) or
    the list of piece sizes (it must add up to the world size).
    """
    world = pool.world_size
    if isinstance(split_size, int) and not isinstance(split_size, bool):
        if split_size <= 0 or world % split_size:
            raise ValueError(
                f"split_size {split_size} must be positive and divide the pool's world size {world}"
            )
        sizes = [split_size] * (world // split_size)
    else:
        sizes = [int(s) for s in split_size]  # type: ignore[union-attr]
        if any(not isinstance(s, int) or s <= 0 for s in sizes) or sum(sizes) != world:
            raise ValueError(
                f"split sizes {sizes} must be positive ints adding up to the pool's world size {world}"
            )
    pieces = []
    start = 0
    for i, size in enumerate(sizes):
        pieces.append(_pool_from_slots(pool.slots[start : start + size], pool, f"{pool.name_prefix}_split{i}"))
        start += size
    return pieces


def merge_resource_pool(a: ResourcePool, b: ResourcePool) -> ResourcePool:
    """One pool holding ``a``'s slots then ``b``'s."""
    if a.use_gpu != b.use_gpu:
        raise ValueError("cannot merge a GPU pool with a CPU-only pool")
    if a.max_colocate_count != b.max_colocate_count:
        raise ValueError(
            f"cannot merge pools with max_colocate_count {a.max_colocate_count} and {b.max_colocate_count}"
        )
    overlap = {(s.root.uid, s.node, s.local) for s in a.slots} & {(s.root.uid, s.node, s.local) for s in b.slots}
    if overlap:
        raise ValueError("cannot merge pools that share slots")
    return _pool_from_slots(a.slots + b.slots, a, f"{a.name_prefix}+{b.name_prefix}")
