#!/usr/bin/env bash
# Create .venv with podium and everything its backends and tests need.
# torch is installed first, pinned, so pip takes the CPU build on this machine
# instead of downloading a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[all,test,examples,hf]"
