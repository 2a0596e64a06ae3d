"""`flintc.kernels.tiles`: the NVFP4 weight decode shared by the decode GEMV kernels.

`dequant_tile` must give `e2m1 * scale * 2^-8` exactly for every code byte and every
E4M3 scale (FLINT_SPEC section 4's values). On the CPU the interpreter runs the
per-element fp32 twin of the bit formulas, and `test_ptx_bit_trick_in_numpy` replays the
GPU path's PTX instruction by instruction (prmt, shl, and, or, then the bf16 multiply)
for all 256 code bytes; the `gpu` test runs the inline asm itself.
"""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import triton
import triton.language as tl

from flintc.kernels import tiles
from flintc.quant.nvfp4 import E2M1_VALUES

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"

# Scales that reach every corner: E4M3 subnormals (2^-9, 3 * 2^-9), 1, a 3-bit mantissa,
# the largest finite 448, and zero.
SCALES = [2.0**-9, 3 * 2.0**-9, 0.015625, 1.0, 1.875, 13.0, 240.0, 448.0, 0.0]


def table(c: np.ndarray) -> np.ndarray:
    return np.asarray(E2M1_VALUES, dtype=np.float64)[c]


@triton.jit
def _dequant_kernel(codes_ptr, scales_ptr, lo_ptr, hi_ptr, R: tl.constexpr,
                    GPU: tl.constexpr):
    r = tl.arange(0, R)
    kb = tl.arange(0, 2)
    j = tl.arange(0, 8)
    offs = r[:, None, None] * 16 + kb[None, :, None] * 8 + j[None, None, :]
    codes = tl.load(codes_ptr + offs)
    scales = tl.load(scales_ptr + r[:, None] * 2 + kb[None, :])
    w_lo, w_hi = tiles.dequant_tile(codes, scales, GPU)
    tl.store(lo_ptr + offs, w_lo.to(tl.float32) * tiles.DEQUANT_UNSCALE)
    tl.store(hi_ptr + offs, w_hi.to(tl.float32) * tiles.DEQUANT_UNSCALE)


@triton.jit
def _table_kernel(out_ptr):
    c = tl.arange(0, 16)
    tl.store(out_ptr + c, tiles.e2m1_fp32(c))


def test_e2m1_fp32_decodes_every_code():
    out = torch.full((16,), float("nan"), device=DEV)
    _table_kernel[(1,)](out)
    assert torch.equal(out.cpu(), torch.tensor(E2M1_VALUES)), out


def _run_dequant(scale: float):
    """All 256 code bytes (16 rows x 16 bytes: 2 blocks of 8) with one scale."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    scales = torch.full((16, 2), scale).to(torch.float8_e4m3fn)
    assert float(scales[0, 0]) == scale  # the test scales are exact in E4M3
    lo = torch.full((16, 16), float("nan"), device=DEV)
    hi = torch.full((16, 16), float("nan"), device=DEV)
    _dequant_kernel[(1,)](codes.to(DEV), scales.to(DEV), lo, hi, R=16, GPU=ON_GPU)
    c = codes.numpy().astype(np.int64)
    return lo.cpu().double().numpy(), hi.cpu().double().numpy(), c


@pytest.mark.parametrize("scale", SCALES)
def test_dequant_tile_is_exact(scale):
    """w_lo / w_hi times 256 equal the low / high nibble's value times the scale, exactly
    (on the CPU: the interpreter's fp32 twin; on a GPU: the inline asm)."""
    lo, hi, c = _run_dequant(scale)
    np.testing.assert_array_equal(lo, table(c & 15) * scale)
    np.testing.assert_array_equal(hi, table(c >> 4) * scale)


def _prmt(a: np.ndarray, b: int, sel: int) -> np.ndarray:
    """PTX prmt.b32 (default mode): result byte i = byte sel[4i+3:4i] of {b, a}."""
    src = [(a >> (8 * k)) & 0xFF for k in range(4)] + [np.uint32((b >> (8 * k)) & 0xFF)
                                                      for k in range(4)]
    out = np.zeros_like(a)
    for i in range(4):
        out |= src[(sel >> (4 * i)) & 0x7] << np.uint32(8 * i)
    return out


def _bf16_pair_to_fp64(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two bf16 halves of uint32 registers as exact float64 values."""
    lo = ((r & 0xFFFF) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi = (r & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
    return lo, hi


def test_ptx_bit_trick_in_numpy():
    """Replay `tiles._DEQUANT_PTX` on every word of 4 code bytes that covers all 256 byte
    values, and check each bf16 pattern is the E2M1 value times 2^-126, so that times
    `scale * 2^118` it is `value * scale * 2^-8` (the bf16 multiply is exact: at most 6
    significant bits; checked here in float64)."""
    ptx = tiles._DEQUANT_PTX.value if hasattr(tiles._DEQUANT_PTX, "value") else tiles._DEQUANT_PTX
    assert "prmt.b32 t0, $4, 0, 0x4140" in ptx and "prmt.b32 t1, $4, 0, 0x4342" in ptx
    rng = np.random.default_rng()
    bytes_ = np.concatenate([np.arange(256), rng.integers(0, 256, 256)]).astype(np.uint32)
    words = (bytes_[0::4] | bytes_[1::4] << 8 | bytes_[2::4] << 16 | bytes_[3::4] << 24)
    words = words.astype(np.uint32)
    m32 = np.uint32(0xFFFFFFFF)

    def shl(v, n):
        return (v << np.uint32(n)) & m32

    t0, t1 = _prmt(words, 0, 0x4140), _prmt(words, 0, 0x4342)
    regs = {}
    for name, t, s_mag, s_sign in [("l0", t0, 6, 12), ("l1", t1, 6, 12),
                                   ("h0", t0, 2, 8), ("h1", t1, 2, 8)]:
        regs[name] = (shl(t, s_mag) & np.uint32(0x01C001C0)) | (shl(t, s_sign) & np.uint32(0x80008000))
        assert f"shl.b32 a, {'t0' if t is t0 else 't1'}, {s_mag};" in ptx
    byte = [(words >> np.uint32(8 * k)) & np.uint32(0xFF) for k in range(4)]
    # $0 = l0 = (byte0 lo, byte1 lo), $1 = l1 = (byte2 lo, byte3 lo); $2/$3 the high nibbles
    for reg, (k0, k1), shift in [("l0", (0, 1), 0), ("l1", (2, 3), 0), ("h0", (0, 1), 4),
                                 ("h1", (2, 3), 4)]:
        a, b = _bf16_pair_to_fp64(regs[reg])
        np.testing.assert_array_equal(a, table(((byte[k0] >> np.uint32(shift)) & 15).astype(np.int64)) * 2.0**-126)
        np.testing.assert_array_equal(b, table(((byte[k1] >> np.uint32(shift)) & 15).astype(np.int64)) * 2.0**-126)
    # the scale factor keeps every product in bf16's normal range and exact
    for s in SCALES[:-1]:
        prod = np.asarray(E2M1_VALUES[1:8]) * s
        assert prod.min() * 2.0**-8 >= 2.0**-126 and s * 2.0**118 < 2.0**128
