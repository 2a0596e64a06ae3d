"""Prefill GEMM, LM head, embedding (`flintc.kernels.gemm`) and the MoE route / grouped
gate-up / down-combine (`flintc.kernels.grouped_gemm`) against the reference ops
(`torch.ops.flintc.*`, FLINT_SPEC section 3).

CPU: tiny config (H=128, E=16, F=64, top-6), N in {1, 7, 64}, bf16 and NVFP4 weights
(per-expert global scales != 1), each MoE implementation ("triton" under the Triton
interpreter, "grouped_mm", "loop"), an expert nobody selects, all tokens on the same
experts. `gpu` tests: the full model's shapes, N in {512, 2048}.

Expected agreement: ids and routing weights bit-identical on CPU (same logits); bf16
outputs equal up to the GEMMs' fp32 summation order, i.e. within the bounds computed
below from the reference's own intermediates, and bit-identical in most elements. Every
comparison reports the share of differing elements and the largest difference. Outputs
are allocated NaN-poisoned (through the launchers' `_alloc` seam), so an unwritten
element fails the finiteness check.
"""

from __future__ import annotations

import functools
import os

# The interpreter must be chosen before triton decorates any kernel (no GPU in CI).
if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the prefill kernels need it")

import flintc.ops  # noqa: F401  (registers torch.ops.flintc.*)
from flintc.config import FlintConfig
from flintc.kernels import gemm as G
from flintc.kernels import grouped_gemm as GG
from flintc.kernels import platform
from flintc.ops.common import as_weight
from flintc.quant.nvfp4 import NVFP4Tensor, dequantize_packed, quantize

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
TINY = FlintConfig.preset("tiny")
H, E, F, TOPK = TINY.hidden_size, TINY.n_routed_experts, TINY.moe_intermediate_size, \
    TINY.num_experts_per_tok
SCALING = TINY.routed_scaling_factor
GPU_IMPLS = ["triton", "grouped_mm"]


# ---------------------------------------------------------------------------- helpers
def make_weight(shape, fmt: str, device=DEV, gen=None) -> list[torch.Tensor]:
    """Fresh random weights [..., F, K]: bf16, or NVFP4 with a global scale per matrix
    (amax / (6 * 448), never 1)."""
    w = (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)
    if fmt == "bf16":
        return [w.to(device)]
    q = quantize(w, use_global_scale=True)
    assert bool((q.global_scale != 1.0).all())
    return [q.codes.to(device), q.scales.to(device), q.global_scale.to(device)]


_DENSE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def dense_fp64(w: list[torch.Tensor], device=None) -> torch.Tensor:
    """The exact weight values [..., Out, In] (global scale included) in float64, memoized
    per weight within a test (the decode is the slow part of the CPU tolerance checks)."""
    hit = _DENSE.get(id(w[0]))
    if hit is not None and hit[0] is w[0]:
        d = hit[1]
    else:
        ww = as_weight(w)
        d = ww.dequantize(torch.float64) if isinstance(ww, NVFP4Tensor) else ww.double()
        _DENSE[id(w[0])] = (w[0], d)
    return d.to(device) if device is not None else d


@pytest.fixture(autouse=True)
def _fresh_dense_cache():
    _DENSE.clear()
    yield
    _DENSE.clear()


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of the bf16 grid at |v| (8 significant bits), floored at the smallest normal."""
    _, e = torch.frexp(v.double().abs().clamp(min=torch.finfo(torch.bfloat16).tiny))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e - 8)


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor,
            min_identical: float = 0.95) -> str:
    """Assert |out - ref| <= tol everywhere and bit-identity in >= min_identical of the
    elements; returns (and puts in the failure message) the share of differing elements
    and the largest difference."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype)
    o, r = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(o).all(), f"{name}: {(~torch.isfinite(o)).sum()} non-finite (unwritten?)"
    diff = (o - r).abs()
    share = (out.cpu() != ref.cpu()).float().mean().item()
    msg = (f"{name}: {share:.3%} of {o.numel()} elements differ, max diff "
           f"{diff.max().item():.3g}, max diff / tolerance {(diff / tol.cpu()).max().item():.2f}")
    print(msg)
    assert bool((diff <= tol.cpu()).all()), msg
    assert 1.0 - share >= min_identical, msg
    return msg


def gemm_tol(ref: torch.Tensor, x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """One bf16 ulp of the reference value plus the fp32 reordering bound
    `K * 2^-24 * sum_k |x_k w_k|` (FLINT_SPEC 3: same products, other summation order)."""
    mag = x.double().abs() @ dense_fp64(w, x.device).abs().T
    return bf16_ulp(ref) + x.shape[-1] * 2.0**-24 * mag


def route_ref(x, router, bias, top_k=TOPK):
    return torch.ops.flintc.moe_route(x, router, bias, top_k, SCALING)


def per_slot(a: torch.Tensor, w: list[torch.Tensor], ids: torch.Tensor):
    """float64 (value, magnitude) [N, K, Out] of `W_{ids[t,k]} a[t(,k)]` and of
    `|W| |a|`, from one dense product against all experts (tolerance inputs only)."""
    N, K = ids.shape
    Wd = dense_fp64(w, a.device)  # [E, Out, In]
    Ee, Out, In = Wd.shape
    if a.dim() == 2:
        a = a[:, None].expand(N, K, In)
    a64 = a.reshape(N * K, In).double()
    Wf = Wd.reshape(Ee * Out, In)
    slot = torch.arange(N * K, device=a.device)
    idx = ids.reshape(-1)
    val = (a64 @ Wf.T).view(N * K, Ee, Out)[slot, idx].view(N, K, Out)
    mag = (a64.abs() @ Wf.abs().T).view(N * K, Ee, Out)[slot, idx].view(N, K, Out)
    return val, mag


def dense_terms(a: torch.Tensor, w: list[torch.Tensor]):
    Wd = dense_fp64(w, a.device)
    return a.double() @ Wd.T, a.double().abs() @ Wd.abs().T


def rounded_with_slack(val: torch.Tensor, mag: torch.Tensor, In: int):
    """A GEMM output as the reference rounds it, and how far another summation order may
    put it: one bf16 ulp plus `In * 2^-24 * magnitude`."""
    r = val.to(torch.bfloat16).double()
    return r, bf16_ulp(r) + In * 2.0**-24 * mag


def gate_up_tol(x, ids, gate, up, sg, su, h_ref):
    """Bound for h = bf16(silu(g) * u) when g and u may each be one bf16 ulp plus the
    reordering bound away from the reference's: |dh| <= ulp(h) + |silu'| dg (|u| + du) +
    (|silu(g)| + |silu'| dg) du, with |silu'| <= 1.1, evaluated at the reference's g, u."""
    In = x.shape[-1]

    def parts(w_routed, w_shared):
        val, mag = per_slot(x, w_routed, ids)
        if w_shared:
            v2, m2 = dense_terms(x, w_shared)
            val, mag = torch.cat([val, v2[:, None]], 1), torch.cat([mag, m2[:, None]], 1)
        return rounded_with_slack(val, mag, In)

    g, dg = parts(gate, sg)
    u, du = parts(up, su)
    silu = (g * torch.sigmoid(g)).abs()
    return bf16_ulp(h_ref) + 1.1 * dg * (u.abs() + du) + (silu + 1.1 * dg) * du


def down_tol(h, ids, weights, down, sd, m_ref):
    """Bound for m = bf16(sum_k w_k y_k + y_s) when each y may be one ulp plus the
    reordering bound off: |dm| <= ulp(m) + sum_k |w_k| dy_k + dy_s."""
    K = ids.shape[1]
    In = h.shape[-1]
    _, dy = rounded_with_slack(*per_slot(h[:, :K], down, ids), In)  # [N, K, H]
    tol = bf16_ulp(m_ref) + (weights.double().abs()[..., None] * dy).sum(1)
    if sd:
        _, dys = rounded_with_slack(*dense_terms(h[:, K], sd), In)
        tol = tol + dys
    return tol


def moe_case(N: int, fmt: str, seed: int, shared: bool = True, gen_ids: str = "route",
             top_k: int = TOPK, shapes=(H, E, F), device=DEV):
    """Inputs of one MoE layer: x, ids/weights (from the reference router, or forced),
    stacked expert weights and the shared expert's."""
    Hh, Ee, Ff = shapes
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, Hh, generator=g).to(torch.bfloat16).to(device)
    router = (torch.randn(Ee, Hh, generator=g) * 0.05).to(torch.bfloat16).to(device)
    bias = (torch.randn(Ee, generator=g) * 0.01).to(device)
    if gen_ids == "route":
        weights, ids = route_ref(x, router, bias, top_k)
    else:
        ids = gen_ids(N).to(device)
        weights = torch.rand(N, ids.shape[1], generator=g).to(device)
    gate = make_weight((Ee, Ff, Hh), fmt, device, g)
    up = make_weight((Ee, Ff, Hh), fmt, device, g)
    down = make_weight((Ee, Hh, Ff), fmt, device, g)
    sg = make_weight((Ff, Hh), fmt, device, g) if shared else []
    su = make_weight((Ff, Hh), fmt, device, g) if shared else []
    sd = make_weight((Hh, Ff), fmt, device, g) if shared else []
    return {"x": x, "router": router, "bias": bias, "ids": ids, "weights": weights, "gate": gate,
            "up": up, "down": down, "sg": sg, "su": su, "sd": sd}


def check_moe(c, impls, min_identical: float = 0.95):
    """Run gate_up and down_combine with each of `impls`; compare each with its reference
    op (computed once), the down stage fed the reference's h so that its check does not
    depend on gate_up's."""
    x, ids, w = c["x"], c["ids"], c["weights"]
    h_ref = torch.ops.flintc.moe_gate_up(x, ids, c["gate"], c["up"], c["sg"], c["su"])
    tol_h = gate_up_tol(x, ids, c["gate"], c["up"], c["sg"], c["su"], h_ref)
    m_ref = torch.ops.flintc.moe_down_combine(h_ref, ids, w, c["down"], c["sd"])
    tol_m = down_tol(h_ref, ids, w, c["down"], c["sd"], m_ref)
    for impl in impls:
        h = GG.moe_gate_up(x, ids, c["gate"], c["up"], c["sg"], c["su"], impl=impl)
        compare(f"moe_gate_up[{impl}]", h, h_ref, tol_h, min_identical)
        m = GG.moe_down_combine(h_ref, ids, w, c["down"], c["sd"], impl=impl)
        compare(f"moe_down_combine[{impl}]", m, m_ref, tol_m, min_identical)


def moe_impls(fmt: str) -> list[str]:
    """Every implementation that can run here: triton (the interpreter on CPU), loop, and
    grouped_mm for bf16 weights when torch has it."""
    impls = ["triton", "loop"]
    if fmt == "bf16" and GG.grouped_mm_fn() is not None:
        impls.append("grouped_mm")
    return impls


# ---------------------------------------------------------------------------- dense GEMM
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("N", [1, 7, 64])
def test_gemm_matches_reference(N, fmt, poisoned):
    x = torch.randn(N, H).to(torch.bfloat16).to(DEV)
    w = make_weight((F + 8, H), fmt)  # F not a power of two
    y = G.gemm(x, w)
    ref = torch.ops.flintc.gemm(x, w)
    # CPU: the reference's expression itself (bit-identical); GPU: cuBLAS order.
    compare(f"gemm[{fmt}]", y, ref, gemm_tol(ref, x, w), 1.0 if not ON_GPU else 0.9)


def test_gemm_leading_dims_and_strided_x(poisoned):
    """x [B, T, K] and a row-strided x (a slice of a wider tensor) give the reference's rows."""
    xw = torch.randn(2, 5, 2 * H).to(torch.bfloat16).to(DEV)
    x = xw[..., :H]  # rows of stride 2H, last dim contiguous
    w = make_weight((F, H), "nvfp4")
    y = G.gemm(x, w)
    ref = torch.ops.flintc.gemm(x.reshape(-1, H), w).view(2, 5, F)
    compare("gemm[strided]", y, ref, gemm_tol(ref.view(-1, F), x.reshape(-1, H), w).view(2, 5, F),
            1.0 if not ON_GPU else 0.9)


def test_nvfp4_dequant_kernel_is_exact():
    """The Triton decode (interpreter on CPU) equals the torch decoder in value, for all 16
    codes and a spread of scales, with a NaN-poisoned output."""
    w = make_weight((40, 192), "nvfp4")
    codes, scales = w[0], w[1]
    codes[0, :8] = torch.arange(0, 256, 32, dtype=torch.uint8, device=codes.device) + 0x0F
    out = torch.full((40, 192), float("nan"), dtype=torch.bfloat16, device=codes.device)
    G.nvfp4_dequantize(codes, scales, out=out, use_triton=True)
    ref = dequantize_packed(codes.cpu(), scales.cpu(), None, torch.float32)
    assert torch.equal(out.float().cpu(), ref), "NVFP4 dequant differs from the torch decoder"
    torch_path = G.nvfp4_dequantize(codes, scales, use_triton=False)
    assert torch.equal(torch_path.float().cpu(), ref)


def test_lm_head_and_embedding_match_reference():
    x = torch.randn(7, H).to(torch.bfloat16).to(DEV)
    w = (torch.randn(TINY.vocab_size, H) * 0.05).to(torch.bfloat16).to(DEV)
    logits = G.lm_head(x, w)
    ref = torch.ops.flintc.lm_head(x, w)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    mag = x.cpu().double().abs() @ w.cpu().double().abs().T
    diff = (logits.double().cpu() - ref.double().cpu()).abs()
    share = (logits != ref).float().mean().item()
    msg = f"lm_head: {share:.3%} differ, max diff {diff.max().item():.3g}"
    print(msg)
    assert bool((diff <= H * 2.0**-24 * mag).all()), msg
    if not ON_GPU:
        assert share == 0.0, msg
    ids = torch.randint(0, TINY.vocab_size, (3, 5)).to(DEV)
    emb = G.embedding(ids, w)
    assert torch.equal(emb, torch.ops.flintc.embedding(ids, w))


# ---------------------------------------------------------------------------- routing
@pytest.mark.parametrize("N", [1, 7, 64])
def test_route_matches_reference(N):
    c = moe_case(N, "bf16", seed=N, shared=False)
    w_ref, ids_ref = route_ref(c["x"], c["router"], c["bias"])
    w, ids = GG.moe_route(c["x"], c["router"], c["bias"], TOPK, SCALING)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref), f"{(ids != ids_ref).any(1).sum()} tokens select differently"
    if not ON_GPU:
        assert torch.equal(w, w_ref)
    else:
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=0)


def test_route_ties_go_to_the_lower_index():
    """Experts 3 and 11 have identical router rows and biases: whenever one is picked and
    not both, it must be 3; identical scores sit in index order."""
    c = moe_case(16, "bf16", seed=5, shared=False)
    router, bias = c["router"].clone(), c["bias"].clone()
    router[11] = router[3]
    bias[11] = bias[3]
    router[3] *= 4  # make 3 (and 11) likely winners
    router[11] = router[3]
    _, ids = GG.moe_route(c["x"], router, bias, TOPK, SCALING)
    _, ids_ref = route_ref(c["x"], router, bias)
    assert torch.equal(ids, ids_ref)
    has3, has11 = (ids == 3).any(1), (ids == 11).any(1)
    assert bool((has3 | ~has11).all()), "expert 11 picked without its tie twin 3"
    both = has3 & has11
    pos3 = (ids == 3).float().argmax(1)
    pos11 = (ids == 11).float().argmax(1)
    assert bool((pos3[both] < pos11[both]).all())


# ---------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("N", [1, 7, 64])
def test_moe_matches_reference(N, fmt, poisoned):
    c = moe_case(N, fmt, seed=100 + N)
    if N == 1:  # 6 of 16 experts selected: the other 10 are nobody's
        assert c["ids"].unique().numel() == TOPK
    check_moe(c, moe_impls(fmt))


def test_moe_unselected_experts_and_one_hot_expert(poisoned):
    """Experts 0 and E-1 are never selected (their tiles must not exist or be written), and
    every token selects the same six experts (each gets all N tokens: several tiles)."""
    same = torch.tensor([9, 2, 14, 5, 7, 1])
    for fmt in ["bf16", "nvfp4"]:
        c = moe_case(24, fmt, seed=7, gen_ids=lambda n: same.expand(n, -1).clone())
        assert not bool(((c["ids"] == 0) | (c["ids"] == E - 1)).any())
        check_moe(c, moe_impls(fmt))


def test_moe_all_tokens_on_one_expert_without_shared(poisoned):
    """top-1 with every token on expert 5 and no shared expert (h has K slots)."""
    for fmt in ["bf16", "nvfp4"]:
        c = moe_case(33, fmt, seed=8, shared=False,
                     gen_ids=lambda n: torch.full((n, 1), 5, dtype=torch.int64))
        check_moe(c, moe_impls(fmt))


# Each dot arrangement of the Triton grouped GEMM (`GG.GroupedConfig`): NVFP4 weights in K
# order (default) or as even / odd halves; the weight tile as the dot's left operand
# (swap); small tiles so several K steps, F blocks and tiles per expert run.
GROUPED_CONFIGS = [GG.GroupedConfig(16, 16, 64, 4, 1, k_order=ko, swap=sw)
                   for ko, sw in ((True, False), (True, True), (False, False))]


@pytest.mark.parametrize("cfg", GROUPED_CONFIGS, ids=lambda c: f"k_order={c.k_order},swap={c.swap}")
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_moe_grouped_gemm_configs(fmt, cfg, poisoned, monkeypatch):
    if not ON_GPU and not GG.interpreting():
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1")
    monkeypatch.setattr(GG, "BLOCKS_OVERRIDE", cfg)
    check_moe(moe_case(21, fmt, seed=31), ["triton"])


def test_tile_table_covers_every_slot_once():
    """Random counts (with empty experts): tiles lie inside one expert, hold <= BLOCK_M
    slots, and cover the M sorted slots exactly once; the table has its static size."""
    g = torch.Generator().manual_seed(3)
    for block_m in (16, 32, 64):
        counts = torch.randint(0, 70, (E,), generator=g)
        counts[[0, 4, 9]] = 0
        ends = torch.cumsum(counts, 0)
        M = int(ends[-1])
        t_e, t_s, t_end = GG.tile_table(counts, ends, M, block_m)
        assert t_e.numel() == min(-(-M // block_m) + E, M)
        seen = torch.zeros(M, dtype=torch.int64)
        for e, s, t in zip(t_e.tolist(), t_s.tolist(), t_end.tolist()):
            if s == t:
                continue
            assert 0 < t - s <= block_m
            assert ends[e] - counts[e] <= s and t <= ends[e], (e, s, t)
            seen[s:t] += 1
        assert bool((seen == 1).all())


def test_sort_by_expert_groups_slots():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2]])
    order, counts, ends = GG.sort_by_expert(ids, 5)
    assert counts.tolist() == [1, 2, 1, 2, 0] and ends.tolist() == [1, 3, 4, 6, 6]
    assert order.tolist() == [3, 1, 2, 5, 0, 4]  # slots token*K + k, stable within an expert


@pytest.mark.parametrize("E", [256, 300])
def test_sort_by_expert_narrow_keys_keep_the_stable_order(E):
    """The sort runs on uint8 keys for E <= 256 (one radix pass) and int16 above: the same
    order as a stable argsort of the int64 ids, with many equal ids (1,000 tokens x 6)."""
    ids = torch.randint(0, E, (1000, 6), generator=torch.Generator().manual_seed(E)).to(DEV)
    order, counts, ends = GG.sort_by_expert(ids, E)
    assert torch.equal(order, torch.argsort(ids.reshape(-1), stable=True))
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=E))
    assert torch.equal(ends, torch.cumsum(counts, 0))


# ---------------------------------------------------------------------------- argument checks
@functools.lru_cache(maxsize=1)
def _bad_calls():
    c = moe_case(4, "bf16", seed=1)
    q = moe_case(4, "nvfp4", seed=1)
    x, ids, w = c["x"], c["ids"], c["weights"]
    h = torch.ops.flintc.moe_gate_up(x, ids, c["gate"], c["up"], c["sg"], c["su"])
    gate, up, sg, su = c["gate"], c["up"], c["sg"], c["su"]
    return [
        ("gemm: x", lambda: G.gemm(x.float(), sg)),
        ("gemm: w must", lambda: G.gemm(x, [sg[0], sg[0]])),
        (r"gemm: w\[0\]", lambda: G.gemm(x, [torch.zeros(F, H + 1, dtype=torch.bfloat16, device=DEV)])),
        (r"gemm: w\[1\]", lambda: G.gemm(x, [q["sg"][0], q["sg"][1].float(), q["sg"][2]])),
        (r"gemm: w\[2\]", lambda: G.gemm(x, [q["sg"][0], q["sg"][1], q["sg"][2].reshape(1)])),
        ("lm_head: w", lambda: G.lm_head(x, gate[0][0].float())),
        ("embedding: ids", lambda: G.embedding(ids.int(), sg[0])),
        ("moe_route: bias", lambda: GG.moe_route(x, c["router"], c["bias"].double(), TOPK, SCALING)),
        ("moe_route: top_k", lambda: GG.moe_route(x, c["router"], c["bias"], E + 1, SCALING)),
        ("moe_gate_up: ids", lambda: GG.moe_gate_up(x, ids.int(), gate, up, sg, su)),
        (r"moe_gate_up: gate\[0\]", lambda: GG.moe_gate_up(x, ids, [gate[0][:, :, :64]], up, sg, su)),
        ("moe_gate_up: up must", lambda: GG.moe_gate_up(x, ids, gate, q["up"], sg, su)),
        ("moe_gate_up: shared_gate", lambda: GG.moe_gate_up(x, ids, gate, up, sg, [])),
        ("moe_gate_up: impl", lambda: GG.moe_gate_up(x, ids, gate, up, sg, su, impl="cutlass")),
        ("moe_gate_up: impl='grouped_mm'",
         lambda: GG.moe_gate_up(x, ids, q["gate"], q["up"], sg, su, impl="grouped_mm")),
        (r"moe_gate_up: up\[2\]", lambda: GG.moe_gate_up(
            x, ids, q["gate"], q["up"][:2] + [q["up"][2][:3]], sg, su)),
        ("moe_down_combine: h", lambda: GG.moe_down_combine(h.float(), ids, w, c["down"], c["sd"])),
        ("moe_down_combine: h has", lambda: GG.moe_down_combine(h, ids, w, c["down"], [])),
        ("moe_down_combine: weights", lambda: GG.moe_down_combine(h, ids, w[:, :2], c["down"], c["sd"])),
        (r"moe_down_combine: down\[0\]", lambda: GG.moe_down_combine(h, ids, w, [c["down"][0].float()], c["sd"])),
    ]


@pytest.mark.parametrize("case", range(20))
def test_launchers_reject_bad_arguments(case):
    calls = _bad_calls()
    assert len(calls) == 20
    match, call = calls[case]
    with pytest.raises(ValueError, match=match):
        call()


def test_kernels_dicts_follow_the_contract():
    assert set(G.KERNELS) == {"gemm", "lm_head", "embedding"}
    assert set(GG.KERNELS) == {"moe_route", "moe_gate_up", "moe_down_combine"}
    import inspect
    for fn in list(G.KERNELS.values()) + list(GG.KERNELS.values()):
        p = inspect.signature(fn).parameters["use_pdl"]
        assert p.kind == p.KEYWORD_ONLY and p.default is False


# ---------------------------------------------------------------------------- GPU, full shapes
FH, FE, FF = 2048, 256, 512
# [F, K] of the model's prefill GEMMs: q, k/v, o, dense gate/up, dense down.
GEMM_SHAPES = [(4096, 2048, "q_proj"), (512, 2048, "kv_proj"), (2048, 4096, "o_proj"),
               (10240, 2048, "dense_gate_up"), (2048, 10240, "dense_down")]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("N", [512, 2048])
@pytest.mark.parametrize("Fo,K,name", GEMM_SHAPES, ids=[s[2] for s in GEMM_SHAPES])
def test_gemm_model_shapes_gpu(Fo, K, name, N, fmt, poisoned):
    x = torch.randn(N, K, device="cuda").to(torch.bfloat16)
    w = make_weight((Fo, K), fmt, "cuda")
    y = G.gemm(x, w)
    ref = torch.ops.flintc.gemm(x, w)
    compare(f"gemm[{name},{fmt},N={N}]", y, ref, gemm_tol(ref, x, w), 0.9)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_lm_head_full_vocab_gpu():
    x = torch.randn(64, FH, device="cuda").to(torch.bfloat16)
    w = (torch.randn(151552, FH, device="cuda") * 0.02).to(torch.bfloat16)
    logits = G.lm_head(x, w)
    ref = torch.ops.flintc.lm_head(x, w)
    mag = x.double().abs() @ w.double().abs().T
    diff = (logits.double() - ref.double()).abs()
    assert bool((diff <= FH * 2.0**-24 * mag).all()), f"max diff {diff.max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("N", [512, 2048])
def test_route_full_shapes_gpu(N):
    """ids equal the reference's except at near-ties: tokens whose sorted `scores + bias`
    have a gap below 1e-5 among the first K+1 places are counted, not judged."""
    c = moe_case(N, "bf16", seed=N, shared=False, gen_ids="route", shapes=(FH, FE, FF), device="cuda")
    w, ids = GG.moe_route(c["x"], c["router"], c["bias"], TOPK, SCALING)
    w_ref, ids_ref = c["weights"], c["ids"]
    logits = c["x"].float() @ c["router"].float().T
    biased = torch.sort(torch.sigmoid(logits) + c["bias"], dim=-1, descending=True).values
    near = (biased[:, :TOPK] - biased[:, 1:TOPK + 1]).min(1).values < 1e-5
    flips = (ids != ids_ref).any(1)
    print(f"route N={N}: {near.sum().item()} near-tie tokens, {flips.sum().item()} differ")
    assert not bool((flips & ~near).any()), "ids differ on a token without a near-tie"
    ok = ~flips
    torch.testing.assert_close(w[ok], w_ref[ok], rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["triton", "grouped_mm", "loop"])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("N", [512, 2048])
def test_moe_full_shapes_gpu(N, fmt, impl, poisoned):
    """Full shapes. The reference op gathers an expert matrix per (token, k), so it runs on
    32 sampled tokens (rows are independent: a token's result does not depend on the
    others); all N rows are compared with the per-expert fp32 `loop` implementation."""
    if impl == "grouped_mm" and fmt != "bf16":
        pytest.skip("grouped_mm has no fp32 output: NVFP4 uses triton")
    check_moe_full_shapes(N, fmt, impl)


# The sweep's dot arrangements (`benchmarks/bench_prefill_moe.py --sweep`) at full shapes:
# the tiles `_choose_blocks` picks, 8 warps, SWAP, and the even / odd NVFP4 loop.
GPU_GROUPED_CONFIGS = [GG.GroupedConfig(16, 64, 64, 4, 2), GG.GroupedConfig(32, 128, 64, 4, 2),
                       GG.GroupedConfig(32, 128, 64, 8, 3), GG.GroupedConfig(64, 64, 64, 4, 2, swap=True),
                       GG.GroupedConfig(16, 128, 128, 4, 2, k_order=False)]


@functools.cache
def full_case(N: int, fmt: str) -> dict:
    return moe_case(N, fmt, seed=N, shapes=(FH, FE, FF), device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cfg", GPU_GROUPED_CONFIGS, ids=lambda c: "m{} f{} k{} w{} st{}{}{}".format(
    *c[:5], "" if c.k_order else " even-odd", " swap" if c.swap else ""))
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_moe_grouped_gemm_configs_gpu(fmt, cfg, poisoned, monkeypatch):
    """GPU twin of `test_moe_grouped_gemm_configs` at 512 tokens. A configuration that
    triton cannot compile is skipped with the compiler's message, as the sweep skips it
    (`test_moe_full_shapes_gpu` checks that the rule's own picks compile)."""
    monkeypatch.setattr(GG, "BLOCKS_OVERRIDE", cfg)
    c = full_case(512, fmt)
    try:  # compile both launches first
        h = GG.moe_gate_up(c["x"][:64], c["ids"][:64], c["gate"], c["up"], c["sg"], c["su"], impl="triton")
        GG.moe_down_combine(h, c["ids"][:64], c["weights"][:64], c["down"], c["sd"], impl="triton")
        torch.cuda.synchronize()
    except (RuntimeError, triton.CompilationError) as exc:  # MLIR pass failures are RuntimeError
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        pytest.skip(f"{cfg} does not compile: {' / '.join(lines[:1] + lines[-2:])[:300]}")
    check_moe_full_shapes(512, fmt, "triton", c)


def check_moe_full_shapes(N: int, fmt: str, impl: str, c: dict | None = None) -> None:
    c = moe_case(N, fmt, seed=N, shapes=(FH, FE, FF), device="cuda") if c is None else c
    x, ids, w = c["x"], c["ids"], c["weights"]
    h = GG.moe_gate_up(x, ids, c["gate"], c["up"], c["sg"], c["su"], impl=impl)
    m = GG.moe_down_combine(h, ids, w, c["down"], c["sd"], impl=impl)
    torch.cuda.synchronize()
    rows = torch.randperm(N, device="cuda")[:32]
    sub = {k: (v[rows] if k in ("x", "ids", "weights") else v) for k, v in c.items()}
    h_ref = torch.ops.flintc.moe_gate_up(sub["x"], sub["ids"], c["gate"], c["up"], c["sg"], c["su"])
    tol_h = gate_up_tol(sub["x"], sub["ids"], c["gate"], c["up"], c["sg"], c["su"], h_ref)
    compare(f"moe_gate_up[{impl},{fmt},N={N}]", h[rows], h_ref, tol_h, 0.9)
    m_ref = torch.ops.flintc.moe_down_combine(h[rows], sub["ids"], sub["weights"], c["down"], c["sd"])
    compare(f"moe_down_combine[{impl},{fmt},N={N}]", m[rows], m_ref,
            down_tol(h[rows], sub["ids"], sub["weights"], c["down"], c["sd"], m_ref), 0.9)
    if impl != "loop":
        h_loop = GG.moe_gate_up(x, ids, c["gate"], c["up"], c["sg"], c["su"], impl="loop")
        diff = (h.float() - h_loop.float()).abs()
        share = (h != h_loop).float().mean().item()
        print(f"vs loop, all {N} rows: {share:.3%} differ, max diff {diff.max().item():.3g}")
        assert share < 0.05


# ---------------------------------------------------------------------------- CUDA-graph safety
def test_auto_impl_is_sync_free_on_cuda(monkeypatch):
    """On CUDA "auto" takes triton (sync-free) for both formats; inside a CUDA-graph
    capture the syncing implementations are refused with a clear error (grouped_mm syncs
    off sm_90 / sm_100)."""
    cuda = torch.device("cuda", 0)
    for major in (8, 9, 10, 12):
        monkeypatch.setattr(platform, "capability_major", lambda index, m=major: m)
        assert GG._pick_impl("op", "auto", False, cuda) == "triton"
        assert GG._pick_impl("op", "auto", True, cuda) == "triton"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    if GG.grouped_mm_fn() is not None:
        monkeypatch.setattr(platform, "capability_major", lambda index: 9)
        assert GG._pick_impl("op", "grouped_mm", False, cuda) == "grouped_mm"  # sync-free here
        monkeypatch.setattr(platform, "capability_major", lambda index: 12)
    with pytest.raises(ValueError, match="impl='loop' reads the expert counts on the host"):
        GG._pick_impl("moe_gate_up", "loop", False, cuda)
    with pytest.raises(ValueError, match="impl='grouped_mm' reads the expert counts on the host"):
        GG._pick_impl("moe_gate_up", "grouped_mm", False, cuda)  # sm_120 (patched above)
    assert GG._pick_impl("op", "triton", False, cuda) == "triton"


@pytest.mark.parametrize("fmt,impl", [("nvfp4", "triton"), ("bf16", "triton"), ("bf16", "grouped_mm")])
def test_moe_launchers_have_no_host_sync(fmt, impl):
    """Route, gate/up and down/combine as a GPU prefill runs them, under forbid_host_sync
    (CUDA-graph capture of the prefill function); the loop fallback is caught."""
    from flintc.runtime.hostsync import HostSyncError, forbid_host_sync

    if impl == "grouped_mm" and GG.grouped_mm_fn() is None:
        pytest.skip("this torch has no grouped_mm")
    c = moe_case(7, fmt, seed=3)
    with forbid_host_sync():
        w, ids = GG.moe_route(c["x"], c["router"], c["bias"], TOPK, SCALING)
        h = GG.moe_gate_up(c["x"], ids, c["gate"], c["up"], c["sg"], c["su"], impl=impl)
        m = GG.moe_down_combine(h, ids, w, c["down"], c["sd"], impl=impl)
    assert bool(torch.isfinite(m.float()).all())
    with pytest.raises(HostSyncError, match="tolist"):
        with forbid_host_sync():
            GG.moe_gate_up(c["x"], ids, c["gate"], c["up"], c["sg"], c["su"], impl="loop")
