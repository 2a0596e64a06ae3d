"""`benchmarks/torch_baselines.py`, the fast plain-torch baselines of bench_gemv.py and
bench_moe.py, against the reference ops on the CPU at small shapes: the NVFP4
dequantization to bf16 bit for bit, the GEMVs and MoE ops within bf16 tolerances (they
round where bf16 GEMMs round, not at FLINT_SPEC's points), the routing's ids exactly, and
`compile_fresh` compiling past Dynamo's per-function limit of variants."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch_baselines as TB  # noqa: E402
import flintc.ops  # noqa: E402,F401  (registers torch.ops.flintc)
from flintc.quant.nvfp4 import dequantize_packed, quantize  # noqa: E402


def _weight(shape, fmt, g):
    w = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    if fmt == "bf16":
        return [w]
    q = quantize(w)
    return [q.codes, q.scales, q.global_scale]


def _close(a, b, what):
    """bf16 tolerance: the baselines round a GEMM's output to bf16 where the reference
    keeps fp32 until one final rounding, i.e. a few bf16 ulps of the output's scale."""
    a, b = a.float(), b.float()
    scale = b.abs().max().clamp_min(1e-6)
    err = (a - b).abs().max() / scale
    assert err < 2e-2, f"{what}: largest difference {err:.3g} of the output's scale"


def test_nvfp4_to_bf16_every_code_and_scale():
    """Every e2m1 code times every finite E4M3 scale (subnormals included) is exact in
    bf16, though products reach 6 significant bits (1.5 x 1.875)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # both nibbles: 16 x 16
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    scales = scales[torch.isfinite(scales.float())]
    c = codes.repeat(scales.numel(), 8)  # [S, 2048]: each row K = 4096 weights, 256 blocks
    s = scales[:, None].expand(-1, c.shape[1] * 2 // 16).contiguous()  # row i: all scale i
    got = TB.nvfp4_to_bf16(c, s)
    assert torch.equal(got.float(), dequantize_packed(c, s, None))
    assert (got.float() == 2.8125).any()


@pytest.mark.parametrize("lead", [(), (3,)])
def test_nvfp4_to_bf16_is_the_dequantization_exactly(lead):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (*lead, 8, 32), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 0x7F, (*lead, 8, 4), generator=g,
                           dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    got = TB.nvfp4_to_bf16(codes, scales)
    want = dequantize_packed(codes, scales, None)  # fp32, exact
    assert got.dtype == torch.bfloat16 and got.shape == (*lead, 8, 64)
    assert torch.equal(got.float(), want)


def test_nvfp4_to_bf16_refuses_mismatched_scales():
    codes = torch.zeros(4, 16, dtype=torch.uint8)  # K = 32: 2 scales per row
    scales = torch.zeros(4, 3, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"codes \(4, 16\) and scales \(4, 3\)"):
        TB.nvfp4_to_bf16(codes, scales)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_linear_matches_the_reference_gemv(fmt):
    g = torch.Generator().manual_seed(2)
    w = _weight((48, 64), fmt, g)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    got = TB.linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 48)
    _close(got, torch.ops.flintc.gemv(x, w), f"linear {fmt}")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_linear_mulsum_is_one_fused_reduction(fmt):
    """`linear_mulsum` (the multiply-and-sum GEMV) matches the reference GEMV (fp32 sums
    of the exact products: within one bf16 rounding), and `torch.compile` makes it one
    generated kernel (decode, product and sum fused; Inductor's CPU backend here) with
    the same values."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(3)
    w = _weight((48, 64), fmt, g)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    got = TB.linear_mulsum(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 48)
    want = torch.ops.flintc.gemv(x, w)
    torch.testing.assert_close(got.double(), want.double(), rtol=2 ** -8, atol=1e-6)
    torch._dynamo.reset()
    try:
        compiled, (code, *_) = run_and_get_code(torch.compile(TB.linear_mulsum), x, w)
    finally:
        torch._dynamo.reset()
    kernels = code.count('extern "C"')  # the CPU backend's generated C++ kernels
    assert kernels == 1, f"{kernels} generated kernels:\n{code[:3000]}"
    torch.testing.assert_close(compiled.double(), want.double(), rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_moe_ops_match_the_reference_ops(fmt):
    E, Fi, H, K, N, scaling, eps = 16, 64, 128, 3, 4, 2.5, 1e-5
    g = torch.Generator().manual_seed(3)
    gate, up, down = _weight((E, Fi, H), fmt, g), _weight((E, Fi, H), fmt, g), _weight((E, H, Fi), fmt, g)
    sg, su, sd = _weight((Fi, H), fmt, g), _weight((Fi, H), fmt, g), _weight((H, Fi), fmt, g)
    router = (torch.randn(E, H, generator=g) * 0.1).to(torch.bfloat16)
    norm = 1 + 0.1 * torch.randn(H, generator=g)
    bias = torch.randn(E, generator=g) * 0.05
    x = torch.randn(N, 1, H, generator=g).to(torch.bfloat16)
    ref = torch.ops.flintc

    xn, lg = TB.norm_router(x, norm, router, eps)
    rxn, rlg = ref.norm_router(x, norm, router, eps)
    assert torch.equal(xn, rxn)  # the same fp32 norm, one rounding
    _close(lg, rlg, "router logits")

    # the reference's logits, so both select the same experts
    h, w, ids = TB.moe_topk_gate_up(rxn, rlg, bias, gate, up, sg, su, K, scaling)
    rh, rw, rids = ref.moe_topk_gate_up(rxn, rlg, bias, gate, up, sg, su, K, scaling)
    assert torch.equal(ids, rids) and torch.equal(w, rw)
    assert h.shape == rh.shape == (N, K + 1, Fi)
    _close(h, rh, f"gate/up {fmt}")

    out = TB.moe_down_combine_residual(rh, rids, rw, down, sd, x)
    rout = ref.moe_down_combine_residual(rh, rids, rw, down, sd, x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    _close(out - x, rout - x, f"down + combine {fmt}")

    layer = TB.moe_layer(x, norm, router, bias, gate, up, down, sg, su, sd, K, scaling, eps)
    assert layer.shape == x.shape


def test_experts_reads_only_the_selected_experts():
    """A poisoned expert that no token selects must not reach the output."""
    E, Fi, H = 8, 16, 32
    g = torch.Generator().manual_seed(4)
    w = _weight((E, Fi, H), "bf16", g)
    w[0][5] = float("nan")
    ids = torch.tensor([[0, 2], [7, 1]])
    y = TB.experts(torch.randn(2, H, generator=g).to(torch.bfloat16), ids, w)
    assert y.shape == (2, 2, Fi) and torch.isfinite(y.float()).all()


def test_compile_fresh_compiles_past_the_variant_limit(monkeypatch):
    """Ten shapes of one function (Dynamo keeps 8 variants per code object, then runs it
    eagerly): with `compile_fresh` each is compiled, none falls back. The global Dynamo
    flag it sets is put back afterwards (it would make a later test's 9th variant raise)."""
    import torch._dynamo as dynamo

    if hasattr(dynamo.config, "fail_on_recompile_limit_hit"):
        monkeypatch.setattr(dynamo.config, "fail_on_recompile_limit_hit",
                            dynamo.config.fail_on_recompile_limit_hit)

    def f(x):
        return x * 2 + 1

    frames = []
    for n in range(1, 11):
        before = dynamo.utils.counters["stats"]["unique_graphs"]
        comp = TB.compile_fresh(f, backend="eager")
        x = torch.randn(n)
        assert torch.equal(comp(x), x * 2 + 1)
        frames.append(dynamo.utils.counters["stats"]["unique_graphs"] - before)
    assert frames == [1] * 10, frames
    if hasattr(dynamo.config, "fail_on_recompile_limit_hit"):
        assert dynamo.config.fail_on_recompile_limit_hit
