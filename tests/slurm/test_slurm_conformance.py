"""The conformance suite's core cases with the torchrun backend on a real Slurm cluster.

One worker group (the suite's ``wg``), so one Slurm job, serves every case kept
here: dispatch modes, futures, environment and gloo process group, deadlines
and user errors. Cases that would submit jobs of their own (other pools,
colocation, meshes, lifecycle) run on the local scheduler in
``tests/torchrun``; the Slurm-specific failures are in ``test_slurm_failures``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from podium.testing.conformance import DispatchTests, ErrorTests, ExecutionTests

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("slurm")]

_OTHER_GROUPS = {"mesh_wg", "pair_wg", "colocated"}
_STARTS_GROUPS = {
    "test_split_pools_each_start_at_rank_zero",
    "test_two_groups_share_one_pool",
    "test_worker_env_reaches_the_workers",
    "test_failing_constructor_raises_at_the_controller",
    "test_dead_worker_is_an_error_within_seconds",
}


class TestSlurmConformance(DispatchTests, ExecutionTests, ErrorTests):
    backend_name = "torchrun"
    backend_options: ClassVar[dict[str, Any]] = {
        "scheduler": "slurm",
        "scheduler_cfg": {"partition": "debug"},
    }

    @staticmethod
    def not_on_slurm(name: str, fixtures: set[str]) -> str | None:
        if fixtures & _OTHER_GROUPS or name in _STARTS_GROUPS:
            return "starts Slurm jobs of its own: run on local_cwd (tests/torchrun)"
        return None
