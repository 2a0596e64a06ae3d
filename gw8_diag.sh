set -uo pipefail
OUT=${OUT:-/tmp/o}; mkdir -p $OUT
LOG=$OUT/pip.log; . scripts/gpu_env.sh
export OMP_NUM_THREADS=4 FLINTC_CACHE_DIR=/tmp/fc TORCHINDUCTOR_CACHE_DIR=/tmp/ti PYTHONPATH=$PWD:$PYTHONPATH
$PY -m pytest -q -rfs -p no:cacheprovider -p gw8_plugin -m "not gpu or gpu_suite" tests > $OUT/gw8.log 2>&1
echo "gw8 rc=$?"; grep -E "passed|failed" $OUT/gw8.log | tail -2
grep -E "ENVCHANGE|missing ids" $OUT/gw8.log | head; grep -E "^E .*here:" $OUT/gw8.log | head -5
