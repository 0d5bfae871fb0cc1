"""Fixtures shared by the conformance test classes.

A backend runs the suite against itself by subclassing
:class:`podium.testing.conformance.ConformanceSuite` in a test module::

    class TestMyBackend(ConformanceSuite):
        backend_name = "mybackend"
        backend_options = {"address": "..."}

or, without writing a module, with ``pytest --podium-backend NAME --pyargs
podium.testing.conformance`` / ``podium conformance NAME``. Groups are started
once per class and shared by its tests. Capabilities the backend does not
declare skip the tests that need them, with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from podium import (
    ClassWithInitArgs,
    ResourcePool,
    WorkerGroup,
    create_colocated_worker_cls,
    load_backend,
)
from podium.core.backend import Backend, backend_class
from podium.testing.conformance.workers import ActorRole, ConformanceWorker, CriticRole, MeshWorker

WORLD = 4


def skip_unless(backend: Backend, capability: str) -> None:
    if not getattr(backend.capabilities, capability):
        pytest.skip(f"backend {backend.name!r} does not declare capability {capability!r}")


class BackendFixtures:
    backend_name: ClassVar[str | None] = None
    backend_options: ClassVar[dict[str, Any] | None] = None
    group_timeout: ClassVar[float] = 120.0

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, request: pytest.FixtureRequest) -> Backend:
        name = cls.backend_name or request.config.getoption("--podium-backend", default=None) or "inline"
        options = cls.backend_options
        if options is None:
            raw = request.config.getoption("--podium-backend-options", default=None)
            options = json.loads(raw) if raw else {}
        backend_class(name)  # raises UnknownBackendError with the details if missing
        return load_backend(name, **options)

    @classmethod
    def _group(cls, backend: Backend, pool: ResourcePool, cwa: ClassWithInitArgs[Any], **kw: Any) -> WorkerGroup:
        return WorkerGroup(pool, cwa, backend=backend, **kw)

    @pytest.fixture(scope="class")
    @classmethod
    def pool(cls) -> ResourcePool:
        return ResourcePool([WORLD], use_gpu=False, max_colocate_count=2)

    @pytest.fixture(scope="class")
    @classmethod
    def wg(cls, backend: Backend, pool: ResourcePool) -> Iterator[WorkerGroup]:
        group = cls._group(backend, pool, ClassWithInitArgs(ConformanceWorker, offset=5))
        yield group
        group.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def pair_wg(cls, backend: Backend) -> Iterator[WorkerGroup]:
        """A second, smaller group (world 2): its results feed calls of ``wg`` (world 4)."""
        group = cls._group(
            backend, ResourcePool([2], use_gpu=False), ClassWithInitArgs(ConformanceWorker)
        )
        yield group
        group.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def mesh_wg(cls, backend: Backend) -> Iterator[WorkerGroup]:
        group = cls._group(backend, ResourcePool([WORLD], use_gpu=False), ClassWithInitArgs(MeshWorker, tp_size=2))
        yield group
        group.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def colocated(cls, backend: Backend) -> Iterator[dict[str, WorkerGroup]]:
        cwa = create_colocated_worker_cls(
            {"actor": ClassWithInitArgs(ActorRole, lr=0.5), "critic": ClassWithInitArgs(CriticRole)}
        )
        group = cls._group(backend, ResourcePool([2], use_gpu=False), cwa)
        yield group.spawn(prefix_set={"actor", "critic"})
        group.shutdown()
