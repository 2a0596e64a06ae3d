#!/usr/bin/env bash
# One H200 call (< 10 min): the prefill's fused norms / elementwise Triton kernels
# (flintc/kernels/prefill_norm.py, the fuse_add_rms_norm pass) and the prefill ladder
# (session 18), against builds of an earlier version. Steps, each time-capped:
#   1. tests: pytest -m gpu tests/kernels/test_prefill_norm.py (full-size kernel checks);
#   2. runtime: scripts/gpu_runtime.py, the 4-layer full-width check against the reference
#      on gpu_builds/$PF_CHECK_PREFIX-<fmt>-b1 with a $PF_CHECK_PROMPT-token prompt (default
#      6000: chunks 4096 + 1024 + 512 + 368 padded to 512);
#   3. graph: scripts/gpu_prefill_graph.py on gpu_builds/full-<fmt>-$PF_NEW (every prefill
#      size captured without changing the caches, graph against eager bit for bit);
#   4. bench: flintc bench, prefill $PF_PREFILL (default 1024,3000,6000,8192) and decode
#      b1/1K, for each build gpu_builds/full-<fmt>-<B>, B in $PF_BUILDS (default
#      "c2048 $PF_NEW"), each alone in a folder of links.
# Formats $PF_FORMATS (default nvfp4,bf16). Outputs in $OUT (at most 8 files come back):
# steps.log (every step's tail), tests.log, runtime.md, graph.md, bench.md (every bench.md
# in turn), bench_json.tgz.
#
#   OUT=/some/dir bash scripts/gpu_prefill_fusion.sh      # from the repository root
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-$PWD/prefill_fusion_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=/tmp/prefill_fusion_pip.log
BUDGET=${PF_BUDGET_S:-570}
T=/tmp/prefill_fusion
rm -rf "$T" && mkdir -p "$T" || exit 1
. scripts/gpu_env.sh
export PYTHONPATH
FORMATS=${PF_FORMATS:-nvfp4,bf16}
NEW=${PF_NEW:-cfus}
BUILDS=${PF_BUILDS:-c2048 $NEW}
{
  step tests "${PF_TESTS_S:-90}" $PY -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_prefill_norm.py
  step runtime "${PF_RUNTIME_S:-120}" $PY scripts/gpu_runtime.py --builds gpu_builds \
    --build-prefix "${PF_CHECK_PREFIX:-full4d}" --config gpu_builds/full4-config --formats "$FORMATS" \
    --prompt-len "${PF_CHECK_PROMPT:-6000}" --steps 16 --out "$OUT/runtime.md"
  for f in ${FORMATS//,/ }; do
    step "graph-$f" "${PF_GRAPH_S:-90}" $PY scripts/gpu_prefill_graph.py --build "gpu_builds/full-$f-$NEW" \
      --formats "$f" --prompt-len "${PF_GRAPH_PROMPT:-6000}" --continue-len 100 --time-len 8192 --iters 2 \
      --out "$T/graph-$f.md"
    cat "$T/graph-$f.md" >> "$OUT/graph.md" 2>/dev/null
  done
  : > "$OUT/bench.md"
  for f in ${FORMATS//,/ }; do
    for b in $BUILDS; do
      mkdir -p "$T/builds-$f-$b" && ln -sfn "$PWD/gpu_builds/full-$f-$b" "$T/builds-$f-$b/full-$f-$b"
      step "bench-$f-$b" "${PF_BENCH_S:-100}" $PY -m flintc bench --load-format dummy --config full \
        --formats "$f" --contexts 1024 --batches 1 --prefill "${PF_PREFILL:-1024,3000,6000,8192}" \
        --prefill-iters 2 --baselines none --builds "$T/builds-$f-$b" --no-compile --no-plots \
        --out "$T/bench-$f-$b"
      { echo; echo "<!-- $f, build full-$f-$b -->"; cat "$T/bench-$f-$b/bench.md"; } >> "$OUT/bench.md" 2>/dev/null
    done
  done
  echo "done after $(( $(date +%s) - START )) s"
} 2>&1 | tee "$OUT/steps.log"
cp "$T/tests.log" "$OUT/tests.log" 2>/dev/null
tar -czf "$OUT/bench_json.tgz" -C "$T" $(cd "$T" && ls -d bench-*/bench.json 2>/dev/null) 2>/dev/null
