#!/usr/bin/env bash
# GPU check of the FSDP2 engine: NCCL + bf16 through both backends and plain torchrun.
#
# Runs the GRPO trainer (examples/rl) for a few steps on every visible GPU (one rank
# per GPU, at most 8) with --device cuda -- NCCL process group, bf16 mixed precision --
# on the ray and torchrun backends and as the plain torchrun script, then prints each
# run's per-step losses and tokens/s and whether the losses agree. Unattended; every run
# has a time limit, the whole script stays under 5 minutes.
#
#     bash scripts/gpu_check.sh            # PYTHON=... to use another interpreter
#     GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh   # the same plumbing on 2 CPU ranks (gloo, fp32)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

DEVICE=${GPU_CHECK_DEVICE:-cuda}
if [ "$DEVICE" = cpu ]; then
    NGPU=0; WS=2
else
    NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    if [ "$NGPU" -lt 1 ]; then
        echo "gpu_check: torch sees no CUDA device; nothing to check" >&2
        exit 1
    fi
    WS=$(( NGPU > 8 ? 8 : NGPU ))
fi
OUT=$(mktemp -d /tmp/podium_gpu_check.XXXXXX)
LIMIT=${GPU_CHECK_TIMEOUT:-90}  # seconds per run: 3 runs stay under 5 minutes
THREADS=$([ "$DEVICE" = cpu ] && echo 1 || echo 4)
FLAGS=(--world-size "$WS" --steps 10 --seed 0 --device "$DEVICE" --threads "$THREADS" --prompts 64 --group 8 --no-plot)
echo "gpu_check: device $DEVICE, $NGPU GPU(s), world size $WS, output in $OUT"
if [ "$DEVICE" = cuda ]; then
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
fi

status=0
for backend in ray torchrun; do
    echo "== podium backend $backend"
    timeout "$LIMIT" "$PY" examples/rl/grpo.py --backend "$backend" "${FLAGS[@]}" --out "$OUT/$backend" \
        > "$OUT/$backend.log" 2>&1 || { echo "FAILED ($?); last lines:"; tail -30 "$OUT/$backend.log"; status=1; }
done
echo "== plain torchrun"
timeout "$LIMIT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$WS" examples/rl/grpo_plain.py \
    "${FLAGS[@]}" --out "$OUT/plain" > "$OUT/plain.log" 2>&1 \
    || { echo "FAILED ($?); last lines:"; tail -30 "$OUT/plain.log"; status=1; }

"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
runs = {}
for name in ("ray", "torchrun", "plain"):
    f = out / name / "metrics.jsonl"
    if f.exists():
        runs[name] = [json.loads(l) for l in f.read_text().splitlines() if l]
for name, recs in runs.items():
    tps = statistics.median(r["tokens_per_s"] for r in recs[2:]) if len(recs) > 2 else float("nan")
    print(f"{name:>9}: {len(recs)} steps, median {tps:,.0f} tokens/s, final reward {recs[-1]['reward_mean']:.3f}")
    print(f"{'':>9}  losses {[round(r['loss'], 6) for r in recs]}")
if len(runs) > 1:
    losses = {name: [r["loss"] for r in recs] for name, recs in runs.items()}
    first = next(iter(losses.values()))
    same = all(v == first for v in losses.values())
    close = all(abs(a - b) <= 1e-3 * max(abs(a), 1e-3) for v in losses.values() for a, b in zip(v, first))
    print(f"losses bit-identical across launchers: {same}; within 1e-3 relative: {close}")
PYEOF
exit $status
