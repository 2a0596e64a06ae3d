"""Small-batch GEMV (decode, N <= 8 rows of activations) over bf16 or NVFP4 weights.

`y[N, F] = x[N, K] @ W[F, K]^T` with the numerics of `flintc::gemv` (reference:
`flintc.ops.linear.gemv`, i.e. `torch.ops.flintc.gemv`; FLINT_SPEC section 3): products
and accumulation in fp32, NVFP4 weights decoded as `e2m1 * block_scale` with the global
scale multiplied on the fp32 accumulator, one rounding to bf16 at the store. The same
kernel, with other epilogues, serves `flintc::lm_head` (fp32 logits, never rounded),
`flintc::gemv_residual` (`bf16(residual + bf16(y))`) and, with an RMSNorm prologue,
`flintc::norm_lm_head` (see `flintc.kernels.fused_gemv`).

Layout: contiguous row-major tensors; NVFP4 in the packed layout of `flintc.quant.nvfp4`
(byte j of a row holds weight 2j in its low nibble and 2j + 1 in its high nibble; one
float8_e4m3fn scale per 16 weights) and a scalar fp32 global scale.

Numerics: every product `x * w` (bf16 x bf16, or bf16 x (e2m1 * e4m3)) is exact in fp32,
so only the summation order differs from torch's matmul: outputs agree with
`gemv_reference` within one bf16 ulp plus the fp32 reordering bound
`K * 2^-24 * sum_k |x_k w_k|`, not bit for bit. With `scale_after` (FMA path, NVFP4) each
16-weight block is summed unscaled and multiplied by its block scale once, which adds one
rounding of at most 2^-24 relative per block: inside the same bound. Split-K partial sums
are combined in a fixed order (split 0, 1, ...), so results are deterministic.

Kernel design (issue 5 speed work):
- E2M1 is decoded by `flintc.kernels.tiles.dequant_tile`: on the GPU an inline-asm bit
  trick (Marlin's FP4 decode: ~2 instructions per weight, scale applied by a bf16x2
  multiply, weights scaled by 2^-8 and the fp32 accumulator by 256 after the K loop,
  both exact); the integer-op decode of the first version (~10 instructions per weight)
  left every NVFP4 GEMV issue-bound at 5-7% of copy bandwidth on the H200.
- Weight tiles are loaded as [BLOCK_F, BLOCK_K/16 (NVFP4) or /8 (bf16), 8]: 8 bytes of
  codes (16 weights, one block scale) or 8 bf16 per thread-vector, so the block scales
  load as [BLOCK_F, BLOCK_K/16] and broadcast over the last axis with no reshape.
- Two reductions: `use_dot` (tensor cores, x padded to 16 rows) or an FMA reduction
  that keeps an fp32 accumulator [BLOCK_N, BLOCK_F, BLOCK_K/8 or /16] and sums its last
  axis once after the K loop (no cross-lane reduction inside the loop).
- Split-K is one launch: each split writes its fp32 partial tile to a workspace, bumps
  a per-F-block counter (acq_rel atomic), and the last-arriving split sums the partials
  in split order, runs the epilogue and resets the counter to zero. The counters live
  in one zeroed int32 buffer per device that every launch leaves zeroed again.
- The first weight tile is loaded before `gdc_wait` (PDL), so the weight stream starts
  while the previous kernel still runs.
- Configurations come from `TUNED` (filled from `benchmarks/bench_gemv.py --sweep`) or
  the rule in `choose_config`; never autotuned at call time (CUDA-graph capture).
- NVFP4 on a CUDA device of compute capability 9.0+ (`gemv` and `gemv_residual` called
  without an explicit `config`): the CUDA C++ `mma.sync` kernel of
  `flintc.kernels.nvfp4_mma` instead (codes repacked once into the mma fragment order;
  about half the time of the Triton kernel at the model's shapes, docs/gpu-runs.md
  session 12). FLINTC_NVFP4_MMA=0 keeps them on Triton.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from flintc.kernels.pdl import pdl_mode
from flintc.kernels.platform import interpreting, sm_count
from flintc.kernels.tiles import (
    DEQUANT_UNSCALE,
    acc_final,
    acc_init,
    dequant_tile,
    dot_2d,
    e2m1_fp32,
    first_scales,
    load_flat_tile,
)
from flintc.kernels.tiles import dot_tile as _dot_tile
from flintc.kernels.tiles import load_weight_tile as _load_w
from flintc.kernels.tuning import overrides
from flintc.model import ops
from flintc.ops.common import CDT, as_weight

MAX_N = 8  # decode batch limit of the op contract
NVFP4_BLOCK = 16  # weights per E4M3 block scale
COUNTER_SLOTS = 1 << 16  # split-K counters per device (one per F block of a launch)

EPI_BF16 = 0  # y = bf16(acc * gscale)
EPI_FP32 = 1  # y = acc (logits, never rounded; bf16 weights only)
EPI_RESIDUAL = 2  # y = bf16(residual + bf16(acc * gscale))
# With an RMSNorm prologue, programs that make at least this many K steps norm x once
# into a workspace (`GemvConfig.norm_once`): the LM head (16 steps of 128).
NORM_ONCE_MIN_STEPS = 4


# ----------------------------------------------------------------------------- jit helpers
@triton.jit
def _bf16_grid(v):
    """fp32 -> the nearest bf16 value (round to nearest even), kept in fp32, from the bits.

    HACK: the Triton interpreter converts fp32 -> bf16 by truncation, so `.to(tl.bfloat16)`
    differs from torch there; rounding on the bits first makes every later cast exact.
    """
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))  # NaN stays NaN


@triton.jit
def _round_to_bf16(v):
    """fp32 -> bf16, round to nearest even on every backend (see `_bf16_grid`)."""
    return _bf16_grid(v).to(tl.bfloat16)


@triton.jit
def _load_x(x_ptr, stride_xn, nw_ptr, rstd, offs_n, mask_n, k0, k_end,
            BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr, HAS_NORM: tl.constexpr):
    """Activation tiles matching `_load_w`'s columns, fp32. bf16: (x [BLOCK_N, KB, 8] at
    columns k0 + 8 kb + j, the same again). NVFP4: (x_even, x_odd), each [BLOCK_N, KB, 8]
    at columns k0 + 16 kb + 2 j (+ 1): even columns meet the low nibbles, odd ones the
    high nibbles; loaded as one contiguous [BLOCK_N, KB, 8, 2] tile and split in
    registers. With HAS_NORM the RMSNorm prologue is applied here: `bf16(x * rstd *
    w_norm)`, the reference's evaluation order and rounding."""
    kb = tl.arange(0, BLOCK_K // 16 if IS_NVFP4 else BLOCK_K // 8)
    j = tl.arange(0, 8)
    if IS_NVFP4:
        p = tl.arange(0, 2)
        col = k0 + kb[:, None, None] * 16 + 2 * j[None, :, None] + p[None, None, :]
        mask_k = col < k_end
        mask = mask_n[:, None, None, None] & mask_k[None, :, :, :]
        x = tl.load(x_ptr + offs_n[:, None, None, None] * stride_xn + col[None, :, :, :],
                    mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            nw = tl.load(nw_ptr + col, mask=mask_k, other=0.0).to(tl.float32)
            x = _bf16_grid(x * rstd[:, None, None, None] * nw[None, :, :, :])
        x_e, x_o = tl.split(x)
        return x_e, x_o
    else:
        col = k0 + kb[:, None] * 8 + j[None, :]
        mask_k = col < k_end
        mask = mask_n[:, None, None] & mask_k[None, :, :]
        x = tl.load(x_ptr + offs_n[:, None, None] * stride_xn + col[None, :, :], mask=mask,
                    other=0.0).to(tl.float32)
        if HAS_NORM:
            nw = tl.load(nw_ptr + col, mask=mask_k, other=0.0).to(tl.float32)
            x = _bf16_grid(x * rstd[:, None, None] * nw[None, :, :])
        return x, x


@triton.jit
def _rms_rstd_rows(x_ptr, stride_xn, N, H, eps, NR: tl.constexpr, NORM_H: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of rows [0, N) as fp32 [NR] (rows past N give 0).
    NR = next_pow2(N) rows and NORM_H = next_pow2(H) columns are loaded in unrolled chunks
    of at most 4096 elements, so every load is issued at once (one L2 round trip on the
    critical path after `gdc_wait`, where a loop of 256-wide steps took eight). IEEE sqrt
    and division, as torch's CPU rsqrt; the sum's order differs from torch."""
    offs_r = tl.arange(0, NR)
    mask_r = offs_r < N
    CH: tl.constexpr = NORM_H if NORM_H * NR <= 4096 else 4096 // NR
    ss = tl.zeros((NR,), dtype=tl.float32)
    for h0 in tl.static_range(0, NORM_H, CH):
        offs_h = h0 + tl.arange(0, CH)
        m = mask_r[:, None] & (offs_h < H)[None, :]
        x = tl.load(x_ptr + offs_r[:, None] * stride_xn + offs_h[None, :], mask=m,
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, H * 1.0) + eps))
    return tl.where(mask_r, r, 0.0)


@triton.jit
def _rms_rstd(x_ptr, stride_xn, offs_n, N, H, eps, NR: tl.constexpr, NORM_H: tl.constexpr):
    """`_rms_rstd_rows` widened to `offs_n`'s [BLOCK_N] (rows past N give 0; they are
    padding)."""
    offs_r = tl.arange(0, NR)
    r = _rms_rstd_rows(x_ptr, stride_xn, N, H, eps, NR, NORM_H)
    return tl.sum(tl.where(offs_n[:, None] == offs_r[None, :], r[None, :], 0.0), axis=1)


@triton.jit
def _norm_rows_to(x_ptr, stride_xn, nw_ptr, xn_ptr, N, H, eps, NR: tl.constexpr,
                  NORM_H: tl.constexpr):
    """Write the RMSNorm of rows [0, N) of x, `bf16(x * rstd * w_norm)` (the evaluation
    order and rounding of `_load_x`'s in-loop prologue, hence bit-identical to it), to
    xn_ptr bf16 [N, H] (row stride H). Every program of a launch writes the same bytes:
    a benign race. The caller must `tl.debug_barrier()` before reading xn back."""
    r = _rms_rstd_rows(x_ptr, stride_xn, N, H, eps, NR, NORM_H)
    offs_r = tl.arange(0, NR)
    mask_r = offs_r < N
    CH: tl.constexpr = NORM_H if NORM_H * NR <= 4096 else 4096 // NR
    for h0 in tl.static_range(0, NORM_H, CH):
        offs_h = h0 + tl.arange(0, CH)
        mask_h = offs_h < H
        m = mask_r[:, None] & mask_h[None, :]
        x = tl.load(x_ptr + offs_r[:, None] * stride_xn + offs_h[None, :], mask=m,
                    other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        y = _bf16_grid(x * r[:, None] * nw[None, :])
        tl.store(xn_ptr + offs_r[:, None] * H + offs_h[None, :], y.to(tl.bfloat16), mask=m)


@triton.jit
def _gemv_loop(w_cur, s_cur, w_rows, s_rows, mask_f, x_ptr, stride_xn, nw_ptr, rstd,
               offs_n, mask_n, k_start, k_end, n_iters,
               BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
               IS_NVFP4: tl.constexpr, HAS_NORM: tl.constexpr, USE_DOT: tl.constexpr,
               SCALE_AFTER: tl.constexpr, GPU: tl.constexpr, PREFETCH: tl.constexpr,
               ACC_FULL: tl.constexpr, SWAP: tl.constexpr = False):
    """fp32 acc [BLOCK_N, BLOCK_F] = x[:, k_start:k_end] @ W[rows, k_start:k_end]^T
    (without the NVFP4 global scale). With PREFETCH, `w_cur, s_cur` is the first tile
    (loaded by the caller, possibly before `gdc_wait`) and each step loads the next
    weight tile into registers before using the current one (software pipeline of depth
    one); without it each step loads its own weight tile and Triton's pipeliner
    (num_stages) may stage the loads through shared memory instead. The x tiles are
    always loaded one step ahead (x comes from L2, but a round trip per step is still
    latency on the critical path). With ACC_FULL (FMA path) the accumulator is the whole
    product tile [BLOCK_N, BLOCK_F, KB, 8], updated by one FMA per weight, and summed over
    its last two axes once after the loop: no reduction (and no cross-lane shuffle) per
    K step, at BLOCK_N * BLOCK_F * BLOCK_K / 8 (bf16) or / 16 (NVFP4) fp32 registers per
    program. SWAP (USE_DOT): the weight tile is the dot's left operand
    (`flintc.kernels.tiles.dot_2d`), the accumulator transposed back after the loop."""
    KB: tl.constexpr = BLOCK_K // 16 if IS_NVFP4 else BLOCK_K // 8
    if USE_DOT:
        acc = acc_init(BLOCK_N, BLOCK_F, SWAP)
    elif ACC_FULL:
        acc4 = tl.zeros((BLOCK_N, BLOCK_F, KB, 8), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_N, BLOCK_F, KB), dtype=tl.float32)
    # The x tiles (from L2, normed when HAS_NORM) are always loaded one step ahead: a
    # load in the step that uses it is an L2 round trip on the critical path per step.
    xa_cur, xb_cur = _load_x(x_ptr, stride_xn, nw_ptr, rstd, offs_n, mask_n, k_start,
                             k_end, BLOCK_K, IS_NVFP4, HAS_NORM)
    for it in range(n_iters):
        k0 = k_start + it * BLOCK_K
        if PREFETCH:
            w_nxt, s_nxt = _load_w(w_rows, s_rows, mask_f, k0 + BLOCK_K, k_end, BLOCK_K,
                                   IS_NVFP4)
        else:
            w_cur, s_cur = _load_w(w_rows, s_rows, mask_f, k0, k_end, BLOCK_K, IS_NVFP4)
        xa_nxt, xb_nxt = _load_x(x_ptr, stride_xn, nw_ptr, rstd, offs_n, mask_n,
                                 k0 + BLOCK_K, k_end, BLOCK_K, IS_NVFP4, HAS_NORM)
        x_a = xa_cur
        x_b = xb_cur
        if IS_NVFP4:
            x_e = x_a
            x_o = x_b
            if USE_DOT:
                # e2m1 * scale * 2^-8, exact (bf16 on the GPU); `* DEQUANT_UNSCALE` below
                w_lo, w_hi = dequant_tile(w_cur, s_cur, GPU)
                acc = _dot_tile(acc, x_e, w_lo, BLOCK_N, BLOCK_F, BLOCK_K // 2, GPU, SWAP)
                acc = _dot_tile(acc, x_o, w_hi, BLOCK_N, BLOCK_F, BLOCK_K // 2, GPU, SWAP)
            elif ACC_FULL:
                w_lo, w_hi = dequant_tile(w_cur, s_cur, GPU)
                acc4 += x_e[:, None, :, :] * w_lo.to(tl.float32)[None, :, :, :]
                acc4 += x_o[:, None, :, :] * w_hi.to(tl.float32)[None, :, :, :]
            elif SCALE_AFTER:
                c = w_cur.to(tl.int32)
                s = s_cur.to(tl.float32)  # [BLOCK_F, KB]
                part = tl.sum(x_e[:, None, :, :] * e2m1_fp32(c & 15)[None, :, :, :], axis=3)
                part += tl.sum(x_o[:, None, :, :] * e2m1_fp32(c >> 4)[None, :, :, :], axis=3)
                acc3 += part * s[None, :, :]
            else:
                w_lo, w_hi = dequant_tile(w_cur, s_cur, GPU)
                acc3 += tl.sum(x_e[:, None, :, :] * w_lo.to(tl.float32)[None, :, :, :], axis=3)
                acc3 += tl.sum(x_o[:, None, :, :] * w_hi.to(tl.float32)[None, :, :, :], axis=3)
        else:
            x3 = x_a
            if USE_DOT:
                acc = _dot_tile(acc, x3, w_cur, BLOCK_N, BLOCK_F, BLOCK_K, GPU, SWAP)
            elif ACC_FULL:
                acc4 += x3[:, None, :, :] * w_cur.to(tl.float32)[None, :, :, :]
            else:
                w3 = w_cur.to(tl.float32)
                acc3 += tl.sum(x3[:, None, :, :] * w3[None, :, :, :], axis=3)
        if PREFETCH:
            w_cur = w_nxt
            s_cur = s_nxt
        xa_cur = xa_nxt
        xb_cur = xb_nxt
    if USE_DOT:
        acc = acc_final(acc, SWAP)
    elif ACC_FULL:
        acc = tl.sum(tl.sum(acc4, axis=3), axis=2)
    else:
        acc = tl.sum(acc3, axis=2)
    if IS_NVFP4 and not (SCALE_AFTER and not USE_DOT and not ACC_FULL):
        acc = acc * DEQUANT_UNSCALE  # exact: undoes dequant_tile's 2^-8
    return acc


@triton.jit
def _gemv_loop_flat(w_rows, s_rows, mask_f, x_ptr, stride_xn, nw_ptr, rstd, offs_n, mask_n,
                    k_start, k_end, n_iters, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
                    BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr, HAS_NORM: tl.constexpr,
                    GPU: tl.constexpr, SWAP: tl.constexpr = False):
    """`_gemv_loop` on the tensor cores with 2-D tiles (GemvConfig.flat): w [BLOCK_F,
    BLOCK_K] (bf16, or NVFP4 decoded and interleaved back into K order,
    `flintc.kernels.tiles.load_flat_tile`) and x [BLOCK_N, BLOCK_K] loaded in the loop, so
    Triton's pipeliner (num_stages) can stage them through shared memory in the layout
    `tl.dot` reads, with no [F, KB, 8] -> [F, K] reshape in registers (the layout
    conversions that Nsight Compute found around the 3-D tiles' dot, docs/gpu-runs.md
    session 6). Same products, fp32 accumulation (NVFP4: without the global scale), and
    the same RMSNorm prologue expression as `_load_x` (bit-identical normed x). SWAP: the
    weight tile is the dot's left operand (`flintc.kernels.tiles.dot_2d`)."""
    acc = acc_init(BLOCK_N, BLOCK_F, SWAP)
    s_cur = first_scales(s_rows, mask_f, k_start, k_end, BLOCK_F, BLOCK_K, False)  # placeholder
    for it in range(n_iters):
        offs_k = k_start + it * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        # scales loaded in the step: 2-5 steps per split-K program, where the one-step
        # scale prefetch measured slower (tiles.load_flat_tile)
        w, s_cur = load_flat_tile(w_rows, s_rows, s_cur, mask_f, k_start + it * BLOCK_K, k_end,
                                  BLOCK_F, BLOCK_K, IS_NVFP4, GPU, False)
        x = tl.load(x_ptr + offs_n[:, None] * stride_xn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        if HAS_NORM:
            nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x = _bf16_grid(x * rstd[:, None] * nw[None, :])
        acc = dot_2d(acc, x, w, GPU, SWAP)
    acc = acc_final(acc, SWAP)
    if IS_NVFP4:
        acc = acc * DEQUANT_UNSCALE  # exact: undoes the decode's 2^-8
    return acc


@triton.jit
def _splitk_combine(acc, ws_ptr, cnt_ptr, counter, pid_k, offs_n, offs_f, mask_n, mask_f,
                    N, F, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_F: tl.constexpr):
    """One-launch split-K: store this split's partial [BLOCK_N, BLOCK_F] into the fp32
    workspace [SPLIT_K, N, F], count arrivals on `cnt_ptr[counter]`, and return
    (total, arrived): the split that sees arrived == SPLIT_K - 1 arrived last and gets
    the sum of all partials in split order (deterministic); the others get zeros and
    must mask their epilogue stores with `_is_last(arrived, SPLIT_K, shape)`. The last
    split resets the counter to zero for the next launch."""
    offs = offs_n[:, None] * F + offs_f[None, :]
    mask = mask_n[:, None] & mask_f[None, :]
    tl.store(ws_ptr + pid_k * N * F + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the release below
    arrived = tl.atomic_add(cnt_ptr + counter, 1, sem="acq_rel", scope="gpu")
    last = (tl.zeros((BLOCK_N, BLOCK_F), dtype=tl.int32) + arrived) == SPLIT_K - 1
    total = tl.zeros((BLOCK_N, BLOCK_F), dtype=tl.float32)
    for s in range(SPLIT_K):
        # .cg: read through L2 (L1 is not coherent with the other SMs' stores)
        total += tl.load(ws_ptr + s * N * F + offs, mask=mask & last, other=0.0,
                         cache_modifier=".cg")
    first = tl.arange(0, 2) == 0
    reset = first & ((tl.zeros((2,), dtype=tl.int32) + arrived) == SPLIT_K - 1)
    tl.atomic_xchg(cnt_ptr + counter + tl.arange(0, 2) * 0, tl.zeros((2,), dtype=tl.int32),
                   mask=reset)
    return total, arrived


@triton.jit
def _is_last(arrived, SPLIT_K: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """[A, B] bool: this program is the last-arriving split (tensor-shaped, since the
    interpreter rejects scalar store masks)."""
    return (tl.zeros((A, B), dtype=tl.int32) + arrived) == SPLIT_K - 1


@triton.jit
def gemv_kernel(
    x_ptr,  # bf16 [N, K], rows `stride_xn` apart, columns contiguous
    nw_ptr,  # RMSNorm weight fp32/bf16 [K] (HAS_NORM only)
    w_ptr,  # bf16 [F, K], or NVFP4 codes uint8 [F, K/2]; contiguous
    scales_ptr,  # NVFP4 block scales float8_e4m3fn [F, K/16] (unused for bf16)
    gscale_ptr,  # NVFP4 global scale fp32 [] (unused for bf16)
    res_ptr,  # residual bf16 [N, F] (EPI_RESIDUAL only)
    out_ptr,  # bf16 [N, F] (EPI_BF16, EPI_RESIDUAL) or fp32 [N, F] (EPI_FP32)
    ws_ptr,  # fp32 workspace [SPLIT_K, N, F] (SPLIT_K > 1 only)
    cnt_ptr,  # int32 counters, zero on entry and on exit (SPLIT_K > 1 only)
    xn_ptr,  # bf16 workspace [N, K]: the normed x (NORM_ONCE only)
    N, F, K, stride_xn, eps,
    K_PER_SPLIT,  # columns per split-K program; a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,  # rows of x held: 16 for tl.dot, else next_pow2(N)
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    HAS_NORM: tl.constexpr,  # RMSNorm prologue over x (K == H)
    EPILOGUE: tl.constexpr,  # EPI_BF16 / EPI_FP32 / EPI_RESIDUAL
    USE_DOT: tl.constexpr,  # tensor-core reduction; False: FMA reduction
    SCALE_AFTER: tl.constexpr,  # FMA + NVFP4: multiply block scales on 16-wide partial sums
    USE_PDL: tl.constexpr,  # must be False under TRITON_INTERPRET (gdc_* raise there)
    GPU: tl.constexpr,  # compiled for a GPU (bf16 math allowed); False in the interpreter
    PREFETCH: tl.constexpr,  # manual register prefetch (else leave it to num_stages)
    NR: tl.constexpr = 1,  # next_pow2(N): rows of the RMSNorm prologue (HAS_NORM)
    NORM_H: tl.constexpr = 1,  # next_pow2(K): columns of the RMSNorm prologue (HAS_NORM)
    NORM_ONCE: tl.constexpr = False,  # HAS_NORM: norm x once into xn_ptr, not per tile
    ACC_FULL: tl.constexpr = False,  # FMA path: accumulate the whole product tile
    FLAT: tl.constexpr = False,  # tensor-core path with 2-D tiles (`_gemv_loop_flat`)
    SWAP: tl.constexpr = False,  # tensor cores: weight tile as the dot's left operand
):
    # Tile-to-program mapping: program (pid_f, pid_k) computes the dot products of all N
    # activation rows with weight rows [pid_f * BLOCK_F, (pid_f + 1) * BLOCK_F) over
    # columns [pid_k * K_PER_SPLIT, (pid_k + 1) * K_PER_SPLIT), BLOCK_K at a time.
    pid_f = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = offs_f < F  # the last F block may stick out past F
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N  # rows past N are padding
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    n_iters = tl.cdiv(k_end - k_start, BLOCK_K)
    if IS_NVFP4:
        w_rows = w_ptr + offs_f.to(tl.int64) * (K // 2)
        s_rows = scales_ptr + offs_f.to(tl.int64) * (K // 16)
    else:
        w_rows = w_ptr + offs_f.to(tl.int64) * K
        s_rows = w_rows
    # The first weight tile goes out before gdc_wait: under PDL the weight stream starts
    # while the previous kernel (which writes x / residual) still runs.
    if PREFETCH and not FLAT:
        w0, s0 = _load_w(w_rows, s_rows, mask_f, k_start, k_end, BLOCK_K, IS_NVFP4)
    else:
        w0, s0 = _load_w(w_rows, s_rows, mask_f, k_start, k_start, BLOCK_K, IS_NVFP4)  # no-op
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if NORM_ONCE:
        # The normed x is computed once per program into a workspace and the loop reads
        # it as a plain x: the in-loop prologue would redo the norm for every K step of
        # every program on BLOCK_N (16 with tl.dot) rows (the LM head: 16 steps, 1184
        # programs; 2x its plain GEMV's time on the H200, session 6).
        _norm_rows_to(x_ptr, stride_xn, nw_ptr, xn_ptr, N, K, eps, NR, NORM_H)
        tl.debug_barrier()  # this program's stores are visible to all its threads
        rstd = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if FLAT:
            acc = _gemv_loop_flat(w_rows, s_rows, mask_f, xn_ptr, K, nw_ptr, rstd, offs_n,
                                  mask_n, k_start, k_end, n_iters, BLOCK_N, BLOCK_F, BLOCK_K,
                                  IS_NVFP4, False, GPU, SWAP)
        else:
            acc = _gemv_loop(w0, s0, w_rows, s_rows, mask_f, xn_ptr, K, nw_ptr, rstd, offs_n,
                             mask_n, k_start, k_end, n_iters, BLOCK_N, BLOCK_F, BLOCK_K,
                             IS_NVFP4, False, USE_DOT, SCALE_AFTER, GPU, PREFETCH, ACC_FULL,
                             SWAP)
    else:
        if HAS_NORM:
            rstd = _rms_rstd(x_ptr, stride_xn, offs_n, N, K, eps, NR, NORM_H)
        else:
            rstd = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if FLAT:
            acc = _gemv_loop_flat(w_rows, s_rows, mask_f, x_ptr, stride_xn, nw_ptr, rstd,
                                  offs_n, mask_n, k_start, k_end, n_iters, BLOCK_N, BLOCK_F,
                                  BLOCK_K, IS_NVFP4, HAS_NORM, GPU, SWAP)
        else:
            acc = _gemv_loop(w0, s0, w_rows, s_rows, mask_f, x_ptr, stride_xn, nw_ptr, rstd,
                             offs_n, mask_n, k_start, k_end, n_iters, BLOCK_N, BLOCK_F,
                             BLOCK_K, IS_NVFP4, HAS_NORM, USE_DOT, SCALE_AFTER, GPU, PREFETCH,
                             ACC_FULL, SWAP)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()  # a scheduling hint: no memory ordering

    mask = mask_n[:, None] & mask_f[None, :]
    if SPLIT_K > 1:
        acc, arrived = _splitk_combine(acc, ws_ptr, cnt_ptr, pid_f, pid_k, offs_n, offs_f,
                                       mask_n, mask_f, N, F, SPLIT_K, BLOCK_N, BLOCK_F)
        mask = mask & _is_last(arrived, SPLIT_K, BLOCK_N, BLOCK_F)
    out_offs = offs_n[:, None] * F + offs_f[None, :]
    if IS_NVFP4:
        acc = acc * tl.load(gscale_ptr)  # global scale on the fp32 accumulator
    if EPILOGUE == 1:  # EPI_FP32
        tl.store(out_ptr + out_offs, acc, mask=mask)
    elif EPILOGUE == 2:  # EPI_RESIDUAL
        res = tl.load(res_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_offs, _round_to_bf16(res + _bf16_grid(acc)), mask=mask)
    else:
        tl.store(out_ptr + out_offs, _round_to_bf16(acc), mask=mask)  # the one rounding


# ----------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One launch configuration. `block_f` rows per program (the fused QKV kernel ignores
    it: one head per program), `block_k` columns per step (multiple of 32, or of 16 for
    bf16 with use_dot=False), `split_k` programs along K (capped so none is empty),
    `use_dot` tensor cores vs FMA reduction, `scale_after` (FMA + NVFP4 only),
    `num_warps`, `num_stages` (Triton's pipeliner), `prefetch` (manual register
    prefetch of the next weight tile, whose first tile is issued before the PDL wait;
    ignored with `flat`), `flat` (use_dot: 2-D tiles staged by the pipeliner, NVFP4
    decoded into K order, `_gemv_loop_flat`; the plain and both fused GEMV kernels),
    `swap` (use_dot: the weight tile as the dot's left operand, `tiles.dot_2d`; Hopper's
    wgmma may then read a decoded NVFP4 tile from registers, with block_f >= 64),
    `norm_once` (with an RMSNorm prologue: norm x once per program into a bf16 workspace
    instead of once per K step; None = `NORM_ONCE_MIN_STEPS` decides), `acc_full` (FMA
    path: accumulate the whole product tile, reduce once after the K loop; `scale_after`
    is then ignored)."""

    use_dot: bool = True
    block_f: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    scale_after: bool = False
    prefetch: bool = True
    norm_once: bool | None = None
    acc_full: bool = False
    flat: bool = False
    swap: bool = False

    def short(self) -> str:
        kind = "dot" if self.use_dot else ("fma-acc" if self.acc_full else
                                           "fma-sa" if self.scale_after else "fma")
        once = {None: "", True: " norm1", False: " normk"}[self.norm_once]
        return (f"{kind} f{self.block_f} k{self.block_k} s{self.split_k} "
                f"w{self.num_warps} st{self.num_stages}{'' if self.prefetch else ' nopf'}{once}"
                f"{' flat' if self.flat else ''}{' swap' if self.swap else ''}")


# Measured winners -> GemvConfig. Keys: (fmt, F, K, N) for the plain GEMV kernel (gemv,
# gemv_residual, lm_head); ("norm:" + fmt, F, K, N) for it with the RMSNorm prologue
# (norm_lm_head: its programs norm x first, so its best tiles differ, session 36);
# ("qkv:" + fmt, Hq * D, H, N) for the fused QKV
# kernel; ("gate_up:" + fmt, F, H, N) for norm_gate_up_silu (block_f = output columns).
# Paste the lines that `python benchmarks/bench_gemv.py --sweep` prints at the end here;
# shapes not listed use the rules in `choose_config` / `qkv_config`. Entries: the sweep
# on an H200, 2026-11-30 session 6 run 2 (`bash scripts/gpu_tune.sh` with
# TUNE_FAMILY=classic TUNE_BATCHES=1,8, weights rotated so they are read from DRAM,
# docs/gpu-runs.md); us = that sweep's time against the previous default's.
TUNED: dict[tuple[str, int, int, int], GemvConfig] = {
    # fused QKV: split 6, one wave of 240 programs (the split rule counted the 32 query
    # heads only; split 8 gave 320 programs of 8 warps for 264 resident: 1.21 waves,
    # Nsight Compute; session 11 runs 7-8, `bench_gemv.py --sweep --family swap/classic`).
    # bf16 flat 2-D tiles with the swapped dot, N = 1 11.1 us (split 8: 14.1; session 9:
    # 14.0 against 16.0 flat alone and 21.3 for session 6's FMA pick), N = 8 13.0 (16.8)
    ("qkv:bf16", 4096, 2048, 1): GemvConfig(use_dot=True, block_f=128, block_k=128, split_k=6,
                                           num_warps=8, num_stages=3, prefetch=False, flat=True,
                                           swap=True),
    ("qkv:bf16", 4096, 2048, 8): GemvConfig(use_dot=True, block_f=128, block_k=128, split_k=6,
                                           num_warps=8, num_stages=3, prefetch=False, flat=True,
                                           swap=True),
    # NVFP4 N = 1: FMA whole-tile accumulator, 10.4 us (split 8: 13.4; session 6: 15.6
    # against 17.5 for the 3-D dot)
    ("qkv:nvfp4", 4096, 2048, 1): GemvConfig(use_dot=False, block_f=128, block_k=128, split_k=6,
                                            num_warps=8, num_stages=1, prefetch=True,
                                            acc_full=True),
    # N = 8: flat 2-D tiles with the swapped dot, 12.8 us (split 8: 17.4; session 9: 20.7
    # against 22.6 for the 3-D tiles)
    ("qkv:nvfp4", 4096, 2048, 8): GemvConfig(use_dot=True, block_f=128, block_k=128, split_k=6,
                                            num_warps=8, num_stages=3, prefetch=False, flat=True,
                                            swap=True),
    # O projection + residual: bf16 flat 2-D tiles 7.8 us against 10.0 for the FMA
    # whole-tile accumulator (session 8 run 5); NVFP4 7.9 against 12.4 at N = 1 (session 6)
    ("bf16", 2048, 4096, 1): GemvConfig(use_dot=True, block_f=64, block_k=256, split_k=8,
                                       num_warps=4, num_stages=3, prefetch=False, flat=True),
    # N = 8 bf16: flat 2-D tiles, 7.9 us against 14.9 (session 8 run 4, --family flat)
    ("bf16", 2048, 4096, 8): GemvConfig(use_dot=True, block_f=64, block_k=256, split_k=8,
                                       num_warps=4, num_stages=3, prefetch=False, flat=True),
    ("nvfp4", 2048, 4096, 1): GemvConfig(use_dot=False, block_f=32, block_k=256, split_k=8,
                                        num_warps=4, num_stages=1, prefetch=True, acc_full=True),
    # dense down + residual, NVFP4 N = 8: flat 2-D tiles, 17.4 us against 22.5 (session 9 run 4)
    ("nvfp4", 2048, 10240, 8): GemvConfig(use_dot=True, block_f=64, block_k=128, split_k=16,
                                         num_warps=4, num_stages=3, prefetch=False, flat=True),
    # norm_gate_up_silu (dense MLP, block_f = output columns; session 9 run 4, --family
    # swap): bf16 flat 2-D tiles, N = 1 with the swapped dot 23.4 us (87% of copy) against
    # 82.1 for the rule's 3-D tiles, N = 8 26.0 against 68.7; NVFP4 N = 1 the FMA whole-tile
    # accumulator 30.6 against 50.2, N = 8 flat 40.9 against 55.3
    ("gate_up:bf16", 10240, 2048, 1): GemvConfig(use_dot=True, block_f=32, block_k=128,
                                                split_k=1, num_warps=4, num_stages=3,
                                                prefetch=False, flat=True, swap=True),
    ("gate_up:bf16", 10240, 2048, 8): GemvConfig(use_dot=True, block_f=32, block_k=128,
                                                split_k=1, num_warps=4, num_stages=3,
                                                prefetch=False, flat=True),
    # bf16 N = 2 / 4: flat 2-D tiles with 3 K splits, 32.2 / 33.7 us against 38.2 / 39.5
    # for the N = 8 entry (session 16 run 13, bench_gemv.py --sweep --cases gate_up)
    **{("gate_up:bf16", 10240, 2048, n): GemvConfig(use_dot=True, block_f=64, block_k=128,
                                                   split_k=3, num_warps=4, num_stages=4,
                                                   prefetch=False, flat=True) for n in (2, 4)},
    ("gate_up:nvfp4", 10240, 2048, 1): GemvConfig(use_dot=False, block_f=16, block_k=256,
                                                 split_k=1, num_warps=4, num_stages=1,
                                                 prefetch=True, acc_full=True),
    ("gate_up:nvfp4", 10240, 2048, 8): GemvConfig(use_dot=True, block_f=32, block_k=128,
                                                 split_k=1, num_warps=4, num_stages=3,
                                                 prefetch=False, flat=True),
    # NVFP4 N = 8: flat 2-D tiles, 10.0 us against 10.9 for the 3-D tiles (session 9 run 2)
    ("nvfp4", 2048, 4096, 8): GemvConfig(use_dot=True, block_f=64, block_k=128, split_k=16,
                                        num_warps=4, num_stages=3, prefetch=False, flat=True),
}


def tuned_config(key: tuple[str, int, int, int]) -> GemvConfig | None:
    """The measured configuration for `key` (see `TUNED`): the file named by the environment
    variable FLINTC_GEMV_TUNED first (`flintc.kernels.tuning.overrides`; written by
    `benchmarks/bench_gemv.py --sweep --tuned-json`), then `TUNED`; None when neither has
    it. Raises ValueError for a malformed override file."""
    hit = overrides("FLINTC_GEMV_TUNED", GemvConfig, (str, int, int, int)).get(key)
    return hit if hit is not None else TUNED.get(key)


def auto_split_k(num_f_blocks: int, K: int, block_k: int, device: torch.device,
                 programs_per_sm: int = 2, max_split: int = 16) -> int:
    """Split-K count so that about `programs_per_sm` programs per SM are in flight, at
    most `max_split`, and each split has at least one BLOCK_K step."""
    target = programs_per_sm * sm_count(device)
    return max(1, min(target // max(num_f_blocks, 1), triton.cdiv(K, block_k), max_split))


def choose_config(N: int, F: int, K: int, fmt: str, device: torch.device,
                  flat_ok: bool = True, norm: bool = False) -> GemvConfig:
    """The launch configuration for a [N, K] x [F, K]^T GEMV: `tuned_config((fmt, F, K, N))`
    (`("norm:" + fmt, F, K, N)` with `norm`; FLINTC_GEMV_TUNED's file, then `TUNED`) if
    the sweep measured this shape, on any
    device; else the rule below. fmt is "bf16" or "nvfp4"; `flat_ok=False` (kernels
    without the flat loop) keeps the rule to 3-D tiles; `norm`: the kernel runs the
    RMSNorm prologue (`norm_lm_head`).

    Rule (shapes the sweep has not measured; DRAM-resident sweeps of sessions 6-8), first
    match wins:
    - not CUDA (the interpreter): small tensor-core tiles (16 x 64, no split) to keep the
      CPU time down;
    - bf16 (flat_ok) with >= 2 programs per SM in F alone (the LM head): 128 x 128
      tensor-core 2-D tiles staged by the pipeliner (`flat`, 3 stages: 200.6 us against
      403.5 for the 3-D tiles at N = 8, session 7 run 2); with the RMSNorm prologue
      (`norm`), 256 x 128 on 8 warps: each program norms x before its first weight load,
      and half as many programs do (H100, session 36, `scripts/gpu_lm_head_configs.py`:
      209.2 / 229.0 us at N = 1 / 8 against 222.5 / 241.5, the same logits bit for bit);
    - bf16 (flat_ok) with K % 256 == 0: flat 64 x 256 tiles, 3 stages, ~2 programs per SM,
      at every N: the O projection's and the dense down projection's winner at N = 1, 2
      and 8 (O projection 7.6-7.9 us against 10.0-14.9; dense down + residual 13.6-14.3
      us, 71-75% of copy, against 19.0-22.3; session 8 runs 4-5);
    - N <= 2 with K % 256 == 0: the FMA path with the whole-tile accumulator (`acc_full`;
      32 x 256 tiles NVFP4: the O projection's winner, 36% faster than the tensor-core
      tiles, session 6; bf16 reaches it only with flat_ok=False: 16 x 256 on 2 warps);
    - else tensor-core 64 x 128 3-D tiles with the register prefetch.
    The non-flat rules split K up to ~4 programs per SM (the winners' split)."""
    hit = tuned_config(("norm:" + fmt if norm else fmt, F, K, N))
    if hit is not None:
        return hit
    if device.type != "cuda":  # interpreter: small tiles keep the CPU time down
        return GemvConfig(use_dot=True, block_f=16, block_k=64, split_k=1)
    if flat_ok and fmt == "bf16" and triton.cdiv(F, 128) >= 2 * sm_count(device):  # LM head
        block_f, warps = (256, 8) if norm else (128, 4)
        split = auto_split_k(triton.cdiv(F, block_f), K, 128, device)
        return GemvConfig(use_dot=True, block_f=block_f, block_k=128, split_k=split,
                          num_warps=warps, num_stages=3, prefetch=False, flat=True)
    if flat_ok and fmt == "bf16" and K % 256 == 0:  # flat 2-D tiles, every N (see above)
        split = auto_split_k(triton.cdiv(F, 64), K, 256, device, programs_per_sm=2)
        return GemvConfig(use_dot=True, block_f=64, block_k=256, split_k=split, num_warps=4,
                          num_stages=3, prefetch=False, flat=True)
    if N <= 2 and K % 256 == 0:
        block_f, warps = (32, 4) if fmt == "nvfp4" else (16, 2)
        split = auto_split_k(triton.cdiv(F, block_f), K, 256, device, programs_per_sm=4)
        return GemvConfig(use_dot=False, block_f=block_f, block_k=256, split_k=split,
                          num_warps=warps, num_stages=1, prefetch=True, acc_full=True)
    split = auto_split_k(triton.cdiv(F, 64), K, 128, device, programs_per_sm=4)
    return GemvConfig(use_dot=True, block_f=64, block_k=128, split_k=split, num_warps=4,
                      num_stages=1, prefetch=True)


def one_step_configs(fmt: str, N: int, F: int, K: int, device: torch.device,
                     rows_fixed: int | None = None, max_tile_bytes: int = 36864) -> list[GemvConfig]:
    """Configurations whose programs make exactly one K step (`block_k == K / split_k`):
    with the register prefetch the whole per-program weight slice is then issued before
    `gdc_wait`, so under PDL (early trigger, `flintc.kernels.pdl`) a GEMV's weight stream
    overlaps the previous kernel and only x, the reduction and the epilogue remain on the
    critical path. Tiles of 4-36 KB of weights per program (`max_tile_bytes`; 8 warps above
    16 KB), block_k a
    power of two from 128 to 4096 that divides K, at least half an SM's worth of programs."""
    wbytes = 0.5 + 1 / 16 if fmt == "nvfp4" else 2.0
    out: list[GemvConfig] = []
    rows_opts = [rows_fixed] if rows_fixed is not None else [16, 32, 64]
    for bk in (4096, 2048, 1024, 512, 256, 128):
        if K % bk:
            continue
        split = K // bk
        for bf in rows_opts:
            tile = bf * bk * wbytes
            if tile > max_tile_bytes or tile < 4096:
                continue
            if triton.cdiv(F, bf) * split < sm_count(device) // 2:
                continue  # fewer programs than half the SMs: not a bandwidth config
            for use_dot in (True, False):
                cfg = GemvConfig(use_dot=use_dot, block_f=bf, block_k=bk, split_k=split,
                                 num_warps=8 if tile > 16384 else 4, num_stages=1,
                                 prefetch=True, scale_after=False)
                if cfg not in out:
                    out.append(cfg)
    return out


# FMA + whole-tile accumulator candidates of `sweep_configs` (block_f, block_k, num_warps),
# kept to ACC_FULL_MAX_ELEMS accumulator elements per 4 warps (64 fp32 registers a thread)
ACC_FULL_SHAPES = [(64, 128, 4), (32, 256, 4), (32, 128, 2), (16, 256, 2)]
ACC_FULL_MAX_ELEMS = 8192


def sweep_configs(fmt: str, N: int, F: int, K: int, device: torch.device,
                  rows_fixed: int | None = None, family: str = "all",
                  flat_ok: bool = False) -> list[GemvConfig]:
    """Candidate configurations that `benchmarks/bench_gemv.py --sweep` times for one
    shape (the `gpu` tests check every one of them for correctness). `rows_fixed`: the
    kernel fixes its rows per program (the fused QKV kernel: one head), so block_f is
    set to it and only the other fields vary. `family`: "all", "classic" (the tile
    shapes below), "one-step" (`one_step_configs`), "flat" (only the `flat` twins below,
    bf16) or "swap" (`swap_configs`: the weight tile as the dot's left operand, 3-D and
    flat tiles, with the flat tiles' non-swapped twins). `flat_ok` (the plain GEMV
    kernel, bf16): each classic tensor-core shape also with `flat` 2-D tiles, 3 and 4
    stages.

    Raises:
        ValueError: an unknown family.
    """
    if family not in ("all", "classic", "one-step", "flat", "swap"):
        raise ValueError("sweep_configs: family must be all, classic, one-step, flat or swap; "
                         f"got {family!r}")
    if family == "swap":
        return swap_configs(fmt, N, F, K, device, rows_fixed)
    if family == "flat":
        if not flat_ok or fmt != "bf16":
            return []
        return [c for c in sweep_configs(fmt, N, F, K, device, rows_fixed, "classic", True)
                if c.flat]
    one = one_step_configs(fmt, N, F, K, device, rows_fixed) if family != "classic" else []
    if family == "one-step":
        return one
    if fmt == "nvfp4":
        shapes = [(True, 64, 128, 4, 1, True), (True, 64, 128, 4, 3, False),
                  (True, 32, 256, 4, 1, True), (True, 64, 256, 8, 1, True),
                  (True, 128, 128, 8, 1, True), (False, 32, 128, 4, 1, True),
                  (False, 64 if N <= 2 else 32, 128, 4, 1, True)]
    else:
        shapes = [(True, 64, 128, 4, 4, False), (True, 128, 128, 4, 3, False),
                  (True, 64, 256, 4, 3, False), (True, 32, 128, 4, 4, False),
                  (True, 64, 128, 4, 1, True), (False, 64 if N <= 2 else 32, 128, 4, 1, True),
                  (False, 16, 128, 4, 3, False)]
    out: list[GemvConfig] = []
    for bf, bk, nw in ACC_FULL_SHAPES:
        if rows_fixed is not None:
            bf, nw = rows_fixed, min(8, max(nw, rows_fixed * bk // 2048))
        if triton.next_power_of_2(N) * bf * bk > ACC_FULL_MAX_ELEMS * nw // 4:
            continue  # > 64 fp32 accumulator registers per thread
        num_f = triton.cdiv(F, bf)
        for sk in sorted({auto_split_k(num_f, K, bk, device, 2), auto_split_k(num_f, K, bk, device, 4)}):
            cfg = GemvConfig(use_dot=False, block_f=bf, block_k=bk, split_k=sk, num_warps=nw,
                             num_stages=1, prefetch=True, acc_full=True)
            if cfg not in out:
                out.append(cfg)
    for i, (use_dot, bf, bk, nw, st, pf) in enumerate(shapes):
        if rows_fixed is not None:
            bf = rows_fixed
            nw = max(nw, 8) if use_dot else nw
        num_f = triton.cdiv(F, bf)
        splits = sorted({auto_split_k(num_f, K, bk, device, 2), auto_split_k(num_f, K, bk, device, 4)})
        for sk in splits:
            cfg = GemvConfig(use_dot=use_dot, block_f=bf, block_k=bk, split_k=sk, num_warps=nw,
                             num_stages=st, prefetch=pf,
                             scale_after=(fmt == "nvfp4" and not use_dot and i % 2 == 1))
            if cfg not in out:
                out.append(cfg)
            if flat_ok and use_dot and fmt == "bf16":
                for st_flat in (3, 4):
                    twin = GemvConfig(use_dot=True, block_f=bf, block_k=bk, split_k=sk,
                                      num_warps=nw, num_stages=st_flat, prefetch=False, flat=True)
                    if twin not in out:
                        out.append(twin)
    return out + [c for c in one if c not in out]


# (block_f, block_k, num_warps, num_stages, flat, prefetch) of the "swap" sweep family:
# 64-row tiles (one warpgroup's wgmma M) and 128-row ones, 3-D tiles with the register
# prefetch or the pipeliner, 2-D tiles staged by the pipeliner.
SWAP_SHAPES = [(64, 128, 4, 1, False, True), (64, 128, 4, 3, False, False),
               (64, 128, 4, 3, True, False), (64, 256, 4, 3, True, False),
               (128, 128, 8, 3, True, False), (128, 128, 4, 3, True, False)]


def swap_configs(fmt: str, N: int, F: int, K: int, device: torch.device,
                 rows_fixed: int | None = None) -> list[GemvConfig]:
    """The "swap" sweep family (`sweep_configs`) for a [N, K] x [F, K]^T GEMV in `fmt`
    ("bf16" or "nvfp4"): `choose_config(N, F, K, fmt, device)`'s pick first (the plain
    GEMV's reference point; for the fused kernels, whose defaults come from `qkv_config` /
    `norm_gate_up_silu`, just one more candidate), then every `SWAP_SHAPES` entry with
    `swap`, each flat one also without it (flat NVFP4 tiles are new to this family), at
    split-K for ~2 and ~4 programs per SM (`auto_split_k`). `rows_fixed` as in
    `sweep_configs` (block_f fixed to it, >= 8 warps). Returns distinct `GemvConfig`s,
    all but possibly the first with use_dot; nothing is launched."""
    out = [choose_config(N, F, K, fmt, device, flat_ok=rows_fixed is None)]
    for bf, bk, nw, st, flat, pf in SWAP_SHAPES:
        if rows_fixed is not None:
            bf, nw = rows_fixed, max(nw, 8)
        num_f = triton.cdiv(F, bf)
        for sk in sorted({auto_split_k(num_f, K, bk, device, 2),
                          auto_split_k(num_f, K, bk, device, 4)}):
            for swap in ((True, False) if flat else (True,)):
                cfg = GemvConfig(use_dot=True, block_f=bf, block_k=bk, split_k=sk,
                                 num_warps=nw, num_stages=st, prefetch=pf, flat=flat,
                                 swap=swap)
                if cfg not in out:
                    out.append(cfg)
    return out


def _effective_split(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(split_k, k_per_split) with no empty split; k_per_split a multiple of block_k."""
    num_k_tiles = triton.cdiv(K, block_k)
    split_k = max(1, min(split_k, num_k_tiles))
    k_per_split = triton.cdiv(num_k_tiles, split_k) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def split_k_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The per-device int32 arrival counters of one-launch split-K, zero between launches
    (each launch's last split resets its counters). Allocated once per device with
    torch.zeros (so call a split-K launcher once before CUDA-graph capture, or let the
    capture record the one-time memset, which is harmless: the counters are zero then)."""
    if needed > COUNTER_SLOTS:
        raise ValueError(f"split-K needs {needed} counters, more than {COUNTER_SLOTS}")
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


# ----------------------------------------------------------------------------- checks
def fail(op: str, name: str, what: str, t=None) -> None:
    """Raise the launchers' ValueError: `op: name must be what; got ...`."""
    got = ""
    if isinstance(t, torch.Tensor):
        got = (f"; got dtype {t.dtype}, shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
               f"device {t.device}")
    elif t is not None:
        got = f"; got {type(t).__name__}"
    raise ValueError(f"{op}: {name} must be {what}{got}")


def check_tensor(op: str, name: str, t, dtypes, shape, device) -> None:
    """t is a contiguous tensor of one of `dtypes`, of `shape` (None = any), on device."""
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    what = (f"a contiguous {'/'.join(str(d) for d in dtypes)} tensor"
            + (f" of shape {list(shape)}" if shape is not None else "") + f" on {device}")
    if not isinstance(t, torch.Tensor):
        fail(op, name, what, t)
    if t.dtype not in dtypes or (shape is not None and tuple(t.shape) != tuple(shape)) \
            or t.device != device:
        fail(op, name, what, t)
    if not t.is_contiguous():
        fail(op, name, what + " (it is not contiguous)", t)


def check_weight(op: str, name: str, w, K: int, device, F: int | None = None,
                 mma_ok: bool = False):
    """Check a weight list `[w]` bf16 [F, K] or NVFP4 `[codes uint8 [F, K/2], scales
    float8_e4m3fn [F, K/16], global_scale fp32 []]`, or with `mma_ok` NVFP4 in the mma
    layout (`[codes int32 [F/16, K/64, 32, 4], scales uint8 [F/16, K/64, 32, 2],
    global_scale]`, `flintc.kernels.nvfp4_mma`). Returns (fmt "bf16" / "nvfp4" /
    "nvfp4-mma", F, (w, scales, gscale) kernel arguments; bf16 passes the weight for the
    unused pointers)."""
    if not isinstance(w, (list, tuple)) or len(w) not in (1, 3):
        fail(op, name, "a list [weight] (bf16) or [codes, scales, global_scale] (NVFP4)", w)
    if len(w) == 3 and isinstance(w[0], torch.Tensor) and w[0].dtype == torch.int32:
        codes, scales, gscale = w
        if not mma_ok:
            fail(op, f"{name}[0] (NVFP4 codes)", f"uint8 codes [F, {K // 2}] of the packed layout "
                 "(this op does not read the mma layout: only the CUDA decode kernels do)", codes)
        if codes.dim() != 4 or K % 64:
            fail(op, f"{name}[0] (NVFP4 codes, mma layout)", f"an int32 tensor [F/16, {K // 64}, "
                 "32, 4] (K % 64 == 0)", codes)
        F = codes.shape[0] * 16 if F is None else F
        check_tensor(op, f"{name}[0] (NVFP4 codes, mma layout)", codes, torch.int32,
                     (F // 16, K // 64, 32, 4), device)
        check_tensor(op, f"{name}[1] (NVFP4 scale codes, mma layout)", scales, torch.uint8,
                     (F // 16, K // 64, 32, 2), device)
        check_tensor(op, f"{name}[2] (NVFP4 global scale)", gscale, torch.float32, (), device)
        return "nvfp4-mma", F, (codes, scales, gscale)
    if len(w) == 3:
        codes, scales, gscale = w
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
            fail(op, f"{name}[0] (NVFP4 codes)", f"a uint8 tensor [F, {K // 2}]", codes)
        if K % NVFP4_BLOCK:
            fail(op, name, f"NVFP4 with K % {NVFP4_BLOCK} == 0 (K = {K})")
        F = codes.shape[0] if F is None else F
        check_tensor(op, f"{name}[0] (NVFP4 codes)", codes, torch.uint8, (F, K // 2), device)
        check_tensor(op, f"{name}[1] (NVFP4 block scales)", scales, torch.float8_e4m3fn,
                     (F, K // NVFP4_BLOCK), device)
        check_tensor(op, f"{name}[2] (NVFP4 global scale)", gscale, torch.float32, (), device)
        return "nvfp4", F, (codes, scales, gscale)
    (weight,) = w
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        fail(op, f"{name}[0] (weight)", f"a bf16 tensor [F, {K}]", weight)
    F = weight.shape[0] if F is None else F
    check_tensor(op, f"{name}[0] (weight)", weight, torch.bfloat16, (F, K), device)
    return "bf16", F, (weight, weight, weight)


def launch_gemv(op: str, x2: torch.Tensor, wargs, fmt: str, F: int, out: torch.Tensor,
                epilogue: int, residual: torch.Tensor | None = None,
                norm: torch.Tensor | None = None, eps: float = 0.0,
                config: GemvConfig | None = None, use_pdl: bool = False) -> torch.Tensor:
    """Launch `gemv_kernel` on checked arguments: x2 bf16 [N, K] (row stride x2.stride(0),
    unit column stride), weights `wargs` from `check_weight`, out [N, F] contiguous."""
    N, K = x2.shape
    dev = x2.device
    if fmt == "nvfp4-mma":  # converted weights: only the CUDA kernel reads them
        if config is not None or norm is not None or epilogue == EPI_FP32:
            fail(op, "w", "in the packed NVFP4 layout for a config, a norm prologue or an fp32 "
                 "output (the mma layout runs on the CUDA kernel only)")
        if not _mma_gemv(x2, wargs, F, out, residual, use_pdl):
            from flintc.kernels.nvfp4_mma import refusal_note

            fail(op, "w", "in the packed NVFP4 layout here: the mma layout runs on the CUDA "
                 "kernel only (sm_90+, NVRTC, F % 16 == 0, K % 64 == 0)" + refusal_note(dev))
        return out
    if (fmt in ("nvfp4", "bf16") and config is None and norm is None and epilogue != EPI_FP32
            and _mma_gemv(x2, wargs, F, out, residual, use_pdl)):
        return out
    cfg = config or choose_config(N, F, K, fmt, dev, norm=norm is not None)
    gpu = dev.type == "cuda" and not interpreting()
    if cfg.block_k % (32 if fmt == "nvfp4" or cfg.use_dot else 8) or cfg.block_f < 16 \
            and cfg.use_dot:
        raise ValueError(f"{op}: config {cfg} has block_k/block_f too small for this path")
    split, k_per_split = _effective_split(K, cfg.block_k, cfg.split_k)
    num_f = triton.cdiv(F, cfg.block_f)
    block_n = 16 if cfg.use_dot else triton.next_power_of_2(N)
    if split > 1:
        ws = torch.empty((split, N, F), dtype=torch.float32, device=dev)
        cnt = split_k_counters(dev, num_f)
    else:
        ws = cnt = out  # unused
    pdl = bool(use_pdl) and gpu
    extra = {"launch_pdl": True} if pdl else {}
    if gpu:
        extra["num_stages"] = cfg.num_stages
    norm_once = norm is not None and (cfg.norm_once if cfg.norm_once is not None
                                      else k_per_split // cfg.block_k >= NORM_ONCE_MIN_STEPS)
    xn = torch.empty((N, K), dtype=torch.bfloat16, device=dev) if norm_once else x2
    w_arg, s_arg, g_arg = wargs
    gemv_kernel[(num_f, split)](
        x2, norm if norm is not None else x2, w_arg, s_arg, g_arg,
        residual if residual is not None else out, out, ws, cnt, xn,
        N, F, K, x2.stride(0), float(eps), k_per_split,
        BLOCK_N=block_n, BLOCK_F=cfg.block_f, BLOCK_K=cfg.block_k, SPLIT_K=split,
        IS_NVFP4=fmt == "nvfp4", HAS_NORM=norm is not None, EPILOGUE=epilogue,
        USE_DOT=cfg.use_dot, SCALE_AFTER=cfg.scale_after and fmt == "nvfp4",
        USE_PDL=pdl_mode(pdl), GPU=gpu, PREFETCH=cfg.prefetch,
        NR=triton.next_power_of_2(N) if norm is not None else 1,
        NORM_H=triton.next_power_of_2(K) if norm is not None else 1, NORM_ONCE=norm_once,
        ACC_FULL=cfg.acc_full and not cfg.use_dot,
        FLAT=cfg.flat and cfg.use_dot, SWAP=cfg.swap and cfg.use_dot, num_warps=cfg.num_warps, **extra,
    )
    return out


def _mma_gemv(x2: torch.Tensor, wargs, F: int, out: torch.Tensor,
              residual: torch.Tensor | None, use_pdl: bool) -> bool:
    """The NVFP4 or bf16 GEMV on the CUDA `mma.sync` kernel (`flintc.kernels.nvfp4_mma`)
    where it applies: a CUDA sm_90+ device (`nvfp4_mma.available`), F % 16 == 0, K % 64
    == 0, x2 contiguous and 16-byte aligned (bf16 weights too), outside the interpreter
    (weights in the mma layout: even inside it, having no Triton path).
    Returns False (the caller runs the Triton kernel) otherwise, or when an NVFP4 weight
    is first seen during CUDA-graph capture (its repack cannot be captured). Same numerics
    as the Triton kernel: exact products, fp32 sums, one rounding (plus the residual
    add's)."""
    from flintc.kernels import nvfp4_mma

    N, K = x2.shape
    codes, scales, gscale = wargs
    if codes.dtype == torch.bfloat16:  # bf16 weights, read in place
        if interpreting() or F % 16 or K % 64 or not nvfp4_mma.available(x2.device) \
                or not x2.is_contiguous() or x2.data_ptr() % 16 or codes.data_ptr() % 16 \
                or not codes.is_contiguous():
            return False
        nvfp4_mma.mma_gemv(x2, codes, None, None, out.view(N, F),
                           residual=residual.view(N, F) if residual is not None else None,
                           use_pdl=use_pdl)
        return True
    converted = nvfp4_mma.is_mma_layout(codes)
    if (interpreting() and not converted) or F % 16 or K % 64:  # converted: no Triton path
        return False
    if not (nvfp4_mma.supported(x2.device) if converted else nvfp4_mma.available(x2.device)):
        return False
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        if not converted:
            return False
        x2 = x2.clone(memory_format=torch.contiguous_format)  # the kernel's 16-byte loads
    try:
        wq, sq = nvfp4_mma.mma_operands(codes, scales)
    except RuntimeError:  # first seen while capturing a CUDA graph
        return False
    nvfp4_mma.mma_gemv(x2, wq, sq, gscale, out.view(N, F),
                       residual=residual.view(N, F) if residual is not None else None,
                       use_pdl=use_pdl)
    return True


def check_x2d(op: str, x, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 \
            or not 1 <= x.shape[0] <= MAX_N:
        fail(op, name, f"a bf16 tensor [N, K] with 1 <= N <= {MAX_N}", x)
    if not x.is_contiguous():
        fail(op, name, "contiguous", x)


# ----------------------------------------------------------------------------- launchers
def gemv(x: torch.Tensor, w: list[torch.Tensor], *, use_pdl: bool = False,
         out: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """`x @ W^T` for decode batches, as `flintc::gemv` (reference: `gemv_reference`).

    Args:
        x: bf16 [N, K], 1 <= N <= 8, contiguous.
        w: `[weight]` bf16 [F, K], or NVFP4 `[codes, scales, global_scale]` with codes
            uint8 [F, K/2], scales float8_e4m3fn [F, K/16], global_scale fp32 [];
            K % 16 == 0 for NVFP4; or NVFP4 in the mma layout (codes int32 [F/16, K/64,
            32, 4], scales uint8 [F/16, K/64, 32, 2]: `flintc.kernels.nvfp4_mma.prepack`),
            which runs on the CUDA kernel only (sm_90+; ValueError elsewhere or with a
            config). All contiguous, on x's device.
        use_pdl: launch with programmatic dependent launch (CUDA, sm_90+ only).
        out: optional bf16 [N, F] contiguous output; allocated when None.
        config: a `GemvConfig`; None picks one with `choose_config`.

    Returns:
        bf16 [N, F]. Numerics: see the module docstring (within one bf16 ulp + the fp32
        reordering bound of the reference).

    Bytes read: weights (bf16: 2*F*K; NVFP4: F*K/2 codes + F*K/16 scales + 4) plus x
    (2*N*K, re-read per F block from L2). Written: 2*N*F, plus with split-K 4*N*F*S of
    fp32 partials (written and read back once, L2-resident).

    Raises:
        ValueError: a dtype, shape, device or contiguity does not match the above; the
            message names the argument.
    """
    check_x2d("gemv", x)
    fmt, F, wargs = check_weight("gemv", "w", w, x.shape[1], x.device, mma_ok=True)
    if out is None:
        out = torch.empty((x.shape[0], F), dtype=torch.bfloat16, device=x.device)
    else:
        check_tensor("gemv", "out", out, torch.bfloat16, (x.shape[0], F), x.device)
    return launch_gemv("gemv", x, wargs, fmt, F, out, EPI_BF16, config=config, use_pdl=use_pdl)


def lm_head(x: torch.Tensor, w: torch.Tensor, *, use_pdl: bool = False,
            config: GemvConfig | None = None) -> torch.Tensor:
    """Logits `x @ W^T` with fp32 accumulation, never rounded, as `flintc::lm_head`
    (reference: `flintc.ops.linear.lm_head`). x: bf16 [N, H] (N <= 8; larger N falls back
    to the reference op); w: bf16 [V, H] contiguous. -> fp32 [N, V]. Within the fp32
    reordering bound of the reference (no bf16 rounding anywhere).

    Raises:
        ValueError: bad dtype / shape / device / contiguity, naming the argument.
    """
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] > MAX_N:
        from flintc.ops import linear  # the reference op (fallback for big batches)
        return linear.lm_head(x, w)
    check_x2d("lm_head", x)
    if not isinstance(w, torch.Tensor):
        fail("lm_head", "w", "a bf16 tensor [V, H]", w)
    fmt, F, wargs = check_weight("lm_head", "w", [w], x.shape[1], x.device)
    out = torch.empty((x.shape[0], F), dtype=torch.float32, device=x.device)
    return launch_gemv("lm_head", x, wargs, fmt, F, out, EPI_FP32, config=config,
                       use_pdl=use_pdl)


def gemv_reference(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """The op's reference (`flintc.model.ops.linear`): plain torch, fp32, one rounding."""
    return ops.linear(x, as_weight(w), CDT)


def _gemv_entry(x, w, *, use_pdl: bool = False):
    """`flintc::gemv` launcher (contract signature); falls back to the reference op
    `flintc.ops.linear.gemv` for N > 8 rows."""
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] > MAX_N:
        from flintc.ops import linear
        return linear.gemv(x, w)
    return gemv(x, w, use_pdl=use_pdl)


KERNELS = {"gemv": _gemv_entry, "lm_head": lm_head}
