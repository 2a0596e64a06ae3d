#!/usr/bin/env bash
# Download, on the CPU machine (the package registries reachable), the wheels the GPU
# scripts install from .whl/ (git-ignored; carried to the GPU call with
# `carry: [".whl", ...]`; the GPU machine has torch + triton and no network). The list
# and the reasons for it: docs/benchmarks.md "How to run". About 38 MB; replaces .whl/
# (older versions left beside new ones make `pip install --no-deps` refuse the set).
#
#   bash scripts/gpu_wheels.sh   # repo root
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl.new
WHL=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux_2_28_x86_64 --platform any -d .whl.new)
for p in matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing "python-dateutil<3" six \
         packaging tqdm pyyaml pytest-xdist execnet gguf pydot pytest pluggy iniconfig \
         hypothesis sortedcontainers attrs httpx httpcore certifi distro; do
  pip download -q "$p" "${WHL[@]}" --no-deps
done
pip download -q fastapi uvicorn openai prometheus_client jsonschema "${WHL[@]}"
# llguidance (structured outputs): an abi3 wheel for glibc 2.31
pip download -q llguidance --only-binary=:all: --python-version 3.12 --implementation cp \
     --abi abi3 --platform manylinux_2_31_x86_64 --no-deps -d .whl.new
# fastapi's dependencies may pull python-dateutil 4.x (needs tzdata) back in: keep 2.x
for f in .whl.new/python_dateutil-[3-9]*.whl; do [ -e "$f" ] && rm -f "$f"; done
rm -rf .whl && mv .whl.new .whl
echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"
