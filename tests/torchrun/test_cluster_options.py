"""Options for clusters that cannot be started here (Kubernetes): what reaches the torchx app."""

from __future__ import annotations

import pytest

from podium import ClassWithInitArgs, ResourcePool, Worker, load_backend
from podium.core.backend import GroupSpec


def _spec(pool: list[int] | None = None, name_prefix: str = "c") -> GroupSpec:
    return GroupSpec(
        pool=ResourcePool(pool or [2], use_gpu=False),
        cls_with_init=ClassWithInitArgs(Worker),
        name_prefix=name_prefix,
    )


def test_image_and_mounts_reach_every_node_of_the_app() -> None:
    from torchx.specs import VolumeMount

    backend = load_backend(
        "torchrun",
        scheduler="kubernetes",
        image="ghcr.io/me/trainer:1",
        python="python3",
        mounts=["type=volume,src=podium-shared,dst=/shared"],
        key_dir="/shared",
        tune_malloc=False,
    )
    role = backend.app_for(_spec(), {"PODIUM_TR_ADDR": "tcp://10.0.0.1:5555"}).roles[0]
    assert role.image == "ghcr.io/me/trainer:1"
    assert role.mounts == [VolumeMount(src="podium-shared", dst_path="/shared", read_only=False)]
    assert role.args[1].startswith("python3 ")
    default = load_backend("torchrun", tune_malloc=False).app_for(_spec(), {}).roles[0]
    assert default.image == "." and default.mounts == []


def test_a_mount_torchx_cannot_parse_says_how_to_write_one() -> None:
    backend = load_backend("torchrun", mounts=["src=/a,dst=/b"], tune_malloc=False)
    with pytest.raises(ValueError, match=r"mounts.*type=volume,src="):
        backend.app_for(_spec(), {})


@pytest.mark.parametrize(
    ("scheduler", "pool"),
    [("local_cwd", [2]), ("local_cwd", [1, 1]), ("slurm", [2]), ("kubernetes", [2])],
)
def test_the_app_is_named_after_the_group(scheduler: str, pool: list[int]) -> None:
    """The app's name starts its id: the Kubernetes job's name, the local scheduler's log directory."""
    backend = load_backend("torchrun", scheduler=scheduler, tune_malloc=False)
    assert backend.app_for(_spec(pool, "actor_rollout"), {}).name == "podium-actor_rollout"
