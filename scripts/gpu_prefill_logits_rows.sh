#!/usr/bin/env bash
# One GPU call (< 9 min; session 31): the prefill functions' LM head on the last real
# row only (`logits_rows`, build_version 2) against the code before it (every row's fp32
# logits [C, V]), NVFP4 full model, dummy weights, batch-1 builds:
#   1. new code, gpu_builds/full-nvfp4-b1 (build_version 2): scripts/gpu_prefill_graph.py
#      (graph against eager bit-identical, logits of every prompt row and the KV cache;
#      prefill of --prompt-len and 8,192 tokens timed, graphs off / on), then the peak
#      memory of an 8K prefill from graphs (every captured size's pool);
#   2. the same with the code before (a `git archive` of it in gpu_builds/old-src) on the
#      builds it compiled (gpu_builds/old/full-nvfp4-b1, build_version 1);
#   3. new code: the 4-layer full-width check against the reference model
#      (scripts/gpu_runtime.py, builds gpu_builds/full4d-{nvfp4,bf16}-b1), whose prefill
#      step compares the compiled prefill's last-token logits (and router choices).
# Make the inputs on the CPU machine first:
#   rm -rf gpu_builds/old-src && mkdir -p gpu_builds/old-src gpu_builds/old
#   git archive <old commit> flintc scripts benchmarks | tar -x -C gpu_builds/old-src
#   cp -r <old full-nvfp4-b1 build> gpu_builds/old/   # compiled by the old code
#   bash scripts/gpu_builds.sh  (SETS=full; or by hand: full-nvfp4-b1, full4d-*-b1)
# carry: .whl gpu_builds/full-nvfp4-b1 gpu_builds/full4d-nvfp4-b1 gpu_builds/full4d-bf16-b1
#        gpu_builds/full4-config gpu_builds/old gpu_builds/old-src
#
# STEPS (default "new_graph new_peak old_graph old_peak runtime4") picks the steps;
# RUNTIME_FORMATS (default nvfp4,bf16) the 4-layer check's formats; TOTAL_S (default 520)
# the seconds from the start by which the last step (runtime4) must end.
#
#   OUT=/some/dir [STEPS="new_graph runtime4"] bash scripts/gpu_prefill_logits_rows.sh   # repo root
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-$PWD/logits_rows_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=$OUT/pip.log
. scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
NEW_PATH=$PYTHONPATH
OLD_PATH=${PYTHONPATH/$PWD/$PWD/gpu_builds/old-src}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

STEPS=" ${STEPS:-new_graph new_peak old_graph old_peak runtime4} "
step() {  # step NAME LIMIT_S CMD...: only the steps STEPS names
  local name=$1 limit=$2; shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  echo "== $name ($(( $(date +%s) - START )) s in, cap $limit s)"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "   exit $? after $(( $(date +%s) - START )) s"
  grep -E '^\|' "$OUT/$name.log" | tail -n 20
}

PEAK='import sys, torch
from flintc.runtime.compiled import load_build
r = load_build(sys.argv[1], load_format="dummy", device="cuda", progress=False)
for c in sorted(r.prefill_sizes):
    r.prefill_graph(c)
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
r.prefill(0, list(range(8192)))
torch.cuda.synchronize()
print(f"| {sys.argv[1]} | sizes {sorted(r.prefill_sizes)} | after capture + 8K prefill: allocated "
      f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB, "
      f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB |")'

# a file, not `python -c`: -c puts the working directory (this checkout's flintc) first on
# sys.path, ahead of PYTHONPATH's old tree
printf '%s\n' "$PEAK" >"$OUT/peak.py"
PYTHONPATH=$NEW_PATH step new_graph 150 $PY scripts/gpu_prefill_graph.py --builds gpu_builds \
  --formats nvfp4 --out "$OUT/new_graph.md"
PYTHONPATH=$NEW_PATH step new_peak 70 $PY "$OUT/peak.py" gpu_builds/full-nvfp4-b1
PYTHONPATH=$OLD_PATH step old_graph 150 $PY gpu_builds/old-src/scripts/gpu_prefill_graph.py \
  --builds gpu_builds/old --formats nvfp4 --out "$OUT/old_graph.md"
PYTHONPATH=$OLD_PATH step old_peak 70 $PY "$OUT/peak.py" gpu_builds/old/full-nvfp4-b1
LEFT=$(( ${TOTAL_S:-520} - ($(date +%s) - START) ))
(( LEFT > 30 )) && PYTHONPATH=$NEW_PATH step runtime4 "$LEFT" $PY scripts/gpu_runtime.py --builds gpu_builds \
  --build-prefix full4d --config gpu_builds/full4-config --formats "${RUNTIME_FORMATS:-nvfp4,bf16}" --prompt-len 2600 \
  --steps 8 --out "$OUT/runtime4.md"
echo "done after $(( $(date +%s) - START )) s"
