"""The "can this cluster ever hold these pools" check, without a cluster (pure functions)."""

from __future__ import annotations

import pytest

from podium import ResourcePool, split_resource_pool
from podium.backends.ray.placement import NodeSupply, PGDemand, check_feasible, demands_of
from podium.errors import ResourceUnavailableError


def nodes(*specs: dict[str, float]) -> list[NodeSupply]:
    return [NodeSupply(f"n{i}", f"10.0.0.{i}", dict(s)) for i, s in enumerate(specs)]


def demand(
    pools: list[ResourcePool], strategy: str = "STRICT_PACK", cpus: float = 1.0
) -> list[PGDemand]:
    return demands_of(pools, cpus, strategy)


def test_gpu_pool_on_gpu_nodes_fits() -> None:
    check_feasible(
        demand([ResourcePool([4, 4])]), nodes({"CPU": 8, "GPU": 4}, {"CPU": 8, "GPU": 4})
    )


def test_gpu_pool_without_gpus_names_demand_supply_and_fix() -> None:
    with pytest.raises(ResourceUnavailableError) as info:
        check_feasible(demand([ResourcePool([2])]), nodes({"CPU": 8}))
    err = info.value
    assert err.demand["total"] == {"CPU": 2.0, "GPU": 2.0}
    assert err.supply["total"] == {"CPU": 8.0}
    assert "use_gpu=False" in str(err)


def test_node_entries_that_fit_alone_but_not_together_are_refused() -> None:
    # 3 + 3 + 2 GPUs fit 8 in total and each fits a node, but not all at once on 4 + 4.
    pools = [ResourcePool([3, 3, 2])]
    with pytest.raises(ResourceUnavailableError, match="cannot all be packed"):
        check_feasible(demand(pools), nodes({"CPU": 16, "GPU": 4}, {"CPU": 16, "GPU": 4}))
    check_feasible(
        demand(pools, strategy="PACK"), nodes({"CPU": 16, "GPU": 4}, {"CPU": 16, "GPU": 4})
    )


def test_split_and_colocated_pools_count_their_root_once() -> None:
    root = ResourcePool([4], use_gpu=False)
    a, b = split_resource_pool(root, 2)
    assert len(demand([root, a, b])) == 1
    check_feasible(demand([root, a, b]), nodes({"CPU": 4}))


def test_strict_spread_needs_enough_nodes() -> None:
    with pytest.raises(ResourceUnavailableError, match="STRICT_SPREAD"):
        check_feasible(
            demand([ResourcePool([3], use_gpu=False)], "STRICT_SPREAD"),
            nodes({"CPU": 8}, {"CPU": 8}),
        )


def test_cpus_per_worker_scales_the_bundles() -> None:
    with pytest.raises(ResourceUnavailableError, match="cpus_per_worker"):
        check_feasible(demand([ResourcePool([2])], cpus=10), nodes({"CPU": 16, "GPU": 8}))
