#!/usr/bin/env bash
# One H200 call (< 10 min): the PDL trigger modes of flintc.kernels.pdl compared on the
# full-size batch-1 builds (decode step time by CUDA-graph replay, FLINTC_PDL_TRIGGER=late
# then early), the one-step GEMV configurations swept under PDL, a correctness check of
# the early trigger (scripts/gpu_runtime.py on the full-width 4-layer builds), and the
# per-kernel profile with the early trigger. Outputs in $OUT/pdl-ab.
#
#   OUT=/some/dir bash scripts/gpu_pdl_ab.sh      # from the repository root
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-$PWD/pdl_out}
mkdir -p "$OUT/pdl-ab" || exit 1
OUT=$(cd "$OUT/pdl-ab" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=$OUT/pip.log
BUDGET=${PDL_AB_BUDGET_S:-560}
T=$OUT
TAIL=${TAIL:-25}
. scripts/gpu_env.sh
step decode-late 170 env FLINTC_PDL_TRIGGER=late $PY scripts/gpu_decode_time.py --builds gpu_builds \
  --formats nvfp4,bf16 --contexts 1024,100000 --out "$OUT/decode-late.md"
step decode-early 170 env FLINTC_PDL_TRIGGER=early $PY scripts/gpu_decode_time.py --builds gpu_builds \
  --formats nvfp4,bf16 --contexts 1024,100000 --out "$OUT/decode-early.md"
step runtime-early 110 env FLINTC_PDL_TRIGGER=early $PY scripts/gpu_runtime.py --builds gpu_builds \
  --build-prefix full4 --config gpu_builds/full4-config --formats nvfp4,bf16 --steps 24 --out "$OUT/runtime-early.md"
step gemv-onestep 150 env FLINTC_PDL_TRIGGER=early $PY benchmarks/bench_gemv.py --sweep --family one-step \
  --pdl --no-compile --batches 1 --cases qkv,o_proj+res --out "$OUT/gemv-onestep.md"
step profile-early 60 env FLINTC_PDL_TRIGGER=early $PY scripts/gpu_decode_profile.py \
  --build gpu_builds/full-nvfp4-b1 --context 1024 --out "$OUT/profile-nvfp4-1k.md"
echo "done after $(( $(date +%s) - START )) s"
