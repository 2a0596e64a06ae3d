#!/usr/bin/env bash
# One H200 call (< 10 min): prefill with chunks longer than the sliding window (session
# 17). For each format in $PC_FORMATS (default nvfp4,bf16):
#   1. scripts/gpu_prefill_graph.py on gpu_builds/full-<fmt>-c$PC_GRAPH_CHUNK (2048):
#      both prefill graphs (the chunk and the 512-token tail) captured without changing
#      the caches, a $PC_PROMPT-token prompt (default 4700: 2048 + 2048 + 512 + 92 with
#      420 tokens of padding) graph against eager bit for bit, timings;
#   2. flintc bench (prefill $PC_PREFILL, default 1024,8192, and decode b1/1K) on each
#      build gpu_builds/full-<fmt>-c<C> for C in $PC_CHUNKS (default 512,2048,4096), each
#      build alone in a folder of links so that bench takes it.
# Builds: cross-compiled on the CPU (docs/benchmarks.md "How to run"):
#   flintc compile --config full --load-format dummy --format FMT --device cuda --no-check \
#     --no-dump --max-batch 1 --max-model-len 131072 --prefill-chunk C --out gpu_builds/full-FMT-cC
# Outputs in $OUT (at most 8 files come back): prefill_graph.md, prefill_bench.md (every
# bench.md one after the other), prefill_json.tgz (every bench.json), prefill.log.
#
#   OUT=/some/dir bash scripts/gpu_prefill_chunks.sh      # from the repository root
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-$PWD/prefill_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=/tmp/prefill_chunks_pip.log
. scripts/gpu_env.sh
export PYTHONPATH
FORMATS=${PC_FORMATS:-nvfp4,bf16}
CHUNKS=${PC_CHUNKS:-512,2048,4096}
PREFILL=${PC_PREFILL:-1024,8192}
FIRST=${PC_GRAPH_CHUNK:-2048}
WORK=/tmp/prefill_chunks
rm -rf "$WORK" && mkdir -p "$WORK" || exit 1
: > "$OUT/prefill_bench.md"
for f in ${FORMATS//,/ }; do
  echo "== $f: prefill graphs, chunk $FIRST ($(( $(date +%s) - START )) s in)"
  timeout 200 $PY scripts/gpu_prefill_graph.py --build "gpu_builds/full-$f-c$FIRST" --formats "$f" \
    --prompt-len "${PC_PROMPT:-4700}" --continue-len 100 --time-len 8192 --iters 3 \
    --out "$WORK/graph-$f.md" 2>&1 | tail -8
  echo "   exit ${PIPESTATUS[0]}"
  cat "$WORK/graph-$f.md" >> "$OUT/prefill_graph.md" 2>/dev/null
  for c in ${CHUNKS//,/ }; do
    echo "== $f: bench, chunk $c ($(( $(date +%s) - START )) s in)"
    mkdir -p "$WORK/builds-$f-$c"
    ln -sfn "$PWD/gpu_builds/full-$f-c$c" "$WORK/builds-$f-$c/full-$f-c$c"
    timeout 150 $PY -m flintc bench --load-format dummy --config full --formats "$f" --contexts 1024 \
      --batches 1 --prefill "$PREFILL" --prefill-iters 3 --baselines none --breakdown 1x1024 \
      --builds "$WORK/builds-$f-$c" --no-compile --no-plots --out "$WORK/bench-$f-$c" 2>&1 | tail -3
    echo "   exit ${PIPESTATUS[0]}"
    { echo; echo "<!-- $f, chunk $c -->"; cat "$WORK/bench-$f-$c/bench.md"; } >> "$OUT/prefill_bench.md" 2>/dev/null
  done
done
tar -czf "$OUT/prefill_json.tgz" -C "$WORK" $(cd "$WORK" && ls -d bench-*/bench.json 2>/dev/null)
echo "done after $(( $(date +%s) - START )) s"
