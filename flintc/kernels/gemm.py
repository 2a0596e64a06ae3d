"""Prefill GEMM (bf16 and NVFP4 W4A16 weights), the NVFP4 dequantization kernel, the LM
head and the embedding lookup: launchers for `flintc::gemm`, `flintc::lm_head` and
`flintc::embedding` (references: the op bodies in `flintc/ops/linear.py`, i.e.
`flintc.model.ops.linear` / `lm_head` and `table[ids]`).

Design. Prefill runs N = 512..8192 rows per chunk, where a GEMM is compute-bound, so the
matmul itself is cuBLAS (`torch.mm`). For NVFP4 weights a Triton kernel first decodes the
whole matrix to bf16 (`e2m1 * e4m3` has at most 4 significant bits and lies in bf16's
range: exact) into a reusable per-device workspace; cuBLAS then multiplies bf16 x bf16.
NVFP4 weights come in the packed layout (uint8 codes, `flintc.quant.nvfp4`) or in the
mma layout of the CUDA decode kernels (int32 codes, `flintc.kernels.nvfp4_mma.
pack_mma_layout`, which the runtime keeps instead of the packed copy on CUDA): its decode
(`nvfp4_mma_dequantize` through `_load_mma_tile`, which the grouped GEMM also uses)
gives the same bf16 matrix, so results are bit-identical.

Numerics (FLINT_SPEC section 3). On CUDA the GEMM is `aten::mm.dtype` (bf16 operands,
fp32 accumulation, **fp32 output**), then for NVFP4 the global scale multiplies the fp32
result, then one rounding to bf16. This keeps the reference's single rounding point; a
bf16-output `torch.mm` would also accumulate in fp32, but cuBLAS may then reduce split-K
partials in bf16 (`allow_bf16_reduced_precision_reduction` is on by default), which adds
a rounding, so fp32 output is the one closer to the reference (`precise=False` selects
bf16 output for the benchmark's comparison). Every product is exact in fp32, so the only
difference from the reference (an fp32 `x.float() @ w.float().T`) is the order of the fp32
additions: |out - ref| <= one bf16 ulp + K * 2^-24 * sum_k |x_k w_k|, and most elements
are bit-identical. On CPU the launchers compute the reference expression itself
(bit-identical). `lm_head` is the same GEMM with the fp32 result returned unrounded;
`embedding` is a row gather (bit-exact).

Nothing here host-synchronizes or allocates data-dependently; the NVFP4 workspace grows on
the first call with a larger weight, so the first call must not be inside CUDA-graph
capture: the runtime warms the prefill function up before capturing it, and the graph
holds a reference to the workspace it was captured with (`CompiledRunner._capture_prefill`),
so a later growth cannot free memory the graph writes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from flintc.kernels.nvfp4_mma import is_mma_layout, weight_dims
from flintc.kernels.platform import interpreting
from flintc.kernels.tiles import e2m1_fp32
from flintc.model import ops
from flintc.ops.common import CDT, as_weight

NVFP4_BLOCK = 16  # weights per E4M3 block scale
DEQUANT_BLOCK = 1024  # code bytes (2048 weights) per dequant program


# ---------------------------------------------------------------------------- Triton helpers
# E2M1 decode: the shared one of the decode kernels (`flintc.kernels.tiles.e2m1_fp32`,
# integer ops only, exact on every backend); also imported by flintc.kernels.grouped_gemm.
_e2m1_to_fp32 = e2m1_fp32


@triton.jit
def _round_to_bf16(v):
    """fp32 -> bf16, round to nearest even, done on the bits (the Triton interpreter's
    fp32 -> bf16 cast truncates; rounding onto the bf16 grid first makes the final cast
    exact on every backend). NaN stays NaN."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    rounded = bits.to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded).to(tl.bfloat16)


@triton.jit
def _dot_acc(acc, a, w, DOT_BF16: tl.constexpr):
    """acc[M, F] += a[M, k] @ w[F, k]^T, exact products, fp32 accumulation. All operand
    values are exact in bf16 (bf16 activations and weights, e2m1 * e4m3), so on the GPU the
    tensor cores take bf16; the interpreter mishandles bf16 math, so there both sides are
    upcast and the dot runs in IEEE fp32."""
    if DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    else:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")


@triton.jit
def _load_weight_tile(w_ptr, scales_ptr, offs_f, mask_f, k0, K,
                      BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr):
    """Raw weight tile of rows `offs_f`, columns [k0, k0 + BLOCK_K) of a row-major [F, K]
    matrix at w_ptr. bf16: (w [BLOCK_F, BLOCK_K], w again as a placeholder). NVFP4: (codes
    uint8 [BLOCK_F, BLOCK_K/2], scales fp8 [BLOCK_F, BLOCK_K/2], each scale repeated for
    the 8 bytes it covers), from codes [F, K/2] at w_ptr and scales [F, K/16] at scales_ptr."""
    if IS_NVFP4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        # mask: row exists and the byte's two weights lie inside K (K even).
        mask = mask_f[:, None] & (2 * offs_b < K)[None, :]
        codes = tl.load(w_ptr + offs_f[:, None] * (K // 2) + offs_b[None, :], mask=mask, other=0)
        offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        mask_s = mask_f[:, None] & (16 * offs_s < K)[None, :]
        scales = tl.load(scales_ptr + offs_f[:, None] * (K // 16) + offs_s[None, :],
                         mask=mask_s, other=0.0)
        scales = tl.broadcast_to(scales[:, :, None], (scales.shape[0], BLOCK_K // 16, 8))
        scales = tl.reshape(scales, (scales.shape[0], BLOCK_K // 2))
        return codes, scales
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_f[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + offs_f[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        return w, w


# ---------------------------------------------------------------------------- mma layout
# NVFP4 weights in the mma-fragment layout of the CUDA decode kernels
# (`flintc.kernels.nvfp4_mma.pack_mma_layout`): codes int32 [F/16, K/64, 32, 4] (stacked:
# [E, F/16, K/64, 32, 4], the flat pack of the [E * F, K] matrix), scale codes uint8
# [F/16, K/64, 32, 2] (`ue5m3`). Row f (ft = f // 16, g = f % 8, h = (f // 8) % 2) and
# column k (kc = k // 64, kk = k % 64, t = kk // 16) live in lane 4 g + t of (ft, kc): the
# int32 word `16 g + kk // 4` of the 128 words of (ft, kc), register r = 2 ((kk // 2) % 2)
# + h, 16-bit half e = kk % 2, code bits at `_CODE_BIT_POS[r]` (+ 16 e); the scale code is
# byte h of that lane's 2. A zero block scale is code 0 with the block's magnitudes
# cleared (its weights decode to +-0).
MMA_TILE_ROWS = 16  # rows per row tile of the mma layout (F % 16 == 0)
MMA_CHUNK = 64  # weights per chunk along K (K % 64 == 0)


@triton.jit
def _mma_code(q, R: tl.constexpr, E: tl.constexpr):
    """The 4-bit E2M1 code (int32) of register R, 16-bit half E of mma-layout words q
    (uint32): bits `_CODE_BIT_POS[R]` + 16 E, i.e. (p, p+1, p+2, p+9) with p = 6, 3, 0 for
    R = 0..2 and (10, 11, 13, 14) for R = 3 (b0 mantissa, b1-b2 exponent, b3 sign)."""
    if R == 3:
        c = ((q >> (10 + 16 * E)) & 3) | (((q >> (13 + 16 * E)) & 3) << 2)
    else:
        c = ((q >> (6 - 3 * R + 16 * E)) & 7) | (((q >> (15 - 3 * R + 16 * E)) & 1) << 3)
    return c.to(tl.int32)


@triton.jit
def _scale_from_code(c, EXP_SHIFT: tl.constexpr):
    """fp32 `scale * 2^-EXP_SHIFT` of ue5m3 codes c (int32 0..255), from the bits (exact)."""
    bits = (((c >> 3) + (127 - 9 - EXP_SHIFT)) << 23) | ((c & 7) << 20)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mma_half(q, s, H: tl.constexpr, BF16: tl.constexpr):
    """The 4 weights of rows g + 8 H in words q [FTB, 8, KCB, 16] (uint32), times their
    scales s (fp32, same shape): [FTB, 8, KCB, 16, 2 (half), 2 (e)], in K order along the
    last two dims (k = 4 j + 2 half + e; register 2 half + H)."""
    w00 = _e2m1_to_fp32(_mma_code(q, H, 0)) * s  # half 0, e 0
    w01 = _e2m1_to_fp32(_mma_code(q, H, 1)) * s
    w10 = _e2m1_to_fp32(_mma_code(q, 2 + H, 0)) * s  # half 1
    w11 = _e2m1_to_fp32(_mma_code(q, 2 + H, 1)) * s
    if BF16:  # exact (<= 6 significant bits, normal range): halves the shuffles below
        w00 = w00.to(tl.bfloat16)
        w01 = w01.to(tl.bfloat16)
        w10 = w10.to(tl.bfloat16)
        w11 = w11.to(tl.bfloat16)
    return tl.join(tl.join(w00, w10), tl.join(w01, w11))


# The CUDA decode kernels' word decode (`flintc.kernels.nvfp4_mma._DECODE_EXPR`, replayed
# on the CPU by `decode_mma_layout`) for the tensor-core path of the Triton prefill GEMMs:
# $8 = one mma-layout word, $9 / $10 = bf16x2 of `scale * 2^118` (both halves) of rows g /
# g + 8; out $2r, $2r + 1 = register r's two weights (e = 0, 1) as bf16
# `e2m1 * scale * 2^-8` (exact). About 2.3 instructions per weight against ~8 for the
# per-weight shifts of `_mma_half`.
_MMA_WORD_PTX = tl.constexpr("""
{
.reg .b32 a, b, c, d0, d1, d2, d3;
and.b32 d0, $8, 0x81C081C0;
shl.b32 a, $8, 3;
and.b32 d1, a, 0x81C081C0;
shl.b32 a, $8, 6;
and.b32 d2, a, 0x81C081C0;
shl.b32 a, $8, 1;
and.b32 a, a, 0x80008000;
shr.b32 b, $8, 4;
and.b32 b, b, 0x00C000C0;
shr.b32 c, $8, 5;
and.b32 c, c, 0x01000100;
or.b32 d3, a, b;
or.b32 d3, d3, c;
mul.rn.bf16x2 d0, d0, $9;
mul.rn.bf16x2 d1, d1, $10;
mul.rn.bf16x2 d2, d2, $9;
mul.rn.bf16x2 d3, d3, $10;
mov.b32 {$0, $1}, d0;
mov.b32 {$2, $3}, d1;
mov.b32 {$4, $5}, d2;
mov.b32 {$6, $7}, d3;
}
""")


@triton.jit
def _load_mma_halves(wq_ptr, sq_ptr, row0, row_end, k0, K, BLOCK_F: tl.constexpr,
                     BLOCK_K: tl.constexpr, EXP_SHIFT: tl.constexpr = 8,
                     BF16: tl.constexpr = False):
    """`_load_mma_tile`'s tile as its two row halves, without the row interleave: (w_lo,
    w_hi), each [BLOCK_F / 2, BLOCK_K] in natural K order, row i of w_lo being row
    row0 + 16 (i // 8) + i % 8 and of w_hi that row + 8 (the rows g and g + 8 that share
    an mma word). A GEMM runs one dot per half and puts the rows back in order once, on
    its accumulators (`mma_unhalve`), instead of permuting every weight tile (which goes
    through shared memory). Same arguments and values as `_load_mma_tile`."""
    FTB: tl.constexpr = BLOCK_F // 16
    KCB: tl.constexpr = BLOCK_K // 64
    KC = K // 64
    i = tl.arange(0, FTB)[:, None, None, None]
    g = tl.arange(0, 8)[None, :, None, None]
    c = tl.arange(0, KCB)[None, None, :, None]
    j = tl.arange(0, 16)[None, None, None, :]
    ft = row0 // 16 + i  # int64
    mask = (row0 + 16 * i < row_end) & (k0 + 64 * c < K) & (g < 8) & (j < 16)
    tile = ft * KC + (k0 // 64 + c)  # (ft, kc) index
    q = tl.load(wq_ptr + (tile * 128 + 16 * g + j), mask=mask, other=0).to(tl.uint32, bitcast=True)
    # Both scale codes of each lane (4 g + t) as one u16, [FTB, 8, KCB, 4 (t)]: vector loads
    # the pipeliner can issue ahead (byte gathers per word were synchronous loads, which
    # made the grouped GEMM 2x slower than on the packed layout), then broadcast over the
    # lane's 4 words (s) to the words' [FTB, 8, KCB, 16 (j = 4 t + s)].
    t4 = tl.arange(0, 4)[None, None, None, :]
    sc = tl.load(sq_ptr.to(tl.pointer_type(tl.uint16)) + (tile * 32 + 4 * g + t4),
                 mask=(row0 + 16 * i < row_end) & (k0 + 64 * c < K) & (g < 8) & (t4 < 4),
                 other=0).to(tl.uint32)
    sc = tl.reshape(tl.broadcast_to(sc[:, :, :, :, None], (FTB, 8, KCB, 4, 4)), (FTB, 8, KCB, 16))
    c_lo, c_hi = sc & 0xFF, sc >> 8  # rows g, rows g + 8
    if BF16 and EXP_SHIFT == 8:  # GPU: the CUDA kernels' word decode, inline PTX
        b_lo = (c_lo << 4) + (236 << 7)  # bf16 of scale * 2^118 (scale_code_to_bf16_bits)
        b_hi = (c_hi << 4) + (236 << 7)
        r0e0, r0e1, r1e0, r1e1, r2e0, r2e1, r3e0, r3e1 = tl.inline_asm_elementwise(
            _MMA_WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
            [q, b_lo | (b_lo << 16), b_hi | (b_hi << 16)],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        # register r = 2 half + h: rows g take r = 0, 2, rows g + 8 r = 1, 3; [.., half, e]
        w_lo = tl.join(tl.join(r0e0, r2e0), tl.join(r0e1, r2e1))
        w_hi = tl.join(tl.join(r1e0, r3e0), tl.join(r1e1, r3e1))
    else:
        w_lo = _mma_half(q, _scale_from_code(c_lo.to(tl.int32), EXP_SHIFT), 0, BF16)  # rows g
        w_hi = _mma_half(q, _scale_from_code(c_hi.to(tl.int32), EXP_SHIFT), 1, BF16)  # rows g + 8
    return (tl.reshape(w_lo, (BLOCK_F // 2, BLOCK_K)),
            tl.reshape(w_hi, (BLOCK_F // 2, BLOCK_K)))


@triton.jit
def _load_mma_tile(wq_ptr, sq_ptr, row0, row_end, k0, K, BLOCK_F: tl.constexpr,
                   BLOCK_K: tl.constexpr, EXP_SHIFT: tl.constexpr = 8, BF16: tl.constexpr = False):
    """Weight tile [BLOCK_F, BLOCK_K] of an mma-layout NVFP4 matrix (flat [R, K]: codes int32
    [R/16, K/64, 32, 4] at wq_ptr, ue5m3 scale codes uint8 [R/16, K/64, 32, 2] at sq_ptr),
    rows [row0, row0 + BLOCK_F) and columns [k0, k0 + BLOCK_K) in natural row and K order,
    as `e2m1 * scale * 2^-EXP_SHIFT`, exact: fp32, or bf16 with BF16 (the same values).
    The default EXP_SHIFT = 8 matches `flintc.kernels.tiles.dequant_tile_k_order` (multiply
    the fp32 accumulator by `DEQUANT_UNSCALE` after the K loop, as for the packed layout).

    row0 (int64) and k0 multiples of 16 and 64, BLOCK_F of 16, BLOCK_K of 64 (K % 64 == 0);
    row tiles at or past `row_end` (for expert e of a stack, rows e * F + f: row0 =
    e * F + f0, row_end = (e + 1) * F) and chunks at or past K read 0.

    Each (16-row tile, 64-column chunk) is 128 contiguous int32 words, loaded as a
    [BLOCK_F/16, 8 (g), BLOCK_K/64, 16 (j = 4 t + s)] tile (coalesced, one load per 8
    weights); word (g, j) holds rows g and g + 8 (h), columns 4 j .. 4 j + 3 of the chunk
    (register 2 half + h, half e: k = 4 j + 2 half + e), and lane 4 g + t's two scale
    bytes the block scales of those rows. `_load_mma_halves` loads and decodes them; the
    two row halves are joined / permuted back into natural order here."""
    FTB: tl.constexpr = BLOCK_F // 16
    w_lo, w_hi = _load_mma_halves(wq_ptr, sq_ptr, row0, row_end, k0, K, BLOCK_F, BLOCK_K,
                                  EXP_SHIFT, BF16)
    w_lo = tl.reshape(w_lo, (FTB, 8, BLOCK_K))  # rows g
    w_hi = tl.reshape(w_hi, (FTB, 8, BLOCK_K))  # rows g + 8
    w = tl.permute(tl.join(w_lo, w_hi), (0, 3, 1, 2))  # [FTB, 2 (h), 8 (g), BLOCK_K]
    return tl.reshape(w, (BLOCK_F, BLOCK_K))


@triton.jit
def mma_unhalve(acc_lo, acc_hi, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """[BLOCK_M, BLOCK_F] accumulator in natural column order from the per-half ones of
    `_load_mma_halves` ([BLOCK_M, BLOCK_F / 2] each: column i = row 16 (i // 8) + i % 8
    (+ 8 for acc_hi) of the weight tile)."""
    both = tl.reshape(tl.join(acc_lo, acc_hi), (BLOCK_M, BLOCK_F // 16, 8, 2))  # [m, ft, g, h]
    return tl.reshape(tl.permute(both, (0, 1, 3, 2)), (BLOCK_M, BLOCK_F))


# ---------------------------------------------------------------------------- NVFP4 dequant
@triton.jit
def nvfp4_dequant_kernel(
    codes_ptr,  # uint8 [R * K/2] (R rows of K weights, contiguous): weight 2j low nibble of byte j
    scales_ptr,  # float8_e4m3fn [R * K/16]: one scale per 16 weights = 8 bytes of codes
    out_ptr,  # bf16 [R * K]
    n_bytes,  # R * K/2
    BLOCK: tl.constexpr,  # code bytes per program
):
    # Program p decodes code bytes [p * BLOCK, (p + 1) * BLOCK) of the flattened matrix.
    # K % 16 == 0, so a row's K/2 bytes are a whole number of 8-byte scale groups and the
    # scale of flat byte b is flat scale b // 8, whatever row b lies in.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes  # the last program may stick out past the matrix
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scales_ptr + offs // 8, mask=mask, other=0.0).to(tl.float32)  # exact
    # e2m1 * e4m3: <= 4 significant bits, exponent within bf16's range: exact in bf16, so
    # the casts below do not round (and the interpreter's truncating cast is harmless).
    lo = (_e2m1_to_fp32(c & 15) * s).to(tl.bfloat16)  # weight 2j
    hi = (_e2m1_to_fp32(c >> 4) * s).to(tl.bfloat16)  # weight 2j + 1
    tl.store(out_ptr + 2 * offs, lo, mask=mask)
    tl.store(out_ptr + 2 * offs + 1, hi, mask=mask)


@triton.jit
def nvfp4_mma_dequant_kernel(
    wq_ptr,  # int32 [R/16, K/64, 32, 4]: mma-layout codes (`pack_mma_layout`), contiguous
    sq_ptr,  # uint8 [R/16, K/64, 32, 2]: ue5m3 block-scale codes
    out_ptr,  # bf16 [R, K], row-major
    R, K,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,  # multiples of 16 and 64
):
    # Program (pid_r, pid_k) decodes rows [pid_r * BLOCK_R, +BLOCK_R) x columns
    # [pid_k * BLOCK_K, +BLOCK_K) into natural order; e2m1 * scale is exact in bf16.
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_R
    k0 = tl.program_id(1) * BLOCK_K
    w = _load_mma_tile(wq_ptr, sq_ptr, row0, R, k0, K, BLOCK_R, BLOCK_K, 0)
    rows = row0 + tl.arange(0, BLOCK_R)
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], w.to(tl.bfloat16), mask=mask)


MMA_DEQUANT_BLOCK_R = 32  # rows per mma dequant program (multiple of 16)
MMA_DEQUANT_BLOCK_K = 256  # columns per mma dequant program (multiple of 64)


def nvfp4_mma_dequantize(codes: torch.Tensor, scales: torch.Tensor,
                         out: torch.Tensor | None = None,
                         use_triton: bool | None = None) -> torch.Tensor:
    """Decode mma-layout NVFP4 weights (`flintc.kernels.nvfp4_mma.pack_mma_layout`) to bf16
    in natural [.., F, K] order, without the global scale.

    Args:
        codes: int32 [..., F/16, K/64, 32, 4], contiguous (a stack of experts: the leading
            dims, as `pack_mma_layout` of the flattened [E * F, K] matrix reshaped).
        scales: uint8 [..., F/16, K/64, 32, 2] ue5m3 block-scale codes, contiguous, on
            codes' device.
        out: optional contiguous bf16 [..., F, K] to write into; allocated when None.
        use_triton: run the Triton kernel `nvfp4_mma_dequant_kernel` (default: on CUDA, or
            on CPU under TRITON_INTERPRET=1); False: the torch decoder
            `flintc.kernels.nvfp4_mma.decode_mma_layout`.

    Returns:
        bf16 [..., F, K]: `e2m1(code) * block_scale`, exact; bit-identical to
        `nvfp4_dequantize` of the same weights in the packed layout (a zero block scale
        gives +-0 with the code's sign, as there).

    Raises:
        ValueError: a dtype, shape, device or contiguity is wrong (the message names it).
    """
    op = "nvfp4_mma_dequantize"
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int32 or codes.dim() < 4 \
            or tuple(codes.shape[-2:]) != (32, 4) or not codes.is_contiguous():
        _fail(op, "codes", "a contiguous int32 tensor [..., F/16, K/64, 32, 4] (mma layout)", codes)
    lead, F, K = weight_dims(codes)
    want = tuple(codes.shape[:-2]) + (32, 2)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 \
            or tuple(scales.shape) != want or not scales.is_contiguous() \
            or scales.device != codes.device:
        _fail(op, "scales", f"a contiguous uint8 tensor {list(want)} (ue5m3 scale codes) on "
              f"{codes.device}", scales)
    if out is None:
        out = torch.empty(lead + (F, K), dtype=torch.bfloat16, device=codes.device)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16
          or tuple(out.shape) != lead + (F, K) or not out.is_contiguous()
          or out.device != codes.device):
        _fail(op, "out", f"a contiguous bf16 tensor {list(lead) + [F, K]} on {codes.device}", out)
    if use_triton is None:
        use_triton = codes.device.type == "cuda" or interpreting()
    R = out.numel() // K if K else 0
    if not use_triton:
        from flintc.kernels.nvfp4_mma import decode_mma_layout

        if R:
            out.view(R, K).copy_(decode_mma_layout(codes.reshape(-1, K // MMA_CHUNK, 32, 4),
                                                   scales.reshape(-1, K // MMA_CHUNK, 32, 2)))
        return out
    if R:
        grid = (triton.cdiv(R, MMA_DEQUANT_BLOCK_R), triton.cdiv(K, MMA_DEQUANT_BLOCK_K))
        nvfp4_mma_dequant_kernel[grid](codes, scales, out, R, K, BLOCK_R=MMA_DEQUANT_BLOCK_R,
                                       BLOCK_K=MMA_DEQUANT_BLOCK_K, num_warps=4)
    return out


_WORKSPACE: dict[tuple[str, int | None], torch.Tensor] = {}


def _workspace(numel: int, device: torch.device) -> torch.Tensor:
    """A bf16 buffer of at least `numel` elements on `device`, reused across calls (grown
    when too small). Kernels on one stream use it in order, so reuse is safe there."""
    key = (device.type, device.index)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.bfloat16, device=device)
        _WORKSPACE[key] = buf
    return buf[:numel]


def nvfp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
                     use_triton: bool | None = None) -> torch.Tensor:
    """Decode packed NVFP4 codes and block scales to bf16, without the global scale.

    Args:
        codes: uint8 [..., R, K/2], contiguous (layout of `flintc.quant.nvfp4`).
        scales: float8_e4m3fn [..., R, K/16], contiguous, on codes' device.
        out: optional contiguous bf16 [..., R, K] to write into; allocated when None.
        use_triton: run the Triton kernel (default: on CUDA, or on CPU under
            TRITON_INTERPRET=1); False: the torch decoder `flintc.quant.nvfp4.dequantize_packed`.

    Returns:
        bf16 [..., R, K]: `e2m1(code) * e4m3(scale)`, exact (equal in value to
        `NVFP4Tensor.dequantize(with_global_scale=False)`; code 8 decodes to -0.0 here).

    The mma layout (codes int32 [..., F/16, K/64, 32, 4], scales uint8 [..., F/16, K/64,
    32, 2]) is decoded by `nvfp4_mma_dequantize` (same result for the same weights).

    Raises:
        ValueError: a dtype, shape, device or contiguity is wrong (the message names it).
    """
    if is_mma_layout(codes):
        return nvfp4_mma_dequantize(codes, scales, out=out, use_triton=use_triton)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() < 2 \
            or not codes.is_contiguous():
        raise ValueError("nvfp4_dequantize: codes must be a contiguous uint8 tensor [..., R, K/2]")
    K = codes.shape[-1] * 2
    lead = tuple(codes.shape[:-1])
    if K % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_dequantize: codes has K={K} weights per row; NVFP4 needs "
                         f"K % {NVFP4_BLOCK} == 0")
    if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float8_e4m3fn
            or tuple(scales.shape) != lead + (K // NVFP4_BLOCK,) or not scales.is_contiguous()
            or scales.device != codes.device):
        raise ValueError(f"nvfp4_dequantize: scales must be a contiguous float8_e4m3fn tensor "
                         f"{list(lead) + [K // NVFP4_BLOCK]} on {codes.device}, got "
                         f"{getattr(scales, 'dtype', None)} {tuple(getattr(scales, 'shape', ()))}")
    if out is None:
        out = torch.empty(lead + (K,), dtype=torch.bfloat16, device=codes.device)
    elif (out.dtype != torch.bfloat16 or tuple(out.shape) != lead + (K,) or not out.is_contiguous()
          or out.device != codes.device):
        raise ValueError(f"nvfp4_dequantize: out must be a contiguous bf16 tensor {list(lead) + [K]} "
                         f"on {codes.device}")
    if use_triton is None:
        use_triton = codes.device.type == "cuda" or interpreting()
    if not use_triton:
        from flintc.quant.nvfp4 import dequantize_packed

        out.copy_(dequantize_packed(codes, scales, None, torch.float32))
        return out
    n_bytes = codes.numel()
    if n_bytes:
        nvfp4_dequant_kernel[(triton.cdiv(n_bytes, DEQUANT_BLOCK),)](
            codes, scales, out, n_bytes, BLOCK=DEQUANT_BLOCK, num_warps=4)
    return out


# ---------------------------------------------------------------------------- checks
def _fail(op: str, name: str, what: str, t) -> None:
    if isinstance(t, torch.Tensor):
        got = f"dtype {t.dtype}, shape {tuple(t.shape)}, strides {tuple(t.stride())}, device {t.device}"
    else:
        got = type(t).__name__
    raise ValueError(f"{op}: {name} must be {what}; got {got}")


def _check_weight(op: str, w, K: int, device: torch.device):
    """Validate a 2-D weight list (bf16, or NVFP4 in the packed or the mma layout);
    returns (is_nvfp4, F)."""
    if not isinstance(w, (list, tuple)) or len(w) not in (1, 3):
        raise ValueError(f"{op}: w must be a list [weight] (bf16) or [codes, scales, "
                         f"global_scale] (NVFP4), got {type(w).__name__} of length "
                         f"{len(w) if isinstance(w, (list, tuple)) else '-'}")
    if len(w) == 1:
        (weight,) = w
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 \
                or weight.dim() != 2 or weight.shape[1] != K or weight.device != device:
            _fail(op, "w[0] (weight)", f"a bf16 tensor [F, {K}] on {device}", weight)
        return False, weight.shape[0]
    codes, scales, gscale = w
    if is_mma_layout(codes):
        return True, _check_mma_weight(op, w, K, device)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 2 \
            or codes.shape[1] * 2 != K or codes.device != device or not codes.is_contiguous():
        _fail(op, "w[0] (NVFP4 codes)", f"a contiguous uint8 tensor [F, {K // 2}] on {device}", codes)
    if K % NVFP4_BLOCK:
        raise ValueError(f"{op}: x has K={K}; NVFP4 weights need K % {NVFP4_BLOCK} == 0")
    F = codes.shape[0]
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float8_e4m3fn \
            or tuple(scales.shape) != (F, K // NVFP4_BLOCK) or scales.device != device \
            or not scales.is_contiguous():
        _fail(op, "w[1] (NVFP4 block scales)",
              f"a contiguous float8_e4m3fn tensor [{F}, {K // NVFP4_BLOCK}] on {device}", scales)
    _check_gscale(op, gscale, device)
    return True, F


def _check_gscale(op: str, gscale, device: torch.device) -> None:
    """w[2] of an NVFP4 weight: an fp32 scalar tensor [] on `device` (either layout)."""
    if not isinstance(gscale, torch.Tensor) or gscale.dtype != torch.float32 or gscale.dim() != 0 \
            or gscale.device != device:
        _fail(op, "w[2] (NVFP4 global scale)", f"an fp32 scalar tensor [] on {device}", gscale)


def _check_mma_weight(op: str, w, K: int, device: torch.device) -> int:
    """Validate a 2-D NVFP4 weight in the mma layout ([codes int32 [F/16, K/64, 32, 4],
    scales uint8 [F/16, K/64, 32, 2], global_scale fp32 []]); returns F."""
    codes, scales, gscale = w
    if K % MMA_CHUNK:
        raise ValueError(f"{op}: x has K={K}; mma-layout NVFP4 weights (int32 codes) need "
                         f"K % {MMA_CHUNK} == 0")
    KC = K // MMA_CHUNK
    if codes.dim() != 4 or codes.shape[1] != KC or tuple(codes.shape[2:]) != (32, 4) \
            or codes.device != device or not codes.is_contiguous():
        _fail(op, "w[0] (NVFP4 mma-layout codes)",
              f"a contiguous int32 tensor [F/16, {KC}, 32, 4] on {device}", codes)
    FT = codes.shape[0]
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 \
            or tuple(scales.shape) != (FT, KC, 32, 2) or scales.device != device \
            or not scales.is_contiguous():
        _fail(op, "w[1] (NVFP4 mma-layout scale codes)",
              f"a contiguous uint8 tensor [{FT}, {KC}, 32, 2] on {device}", scales)
    _check_gscale(op, gscale, device)
    return FT * MMA_TILE_ROWS


def _check_x(op: str, x) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() < 2:
        _fail(op, "x", "a bf16 tensor [..., K] (at least 2-D)", x)
    if x.stride(-1) != 1:
        _fail(op, "x", "a tensor with a contiguous last dim", x)


def _mm_fp32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """fp32 [M, F] = a [M, K] @ b_t [K, F] for bf16 operands with fp32 accumulation, no
    rounding: cuBLAS bf16 GEMM with fp32 output (`aten::mm.dtype`) on CUDA; on CPU the
    reference's own expression (upcast, fp32 matmul), so CPU results are bit-identical."""
    if a.device.type == "cuda" and hasattr(torch.ops.aten.mm, "dtype"):
        return torch.ops.aten.mm.dtype(a, b_t, torch.float32)
    return a.to(torch.float32) @ b_t.to(torch.float32)


# ---------------------------------------------------------------------------- gemm
def gemm(x: torch.Tensor, w: list[torch.Tensor], *, use_pdl: bool = False,
         precise: bool = True) -> torch.Tensor:
    """Prefill `x @ W^T`, as `flintc::gemm` (reference: `flintc.model.ops.linear`).

    Args:
        x: bf16 [..., K] (usually [N, K], N = chunk tokens), last dim contiguous.
        w: `[weight]` bf16 [F, K] (any strides), or NVFP4 `[codes, scales, global_scale]`
            in either layout, told apart by codes' dtype:
            - packed: codes uint8 [F, K/2], scales float8_e4m3fn [F, K/16]; K % 16 == 0;
            - mma (`flintc.kernels.nvfp4_mma.pack_mma_layout`): codes int32
              [F/16, K/64, 32, 4], scales uint8 [F/16, K/64, 32, 2] (ue5m3 codes);
              K % 64 == 0. Results are bit-identical to the packed layout's.
            Codes and scales contiguous, global_scale fp32 []. All on x's device.
        use_pdl: accepted for the kernel contract; cuBLAS launches ignore it.
        precise: True (default): fp32-output GEMM, then (NVFP4) the global scale, then
            one rounding. False: bf16-output cuBLAS GEMM (one fewer pass over the output,
            may round split-K partials in bf16); for NVFP4 the fp32 path is always used,
            since the global scale must meet the unrounded accumulator.

    Returns:
        bf16 [..., F]. Numerics: see the module docstring (<= 1 bf16 ulp + reordering
        bound from the reference on CUDA; bit-identical on CPU).

    Raises:
        ValueError: a dtype, shape, device or stride does not match the above (the message
            names the tensor, e.g. `w[1] (NVFP4 mma-layout scale codes)`, and the expected
            dtype and shape), or K % 64 != 0 for an mma-layout weight.
    """
    del use_pdl
    _check_x("gemm", x)
    K = x.shape[-1]
    is_nvfp4, F = _check_weight("gemm", w, K, x.device)
    x2 = x.reshape(-1, K)
    if is_nvfp4:
        codes, scales, gscale = w
        wd = nvfp4_dequantize(codes, scales, out=_workspace(F * K, x.device).view(F, K))
        # the global scale on the fp32 accumulator (FLINT_SPEC 3), rounded once as the
        # product is stored (fp32 multiply, then the same RNE as `.to(bfloat16)`)
        out = torch.empty(x2.shape[0], F, dtype=torch.bfloat16, device=x.device)
        return torch.mul(_mm_fp32(x2, wd.T), gscale, out=out).view(*x.shape[:-1], F)
    if precise or x.device.type != "cuda":
        y = _mm_fp32(x2, w[0].T)
    else:
        return (x2 @ w[0].T).view(*x.shape[:-1], F)
    return y.to(torch.bfloat16).view(*x.shape[:-1], F)


def gemm_reference(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """The op's reference (`flintc.model.ops.linear`): plain torch, fp32, one rounding."""
    return ops.linear(x, as_weight(w), CDT)


# ---------------------------------------------------------------------------- lm_head
def lm_head(x: torch.Tensor, w: torch.Tensor, *, use_pdl: bool = False) -> torch.Tensor:
    """Logits `x @ lm_head^T` with fp32 accumulation, never rounded, as `flintc::lm_head`
    (reference: `flintc.model.ops.lm_head`).

    For prefill the runtime usually needs only the last token's row; the op contract
    returns every row, so pass only the rows you need (e.g. `x[-1:]`) to save the GEMM.

    Args:
        x: bf16 [N, H], last dim contiguous.
        w: bf16 [V, H] on x's device.
        use_pdl: accepted for the kernel contract; ignored (cuBLAS).

    Returns:
        fp32 [N, V]. On CUDA: cuBLAS bf16 GEMM with fp32 output, equal to the reference up
        to fp32 reordering (|diff| <= H * 2^-24 * sum |x_k w_k|); on CPU bit-identical.

    Raises:
        ValueError: wrong dtype, rank, shape or device.
    """
    del use_pdl
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 \
            or x.stride(-1) != 1:
        _fail("lm_head", "x", "a bf16 tensor [N, H] with a contiguous last dim", x)
    H = x.shape[1]
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2 \
            or w.shape[1] != H or w.device != x.device:
        _fail("lm_head", "w", f"a bf16 tensor [V, {H}] on {x.device}", w)
    return _mm_fp32(x, w.T)


# ---------------------------------------------------------------------------- embedding
def embedding(ids: torch.Tensor, table: torch.Tensor, *, use_pdl: bool = False) -> torch.Tensor:
    """Row lookup `table[ids]`, as `flintc::embedding` (bit-exact).

    Args:
        ids: int64 [B, T] token ids in [0, V) (not range-checked here: that would need a
            host sync; out-of-range ids raise on CPU and trip a device assert on CUDA).
        table: bf16 [V, H] on ids' device.
        use_pdl: accepted for the kernel contract; ignored.

    Returns:
        bf16 [B, T, H], a new tensor.

    Raises:
        ValueError: wrong dtype, rank or device.
    """
    del use_pdl
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 2:
        _fail("embedding", "ids", "an int64 tensor [B, T]", ids)
    if not isinstance(table, torch.Tensor) or table.dtype != torch.bfloat16 or table.dim() != 2 \
            or table.device != ids.device:
        _fail("embedding", "table", f"a bf16 tensor [V, H] on {ids.device}", table)
    return torch.nn.functional.embedding(ids, table)


KERNELS: dict[str, Callable] = {
    "gemm": gemm,
    "lm_head": lm_head,
    "embedding": embedding,
}
