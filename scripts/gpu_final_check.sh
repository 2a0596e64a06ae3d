#!/usr/bin/env bash
# One H200 call (< 8 min): the checks to run after a kernel or runtime change lands.
#   1. scripts/gpu_prefill_graph.py: prefill from CUDA graphs against eager, bit for bit,
#      and timed at 8,192 tokens (both formats, the full-size -b1 builds);
#   2. benchmarks/bench_moe.py without the sweep at batch 1 (router and MoE kernels);
#   3. scripts/gpu_decode_time.py: the batch-1 decode step, 1K and 100K;
#   4. scripts/gpu_runtime.py on the full-width 4-layer builds (against the reference).
# Logs and tables in $OUT/final.tgz. Budget: FINAL_BUDGET_S (default 430 s).
#
#   OUT=/some/dir bash scripts/gpu_final_check.sh      # from the repository root
set -uo pipefail
START=$(date +%s)
BUDGET=${FINAL_BUDGET_S:-430}
OUT=${OUT:-$PWD/final_out}
mkdir -p "$OUT/final" || exit 1
OUT=$(cd "$OUT" && pwd)
T=$OUT/final
cd "$(dirname "$0")/.." || exit 1
LOG=$T/pip.log
. scripts/gpu_env.sh
TAIL=30 step prefill-graph 190 $PY scripts/gpu_prefill_graph.py --builds gpu_builds --formats nvfp4,bf16 \
  --iters 2 --out "$T/prefill-graph.md"
TAIL=12 step moe-bench 60 $PY benchmarks/bench_moe.py --pdl --batches 1 --no-sweep --out "$T/moe.md"
TAIL=8 step decode 50 $PY scripts/gpu_decode_time.py --builds gpu_builds --formats nvfp4,bf16 \
  --contexts 1024,100000 --out "$T/decode.md"
TAIL=8 step runtime 70 $PY scripts/gpu_runtime.py --builds gpu_builds --build-prefix full4 \
  --config gpu_builds/full4-config --formats nvfp4,bf16 --steps 24 --out "$T/runtime.md"
echo "done after $(( $(date +%s) - START )) s"
tar czf "$OUT/final.tgz" -C "$OUT" final && rm -rf "$T"
