"""The conformance suite on the inline backend (the core's reference backend)."""

from podium.testing.conformance import ConformanceSuite


class TestInlineConformance(ConformanceSuite):
    backend_name = "inline"
