"""Padding rows of a decode bucket (`flintc.ops.attention.pad_slot`): a negative slot
writes no KV-cache row and reads none, in the torch ops (the oracles) and in the Triton
kernels (interpreter on the CPU), so the runtime needs no scratch slot.

Each check: the caches are bit-identical afterwards except the live rows' own
(slot, row) cells, the live rows' outputs equal a call without the padding rows (the
kernels' rows do not interact), and a padding row's attention is empty (o = 0, lse =
-inf; after the combine with the sink: 0)."""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import flintc.ops  # noqa: E402,F401  (registers torch.ops.flintc)
from flintc.kernels import decode_attention as DA  # noqa: E402
from flintc.kernels import fused_gemv as FG  # noqa: E402
from flintc.model import ops  # noqa: E402
from flintc.ops import grouped  # noqa: E402
from flintc.ops.attention import cache_slots, pad_slot, write_kv_padded  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_pad_slot_encoding():
    assert pad_slot(0) == -1 and pad_slot(3) == -4
    s = torch.tensor([2, pad_slot(0), 5, pad_slot(4)])
    assert cache_slots(s).tolist() == [2, 0, 5, 4]
    with pytest.raises(ValueError, match="free_slot"):
        pad_slot(-1)


@pytest.mark.parametrize("window,T", [(0, 1), (9, 1), (9, 12), (0, 3)])
def test_write_kv_skips_padding_rows(window, T):
    """The torch write: padding rows (on free slot 0, at the live rows' own positions
    too) change nothing; live rows write what a call without them writes."""
    g = torch.Generator().manual_seed(1)
    S = window or 40
    kc = torch.randn(4, S, 2, 8, generator=g).to(torch.bfloat16)
    vc = torch.randn(4, S, 2, 8, generator=g).to(torch.bfloat16)
    k = torch.randn(3, T, 2, 8, generator=g).to(torch.bfloat16)
    v = torch.randn(3, T, 2, 8, generator=g).to(torch.bfloat16)
    pos = torch.arange(T)[None, :] + torch.tensor([[20], [20], [7]])  # a pad row at a live position
    slots = torch.tensor([2, pad_slot(0), 3])
    kc1, vc1 = kc.clone(), vc.clone()
    write_kv_padded(kc1, vc1, k, v, slots, pos, window)
    kc2, vc2 = kc.clone(), vc.clone()
    live = torch.tensor([0, 2])
    write_kv_padded(kc2, vc2, k[live], v[live], slots[live], pos[live], window)
    assert torch.equal(bits(kc1), bits(kc2)) and torch.equal(bits(vc1), bits(vc2))
    assert torch.equal(bits(kc1[0]), bits(kc[0])) and torch.equal(bits(kc1[1]), bits(kc[1]))


def same_rows(a: torch.Tensor, b: torch.Tensor, name: str) -> bool:
    """The live rows of a padded call against a call without the padding row: bit for bit,
    except the torch op on CUDA, whose cuBLAS batched matmuls may take another reduction
    order for another batch size (session 34, on an H100: the ring case's fp32 outputs
    differed in their last bits). There: within fp32 rounding (rtol 1e-5) for fp32
    tensors, one bf16 ulp (rtol 2^-7: an ulp of x in [2^e, 2^(e+1)) is 2^(e-7)) for bf16
    ones; -inf entries must match exactly."""
    if name == "kernel" or a.device.type != "cuda":
        return torch.equal(a, b)
    rtol = 2.0 ** -7 if a.dtype == torch.bfloat16 else 1e-5
    return torch.allclose(a.float(), b.float(), rtol=rtol, atol=1e-6, equal_nan=False)


@pytest.mark.parametrize("window,S,splits", [(0, 48, 3), (9, 9, 2)])
def test_decode_attention_padding_rows(window, S, splits):
    """Kernel and torch op: a padding row reads nothing (every split empty, combined
    output 0, finite); the live rows equal a call without the padding row (`same_rows`)."""
    g = torch.Generator(device=DEV).manual_seed(2)
    Hq, Hkv, D = 8, 2, 32
    q = torch.randn(3, 1, Hq, D, generator=g, device=DEV).to(torch.bfloat16)
    kc = torch.randn(4, S, Hkv, D, generator=g, device=DEV).to(torch.bfloat16)
    vc = torch.randn(4, S, Hkv, D, generator=g, device=DEV).to(torch.bfloat16)
    sinks = torch.randn(Hq, generator=g, device=DEV)
    slots = torch.tensor([3, pad_slot(0), 1], device=DEV)
    pos = torch.tensor([[30], [0], [12]], device=DEV) if window == 0 else torch.tensor([[30], [0], [5]], device=DEV)
    live = torch.tensor([0, 2], device=DEV)
    for name, attn, comb in (
        ("kernel", lambda *a: DA.launch_decode_attention(*a), DA.attention_combine),
        ("torch op", torch.ops.flintc.decode_attention, torch.ops.flintc.attention_combine),
    ):
        o, lse = attn(q, kc, vc, slots, pos, window, splits)
        o_l, lse_l = attn(q[live], kc, vc, slots[live], pos[live], window, splits)
        assert same_rows(o[live], o_l, name) and same_rows(lse[live], lse_l, name), name
        assert torch.equal(o[1], torch.zeros_like(o[1])), name
        assert bool((lse[1] == float("-inf")).all()), name
        out = comb(o, lse, sinks)
        assert torch.isfinite(out.float()).all() and not out[1].float().abs().any(), name
    # the combine in the attention launch (decode_attention_combine), kernel and op
    for name, fused in (("kernel", DA.decode_attention_combine),
                        ("torch op", torch.ops.flintc.decode_attention_combine)):
        out = fused(q, kc, vc, slots, pos, sinks, window, splits)
        out_l = fused(q[live], kc, vc, slots[live], pos[live], sinks, window, splits)
        assert same_rows(out[live], out_l, name), name
        assert torch.isfinite(out.float()).all() and not out[1].float().abs().any(), name


@pytest.mark.parametrize("fmt,kind", [("bf16", "full"), ("nvfp4", "sliding")])
def test_norm_qkv_rope_kv_padding_rows(fmt, kind):
    """The fused QKV kernel and its reference op with a padding row whose free slot is 0:
    the caches change only at the live rows' cells, identically for both, and the live
    rows' q equal a call without the padding row."""
    from flintc.quant.nvfp4 import quantize

    g = torch.Generator().manual_seed(3)
    H, Hq, Hkv, D, W = 128, 8, 2, 32, 9

    def weight(F):
        w = (torch.randn(F, H, generator=g) * 0.05).to(torch.bfloat16)
        if fmt == "bf16":
            return [w.to(DEV)]
        q = quantize(w)
        return [q.codes.to(DEV), q.scales.to(DEV), q.global_scale.to(DEV)]

    x = torch.randn(3, 1, H, generator=g).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(H, generator=g) + 0.5).to(DEV)
    wq, wk, wv = weight(Hq * D), weight(Hkv * D), weight(Hkv * D)
    qn, kn = (torch.rand(D, generator=g) + 0.5).to(DEV), (torch.rand(D, generator=g) + 0.5).to(DEV)
    cos, sin = (t.to(DEV) for t in ops.rope_tables(10000.0, D, 64, torch.float32))
    S = W if kind == "sliding" else 40
    window, rope = (W, True) if kind == "sliding" else (0, False)
    kc = torch.randn(4, S, Hkv, D, generator=g).to(torch.bfloat16).to(DEV)
    vc = torch.randn(4, S, Hkv, D, generator=g).to(torch.bfloat16).to(DEV)
    slots = torch.tensor([2, pad_slot(0), 3], device=DEV)
    pos = torch.tensor([[20], [0], [11]], device=DEV)
    live = torch.tensor([0, 2], device=DEV)
    rows = pos[live, 0] % W if window else pos[live, 0]
    touched = torch.zeros(kc.shape[:2], dtype=torch.bool, device=DEV)
    touched[slots[live], rows] = True
    res = {}
    for name, fn in (("kernel", FG.norm_qkv_rope_kv), ("reference", grouped.norm_qkv_rope_kv)):
        k1, v1 = kc.clone(), vc.clone()
        q = fn(x, norm, wq, wk, wv, qn, kn, cos, sin, k1, v1, slots, pos, EPS, Hq, Hkv, rope, window)
        k2, v2 = kc.clone(), vc.clone()
        q_l = fn(x[live], norm, wq, wk, wv, qn, kn, cos, sin, k2, v2, slots[live], pos[live], EPS,
                 Hq, Hkv, rope, window)
        assert torch.equal(bits(q[live]), bits(q_l)), name
        assert torch.equal(bits(k1), bits(k2)) and torch.equal(bits(v1), bits(v2)), name
        assert torch.equal(bits(k1[~touched]), bits(kc[~touched])), name
        assert not torch.equal(bits(k1[touched]), bits(kc[touched])), name  # the live rows were written
        res[name] = (k1, v1)
    # kernel vs reference on the written cells: within a few bf16 ulps (summation order)
    for a, b in zip(res["kernel"], res["reference"]):
        assert (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max()
