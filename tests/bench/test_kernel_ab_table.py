"""`scripts/kernel_ab_table.py` (the table of `scripts/gpu_kernel_ab.sh`) on tables shaped
as `bench_gemv.py` and `bench_moe.py` write them; and the shell script's refusal of a
missing AB_OLD (CPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("kernel_ab_table", ROOT / "scripts" / "kernel_ab_table.py")
kab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kab)

GEMV = """Device: X; copy bandwidth 3000 GB/s

| case | F x K | fmt | N | flintc us | GB/s | % copy | config |
|---|---|---|---|---|---|---|---|
| o_proj+res | 2048x4096 | nvfp4 | 1 | {a} | 1 | 1% | mma |
| o_proj+res | 2048x4096 | nvfp4 | 8 | {b} | 1 | 1% | mma |
| lm_head | 151552x2048 | bf16 | 1 | - | - | - | skipped |
"""
MOE = """| op | fmt | N | distinct experts | MB read | flintc us | GB/s | % copy |
|---|---|---|---|---|---|---|---|
| moe_down_combine_residual | nvfp4 | 1 | 6.0 | 4.1 | {a} | 1 | 1% |
"""


def _write(folder: Path, bench: str, v: str, r: int, text: str) -> None:
    (folder / f"{bench}-{v}-{r}.md").write_text(text)


def test_table_pairs_rows_and_rounds(tmp_path):
    for r, (old, new) in enumerate([((4.0, 5.0), (3.0, 4.5)), ((4.2, 5.2), (3.2, 4.4))], 1):
        _write(tmp_path, "gemv", "old", r, GEMV.format(a=old[0], b=old[1]))
        _write(tmp_path, "gemv", "new", r, GEMV.format(a=new[0], b=new[1]))
    _write(tmp_path, "moe", "old", 1, MOE.format(a=3.5))
    _write(tmp_path, "moe", "new", 1, MOE.format(a=2.8))
    text = kab.table(tmp_path)
    lines = text.splitlines()
    assert lines[0].startswith("| bench | row | fmt | N | old 1 | new 1 | old 2 | new 2 |")
    row = next(ln for ln in lines if "o_proj+res | nvfp4 | 1 |" in ln)
    assert "| 4.00 | 3.00 | 4.20 | 3.20 |" in row
    assert row.rstrip(" |").endswith(f"{3.1 / 4.1:.3f}")  # medians of the rounds
    moe = next(ln for ln in lines if ln.startswith("| moe |"))
    assert "| 3.50 | 2.80 | - | - |" in moe and moe.rstrip(" |").endswith(f"{2.8 / 3.5:.3f}")
    assert "lm_head" not in text  # a skipped row has no time


def test_main_exit_status(tmp_path, capsys):
    assert kab.main([str(tmp_path)]) == 1
    assert "no gemv-/moe-" in capsys.readouterr().err
    _write(tmp_path, "gemv", "old", 1, GEMV.format(a=1, b=2))
    out = tmp_path / "t.md"
    assert kab.main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_text() == capsys.readouterr().out


def test_script_refuses_a_missing_old_tree(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "AB_OLD": str(tmp_path / "nope"),
           "GPU_WHEELS": str(tmp_path / "no-wheels"), "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_kernel_ab.sh")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "AB_OLD must name a folder" in p.stderr
