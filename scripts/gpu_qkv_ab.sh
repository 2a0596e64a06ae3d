#!/usr/bin/env bash
# One H200 call (< 10 min) for the CUDA fused QKV kernel (flintc.kernels.nvfp4_mma.mma_qkv,
# session 14): its GPU tests, its micro-benchmark against the Triton kernel
# (scripts/gpu_mma_qkv.py), an A/B of the decode step (flintc bench, b1 and b8 at 1K,
# prefill 1K; weight formats $AB_FORMATS, default nvfp4) between the code in $AB_OLD (a `git archive` of the previous commit,
# made before the call: git archive HEAD | tar -x -C _ab_old) and this tree, the
# 4-layer full-width runtime check (scripts/gpu_runtime.py) and the per-kernel profile
# at b1/1K. Needs gpu_builds/ (docs/benchmarks.md "How to run"). Outputs in $OUT/qkv-ab.
#
#   OUT=/some/dir AB_OLD=_ab_old [AB_FORMATS=nvfp4,bf16] bash scripts/gpu_qkv_ab.sh   # repo root
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-$PWD/qkv_out}
mkdir -p "$OUT/qkv-ab" || exit 1
OUT=$(cd "$OUT/qkv-ab" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=$OUT/pip.log
BUDGET=${QKV_AB_BUDGET_S:-570}
T=$OUT
TAIL=${TAIL:-25}
. scripts/gpu_env.sh
ROOT=$PWD
step tests 150 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_fused_gemv.py \
  tests/kernels/test_nvfp4_mma.py -k "gpu and (qkv or converted)"
step micro 150 $PY scripts/gpu_mma_qkv.py --pdl --launches 4x8x1,2x16x1,8x4x1,4x8x2
FORMATS=${AB_FORMATS:-nvfp4}
BENCH="-m flintc bench --load-format dummy --config full --formats $FORMATS --contexts 1024
  --batches 1,8 --prefill 1024 --prefill-iters 1 --baselines none --builds $ROOT/gpu_builds
  --no-compile"
if [ -n "${AB_OLD:-}" ] && [ -d "$AB_OLD" ]; then
  OLD=$(cd "$AB_OLD" && pwd)
  step bench-old 120 env -C "$OLD" PYTHONPATH="$SITE:$OLD" $PY $BENCH --out "$OUT/bench-old"
fi
step bench-new 120 env PYTHONPATH="$SITE:$ROOT" $PY $BENCH --out "$OUT/bench-new"
step runtime 100 $PY scripts/gpu_runtime.py --builds gpu_builds --build-prefix full4 \
  --config gpu_builds/full4-config --formats "$FORMATS" --steps 24 --out "$OUT/runtime.md"
for f in ${FORMATS//,/ }; do
  step "profile-$f" 70 $PY scripts/gpu_decode_profile.py --build "gpu_builds/full-$f-b1" \
    --context 1024 --out "$OUT/profile-$f-1k.md"
done
echo "done after $(( $(date +%s) - START )) s"
