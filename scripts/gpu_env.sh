# Sourced by the GPU scripts (gpu_bench.sh, gpu_bench_compile_baseline.sh) from the
# repository root, on a bare GPU machine with torch + triton preinstalled and no network:
#
#   PY          the Python to use: $PYTHON, else /opt/torch/.venv/bin/python3 when it
#               exists, else python3;
#   /tmp/site   the wheels carried in .whl/ (or in $GPU_WHEELS; matplotlib and its dependencies, gguf,
#               pyyaml, pydot, ...), installed with pip --no-index --no-deps, or, when
#               pip is missing or fails, unpacked with zipfile (a wheel is a zip of the
#               package folders; enough for imports);
#   PYTHONPATH  /tmp/site:$PWD (flintc from the working tree, not an installed copy);
#   MPLCONFIGDIR a writable folder for matplotlib's font cache.
#
# Usage: LOG=path/pip.log; . scripts/gpu_env.sh
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x /opt/torch/.venv/bin/python3 ]; then
  PY=/opt/torch/.venv/bin/python3
else
  PY=python3
fi
SITE=${GPU_SITE:-/tmp/site}
WHEELS=${GPU_WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl >"${LOG:-/dev/null}" 2>&1; then
    echo "pip install of $WHEELS/*.whl failed (see ${LOG:-the log}); unpacking the wheels instead"
    $PY - "$SITE" "$WHEELS"/*.whl <<'EOF' || echo "unpacking the wheels failed too; going on without them"
import sys, zipfile
from pathlib import Path
site = Path(sys.argv[1])
site.mkdir(parents=True, exist_ok=True)
for whl in sys.argv[2:]:
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):  # NAME.data/{purelib,platlib}/... -> site; scripts etc. skipped
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if info.is_dir() or not parts or not parts[-1]:
                continue
            dest = site.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(info))
    print("unpacked", Path(whl).name)
EOF
  fi
  export PYTHONPATH=$SITE:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
export MPLCONFIGDIR=${MPLCONFIGDIR:-/tmp/flintc-mplconfig}
mkdir -p "$MPLCONFIGDIR" 2>/dev/null || true
unset TRITON_INTERPRET

# Time-capped steps for the scripts that run several measurements in one call. They read
# START (the script's start, `date +%s`), BUDGET (seconds for the whole script) and T (the
# folder for the logs) from the caller:
#   step NAME CAP_S CMD...  runs CMD with min(CAP_S, seconds left) seconds, its output in
#                           $T/NAME.log, then prints the exit status and the log's last
#                           ${TAIL:-12} lines; skipped when fewer than 20 s are left.
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() {
  local name=$1 cap=$2; shift 2
  local t; t=$(left); [ "$t" -lt "$cap" ] && cap=$t
  if [ "$cap" -lt 20 ]; then echo "== $name: skipped (no time left)"; return; fi
  echo "== $name (cap ${cap} s, $(( $(date +%s) - START )) s in)"
  timeout --kill-after=10 "$cap" "$@" > "$T/$name.log" 2>&1
  echo "   exit $? after $(( $(date +%s) - START )) s"; tail -n "${TAIL:-12}" "$T/$name.log"
}

# require_builds NAME...: every $BUILDS/NAME/build.json exists (BUILDS default gpu_builds),
# else a line naming the first missing one and `scripts/gpu_builds.sh`; returns 1.
require_builds() {
  local b
  for b in "$@"; do
    [ -f "${BUILDS:-gpu_builds}/$b/build.json" ] || {
      echo "${BUILDS:-gpu_builds}/$b missing: run scripts/gpu_builds.sh" >&2; return 1; }
  done
}
