#!/usr/bin/env bash
# One H200 call (< 10 min): the flat 2-D tile sweeps of session 8 (MoeConfig.flat /
# GemvConfig.flat) and the checks that follow a kernel change, as scripts/gpu_sweep.sh with
# SWEEP_FAMILY=flat and this script's former defaults:
#   1. bench_moe.py --family flat at FLAT_MOE_BATCHES (default 1,2,4,8), winners to moe.json;
#   2. bench_gemv.py --sweep --family flat: the O projection and the dense down projection
#      at FLAT_GEMV_BATCHES (1,2,8), winners to gemv.json;
#   3. GPU tests: the bf16 MoE kernels' TUNED configs at N = 1, 2, 8, every MoE sweep
#      configuration at N = 8 and the bf16 GEMVs that the flat rule serves, at full shapes
#      (FLAT_TESTS overrides the pytest arguments);
#   4. scripts/gpu_prefill_graph.py (graph against eager, bit for bit, both formats);
#   5. flintc bench at batches 1 and 8, contexts 1K and 100K, the 1K / 8K prefills, with the
#      sweeps' winners as FLINTC_*_TUNED overrides.
# Budget FLAT_BUDGET_S (560 s); caps FLAT_MOE_S (200), FLAT_GEMV_S (45), FLAT_TESTS_S (120),
# FLAT_PREFILL_S (90). Logs and tables in $OUT/flat.tgz (gpu_sweep.sh's sweep.tgz, renamed).
#
#   OUT=/some/dir bash scripts/gpu_flat_tiles.sh      # from the repository root
set -uo pipefail
OUT=${OUT:-$PWD/flat_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
OUT="$OUT" SWEEP_FAMILY=flat SWEEP_BUDGET_S=${FLAT_BUDGET_S:-560} \
  SWEEP_MOE_BATCHES=${FLAT_MOE_BATCHES:-1,2,4,8} SWEEP_MOE_S=${FLAT_MOE_S:-200} \
  SWEEP_GEMV_CASES=o_proj+res,down+res SWEEP_GEMV_BATCHES=${FLAT_GEMV_BATCHES:-1,2,8} \
  SWEEP_GEMV_S=${FLAT_GEMV_S:-45} SWEEP_TESTS_S=${FLAT_TESTS_S:-120} \
  SWEEP_PREFILL_S=${FLAT_PREFILL_S:-90} SWEEP_TESTS="${FLAT_TESTS:-\
tests/kernels/test_moe_kernels.py::test_moe_kernels_full_shapes_gpu[1-bf16-True] \
tests/kernels/test_moe_kernels.py::test_moe_kernels_full_shapes_gpu[2-bf16-True] \
tests/kernels/test_moe_kernels.py::test_moe_kernels_full_shapes_gpu[8-bf16-True] \
tests/kernels/test_moe_kernels.py::test_sweep_configs_full_shapes_gpu[base+swap-8-bf16] \
tests/kernels/test_moe_kernels.py::test_sweep_configs_full_shapes_gpu[base+swap-8-nvfp4_gs] \
tests/kernels/test_gemv.py::test_gemv_model_shapes_gpu[o_proj-8-bf16-True] \
tests/kernels/test_gemv.py::test_gemv_model_shapes_gpu[dense_down-8-bf16-True] \
tests/kernels/test_gemv.py::test_gemv_model_shapes_gpu[q_proj-8-bf16-True] \
tests/kernels/test_gemv.py::test_gemv_model_shapes_gpu[lm_head-1-bf16-True]}" \
  bash scripts/gpu_sweep.sh
rc=$?
[ -f "$OUT/sweep.tgz" ] && mv "$OUT/sweep.tgz" "$OUT/flat.tgz"
exit $rc
