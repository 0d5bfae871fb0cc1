"""The conformance suite against the torchrun backend (real torchx, torchrun and ZeroMQ)."""

import pytest

from podium.testing.conformance import ConformanceSuite

pytest.importorskip("torchx")
pytest.importorskip("zmq")

pytestmark = pytest.mark.timeout(240)


class TestTorchrunConformance(ConformanceSuite):
    backend_name = "torchrun"
