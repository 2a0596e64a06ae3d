#!/usr/bin/env bash
# One H200 call (< 10 min): optionally the torch.compile baseline point(s) of flintc bench
# first (TUNE_BASELINE_POINTS, e.g. 8x1024; ~300 s each), then the one-step sweeps of the
# GEMV and MoE kernels (benchmarks/bench_gemv.py / bench_moe.py --family one-step
# --tuned-json), then the full-size batch-1 decode step with and without the sweep winners
# (FLINTC_GEMV_TUNED / FLINTC_MOE_TUNED override files, flintc.kernels.tuning).
# Outputs in $OUT/tune.tgz (and $OUT/bench-compile). Knobs: TUNE_FAMILY (all / classic /
# one-step), TUNE_BATCHES, TUNE_GEMV_CASES, TUNE_GEMV_S / TUNE_MOE_S (caps; 0 skips the
# MoE sweep), TUNE_MOE_FAMILY / TUNE_MOE_BATCHES, TUNE_BENCH_CASES (bench_gemv without
# sweep, batches 1 and 8), TUNE_RUNTIME=1 (scripts/gpu_runtime.py on the full-width 4-layer
# builds), TUNE_TESTS (pytest -m gpu arguments), TUNE_BUDGET_S.
#
#   TUNE_BASELINE_POINTS=8x1024 OUT=/some/dir bash scripts/gpu_tune.sh   # from the repo root
set -uo pipefail
START=$(date +%s)
BUDGET=${TUNE_BUDGET_S:-565}
OUT=${OUT:-$PWD/tune_out}
mkdir -p "$OUT/tune" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
T=$OUT/tune
LOG=$T/pip.log
. scripts/gpu_env.sh
if [ -n "${TUNE_BASELINE_POINTS:-}" ]; then
  echo "== compile baseline $TUNE_BASELINE_POINTS"
  BENCH_BUDGET_S=${TUNE_BASELINE_S:-340} BASELINE_POINTS=$TUNE_BASELINE_POINTS OUT=$OUT \
    bash scripts/gpu_bench_compile_baseline.sh > "$T/compile-baseline.log" 2>&1
  echo "   exit $? after $(( $(date +%s) - START )) s"; grep -E "^\| compile|done in|skipp|rror" "$T/compile-baseline.log" | head
fi
step gemv-sweep ${TUNE_GEMV_S:-70} $PY benchmarks/bench_gemv.py --sweep --family "${TUNE_FAMILY:-one-step}" --pdl \
  --no-compile --batches "${TUNE_BATCHES:-1}" --cases "${TUNE_GEMV_CASES:-qkv,o_proj+res}" --out "$T/gemv.md" \
  --tuned-json "$T/gemv.json"
if [ -n "${TUNE_BENCH_CASES:-}" ]; then
  TAIL=10 step gemv-bench ${TUNE_BENCH_S:-60} $PY benchmarks/bench_gemv.py --pdl --no-compile --batches 1,8 \
    --cases "$TUNE_BENCH_CASES" --out "$T/gemv-bench.md"
fi
[ "${TUNE_MOE_S:-110}" -gt 0 ] && step moe-sweep ${TUNE_MOE_S:-110} $PY benchmarks/bench_moe.py --pdl \
  --batches "${TUNE_MOE_BATCHES:-1}" --family "${TUNE_MOE_FAMILY:-one-step}" \
  --sweep-seconds ${TUNE_MOE_SWEEP_S:-80} --out "$T/moe.md" --tuned-json "$T/moe.json"
TAIL=8 step decode-default 60 $PY scripts/gpu_decode_time.py --builds gpu_builds --formats nvfp4,bf16 \
  --contexts 1024,100000 --out "$T/decode-default.md"
ENVS=()
[ -s "$T/gemv.json" ] && ENVS+=("FLINTC_GEMV_TUNED=$T/gemv.json")
[ -s "$T/moe.json" ] && ENVS+=("FLINTC_MOE_TUNED=$T/moe.json")
TAIL=8 step decode-tuned 60 env "${ENVS[@]}" $PY scripts/gpu_decode_time.py --builds gpu_builds \
  --formats nvfp4,bf16 --contexts 1024,100000 --out "$T/decode-tuned.md"
if [ "${TUNE_RUNTIME:-0}" = 1 ]; then  # the default configs in the model against the reference
  TAIL=16 step runtime ${TUNE_RUNTIME_S:-110} $PY scripts/gpu_runtime.py --builds gpu_builds --build-prefix full4 \
    --config gpu_builds/full4-config --formats nvfp4,bf16 --steps 24 --out "$T/runtime.md"
fi
if [ -n "${TUNE_TESTS:-}" ]; then  # pytest arguments, e.g. "tests/kernels/test_gemv.py -k sweep"
  TAIL=6 step gpu-tests ${TUNE_TESTS_S:-90} $PY -m pytest -q -m gpu -x -p no:cacheprovider $TUNE_TESTS
fi
echo "done after $(( $(date +%s) - START )) s"
# the device tool returns at most 8 files: pack the logs and tables into one archive
tar czf "$OUT/tune.tgz" -C "$OUT" tune && rm -rf "$T"
