#!/usr/bin/env bash
# The torch.compile baseline of `flintc bench`, in its own H200 call (< 10 min, ends by ~565 s):
# the reference model's decode step compiled with torch.compile(mode="max-autotune")
# (CUDA graphs, KV cache as static inputs) on the same dummy weights as flintc's run,
# BF16, at the points of issue 8's speed-up targets. Outputs in $OUT/bench-compile.
#
# A max-autotune build of the full model took 211 s at batch 1 and 289 s at batch 8,
# so the three default points rarely fit one call: run it twice and merge,
#
#   BASELINE_POINTS=1x1024,1x100000 OUT=... bash scripts/gpu_bench_compile_baseline.sh
#   BASELINE_POINTS=8x1024          OUT=... bash scripts/gpu_bench_compile_baseline.sh
#   flintc bench --from-json run1/bench.json --from-json c1/bench.json --from-json c2/bench.json --out merged
#
# A point is skipped (with a note) when less time is left than its expected compile
# time. Inductor's cache lives in TORCHINDUCTOR_CACHE_DIR (default
# /tmp/flintc-inductor-cache), so a second call on the same warm machine reuses the
# autotuning results. A compile failure is recorded in bench.json, not fatal.
#
# BENCH_BASELINE=fast runs the stronger "fast" baseline instead (torch.compile of
# flintc.bench.fast_model.FastFlintModel: bf16 GEMMs, NVFP4 dequantized to bf16 per call),
# outputs in $OUT/bench-fast; BENCH_BASELINE=compile,fast runs both, into $OUT/bench-compile.
set -uo pipefail

START=$(date +%s)
BUDGET=${BENCH_BUDGET_S:-540}
POINTS=${BASELINE_POINTS:-1x1024,1x100000,8x1024}
FORMATS=${BENCH_FORMATS:-bf16}
BASELINE=${BENCH_BASELINE:-compile}
SUB=bench-compile
[ "$BASELINE" = fast ] && SUB=bench-fast
OUT=${OUT:-$PWD/bench_out}

mkdir -p "$OUT/$SUB" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1

LOG=$OUT/$SUB/pip.log
. scripts/gpu_env.sh   # PY, the carried wheels in /tmp/site, PYTHONPATH, MPLCONFIGDIR
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/flintc-inductor-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'

# Contexts and batches only bound the points; --baseline-points picks them.
CTXS=$(echo "$POINTS" | tr ',' '\n' | cut -dx -f2 | sort -un | paste -sd,)
BS=$(echo "$POINTS" | tr ',' '\n' | cut -dx -f1 | sort -un | paste -sd,)
LEFT=$(( BUDGET - ($(date +%s) - START) ))
echo "$BASELINE baseline at $POINTS: time budget $(( LEFT - 10 )) s"
timeout --signal=INT --kill-after=15 $(( LEFT + 10 )) \
  $PY -m flintc bench --load-format dummy --config full --formats "$FORMATS" --no-flintc \
    --baselines "$BASELINE" --baseline-points "$POINTS" --contexts "$CTXS" --batches "$BS" --prefill none \
    --time-budget $(( LEFT - 10 )) --out "$OUT/$SUB" 2>&1 | tee "$OUT/$SUB/bench.log"
RC=${PIPESTATUS[0]}
echo "exit status $RC after $(( $(date +%s) - START )) s"
exit "$RC"
