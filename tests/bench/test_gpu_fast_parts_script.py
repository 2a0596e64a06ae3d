"""`scripts/gpu_fast_parts.py` (the fast baseline's four variants, session 38's first GPU
item) runs end to end on CPU at the tiny config: each variant compiles with
`reduce-overhead`, runs, and gets a finite time in the table; the script exits 0. Its GPU
run (the full config's width) is in docs/gpu-runs.md; this guards the script itself."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_fast_parts.py"


def test_fast_parts_script_runs_every_variant_on_cpu(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    r = subprocess.run([sys.executable, str(SCRIPT), "--config", "tiny", "--device", "cpu", "--layers", "2",
                        "--batches", "1", "--iters", "1", "--reps", "1"],
                       capture_output=True, text=True, timeout=600, check=False, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| 1 |")]
    variants = {(e.strip(), a.strip()) for _, e, a, *_ in rows}
    assert variants == {("grouped", "inplace"), ("grouped", "gather"), ("gather", "inplace"),
                        ("gather", "gather")}, r.stdout
    for row in rows:
        ms, breaks = float(row[3]), int(row[5])
        assert math.isfinite(ms) and ms > 0 and breaks == 0, row


def test_fast_parts_script_runs_one_chosen_variant_with_grouped_min_rows(tmp_path):
    """`--experts / --attention` pick the variants and `--grouped-min-rows 1` puts batch 1's
    six rows through the grouped GEMM (session 45's next GPU item); bad values exit 2
    naming the option."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    base = [sys.executable, str(SCRIPT), "--config", "tiny", "--device", "cpu", "--layers", "2",
            "--batches", "1", "--iters", "1", "--reps", "1"]
    r = subprocess.run(base + ["--experts", "grouped", "--attention", "inplace", "--grouped-min-rows", "1"],
                       capture_output=True, text=True, timeout=600, check=False, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "GROUPED_MIN_ROWS 1" in r.stdout, r.stdout
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| 1 |")]
    assert [(e.strip(), at.strip()) for _, e, at, *_ in rows] == [("grouped", "inplace")], r.stdout
    for args, name in ((["--experts", "grouped,scatter"], "--experts"), (["--grouped-min-rows", "0"], "--grouped-min-rows")):
        bad = subprocess.run(base + args, capture_output=True, text=True, timeout=120, check=False, env=env)
        assert bad.returncode == 2 and name in bad.stderr, bad.stderr
