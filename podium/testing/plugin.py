"""pytest plugin (entry point ``pytest11``): ``--podium-backend`` and a skip-reason summary."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("podium")
    group.addoption(
        "--podium-backend",
        default=None,
        help="backend the podium conformance suite runs against (default: inline)",
    )
    group.addoption(
        "--podium-backend-options",
        default=None,
        help="JSON object of backend_options for --podium-backend",
    )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    name = config.getoption("--podium-backend", default=None)
    if not name:
        return
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            reasons[longrepr[2]] = reasons.get(longrepr[2], 0) + 1
    if reasons:
        terminalreporter.section(f"podium conformance: skipped on {name!r}")
        for reason, count in sorted(reasons.items()):
            terminalreporter.write_line(f"{count:3d} x {reason}")
