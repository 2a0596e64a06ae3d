"""`flintc.kernels.fused_gemv` (the decode schedule's GEMV kernels) against the reference ops.

The oracles are the ops' Python bodies (`flintc.ops.grouped`, `flintc.ops.linear`, i.e.
`torch.ops.flintc.<op>`). On the CPU the kernels run in the Triton interpreter at the
tiny config (H = 128, 8 / 2 heads of dim 32, window 9, dense F = 256, vocab 512); the
`gpu` tests run the model's shapes with PDL on and off. Inputs are fresh random values;
every tensor the launchers allocate is NaN-poisoned (torch.empty is patched), and the
KV-cache rows about to be written are NaN-poisoned while all other rows must stay
bit-identical. The kernels sum in another order than torch, so each check allows the
reordering bound plus bf16 ulps at the rounding points, asserts that most elements are
bit-identical, and reports the share of differing elements and the largest difference.
"""

from __future__ import annotations

import dataclasses

import inspect
import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the kernels need it")

import flintc.ops  # noqa: E402,F401  (registers torch.ops.flintc)
from flintc.kernels import fused_gemv as FG  # noqa: E402
from flintc.kernels.gemv import GemvConfig, _effective_split, split_k_counters  # noqa: E402
from flintc.model import ops  # noqa: E402
from flintc.ops import grouped, linear  # noqa: E402
from flintc.ops.common import as_weight  # noqa: E402
from flintc.quant.nvfp4 import NVFP4Tensor, quantize  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
EPS = 1e-5
F32 = torch.float32


def make_weight(F: int, K: int, fmt: str, device=DEV) -> list[torch.Tensor]:
    """Fresh random weights [F, K]: bf16, or NVFP4 with (nvfp4_gs) / without a global scale."""
    w = (torch.randn(F, K) * 0.05).to(torch.bfloat16)
    if fmt == "bf16":
        return [w.to(device)]
    q = quantize(w, use_global_scale=(fmt == "nvfp4_gs"))
    assert fmt != "nvfp4_gs" or float(q.global_scale) != 1.0
    return [q.codes.to(device), q.scales.to(device), q.global_scale.to(device)]


def dense(w: list[torch.Tensor]) -> torch.Tensor:
    """The weight as float64 [F, K] (global scale included)."""
    d = as_weight([t.cpu() for t in w])
    return d.dequantize(torch.float64) if isinstance(d, NVFP4Tensor) else d.double()


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of the bf16 grid at |v|, floored at the smallest normal; float64."""
    _, e = torch.frexp(v.double().abs().clamp(min=torch.finfo(torch.bfloat16).tiny))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e - 8)


def compare(name: str, out, ref, tol, min_identical: float = 0.9, tight=None,
            min_tight: float = 0.9) -> None:
    """All |out - ref| <= tol, all finite, and >= min_identical of the elements identical;
    with `tight` (for fp32 outputs, where bit-identity is not expected) also >= min_tight
    of the elements within the tight tolerance."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (name, out.shape, ref.shape)
    o, r = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(o).all(), f"{name}: {(~torch.isfinite(o)).sum()} non-finite (unwritten?)"
    diff = (o - r).abs()
    share = (out.cpu() != ref.cpu()).float().mean().item()
    msg = (f"{name}: {share:.2%} of {o.numel()} elements differ, max diff "
           f"{diff.max().item():.3g}, max diff / tolerance {(diff / tol).max().item():.2f}")
    assert bool((diff <= tol).all()), msg
    assert 1.0 - share >= min_identical, msg
    if tight is not None:
        within = (diff <= tight).double().mean().item()
        assert within >= min_tight, f"{msg}; only {within:.2%} within the tight tolerance"


def reorder_tol(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 reordering bound `K * 2^-24 * sum_k |x_k w_k|` of x [N, K] @ W^T; float64."""
    return x.shape[1] * 2.0**-24 * (x.cpu().double().abs() @ dense(w).abs().T)


def gemv_tol(h: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """Bound on |kernel - reference| of the fp32 GEMV of a normed input h [N, K] (bf16,
    reference values): the fp32 reordering bound plus one bf16 ulp of every h_k (the
    RMSNorm's sum of squares is summed in another order, so a normed value on a rounding
    boundary may land one ulp away). float64 [N, F]."""
    return reorder_tol(h, w) + bf16_ulp(h.cpu()) @ dense(w).abs().T


def gate_up_tol(x, norm, gate, up, ref) -> torch.Tensor:
    """Bound on |kernel - reference| of `norm_gate_up_silu` (x [N, 1, H] bf16, ref [N, 1, F]
    the reference's output): g and u (the fp32 GEMVs of the normed x) may each be one bf16
    ulp plus the GEMV bound (`gemv_tol`) away; silu' <= 1.1 and |silu(g)| <= |g|; plus two
    ulps of the result. float64, ref's shape (element by element: the copies this
    replaced added [N, F] terms to [N, 1, F] ones, a [N, N, F] bound that held each row to
    the smallest bound of all rows)."""
    N = x.shape[0]
    h = ops.rms_norm(x, norm, EPS, F32).view(N, -1)
    g = ops.linear(h, as_weight(gate), F32).cpu().double()
    u = ops.linear(h, as_weight(up), F32).cpu().double()
    dg = gemv_tol(h, gate) + bf16_ulp(g)
    du = gemv_tol(h, up) + bf16_ulp(u)
    return 2 * bf16_ulp(ref).cpu() + (1.1 * dg * u.abs() + du * g.abs()).view(ref.shape)


@pytest.fixture
def poison_empty(monkeypatch):
    """Make torch.empty (and empty_like) return NaN-filled floats / -1-filled ints, so an
    element a kernel fails to write (and any workspace it reads unwritten) shows up."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-1)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_like(*a, **k)))


# ----------------------------------------------------------------------------- QKV
def qkv_inputs(N, H, Hq, Hkv, D, fmt, kind, window, S_full, num_slots=10, P=4096):
    x = torch.randn(N, 1, H).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(H) + 0.5).to(DEV)
    wq, wk, wv = make_weight(Hq * D, H, fmt), make_weight(Hkv * D, H, fmt), make_weight(Hkv * D, H, fmt)
    qn, kn = (torch.rand(D) + 0.5).to(DEV), (torch.rand(D) + 0.5).to(DEV)
    cos, sin = ops.rope_tables(10000.0, D, P, F32)
    S = window if kind == "sliding" else S_full
    k_cache = torch.randn(num_slots, S, Hkv, D).to(torch.bfloat16).to(DEV)
    v_cache = torch.randn(num_slots, S, Hkv, D).to(torch.bfloat16).to(DEV)
    slots = torch.randperm(num_slots)[:N].to(DEV)
    if kind == "sliding":  # positions past the window wrap the ring (one at a multiple of W)
        pos = torch.randint(window, 6 * window, (N, 1))
        pos[0, 0] = 3 * window
    else:
        pos = torch.randint(0, S_full, (N, 1))
    return (x, norm, wq, wk, wv, qn, kn, cos.to(DEV), sin.to(DEV), k_cache, v_cache, slots,
            pos.to(DEV))


def check_qkv(args, Hq, Hkv, rope, window, config=None, use_pdl=False):
    x, norm, wq, wk, wv, qn, kn, cos, sin, kc, vc, slots, pos = args
    N, D = x.shape[0], qn.shape[0]
    rows = pos[:, 0] % window if window else pos[:, 0]
    live = slots >= 0  # a negative slot is a padding row: nothing written
    written = torch.zeros(kc.shape[:2], dtype=torch.bool, device=kc.device)
    written[slots[live], rows[live]] = True
    for c in (kc, vc):  # poison the rows about to be written
        c[written] = float("nan")
    kc_ref, vc_ref = kc.clone(), vc.clone()
    before_k, before_v = kc.clone(), vc.clone()
    q = FG.norm_qkv_rope_kv(x, norm, wq, wk, wv, qn, kn, cos, sin, kc, vc, slots, pos, EPS,
                            Hq, Hkv, rope, window, use_pdl=use_pdl, config=config)
    q_ref = grouped.norm_qkv_rope_kv(x, norm, wq, wk, wv, qn, kn, cos, sin, kc_ref, vc_ref,
                                     slots, pos, EPS, Hq, Hkv, rope, window)
    assert q.shape == (N, 1, Hq, D) and q.dtype == torch.bfloat16

    def head_tol(ref):  # a few bf16 ulps of each head's largest element
        return 4 * bf16_ulp(ref.double().abs().amax(dim=-1, keepdim=True)).expand(ref.shape).cpu()

    compare("q", q, q_ref, head_tol(q_ref))
    for name, c, c_ref, c0 in (("k_cache", kc, kc_ref, before_k), ("v_cache", vc, vc_ref, before_v)):
        # rows not written: bit-identical (NaN-safe: compare the bits)
        keep = ~written
        assert torch.equal(c[keep].view(torch.int16), c0[keep].view(torch.int16)), \
            f"{name}: rows outside (slot, position) changed"
        new, new_ref = c[written], c_ref[written]
        if name == "v_cache":  # v: the GEMV of the normed x, one rounding
            h = ops.rms_norm(x, norm, EPS, F32).view(N, -1)[live]
            # rows of c[written] are sorted by (slot, row)
            order = torch.argsort(slots[live] * 10**6 + rows[live])
            tol = gemv_tol(h, wv)[order.cpu()].view(new.shape) + bf16_ulp(new_ref).cpu()
            compare(name, new, new_ref, tol)
        else:
            compare(name, new, new_ref, head_tol(new_ref))


QKV_CPU_CASES = [
    ("bf16", 1, "sliding", None),
    ("bf16", 3, "full", GemvConfig(use_dot=False, block_k=64, split_k=2, prefetch=False)),
    ("bf16", 8, "sliding", GemvConfig(use_dot=True, block_k=32, split_k=3, prefetch=False)),
    ("nvfp4_gs", 3, "sliding", GemvConfig(use_dot=True, block_k=64, split_k=2)),
    ("nvfp4_gs", 8, "full", GemvConfig(use_dot=False, block_k=32, split_k=2, scale_after=True)),
    ("nvfp4_gs", 1, "full", None),
    ("nvfp4", 3, "sliding", GemvConfig(use_dot=False, block_k=64, split_k=1)),
    ("nvfp4_gs", 1, "full", GemvConfig(use_dot=False, block_k=64, split_k=2, acc_full=True)),
    ("bf16", 2, "sliding", GemvConfig(use_dot=False, block_k=32, split_k=2, acc_full=True)),
    # 2-D tiles (flat; NVFP4 decoded into K order) and the swapped dot (weights on the left)
    ("nvfp4_gs", 3, "sliding", GemvConfig(use_dot=True, block_k=32, split_k=2, prefetch=False,
                                          flat=True)),
    ("bf16", 8, "full", GemvConfig(use_dot=True, block_k=32, split_k=2, prefetch=False,
                                   flat=True, swap=True)),
    ("nvfp4_gs", 2, "sliding", GemvConfig(use_dot=True, block_k=64, split_k=2, swap=True)),
]


@pytest.mark.parametrize("fmt,N,kind,cfg", QKV_CPU_CASES,
                         ids=[f"{c[0]}-N{c[1]}-{c[2]}-{c[3].short().replace(' ', '_') if c[3] else 'default'}"
                              for c in QKV_CPU_CASES])
def test_norm_qkv_rope_kv(fmt, N, kind, cfg, poison_empty):
    """Tiny config: 8 / 2 heads of dim 32, H = 128; sliding layers (RoPE, ring of 9 rows,
    positions that wrap) and full layers (NoPE, row = position)."""
    window = 9 if kind == "sliding" else 0
    args = qkv_inputs(N, 128, 8, 2, 32, fmt, kind, 9, 40)
    check_qkv(args, 8, 2, kind == "sliding", window, config=cfg)
    assert int(split_k_counters(args[0].device, 1)[:64].abs().sum()) == 0


# Ragged split-K in the fused kernels: H = 320 (NVFP4 rows are multiples of 64) in steps
# of 128 over 2 splits of 256, so split 0 makes 2 steps (flat NVFP4 tiles with several K
# steps) and split 1 one step with only 64 of its 128 columns inside H.
TAIL_CONFIGS = [
    GemvConfig(use_dot=True, block_f=16, block_k=128, split_k=2, prefetch=False, flat=True,
               swap=True),
    GemvConfig(use_dot=True, block_f=16, block_k=128, split_k=2, prefetch=False, flat=True),
]


@pytest.mark.parametrize("cfg", TAIL_CONFIGS, ids=lambda c: c.short().replace(" ", "_"))
def test_fused_flat_nvfp4_ragged_split(cfg, poison_empty):
    """norm_qkv_rope_kv (sliding layer, N = 3) and norm_gate_up_silu (F = 48, N = 2) with
    NVFP4 weights (non-unit global scale) at H = 320 on flat tiles, with and without the
    swapped dot."""
    H = 320
    assert _effective_split(H, cfg.block_k, cfg.split_k) == (2, 256)
    args = qkv_inputs(3, H, 8, 2, 32, "nvfp4_gs", "sliding", 9, 40)
    check_qkv(args, 8, 2, True, 9, config=cfg)
    N, F = 2, 48
    x = torch.randn(N, 1, H).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(H) + 0.5).to(DEV)
    gate, up = make_weight(F, H, "nvfp4_gs"), make_weight(F, H, "nvfp4_gs")
    out = FG.norm_gate_up_silu(x, norm, gate, up, EPS, config=cfg)
    ref = grouped.norm_gate_up_silu(x, norm, gate, up, EPS)
    tol = gate_up_tol(x, norm, gate, up, ref)
    compare("norm_gate_up_silu", out, ref, tol)
    assert int(split_k_counters(x.device, 1)[:64].abs().sum()) == 0


# ----------------------------------------------------------------------------- gemv_residual
@pytest.mark.parametrize("fmt,N,cfg", [
    ("bf16", 3, GemvConfig(use_dot=True, block_f=32, block_k=64, split_k=2, prefetch=False)),
    ("nvfp4_gs", 8, GemvConfig(use_dot=False, block_f=32, block_k=64, split_k=1)),
    ("nvfp4_gs", 1, None),
    ("bf16", 1, GemvConfig(use_dot=False, block_f=32, block_k=64, split_k=2, acc_full=True)),
    ("nvfp4_gs", 2, GemvConfig(use_dot=True, block_f=32, block_k=64, split_k=2, prefetch=False,
                               flat=True, swap=True)),
])
def test_gemv_residual(fmt, N, cfg, poison_empty):
    """O projection shape of the tiny config: x [N, 1, Hq*D = 256] -> [N, 1, H = 128]."""
    x = torch.randn(N, 1, 256).to(torch.bfloat16).to(DEV)
    w = make_weight(128, 256, fmt)
    res = torch.randn(N, 1, 128).to(torch.bfloat16).to(DEV)
    out = FG.gemv_residual(x, w, res, config=cfg)
    ref = grouped.gemv_residual(x, w, res)
    y = ops.linear(x.view(N, -1), as_weight(w), F32)  # the rounded GEMV of the reference
    tol = (reorder_tol(x.view(N, -1), w) + bf16_ulp(y).cpu()).view(ref.shape) + bf16_ulp(ref).cpu()
    compare("gemv_residual", out, ref, tol)


# ----------------------------------------------------------------------------- gate/up
@pytest.mark.parametrize("fmt,N,cfg", [
    ("bf16", 1, None),
    ("bf16", 8, GemvConfig(use_dot=False, block_f=32, block_k=64, split_k=2)),
    ("nvfp4_gs", 3, GemvConfig(use_dot=True, block_f=64, block_k=32, split_k=4, prefetch=False)),
    ("nvfp4_gs", 1, GemvConfig(use_dot=False, block_f=32, block_k=64, split_k=2, acc_full=True)),
    ("nvfp4_gs", 2, GemvConfig(use_dot=True, block_f=32, block_k=32, split_k=2, prefetch=False,
                               flat=True)),
    ("bf16", 3, GemvConfig(use_dot=True, block_f=32, block_k=64, split_k=2, swap=True)),
    # bf16 flat tiles, split-K 3 over 8 K blocks (3, 3, 2), as session 16 run 13 swept
    ("bf16", 2, GemvConfig(use_dot=True, block_f=64, block_k=16, split_k=3, num_stages=4,
                           prefetch=False, flat=True)),
])
def test_norm_gate_up_silu(fmt, N, cfg, poison_empty):
    """Dense MLP of the tiny config: H = 128, F = 256."""
    x = torch.randn(N, 1, 128).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(128) + 0.5).to(DEV)
    gate, up = make_weight(256, 128, fmt), make_weight(256, 128, fmt)
    out = FG.norm_gate_up_silu(x, norm, gate, up, EPS, config=cfg)
    ref = grouped.norm_gate_up_silu(x, norm, gate, up, EPS)
    tol = gate_up_tol(x, norm, gate, up, ref)
    compare("norm_gate_up_silu", out, ref, tol)


# ----------------------------------------------------------------------------- LM head
@pytest.mark.parametrize("N,cfg", [(2, GemvConfig(use_dot=True, block_f=128, block_k=64, split_k=2)),
                                   (8, GemvConfig(use_dot=False, block_f=128, block_k=128))])
def test_norm_lm_head(N, cfg, poison_empty):
    """Final norm + LM head of the tiny config (vocab 512): fp32 logits, never rounded."""
    x = torch.randn(N, 1, 128).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(128) + 0.5).to(DEV)
    w = (torch.randn(512, 128) * 0.05).to(torch.bfloat16).to(DEV)
    out = FG.norm_lm_head(x, norm, w, EPS, config=cfg)
    ref = grouped.norm_lm_head(x, norm, w, EPS)
    h = ops.rms_norm(x, norm, EPS, F32).view(N, -1)
    # loose: a normed value may land one ulp away (and shift its whole row); tight: the
    # fp32 reordering bound, which nearly every logit must meet
    compare("norm_lm_head", out, ref, gemv_tol(h, [w]).view(ref.shape), min_identical=0.0,
            tight=2 * reorder_tol(h, [w]).view(ref.shape))


@pytest.mark.parametrize("N,use_dot", [(1, True), (3, False), (8, True)])
def test_norm_lm_head_norm_once(N, use_dot, poison_empty):
    """The norm-once prologue (x normed once per program into a workspace, the LM head's
    default on the GPU) gives the same bits as the per-tile prologue, and the reference's
    values within the GEMV bound; 8 K steps per program, 4 F blocks."""
    H, V = 256, 256
    x = torch.randn(N, 1, H).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(H) + 0.5).to(DEV)
    w = (torch.randn(V, H) * 0.05).to(torch.bfloat16).to(DEV)
    base = dict(use_dot=use_dot, block_f=64, block_k=32, split_k=1)
    once = FG.norm_lm_head(x, norm, w, EPS, config=GemvConfig(**base, norm_once=True))
    per_tile = FG.norm_lm_head(x, norm, w, EPS, config=GemvConfig(**base, norm_once=False))
    auto = FG.norm_lm_head(x, norm, w, EPS, config=GemvConfig(**base))  # 8 steps >= 4: once
    assert torch.equal(once, per_tile), (once - per_tile).abs().max()
    assert torch.equal(once, auto)
    ref = grouped.norm_lm_head(x, norm, w, EPS)
    h = ops.rms_norm(x, norm, EPS, F32).view(N, -1)
    compare("norm_lm_head", once, ref, gemv_tol(h, [w]).view(ref.shape), min_identical=0.0,
            tight=2 * reorder_tol(h, [w]).view(ref.shape))


@pytest.mark.parametrize("N", [1, 2, 8])
def test_split_norm_then_lm_head(N, poison_empty):
    """The build option split_lm_head_norm's two kernels, the final norm alone
    (`FG.rms_norm`: the prefill's kernel, with PDL on a GPU) then the plain LM head, against
    `norm_lm_head`: the normed x within a bf16 ulp of the reference's (the sum of squares in
    another order) and the logits the fused kernel's; bit-identical in the interpreter."""
    x = torch.randn(N, 1, 128).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(128) + 0.5).to(DEV)
    w = (torch.randn(512, 128) * 0.05).to(torch.bfloat16).to(DEV)
    fused = FG.norm_lm_head(x, norm, w, EPS, use_pdl=ON_GPU)
    xn = FG.rms_norm(x, norm, EPS, use_pdl=ON_GPU)
    assert xn.shape == x.shape and xn.dtype == torch.bfloat16
    split = FG.lm_head(xn.view(N, 128), w, use_pdl=ON_GPU).view(fused.shape)
    want = ops.rms_norm(x, norm, EPS, F32)
    if not ON_GPU:
        assert torch.equal(xn, want) and torch.equal(split, fused), (split - fused).abs().max()
        return
    assert ((xn.double() - want.double()).abs().cpu() <= bf16_ulp(want.cpu())).all()
    h = want.view(N, -1)
    # each within gemv_tol of the reference (session 36's H100: identical)
    compare("rms_norm + lm_head", split, fused, 2 * gemv_tol(h, [w]).view(fused.shape), min_identical=0.0,
            tight=2 * reorder_tol(h, [w]).view(fused.shape))


@pytest.mark.parametrize("N,norm_once", [(1, True), (5, False)])
def test_norm_lm_head_flat_tiles(N, norm_once, poison_empty):
    """`GemvConfig.flat` (2-D weight and x tiles) computes the same normed x and the same
    products as the 3-D tiles: the logits agree within the fp32 reordering bound (the dot
    may sum in another order), and nearly all are bit-identical here (exact products);
    with and without the norm-once prologue, split-K 2 and a short last F block."""
    H, V = 256, 200
    x = torch.randn(N, 1, H).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(H) + 0.5).to(DEV)
    w = (torch.randn(V, H) * 0.05).to(torch.bfloat16).to(DEV)
    base = dict(use_dot=True, block_f=64, block_k=64, split_k=2, norm_once=norm_once,
                prefetch=False)
    flat = FG.norm_lm_head(x, norm, w, EPS, config=GemvConfig(**base, flat=True))
    tiles3 = FG.norm_lm_head(x, norm, w, EPS, config=GemvConfig(**base))
    h = ops.rms_norm(x, norm, EPS, F32).view(N, -1)
    compare("norm_lm_head[flat]", flat, tiles3, 2 * reorder_tol(h, [w]).view(flat.shape),
            min_identical=0.5)
    ref = grouped.norm_lm_head(x, norm, w, EPS)
    compare("norm_lm_head[flat]", flat, ref, gemv_tol(h, [w]).view(ref.shape), min_identical=0.0,
            tight=2 * reorder_tol(h, [w]).view(ref.shape))


def test_lm_head_config_with_the_norm_prologue(monkeypatch):
    """The LM head's default on a GPU (132 SMs, no TUNED entry): 128 x 128 flat tiles on 4
    warps without the norm; with the RMSNorm prologue (`norm_lm_head`) 256 x 128 on 8 warps,
    half the programs each norming x (H100, session 36: 209 / 229 us at N = 1 / 8 against
    223 / 242)."""
    from flintc.kernels import gemv as G

    monkeypatch.setattr(G, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    for n in (1, 8):
        assert G.tuned_config(("bf16", 151552, 2048, n)) is None
        plain = G.choose_config(n, 151552, 2048, "bf16", cuda)
        normed = G.choose_config(n, 151552, 2048, "bf16", cuda, norm=True)
        assert (plain.block_f, plain.num_warps) == (128, 4)
        assert (normed.block_f, normed.num_warps) == (256, 8)
        assert dataclasses.replace(normed, block_f=128, num_warps=4) == plain
        assert normed.flat and normed.use_dot and normed.split_k == 1
    # other shapes: the norm changes nothing
    assert (G.choose_config(1, 2048, 4096, "bf16", cuda, norm=True)
            == G.choose_config(1, 2048, 4096, "bf16", cuda))
    # a measured entry of the plain LM head does not reach the normed one, nor the reverse
    tuned_plain = G.GemvConfig(use_dot=True, block_f=64, block_k=128, num_warps=4)
    tuned_norm = G.GemvConfig(use_dot=True, block_f=512, block_k=64, num_warps=8)
    monkeypatch.setitem(G.TUNED, ("bf16", 151552, 2048, 1), tuned_plain)
    assert G.choose_config(1, 151552, 2048, "bf16", cuda) == tuned_plain
    assert G.choose_config(1, 151552, 2048, "bf16", cuda, norm=True) == normed
    monkeypatch.setitem(G.TUNED, ("norm:bf16", 151552, 2048, 1), tuned_norm)
    assert G.choose_config(1, 151552, 2048, "bf16", cuda, norm=True) == tuned_norm
    assert G.choose_config(1, 151552, 2048, "bf16", cuda) == tuned_plain


@pytest.mark.parametrize("N", [1, 8])
def test_norm_lm_head_default_gpu_tiles(N, poison_empty):
    """The GPU default of `norm_lm_head` (256 x 128 flat tiles, 8 warps, norm once per
    program) at a small shape: 3 F blocks (the last one short), 2 K steps; equal to the
    128 x 128 / 4-warp tiles within the fp32 reordering bound and to the reference within
    the GEMV bound."""
    H, V = 256, 600
    x = torch.randn(N, 1, H).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(H) + 0.5).to(DEV)
    w = (torch.randn(V, H) * 0.05).to(torch.bfloat16).to(DEV)
    base = dict(use_dot=True, block_k=128, split_k=1, num_stages=3, prefetch=False, flat=True,
                norm_once=True)
    wide = FG.norm_lm_head(x, norm, w, EPS, config=GemvConfig(**base, block_f=256, num_warps=8))
    narrow = FG.norm_lm_head(x, norm, w, EPS, config=GemvConfig(**base, block_f=128, num_warps=4))
    h = ops.rms_norm(x, norm, EPS, F32).view(N, -1)
    compare("norm_lm_head[f256]", wide, narrow, 2 * reorder_tol(h, [w]).view(wide.shape),
            min_identical=0.5)
    ref = grouped.norm_lm_head(x, norm, w, EPS)
    compare("norm_lm_head[f256]", wide, ref, gemv_tol(h, [w]).view(ref.shape), min_identical=0.0,
            tight=2 * reorder_tol(h, [w]).view(ref.shape))


def test_lm_head_and_gemv_entries(poison_empty):
    x = torch.randn(3, 128).to(torch.bfloat16).to(DEV)
    w = (torch.randn(512, 128) * 0.05).to(torch.bfloat16).to(DEV)
    cfg = GemvConfig(use_dot=True, block_f=128, block_k=128)
    out = FG.lm_head(x, w, config=cfg)
    compare("lm_head", out, linear.lm_head(x, w), reorder_tol(x, [w]), min_identical=0.0)
    wg = make_weight(40, 128, "nvfp4_gs")
    y = FG.gemv(x, wg)
    compare("gemv", y, linear.gemv(x, wg), reorder_tol(x, wg) + bf16_ulp(y).cpu())


# ----------------------------------------------------------------------------- embedding
def test_embedding_bit_exact(poison_empty):
    table = torch.randn(512, 128).to(torch.bfloat16).to(DEV)
    ids = torch.tensor([[0, 511, 7], [300, 7, 1]]).to(DEV)
    out = FG.embedding(ids, table)
    assert torch.equal(out, linear.embedding(ids, table))


# ----------------------------------------------------------------------------- contract
def test_kernels_table_matches_the_ops():
    """KERNELS: every op of this file, launchers with the op's positional parameters plus
    keyword-only use_pdl."""
    from flintc.ops import grouped as og, linear as ol, norm as on

    want = {"norm_qkv_rope_kv": og.norm_qkv_rope_kv, "gemv_residual": og.gemv_residual,
            "norm_gate_up_silu": og.norm_gate_up_silu, "norm_lm_head": og.norm_lm_head,
            "embedding": ol.embedding, "gemv": ol.gemv, "lm_head": ol.lm_head, "rms_norm": on.rms_norm}
    assert set(FG.KERNELS) == set(want)
    for name, launcher in FG.KERNELS.items():
        params = inspect.signature(launcher).parameters
        positional = [p.name for p in params.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        ref_params = list(inspect.signature(want[name]._init_fn if hasattr(want[name], "_init_fn")
                                            else want[name]).parameters)
        assert len(positional) == len(ref_params), (name, positional, ref_params)
        assert params["use_pdl"].kind == inspect.Parameter.KEYWORD_ONLY


def test_fallbacks_for_big_batches():
    """N > 8 (and T > 1 for QKV) go to the reference op, as the docstrings say."""
    x = torch.randn(9, 1, 128).to(torch.bfloat16).to(DEV)
    norm = (torch.rand(128) + 0.5).to(DEV)
    w = (torch.randn(512, 128) * 0.05).to(torch.bfloat16).to(DEV)
    assert torch.equal(FG.norm_lm_head(x, norm, w, EPS), grouped.norm_lm_head(x, norm, w, EPS))
    args = list(qkv_inputs(2, 128, 8, 2, 32, "bf16", "full", 9, 40))
    args[0] = torch.randn(2, 2, 128).to(torch.bfloat16).to(DEV)  # T = 2 (prefill)
    args[12] = torch.tensor([[3, 4], [7, 8]]).to(DEV)
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    q = FG.norm_qkv_rope_kv(*args, EPS, 8, 2, False, 0)
    q_ref = grouped.norm_qkv_rope_kv(*ref_args, EPS, 8, 2, False, 0)
    assert torch.equal(q, q_ref) and torch.equal(args[9], ref_args[9])


def _bad_calls():
    args = qkv_inputs(2, 128, 8, 2, 32, "bf16", "sliding", 9, 40)
    x, norm, wq, wk, wv, qn, kn, cos, sin, kc, vc, slots, pos = args

    def qkv(**over):
        a = dict(x=x, norm=norm, wq=wq, wk=wk, wv=wv, q_norm=qn, k_norm=kn, cos_table=cos,
                 sin_table=sin, k_cache=kc, v_cache=vc, slots=slots, positions=pos)
        a.update(over)
        return lambda: FG.norm_qkv_rope_kv(*a.values(), EPS, 8, 2, True, 9)

    x2 = torch.randn(2, 256).to(torch.bfloat16).to(DEV)
    w = make_weight(128, 256, "bf16")
    res = torch.randn(2, 128).to(torch.bfloat16).to(DEV)
    return [
        ("norm_qkv_rope_kv: x", qkv(x=x.float())),
        ("norm_qkv_rope_kv: norm", qkv(norm=norm[:64].contiguous())),
        ("norm_qkv_rope_kv: wk", qkv(wk=[wk[0][:32].contiguous()])),
        ("norm_qkv_rope_kv: k_norm", qkv(k_norm=kn.double())),
        ("norm_qkv_rope_kv: cos_table", qkv(cos_table=cos[:, :8].contiguous())),
        ("norm_qkv_rope_kv: k_cache", qkv(k_cache=kc.transpose(0, 1))),
        ("norm_qkv_rope_kv: v_cache", qkv(v_cache=vc.float())),
        ("norm_qkv_rope_kv: slots", qkv(slots=slots.float())),
        ("norm_qkv_rope_kv: positions", qkv(positions=pos.view(-1))),
        ("norm_qkv_rope_kv: window", lambda: FG.norm_qkv_rope_kv(*args, EPS, 8, 2, True, 10)),
        ("gemv_residual: residual", lambda: FG.gemv_residual(x2, w, res[:, :64])),
        ("gemv_residual: w", lambda: FG.gemv_residual(x2, [w[0].float()], res)),
        ("norm_gate_up_silu: up", lambda: FG.norm_gate_up_silu(
            x2[:, :128].contiguous(), norm, make_weight(64, 128, "bf16"),
            make_weight(64, 128, "nvfp4"), EPS)),
        ("norm_gate_up_silu: norm", lambda: FG.norm_gate_up_silu(
            x2[:, :128].contiguous(), norm.half(), make_weight(64, 128, "bf16"),
            make_weight(64, 128, "bf16"), EPS)),
        ("norm_lm_head: w", lambda: FG.norm_lm_head(x2[:, None, :128].contiguous(), norm,
                                                    w[0].float(), EPS)),
        ("embedding: ids", lambda: FG.embedding(slots.float()[None], w[0])),
        ("embedding: table", lambda: FG.embedding(slots[None], w[0].float())),
    ]


@pytest.mark.parametrize("case", range(17))
def test_rejects_bad_inputs(case):
    calls = _bad_calls()
    assert len(calls) == 17
    name, call = calls[case]
    with pytest.raises(ValueError, match=name):
        call()


# ----------------------------------------------------------------------------- GPU
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("kind", ["sliding", "full"])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
@pytest.mark.parametrize("N", [1, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_norm_qkv_rope_kv_gpu(N, fmt, kind, use_pdl):
    """Full model: H = 2048, 32 / 4 heads of dim 128, window 513, full cache of 2048 rows."""
    window = 513 if kind == "sliding" else 0
    args = qkv_inputs(N, 2048, 32, 4, 128, fmt, kind, 513, 2048)
    check_qkv(args, 32, 4, kind == "sliding", window, use_pdl=use_pdl)


MMA_QKV_LAUNCHES = [("nvfp4_gs", None), ("nvfp4_gs", (1, 16, 1)), ("nvfp4_gs", (2, 8, 1)),
                    ("nvfp4_gs", (2, 16, 1)), ("nvfp4_gs", (8, 4, 1)), ("nvfp4_gs", (4, 8, 2)),
                    ("nvfp4_gs", (1, 2, 1)), ("bf16", None), ("bf16", (4, 16, 4)),
                    ("bf16", (8, 8, 4)), ("bf16", (2, 8, 2)), ("bf16", (1, 4, 1)),
                    ("bf16", (8, 16, 8))]


@pytest.mark.parametrize("fmt,launch", MMA_QKV_LAUNCHES,
                         ids=[f"{f}-" + (f"cl{c[0]}w{c[1]}r{c[2]}" if c else "default")
                              for f, c in MMA_QKV_LAUNCHES])
@pytest.mark.parametrize("kind", ["sliding", "full"])
@pytest.mark.parametrize("N", [1, 3, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_mma_qkv_gpu(N, kind, fmt, launch, monkeypatch):
    """The CUDA fused QKV kernel (`nvfp4_mma.mma_qkv`) on NVFP4 weights in the mma layout
    (as the runtime runs them after `prepack`) and on bf16 weights: full model shapes,
    every (cluster, warps, row_groups) launch given, PDL on; int32 slots with a padding
    row (slot -1: nothing written), bf16 head norms. CPU twins: test_norm_qkv_rope_kv
    (the same op on the Triton kernel) and test_nvfp4_mma.py's NVRTC compile of the QKV
    source."""
    from flintc.kernels import nvfp4_mma as M

    if not M.supported(torch.device("cuda")):
        pytest.skip("the CUDA mma kernels need sm_90+ and NVRTC")
    if launch is not None:
        monkeypatch.setattr(M, "qkv_launch_config", lambda *a: launch)
    calls = []
    real = M.mma_qkv
    monkeypatch.setattr(M, "mma_qkv", lambda *a, **k: calls.append(k) or real(*a, **k))
    window = 513 if kind == "sliding" else 0
    x, norm, wq, wk, wv, qn, kn, *rest = qkv_inputs(N, 2048, 32, 4, 128, fmt, kind, 513, 2048)
    if fmt != "bf16":
        wq, wk, wv = ([*M.pack_mma_stack(w[0], w[1]), w[2]] for w in (wq, wk, wv))
    kn = kn.to(torch.bfloat16)
    cos, sin, kc, vc, slots, pos = rest
    slots = slots.to(torch.int32)
    if N > 1:
        slots[1] = -1
    check_qkv((x, norm, wq, wk, wv, qn, kn, cos, sin, kc, vc, slots, pos), 32, 4,
              kind == "sliding", window, use_pdl=True)
    assert len(calls) == 1


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
@pytest.mark.parametrize("N", [1, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_fused_swap_and_flat_configs_gpu(N, fmt):
    """Every candidate of the "swap" sweep family (`flintc.kernels.gemv.swap_configs`: the
    swapped dot, 3-D and flat tiles, flat NVFP4) in the fused QKV kernel (full layer,
    one head per program) and in norm_gate_up_silu (dense MLP) at full shapes, with PDL
    (CPU twins: QKV_CPU_CASES, test_norm_gate_up_silu)."""
    import triton

    from flintc.kernels.gemv import swap_configs

    args = qkv_inputs(N, 2048, 32, 4, 128, fmt, "full", 513, 2048)
    key = "nvfp4" if fmt.startswith("nvfp4") else "bf16"
    for cfg in swap_configs(key, N, 32 * 128, 2048, torch.device("cuda"), rows_fixed=128):
        try:
            check_qkv(args, 32, 4, False, 0, config=cfg, use_pdl=True)
        except triton.runtime.errors.OutOfResources:
            continue
    # the dense MLP's norm_gate_up_silu (F = 10240), block_f halved as bench_gemv.py does
    x = torch.randn(N, 1, 2048, device="cuda").to(torch.bfloat16)
    norm = torch.rand(2048, device="cuda") + 0.5
    gate, up = make_weight(10240, 2048, fmt), make_weight(10240, 2048, fmt)
    ref = grouped.norm_gate_up_silu(x, norm, gate, up, EPS)
    tol = gate_up_tol(x, norm, gate, up, ref)
    for cfg in swap_configs(key, N, 2 * 10240, 2048, torch.device("cuda")):
        cfg = dataclasses.replace(cfg, block_f=max(16, cfg.block_f // 2))
        try:
            out = FG.norm_gate_up_silu(x, norm, gate, up, EPS, use_pdl=True, config=cfg)
        except triton.runtime.errors.OutOfResources:
            continue
        compare(f"norm_gate_up_silu[{cfg.short()}]", out, ref, tol)


@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
@pytest.mark.parametrize("N", [1, 2, 4, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_fused_mlp_and_residual_gpu(N, fmt, use_pdl):
    """Dense MLP (F = 10240) and the O / down projections with the residual add, with
    each N's default config (bf16 N = 2, 4: their own TUNED entries)."""
    x = torch.randn(N, 1, 2048, device="cuda").to(torch.bfloat16)
    norm = torch.rand(2048, device="cuda") + 0.5
    gate, up = make_weight(10240, 2048, fmt), make_weight(10240, 2048, fmt)
    out = FG.norm_gate_up_silu(x, norm, gate, up, EPS, use_pdl=use_pdl)
    ref = grouped.norm_gate_up_silu(x, norm, gate, up, EPS)
    tol = gate_up_tol(x, norm, gate, up, ref)
    compare("norm_gate_up_silu", out, ref, tol)
    for K in (4096, 10240):  # o_proj, dense down
        xo = torch.randn(N, 1, K, device="cuda").to(torch.bfloat16)
        w = make_weight(2048, K, fmt)
        res = torch.randn(N, 1, 2048, device="cuda").to(torch.bfloat16)
        out = FG.gemv_residual(xo, w, res, use_pdl=use_pdl)
        ref = grouped.gemv_residual(xo, w, res)
        y = ops.linear(xo.view(N, -1), as_weight(w), F32)
        tol = ((reorder_tol(xo.view(N, -1), w) + bf16_ulp(y).cpu()).view(ref.shape)
               + bf16_ulp(ref).cpu())
        compare(f"gemv_residual K={K}", out, ref, tol)


@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("N", [1, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_norm_lm_head_gpu(N, use_pdl):
    x = torch.randn(N, 1, 2048, device="cuda").to(torch.bfloat16)
    norm = torch.rand(2048, device="cuda") + 0.5
    w = (torch.randn(151552, 2048, device="cuda") * 0.05).to(torch.bfloat16)
    out = FG.norm_lm_head(x, norm, w, EPS, use_pdl=use_pdl)
    ref = grouped.norm_lm_head(x, norm, w, EPS)
    h = ops.rms_norm(x, norm, EPS, F32).view(N, -1)
    compare("norm_lm_head", out, ref, gemv_tol(h, [w]).view(ref.shape), min_identical=0.0,
            tight=2 * reorder_tol(h, [w]).view(ref.shape), min_tight=0.5)
    ids = torch.randint(0, 151552, (N, 1), device="cuda")
    assert torch.equal(FG.embedding(ids, w, use_pdl=use_pdl), linear.embedding(ids, w))


@pytest.mark.parametrize("hq,hkv", [(32, 4), (16, 8), (8, 1)])
def test_qkv_split_rule_counts_every_head_program(monkeypatch, hq, hkv):
    """`qkv_config`'s split-K rule sizes the grid for one wave of ~2 programs per SM over
    all Hq + 2 Hkv head programs (the kernel's grid is (Hq + 2 Hkv, split)): counting the
    query heads only gave the full model 320 programs for 264 resident slots, 1.21 waves
    (Nsight Compute, docs/gpu-runs.md session 11). Shapes outside TUNED, 132 SMs."""
    from flintc.kernels import gemv as G

    monkeypatch.setattr(G, "sm_count", lambda device: 132)
    H = 1024  # not a TUNED shape: the rule decides
    for fmt in ("bf16", "nvfp4"):
        cfg = FG.qkv_config(1, H, 64, hq, fmt, torch.device("cuda"), kv_heads=hkv)
        programs = (hq + 2 * hkv) * cfg.split_k
        assert programs <= 2 * 132, (fmt, cfg.split_k)
        assert (hq + 2 * hkv) * (cfg.split_k + 1) > 2 * 132 or cfg.split_k == H // 128, cfg


def test_gate_up_config_falls_back_to_tensor_core_entries_for_bf16():
    """`norm_gate_up_silu`'s default config: the TUNED entry where there is one (N = 1
    and 8; bf16 also 2 and 4); bf16 at N = 3, 5-7 takes the next larger N's tensor-core
    entry (the rule's 3-D tiles measured 782.7 us at N = 2 on the H200 against 38.2),
    NVFP4 keeps the rule there (faster than the N = 8 entry)."""
    from flintc.kernels.gemv import TUNED, choose_config

    cpu = torch.device("cpu")
    F, H = 10240, 2048
    for fmt, ns in (("bf16", (1, 2, 4, 8)), ("nvfp4", (1, 8))):
        for n in ns:
            assert FG.gate_up_config(fmt, F, H, n, cpu) == TUNED[("gate_up:" + fmt, F, H, n)]
    for n, tuned_n in ((3, 4), (5, 8), (6, 8), (7, 8)):
        assert FG.gate_up_config("bf16", F, H, n, cpu) == TUNED[("gate_up:bf16", F, H, tuned_n)]
    assert TUNED[("gate_up:bf16", F, H, 2)].use_dot and TUNED[("gate_up:bf16", F, H, 4)].use_dot
    for n in range(2, 8):
        base = choose_config(n, 2 * F, H, "nvfp4", cpu, flat_ok=False)
        got = FG.gate_up_config("nvfp4", F, H, n, cpu)
        assert got.block_f == max(16, base.block_f // 2) and got.use_dot == base.use_dot
    for fmt, n in (("BF16", 1), ("fp8", 1), ("bf16", 0), ("nvfp4", 9)):
        with pytest.raises(ValueError, match="fmt must be 'bf16' or 'nvfp4' and N in"):
            FG.gate_up_config(fmt, F, H, n, cpu)
    small = FG.gate_up_config("bf16", 64, 128, 2, cpu)  # no TUNED entry at all: the rule
    assert small.block_f == max(16, choose_config(2, 128, 128, "bf16", cpu,
                                                  flat_ok=False).block_f // 2)


def test_mma_qkv_falls_back_only_while_capturing(monkeypatch):
    """`_mma_qkv` hands a RuntimeError of the CUDA kernel (packed weights first seen during
    CUDA-graph capture: their repack is eager) to the Triton kernel only while a graph is
    being captured; otherwise it propagates (CPU: the CUDA entry points replaced)."""
    from flintc.kernels import nvfp4_mma

    def fail(*args, **kwargs):
        raise RuntimeError("nvfp4_mma: a weight was first seen during CUDA-graph capture")

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(nvfp4_mma, "qkv_applies", lambda *a: True)
    monkeypatch.setattr(nvfp4_mma, "available", lambda dev: True)
    monkeypatch.setattr(nvfp4_mma, "mma_qkv", fail)
    x2 = torch.zeros(1, 128, dtype=torch.bfloat16)
    w = [torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), None]
    q = torch.empty(1, 2, 64, dtype=torch.bfloat16)
    args = (x2, None, w, w, w, None, None, None, None, None, None, torch.zeros(1),
            torch.zeros(1), 1e-5, 2, 1, True, 0, q)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert FG._mma_qkv(*args, converted=False, use_pdl=False) is False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(RuntimeError, match="first seen during CUDA-graph capture"):
        FG._mma_qkv(*args, converted=False, use_pdl=False)
