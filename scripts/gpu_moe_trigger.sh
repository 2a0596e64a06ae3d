#!/usr/bin/env bash
# One H200 call (< 10 min): the CUDA kernels' PDL trigger (FLINTC_MMA_TRIGGER: which of
# gemv, qkv, router, gate_up, down call `griddepcontrol.launch_dependents` once a block's
# first loads are issued instead of after its main loop) and the MoE read floor
# (benchmarks/read_floor.py). Steps, each skipped when its variable is empty:
#   TRIG_TESTS    pytest arguments, run with FLINTC_MMA_TRIGGER=all (default: the GPU
#                 tests of the CUDA kernels and of the read floor)
#   TRIG_MOE      `;`-separated FLINTC_MMA_TRIGGER values for `bench_moe.py --pdl
#                 --no-sweep` (the first with the read-floor rows; default "none;down")
#   TRIG_SETS     `;`-separated values for `flintc bench` (decode at contexts
#                 $TRIG_CONTEXTS, batches $TRIG_BATCHES; default "none;down;all;none")
#   TRIG_RUNTIME  the value for the 4-layer full-width runtime check (default all)
# Needs gpu_builds/ (docs/benchmarks.md "How to run": full-{fmt}-b1 and full-{fmt} only;
# the bench takes the first batch-1 build it finds). Logs in $OUT/*.log; bench tables in
# $OUT/bench-<i>.md (at most 8 files come back from the device).
#
#   OUT=/some/dir [TRIG_FORMATS=nvfp4,bf16] bash scripts/gpu_moe_trigger.sh   # repo root
set -uo pipefail
OUT=${OUT:-$PWD/trigger_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=/tmp/pip-trigger.log
. scripts/gpu_env.sh
export PYTHONPATH PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
FORMATS=${TRIG_FORMATS:-nvfp4,bf16}
WORK=/tmp/trigger_work
mkdir -p "$WORK"
step() {  # step NAME LIMIT_S CMD...: output to $WORK/NAME.log, its tail to stdout
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
  echo "== $name: rc $? in $(( $(date +%s) - t0 )) s"
  tail -n "${TAIL:-12}" "$WORK/$name.log"
}
TESTS=${TRIG_TESTS-tests/kernels/test_nvfp4_mma.py tests/bench/test_read_floor.py}
[ -n "$TESTS" ] && TAIL=4 step tests 200 env FLINTC_MMA_TRIGGER=all $PY -m pytest -q \
  -p no:cacheprovider -m gpu $TESTS
i=0
IFS=';' read -ra MOE <<<"${TRIG_MOE-none;down}"
for t in "${MOE[@]}"; do
  floor=--no-floor; [ $i = 0 ] && floor=
  TAIL=80 step "moe-$i" 150 env FLINTC_MMA_TRIGGER="$t" $PY benchmarks/bench_moe.py --pdl \
    --no-sweep $floor --formats "$FORMATS" --out "$WORK/moe-$i.md"
  echo "(FLINTC_MMA_TRIGGER=$t)"; i=$((i + 1))
done
cat "$WORK"/moe-*.md >"$OUT/moe.md" 2>/dev/null
BENCH="-m flintc bench --load-format dummy --config full --formats $FORMATS
  --contexts ${TRIG_CONTEXTS:-1024} --batches ${TRIG_BATCHES:-1,8} --prefill 1024
  --prefill-iters 1 --baselines none --builds gpu_builds --no-compile"
i=0
IFS=';' read -ra SETS <<<"${TRIG_SETS-none;down;all;none}"
for t in "${SETS[@]}"; do
  TAIL=0 step "bench-$i" 130 env FLINTC_MMA_TRIGGER="$t" $PY $BENCH --out "$WORK/bench-$i"
  echo "FLINTC_MMA_TRIGGER=$t"; grep -E '^\| (nvfp4|bf16) \| [0-9] \|' "$WORK/bench-$i.log"
  cp "$WORK/bench-$i/bench.md" "$OUT/bench-$i.md" 2>/dev/null
  i=$((i + 1))
done
RT=${TRIG_RUNTIME-all}
[ -n "$RT" ] && TAIL=3 step runtime 100 env FLINTC_MMA_TRIGGER="$RT" $PY scripts/gpu_runtime.py \
  --builds gpu_builds --build-prefix full4d --config gpu_builds/full4-config --formats "$FORMATS" \
  --prompt-len 2600 --steps 16 --out "$WORK/runtime.md"
grep -h "SUMMARY" "$WORK/runtime.log" 2>/dev/null
cp "$WORK/tests.log" "$OUT/tests.log" 2>/dev/null
exit 0
