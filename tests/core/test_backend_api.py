"""The public module for backend authors: its names resolve, and ranks are laid out one way."""

import podium.backend_api as api
from podium import ResourcePool, merge_resource_pool, split_resource_pool


def test_every_name_resolves() -> None:
    assert [name for name in api.__all__ if not hasattr(api, name)] == []


def test_rank_infos_follow_the_pool_entries_of_the_group() -> None:
    a, b = split_resource_pool(ResourcePool([2, 2], use_gpu=False), [3, 1])
    merged = merge_resource_pool(b, ResourcePool([1], use_gpu=False))
    infos = api.rank_infos(merged, master_addr="h", master_port=1)
    assert [(i.rank, i.node_rank, i.local_rank, i.local_world_size) for i in infos] == [
        (0, 0, 0, 1),
        (1, 1, 0, 1),
    ]
    assert [(i.node_rank, i.local_rank) for i in api.rank_infos(a)] == [(0, 0), (0, 1), (1, 0)]
    assert {(i.world_size, i.master_addr, i.master_port) for i in infos} == {(2, "h", 1)}
