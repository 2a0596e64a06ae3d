"""Weight tiles of the decode GEMV kernels, the Triton helpers that `flintc.kernels.gemv`,
`flintc.kernels.fused_gemv` and `flintc.kernels.moe` share: the tile loader
(`load_weight_tile`, `load_flat_tile`), the NVFP4 decode (`dequant_tile`, `e2m1_fp32`)
and the tensor-core step (`dot_tile`, `dot_2d`; with SWAP the weight tile is the dot's
left operand, `acc_init` / `acc_final` hold the transposed accumulator).

Format (FLINT_SPEC section 4, packed layout of `flintc.quant.nvfp4`): byte j of a weight
row holds weight 2j in its low nibble and weight 2j + 1 in its high nibble; a code is
sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0), values
{0, 0.5, 1, 1.5, 2, 3, 4, 6}; one float8_e4m3fn scale per 16 weights.

Decoding for the tensor cores (`dequant_tile`, issue 5 round 3). The first kernels
built the bf16 bit pattern of each weight with ~10 integer ops per weight, which made
every NVFP4 GEMV bound by instruction issue (5-7% of copy bandwidth on the H200). The
decode here follows the bit trick of Marlin's FP4 path (vLLM `csrc/quantization/
gptq_marlin/dequant.h`, `dequant<nv_bfloat162, kFE2M1f>`): copy the code's three
magnitude bits into bf16 bits 8-6 (the two low exponent bits and the top mantissa bit)
and its sign into bit 15. The resulting bf16 is the E2M1 value times 2^-126 for every
code, subnormal 0.5 included (bf16 exponent field e - 127 versus E2M1 bias 1, and the
subnormal 0.5 * 2^-126 lands on the bf16 subnormal with the same mantissa bit). One
bf16x2 multiply by `bf16(scale * 2^118)` then gives `e2m1 * scale * 2^-8`:

* exact: an E2M1 significand has 2 bits and an E4M3 one 4, so the product has at most 6
  significant bits (bf16 keeps 8), and it stays in bf16's normal range (2^-18 ..
  10.5; `scale * 2^118` is at most 2^127);
* the 2^-8 is undone by one exact multiply of the fp32 accumulator by
  `DEQUANT_UNSCALE` (256) after the K loop, so the dot products are the same fp32 sums of
  the same exact products as with the direct decode.

On the GPU the decode is one `tl.inline_asm_elementwise` per 4 code bytes (8 weights):
two `prmt` spread the bytes into the two 16-bit halves of two registers, shifts and
masks place the bits (ptxas merges them into LOP3s), four `mul.rn.bf16x2` apply the
scale: about 2 instructions per weight instead of ~10. The interpreter cannot run inline
asm, so there the same bit formulas run per element in fp32 (a bf16 pattern shifted
into the top half of an fp32 is the same value), which tests the formulas and the
2^-8 / 256 bookkeeping on the CPU; `tests/kernels/test_tiles.py` also replays the PTX
instruction by instruction in numpy for all 256 code bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

DEQUANT_UNSCALE = tl.constexpr(256.0)  # multiply the fp32 accumulator of `dequant_tile` weights by this
SCALE_BIAS = tl.constexpr(2.0 ** 118)  # `dequant_tile`'s scale factor: bf16 pattern (x 2^-126) -> x 2^-8

# Operands: $0, $1 = bf16x2 of the 4 low-nibble weights, $2, $3 = bf16x2 of the 4
# high-nibble weights, $4 = the 4 code bytes (byte k = element k), $5, $6 = bf16x2 of the
# 4 elements' scales (times SCALE_BIAS). Element 2i sits in the low half of a register.
_DEQUANT_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, a, b, l0, l1, h0, h1;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 a, t0, 6;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t0, 12;
and.b32 b, b, 0x80008000;
or.b32 l0, a, b;
shl.b32 a, t1, 6;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t1, 12;
and.b32 b, b, 0x80008000;
or.b32 l1, a, b;
shl.b32 a, t0, 2;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t0, 8;
and.b32 b, b, 0x80008000;
or.b32 h0, a, b;
shl.b32 a, t1, 2;
and.b32 a, a, 0x01C001C0;
shl.b32 b, t1, 8;
and.b32 b, b, 0x80008000;
or.b32 h1, a, b;
mul.rn.bf16x2 $0, l0, $5;
mul.rn.bf16x2 $1, l1, $6;
mul.rn.bf16x2 $2, h0, $5;
mul.rn.bf16x2 $3, h1, $6;
}
""")


@triton.jit
def e2m1_fp32(c):
    """E2M1 codes (int32, 0..15; sign bit 3, exponent bits 2-1, mantissa bit 0) to fp32,
    by building the fp32 bit pattern with integer ops (no conversion instruction).

    Magnitude index m = c & 7: m >= 2 is normal, exponent e = m >> 1 with bias 1, so the
    fp32 pattern is (m << 22) + (126 << 23); m == 1 is 0.5 (0x3F000000); m == 0 is zero.
    Code 8 (-0) gives -0.0, which adds like +0.0.
    """
    m = c & 7
    bits = tl.where(m >= 2, (m << 22) + (126 << 23), m * 0x3F000000)
    bits = bits | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_code_tile(w_rows, mask_f, k0, k_end, BLOCK_K: tl.constexpr):
    """NVFP4 codes uint8 [BLOCK_F, BLOCK_K/16, 8] of columns [k0, k0 + BLOCK_K): 8 bytes
    (one 16-weight block) per thread-vector. `w_rows`: pointers [BLOCK_F] to each row's
    first code byte (row length K/2 bytes); `mask_f` bool [BLOCK_F]: rows that exist.
    Blocks starting at or past `k_end` and rows off `mask_f` read 0 (no memory traffic);
    k0 and k_end must be multiples of 16 (K % 16 == 0, split bounds multiples of
    BLOCK_K).

    Loaded as a 2-D [BLOCK_F, BLOCK_K/2] tile and reshaped: Triton then spreads a warp's
    lanes along each row's contiguous bytes, so the pipeliner's cp.async copies and the
    reads back fill shared memory without bank conflicts. A 3-D [BLOCK_F, BLOCK_K/16, 8]
    pointer tile put the 32 lanes on 32 rows, 64 bytes apart in shared memory: 15x the
    ideal shared-memory wavefronts on those copies, 60% of all of the NVFP4 MoE gate/up
    kernel's (Nsight Compute, session 10 run 3). The 2-D tile made the NVFP4 GEMVs 15-26%
    faster (docs/gpu-runs.md, session 10 run 6)."""
    b = tl.arange(0, BLOCK_K // 2)  # byte column
    # mask: row exists, and the byte's 16-weight block starts before k_end; (b // 8) keeps
    # it constant over each 8-byte vector, so the load stays vectorized
    mask = mask_f[:, None] & (k0 + 16 * (b // 8) < k_end)[None, :]
    codes = tl.load(w_rows[:, None] + (k0 // 2 + b)[None, :], mask=mask, other=0)
    return tl.reshape(codes, (codes.shape[0], BLOCK_K // 16, 8))


@triton.jit
def load_scale_tile(s_rows, mask_f, k0, k_end, BLOCK_K: tl.constexpr):
    """NVFP4 block scales float8_e4m3fn [BLOCK_F, BLOCK_K/16] of columns [k0, k0 + BLOCK_K)
    (one per 16 weights). `s_rows`: pointers [BLOCK_F] to each row's first scale (K/16 per
    row); blocks at or past `k_end` and rows off `mask_f` read 0 (no memory traffic), so a
    load one step past the end of a split is free."""
    kb = tl.arange(0, BLOCK_K // 16)
    mask_s = mask_f[:, None] & (k0 + 16 * kb < k_end)[None, :]
    return tl.load(s_rows[:, None] + (k0 // 16 + kb)[None, :], mask=mask_s, other=0.0)


@triton.jit
def load_weight_tile(w_rows, s_rows, mask_f, k0, k_end, BLOCK_K: tl.constexpr,
                     IS_NVFP4: tl.constexpr):
    """Raw weight tile for columns [k0, k0 + BLOCK_K) of the rows that `w_rows` (pointer
    [BLOCK_F] to each row's first element / code byte) and `s_rows` (pointer [BLOCK_F] to
    each row's first block scale) point at. Columns at or past `k_end` are masked (no
    memory traffic), so a prefetch past the end of a split is free.

    bf16: (w [BLOCK_F, BLOCK_K/8, 8] bf16, the same again as a placeholder).
    NVFP4: (codes [BLOCK_F, BLOCK_K/16, 8] uint8, scales [BLOCK_F, BLOCK_K/16] fp8): 8
    bytes of codes (16 weights, one block scale) per thread-vector, so the scales
    broadcast over the last axis with no reshape.
    """
    kb = tl.arange(0, BLOCK_K // 16 if IS_NVFP4 else BLOCK_K // 8)
    j = tl.arange(0, 8)
    if IS_NVFP4:
        codes = load_code_tile(w_rows, mask_f, k0, k_end, BLOCK_K)
        scales = load_scale_tile(s_rows, mask_f, k0, k_end, BLOCK_K)
        return codes, scales
    else:
        col = k0 + kb[:, None] * 8 + j[None, :]  # [KB, 8]
        mask = mask_f[:, None, None] & (col < k_end)[None, :, :]
        w = tl.load(w_rows[:, None, None] + col[None, :, :], mask=mask, other=0.0)
        return w, w


@triton.jit
def _pattern_fp32(c):
    """The bf16 bit pattern the PTX builds for code c (int32, 0..15), as fp32: the E2M1
    value times 2^-126 (fp32 subnormal for 0.5, exact in numpy)."""
    bits16 = ((c & 7) << 6) | ((c & 8) << 12)
    return (bits16 << 16).to(tl.float32, bitcast=True)


@triton.jit
def dequant_tile(codes, scales, GPU: tl.constexpr):
    """Weights of an NVFP4 tile, scaled by 2^-8 (multiply the fp32 dot products by
    `DEQUANT_UNSCALE` once, after the K loop).

    codes: uint8 [R, KB, 8] and scales: float8_e4m3fn [R, KB] from `load_weight_tile`.
    Returns (w_lo, w_hi) [R, KB, 8], weights 2j and 2j + 1 of each byte j, each equal to
    `e2m1 * scale * 2^-8` exactly: bf16 on the GPU (the inline-asm decode, tensor-core
    operands), fp32 in the interpreter (the same bit formulas per element).
    """
    sb = scales.to(tl.float32) * SCALE_BIAS  # exact: a power-of-two multiply, <= 2^127
    if GPU:
        s4 = tl.broadcast_to(sb.to(tl.bfloat16)[:, :, None], codes.shape)
        w_lo, w_hi = tl.inline_asm_elementwise(
            _DEQUANT_PTX, "=r,=r,=r,=r,r,r,r", [codes, s4],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return w_lo, w_hi
    else:
        c = codes.to(tl.int32)
        s3 = sb[:, :, None]
        return _pattern_fp32(c & 15) * s3, _pattern_fp32(c >> 4) * s3


@triton.jit
def dequant_tile_k_order(codes, scales, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
                         GPU: tl.constexpr):
    """NVFP4 weights [BLOCK_F, BLOCK_K] in K order from `load_weight_tile`'s codes and
    scales: `dequant_tile`'s halves (e2m1 * scale * 2^-8, exact) interleaved back (weight
    2j, then 2j + 1, of each code byte j), for a plain 2-D dot (`dot_2d`)."""
    w_lo, w_hi = dequant_tile(codes, scales, GPU)
    return tl.reshape(tl.join(w_lo, w_hi), (BLOCK_F, BLOCK_K))


@triton.jit
def dot_2d(acc, x, w, GPU: tl.constexpr, SWAP: tl.constexpr = False):
    """Returns acc + x @ w^T, fp32: acc [M, F] fp32, x [M, K] and w [F, K] with values
    exact in bf16 (bf16 activations; bf16 or decoded NVFP4 weights, any float dtype):
    bf16 tensor cores with fp32 accumulation on the GPU; IEEE fp32 in the interpreter,
    which mishandles bf16 math (../shared/NOTES.md). M, F, K: powers of two, >= 16 on the
    GPU (`tl.dot`).

    SWAP: acc [F, M] += w @ x^T instead (the transposed product, same fp32 sums of the
    same exact products): the weight tile is the dot's left operand, which Hopper's wgmma
    can read from registers (where a decoded NVFP4 tile already is) when F >= 64, and the
    small activation tile is the right operand (M >= 16); the caller transposes the
    accumulator once after its K loop."""
    if SWAP:
        if GPU:
            out = tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)), acc)
        else:
            out = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc,
                         input_precision="ieee")
    else:
        if GPU:
            out = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
        else:
            out = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")
    return out


@triton.jit
def dot_tile(acc, x3, w3, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, KW: tl.constexpr,
             GPU: tl.constexpr, SWAP: tl.constexpr = False):
    """acc [BLOCK_N, BLOCK_F] += x3 [BLOCK_N, KB, 8] . w3 [BLOCK_F, KB, 8] over (KB, 8)
    (KW = KB * 8) on the tensor cores (with SWAP: acc [BLOCK_F, BLOCK_N], see `dot_2d`).
    Every operand is exact in bf16 (bf16 activations; bf16 weights or `dequant_tile`'s
    e2m1 * scale * 2^-8, at most 6 significant bits), so on the GPU the dot takes bf16
    with fp32 accumulation; the interpreter mishandles bf16 math (../shared/NOTES.md), so
    there both sides stay fp32 and the dot runs in IEEE precision."""
    return dot_2d(acc, tl.reshape(x3, (BLOCK_N, KW)), tl.reshape(w3, (BLOCK_F, KW)), GPU, SWAP)


@triton.jit
def acc_init(BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, SWAP: tl.constexpr):
    """The zero fp32 accumulator of a tensor-core GEMV loop: [BLOCK_N, BLOCK_F], or
    [BLOCK_F, BLOCK_N] with SWAP (pass the same SWAP to `dot_2d` / `dot_tile`);
    `acc_final` brings it back to [BLOCK_N, BLOCK_F]."""
    if SWAP:
        acc = tl.zeros((BLOCK_F, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_F), dtype=tl.float32)
    return acc


@triton.jit
def acc_final(acc, SWAP: tl.constexpr):
    """`acc_init`'s fp32 accumulator as [BLOCK_N, BLOCK_F]: one transpose after the K loop
    with SWAP (acc [BLOCK_F, BLOCK_N]); acc itself otherwise."""
    if SWAP:
        out = tl.trans(acc)
    else:
        out = acc
    return out


@triton.jit
def first_scales(s_rows, mask_f, k0, k_end, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
                 IS_NVFP4: tl.constexpr):
    """`load_flat_tile`'s `s_cur` for its first step at k0. IS_NVFP4: the block scales of
    columns [k0, k0 + BLOCK_K), float8_e4m3fn [BLOCK_F, BLOCK_K/16] (`load_scale_tile`;
    what `load_flat_tile` with PREFETCH_SCALES=True expects). Else a placeholder, fp32
    zeros [BLOCK_F, BLOCK_K/16], no load: for bf16 weights, for `load_flat_tile` with
    PREFETCH_SCALES=False (which returns it unchanged), or for a second matrix that the
    loop does not use. The dtype is part of the K loop's carried state: pass IS_NVFP4 =
    True exactly when `load_flat_tile` will return loaded scales (NVFP4 with the
    prefetch), else the GPU compile fails ("Loop-carried variable ... fp32 ... re-assigned
    to fp8e4nv"; the interpreter does not check). BLOCK_K >= 16."""
    if IS_NVFP4:
        out = load_scale_tile(s_rows, mask_f, k0, k_end, BLOCK_K)
    else:
        out = tl.zeros((BLOCK_F, BLOCK_K // 16), dtype=tl.float32)
    return out


@triton.jit
def load_flat_tile(w_rows, s_rows, s_cur, mask_f, k0, k_end, BLOCK_F: tl.constexpr,
                   BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr, GPU: tl.constexpr,
                   PREFETCH_SCALES: tl.constexpr = True):
    """One step of a flat 2-D tensor-core loop: returns (w, s_nxt).

    w: the weight tile of columns [k0, k0 + BLOCK_K) in K order, [BLOCK_F, BLOCK_K];
    columns at or past `k_end` and rows off `mask_f` (bool [BLOCK_F]) are 0. bf16 weights:
    a plain 2-D load (bf16; `w_rows` [BLOCK_F] pointers to each row's first element,
    `s_rows` unused). NVFP4: codes from `load_code_tile` (`w_rows` to each row's first code
    byte; staged by Triton's pipeliner) decoded with this step's scales by the inline asm
    (`dequant_tile_k_order`: bf16 on the GPU, fp32 in the interpreter) as
    `e2m1 * scale * 2^-8`, exact: multiply the accumulator by `DEQUANT_UNSCALE` after the
    loop. k0, k_end: multiples of 16 for NVFP4.

    s_cur / s_nxt: the scale tile carried through the loop (start with `first_scales`,
    then pass the previous call's s_nxt). NVFP4 with PREFETCH_SCALES (default): s_cur
    holds this step's scales (float8_e4m3fn [BLOCK_F, BLOCK_K/16]) and s_nxt those of
    k0 + BLOCK_K, loaded here one step ahead (masked at `k_end`, so free past the end):
    1-byte loads that the pipeliner does not stage, which Nsight Compute found the NVFP4
    loop waiting on (31% of stall samples at batch 8, docs/gpu-runs.md session 9).
    Otherwise s_nxt is s_cur unchanged (a placeholder), and PREFETCH_SCALES=False loads
    this step's scales here instead: in the split-K GEMVs (2-5 steps per program) the
    prefetch measured 11-16% slower (session 9 run 7) while the MoE loops (4-16 steps)
    gained 5-6%. For the flat 2-D tensor-core loops of `flintc.kernels.gemv` and
    `flintc.kernels.moe`."""
    # one return after a constexpr if / else: Triton compiles the statements after an
    # early return of a constexpr branch too (the uint8 code pointer loaded as weights)
    if IS_NVFP4:
        ct = load_code_tile(w_rows, mask_f, k0, k_end, BLOCK_K)
        if PREFETCH_SCALES:
            s_nxt = load_scale_tile(s_rows, mask_f, k0 + BLOCK_K, k_end, BLOCK_K)
            w = dequant_tile_k_order(ct, s_cur, BLOCK_F, BLOCK_K, GPU)
        else:
            s_nxt = s_cur
            w = dequant_tile_k_order(ct, load_scale_tile(s_rows, mask_f, k0, k_end, BLOCK_K),
                                     BLOCK_F, BLOCK_K, GPU)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows[:, None] + offs_k[None, :],
                    mask=mask_f[:, None] & (offs_k < k_end)[None, :], other=0.0)
        s_nxt = s_cur
    return w, s_nxt
