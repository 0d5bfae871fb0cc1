"""Resource pools are logical specs: split and merge keep slots; the manager checks first."""

from __future__ import annotations

import pytest
import torch

from podium import ResourcePool, ResourcePoolManager, merge_resource_pool, split_resource_pool
from podium.errors import ResourceUnavailableError


def test_pool_shape() -> None:
    pool = ResourcePool([2, 3], use_gpu=False)
    assert pool.world_size == 5 and pool.store == [2, 3]
    assert pool.local_world_size_list() == [2, 2, 3, 3, 3]
    assert pool.local_rank_list() == [0, 1, 0, 1, 2]


@pytest.mark.parametrize("nodes", [[], [0], [2, -1], "4", [1.5]])
def test_bad_pool_specs(nodes: object) -> None:
    with pytest.raises(ValueError, match="process_on_nodes"):
        ResourcePool(nodes)  # type: ignore[arg-type]


def test_split_keeps_the_parents_slots() -> None:
    pool = ResourcePool([4, 4])
    a, b = split_resource_pool(pool, [6, 2])
    assert a.store == [4, 2] and b.store == [2]
    assert [(s.root, s.node, s.local) for s in b.slots] == [(pool, 1, 2), (pool, 1, 3)]
    quarters = split_resource_pool(pool, 2)
    assert [q.store for q in quarters] == [[2]] * 4
    with pytest.raises(ValueError, match="divide"):
        split_resource_pool(pool, 3)
    with pytest.raises(ValueError, match="adding up"):
        split_resource_pool(pool, [4, 3])


def test_merge_concatenates_slots_and_refuses_overlap() -> None:
    pool = ResourcePool([4])
    a, b = split_resource_pool(pool, 2)
    merged = merge_resource_pool(b, a)
    assert merged.world_size == 4 and [s.local for s in merged.slots] == [2, 3, 0, 1]
    with pytest.raises(ValueError, match="share slots"):
        merge_resource_pool(a, a)
    with pytest.raises(ValueError, match="CPU-only"):
        merge_resource_pool(ResourcePool([1]), ResourcePool([1], use_gpu=False))


def test_manager_maps_roles_and_checks_through_the_backend() -> None:
    mgr = ResourcePoolManager(
        {"global": [2], "reward": [1]}, {"actor": "global", "critic": "global", "rm": "reward"}, use_gpu=False
    )
    with pytest.raises(RuntimeError, match="create_resource_pool"):
        mgr.get_resource_pool("actor")
    mgr.create_resource_pool(backend="inline")
    assert mgr.get_resource_pool("actor") is mgr.get_resource_pool("critic")
    assert mgr.get_resource_pool("rm").world_size == 1
    assert mgr.get_n_gpus() == 3
    with pytest.raises(KeyError, match="roles"):
        mgr.get_resource_pool("ref")
    with pytest.raises(ValueError, match="does not define"):
        ResourcePoolManager({"a": [1]}, {"actor": "b"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_manager_refuses_gpu_pools_a_backend_without_gpus_cannot_hold() -> None:
    mgr = ResourcePoolManager({"global": [2]}, {"actor": "global"})  # use_gpu=True, as in verl
    with pytest.raises(ResourceUnavailableError, match="use_gpu=False"):
        mgr.create_resource_pool(backend="inline")


def test_pool_positional_arguments_follow_verl() -> None:
    pool = ResourcePool([2, 1], False, "rollout", 3)
    assert (pool.use_gpu, pool.name_prefix, pool.max_colocate_count) == (False, "rollout", 3)
    with pytest.raises(TypeError, match="max_colocate_count= by keyword"):
        ResourcePool([2], 3)  # type: ignore[arg-type]


def test_manager_without_a_mapping_gives_roles_their_pool() -> None:
    single = ResourcePoolManager({"global_pool": [2]}, use_gpu=False)
    single.create_resource_pool(backend="inline")
    assert single.get_resource_pool("actor") is single.get_resource_pool("critic")
    named = ResourcePoolManager({"actor": [1], "critic": [1]}, use_gpu=False)
    named.create_resource_pool(backend="inline")
    assert named.get_resource_pool("critic").name_prefix == "critic"
    with pytest.raises(KeyError, match="mapping="):
        named.get_resource_pool("reward")
