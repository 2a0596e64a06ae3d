#!/usr/bin/env bash
# One call on a bare GPU machine (torch + triton preinstalled): install what is missing
# from carried wheels (.whl/*.whl, exactly as scripts/gpu_run.sh does), run every GPU
# kernel test at full shapes (`pytest -m gpu tests/kernels`) and every
# benchmarks/bench_*.py (each with --out $OUT/<name>.md), and write $OUT/kernels.md:
# the pytest summary and all benchmark tables, one section per step.
#
# Each step runs under `timeout`; the timeouts share a budget so that the whole call
# ends within KERNELS_BUDGET_S seconds (default 530, under 9 minutes). A failing or
# timed-out step is recorded in kernels.md and the script goes on. Logs: $OUT/*.log.
# Exit status: 0 when every step passed, 1 otherwise (kernels.md is written either way).
#
# The tests run in KERNELS_PYTEST_WORKERS pytest-xdist processes (default 6) when xdist
# imports (carry its wheels in .whl/: pytest_xdist, execnet), else in one. Session 30 (an
# H100, 80 GB): 6-10 workers ran the 547 GPU tests in about 6 min; 14 ran out of GPU
# memory in the prefill MoE tests at the end, and so did 8 in session 34 (9 of the prefill
# GEMM / norm tests, which then passed in 2 workers), and 6 in session 43 (6 prefill MoE
# GEMM tests, which passed in 2): keep 6 on an 80 GB card. When a test fails out of
# memory, the failed tests run again in one process and their outcome there counts (the
# report shows both). 1 runs them all in one process. Session 43 (an H100): the whole
# tests/kernels took over 7 minutes in 6 workers (494 passed when cut at 430 s, the rest
# in a second call), so run the tests and the benchmarks in separate calls
# (KERNELS_PYTEST_S=540 KERNELS_BUDGET_S=580 KERNELS_BENCHES=bench_pdl.py for the tests).
#
# When the tests are cut by their cap, the tests not reached (collected, with no outcome
# in the log: never started or still running) are written to $OUT/pytest_gpu_unrun.txt,
# one node id per line; copy it into the repository and pass it as KERNELS_TESTS_FILE
# (one pytest argument per line, so node ids with spaces stay whole) to run just those
# next call (session 46: 27 tests after a 520 s cut).
#
# Narrower runs: KERNELS_TESTS (pytest arguments, default `tests/kernels`) or
# KERNELS_TESTS_FILE (a file of pytest arguments, one per line; # starts a comment) and
# KERNELS_BENCHES (`;`-separated benchmark invocations relative to benchmarks/, default
# every bench_*.py with no options), e.g. a tuning call:
#   KERNELS_TESTS="tests/kernels/test_tiles.py tests/kernels/test_gemv.py" \
#   KERNELS_BENCHES="bench_gemv.py --sweep --no-compile --batches 1,8;bench_moe.py --batches 1,8" \
#   OUT=/some/dir bash scripts/gpu_kernels.sh
#
#   OUT=/some/dir bash scripts/gpu_kernels.sh        # from the repository root
set -uo pipefail

START=$(date +%s)
BUDGET=${KERNELS_BUDGET_S:-530}
PYTEST_CAP=${KERNELS_PYTEST_S:-240}
WORKERS=${KERNELS_PYTEST_WORKERS:-6}
BENCH_CAP=${KERNELS_BENCH_S:-200}
MIN_BENCH_S=${KERNELS_MIN_BENCH_S:-45}
RESERVE=10  # seconds kept for writing the report
OUT=${OUT:-$PWD/kernels_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)  # absolute: the steps run from the repository root
REPORT="$OUT/kernels.md"
PY=${PYTHON:-python3}
FAILED=0

cd "$(dirname "$0")/.." || exit 1

if ls .whl/*.whl >/dev/null 2>&1; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1; then
    echo "installed carried wheels into /tmp/site"
  else
    echo "pip install of .whl/*.whl failed (see pip.log); going on"; FAILED=1
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the GPU tests need the real compiler

left() {  # seconds left for steps
  echo $(( BUDGET - RESERVE - ($(date +%s) - START) ))
}

run_step() {  # run_step NAME TIMEOUT_S CMD...: log to $OUT/NAME.log; sets STATUS
  local name=$1 limit=$2; shift 2
  if (( limit < 5 )); then
    STATUS="skipped: no time left in the ${BUDGET} s budget"; FAILED=1
    echo "$STATUS" >"$OUT/$name.log"
    echo "== $name: $STATUS"; return
  fi
  echo "== $name (timeout ${limit} s): $*"
  local t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if (( rc == 0 )); then
    STATUS="ok (${dt} s)"
  elif (( rc == 124 || rc == 137 )); then
    STATUS="TIMED OUT after ${limit} s"; FAILED=1
  else
    STATUS="FAILED, exit status $rc (${dt} s)"; FAILED=1
  fi
  echo "   $STATUS"
  tail -n 5 "$OUT/$name.log" | sed 's/^/   | /'
}

{
  echo "# GPU kernel tests and benchmarks"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'none found (nvidia-smi failed)')"
  echo "- software: $($PY -c 'import torch, triton; print("torch", torch.__version__, "(CUDA", str(torch.version.cuda) + ")", "triton", triton.__version__, "cuda available:", torch.cuda.is_available())' 2>&1 | tail -n 1)"
  echo "- budget: ${BUDGET} s; pytest cap ${PYTEST_CAP} s, benchmark cap ${BENCH_CAP} s each"
} >"$REPORT.head"
if ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "- WARNING: no CUDA GPU visible to torch: the GPU tests skip and the benchmarks fail" \
    >>"$REPORT.head"
  FAILED=1
fi
cat "$REPORT.head"

# 1. GPU kernel tests at full shapes (-v: a test's outcome is logged as it ends, so a run
# cut by its cap still says which tests passed).
T=$(left); (( T > PYTEST_CAP )) && T=$PYTEST_CAP
XDIST=()
if (( WORKERS > 1 )) && $PY -c 'import xdist' 2>/dev/null; then
  XDIST=(-n "$WORKERS" -p no:benchmark)
fi
FAILED_BEFORE=$FAILED
if [[ -n ${KERNELS_TESTS_FILE:-} ]]; then
  if [[ ! -r $KERNELS_TESTS_FILE ]]; then
    echo "KERNELS_TESTS_FILE=$KERNELS_TESTS_FILE: no such readable file" >&2; exit 2
  fi
  mapfile -t TESTS < <(grep -vE '^[[:space:]]*(#|$)' "$KERNELS_TESTS_FILE")
  if (( ${#TESTS[@]} == 0 )); then
    echo "KERNELS_TESTS_FILE=$KERNELS_TESTS_FILE: no pytest arguments in it" >&2; exit 2
  fi
  TESTS_LABEL="the ${#TESTS[@]} arguments of $KERNELS_TESTS_FILE"
else
  # shellcheck disable=SC2206  # KERNELS_TESTS is a list of pytest arguments
  TESTS=(${KERNELS_TESTS:-tests/kernels})
  TESTS_LABEL=${KERNELS_TESTS:-tests/kernels}
fi
run_step pytest_gpu "$T" $PY -m pytest -v -m gpu -rfE -p no:cacheprovider "${XDIST[@]}" "${TESTS[@]}"
PYTEST_STATUS=$STATUS
# 1a. Cut by the cap: the tests not reached, for KERNELS_TESTS_FILE in the next call.
UNRUN=-1
if [[ $PYTEST_STATUS == "TIMED OUT"* ]]; then
  T=$(left); (( T > 90 )) && T=90
  if (( T >= 5 )) && timeout "$T" $PY -m pytest --collect-only -q -m gpu -p no:cacheprovider "${TESTS[@]}" \
      >"$OUT/pytest_gpu_collect.log" 2>&1; then
    # outcomes as -v logs them: "[gw0] [ 95%] PASSED <id>" (xdist) or "<id> PASSED [ 95%]"
    # ("<id> SKIPPED (reason) [ 95%]")
    { sed -nE 's/^.*(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests\/.*[^ ]) *$/\2/p' "$OUT/pytest_gpu.log"
      sed -nE 's/^(tests\/[^ ].*) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)( \(.*\))?( +\[ *[0-9]+%\])? *$/\1/p' "$OUT/pytest_gpu.log"
    } | LC_ALL=C sort -u >"$OUT/pytest_gpu_done.txt"
    grep -E '^tests/.*::' "$OUT/pytest_gpu_collect.log" | LC_ALL=C sort -u \
      | LC_ALL=C comm -23 - "$OUT/pytest_gpu_done.txt" >"$OUT/pytest_gpu_unrun.txt"
    UNRUN=$(wc -l <"$OUT/pytest_gpu_unrun.txt")
    rm -f "$OUT/pytest_gpu_done.txt"
  fi
fi
# 1b. Workers share the card's memory: when a test ran out of it (session 43, an 80 GB H100:
# 6 prefill MoE tests in 6 workers), the tests that failed run again in one process, and
# their outcome there is the one that counts.
RERUN=()
if (( ${#XDIST[@]} )) && [[ $PYTEST_STATUS == "FAILED, exit status 1"* ]] \
    && grep -q "OutOfMemoryError" "$OUT/pytest_gpu.log"; then
  # short-summary lines: "FAILED tests/x.py::name[id with spaces] - message"
  mapfile -t RERUN < <(sed -n '/short test summary info/,$p' "$OUT/pytest_gpu.log" \
    | sed -nE 's/^(FAILED|ERROR) (tests\/[^ []*(\[[^]]*\])?).*$/\2/p' | sort -u)
fi
if (( ${#RERUN[@]} )); then
  T=$(left); (( T > PYTEST_CAP )) && T=$PYTEST_CAP
  run_step pytest_gpu_rerun "$T" $PY -m pytest -v -m gpu -rfE -p no:cacheprovider "${RERUN[@]}"
  if [[ $STATUS == ok* ]]; then
    FAILED=$FAILED_BEFORE  # every failure of the shared run passed alone
  fi
fi
{
  echo
  echo "## pytest -m gpu $TESTS_LABEL: $PYTEST_STATUS"
  echo
  echo '```'
  # The short summary (failures, errors) and the final count line.
  sed -n '/short test summary info/,$p' "$OUT/pytest_gpu.log" | tail -n 60
  if ! grep -qs 'short test summary info' "$OUT/pytest_gpu.log"; then
    # Cut by the cap: count the outcomes logged so far, list the failures.
    for o in PASSED FAILED ERROR SKIPPED; do
      echo "$o so far: $(grep -cE "(^| )$o tests/" "$OUT/pytest_gpu.log")"
    done
    grep -E "(^| )(FAILED|ERROR) tests/" "$OUT/pytest_gpu.log" | head -n 40
    tail -n 5 "$OUT/pytest_gpu.log"
  fi
  echo '```'
  if (( UNRUN >= 0 )); then
    echo
    echo "$UNRUN tests not reached (no outcome logged): pytest_gpu_unrun.txt; run them next with KERNELS_TESTS_FILE=pytest_gpu_unrun.txt (copied into the repository)"
  elif [[ $PYTEST_STATUS == "TIMED OUT"* ]]; then
    echo
    echo "the tests not reached could not be listed (collection failed or no time left: pytest_gpu_collect.log)"
  fi
  if (( ${#RERUN[@]} )); then
    echo
    echo "### The ${#RERUN[@]} failed tests again, in one process (out of GPU memory in ${WORKERS} workers): $STATUS"
    echo
    echo '```'
    if grep -qs 'short test summary info' "$OUT/pytest_gpu_rerun.log"; then
      sed -n '/short test summary info/,$p' "$OUT/pytest_gpu_rerun.log" | tail -n 40
    else
      tail -n 1 "$OUT/pytest_gpu_rerun.log"
    fi
    echo '```'
  fi
} >"$REPORT.pytest"

# 2. Every benchmark, sharing what is left of the budget.
if [[ -n ${KERNELS_BENCHES:-} ]]; then
  IFS=';' read -r -a BENCHES <<<"$KERNELS_BENCHES"
else
  BENCHES=()
  for b in benchmarks/bench_*.py; do BENCHES+=("$(basename "$b")"); done
fi
: >"$REPORT.bench"
N=${#BENCHES[@]}
for i in "${!BENCHES[@]}"; do
  read -r -a words <<<"${BENCHES[$i]}"
  b=benchmarks/${words[0]}
  [[ -f $b ]] || { echo "== no such benchmark: $b"; FAILED=1; continue; }
  name=$(basename "$b" .py)
  rm -f "$OUT/$name.md"
  # What is left, less MIN_BENCH_S for each benchmark after this one, at most BENCH_CAP.
  T=$(( $(left) - MIN_BENCH_S * (N - i - 1) )); (( T > BENCH_CAP )) && T=$BENCH_CAP
  run_step "$name" "$T" $PY "$b" "${words[@]:1}" --out "$OUT/$name.md"
  {
    echo
    echo "## $name: $STATUS"
    echo
    if [[ -s $OUT/$name.md ]]; then
      cat "$OUT/$name.md"
    else
      echo "No table written. Last lines of $name.log:"
      echo
      echo '```'
      tail -n 25 "$OUT/$name.log"
      echo '```'
    fi
  } >>"$REPORT.bench"
done

cat "$REPORT.head" "$REPORT.pytest" "$REPORT.bench" >"$REPORT"
rm -f "$REPORT.head" "$REPORT.pytest" "$REPORT.bench"
echo
echo "== wrote $REPORT ($(( $(date +%s) - START )) s in all; failures: $FAILED)"
tail -c 6000 "$REPORT"
exit $FAILED
