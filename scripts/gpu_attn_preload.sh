#!/usr/bin/env bash
# One H200 call (< 10 min): the decode attention's early reads (FLINTC_DECODE_ATTN_PRELOAD,
# `decode_attention.preload_enabled`), written in session 23; session 25 ran this call and
# measured them slower, so they stay off (docs/gpu-runs.md, session 25, run 4).
# With them each program reads slots, positions and its first block of K / V rows before
# the PDL wait, and the current token's row again after it.
# Steps (`scripts/gpu_env_ab.sh`): the decode attention GPU tests (the preload cases turn
# it on themselves; the others run with the variable unset), then the NVFP4 model at 1K
# and 100K, b1 / b8, 0 then 1 (one alternation: the call must stay under 10 min), and the
# 4-layer full-width check with 1.
#
#   OUT=/some/dir bash scripts/gpu_attn_preload.sh   # repo root; needs gpu_builds/
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
AB_VAR=FLINTC_DECODE_ATTN_PRELOAD \
AB_TESTS="tests/kernels/test_decode_attention.py -k 'preload or cuda_graph or B1 or ring'" \
AB_TESTS_VALUE=- AB_TESTS_S=150 AB_MICRO="" AB_MOE="" AB_SETS="0;1" \
AB_FORMATS=nvfp4 AB_CONTEXTS=1024,100000 AB_BATCHES=1,8 AB_BUILD_GLOB='full-nvfp4*' \
AB_RUNTIME=1 bash scripts/gpu_env_ab.sh
