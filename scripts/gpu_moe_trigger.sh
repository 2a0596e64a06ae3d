#!/usr/bin/env bash
# One H200 call (< 10 min): the MoE kernels' PDL trigger, late (after the main loop, the
# default) against early (once each block's first loads are issued, FLINTC_MOE_TRIGGER),
# and the MoE read floor (benchmarks/read_floor.py). Steps: the GPU tests of the MoE CUDA
# kernels with the early trigger and of the read floor; `bench_moe.py --pdl` with the
# read-floor rows, then again with FLINTC_MOE_TRIGGER=$TRIG_KERNELS; `flintc bench`
# (decode, contexts $TRIG_CONTEXTS, batches $TRIG_BATCHES) without and with it; the
# 4-layer full-width runtime check with it. Needs gpu_builds/ (docs/benchmarks.md "How
# to run"; only batch-1 builds full-{fmt}-b1 and the full-{fmt} builds for batch > 1).
#
#   OUT=/some/dir [TRIG_KERNELS=gate_up,down] [TRIG_FORMATS=nvfp4,bf16] \
#     bash scripts/gpu_moe_trigger.sh   # from the repository root
set -uo pipefail
OUT=${OUT:-$PWD/trigger_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=$OUT/pip.log
. scripts/gpu_env.sh
export PYTHONPATH PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
KERNELS=${TRIG_KERNELS:-gate_up,down}
FORMATS=${TRIG_FORMATS:-nvfp4,bf16}
step() {  # step NAME LIMIT_S CMD...: output to $OUT/NAME.log, its tail to stdout
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: rc $? in $(( $(date +%s) - t0 )) s"
  tail -n "${TAIL:-12}" "$OUT/$name.log"
}
step tests 150 env FLINTC_MOE_TRIGGER="$KERNELS" $PY -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_nvfp4_mma.py tests/bench/test_read_floor.py -k "moe or read_floor"
TAIL=70 step moe-late 150 $PY benchmarks/bench_moe.py --pdl --no-sweep --formats "$FORMATS" \
  --out "$OUT/moe-late.md"
TAIL=40 step moe-early 120 env FLINTC_MOE_TRIGGER="$KERNELS" $PY benchmarks/bench_moe.py --pdl \
  --no-sweep --no-floor --formats "$FORMATS" --out "$OUT/moe-early.md"
BENCH="-m flintc bench --load-format dummy --config full --formats $FORMATS
  --contexts ${TRIG_CONTEXTS:-1024} --batches ${TRIG_BATCHES:-1,8} --prefill 1024
  --prefill-iters 1 --baselines none --builds gpu_builds --no-compile"
TAIL=20 step bench-late 130 $PY $BENCH --out "$OUT/bench-late"
TAIL=20 step bench-early 130 env FLINTC_MOE_TRIGGER="$KERNELS" $PY $BENCH --out "$OUT/bench-early"
step runtime 100 env FLINTC_MOE_TRIGGER="$KERNELS" $PY scripts/gpu_runtime.py --builds gpu_builds \
  --build-prefix full4d --config gpu_builds/full4-config --formats "$FORMATS" --prompt-len 2600 --steps 16 \
  --out "$OUT/runtime.md"
