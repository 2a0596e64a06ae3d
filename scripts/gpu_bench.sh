#!/usr/bin/env bash
# ONE call on the H200 (at most 9.5 minutes): `flintc bench` for both weight formats,
# with the eager baseline, from builds cross-compiled beforehand on the CPU machine
# (gpu_builds/, see docs/benchmarks.md "How to run"). Outputs in $OUT/bench: bench.json,
# bench.md, the PNG plots, bench.log.
#
# Time: the wheels install first (as scripts/gpu_run.sh does); then flintc bench gets
# what is left of BENCH_BUDGET_S (default 560 s from the start of this script) as its
# --time-budget: later points are skipped with a note once it is spent, every single
# measurement has a --step-timeout (BENCH_STEP_TIMEOUT_S, default 150 s: the first point
# of each build includes Triton's compile and the CUDA-graph capture), and bench.json is
# rewritten after each format. A hard `timeout` sends SIGINT 20 s after the budget, on
# which flintc bench still writes its report; if even that fails, re-render locally from
# bench.json with `flintc bench --from-json bench.json --out DIR`.
#
#   OUT=/some/dir bash scripts/gpu_bench.sh                     # from the repository root
#   BENCH_FORMATS=nvfp4 BENCH_CONTEXTS=1024,100000 OUT=... bash scripts/gpu_bench.sh
set -uo pipefail

START=$(date +%s)
BUDGET=${BENCH_BUDGET_S:-560}
STEP_TIMEOUT=${BENCH_STEP_TIMEOUT_S:-150}
FORMATS=${BENCH_FORMATS:-nvfp4,bf16}
CONTEXTS=${BENCH_CONTEXTS:-1024,8192,32768,100000,262144}
BATCHES=${BENCH_BATCHES:-1,2,4,8}
PREFILL=${BENCH_PREFILL:-1024,8192}
BUILDS=${BENCH_BUILDS:-gpu_builds}
OUT=${OUT:-$PWD/bench_out}
PY=${PYTHON:-python3}

cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT/bench" || exit 1
OUT=$(cd "$OUT" && pwd)

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >"$OUT/bench/pip.log" 2>&1 || echo "pip install of .whl/*.whl failed (see pip.log); going on"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
$PY -c 'import matplotlib' 2>/dev/null || echo "matplotlib not installed: no plots (carry its wheels in .whl/)"
if ! ls "$BUILDS"/*/build.json >/dev/null 2>&1; then
  echo "no builds in $BUILDS: cross-compile them on the CPU machine first (docs/benchmarks.md)"; exit 2
fi
ls -d "$BUILDS"/*/

LEFT=$(( BUDGET - ($(date +%s) - START) ))
echo "flintc bench: time budget ${LEFT} s"
timeout --signal=INT --kill-after=15 $(( LEFT + 20 )) \
  $PY -m flintc bench --load-format dummy --config full --formats "$FORMATS" \
    --contexts "$CONTEXTS" --batches "$BATCHES" --prefill "$PREFILL" --baselines eager \
    --builds "$BUILDS" --no-compile --time-budget "$LEFT" --step-timeout "$STEP_TIMEOUT" \
    --out "$OUT/bench" 2>&1 | tee "$OUT/bench/bench.log"
RC=${PIPESTATUS[0]}
echo "flintc bench exit status $RC after $(( $(date +%s) - START )) s"
exit "$RC"
