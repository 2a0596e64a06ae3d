#!/usr/bin/env bash
# One H200 call (< 6 min): the prefill MoE grouped GEMM (flintc/kernels/grouped_gemm.py).
#   1. its GPU tests at full shapes (tests/kernels/test_prefill_gemm.py -m gpu -k moe,
#      or -k PMOE_TESTS_K);
#   2. benchmarks/bench_prefill_moe.py: route + gate/up + down per implementation, no
#      dense GEMMs (PMOE_FORMATS, PMOE_TOKENS);
#   3. the same with --sweep: the Triton kernel's block sweep at PMOE_SWEEP_TOKENS (default
#      512, one prefill chunk, and 2048; PMOE_SWEEP_FORMATS, default nvfp4; PMOE_SWEEP_S=0
#      skips it);
#   4. scripts/gpu_prefill_graph.py: prefill in the full model (graph against eager, bit
#      for bit, and timed at 8,192 tokens; PMOE_PREFILL_FORMATS, default nvfp4;
#      PMOE_PREFILL_S=0 skips it).
# Logs and tables in $OUT/prefill_moe.tgz. Budget: PMOE_BUDGET_S (default 330 s). Caps per
# step (each also capped by what is left of the budget; a step with < 20 s left is
# skipped): PMOE_TESTS_S (80), PMOE_BENCH_S (60), PMOE_SWEEP_S (100), PMOE_PREFILL_S (100).
#
#   OUT=/some/dir bash scripts/gpu_prefill_moe.sh      # from the repository root
set -uo pipefail
START=$(date +%s)
BUDGET=${PMOE_BUDGET_S:-330}
OUT=${OUT:-$PWD/prefill_moe_out}
mkdir -p "$OUT/prefill_moe" || exit 1
OUT=$(cd "$OUT" && pwd)
T=$OUT/prefill_moe
cd "$(dirname "$0")/.." || exit 1
LOG=$T/pip.log
. scripts/gpu_env.sh
TAIL=6 step gpu-tests ${PMOE_TESTS_S:-80} $PY -m pytest -q -m gpu -p no:cacheprovider \
  tests/kernels/test_prefill_gemm.py -k "${PMOE_TESTS_K:-moe}"
TAIL=16 step bench ${PMOE_BENCH_S:-60} $PY benchmarks/bench_prefill_moe.py --skip-dense \
  --formats ${PMOE_FORMATS:-nvfp4 bf16} --tokens ${PMOE_TOKENS:-512 2048} --impls triton grouped_mm \
  --out "$T/bench.md"
[ "${PMOE_SWEEP_S:-100}" -gt 0 ] && TAIL=8 step sweep ${PMOE_SWEEP_S:-100} $PY benchmarks/bench_prefill_moe.py \
  --sweep --formats ${PMOE_SWEEP_FORMATS:-nvfp4} --tokens ${PMOE_SWEEP_TOKENS:-512 2048} --out "$T/sweep.md"
[ "${PMOE_PREFILL_S:-100}" -gt 0 ] && TAIL=16 step prefill-graph ${PMOE_PREFILL_S:-100} $PY scripts/gpu_prefill_graph.py --builds gpu_builds \
  --formats "${PMOE_PREFILL_FORMATS:-nvfp4}" --iters 2 --out "$T/prefill-graph.md"
echo "done after $(( $(date +%s) - START )) s"
tar czf "$OUT/prefill_moe.tgz" -C "$OUT" prefill_moe && rm -rf "$T"
