#!/usr/bin/env bash
# One H200 call per part (< 10 min each): the L2 prefetch of the CUDA kernels
# (FLINTC_MMA_L2_PREFETCH, `nvfp4_mma.mma_l2_prefetch`), written in session 23 with no GPU
# lent, so it is off by default until these runs say which kernels gain
# (docs/gpu-runs.md, "session 23: planned"). Both parts run `scripts/gpu_env_ab.sh`.
#   PART=1 (default): the GPU tests of every prefetching kernel (the tests turn the
#     prefetch on themselves), `bench_moe.py` NVFP4 with none / all (session 25 dropped the
#     in-kernel-only value, INKERNEL, to fit AB_BUDGET_S; run it with AB_MOE if all gains), and
#     the NVFP4 model at 1K, b1-b8, none then all (one alternation: the call must stay
#     under 10 min).
#   PART=2: the dense gate/up (`gpu_dense_gate_up.py`) and the GEMV O projection / dense
#     down (`gpu_nvfp4_mma.py` OPS) alone, none / on; BF16 `bench_moe.py` none / all; the
#     BF16 model at 1K b1 / b8, none / all; the 4-layer full-width check with all.
#
#   OUT=/some/dir [PART=2] bash scripts/gpu_l2_prefetch.sh   # repo root; needs gpu_builds/
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export AB_VAR=FLINTC_MMA_L2_PREFETCH
INKERNEL="gemv,gate_up,down,norm_gate_up"
case "${PART:-1}" in
  1)
    K="moe_topk_gate_up_matches and (True-1- or True-8-) or moe_down_matches"
    K="$K or norm_gate_up_matches or kernel_model_shapes or converted"
    AB_TESTS="tests/kernels/test_nvfp4_mma.py -k '$K'" \
    AB_TESTS_VALUE=- AB_TESTS_S=90 AB_MICRO="" AB_MOE="none;all" \
    AB_SETS="none;all" AB_FORMATS=nvfp4 AB_BATCHES=1,2,4,8 \
    AB_BUILD_GLOB='full-nvfp4*' AB_RUNTIME="" bash scripts/gpu_env_ab.sh ;;
  2)
    MICRO='for v in none all; do echo "== FLINTC_MMA_L2_PREFETCH=$v";
      FLINTC_MMA_L2_PREFETCH=$v FMTS=nvfp4,bf16 NS=1,8 LAUNCHES="4,2,2,0 4,1,2,2"
        $PY scripts/gpu_dense_gate_up.py;
      FLINTC_MMA_L2_PREFETCH=$v CASES="" OPS="2048,4096 2048,10240" MOE=0 NS=1,8
        $PY scripts/gpu_nvfp4_mma.py; done'
    AB_TESTS="" AB_MICRO="$MICRO" AB_MICRO_S=220 AB_MOE="none;all" AB_SETS="none;all" \
    AB_FORMATS=bf16 AB_BATCHES=1,8 AB_BUILD_GLOB='full-bf16*' AB_RUNTIME=all \
    bash scripts/gpu_env_ab.sh ;;
  *) echo "PART must be 1 or 2, got '${PART}'" >&2; exit 1 ;;
esac
