#!/usr/bin/env bash
# One H200 call (< 10 min) to A/B a kernel change: GPU tests ($AB_TESTS, pytest arguments),
# a micro-benchmark ($AB_MICRO, a command run with the GPU Python), an A/B of the decode
# step (flintc bench at batches $AB_BATCHES, contexts $AB_CONTEXTS, prefill 1K; weight
# formats $AB_FORMATS, default nvfp4) between the code in $AB_OLD (a `git archive` of the
# previous commit, made before the call: git archive HEAD | tar -x -C _ab_old) and this
# tree, the 4-layer full-width runtime check (scripts/gpu_runtime.py) and the per-kernel
# profile at b1/1K. Needs gpu_builds/ (docs/benchmarks.md "How to run"). Outputs in
# $OUT/ab. The defaults are session 14's QKV A/B (it was scripts/gpu_qkv_ab.sh); an empty
# AB_TESTS or AB_MICRO skips that step.
#
#   OUT=/some/dir AB_OLD=_ab_old [AB_FORMATS=nvfp4,bf16] [AB_TESTS=...] [AB_MICRO=...] \
#     bash scripts/gpu_ab.sh   # from the repository root
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-$PWD/ab_out}
mkdir -p "$OUT/ab" || exit 1
OUT=$(cd "$OUT/ab" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=$OUT/pip.log
BUDGET=${AB_BUDGET_S:-570}
T=$OUT
TAIL=${TAIL:-25}
. scripts/gpu_env.sh
ROOT=$PWD
TESTS=${AB_TESTS-tests/kernels/test_fused_gemv.py tests/kernels/test_nvfp4_mma.py -k "gpu and (qkv or converted)"}
MICRO=${AB_MICRO-$PY scripts/gpu_mma_qkv.py --pdl --launches 4x8x1,2x16x1,8x4x1,4x8x2}
[ -n "$TESTS" ] && eval "step tests ${AB_TESTS_S:-150} $PY -m pytest -q -p no:cacheprovider $TESTS"
[ -n "$MICRO" ] && eval "step micro ${AB_MICRO_S:-150} $MICRO"
FORMATS=${AB_FORMATS:-nvfp4}
BENCH="-m flintc bench --load-format dummy --config full --formats $FORMATS
  --contexts ${AB_CONTEXTS:-1024} --batches ${AB_BATCHES:-1,8} --prefill 1024 --prefill-iters 1
  --baselines none --builds $ROOT/gpu_builds --no-compile"
if [ -n "${AB_OLD:-}" ] && [ -d "$AB_OLD" ]; then
  OLD=$(cd "$AB_OLD" && pwd)
  step bench-old ${AB_BENCH_S:-120} env -C "$OLD" PYTHONPATH="$SITE:$OLD" $PY $BENCH --out "$OUT/bench-old"
fi
step bench-new ${AB_BENCH_S:-120} env PYTHONPATH="$SITE:$ROOT" $PY $BENCH --out "$OUT/bench-new"
step runtime 100 $PY scripts/gpu_runtime.py --builds gpu_builds --build-prefix full4 \
  --config gpu_builds/full4-config --formats "$FORMATS" --steps 24 --out "$OUT/runtime.md"
for f in ${FORMATS//,/ }; do
  step "profile-$f" 70 $PY scripts/gpu_decode_profile.py --build "gpu_builds/full-$f-b1" \
    --context 1024 --out "$OUT/profile-$f-1k.md"
done
echo "done after $(( $(date +%s) - START )) s"
