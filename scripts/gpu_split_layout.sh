#!/usr/bin/env bash
# One H200 call (< 10 min): session 26's split layout of decode attention, which follows
# the visible rows (`flintc.ops.attention.split_layout`: at most N chunks of >= 64 rows)
# instead of cutting the whole cache into N chunks (docs/gpu-runs.md, session 26).
# Steps, logs in $WORK (default /tmp/split_layout), tails to stdout, everything packed
# into $OUT/split_layout.tgz:
#   tests      the decode attention GPU tests (and the padding rows')
#   micro-new  benchmarks/bench_decode_attention.py --short-only: full layers at 1K-8K
#              tokens in caches of 1,024-262,144 rows, several chunk layouts and launches
#   micro-old  the same benchmark on the previous code ($AB_OLD, default _ab_old: `git
#              archive` of the commit before, made before the call, with this tree's
#              benchmark copied in), when that folder exists
#   bench-*    flintc bench, NVFP4 1K, b1 / b8 (the full-nvfp4* builds): old, new,
#              new with FLINTC_DECODE_ATTN_MIN_ROWS=$MIN_ROWS (default 64), old
#   sampler    the one-launch sampler's chunk x warps sweep (gpu_sampler_profile.py
#              --launch-sweep), b1 / b8, this tree's then the old one's (with this
#              tree's script copied in)
#   check      the 4-layer full-width runtime check (scripts/gpu_runtime.py, full4d builds)
#              at a 2,600-token prompt: decode steps against the reference ops
# Caps within SPLIT_BUDGET_S (default 570 s); the tests first (the new layout's first GPU run),
# then the measurements.
#
#   git archive HEAD~1 | tar -x -C _ab_old; cp benchmarks/bench_decode_attention.py _ab_old/benchmarks/
#   cp scripts/gpu_sampler_profile.py _ab_old/scripts/
#   OUT=/some/dir bash scripts/gpu_split_layout.sh   # repo root; carry .whl, gpu_builds, _ab_old
set -uo pipefail
START=$(date +%s)
BUDGET=${SPLIT_BUDGET_S:-570}
OUT=${OUT:-$PWD/split_layout_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=/tmp/pip-split-layout.log
. scripts/gpu_env.sh  # PY, PYTHONPATH, the wheels; `step` (time-capped, logs in $T)
WORK=${AB_WORK:-/tmp/split_layout}
T=$WORK
BUILDS=${BUILDS:-gpu_builds}
ROOT=$PWD
OLD=${AB_OLD:-_ab_old}
MIN_ROWS=${MIN_ROWS:-64}
require_builds full-nvfp4 full-nvfp4-b1 || exit 1
rm -rf "$WORK" && mkdir -p "$WORK"
TAIL=4 step tests 100 $PY -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_decode_attention.py tests/kernels/test_pad_slot.py
TAIL=45 step micro-new 100 $PY benchmarks/bench_decode_attention.py --short-only \
  --out "$WORK/micro-new.md"
if [ -d "$OLD" ]; then
  OLD=$(cd "$OLD" && pwd)
  TAIL=45 step micro-old 100 env -C "$OLD" PYTHONPATH="$SITE:$OLD" $PY \
    benchmarks/bench_decode_attention.py --short-only --out "$WORK/micro-old.md"
fi
BENCH="-m flintc bench --load-format dummy --config full --formats nvfp4 --contexts 1024
  --batches 1,8 --prefill 1024 --prefill-iters 1 --baselines none --builds $ROOT/$BUILDS
  --no-compile --build-glob full-nvfp4*"
i=0
for set in old new "FLINTC_DECODE_ATTN_MIN_ROWS=$MIN_ROWS" old; do
  if [ "$set" = old ]; then
    [ -d "$OLD" ] || continue
    TAIL=0 step "bench-$i" 60 env -C "$OLD" PYTHONPATH="$SITE:$OLD" $PY $BENCH --out "$WORK/bench-$i"
  elif [ "$set" = new ]; then
    TAIL=0 step "bench-$i" 60 $PY $BENCH --out "$WORK/bench-$i"
  else
    TAIL=0 step "bench-$i" 60 env $set $PY $BENCH --out "$WORK/bench-$i"
  fi
  echo "code: $set"; grep -E '^\| nvfp4 \| [0-9] \|' "$WORK/bench-$i.log"
  grep -E '^\| (decode_attention|attention_combine) \|' "$WORK/bench-$i.log" | head -4
  i=$((i + 1))
done
TAIL=40 step sampler 70 $PY scripts/gpu_sampler_profile.py --batches 1,8 --launch-sweep \
  --out "$WORK/sampler.md"
if [ -d "$OLD" ]; then
  TAIL=40 step sampler-old 60 env -C "$OLD" PYTHONPATH="$SITE:$OLD" $PY \
    scripts/gpu_sampler_profile.py --batches 1,8 --launch-sweep --out "$WORK/sampler-old.md"
fi
TAIL=3 step check 80 $PY scripts/gpu_runtime.py --builds "$BUILDS" --build-prefix full4d \
  --config "$BUILDS/full4-config" --formats nvfp4 --prompt-len 2600 --steps 16 \
  --out "$WORK/check.md"
grep -h "SUMMARY" "$WORK/check.log" 2>/dev/null
cp "$WORK"/micro-*.md "$WORK"/sampler*.md "$OUT/" 2>/dev/null
tar czf "$OUT/split_layout.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")" || echo "packing $WORK failed"
exit 0
