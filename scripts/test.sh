#!/usr/bin/env bash
# The project's test command: lint, type-check, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check podium tests examples benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest tests -q -ra "$@"
