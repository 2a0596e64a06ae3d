#!/usr/bin/env bash
# One H200 call (< 10 min): the flat 2-D tile sweeps (MoeConfig.flat / GemvConfig.flat) and
# the checks that follow a kernel change.
#   1. benchmarks/bench_moe.py --family flat: the MoE kernels' rule / TUNED pick against
#      its flat twins at FLAT_MOE_BATCHES (default 1,2,4,8), winners to moe.json;
#   2. benchmarks/bench_gemv.py --sweep --family flat: the O projection and the dense
#      down projection (bf16; NVFP4 has no flat loop) at FLAT_GEMV_BATCHES (1,2,8),
#      winners to gemv.json;
#   3. GPU tests: the bf16 MoE kernels' TUNED configs at N = 1, 2, 8, every MoE sweep
#      configuration at N = 8 (flat twins included) and the bf16 GEMVs that the flat rule
#      serves, at full shapes (FLAT_TESTS overrides the pytest arguments);
#   4. scripts/gpu_prefill_graph.py: prefill from CUDA graphs against eager, bit for bit,
#      both formats, timed at 8,192 tokens;
#   5. flintc bench (scripts/gpu_bench.sh) at batches 1 and 8, contexts 1K and 100K, and
#      the 1K / 8K prefills, with FLINTC_MOE_TUNED / FLINTC_GEMV_TUNED set to the sweeps'
#      winners (flintc.kernels.tuning), so its numbers are those of the winners.
# Logs and tables in $OUT/flat.tgz (bench.json and bench.md of step 5 included). Budget:
# FLAT_BUDGET_S (default 560 s; session 8 run 5 ran it with 480, and the MoE sweep (130 s
# then) and the tests (70 s) hit their caps). Caps per step (each also capped by what is
# left of the budget; a step with < 20 s left is skipped): FLAT_MOE_S (200; the sweep's
# own --sweep-seconds is 20 s less), FLAT_GEMV_S (45), FLAT_TESTS_S (120), FLAT_PREFILL_S
# (90); step 5 gets the rest less 10 s, and is skipped below 60 s.
#
#   OUT=/some/dir bash scripts/gpu_flat_tiles.sh      # from the repository root
set -uo pipefail
START=$(date +%s)
BUDGET=${FLAT_BUDGET_S:-560}
OUT=${OUT:-$PWD/flat_out}
mkdir -p "$OUT/flat" || exit 1
OUT=$(cd "$OUT" && pwd)
T=$OUT/flat
cd "$(dirname "$0")/.." || exit 1
LOG=$T/pip.log
. scripts/gpu_env.sh
MOE_CAP=${FLAT_MOE_S:-200}; [ "$(left)" -lt "$MOE_CAP" ] && MOE_CAP=$(left)  # the step's real cap
TAIL=40 step moe-sweep "$MOE_CAP" $PY benchmarks/bench_moe.py --pdl --family flat \
  --batches "${FLAT_MOE_BATCHES:-1,2,4,8}" --sweep-seconds $(( MOE_CAP - 25 )) \
  --out "$T/moe.md" --tuned-json "$T/moe.json"
TAIL=10 step gemv-sweep ${FLAT_GEMV_S:-45} $PY benchmarks/bench_gemv.py --sweep --family flat --pdl \
  --no-compile --batches "${FLAT_GEMV_BATCHES:-1,2,8}" --cases o_proj+res,down+res \
  --out "$T/gemv.md" --tuned-json "$T/gemv.json"
# shellcheck disable=SC2086
TAIL=6 step gpu-tests ${FLAT_TESTS_S:-120} $PY -m pytest -q -m gpu -p no:cacheprovider ${FLAT_TESTS:-\
"tests/kernels/test_moe_kernels.py::test_moe_kernels_full_shapes_gpu[1-bf16-True]" \
"tests/kernels/test_moe_kernels.py::test_moe_kernels_full_shapes_gpu[2-bf16-True]" \
"tests/kernels/test_moe_kernels.py::test_moe_kernels_full_shapes_gpu[8-bf16-True]" \
"tests/kernels/test_moe_kernels.py::test_sweep_configs_full_shapes_gpu[8-bf16]" \
"tests/kernels/test_moe_kernels.py::test_sweep_configs_full_shapes_gpu[8-nvfp4_gs]" \
"tests/kernels/test_gemv.py::test_gemv_model_shapes_gpu[o_proj-8-bf16-True]" \
"tests/kernels/test_gemv.py::test_gemv_model_shapes_gpu[dense_down-8-bf16-True]" \
"tests/kernels/test_gemv.py::test_gemv_model_shapes_gpu[q_proj-8-bf16-True]" \
"tests/kernels/test_gemv.py::test_gemv_model_shapes_gpu[lm_head-1-bf16-True]"}
TAIL=12 step prefill-graph ${FLAT_PREFILL_S:-90} $PY scripts/gpu_prefill_graph.py --builds gpu_builds \
  --formats nvfp4,bf16 --iters 2 --out "$T/prefill-graph.md"
ENVS=()
[ -s "$T/gemv.json" ] && ENVS+=("FLINTC_GEMV_TUNED=$T/gemv.json")
[ -s "$T/moe.json" ] && ENVS+=("FLINTC_MOE_TUNED=$T/moe.json")
BENCH_S=$(( $(left) - 10 ))
if [ "$BENCH_S" -ge 60 ]; then
  echo "== flintc bench (${BENCH_S} s, ${ENVS[*]:-no overrides})"
  env "${ENVS[@]}" OUT="$T" BENCH_BUDGET_S=$BENCH_S BENCH_FORMATS=nvfp4,bf16 \
    BENCH_CONTEXTS=1024,100000 BENCH_BATCHES=1,8 BENCH_PREFILL=1024,8192 BENCH_PREFILL_ITERS=2 \
    BENCH_ARGS="--baselines none" bash scripts/gpu_bench.sh > "$T/bench-run.log" 2>&1
  echo "   exit $?"; grep -E "^\| (nvfp4|bf16) \| [0-9]+ \| " "$T/bench/bench.md" 2>/dev/null | head -20
  rm -f "$T"/bench/*.png
else
  echo "== flintc bench: skipped (${BENCH_S} s left)"
fi
echo "done after $(( $(date +%s) - START )) s"
tar czf "$OUT/flat.tgz" -C "$OUT" flat && rm -rf "$T"
