#!/usr/bin/env bash
# Cross-compile, on the CPU machine, the builds the GPU scripts read from gpu_builds/
# (git-ignored; carried to the GPU call with `carry: ["gpu_builds", ".whl"]`). Dummy
# weights on the meta device, no numeric checks (docs/benchmarks.md "How to run"):
#   full-{fmt}        buckets 1, 2, 4, 8    (flintc bench, batches 2-8)
#   full-{fmt}-b1     bucket 1              (flintc bench, batch 1)
#   full4-config/     the full model's first 4 layers (2 dense, sliding MoE, full MoE)
#   full4d-{fmt}-b1   those 4 layers, bucket 1 (scripts/gpu_runtime.py --build-prefix full4d)
#   fold-{fmt}, fold-{fmt}-b1, fold4d-{fmt}-b1: the same with --fold-attention-combine
#                     (scripts/gpu_attn_fold.sh)
#   split-{fmt}, split-{fmt}-b1, split4d-{fmt}-b1: the same with --split-lm-head-norm
#                     (the default since session 47, so the same as full-*; SETS=split)
#   fused-{fmt}, fused-{fmt}-b1, fused4d-{fmt}-b1: with --no-split-lm-head-norm (the
#                     fused norm_lm_head, the default before session 47; SETS=fused)
# Rebuild after any change to the passes or the generated runtime: a build keeps the
# graph of the code that compiled it (session 23's down-weights prefetch argument, for
# one, is only in builds compiled since). About 15 min on 2 cores.
#
#   [FORMATS="nvfp4 bf16"] [SETS="full fold"] bash scripts/gpu_builds.sh   # repo root
#   (SETS: any of full, fold, split, fused)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
mkdir -p gpu_builds/full4-config
$PY - <<'EOF'
import json
from flintc.config import FlintConfig

d = FlintConfig.preset("full").to_dict()
d.update(num_hidden_layers=4, layer_types=d["layer_types"][:4])
json.dump(d, open("gpu_builds/full4-config/config.json", "w"))
EOF
compile() {  # compile OUT ARGS...: replace gpu_builds/OUT
  local out=gpu_builds/$1; shift
  rm -rf "$out"
  $PY -m flintc compile --load-format dummy --device cuda --no-check --no-dump "$@" --out "$out"
}
for S in ${SETS:-full fold}; do
  FLAGS=()
  [ "$S" = fold ] && FLAGS=(--fold-attention-combine)
  [ "$S" = split ] && FLAGS=(--split-lm-head-norm)
  [ "$S" = fused ] && FLAGS=(--no-split-lm-head-norm)
  for F in ${FORMATS:-nvfp4 bf16}; do
    compile "$S-$F" --config full --format "$F" --max-batch 8 --max-model-len 131072 "${FLAGS[@]}"
    compile "$S-$F-b1" --config full --format "$F" --max-batch 1 --max-model-len 131072 "${FLAGS[@]}"
    compile "${S}4d-$F-b1" gpu_builds/full4-config --format "$F" --max-batch 1 \
      --max-model-len 131072 "${FLAGS[@]}"
  done
done
echo "gpu_builds: done"
