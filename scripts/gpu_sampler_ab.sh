#!/usr/bin/env bash
# One H200 call (< 10 min): the one-launch sampler (FLINTC_SAMPLER=triton,
# `flintc.kernels.sampler`), written in session 24; session 25 ran this call and it paid,
# so it is the default on CUDA since (docs/gpu-runs.md, session 25, run 2). The A/B still
# sets FLINTC_SAMPLER=torch / triton explicitly.
# Steps (`scripts/gpu_env_ab.sh`, AB_VAR=FLINTC_SAMPLER):
#   tests   the sampler's GPU tests (the full vocabulary against the kernel's rule) and
#           tests/test_sampling.py, with FLINTC_SAMPLER=triton
#   micro   scripts/gpu_sampler_profile.py (host time alone and after 2 ms of device
#           work, the kernels), then scripts/gpu_e2e_overhead.py at batch 1 and 8 (decode
#           + default sampling + token read against the replay), torch then triton
#   bench   flintc bench, NVFP4 1K, b1 / b8 (its end-to-end column samples with Flint's
#           defaults), torch then triton
# Limits (tests 100 s, micro 200 s, two bench sets of at most 130 s) keep it under 10 min.
# Needs gpu_builds/ (`bash scripts/gpu_builds.sh`).
#
#   OUT=/some/dir bash scripts/gpu_sampler_ab.sh   # repo root; carry .whl and gpu_builds
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
MICRO='for v in torch triton; do echo "== FLINTC_SAMPLER=$v";
  FLINTC_SAMPLER=$v $PY scripts/gpu_sampler_profile.py --batches 1,8 --iters 50;
  FLINTC_SAMPLER=$v $PY scripts/gpu_e2e_overhead.py --build gpu_builds/full-nvfp4-b1 --batch 1;
  FLINTC_SAMPLER=$v $PY scripts/gpu_e2e_overhead.py --build gpu_builds/full-nvfp4 --batch 8; done'
AB_VAR=FLINTC_SAMPLER AB_TESTS="tests/kernels/test_sampler.py tests/test_sampling.py -m 'gpu or not gpu'" \
AB_TESTS_VALUE=triton AB_TESTS_S=100 AB_MICRO="$MICRO" AB_MICRO_S=200 AB_MOE="" \
AB_SETS="torch;triton" AB_FORMATS=nvfp4 AB_CONTEXTS=1024 AB_BATCHES=1,8 \
AB_BUILD_GLOB='full-nvfp4*' AB_RUNTIME="" bash scripts/gpu_env_ab.sh
