#!/usr/bin/env bash
# One call on a bare GPU machine: README's test suite there, as a user with a GPU runs it.
# pytest over tests/ with the GPU kernel tests deselected (`-m "not gpu or gpu_suite"`:
# scripts/gpu_kernels.sh runs those at full shapes; the `gpu_suite` ones, such as the
# tiny model compiled for CUDA in tests/runtime/test_compiled.py, run here), so the same
# tests as the CPU CI but with torch.cuda.is_available() true: the tests that take the
# GPU path when one is visible, the interpreter-only tests' skips
# (tests/harness.cpu_interpreter_only) and the TRITON_INTERPRET handling (tests/conftest.py). Session 33 found eight tests/runtime
# failures and a bare traceback of `flintc serve` this way (docs/gpu-runs.md).
#
# The tests run in SUITE_WORKERS pytest-xdist processes (default 14) with
# OMP_NUM_THREADS=1: 16 workers of 16 torch threads each did not finish tests/runtime in
# 420 s; with one thread each it took 99 s. `-v` output goes to $OUT/suite.log as the run
# goes, so a run cut by the budget (SUITE_BUDGET_S, default 540 s for the whole call)
# still names every test that finished; $OUT/suite.md gets the summary: the counts, the
# failed tests, the skip reasons, and the tests that started but never finished.
# Wheels: .whl/ as for the other scripts, with FastAPI, uvicorn, openai and their
# dependencies for tests/serve (docs/benchmarks.md "How to run"); scripts/gpu_env.sh
# installs them. Exit status: pytest's (124 when the budget ran out).
#
#   [SUITE_ARGS="tests/runtime tests/cli"] OUT=/some/dir bash scripts/gpu_suite.sh   # repo root
set -uo pipefail
START=$(date +%s)
BUDGET=${SUITE_BUDGET_S:-540}
WORKERS=${SUITE_WORKERS:-14}
OUT=${OUT:-$PWD/suite_out}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 1

LOG=$OUT/pip.log
. scripts/gpu_env.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export FLINTC_CACHE_DIR=${FLINTC_CACHE_DIR:-/tmp/flintc-suite-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/flintc-suite-inductor}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"

XDIST=(-n "$WORKERS")
$PY -c "import xdist" 2>/dev/null || { echo "pytest-xdist does not import: one process"; XDIST=(); }
CAP=$(( BUDGET - ($(date +%s) - START) - 15 ))
# shellcheck disable=SC2086
timeout --signal=TERM --kill-after=10 "$CAP" $PY -m pytest ${SUITE_ARGS:-tests} -m "not gpu or gpu_suite" -v -rfs \
  "${XDIST[@]}" -p no:cacheprovider >"$OUT/suite.log" 2>&1
RC=$?
echo "pytest exit status $RC after $(( $(date +%s) - START )) s (cap $CAP s)"

$PY - "$OUT/suite.log" "$RC" >"$OUT/suite.md" <<'EOF'
import re, sys
from collections import Counter
text = open(sys.argv[1], errors="replace").read()
started, done = set(), {}
STATUS = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
for line in text.splitlines():
    m = re.search(rf"\b({STATUS}) (\S+\.py::.*\S)\s*$", line)  # xdist's "[gw0] [ 25%] PASSED id", the -rfs lines
    one = re.fullmatch(rf"(\S+\.py::.*?) ({STATUS})(?: \[ *\d+%\])?\s*", line)  # one process: "id PASSED [ 25%]"
    if m:
        done[m.group(2)] = m.group(1)
    elif one:
        done[one.group(1)] = one.group(2)
    elif re.fullmatch(r"\S+\.py::.*\S\s*", line):
        started.add(line.strip())
counts = Counter(done.values())
print(f"# README's suite on a GPU machine (pytest exit status {sys.argv[2]})\n")
print("finished: " + (", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items())) or "none"))
summary = [l for l in text.splitlines() if re.match(r"=+ .*\b(passed|failed|error)", l)]
print("pytest summary: " + (summary[-1].strip("= ") if summary else "none (the run was cut)"))
for title, rows in (("failed", sorted(t for t, s in done.items() if s in ("FAILED", "ERROR"))),
                    ("started, never finished", sorted(started - set(done))),
                    ("skip reasons", [l for l in text.splitlines() if l.startswith("SKIPPED [")])):
    print(f"\n## {title} ({len(rows)})\n")
    print("\n".join(f"- {r}" for r in rows) or "- none")
EOF
cat "$OUT/suite.md"
exit "$RC"
