"""``ResourcePoolManager``: which pool each role runs on, checked against the cluster first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from podium.core.backend import Backend, resolve_backend
from podium.core.resource import ResourcePool

__all__ = ["ResourcePoolManager"]


class ResourcePoolManager:
    """Role -> pool, with a check that the cluster can hold every pool before anything starts.

    ``resource_pool_spec`` names pools (``{"global_pool": [8, 8]}``) and
    ``mapping`` assigns each role to one of them. Roles mapped to the same pool
    share it (colocation). Without a ``mapping`` (or for a role it does not
    name), a role gets the pool of its own name, or the only pool when the spec
    defines one.
    """

    def __init__(
        self,
        resource_pool_spec: Mapping[str, Sequence[int]],
        mapping: Mapping[Any, str] | None = None,
        *,
        use_gpu: bool = True,
        max_colocate_count: int = 1,
    ) -> None:
        mapping = dict(mapping or {})
        unknown = {pool for pool in mapping.values() if pool not in resource_pool_spec}
        if unknown:
            raise ValueError(
                f"mapping names pools {sorted(unknown)} that resource_pool_spec does not define "
                f"(defined: {sorted(resource_pool_spec)})"
            )
        self.resource_pool_spec = {k: list(v) for k, v in resource_pool_spec.items()}
        self.mapping = dict(mapping)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.resource_pool_dict: dict[str, ResourcePool] = {}

    def create_resource_pool(
        self, backend: Backend | str | None = None, **backend_options: Any
    ) -> None:
        """Build the pools, after checking through ``backend`` that the cluster can hold them all.

        Raises :class:`podium.errors.ResourceUnavailableError` (demand vs supply) when it cannot.
        """
        pools = {
            name: ResourcePool(
                nodes,
                use_gpu=self.use_gpu,
                max_colocate_count=self.max_colocate_count,
                name_prefix=name,
            )
            for name, nodes in self.resource_pool_spec.items()
        }
        resolve_backend(backend, backend_options).check_resources(list(pools.values()))
        self.resource_pool_dict = pools

    def get_resource_pool(self, role: Any) -> ResourcePool:
        if not self.resource_pool_dict:
            raise RuntimeError("call create_resource_pool() before get_resource_pool()")
        pools = self.resource_pool_dict
        if role in self.mapping:
            return pools[self.mapping[role]]
        name = getattr(role, "name", role)  # verl's Role enum members map by their name
        if isinstance(name, str) and name in pools:
            return pools[name]
        if len(pools) == 1:
            return next(iter(pools.values()))
        raise KeyError(
            f"role {role!r} is not in the mapping (roles: {list(self.mapping)}) and names none of the "
            f"pools {sorted(pools)}; add it to ResourcePoolManager(spec, mapping={{role: pool_name}})"
        )

    def get_n_gpus(self) -> int:
        return sum(sum(nodes) for nodes in self.resource_pool_spec.values())
