"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def poisoned(monkeypatch):
    """The prefill launchers' outputs (`grouped_gemm._alloc`, `prefill_norm._alloc`) and
    the NVFP4 dequant workspace (`gemm._WORKSPACE`) start as NaN, so an unwritten element
    shows up. Imports the kernels lazily: the test modules set TRITON_INTERPRET before
    they import them."""
    from flintc.kernels import gemm as G
    from flintc.kernels import grouped_gemm as GG
    from flintc.kernels import prefill_norm as PN

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def nan_alloc(*shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(GG, "_alloc", nan_alloc)
    monkeypatch.setattr(PN, "_alloc", nan_alloc)
    G._WORKSPACE.clear()
    G._WORKSPACE[(dev.type, dev.index)] = torch.full(
        (1 << (25 if dev.type == "cuda" else 16),), float("nan"), dtype=torch.bfloat16,
        device=dev)
    yield
    G._WORKSPACE.clear()
