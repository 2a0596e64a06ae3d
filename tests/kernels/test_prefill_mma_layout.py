"""Prefill ops on NVFP4 weights in the mma layout of the CUDA decode kernels
(`flintc.kernels.nvfp4_mma.pack_mma_layout`: int32 codes [.., F/16, K/64, 32, 4], uint8
ue5m3 scale codes [.., F/16, K/64, 32, 2]) against the same weights in the packed layout
(uint8 codes [.., F, K/2], float8_e4m3fn scales [.., F, K/16]).

Both layouts hold the same values and the ops decode both exactly, so the dequant, gemm
and the "loop" impl must be bit-identical (compared as bit patterns, after a finiteness
check: outputs and the dequant workspace start NaN-poisoned, so an unwritten element
fails); the Triton grouped GEMM, a different compiled program per layout, within a
stated bound (`assert_same`). Covered: the dequant
(`nvfp4_mma_dequantize`, `nvfp4_dequantize`'s int32 dispatch; Triton under the
interpreter on CPU and the torch decoder), `gemm`, `moe_gate_up` (with and without the
shared expert) and `moe_down_combine`, impl "triton" and "loop", the grouped GEMM's dot
arrangements, and the argument checks.

Weights are fresh random each run (the seed is printed; rerun with FLINTC_TEST_SEED=<seed>):
uniform random code bytes (every code 0..15, a row with all 16 in order) and block scales
drawn from every finite non-negative E4M3 value (zero and the subnormals included, a
zero and subnormal block forced in). `gpu` tests: the same at larger shapes.
"""

from __future__ import annotations

import os
import random

# The interpreter must be chosen before triton decorates any kernel (no GPU in CI).
if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from harness import assert_same

triton = pytest.importorskip("triton", reason="triton is not installed: the prefill kernels need it")

from flintc.kernels import gemm as G
from flintc.kernels import grouped_gemm as GG
from flintc.kernels.nvfp4_mma import decode_mma_layout, pack_mma_stack
from flintc.quant.nvfp4 import dequantize_packed

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
CAN_TRITON = ON_GPU or G.interpreting()
E, TOPK = 4, 2


# ---------------------------------------------------------------------------- helpers
@pytest.fixture
def gen():
    """A generator seeded fresh each test (FLINTC_TEST_SEED overrides); prints the seed."""
    seed = int(os.environ.get("FLINTC_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def packed_weight(shape, gen: torch.Generator, device=DEV) -> list[torch.Tensor]:
    """Random NVFP4 weight [..., F, K] in the packed layout: [codes, scales, global_scale]
    (global scale [] for a matrix, [E] for a stack; random, never 1).

    Codes: uniform random bytes, and the first row's first 8 bytes hold codes 0..15 in
    order. Scales: uniform over the E4M3 bit patterns 0x00..0x7E (every finite
    non-negative value: zero, the 7 subnormals, the normals up to 448), and the second row
    has a zero block and a subnormal one forced in."""
    *lead, F, K = shape
    codes = torch.randint(0, 256, (*lead, F, K // 2), dtype=torch.uint8, generator=gen)
    sbits = torch.randint(0, 0x7F, (*lead, F, K // 16), dtype=torch.uint8, generator=gen)
    c2 = codes.view(-1, F, K // 2)
    s2 = sbits.view(-1, F, K // 16)
    c2[0, 0, :8] = torch.arange(0, 16, 2, dtype=torch.uint8) | (torch.arange(1, 16, 2, dtype=torch.uint8) << 4)
    s2[0, 1, 0] = 0  # zero block scale
    s2[0, 1, -1] = 3  # subnormal: 3 * 2^-9
    gs = (torch.rand(tuple(lead[:1]), generator=gen) + 0.5) * 2.0**-12
    return [codes.to(device), sbits.view(torch.float8_e4m3fn).to(device), gs.to(device)]


def to_mma(w: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same weight in the mma layout: `pack_mma_layout` of the flattened [.. * F, K]
    matrix, the leading dims put back (expert e's row tiles are e * F/16 ..)."""
    return [*pack_mma_stack(w[0], w[1]), w[2]]


def random_ids(N: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [N, TOPK]: distinct random experts per token, expert 0 on every token (so at
    least one expert has several tiles' worth and the last expert's offset is used often)."""
    rest = torch.stack([torch.randperm(E - 1, generator=gen)[:TOPK - 1] + 1 for _ in range(N)])
    return torch.cat([torch.zeros(N, 1, dtype=torch.int64), rest], dim=1).to(DEV)


def triton_or_skip(impl: str) -> None:
    if impl == "triton" and not CAN_TRITON:
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")


# ---------------------------------------------------------------------------- dequant
@pytest.mark.parametrize("lead", [(), (3,)], ids=["matrix", "stack"])
@pytest.mark.parametrize("F,K", [(16, 64), (48, 128)])
def test_dequant_mma_matches_packed(F, K, lead, gen):
    """`nvfp4_mma_dequantize` (Triton and torch) and `nvfp4_dequantize` of int32 codes give
    the packed layout's bf16 matrix: equal in value to `dequantize_packed` everywhere, and
    bit for bit equal to the packed layout's Triton decode. (Signed zeros: the Triton
    decodes and `decode_mma_layout` give code 8 as -0.0 and a zero-scale block's weights
    the code's sign, `dequantize_packed` +0.0 for code 8, so the torch decoders of the two
    layouts agree in value only; a zero scale's block keeps no magnitudes in the mma
    layout, so no decoder of it could match `dequantize_packed`'s zero signs there.)"""
    w = packed_weight((*lead, F, K), gen)
    wq, sq, _ = to_mma(w)
    ref = dequantize_packed(w[0].cpu(), w[1].cpu(), None, torch.float32)
    assert bool((ref == 0).any()) and bool((ref.abs() < 2.0**-6).any())  # zeros, subnormal scales
    flat = decode_mma_layout(wq.reshape(-1, *wq.shape[-3:]), sq.reshape(-1, *sq.shape[-3:]))
    assert torch.equal(flat.cpu(), ref.reshape(-1, K)), "decode_mma_layout != dequantize_packed"
    want = G.nvfp4_dequantize(w[0], w[1], use_triton=False)  # packed, torch
    assert torch.equal(want.float().cpu(), ref)
    if CAN_TRITON:  # the packed layout's Triton decode: every mma path matches its bits
        want = G.nvfp4_dequantize(w[0], w[1], use_triton=True)
        assert torch.equal(want.float().cpu(), ref)
    for use_triton in [False] + ([True] if CAN_TRITON else []):
        out = torch.full((*lead, F, K), float("nan"), dtype=torch.bfloat16, device=DEV)
        got = G.nvfp4_mma_dequantize(wq, sq, out=out, use_triton=use_triton)
        assert got is out
        assert torch.equal(got.float().cpu(), ref)
        if CAN_TRITON:
            assert_same(f"nvfp4_mma_dequantize[triton={use_triton}]", got, want)
        assert_same(f"nvfp4_dequantize(int32)[triton={use_triton}]",
                    G.nvfp4_dequantize(wq, sq, use_triton=use_triton), got)


# ---------------------------------------------------------------------------- gemm
@pytest.mark.parametrize("F,K", [(16, 64), (48, 128), (16, 128), (48, 64)])
def test_gemm_mma_matches_packed(F, K, gen, poisoned):
    w = packed_weight((F, K), gen)
    x = torch.randn(2, 5, K, generator=gen).to(torch.bfloat16).to(DEV)
    want = G.gemm(x, w)
    assert_same("gemm", G.gemm(x, to_mma(w)), want)
    xs = torch.randn(7, 2 * K, generator=gen).to(torch.bfloat16).to(DEV)[:, K:]  # row-strided x
    assert_same("gemm[strided x]", G.gemm(xs, to_mma(w)), G.gemm(xs, w))


# ---------------------------------------------------------------------------- MoE
def _moe_weights(H: int, F: int, shared: bool, gen, down: bool):
    if down:
        return packed_weight((E, H, F), gen), packed_weight((H, F), gen) if shared else []
    ws = [packed_weight((E, F, H), gen), packed_weight((E, F, H), gen)]
    sh = [packed_weight((F, H), gen), packed_weight((F, H), gen)] if shared else [[], []]
    return ws, sh


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no_shared"])
@pytest.mark.parametrize("impl", ["triton", "loop"])
@pytest.mark.parametrize("H,F", [(128, 48), (64, 128)])
def test_moe_gate_up_mma_matches_packed(H, F, impl, shared, gen, poisoned):
    triton_or_skip(impl)
    N = 9
    (gate, up), (sg, su) = _moe_weights(H, F, shared, gen, down=False)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(DEV)
    ids = random_ids(N, gen)
    want = GG.moe_gate_up(x, ids, gate, up, sg, su, impl=impl)
    mma = [to_mma(w) if w else [] for w in (gate, up, sg, su)]
    assert_same(f"moe_gate_up[{impl}]", GG.moe_gate_up(x, ids, *mma, impl=impl), want,
                dots=impl == "triton")
    # routed experts in the mma layout, the shared expert still packed (a mixed checkpoint)
    if shared:
        assert_same(f"moe_gate_up[{impl}, packed shared]",
                    GG.moe_gate_up(x, ids, mma[0], mma[1], sg, su, impl=impl), want,
                    dots=impl == "triton")


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "no_shared"])
@pytest.mark.parametrize("impl", ["triton", "loop"])
@pytest.mark.parametrize("H,F", [(48, 128), (128, 64)])
def test_moe_down_combine_mma_matches_packed(H, F, impl, shared, gen, poisoned):
    triton_or_skip(impl)
    N = 9
    down, sd = _moe_weights(H, F, shared, gen, down=True)
    h = torch.randn(N, TOPK + int(shared), F, generator=gen).to(torch.bfloat16).to(DEV)
    ids = random_ids(N, gen)
    weights = torch.rand(N, TOPK, generator=gen).to(DEV)
    want = GG.moe_down_combine(h, ids, weights, down, sd, impl=impl)
    got = GG.moe_down_combine(h, ids, weights, to_mma(down), to_mma(sd) if sd else [], impl=impl)
    assert_same(f"moe_down_combine[{impl}]", got, want, dots=impl == "triton")


# The grouped GEMM's dot arrangements: K order (the mma loader's), K order with SWAP, and
# the even / odd config, which the launcher turns into K order for mma-layout weights (so
# the mma run is compared with the packed layout's K-order run: the even / odd dots sum in
# another order); small tiles so several K steps, F blocks and tiles per expert run.
MMA_CONFIGS = [GG.GroupedConfig(16, 16, 64, 4, 1), GG.GroupedConfig(16, 16, 64, 4, 1, swap=True),
               GG.GroupedConfig(16, 16, 64, 4, 1, k_order=False)]


@pytest.mark.parametrize("cfg", MMA_CONFIGS, ids=lambda c: f"k_order={c.k_order},swap={c.swap}")
def test_moe_grouped_gemm_configs_mma(cfg, gen, poisoned, monkeypatch):
    triton_or_skip("triton")
    H, F, N = 128, 64, 17  # expert 0 on all 17 tokens: two tiles
    (gate, up), _ = _moe_weights(H, F, False, gen, down=False)
    down, _ = _moe_weights(H, F, False, gen, down=True)
    x = torch.randn(N, H, generator=gen).to(torch.bfloat16).to(DEV)
    ids = random_ids(N, gen)
    weights = torch.rand(N, TOPK, generator=gen).to(DEV)
    monkeypatch.setattr(GG, "BLOCKS_OVERRIDE", cfg._replace(k_order=True))
    h = GG.moe_gate_up(x, ids, gate, up, [], [], impl="triton")
    want = GG.moe_down_combine(h, ids, weights, down, [], impl="triton")
    monkeypatch.setattr(GG, "BLOCKS_OVERRIDE", cfg)
    assert_same("moe_gate_up", GG.moe_gate_up(x, ids, to_mma(gate), to_mma(up), [], [], impl="triton"), h,
                dots=True)
    assert_same("moe_down_combine", GG.moe_down_combine(h, ids, weights, to_mma(down), [], impl="triton"),
                want, dots=True)


# ---------------------------------------------------------------------------- argument checks
def _bad_calls():
    g = torch.Generator().manual_seed(0)
    H, F, N = 128, 64, 3
    x = torch.randn(N, H, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]], device=DEV)
    wts = torch.rand(N, TOPK, generator=g).to(DEV)
    w = to_mma(packed_weight((F, H), g))
    gate, up = to_mma(packed_weight((E, F, H), g)), to_mma(packed_weight((E, F, H), g))
    gate_p = packed_weight((E, F, H), g)
    down = to_mma(packed_weight((E, H, F), g))
    h = torch.randn(N, TOPK, F, generator=g).to(torch.bfloat16).to(DEV)
    wq, sq, gs = w
    x80 = torch.randn(N, 80, generator=g).to(torch.bfloat16).to(DEV)
    return [
        (r"gemm: w\[0\] \(NVFP4 mma-layout codes\)", lambda: G.gemm(x, [wq.reshape(4, 2, 128), sq, gs])),
        (r"gemm: w\[0\] \(NVFP4 mma-layout codes\).*\[F/16, 2, 32, 4\]",
         lambda: G.gemm(x, [wq[:, :1].contiguous(), sq, gs])),
        (r"gemm: w\[1\] \(NVFP4 mma-layout scale codes\).*uint8",
         lambda: G.gemm(x, [wq, sq.view(torch.float8_e4m3fn), gs])),
        (r"gemm: w\[1\] \(NVFP4 mma-layout scale codes\).*\[4, 2, 32, 2\]",
         lambda: G.gemm(x, [wq, sq[..., :1].contiguous(), gs])),
        (r"gemm: w\[2\]", lambda: G.gemm(x, [wq, sq, gs.reshape(1)])),
        ("gemm: x has K=80; mma-layout", lambda: G.gemm(x80, w)),
        (r"moe_gate_up: gate\[1\] \(NVFP4 mma-layout scale codes\)",
         lambda: GG.moe_gate_up(x, ids, [gate[0], gate[1].view(torch.float8_e4m3fn), gate[2]], up, [], [])),
        (r"moe_gate_up: gate\[0\] \(NVFP4 mma-layout codes\)",
         lambda: GG.moe_gate_up(x, ids, [gate[0][:, :, :1].contiguous(), gate[1], gate[2]], up, [], [])),
        ("moe_gate_up: up must have gate's format, layout",
         lambda: GG.moe_gate_up(x, ids, gate, gate_p, [], [])),
        (r"moe_gate_up: up\[1\] \(NVFP4 mma-layout scale codes\).*\[4, 4, 2, 32, 2\]",
         lambda: GG.moe_gate_up(x, ids, gate, [up[0], up[1][:, :, :, :16].contiguous(), up[2]], [], [])),
        ("moe_gate_up: impl='grouped_mm'",
         lambda: GG.moe_gate_up(x, ids, gate, up, [], [], impl="grouped_mm")),
        (r"moe_down_combine: down\[1\] \(NVFP4 mma-layout scale codes\)",
         lambda: GG.moe_down_combine(h, ids, wts, [down[0], down[1][:2], down[2]], [])),
        (r"moe_down_combine: down\[2\]",
         lambda: GG.moe_down_combine(h, ids, wts, [down[0], down[1], down[2][:2]], [])),
        ("nvfp4_mma_dequantize: scales", lambda: G.nvfp4_mma_dequantize(wq, sq.to(torch.int32))),
        ("nvfp4_mma_dequantize: codes", lambda: G.nvfp4_mma_dequantize(wq.reshape(-1, 4), sq)),
    ]


@pytest.mark.parametrize("case", range(15))
def test_mma_layout_bad_arguments(case):
    calls = _bad_calls()
    assert len(calls) == 15
    match, call = calls[case]
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------- GPU, larger shapes
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_mma_layout_larger_shapes_gpu(gen, poisoned):
    """GPU twin at model-like widths: dequant and gemm (cuBLAS on the same bf16 matrix)
    bit-identical to the packed layout, the Triton grouped GEMM within `assert_same`'s
    bound (another compiled program: the fp32 sums may come out in another order)."""
    w = packed_weight((1024, 2048), gen)
    assert_same("nvfp4_mma_dequantize", G.nvfp4_mma_dequantize(*to_mma(w)[:2]),
                G.nvfp4_dequantize(w[0], w[1]))
    x = torch.randn(512, 2048, generator=gen).to(torch.bfloat16).to(DEV)
    assert_same("gemm", G.gemm(x, to_mma(w)), G.gemm(x, w))
    Hh, Ff, N, Ee = 1024, 512, 512, 16
    gate, up = packed_weight((Ee, Ff, Hh), gen), packed_weight((Ee, Ff, Hh), gen)
    down = packed_weight((Ee, Hh, Ff), gen)
    sg, su, sd = packed_weight((Ff, Hh), gen), packed_weight((Ff, Hh), gen), packed_weight((Hh, Ff), gen)
    x = torch.randn(N, Hh, generator=gen).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(Ee, generator=gen)[:4] for _ in range(N)]).to(DEV)
    weights = torch.rand(N, 4, generator=gen).to(DEV)
    h = GG.moe_gate_up(x, ids, gate, up, sg, su, impl="triton")
    assert_same("moe_gate_up", GG.moe_gate_up(x, ids, to_mma(gate), to_mma(up), to_mma(sg), to_mma(su),
                                              impl="triton"), h, dots=True)
    want = GG.moe_down_combine(h, ids, weights, down, sd, impl="triton")
    assert_same("moe_down_combine", GG.moe_down_combine(h, ids, weights, to_mma(down), to_mma(sd),
                                                        impl="triton"), want, dots=True)
