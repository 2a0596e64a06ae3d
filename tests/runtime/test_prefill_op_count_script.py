"""`scripts/prefill_op_count.py` refuses bad arguments before it compiles anything: one
argparse line and exit code 2, no traceback (a missing or non-build --build folder, a
format other than nvfp4 / bf16 or an empty item, --cuda-kernels without --build and a
GPU, a --json folder that does not exist)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prefill_op_count.py"


@pytest.mark.parametrize("args,expect", [
    (["--build", "{tmp}/missing"], "not a flintc build"),
    (["--build", "{tmp}"], "not a flintc build"),
    (["--formats", "fp8"], "--formats 'fp8'"),
    (["--formats", "nvfp4,"], "--formats 'nvfp4,'"),
    (["--cuda-kernels"], "--cuda-kernels needs --build"),
    (["--json", "{tmp}/no/such/dir/c.json"], "does not exist"),
])
def test_bad_arguments_are_one_line(args, expect, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and expect in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("prefill_op_count.py: error: "), r.stderr
