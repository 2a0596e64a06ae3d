#!/usr/bin/env bash
# One H200 call (< 10 min): the combine folded into the decode attention kernel
# (`decode_attention_combine`, `flintc compile --fold-attention-combine`), written in
# session 24; session 25 ran this call and measured it slower, so it stays off
# (docs/gpu-runs.md, session 25, run 3). With it the last busy program of each
# (sequence, KV head) merges the splits with the sinks: one kernel less per layer
# (294 per forward instead of 343).
# Steps, logs in $WORK (default /tmp/attn_fold), tails to stdout, everything packed into
# $OUT/attn_fold.tgz:
#   tests   the decode attention GPU tests of the fused launch (the model's shapes: 1K and
#           100K in a 262,144-row cache, B = 8 mixed, the rings) and of CUDA-graph replays
#           (both paths), at most 100 s
#   route   the prefill routing kernel's tests (`route_topk_rows`, at 4,096 tokens too)
#   micro   benchmarks/bench_decode_attention.py key rows: "attn+combine us" (two
#           launches) against "fused us" (one), B = 1 / 8, 1K-100K and the ring; and the
#           ring with one program per split at B = 1 / 8 (`--sweep-ring-only`)
#   model   flintc bench, NVFP4, 1K, b1 / b8: the full-nvfp4* builds against the
#           fold-nvfp4* builds, alternated twice (the forward; 100K is the micro's)
# Limits (100 + 60 + 150 + 4 x 80 + 80 s = 710 s) are caps, within a budget of 540 s for
# the whole call (FOLD_BUDGET_S; `step` of scripts/gpu_env.sh); the steps' expected times
# are about 540 s. The bench's prefill row (1,024 tokens) is the
# first timing of the prefill routing kernel (against session 22 run 4's 44.8 ms NVFP4).
#   check   the 4-layer full-width runtime check of the fold4d NVFP4 build
# Needs the builds of `bash scripts/gpu_builds.sh` in $BUILDS (default gpu_builds: full-*,
# fold-*, fold4d-*, full4-config).
#
#   OUT=/some/dir bash scripts/gpu_attn_fold.sh   # repo root; carry .whl and gpu_builds
set -uo pipefail
START=$(date +%s)
BUDGET=${FOLD_BUDGET_S:-540}  # the whole call: each step gets min(its cap, what is left)
OUT=${OUT:-$PWD/attn_fold_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=/tmp/pip-attn-fold.log
. scripts/gpu_env.sh  # PY, PYTHONPATH, the wheels; `step` (time-capped, logs in $T)
WORK=${AB_WORK:-/tmp/attn_fold}
T=$WORK
BUILDS=${BUILDS:-gpu_builds}
require_builds full-nvfp4 full-nvfp4-b1 fold-nvfp4 fold-nvfp4-b1 fold4d-nvfp4-b1 || exit 1
rm -rf "$WORK" && mkdir -p "$WORK"
TAIL=4 step tests 100 $PY -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_decode_attention.py \
  -k "(combine_gpu and (1K-context or 100K or B8-mixed or ring)) or cuda_graph"
# (and the prefill chunk's routing kernel, on by default since session 24, unmeasured)
TAIL=3 step route 60 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_moe_kernels.py \
  -k route_topk_rows
TAIL=30 step micro 150 $PY benchmarks/bench_decode_attention.py --no-full-table --sweep-s 30 \
  --sweep-ring-only --out "$WORK/micro.md"
BENCH="-m flintc bench --load-format dummy --config full --formats nvfp4 --contexts 1024
  --batches 1,8 --prefill 1024 --prefill-iters 1 --baselines none --builds $BUILDS --no-compile"
i=0
for glob in 'full-nvfp4*' 'fold-nvfp4*' 'full-nvfp4*' 'fold-nvfp4*'; do
  TAIL=0 step "bench-$i" 80 $PY $BENCH --build-glob "$glob" --out "$WORK/bench-$i"
  echo "builds $glob"; grep -E '^\| nvfp4 \| [0-9] \|' "$WORK/bench-$i.log"
  grep -E '^\| (decode_attention|attention_combine|decode_attention_combine) \|' "$WORK/bench-$i.log" | head -6
  i=$((i + 1))
done
TAIL=3 step check 80 $PY scripts/gpu_runtime.py --builds "$BUILDS" --build-prefix fold4d \
  --config "$BUILDS/full4-config" --formats nvfp4 --prompt-len 2600 --steps 16 \
  --out "$WORK/check.md"
grep -h "SUMMARY" "$WORK/check.log" 2>/dev/null
cp "$WORK/micro.md" "$OUT/" 2>/dev/null
tar czf "$OUT/attn_fold.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")" || echo "packing $WORK failed"
exit 0
