#!/usr/bin/env bash
# One H200 call (< 10 min): A/B of a kernel tuning knob that an environment variable sets
# ($AB_VAR, default FLINTC_MMA_TRIGGER: which CUDA kernels trigger PDL early; or
# FLINTC_MMA_GATE_UP_LAUNCH, ...), in one process per value so nothing is shared.
# Steps, each skipped when its variable is empty (`;` separates values):
#   AB_TESTS      pytest arguments, split as the shell would (quotes group words:
#                 AB_TESTS="tests/x.py -k 'a or b'"), run with $AB_VAR=$AB_TESTS_VALUE (default: the GPU
#                 tests of the CUDA kernels and of the read floor, with "all"), at most
#                 $AB_TESTS_S seconds (200)
#   AB_MICRO      a command run with the GPU Python's environment (e.g. `$PY
#                 scripts/gpu_nvfp4_mma.py` with its own variables), at most
#                 $AB_MICRO_S seconds (200); default none
#   AB_MOE        values for `benchmarks/bench_moe.py --pdl --no-sweep` (the first one
#                 with the read-floor rows; default "none;down")
#   AB_SETS       values for `flintc bench` (decode, contexts $AB_CONTEXTS, batches
#                 $AB_BATCHES, formats $AB_FORMATS; default "none;down;all;none")
#   AB_RUNTIME    the value for the 4-layer full-width runtime check (default all; "-":
#                 with the variable unset; empty: no check)
# An empty value in AB_MOE / AB_SETS ("" between `;`, or a leading / trailing `;`) or "-"
# means the variable unset; AB_MOE / AB_SETS empty skip the step. Needs gpu_builds/
# (docs/benchmarks.md "How to run": full-{fmt}-b1 and full-{fmt}; the bench takes the
# first batch-1 build it finds, restricted to the builds matching $AB_BUILD_GLOB when set,
# e.g. 'full-nvfp4*'). Logs in $AB_WORK (default /tmp/env_ab; emptied first, so an
# absolute path holding neither the repository nor $OUT); back in $OUT: moe.md, micro.log,
# tests.log and env_ab.tgz (all of that folder: every log, each bench's bench.md,
# bench.json and plots; at most 8 files come back from the device, so the rest is packed).
#
# AB_BUDGET_S (default 540) caps the whole call: a step gets what is left at most.
#
#   OUT=/some/dir [AB_VAR=...] [AB_SETS=...] bash scripts/gpu_env_ab.sh   # repo root
set -uo pipefail
START=${AB_START:-$(date +%s)}  # the whole call's start (AB_BUDGET_S below)
OUT=${OUT:-$PWD/env_ab_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1
LOG=/tmp/pip-env-ab.log
. scripts/gpu_env.sh
export PY PYTHONPATH PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
VAR=${AB_VAR:-FLINTC_MMA_TRIGGER}
FORMATS=${AB_FORMATS:-nvfp4,bf16}
WORK=${AB_WORK:-/tmp/env_ab}
case "$WORK" in  # emptied below: an absolute path that holds neither the repository nor $OUT
  /*[!/]*) case "$PWD/ $OUT/" in "${WORK%/}/"* | *" ${WORK%/}/"*)
    echo "AB_WORK=$WORK holds the repository or OUT: refusing to empty it" >&2; exit 1 ;; esac ;;
  *) echo "AB_WORK must be an absolute path other than /; got '$WORK'" >&2; exit 1 ;;
esac
rm -rf "$WORK" && mkdir -p "$WORK"  # a warm machine keeps /tmp: no earlier call's files
# `step NAME CAP_S CMD...` is gpu_env.sh's: each step gets min(CAP_S, what is left of
# the whole call's AB_BUDGET_S, default 540 s) and is skipped under 20 s, so one call
# never outlasts the device's 10-minute limit; logs in $WORK.
BUDGET=${AB_BUDGET_S:-540}
T=$WORK
envp() {  # envp VALUE: ENVP, the `env` words that set $VAR to VALUE (unset: empty or -)
  if [ -n "$1" ] && [ "$1" != - ]; then ENVP=(env "$VAR=$1"); else ENVP=(env -u "$VAR"); fi
}
values() {  # values TEXT: VALUES, TEXT split at `;`, empty fields (leading, trailing) kept
  VALUES=()
  local rest=$1
  while :; do
    VALUES+=("${rest%%;*}")
    [ "$rest" = "${rest#*;}" ] && break
    rest=${rest#*;}
  done
}
TESTS=${AB_TESTS-tests/kernels/test_nvfp4_mma.py tests/bench/test_read_floor.py}
if [ -n "$TESTS" ]; then
  envp "${AB_TESTS_VALUE-all}"
  eval "TEST_ARGS=($TESTS)" || exit 1
  TAIL=4 step tests "${AB_TESTS_S:-200}" "${ENVP[@]}" $PY -m pytest -q -p no:cacheprovider -m gpu \
    "${TEST_ARGS[@]}"
fi
cp "$WORK/tests.log" "$OUT/tests.log" 2>/dev/null
[ -n "${AB_MICRO:-}" ] && TAIL=60 step micro "${AB_MICRO_S:-200}" bash -c "$AB_MICRO"
cp "$WORK/micro.log" "$OUT/micro.log" 2>/dev/null
i=0
if [ -n "${AB_MOE-none;down}" ]; then
  values "${AB_MOE-none;down}"
  for t in "${VALUES[@]}"; do
    floor=--no-floor; [ $i = 0 ] && floor=
    envp "$t"
    TAIL=80 step "moe-$i" 150 "${ENVP[@]}" $PY benchmarks/bench_moe.py --pdl --no-sweep $floor \
      --formats "$FORMATS" --out "$WORK/moe-$i.md"
    echo "($VAR=$t)"; echo "($VAR=$t)" >>"$WORK/moe-$i.md"; i=$((i + 1))
  done
fi
cat "$WORK"/moe-*.md >"$OUT/moe.md" 2>/dev/null
BENCH="-m flintc bench --load-format dummy --config full --formats $FORMATS
  --contexts ${AB_CONTEXTS:-1024} --batches ${AB_BATCHES:-1,8} --prefill 1024
  --prefill-iters 1 --baselines none --builds gpu_builds --no-compile"
GLOB_ARGS=()  # quoted: the patterns must reach flintc bench unexpanded
[ -n "${AB_BUILD_GLOB:-}" ] && GLOB_ARGS=(--build-glob "$AB_BUILD_GLOB")
i=0
if [ -n "${AB_SETS-none;down;all;none}" ]; then
  values "${AB_SETS-none;down;all;none}"
  for t in "${VALUES[@]}"; do
    envp "$t"
    TAIL=0 step "bench-$i" 130 "${ENVP[@]}" $PY $BENCH "${GLOB_ARGS[@]}" --out "$WORK/bench-$i"
    echo "$VAR=$t"; grep -E '^\| (nvfp4|bf16) \| [0-9] \|' "$WORK/bench-$i.log"
    i=$((i + 1))
  done
fi
RT=${AB_RUNTIME-all}
if [ -n "$RT" ]; then
  envp "$RT"
  TAIL=3 step runtime 100 "${ENVP[@]}" $PY scripts/gpu_runtime.py --builds gpu_builds \
    --build-prefix full4d --config gpu_builds/full4-config --formats "$FORMATS" \
    --prompt-len 2600 --steps 16 --out "$WORK/runtime.md"
  grep -h "SUMMARY" "$WORK/runtime.log" 2>/dev/null
fi
tar czf "$OUT/env_ab.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")" \
  || echo "packing $WORK failed"
exit 0
