"""PDL trigger modes (`flintc.kernels.pdl`) and the one-step GEMV configurations that rely
on them. The modes only change where `gdc_launch_dependents` sits; the GPU tests
(`test_gemv.py`, `test_moe_kernels.py`, ... with use_pdl=True) run the default (late)."""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton loads (as the other kernel tests)

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from flintc.kernels import gemv as G  # noqa: E402
from flintc.kernels.pdl import PDL_EARLY, PDL_LATE, PDL_OFF, pdl_mode  # noqa: E402


def test_pdl_mode_default_and_env(monkeypatch):
    monkeypatch.delenv("FLINTC_PDL_TRIGGER", raising=False)
    assert pdl_mode(False) == PDL_OFF
    assert pdl_mode(True) == PDL_LATE  # the measured faster mode (module doc)
    monkeypatch.setenv("FLINTC_PDL_TRIGGER", "late")
    assert pdl_mode(True) == PDL_LATE
    assert pdl_mode(False) == PDL_OFF
    monkeypatch.setenv("FLINTC_PDL_TRIGGER", "Early")
    assert pdl_mode(True) == PDL_EARLY


def test_pdl_mode_rejects_unknown(monkeypatch, tmp_path):
    """A bad FLINTC_PDL_TRIGGER / FLINTC_*_TUNED is a user error (FlintcError, and a
    ValueError), also without PDL, and check_environment reports it up front."""
    from flintc.errors import FlintcError
    from flintc.kernels.tuning import check_environment

    monkeypatch.setenv("FLINTC_PDL_TRIGGER", "sometimes")
    for use_pdl in (True, False):
        with pytest.raises(ValueError, match="FLINTC_PDL_TRIGGER"):
            pdl_mode(use_pdl)
    with pytest.raises(FlintcError, match="FLINTC_PDL_TRIGGER"):
        check_environment()
    monkeypatch.setenv("FLINTC_PDL_TRIGGER", "late")
    check_environment()
    monkeypatch.setenv("FLINTC_MOE_TUNED", str(tmp_path / "missing.json"))
    with pytest.raises(FlintcError, match="FLINTC_MOE_TUNED=.*cannot read"):
        check_environment()
    monkeypatch.delenv("FLINTC_MOE_TUNED")
    # the CUDA kernels' launch knobs are checked up front too
    for var, bad in (("FLINTC_MMA_TRIGGER", "qkv,sometimes"),
                     ("FLINTC_MMA_GEMV_LAUNCH", "nvfp4:2048x4096=3,2"),
                     ("FLINTC_MMA_GATE_UP_LAUNCH", "nvfp4:1=4,1"),
                     ("FLINTC_MMA_DOWN_LAUNCH", "nvfp4:1=32"),
                     ("FLINTC_MMA_NORM_GATE_UP_LAUNCH", "nvfp4:1=4,1,2"),
                     ("FLINTC_MMA_NORM_GATE_UP_FORMATS", "fp8"),
                     ("FLINTC_MMA_L2_PREFETCH", "gate_up,qkv"),
                     ("FLINTC_MMA_EARLY_EPILOGUE", "gemv,qkv")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(FlintcError, match=var):
            check_environment()
        monkeypatch.delenv(var)
    check_environment()


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("F,K,rows", [(2048, 4096, None), (2048, 10240, None), (4096, 2048, 128),
                                      (151552, 2048, None)])
def test_one_step_configs_make_one_step(monkeypatch, fmt, F, K, rows):
    """Every one-step candidate covers K in exactly one BLOCK_K step per program, prefetches
    (so the whole slice is issued before gdc_wait) and fits the tile budget."""
    monkeypatch.setattr(G, "sm_count", lambda device: 132)
    cands = G.one_step_configs(fmt, 1, F, K, torch.device("cpu"), rows)
    assert cands, "no candidate"
    wbytes = 0.5 + 1 / 16 if fmt == "nvfp4" else 2.0
    for c in cands:
        split, k_per_split = G._effective_split(K, c.block_k, c.split_k)
        assert (split, k_per_split) == (c.split_k, c.block_k), c
        assert c.prefetch and c.num_stages == 1
        assert c.block_f * c.block_k * wbytes <= 36864
        assert c.num_warps == (8 if c.block_f * c.block_k * wbytes > 16384 else 4)
        if rows:
            assert c.block_f == rows
    assert set(G.one_step_configs(fmt, 1, F, K, torch.device("cpu"), rows)) <= set(
        G.sweep_configs(fmt, 1, F, K, torch.device("cpu"), rows))
    assert G.sweep_configs(fmt, 1, F, K, torch.device("cpu"), rows, family="one-step") == cands
    with pytest.raises(ValueError, match="family"):
        G.sweep_configs(fmt, 1, F, K, torch.device("cpu"), rows, family="bogus")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("kernel,rows,red", [("gate_up", 512, 2048), ("down", 2048, 512)])
def test_moe_one_step_configs(monkeypatch, fmt, kernel, rows, red):
    """MoE one-step candidates: one reduction step per program, prefetching, within the
    tile budget (gate and up tiles counted together), listed by the one-step sweep."""
    from flintc.kernels import moe as M

    monkeypatch.setattr(M, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    cands = M.one_step_configs(kernel, fmt, 1, rows, red, 7, dev)
    assert cands
    wbytes = 0.5 + 1 / 16 if fmt == "nvfp4" else 2.0
    for c in cands:
        assert M._effective_split(red, c.block_k, c.split) == (c.split, c.block_k), c
        assert c.prefetch and c.num_stages == 1
        assert (2 if kernel == "gate_up" else 1) * c.block_rows * c.block_k * wbytes <= 36864
    sweep = M.sweep_configs(kernel, fmt, 1, rows, red, 7, dev, family="one-step")
    assert set(cands) <= set(sweep)
    assert not set(cands) & set(M.sweep_configs(kernel, fmt, 1, rows, red, 7, dev, family="classic"))
    with pytest.raises(ValueError, match="family"):
        M.sweep_configs(kernel, fmt, 1, rows, red, 7, dev, family="x")


def test_tuning_override_files(tmp_path, monkeypatch):
    """FLINTC_GEMV_TUNED / FLINTC_MOE_TUNED files take precedence over the TUNED tables, and a
    malformed file is a ValueError that names the variable and the file."""
    import json

    from flintc.kernels import moe as M

    cfg = G.GemvConfig(use_dot=False, block_f=32, block_k=256, split_k=8)
    path = tmp_path / "gemv.json"
    path.write_text(json.dumps({"entries": [{"key": ["nvfp4", 2048, 4096, 1],
                                             "config": dict(cfg.__dict__), "us": 1.0}]}))
    monkeypatch.setenv("FLINTC_GEMV_TUNED", str(path))
    assert G.tuned_config(("nvfp4", 2048, 4096, 1)) == cfg
    assert G.choose_config(1, 2048, 4096, "nvfp4", torch.device("cpu")) == cfg
    assert G.tuned_config(("qkv:nvfp4", 4096, 2048, 1)) == G.TUNED[("qkv:nvfp4", 4096, 2048, 1)]
    mcfg = M.MoeConfig(block_rows=16, block_k=512, split=4, prefetch=True, num_stages=1)
    mpath = tmp_path / "moe.json"
    mpath.write_text(json.dumps({"entries": [{"key": ["gate_up", "nvfp4", 1],
                                              "config": {**mcfg.__dict__}}]}))
    monkeypatch.setenv("FLINTC_MOE_TUNED", str(mpath))
    monkeypatch.setattr(M, "interpreting", lambda: False)
    assert M.choose_config("gate_up", "nvfp4", 1, 512, 2048, 7, torch.device("cuda", 0)) == mcfg
    path.write_text('{"entries": [{"key": ["nvfp4", 1], "config": {}}]}')
    with pytest.raises(ValueError, match="FLINTC_GEMV_TUNED=.*gemv.json"):
        G.tuned_config(("nvfp4", 2048, 4096, 1))
    monkeypatch.setenv("FLINTC_GEMV_TUNED", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot read"):
        G.tuned_config(("nvfp4", 2048, 4096, 1))
