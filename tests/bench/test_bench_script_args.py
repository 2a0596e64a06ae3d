"""Argument checks of the GPU kernel benchmarks (`benchmarks/bench_gemv.py`,
`benchmarks/bench_moe.py`): bad options end the script with one `error:` line naming the
flag and exit status 2, before the "needs a CUDA GPU" check, so they are caught on a
machine without a GPU too; and `benchmarks/common.py`'s list parsers behind them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import choice_list, int_list


def parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="bench")


@pytest.mark.parametrize("text,want", [("1,8", [1, 8]), (" 2 , 4", [2, 4]), ("8", [8])])
def test_int_list_parses(text, want):
    assert int_list(parser(), "--batches", text, 1, 8) == want


@pytest.mark.parametrize("text,needle", [("", "no empty items"), ("1,,2", "no empty items"),
                                         ("x", "'x' is not an integer"),
                                         ("0", "0 is outside [1, 8]"),
                                         ("1,9", "9 is outside [1, 8]")])
def test_int_list_refuses(text, needle, capsys):
    with pytest.raises(SystemExit) as e:
        int_list(parser(), "--batches", text, 1, 8)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("bench: error: --batches: ") and needle in err, err


def test_choice_list_keeps_order_and_drops_duplicates():
    assert choice_list(parser(), "--formats", "nvfp4,bf16,nvfp4", ("bf16", "nvfp4")) == \
        ["nvfp4", "bf16"]


@pytest.mark.parametrize("text,needle", [("", "no empty items"), ("bf16,", "no empty items"),
                                         ("xyz", "unknown 'xyz'"), ("bf16,foo", "unknown 'foo'")])
def test_choice_list_refuses(text, needle, capsys):
    with pytest.raises(SystemExit) as e:
        choice_list(parser(), "--formats", text, ("bf16", "nvfp4"))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("bench: error: --formats: ") and needle in err
    assert "bf16,nvfp4" in err  # the choices are named


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


@pytest.mark.parametrize("script,args,needle", [
    ("bench_gemv.py", ["--formats", "xyz"], "--formats: unknown 'xyz'"),
    ("bench_gemv.py", ["--sweep-seconds", "-1"], "--sweep-seconds: expected >= 0"),
    ("bench_gemv.py", ["--cases", "qkv,nope"], "--cases: unknown 'nope'"),
    ("bench_moe.py", ["--formats", "bf16,foo"], "--formats: unknown 'foo'"),
    ("bench_moe.py", ["--sweep-seconds", "-1"], "--sweep-seconds: expected >= 0"),
    ("bench_moe.py", ["--batches", "9"], "--batches: 9 is outside [1, 8]"),
])
def test_scripts_refuse_bad_arguments_before_the_gpu_check(script, args, needle):
    r = run_script(script, *args)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "error: " + needle in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "CUDA" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_scripts_with_good_arguments_reach_the_gpu_check():
    r = run_script("bench_gemv.py", "--formats", "nvfp4", "--batches", "1,8", "--cases",
                   "qkv,o_proj+res", "--sweep-seconds", "0", "--floor")
    assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr, r.stderr[-2000:]


def test_first_call_reports_a_failing_variant_and_returns_none(capsys):
    """`first_call` (the kernel sweeps' first run of a variant): a raising call gives (None,
    "Type: message") and prints the label with it; the sweeps then skip that variant."""
    from common import first_call

    out, err = first_call(lambda: [][1], "variant w3")
    assert out is None and err.startswith("IndexError: list index out of range")
    assert "variant w3: IndexError" in capsys.readouterr().out


def test_gemv_floor_groups_each_case_s_weights():
    """`bench_gemv.weight_floors` (`--floor`): a plain weight is one matrix, the dense
    gate/up two, per rotated copy; each floor reads exactly that copy's codes and scales."""
    import bench_gemv as BG
    from flintc.quant.nvfp4 import quantize

    q = quantize((torch.randn(64, 128) * 0.05).to(torch.bfloat16))
    nv = [q.codes, q.scales, q.global_scale]
    bf = [(torch.randn(64, 128) * 0.05).to(torch.bfloat16)]

    class Rot:  # the part of `bench_gemv.Rotation` the floors read
        def __init__(self, *copies):
            self.copies = list(copies)

    for copies, per in (((nv, [c.clone() for c in nv]), 64 * 64 + 64 * 8), ((bf,), 64 * 128 * 2),
                        (([nv, nv],), 2 * (64 * 64 + 64 * 8))):
        floors = BG.weight_floors(Rot(*copies))
        assert len(floors) == len(copies) and all(f.item_bytes() == per for f in floors)
        assert floors[0].shared[0].data_ptr() == (copies[0][0][0] if isinstance(copies[0][0], list)
                                                  else copies[0][0]).data_ptr()
    with pytest.raises(ValueError, match="needs 1 or 2 matrices; got 3"):
        BG.weight_floors(Rot([nv, nv, nv]))


@pytest.mark.parametrize("env,needle", [
    ({"FMTS": "fp8"}, "FMTS: expected formats among nvfp4, bf16"),
    ({"NS": "0,8"}, "NS: batches must be in 1..8"),
    ({"LAUNCHES": "4,2,2"}, "LAUNCHES: expected space-separated"),
    ({"LAUNCHES": "4,2,x,0"}, "LAUNCHES: expected comma-separated integers"),
    ({"H": "1,2"}, "H: expected one positive integer"),
])
def test_dense_gate_up_script_refuses_bad_settings(env, needle):
    """scripts/gpu_dense_gate_up.py: a malformed environment variable ends it with one
    `error:` line naming the variable, exit status 2, before it looks for a GPU."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_dense_gate_up.py")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env}, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr.strip().splitlines()[-1]
