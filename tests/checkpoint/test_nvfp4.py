"""The NVFP4 codec against ggml's own decoder (`gguf.quants.dequantize`).

Checks that flintc's quantizer, its ggml <-> packed repacking and its decoder agree
bit for bit with the independent decoder in the `gguf` package, that repacking is
lossless both ways, that E2M1 rounding is round-to-nearest-even at every midpoint,
and how odd block-scale bytes are handled (0x7F decodes to 0, as in ggml; a byte with
the top bit set is rejected).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from flintc.quant.nvfp4 import (
    NVFP4FormatError,
    NVFP4Tensor,
    dequantize_packed,
    ggml_to_packed,
    packed_to_ggml,
    quantize,
)

NVFP4 = GGMLQuantizationType.NVFP4
SETTINGS = settings(max_examples=25, deadline=None, database=None)  # no .hypothesis/ folder


def gguf_decode(blocks: np.ndarray, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """ggml's decoding of NVFP4 bytes [..., N, K/64*36], times the global scale."""
    ref = torch.from_numpy(gguf_dequantize(blocks, NVFP4).copy())
    if global_scale is not None:
        g = global_scale.to(torch.float32)
        ref = ref * (g.view(-1, 1, 1) if g.dim() == 1 else g)
    return ref


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float32
    assert got.shape == want.shape
    differ = got.view(torch.int32) != want.view(torch.int32)
    assert not bool(differ.any()), f"{int(differ.sum())} of {differ.numel()} values differ"


shapes = st.tuples(
    st.sampled_from([None, 1, 3]),  # experts (None: a plain matrix)
    st.integers(1, 5),  # N
    st.sampled_from([64, 128, 192]),  # K
)


def make_shape(lead, n, k):
    return (n, k) if lead is None else (lead, n, k)


@SETTINGS
@given(shapes, st.integers(-8, 4), st.booleans(), st.integers(0, 2**31 - 1))
def test_quantize_decodes_like_ggml(shape, exponent, use_global, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(make_shape(*shape), generator=gen) * 10.0**exponent
    w[..., :16] *= 0  # a zero block
    w[..., 0, 20] = 50.0 * 10.0**exponent  # an outlier
    q = quantize(w, use_global_scale=use_global)
    blocks = packed_to_ggml(q.codes, q.scales)
    assert_same_bits(q.dequantize(), gguf_decode(blocks, q.global_scale))
    assert_same_bits(dequantize_packed(q.codes, q.scales, None), gguf_decode(blocks))


@SETTINGS
@given(shapes, st.integers(0, 2**31 - 1))
def test_random_ggml_bytes_decode_like_ggml(shape, seed):
    """Every code and every valid scale byte (0x00..0x7F, 0x7F included)."""
    lead, n, k = shape
    rng = np.random.default_rng(seed)
    logical = make_shape(lead, n, k)
    blocks = rng.integers(0, 256, size=(*logical[:-1], k // 64 * 36), dtype=np.uint8)
    sb = blocks.reshape(-1, 36)
    sb[:, :4] &= 0x7F
    sb[0, 0] = 0x7F
    g = torch.tensor(rng.uniform(1e-3, 2.0, size=(lead,) if lead else ()), dtype=torch.float32)
    codes, scales = ggml_to_packed(blocks, logical, name="w")
    assert_same_bits(NVFP4Tensor(codes, scales, g).dequantize(), gguf_decode(blocks, g))
    # back to ggml: identical, except that 0x7F scales come back as 0x00 (both decode to 0)
    again = packed_to_ggml(codes, scales).reshape(-1, 36)
    want = blocks.reshape(-1, 36).copy()
    want[:, :4][want[:, :4] == 0x7F] = 0
    assert np.array_equal(again, want)


@SETTINGS
@given(shapes, st.integers(0, 2**31 - 1))
def test_packed_ggml_packed_round_trip(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    logical = make_shape(*shape)
    codes = torch.randint(0, 256, (*logical[:-1], logical[-1] // 2), generator=gen)
    codes = codes.to(torch.uint8)
    scale_bytes = torch.randint(0, 0x7F, (*logical[:-1], logical[-1] // 16), generator=gen)
    scales = scale_bytes.to(torch.uint8).view(torch.float8_e4m3fn)
    back_codes, back_scales = ggml_to_packed(packed_to_ggml(codes, scales), logical)
    assert torch.equal(back_codes, codes)
    assert torch.equal(back_scales.view(torch.uint8), scales.view(torch.uint8))


# Midpoints between neighbouring E2M1 magnitudes and where a tie goes (to the even
# mantissa, i.e. the even code): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
# 3.5 -> 4, 5 -> 4.
MIDPOINTS = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
NEIGHBOURS = [(0.0, 0.5), (0.5, 1.0), (1.0, 1.5), (1.5, 2.0), (2.0, 3.0), (3.0, 4.0), (4.0, 6.0)]


def quantize_unit_scale(values: list[float]) -> torch.Tensor:
    """Quantize `values` with block scale exactly 1 (each 16-block holds a 6.0) and
    return what they decode to."""
    per_block = 15
    n_blocks = -(-len(values) // per_block)
    n_blocks += -n_blocks % 4  # whole 64-weight super-blocks
    rows = torch.zeros(n_blocks, 16)
    rows[:, 0] = 6.0
    flat = torch.tensor(values + [0.0] * (n_blocks * per_block - len(values)))
    rows[:, 1:] = flat.view(n_blocks, per_block)
    q = quantize(rows.reshape(1, -1), use_global_scale=False)
    assert torch.equal(q.scales.float(), torch.ones_like(q.scales.float()))
    assert float(q.global_scale) == 1.0
    return q.dequantize().view(n_blocks, 16)[:, 1:].reshape(-1)[: len(values)]


def test_e2m1_rounds_half_to_even_at_every_midpoint():
    mids = [m for m, _ in MIDPOINTS]
    want = [r for _, r in MIDPOINTS]
    got = quantize_unit_scale(mids + [-m for m in mids])
    assert got.tolist() == want + [-r for r in want]


def test_e2m1_rounds_to_nearest_just_off_the_midpoints():
    values, want = [], []
    for (mid, _), (lo, hi) in zip(MIDPOINTS, NEIGHBOURS):
        below = float(np.nextafter(np.float32(mid), np.float32(0)))
        above = float(np.nextafter(np.float32(mid), np.float32(10)))
        values += [below, above, -below, -above]
        want += [lo, hi, -lo, -hi]
    assert quantize_unit_scale(values).tolist() == want


def test_e2m1_saturates_beyond_six():
    q = quantize(torch.tensor([[448.0 * 6 * 4] + [1e9] + [0.0] * 62]), use_global_scale=False)
    assert q.dequantize()[0, 0].item() == 448.0 * 6


def one_super_block(scale_bytes: list[int]) -> np.ndarray:
    block = np.full((1, 36), 0x22, dtype=np.uint8)  # every code 2 (1.0)
    block[0, :4] = scale_bytes
    return block


def test_scale_byte_0x7f_decodes_to_zero_like_ggml():
    block = one_super_block([0x7F, 0x38, 0x7F, 0x00])  # 0x38 is 1.0
    codes, scales = ggml_to_packed(block, (1, 64))
    ours = dequantize_packed(codes, scales, None)
    assert_same_bits(ours, gguf_decode(block))
    assert ours[0, :16].eq(0).all() and ours[0, 16:32].eq(1).all()
    assert not torch.isnan(scales.float()).any()


@pytest.mark.parametrize("byte", [0x80, 0xB8, 0xFF])
def test_scale_byte_with_top_bit_is_rejected(byte):
    block = one_super_block([0x38, 0x38, byte, 0x38])
    want = rf"blk\.0\.attn_q\.weight: block scale 2 is 0x{byte:02X}"
    with pytest.raises(NVFP4FormatError, match=want):
        ggml_to_packed(block, (1, 64), name="blk.0.attn_q.weight")


def test_code_eight_is_positive_zero_as_in_ggml():
    """Code 8 is E2M1's -0: ggml's integer table gives +0, and so must we (same bits)."""
    block = one_super_block([0x38] * 4)
    block[0, 4:] = 0x88
    codes, scales = ggml_to_packed(block, (1, 64))
    ours = dequantize_packed(codes, scales, torch.tensor(0.5))
    assert_same_bits(ours, gguf_decode(block, torch.tensor(0.5)))
    assert not torch.signbit(ours).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_eager_lookup_decodes_as_the_traced_bit_formula(dtype):
    """Eager decoding looks each code byte up in a table; a traced one (make_fx, fake
    tensors) keeps the bit formula of `decode_e2m1`, whose aten ops the fusion passes'
    patterns match. Both give the same bits for every byte and a spread of scales, and
    the traced graph holds the bit arithmetic, not the lookup."""
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(3)
    codes = torch.arange(256, dtype=torch.uint8).repeat(24, 4)  # [24, 1024]: every byte
    scales = torch.randint(0, 127, (24, 128), generator=g, dtype=torch.uint8)
    scales[0], scales[1] = 0, 1  # zero and the smallest subnormal E4M3 scale
    scales = scales.view(torch.float8_e4m3fn)
    gs = torch.tensor(0.3711)
    eager = dequantize_packed(codes, scales, gs, dtype)
    for mode in ("real", "fake"):
        gm = make_fx(lambda c, s, x: dequantize_packed(c, s, x, dtype), tracing_mode=mode)(
            codes, scales, gs)
        targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert not any("embedding" in t for t in targets), targets
        assert any("bitwise_and" in t for t in targets), targets
        traced = gm(codes, scales, gs)
        assert traced.dtype == eager.dtype == dtype
        bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}
        assert torch.equal(traced.view(bits[dtype]), eager.view(bits[dtype]))
