#!/usr/bin/env bash
# Create benchmarks/.verl-venv: verl 0.9.1 with just what its single_controller needs, for
# `python -m benchmarks` to compare against (verl is not a podium dependency). torch goes in
# first, pinned, so pip takes the same CPU build as podium's .venv; verl goes in with
# --no-deps because its full requirements pull in vLLM, flash-attn and friends.
#
#     bash benchmarks/make-verl-venv.sh [DIR]     # default: benchmarks/.verl-venv
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-benchmarks/.verl-venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$DIR/bin/python" ]; then
  "$PYTHON" -m venv "$DIR"
fi
"$DIR/bin/python" -m pip install -q --upgrade pip
"$DIR/bin/python" -m pip install -q torch==2.13.0
"$DIR/bin/python" -m pip install -q --no-deps verl==0.9.1
"$DIR/bin/python" -m pip install -q "ray[default]>=2.40" "tensordict<=0.10.0" omegaconf \
  "transformers<5.11" codetiming packaging pyyaml
"$DIR/bin/python" -c "from verl.single_controller.ray import RayWorkerGroup; print('verl ready:', '$DIR/bin/python')"
