"""Entry module for ``pytest --podium-backend NAME --pyargs podium.testing.conformance``."""

from podium.testing.conformance import ConformanceSuite


class TestConformance(ConformanceSuite):
    """Runs against the backend named by ``--podium-backend`` (default: inline)."""
