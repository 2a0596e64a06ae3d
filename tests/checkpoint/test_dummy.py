"""Dummy weights (`load_format="dummy"`): shapes, distributions, chunking, meta device."""

from __future__ import annotations

import math

import pytest
import torch

import flintc.checkpoint.dummy as dummy
from flintc.checkpoint.dummy import dummy_weights
from flintc.checkpoint.loader import load_checkpoint
from flintc.config import FlintConfig
from flintc.model.weights import check_weights, weight_specs
from flintc.quant.nvfp4 import NVFP4Tensor

TINY = FlintConfig.preset("tiny")
FULL = FlintConfig.preset("full")
# Full width, few layers and experts: one dense layer and two MoE layers.
NARROW_FULL = FULL.replace(
    num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=16, vocab_size=1024
)


def rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


def some_rows(w, rows: int = 64):
    """The first `rows` rows of each of the first two experts, as fp32 values."""
    if isinstance(w, NVFP4Tensor):
        stacked = len(w.shape) == 3
        w = NVFP4Tensor(w.codes[:2, :rows] if stacked else w.codes[:rows],
                        w.scales[:2, :rows] if stacked else w.scales[:rows],
                        w.global_scale[:2] if stacked else w.global_scale)
        return w.dequantize()
    return (w[:2, :rows] if w.dim() == 3 else w[:rows]).float()


def is_global_scaled(name: str) -> bool:
    return ".self_attn." in name or ".mlp.experts." in name


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("config", [TINY, NARROW_FULL], ids=["tiny", "narrow_full"])
def test_shapes_and_distributions(config, fmt):
    weights = dummy_weights(config, fmt, "cpu", seed=0)
    check_weights(config, weights)
    for spec in weight_specs(config):
        w = weights[spec.name]
        if spec.kind == "linear" and fmt == "nvfp4":
            assert isinstance(w, NVFP4Tensor)
            g = w.global_scale
            assert bool((g != 1).all()) if is_global_scaled(spec.name) else bool((g == 1).all())
            assert abs(rms(some_rows(w)) * math.sqrt(spec.shape[-1]) - 1) < 0.25, spec.name
        elif spec.kind in ("linear", "bf16"):
            embedding = spec.name == "model.embed_tokens.weight"
            want = 1.0 if embedding else 1 / math.sqrt(spec.shape[-1])
            assert abs(rms(some_rows(w)) / want - 1) < 0.1, spec.name
        elif "norm" in spec.name:
            assert torch.equal(w, w.bfloat16().float()) and abs(w.mean().item() - 1) < 0.1
    if fmt == "nvfp4":  # stacked experts: one global scale per expert, all different
        g = weights["model.layers.2.mlp.experts.down_proj.weight"].global_scale
        assert g.shape == (config.n_routed_experts,) and len(set(g.tolist())) == g.numel()


def test_deterministic_for_a_seed():
    a = dummy_weights(TINY, "nvfp4", "cpu", seed=7)
    b = dummy_weights(TINY, "nvfp4", "cpu", seed=7)
    c = dummy_weights(TINY, "nvfp4", "cpu", seed=8)
    name = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(a[name].codes, b[name].codes)
    assert torch.equal(a[name].scales.view(torch.uint8), b[name].scales.view(torch.uint8))
    assert not torch.equal(a[name].codes, c[name].codes)
    assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_small_chunks_fill_every_row(fmt, monkeypatch):
    monkeypatch.setattr(dummy, "CHUNK_ELEMS", 1000)  # many chunks, some ragged
    weights = dummy_weights(TINY, fmt, "cpu", seed=1)
    for name, w in weights.items():
        values = w.dequantize() if isinstance(w, NVFP4Tensor) else w.float()
        rows = values.reshape(-1, values.shape[-1])
        assert torch.isfinite(rows).all(), name
        if rows.shape[-1] >= 64:
            assert (rows.std(dim=-1) > 0).all(), name


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_full_config_on_meta_device(fmt):
    """Every shape of the 40B model, checked without allocating it."""
    weights = dummy_weights(FULL, fmt, "meta")
    check_weights(FULL, weights)
    total = 0
    for w in weights.values():
        assert w.device.type == "meta"
        total += math.prod(w.shape)
    assert total == FULL.num_parameters()["total"]
    assert abs(total / 1e9 - 39.69) < 0.01


def test_loader_dummy_format_needs_only_a_config():
    ckpt = load_checkpoint(None, load_format="dummy", config=TINY, fmt="nvfp4", progress=False)
    assert ckpt.fmt == "nvfp4" and ckpt.source == "dummy:nvfp4" and ckpt.tokenizer_dir is None
    check_weights(TINY, ckpt.weights)


def test_unknown_format():
    with pytest.raises(ValueError, match="fp8"):
        dummy_weights(TINY, "fp8")
