#!/usr/bin/env bash
# One H200 call (< 10 min): where the decode kernels' time goes.
#   1. Nsight Compute (`ncu --set full`, clocks left alone) over one launch of each case of
#      scripts/gpu_ncu.py (GEMVs, fused QKV, MoE kernels, LM head, cuBLAS's GEMV and a
#      pure-read kernel of the same bytes), weights read from DRAM (ncu flushes the caches);
#      the report (.ncu-rep), its details page and the SASS source page with stall samples.
#   2. benchmarks/bench_gemv.py with weights rotated (read from DRAM), PDL on, batches 1
#      and 8, and the one-step sweep of the QKV / O-projection cases at batch 1.
#   3. `flintc bench` at batch 1 / 262K with a prefill of 8,192 tokens (peak memory
#      without the scratch slot; the prefill per-kernel breakdown), no baselines.
# Everything is packed into $OUT/profile.tgz at the end (the device tool returns at
# most 8 files).
#
#   OUT=/some/dir bash scripts/gpu_profile.sh       # from the repository root
#   PROFILE_STEPS=ncu,gemv,sweep,bench  PROFILE_BUDGET_S=560  PROFILE_NCU_CASES=a,b
set -uo pipefail
START=$(date +%s)
BUDGET=${PROFILE_BUDGET_S:-560}
STEPS=${PROFILE_STEPS:-ncu,gemv,sweep,bench}
OUT=${OUT:-$PWD/profile_out}
mkdir -p "$OUT/profile" || exit 1
OUT=$(cd "$OUT" && pwd)
T=$OUT/profile
cd "$(dirname "$0")/.." || exit 1
LOG=$T/pip.log
. scripts/gpu_env.sh
has() { [[ ",$STEPS," == *",$1,"* ]]; }
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
if has ncu; then
  if [ -z "$NCU" ]; then echo "ncu not found"; else
    TAIL=4 step ncu 200 "$NCU" --clock-control none --profile-from-start off --set full \
      --import-source yes -f -o "$T/decode" $PY scripts/gpu_ncu.py --cases "${PROFILE_NCU_CASES:-}"
    TAIL=2 step ncu-details 60 "$NCU" --import "$T/decode.ncu-rep" --print-details all
    TAIL=2 step ncu-source 60 "$NCU" --import "$T/decode.ncu-rep" --page source --csv --print-source sass
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Block Size|Grid Size|Stall" \
      "$T/ncu-details.log" | head -n 250 > "$T/ncu-summary.txt"
    head -n 120 "$T/ncu-summary.txt"
  fi
fi
has gemv && TAIL=40 step gemv-dram 170 $PY benchmarks/bench_gemv.py --pdl --no-compile --batches 1,8 \
  --out "$T/gemv-dram.md"
has sweep && TAIL=12 step gemv-sweep 130 $PY benchmarks/bench_gemv.py --pdl --no-compile --sweep \
  --family all --batches 1 --cases o_proj+res,qkv --out "$T/gemv-sweep.md" --tuned-json "$T/gemv-sweep.json"
if has bench; then
  t=$(left)
  if [ "$t" -gt 120 ]; then
    echo "== flintc bench (budget $(( t - 25 )) s)"
    BENCH_BUDGET_S=$(( t - 25 )) BENCH_FORMATS=nvfp4,bf16 BENCH_CONTEXTS=262144 BENCH_BATCHES=1 \
      BENCH_PREFILL=8192 BENCH_PREFILL_ITERS=1 BENCH_ARGS="--baselines none" OUT=$T \
      bash scripts/gpu_bench.sh > "$T/bench-run.log" 2>&1
    echo "   exit $?"; grep -E "^\| (nvfp4|bf16) \||peak|prefill|Prefill" "$T/bench/bench.md" | head -n 40
  else
    echo "== flintc bench: skipped ($t s left)"
  fi
fi
echo "done after $(( $(date +%s) - START )) s"
find "$T" -type f -size +12M -print -delete
tar czf "$OUT/profile.tgz" -C "$OUT" profile && rm -rf "$T"
ls -la "$OUT"
