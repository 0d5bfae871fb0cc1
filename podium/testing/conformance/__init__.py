"""The conformance suite every podium backend runs against itself.

Subclass :class:`ConformanceSuite` in a test module and set ``backend_name``
(and ``backend_options``), or run ``podium conformance NAME``.
"""

from podium.testing.conformance.base import BackendFixtures
from podium.testing.conformance.contract_tests import ContractTests
from podium.testing.conformance.dataplane_tests import DataPlaneTests
from podium.testing.conformance.dispatch_tests import DispatchTests
from podium.testing.conformance.errors_tests import ErrorTests
from podium.testing.conformance.execution_tests import ExecutionTests
from podium.testing.conformance.lifecycle_tests import LifecycleTests

__all__ = [
    "BackendFixtures",
    "ConformanceSuite",
    "ContractTests",
    "DataPlaneTests",
    "DispatchTests",
    "ErrorTests",
    "ExecutionTests",
    "LifecycleTests",
]


class ConformanceSuite(
    DispatchTests, ExecutionTests, ErrorTests, LifecycleTests, ContractTests, DataPlaneTests
):
    """Every conformance test, sharing one set of started groups per class."""
