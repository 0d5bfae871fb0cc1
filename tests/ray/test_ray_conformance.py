"""The conformance suite against the Ray backend (a local Ray that podium starts itself)."""

from collections.abc import Iterator

import pytest
from _raytools import restart_ray, stop_ray

from podium.testing.conformance import ConformanceSuite

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def no_other_ray() -> Iterator[None]:
    restart_ray()  # the backend starts its own local Ray, as it does for users
    yield
    stop_ray()


class TestRayConformance(ConformanceSuite):
    backend_name = "ray"
