"""The decode kernels' GPU code paths compile for sm_90 (the H200) on this CPU machine.

The interpreter twins check what the kernels compute but never run their `GPU=True`
branches (inline-asm NVFP4 decode, bf16 tensor-core dots, the swapped dot, PDL waits).
`scripts/sm90_compile_check.py --quick` compiles one configuration per kernel and format
(plain GEMV, fused QKV, dense gate/up, MoE gate/up and down; flat and swapped tiles) and
decode attention's default launch, its ring > W variant and the combine, with Triton's
whole pipeline down to ptxas, in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: the kernels need it")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sm90_compile_check.py"


def test_decode_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=900, env=env)
    if proc.returncode == 2 and "lacks" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "every case compiled for sm_90" in proc.stdout
    assert proc.stdout.count("ok    ") == 17, proc.stdout
    # the report includes the K loop's length: every GEMV / MoE case has a loop
    assert all(" loop 0 instr" not in line for line in proc.stdout.splitlines()
               if line.startswith("ok    ") and ("moe" in line or "gemv" in line)), proc.stdout
