#!/usr/bin/env bash
# One call on a bare GPU machine (torch + triton preinstalled): install what is missing
# from carried wheels (.whl), then run the GPU smoke checks into $OUT.
set -euo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 scripts/gpu_smoke.py --out "${OUT:-.}" 2>&1 | tee "${OUT:-.}/gpu_smoke.log"
