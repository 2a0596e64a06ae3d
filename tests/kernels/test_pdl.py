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


def test_pdl_mode_rejects_unknown(monkeypatch):
    monkeypatch.setenv("FLINTC_PDL_TRIGGER", "sometimes")
    with pytest.raises(ValueError, match="FLINTC_PDL_TRIGGER"):
        pdl_mode(True)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("F,K,rows", [(2048, 4096, None), (2048, 10240, None), (4096, 2048, 128),
                                      (151552, 2048, None)])
def test_one_step_configs_make_one_step(monkeypatch, fmt, F, K, rows):
    """Every one-step candidate covers K in exactly one BLOCK_K step per program, prefetches
    (so the whole slice is issued before gdc_wait) and fits the tile budget."""
    monkeypatch.setattr(G, "num_sms", lambda device: 132)
    cands = G.one_step_configs(fmt, 1, F, K, torch.device("cpu"), rows)
    assert cands, "no candidate"
    wbytes = 0.5 + 1 / 16 if fmt == "nvfp4" else 2.0
    for c in cands:
        split, k_per_split = G._effective_split(K, c.block_k, c.split_k)
        assert (split, k_per_split) == (c.split_k, c.block_k), c
        assert c.prefetch and c.num_stages == 1
        assert c.block_f * c.block_k * wbytes <= 16384 * (2 if rows else 1)
        if rows:
            assert c.block_f == rows
    assert set(G.one_step_configs(fmt, 1, F, K, torch.device("cpu"), rows)) <= set(
        G.sweep_configs(fmt, 1, F, K, torch.device("cpu"), rows))
    assert G.sweep_configs(fmt, 1, F, K, torch.device("cpu"), rows, family="one-step") == cands
    with pytest.raises(ValueError, match="family"):
        G.sweep_configs(fmt, 1, F, K, torch.device("cpu"), rows, family="bogus")
