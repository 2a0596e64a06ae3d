#!/usr/bin/env bash
# One H200 call (< 8 min): session 25's follow-up of the ring sweep and the MoE gate/up
# micro (docs/gpu-runs.md, session 25). Steps, logs in $WORK (default /tmp/ring_launch),
# tails to stdout, everything packed into $OUT/ring_launch.tgz:
#   tests   the decode attention GPU tests of the rings (the `ring_launch` candidates too)
#           and of CUDA-graph replays, and the sampler's GPU tests with the default
#           backend (FLINTC_SAMPLER unset: the one launch since session 25)
#   micro   benchmarks/bench_decode_attention.py --sweep-ring-only: the ring's launches at
#           B = 1-16 (BLOCK_S, warps, stages; one program per split or the one-wave count)
#   model   flintc bench, NVFP4 1K, b1-b8 (the full-nvfp4* builds): the defaults,
#           FLINTC_DECODE_ATTN_RING_LAUNCH=$RING (default 2=32,2,2,1), FLINTC_MMA_GATE_UP_LAUNCH=
#           $GATE_UP (default nvfp4:4=2,1,0/nvfp4:8=2,1,0), the defaults again
# Caps (90 + 130 + 4 x 80 s) within a budget of RING_BUDGET_S (default 480 s); AB_WORK
# sets the log folder.
#
#   OUT=/some/dir bash scripts/gpu_ring_launch.sh   # repo root; carry .whl and gpu_builds
set -uo pipefail
START=$(date +%s)
BUDGET=${RING_BUDGET_S:-480}
OUT=${OUT:-$PWD/ring_launch_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=/tmp/pip-ring-launch.log
. scripts/gpu_env.sh  # PY, PYTHONPATH, the wheels; `step` (time-capped, logs in $T)
WORK=${AB_WORK:-/tmp/ring_launch}
T=$WORK
BUILDS=${BUILDS:-gpu_builds}
RING=${RING:-2=32,2,2,1}
GATE_UP=${GATE_UP:-nvfp4:4=2,1,0/nvfp4:8=2,1,0}
require_builds full-nvfp4 full-nvfp4-b1 || exit 1
rm -rf "$WORK" && mkdir -p "$WORK"
TAIL=4 step tests 90 env -u FLINTC_SAMPLER $PY -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_decode_attention.py tests/kernels/test_sampler.py tests/test_sampling.py \
  -k "(decode_attention_gpu and ring) or cuda_graph or sampler or sampling"
TAIL=60 step micro 130 $PY benchmarks/bench_decode_attention.py --no-full-table --sweep-s 70 \
  --sweep-ring-only --out "$WORK/micro.md"
BENCH="-m flintc bench --load-format dummy --config full --formats nvfp4 --contexts 1024
  --batches 1,2,4,8 --prefill 1024 --prefill-iters 1 --baselines none --builds $BUILDS
  --no-compile --build-glob full-nvfp4*"
i=0
for set in "" "FLINTC_DECODE_ATTN_RING_LAUNCH=$RING" "FLINTC_MMA_GATE_UP_LAUNCH=$GATE_UP" ""; do
  TAIL=0 step "bench-$i" 80 env $set $PY $BENCH --out "$WORK/bench-$i"
  echo "settings: ${set:-defaults}"; grep -E '^\| nvfp4 \| [0-9] \|' "$WORK/bench-$i.log"
  grep -E '^\| (decode_attention|moe_topk_gate_up) \|' "$WORK/bench-$i.log" | head -4
  i=$((i + 1))
done
cp "$WORK/micro.md" "$OUT/" 2>/dev/null
tar czf "$OUT/ring_launch.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")" || echo "packing $WORK failed"
exit 0
