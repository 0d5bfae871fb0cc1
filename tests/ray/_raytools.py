"""Helpers for the Ray backend tests: each module owns one Ray instance (CI has 2 cores)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from podium.core.backend import shutdown_backends


def restart_ray(**init_kwargs: Any) -> None:
    """Drop every backend and Ray instance of earlier modules; start Ray with ``init_kwargs`` if given."""
    shutdown_backends()
    if ray.is_initialized():
        ray.shutdown()
    if init_kwargs:
        ray.init(include_dashboard=False, **init_kwargs)


def stop_ray() -> None:
    shutdown_backends()
    if ray.is_initialized():
        ray.shutdown()


def live_actor_names(prefix: str, namespace: str = "podium") -> list[str]:
    return sorted(
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["namespace"] == namespace and e["name"].startswith(prefix)
    )


def live_placement_groups() -> list[str]:
    return sorted(
        info["name"]
        for info in ray.util.placement_group_table().values()
        if info["state"] != "REMOVED"
    )


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return check()
