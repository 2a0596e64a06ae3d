#!/usr/bin/env bash
# One H200 call (< 10 min): a kernel-configuration sweep family and the checks that follow a
# kernel change.
#   1. benchmarks/bench_moe.py --family $SWEEP_FAMILY: the MoE kernels' rule / TUNED pick
#      against the family's candidates at SWEEP_MOE_BATCHES (default 8,1,4), winners to
#      moe.json;
#   2. benchmarks/bench_gemv.py --sweep --family $SWEEP_FAMILY: SWEEP_GEMV_CASES (default
#      qkv,o_proj+res) at SWEEP_GEMV_BATCHES (1,8), winners to gemv.json;
#   3. GPU tests at full shapes: SWEEP_TESTS (pytest arguments; default: the swap family's
#      correctness tests: MoE at N = 8 NVFP4 and bf16, plain GEMV (q_proj shape) at N = 8
#      NVFP4, fused QKV + dense MLP at N = 8 NVFP4 and N = 1 bf16);
#   4. scripts/gpu_prefill_graph.py (prefill from CUDA graphs against eager, bit for bit,
#      both formats; skipped when SWEEP_PREFILL_S is 0, the default);
#   5. flintc bench (scripts/gpu_bench.sh) at batches 1 and 8, contexts 1K and 100K, and
#      the prefills SWEEP_BENCH_PREFILL (default 1024,8192) in the formats
#      SWEEP_BENCH_FORMATS (default nvfp4,bf16), with FLINTC_MOE_TUNED / FLINTC_GEMV_TUNED
#      set to the sweeps' winners (flintc.kernels.tuning), so its numbers are those of the
#      winners.
# SWEEP_FAMILY: swap (default), flat, classic, one-step, maxnreg (MoE only: register caps;
# step 2 is then skipped), stage (MoE only: the down kernel's weight tiles staged or not;
# step 2 skipped) or all (see the benchmarks' --family);
# SWEEP_FORMATS: the sweeps' weight formats (default bf16,nvfp4).
# Logs and tables in $OUT/sweep.tgz (bench.json and bench.md of step 5 included). Budget:
# SWEEP_BUDGET_S (default 560 s). Caps per step (each also capped by what is left of the
# budget): SWEEP_MOE_S (200; the sweep's own --sweep-seconds is SWEEP_MOE_MARGIN_S,
# default 60 s, less, at least 0), SWEEP_GEMV_S (90; --sweep-seconds 25 s less),
# SWEEP_TESTS_S (120), SWEEP_PREFILL_S (0). The two sweeps are skipped below 45 s, steps 3
# and 4 below 20 s; step 5 gets the rest less 10 s, and is skipped below 60 s.
#
#   OUT=/some/dir bash scripts/gpu_sweep.sh      # from the repository root
set -uo pipefail
START=$(date +%s)
BUDGET=${SWEEP_BUDGET_S:-560}
FAMILY=${SWEEP_FAMILY:-swap}
OUT=${OUT:-$PWD/sweep_out}
mkdir -p "$OUT/sweep" || exit 1
OUT=$(cd "$OUT" && pwd)
T=$OUT/sweep
cd "$(dirname "$0")/.." || exit 1
LOG=$T/pip.log
. scripts/gpu_env.sh
echo "== family $FAMILY, budget $BUDGET s"
MOE_CAP=${SWEEP_MOE_S:-200}; [ "$(left)" -lt "$MOE_CAP" ] && MOE_CAP=$(left)  # the step's real cap
if [ "$MOE_CAP" -ge 45 ]; then
  MOE_SWEEP_S=$(( MOE_CAP - ${SWEEP_MOE_MARGIN_S:-60} )); [ "$MOE_SWEEP_S" -lt 0 ] && MOE_SWEEP_S=0
  TAIL=40 step moe-sweep "$MOE_CAP" $PY benchmarks/bench_moe.py --pdl --family "$FAMILY" \
    --batches "${SWEEP_MOE_BATCHES:-8,1,4}" --formats "${SWEEP_FORMATS:-bf16,nvfp4}" --sweep-seconds "$MOE_SWEEP_S" \
    --out "$T/moe.md" --tuned-json "$T/moe.json"
fi
GEMV_CAP=${SWEEP_GEMV_S:-90}; [ "$(left)" -lt "$GEMV_CAP" ] && GEMV_CAP=$(left)
case "$FAMILY" in maxnreg|stage) GEMV_CAP=0 ;; esac  # MoE-only families
if [ "$GEMV_CAP" -ge 45 ]; then
  TAIL=14 step gemv-sweep "$GEMV_CAP" $PY benchmarks/bench_gemv.py --sweep --family "$FAMILY" \
    --pdl --no-compile --batches "${SWEEP_GEMV_BATCHES:-1,8}" --formats "${SWEEP_FORMATS:-bf16,nvfp4}" --sweep-seconds $(( GEMV_CAP - 25 )) \
    --cases "${SWEEP_GEMV_CASES:-qkv,o_proj+res}" --out "$T/gemv.md" --tuned-json "$T/gemv.json"
fi
# shellcheck disable=SC2086
TAIL=8 step gpu-tests ${SWEEP_TESTS_S:-120} $PY -m pytest -q -m gpu -p no:cacheprovider ${SWEEP_TESTS:-\
"tests/kernels/test_moe_kernels.py::test_sweep_configs_full_shapes_gpu[base+swap-8-nvfp4_gs]" \
"tests/kernels/test_fused_gemv.py::test_fused_swap_and_flat_configs_gpu[8-nvfp4_gs]" \
"tests/kernels/test_gemv.py::test_every_sweep_config_gpu[4096-2048-8-nvfp4_gs]" \
"tests/kernels/test_moe_kernels.py::test_sweep_configs_full_shapes_gpu[base+swap-8-bf16]" \
"tests/kernels/test_fused_gemv.py::test_fused_swap_and_flat_configs_gpu[1-bf16]"}
if [ "${SWEEP_PREFILL_S:-0}" -gt 0 ]; then
  TAIL=12 step prefill-graph "$SWEEP_PREFILL_S" $PY scripts/gpu_prefill_graph.py --builds gpu_builds \
    --formats nvfp4,bf16 --iters 2 --out "$T/prefill-graph.md"
fi
ENVS=()
[ -s "$T/gemv.json" ] && ENVS+=("FLINTC_GEMV_TUNED=$T/gemv.json")
[ -s "$T/moe.json" ] && ENVS+=("FLINTC_MOE_TUNED=$T/moe.json")
BENCH_S=$(( $(left) - 10 ))
if [ "$BENCH_S" -ge 60 ]; then
  echo "== flintc bench (${BENCH_S} s, ${ENVS[*]:-no overrides})"
  env "${ENVS[@]}" OUT="$T" BENCH_BUDGET_S=$BENCH_S BENCH_FORMATS=${SWEEP_BENCH_FORMATS:-nvfp4,bf16} \
    BENCH_CONTEXTS=1024,100000 BENCH_BATCHES=1,8 BENCH_PREFILL=${SWEEP_BENCH_PREFILL:-1024,8192} \
    BENCH_PREFILL_ITERS=2 BENCH_ARGS="--baselines none" bash scripts/gpu_bench.sh > "$T/bench-run.log" 2>&1
  echo "   exit $?"; grep -E "^\| (nvfp4|bf16) \| [0-9]+ \| " "$T/bench/bench.md" 2>/dev/null | head -20
  rm -f "$T"/bench/*.png
else
  echo "== flintc bench: skipped (${BENCH_S} s left)"
fi
echo "done after $(( $(date +%s) - START )) s"
tar czf "$OUT/sweep.tgz" -C "$OUT" sweep && rm -rf "$T"
