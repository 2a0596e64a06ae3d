"""The decode kernels' GPU code paths compile for sm_90 (the H200) on this CPU machine.

The interpreter twins check what the kernels compute but never run their `GPU=True`
branches (inline-asm NVFP4 decode, bf16 tensor-core dots, the swapped dot, PDL waits).
`scripts/sm90_compile_check.py --quick` compiles one configuration per kernel and format
(plain GEMV, fused QKV, dense gate/up, MoE gate/up and down; flat and swapped tiles) and
decode attention's default launch, its ring > W variant, its early reads, its fused
combine (`decode_attention_combine`) and the combine, the one-launch sampler, and the
prefill chunk's routing (`route_topk_rows`), with Triton's
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


@pytest.fixture(scope="module")
def quick_run():
    """`sm90_compile_check.py --quick` run once for this module's tests."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=900, env=env)
    if proc.returncode == 2 and "lacks" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    return proc


def test_decode_kernels_compile_for_sm90(quick_run):
    proc = quick_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "every case compiled for sm_90" in proc.stdout
    assert proc.stdout.count("ok    ") == 21, proc.stdout
    # the report includes the K loop's length: every GEMV / MoE case has a loop
    assert all(" loop 0 instr" not in line for line in proc.stdout.splitlines()
               if line.startswith("ok    ") and ("moe" in line or "gemv" in line)), proc.stdout


def test_code_tile_copies_are_conflict_free(quick_run):
    """The NVFP4 code tiles' cp.async copies need no more shared-memory wavefronts than
    their bytes (`flintc.kernels.tiles.load_code_tile`; 15x in session 10 before the fix),
    in every decode kernel of the quick set, from the probe's layout-based estimate.

    Every NVFP4 GEMV, fused and MoE kernel stages a code tile through cp.async (at least
    6 copies). Before triton 3.9 the pipeliner leaves one out: on the H100 machine's
    triton 3.6 (session 34) the MoE down swap kernel loads its 64x64xi8 tile
    synchronously, so there that one kernel's synchronous tile stands in for its copy."""
    import re

    import triton

    proc = quick_run
    copies = re.findall(r"(\d+(?:x\d+)+xi8) (\d+)/(\d+)", proc.stdout)
    older = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2]) < (3, 9)
    swap_sync = [line for line in proc.stdout.splitlines() if line.startswith("ok    moe down nvfp4")
                 and " swap:" in line and "sync tile loads [64x64xi8]" in line] if older else []
    assert len(copies) + len(swap_sync[:1]) >= 6, proc.stdout  # the NVFP4 GEMV, fused and MoE kernels
    bad = [c for c in copies if int(c[1]) > int(c[2])]
    assert not bad, f"bank-conflicted code tile copies (tile, wavefronts, ideal): {bad}"


def test_copy_conflict_estimate():
    """`triton_aot_probe.copy_conflicts` on two hand-written TTGIR layouts: the 3-D code
    tile that session 10 found conflicted (a warp's lanes on 32 rows 64 bytes apart: 16
    wavefronts for 256 bytes) and the 2-D tile that replaced it (2, the ideal)."""
    sys.path.insert(0, str(SCRIPT.parent))
    from triton_aot_probe import copy_conflicts

    copy = ("    %ct = ttg.async_copy_global_to_local %a, %b mask %m other %c {contiguity = 8 : "
            "i32} : tensor<{t}x!tt.ptr<i8>, #blocked2> -> <{t}xi8, #shared1, #smem, mutable>\n")
    old = ("#blocked2 = #ttg.blocked<{sizePerThread = [1, 1, 8], threadsPerWarp = [32, 1, 1], "
           "warpsPerCTA = [2, 2, 1], order = [2, 0, 1]}>\n"
           "#shared1 = #ttg.swizzled_shared<{vec = 1, perPhase = 1, maxPhase = 1, "
           "order = [2, 1, 0]}>\n" + copy.replace("{t}", "64x8x8"))
    new = ("#blocked2 = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8], "
           "warpsPerCTA = [4, 1], order = [1, 0]}>\n"
           "#shared1 = #ttg.swizzled_shared<{vec = 1, perPhase = 1, maxPhase = 1, "
           "order = [1, 0]}>\n" + copy.replace("{t}", "64x64"))
    assert copy_conflicts(old) == [("64x8x8xi8", 16, 2)]
    assert copy_conflicts(new) == [("64x64xi8", 2, 2)]
    # a swizzled bf16 tile: 16-byte vectors, 8 rows of 256 bytes XOR-swizzled -> ideal
    swz = ("#blocked2 = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [2, 16], "
           "warpsPerCTA = [4, 1], order = [1, 0]}>\n"
           "#shared1 = #ttg.swizzled_shared<{vec = 8, perPhase = 1, maxPhase = 8, "
           "order = [1, 0]}>\n" + copy.replace("{t}x!tt.ptr<i8>", "16x128x!tt.ptr<bf16>")
           .replace("<{t}xi8", "<16x128xbf16"))
    assert copy_conflicts(swz) == [("16x128xbf16", 4, 4)]
