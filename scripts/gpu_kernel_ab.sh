#!/usr/bin/env bash
# Kernel-alone A/B of a kernel change (one GPU call, a few minutes): `bench_gemv.py` and
# `bench_moe.py` (PDL on, no torch.compile columns, no sweep, no read floor) run on the
# code in $AB_OLD (a `git archive` of the commit before the change: `mkdir _ab_old &&
# git archive HEAD flintc benchmarks scripts | tar -x -C _ab_old`, made before the call)
# and on this tree, in the order old, new, old, new ($KAB_ROUNDS rounds, default 2), each
# run in its own process, so the spread between rounds shows the noise. Writes
# $OUT/kab/{gemv,moe}-{old,new}-ROUND.md (and .log) and prints a table of flintc's us per
# call for each (case, format, N): old and new of every round.
#
#   KAB_GEMV     bench_gemv.py arguments (default: the residual GEMVs of the model, both
#                formats, N = 1 and 8)
#   KAB_MOE      bench_moe.py arguments (default: both formats, N = 1, 2, 8); empty skips it
#   KAB_CAP_S    seconds per benchmark run (default 90)
#   KAB_ENV_OLD, KAB_ENV_NEW  environment settings (`VAR=value` words) for the old / new
#                runs: with AB_OLD=. both run this tree, so a knob's A/B is e.g.
#                AB_OLD=. KAB_ENV_NEW="FLINTC_MMA_EARLY_EPILOGUE=all"
#
#   OUT=/some/dir AB_OLD=_ab_old bash scripts/gpu_kernel_ab.sh   # from the repository root
set -uo pipefail
OUT=${OUT:-$PWD/kab_out}
mkdir -p "$OUT/kab" || exit 1
OUT=$(cd "$OUT/kab" && pwd)
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
LOG=$OUT/pip.log
. scripts/gpu_env.sh
OLD=${AB_OLD:-}
if [ -z "$OLD" ] || [ ! -f "$OLD/benchmarks/bench_gemv.py" ]; then
  echo "AB_OLD must name a folder holding the old commit's flintc/ and benchmarks/ (got '${OLD}')" >&2
  exit 2
fi
OLD=$(cd "$OLD" && pwd)
GEMV=${KAB_GEMV-"--formats nvfp4,bf16 --batches 1,8 --cases o_proj+res,down+res"}
MOE=${KAB_MOE-"--formats nvfp4,bf16 --batches 1,2,8"}
CAP=${KAB_CAP_S:-90}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
for r in $(seq 1 "${KAB_ROUNDS:-2}"); do
  for v in old new; do
    tree=$ROOT; envs=${KAB_ENV_NEW:-}
    [ "$v" = old ] && { tree=$OLD; envs=${KAB_ENV_OLD:-}; }
    if [ -n "$GEMV" ]; then
      # shellcheck disable=SC2086  # the arguments are words
      (cd "$tree/benchmarks" && env $envs PYTHONPATH="$SITE:$tree" timeout "$CAP" $PY bench_gemv.py --pdl \
        --no-compile $GEMV --out "$OUT/gemv-$v-$r.md" > "$OUT/gemv-$v-$r.log" 2>&1)
      rc=$?; echo "gemv $v round $r: exit $rc"; [ $rc -eq 0 ] || status=1
    fi
    if [ -n "$MOE" ]; then
      # shellcheck disable=SC2086
      (cd "$tree/benchmarks" && env $envs PYTHONPATH="$SITE:$tree" timeout "$CAP" $PY bench_moe.py --pdl \
        --no-sweep --no-floor --no-compile $MOE --out "$OUT/moe-$v-$r.md" > "$OUT/moe-$v-$r.log" 2>&1)
      rc=$?; echo "moe $v round $r: exit $rc"; [ $rc -eq 0 ] || status=1
    fi
  done
done
$PY scripts/kernel_ab_table.py "$OUT" --out "$OUT/table.md" || status=1
exit $status
