#!/usr/bin/env bash
# ONE call on the H200 (at most 10 minutes; the script ends by about 565 s): `flintc bench`
# for both weight formats, with the eager baseline, from builds cross-compiled beforehand
# on the CPU machine (gpu_builds/, see docs/benchmarks.md "How to run"). Outputs in
# $OUT/bench: bench.json, bench.md, the PNG plots, bench.log, pip.log.
#
# What it measures by default (docs/benchmarks.md): decode at contexts 1K-262K and batches
# 1-8 on KV caches filled with random values (no prefill runs before a decode point, so
# the 262K points cost no 262K-token prefill), prefill of 1,024 and 8,192 tokens (3 timed
# runs each), the eager baseline at batch 1 at every context and at batches 2-8 at 1K.
# Each build's caches are sized to the longest context it serves that fits next to the
# weights (batch 1 runs on the *-b1 builds, up to 262K; batches 2-8 on the 8-bucket
# builds; BF16 at batches 2-8 and 262K does not fit and is skipped with a note).
#
# Time: the wheels install first (scripts/gpu_env.sh); then flintc bench gets what is left
# of BENCH_BUDGET_S (default 540 s from the start of this script) less 10 s for Python's
# start as its --time-budget: each weight format gets an equal share of what is left, later
# points are skipped with a note once a share is spent, every single measurement has a
# --step-timeout (BENCH_STEP_TIMEOUT_S, default 150 s: the first point of each build
# includes Triton's compile and the CUDA-graph capture), and bench.json is rewritten
# before every measurement. A hard `timeout` sends SIGINT 20 s after the budget, on which
# flintc bench still writes its report; if even that fails, re-render locally from
# bench.json with `flintc bench --from-json bench.json --out DIR`. Without matplotlib
# (its wheels missing from .whl/) everything but the PNGs is written, with a note.
#
#   OUT=/some/dir bash scripts/gpu_bench.sh                     # from the repository root
#   BENCH_FORMATS=nvfp4 BENCH_CONTEXTS=1024,100000 OUT=... bash scripts/gpu_bench.sh
set -uo pipefail

START=$(date +%s)
BUDGET=${BENCH_BUDGET_S:-540}
STEP_TIMEOUT=${BENCH_STEP_TIMEOUT_S:-150}
FORMATS=${BENCH_FORMATS:-nvfp4,bf16}
CONTEXTS=${BENCH_CONTEXTS:-1024,8192,32768,100000,262144}
BATCHES=${BENCH_BATCHES:-1,2,4,8}
PREFILL=${BENCH_PREFILL:-1024,8192}
PREFILL_ITERS=${BENCH_PREFILL_ITERS:-3}
BUILDS=${BENCH_BUILDS:-gpu_builds}
EXTRA=${BENCH_ARGS:-}
OUT=${OUT:-$PWD/bench_out}

mkdir -p "$OUT/bench" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1

LOG=$OUT/bench/pip.log
. scripts/gpu_env.sh

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
# versions; matplotlib imported once here, so its font cache is not built inside the timed run
$PY - <<'EOF'
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot
    print("matplotlib", matplotlib.__version__)
except Exception as e:
    print(f"matplotlib does not import ({type(e).__name__}: {e}): no plots (carry its wheels in .whl/)")
EOF
if ! ls "$BUILDS"/*/build.json >/dev/null 2>&1; then
  echo "no builds in $BUILDS: cross-compile them on the CPU machine first (docs/benchmarks.md)"; exit 2
fi
ls -d "$BUILDS"/*/
echo "setup took $(( $(date +%s) - START )) s"

LEFT=$(( BUDGET - ($(date +%s) - START) ))
echo "flintc bench: time budget $(( LEFT - 10 )) s"
# shellcheck disable=SC2086
timeout --signal=INT --kill-after=15 $(( LEFT + 10 )) \
  $PY -m flintc bench --load-format dummy --config full --formats "$FORMATS" \
    --contexts "$CONTEXTS" --batches "$BATCHES" --prefill "$PREFILL" --prefill-iters "$PREFILL_ITERS" \
    --baselines eager --builds "$BUILDS" --no-compile --time-budget $(( LEFT - 10 )) \
    --step-timeout "$STEP_TIMEOUT" --out "$OUT/bench" $EXTRA 2>&1 | tee "$OUT/bench/bench.log"
RC=${PIPESTATUS[0]}
rm -f "$OUT/bench/bench.json.tmp"
echo "flintc bench exit status $RC after $(( $(date +%s) - START )) s"
ls -la "$OUT/bench"
exit "$RC"
