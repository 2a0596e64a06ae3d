"""Triton kernels for the MoE part of the low-latency decode schedule (FLINT_SPEC section 5,
kernels 5-7 of a MoE layer), batch N <= 8 decode tokens, BF16 or NVFP4 (W4A16) weights.

Kernels (one launch each unless stated) and the ops they implement (references in
`flintc.ops.grouped` / `flintc.ops.moe`; `torch.ops.flintc.<name>` is the oracle):

* `norm_router_kernel`: `flintc::norm_router`: post-attention RMSNorm (fp32, one bf16
  rounding of the normed x, which is also stored) + router GEMV -> fp32 logits [N, E].
  Grid: blocks of BLOCK_E router rows; every program recomputes the N row norms from x (a
  few KiB read from L2) so that no second launch is needed. With APPLY_NORM=False the same
  kernel is the router GEMV of `flintc::moe_route`, which then runs `topk_kernel` (two
  launches: the top-k needs all E logits of a token, which one GEMV program never has).
* `gate_up_kernel`: `flintc::moe_topk_gate_up` (ROUTE=True: sigmoid, bias-corrected top-k
  and routing weights in the prologue) and `flintc::moe_gate_up` (ROUTE=False: ids read
  from memory). Grid: (F block, slot, split of H); slot = one (token, k) pair, plus one
  for the shared expert. **Expert dedupe**: every program computes the selections of all
  N tokens (N*E logits, a few KiB), and slot (t, k) owns expert e = ids[t, k] only if no
  earlier slot selected e; the owner runs e's gate and up GEMVs (one loop, both matrices'
  tiles in flight, each x tile used twice) for *all* tokens that selected e, so each
  distinct expert's weights are streamed from HBM once per call; non-owners exit. With
  split > 1 each split stores fp32 partials [2, N, K+1, F] to a workspace and bumps a
  per-(slot, F block) counter; the last-arriving split sums the partials in split order
  (deterministic) and runs the epilogue: g and u each rounded to bf16 (the reference's
  rounding points), SiLU-and-mul in fp32, one rounding.
* `down_kernel`: `flintc::moe_down_combine_residual` (HAS_RESIDUAL=True) and
  `flintc::moe_down_combine`. Grid: (H block, slot, split of F): every distinct expert
  (same dedupe) and the shared expert run in parallel, each owner writing its fp32
  partial y[n, k, h-block] for its tokens into a workspace [split, N, K+1, H]. Every
  program, owner or not, then counts itself on the H block's counter; the last of the
  (N*K+1) * split arrivals does the combine in the reference's order: per (n, k) the
  splits summed in split order, times the global scale, rounded to bf16; `w_k * y_k`
  (a separate fp32 multiply, never an FMA) summed over k = 0..K-1 in order, plus the
  shared expert's bf16 output, rounded once; then the residual add (fp32 sum of two
  bf16, rounded once). No float atomics: the result does not depend on arrival order.

Counters: the int32 arrival counters are `flintc.kernels.gemv.split_k_counters` (one zeroed
buffer per device; the last arrival resets its counter, so every launch leaves them zero).
They are touched only after `gdc_wait`, so a PDL-overlapped neighbour never sees them
mid-use. Workspaces are `torch.empty` of shapes fixed by (N, K, F, H, split): nothing
depends on data values and there are no host syncs (CUDA-graph safe).

Expert GEMV (issue 5 round 2; ideas from `flintc.kernels.gemv`): weight tiles load as
[rows, BLOCK_K/8, 8] bf16 or [rows, BLOCK_K/16, 8] code bytes (one 16-weight block and its
scale per 8-byte vector, `flintc.kernels.tiles.load_weight_tile`); E2M1 is decoded by
`flintc.kernels.tiles.dequant_tile` (inline-asm bit trick on the GPU, ~2 instructions per
weight, weights scaled by 2^-8 and the accumulator by 256 after the loop); the reduction is either the tensor cores (tokens
padded to 16) or an FMA reduction that keeps one fp32 partial per 8/16 columns and sums
once after the K loop, NVFP4 optionally scaling each 16-weight partial once
(`scale_after`). Memory in flight comes from Triton's pipeliner (num_stages) or a
register prefetch of the next tile. Configurations come from `TUNED` (measured by
`benchmarks/bench_moe.py`, which sweeps `sweep_configs`) or the rule in `choose_config`;
never autotuned at call time.

PDL: each kernel loads what does not depend on the previous kernel (router rows; the
shared expert's first tiles in `prefetch` configs) before `gdc_wait`; routed-expert tiles
can only be addressed once the ids are known. `use_pdl=True` launches with
`launch_pdl=True` (CUDA only).

Numerics against the reference (FLINT_SPEC section 3 rounding points, all kept):
* logits: fp32 dot products in a different order than torch's matmul: a few fp32 ulps.
* normed x, g, u, h, expert outputs, combine, residual: one bf16 rounding each, at the
  reference's points. Every product x * w is exact in fp32 (bf16 x bf16, or bf16 x
  e2m1 * e4m3); only the fp32 summation order differs from torch (tensor-core order,
  split-K, and with `scale_after` one extra rounding of at most 2^-24 relative per
  16-weight block), and Triton's exp/rsqrt/sigmoid can differ from torch's by an ulp, so a
  value on a bf16 rounding boundary can move one bf16 ulp (a small share of elements;
  tests report it). The combine sums the K weighted expert outputs in k order, then adds
  the shared expert, as the reference does.
* top-k ids: exact (ties in `sigmoid(logit) + bias` go to the lower expert index), except
  where two keys are within an ulp of each other and the sigmoids differ by an ulp.
* routing weights: `s_k / sum(s) * scaling` with a tree-ordered sum and a correctly
  rounded division; torch's 6-element sum and its CPU sigmoid use other orders / formulas
  (measured: a sequential 6-term sum differs from torch's CPU sum in 39% of rows), so the
  weights agree to a few fp32 ulps, not bit for bit.

All launchers fall back to the reference op (`torch.ops.flintc.*`) for N > 8, which a
decode step at batch <= 8 never sees.

On CUDA sm_90+ (no explicit config, a shared expert; FLINTC_NVFP4_MMA=0 turns it off),
`moe_topk_gate_up` and `moe_down_combine_residual` run the CUDA C++ `mma.sync` kernels of
`flintc.kernels.nvfp4_mma` instead (same op contract and rounding points; no expert
dedupe; the routing weights use the same formulas and sum order as `_route`): NVFP4 at
every batch (gate/up 1.7-2.1x, down 2.5x faster than Triton at batches 1-8), bf16 where
they were measured faster (`BF16_MMA_N`: down at every batch, 1.2-1.5x; gate/up at
batches 1-2); docs/gpu-runs.md sessions 12 and 15. The other ops stay on the Triton
kernels here. Experts that the runtime converted to the mma layout
(`flintc.kernels.nvfp4_mma.prepack`: int32 codes [E, F/16, K/64, 32, 4], uint8 scale
codes [E, F/16, K/64, 32, 2]) run on those CUDA kernels only, whatever FLINTC_NVFP4_MMA
says; a call they cannot take (no routing, a
config, another device, the interpreter) raises ValueError saying so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from flintc.kernels.gemv import _round_to_bf16, split_k_counters
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

MAX_N = 8  # decode batch limit of the kernels (the launchers fall back above it)
NVFP4_BLOCK = 16


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _bf16_value(v):
    """fp32 -> the fp32 value of its bf16 rounding (nearest even), exact on every backend."""
    return _round_to_bf16(v).to(tl.float32)


@triton.jit
def _exp(v, LIBDEVICE: tl.constexpr):
    """expf: libdevice's accurate `__nv_expf` on the GPU (what torch's CUDA kernels call);
    `tl.exp` in the interpreter (where libdevice is unavailable)."""
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.exp(v)
    else:
        return tl.exp(v)


@triton.jit
def _sigmoid(v, LIBDEVICE: tl.constexpr):
    """`1 / (1 + exp(-v))` with a correctly rounded division (torch's formula)."""
    return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), 1.0 + _exp(-v, LIBDEVICE))


@triton.jit
def _rsqrt(v, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return tl.extra.cuda.libdevice.rsqrt(v)
    else:
        return 1.0 / tl.sqrt(v)


@triton.jit
def _load_tile(w_ptr, s_ptr, offs_r, mask_r, k0, K, BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr):
    """Raw weight tile of rows `offs_r`, columns [k0, k0 + BLOCK_K) of a row-major [R, K]
    matrix (w_ptr already at the matrix). bf16: (w [R, BLOCK_K], w). NVFP4: (codes uint8
    [R, BLOCK_K/2], scales fp8 [R, BLOCK_K/16]). Masked rows / columns read nothing."""
    if IS_NVFP4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        codes = tl.load(w_ptr + offs_r[:, None] * (K // 2) + offs_b[None, :],
                        mask=mask_r[:, None] & (2 * offs_b < K)[None, :], other=0)
        offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        scales = tl.load(s_ptr + offs_r[:, None] * (K // 16) + offs_s[None, :],
                         mask=mask_r[:, None] & (16 * offs_s < K)[None, :], other=0.0)
        return codes, scales
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_r[:, None] * K + offs_k[None, :],
                    mask=mask_r[:, None] & (offs_k < K)[None, :], other=0.0)
        return w, w




@triton.jit
def _route(logits_ptr, bias_ptr, N, E, scaling, offs_n, offs_k,
           BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Top-k routing of the tokens `offs_n` (FLINT_SPEC 2, MoE steps 2-4; reference
    `flintc.model.ops.select_topk`): scores = sigmoid(logits) fp32; selection = top-k of
    `scores + bias`, ties to the lower expert index; weights =
    `scores[sel] / sum(scores[sel]) * scaling`.

    Each of the K rounds is one max-reduction over int64 keys that pack the fp32 key's
    order-preserving bits (high word) above `BLOCK_E - 1 - expert` (low word), so the max
    is the largest key and, among equal keys, the lowest expert index.
    Returns (ids int32 [BLOCK_N, TOPK_PAD], weights fp32 [BLOCK_N, TOPK_PAD]); padding
    columns k >= TOP_K and rows n >= N hold junk that callers mask."""
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    mask_n = offs_n < N
    logit = tl.load(logits_ptr + offs_n[:, None] * E + offs_e[None, :],
                    mask=mask_n[:, None] & mask_e[None, :], other=0.0)
    bias = tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0)
    key = _sigmoid(logit, LIBDEVICE) + bias[None, :] + 0.0  # + 0.0: -0.0 becomes +0.0
    bits = key.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed-int order == float order
    packed = (bits.to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e)[None, :].to(tl.int64)
    lowest = -9223372036854775807 - 1
    packed = tl.where(mask_e[None, :], packed, lowest)
    ids = tl.zeros((offs_n.shape[0], offs_k.shape[0]), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(packed, axis=1)
        idx = (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        ids = tl.where(offs_k[None, :] == k, idx[:, None], ids)
        packed = tl.where(offs_e[None, :] == idx[:, None], lowest, packed)
    # Scores of the selected experts, recomputed from their logits (same function, same
    # bits), then normalised; the sum is a tree reduction (torch's 6-term sum is not in
    # k order either, so neither is bit-exact against the other).
    keep = mask_n[:, None] & (offs_k < TOP_K)[None, :]
    s_sel = _sigmoid(tl.load(logits_ptr + offs_n[:, None] * E + ids, mask=keep, other=0.0),
                     LIBDEVICE)
    s_sel = tl.where(keep, s_sel, 0.0)
    total = tl.sum(s_sel, axis=1)
    total = tl.where(total > 0, total, 1.0)  # padding rows: avoid 0 / 0
    wts = tl.math.div_rn(s_sel, tl.broadcast_to(total[:, None], s_sel.shape)) * scaling
    return ids, wts


# ----------------------------------------------------------------------------- kernel 5
@triton.jit
def norm_router_kernel(
    x_ptr,  # bf16 [N, H]
    norm_ptr,  # fp32 [H] (unused without APPLY_NORM)
    w_ptr,  # router bf16 [E, H]
    h_ptr,  # out: normed x bf16 [N, H] (unused without APPLY_NORM)
    logits_ptr,  # out: fp32 [N, E]
    N, E, H, eps,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    APPLY_NORM: tl.constexpr, USE_PDL: tl.constexpr, LIBDEVICE: tl.constexpr,
    NUM_K: tl.constexpr,  # cdiv(H, BLOCK_K)
):
    # Program p: logits of all N tokens for router rows [p*BLOCK_E, (p+1)*BLOCK_E); CUDA-core
    # products (the tile is [BLOCK_N, BLOCK_E, BLOCK_K]: few rows per program keep 100+ SMs
    # busy on a 1 MiB matrix). Program 0 also stores the normed x. The products accumulate
    # elementwise into the whole tile and are reduced once after the loop (no cross-lane
    # reduction per step, as `acc_full` in the GEMV kernels); the sum of squares of the
    # RMSNorm is unrolled so its x loads are issued together.
    pid = tl.program_id(0)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_cur, _ = _load_tile(w_ptr, w_ptr, offs_e, mask_e, 0, H, BLOCK_K, False)  # before the wait
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by the previous kernel
    rstd = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if APPLY_NORM:
        ss = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for kk in tl.static_range(NUM_K):
            offs_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + offs_n[:, None] * H + offs_k[None, :],
                         mask=mask_n[:, None] & (offs_k < H)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xv * xv, axis=1)
        rstd = _rsqrt(ss / H + eps, LIBDEVICE)
    h_rows = tl.where(pid == 0, N, 0)  # program 0 stores the normed x
    acc3 = tl.zeros((BLOCK_N, BLOCK_E, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        w_next, _ = _load_tile(w_ptr, w_ptr, offs_e, mask_e, k0 + BLOCK_K, H, BLOCK_K, False)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_x = mask_n[:, None] & (offs_k < H)[None, :]
        xv = tl.load(x_ptr + offs_n[:, None] * H + offs_k[None, :], mask=mask_x,
                     other=0.0).to(tl.float32)
        if APPLY_NORM:
            nw = tl.load(norm_ptr + offs_k, mask=offs_k < H, other=0.0)
            hv = xv * rstd[:, None] * nw[None, :]  # the reference's order: (x * rstd) * w
            hb = _round_to_bf16(hv)  # the one rounding of the normed x
            tl.store(h_ptr + offs_n[:, None] * H + offs_k[None, :], hb,
                     mask=mask_x & (offs_n < h_rows)[:, None])
            xv = hb.to(tl.float32)
        wf = w_cur.to(tl.float32)
        acc3 += xv[:, None, :] * wf[None, :, :]
        w_cur = w_next
    acc = tl.sum(acc3, axis=2)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(logits_ptr + offs_n[:, None] * E + offs_e[None, :], acc,
             mask=mask_n[:, None] & mask_e[None, :])


@triton.jit
def topk_kernel(
    logits_ptr, bias_ptr,  # fp32 [N, E], fp32 [E]
    wts_ptr, ids_ptr,  # out: fp32 [N, K], int64 [N, K]
    N, E, scaling,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    USE_PDL: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    # Program p: the top-k of tokens [p * BLOCK_N, (p + 1) * BLOCK_N): one program for all
    # N in decode (the second launch of moe_route), blocks of TOPK_ROWS_BLOCK_N tokens for
    # a prefill chunk (`route_topk_rows`).
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, TOPK_PAD)
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    ids, wts = _route(logits_ptr, bias_ptr, N, E, scaling, offs_n, offs_k, BLOCK_E, TOP_K,
                      LIBDEVICE)
    mask = (offs_n < N)[:, None] & (offs_k < TOP_K)[None, :]
    out = offs_n[:, None] * TOP_K + offs_k[None, :]
    tl.store(wts_ptr + out, wts, mask=mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)


# ----------------------------------------------------------------------------- expert GEMV
@triton.jit
def _load_x(x_rows, mask_x, k0, k_end, BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr):
    """Activation tiles matching `_load_w`'s columns, fp32, for the tokens whose row
    starts `x_rows` (pointer [BLOCK_N]) point at (rows not in `mask_x` read as 0; the
    rows need not be evenly spaced: the down GEMV reads h[n, kpos[n], :]).
    bf16: (x [BLOCK_N, KB, 8] at columns k0 + 8 kb + j, the same again); NVFP4: (x_even,
    x_odd) [BLOCK_N, KB, 8] at columns k0 + 16 kb + 2 j (+ 1), loaded as one contiguous
    [BLOCK_N, KB, 8, 2] tile and split in registers (gemv.py's `_load_x`)."""
    kb = tl.arange(0, BLOCK_K // 16 if IS_NVFP4 else BLOCK_K // 8)
    j = tl.arange(0, 8)
    if IS_NVFP4:
        p = tl.arange(0, 2)
        col = k0 + kb[:, None, None] * 16 + 2 * j[None, :, None] + p[None, None, :]
        mask = mask_x[:, None, None, None] & (col < k_end)[None, :, :, :]
        x = tl.load(x_rows[:, None, None, None] + col[None, :, :, :], mask=mask,
                    other=0.0).to(tl.float32)
        x_e, x_o = tl.split(x)
        return x_e, x_o
    else:
        col = k0 + kb[:, None] * 8 + j[None, :]
        mask = mask_x[:, None, None] & (col < k_end)[None, :, :]
        x = tl.load(x_rows[:, None, None] + col[None, :, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        return x, x


@triton.jit
def _mac(acc, w, s, x_a, x_b, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
         BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr, USE_DOT: tl.constexpr,
         SCALE_AFTER: tl.constexpr, GPU: tl.constexpr, ACC_FULL: tl.constexpr,
         SWAP: tl.constexpr = False):
    """One BLOCK_K step: acc += x . w for one weight tile (from `_load_w`) and the x tiles
    (from `_load_x`). USE_DOT: acc [BLOCK_N, BLOCK_F] on the tensor cores ([BLOCK_F,
    BLOCK_N] with SWAP: the weight tile as the dot's left operand, `tiles.dot_2d`). Else the FMA
    reduction: acc [BLOCK_N, BLOCK_F, KB] keeps one fp32 partial per 8 (bf16) or 16
    (NVFP4) columns, summed once after the K loop; with SCALE_AFTER (NVFP4) each
    16-weight block is summed unscaled and multiplied by its block scale once. ACC_FULL
    (FMA): acc [BLOCK_N, BLOCK_F, KB, 8] is the whole product tile, one FMA per weight and
    no per-step reduction (`flintc.kernels.gemv._gemv_loop`)."""
    if ACC_FULL and not USE_DOT:
        if IS_NVFP4:
            w_lo, w_hi = dequant_tile(w, s, GPU)
            acc += x_a[:, None, :, :] * w_lo.to(tl.float32)[None, :, :, :]
            acc += x_b[:, None, :, :] * w_hi.to(tl.float32)[None, :, :, :]
        else:
            acc += x_a[:, None, :, :] * w.to(tl.float32)[None, :, :, :]
    elif IS_NVFP4:
        if USE_DOT:
            # e2m1 * scale * 2^-8, exact (bf16 on the GPU); `_expert_gemv` undoes the 2^-8
            w_lo, w_hi = dequant_tile(w, s, GPU)
            acc = _dot_tile(acc, x_a, w_lo, BLOCK_N, BLOCK_F, BLOCK_K // 2, GPU, SWAP)
            acc = _dot_tile(acc, x_b, w_hi, BLOCK_N, BLOCK_F, BLOCK_K // 2, GPU, SWAP)
        elif SCALE_AFTER:
            c = w.to(tl.int32)
            sf = s.to(tl.float32)  # [BLOCK_F, KB]
            part = tl.sum(x_a[:, None, :, :] * e2m1_fp32(c & 15)[None, :, :, :], axis=3)
            part += tl.sum(x_b[:, None, :, :] * e2m1_fp32(c >> 4)[None, :, :, :], axis=3)
            acc += part * sf[None, :, :]
        else:
            w_lo, w_hi = dequant_tile(w, s, GPU)
            acc += tl.sum(x_a[:, None, :, :] * w_lo.to(tl.float32)[None, :, :, :], axis=3)
            acc += tl.sum(x_b[:, None, :, :] * w_hi.to(tl.float32)[None, :, :, :], axis=3)
    else:
        if USE_DOT:
            acc = _dot_tile(acc, x_a, w, BLOCK_N, BLOCK_F, BLOCK_K, GPU, SWAP)
        else:
            acc += tl.sum(x_a[:, None, :, :] * w.to(tl.float32)[None, :, :, :], axis=3)
    return acc


@triton.jit
def _expert_gemv_flat(w_rows, s_rows, v_rows, t_rows, mask_f, x_rows, mask_x, k_start,
                      k_end, n_iters, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
                      BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr, TWO: tl.constexpr,
                      GPU: tl.constexpr, SWAP: tl.constexpr = False):
    """`_expert_gemv` on the tensor cores with 2-D tiles (MoeConfig.flat): x
    [BLOCK_N, BLOCK_K] and weights [BLOCK_F, BLOCK_K] in K order, loaded in the loop so
    Triton's pipeliner (num_stages) stages them, one dot per step and matrix, with no
    [F, KB, 8] -> [F, K] relayout around the dot (what made the LM head's 3-D tiles ~2x
    slower than 2-D ones, `flintc.kernels.gemv.GemvConfig.flat`). Same products and fp32
    accumulation as the 3-D tiles; NVFP4 results lack the global scale. SWAP: the weight
    tile is the dot's left operand (`tiles.dot_2d`), accumulators transposed back after
    the loop."""
    acc = acc_init(BLOCK_N, BLOCK_F, SWAP)
    acc2 = acc_init(BLOCK_N, BLOCK_F, SWAP)
    s_w = first_scales(s_rows, mask_f, k_start, k_end, BLOCK_F, BLOCK_K, IS_NVFP4)
    s_v = first_scales(t_rows, mask_f, k_start, k_end, BLOCK_F, BLOCK_K, IS_NVFP4 and TWO)
    for it in range(n_iters):
        k0 = k_start + it * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows[:, None] + offs_k[None, :],
                    mask=mask_x[:, None] & (offs_k < k_end)[None, :], other=0.0)
        w, s_w = load_flat_tile(w_rows, s_rows, s_w, mask_f, k0, k_end, BLOCK_F, BLOCK_K,
                                IS_NVFP4, GPU)
        acc = dot_2d(acc, x, w, GPU, SWAP)
        if TWO:
            v, s_v = load_flat_tile(v_rows, t_rows, s_v, mask_f, k0, k_end, BLOCK_F, BLOCK_K,
                                    IS_NVFP4, GPU)
            acc2 = dot_2d(acc2, x, v, GPU, SWAP)
    acc = acc_final(acc, SWAP)
    acc2 = acc_final(acc2, SWAP)
    if IS_NVFP4:
        acc = acc * DEQUANT_UNSCALE  # exact: undoes dequant_tile's 2^-8
        acc2 = acc2 * DEQUANT_UNSCALE
    return acc, acc2


@triton.jit
def _expert_gemv(w_rows, s_rows, v_rows, t_rows, w0, s0, v0, t0, mask_f, x_rows, mask_x,
                 k_start, k_end, n_iters,
                 BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
                 IS_NVFP4: tl.constexpr, TWO: tl.constexpr, USE_DOT: tl.constexpr,
                 SCALE_AFTER: tl.constexpr, GPU: tl.constexpr, PREFETCH: tl.constexpr,
                 ACC_FULL: tl.constexpr, SWAP: tl.constexpr = False):
    """(acc, acc2) fp32 [BLOCK_N, BLOCK_F]: x[:, k_start:k_end] @ W[rows, k_start:k_end]^T
    for W = the matrix at (w_rows, s_rows) and, with TWO, also for V at (v_rows, t_rows)
    (gate and up share each x tile; twice the loads in flight per step). NVFP4 results
    lack the global scale. PREFETCH: (w0, s0) / (v0, t0) are the first tiles (loaded by
    the caller, the shared expert's before `gdc_wait`) and each step loads the next tiles
    into registers before using the current ones; without it each step loads its own
    tiles and Triton's pipeliner (num_stages) stages them through shared memory. SWAP
    (USE_DOT): the weight tile is the dot's left operand (`tiles.dot_2d`)."""
    KB: tl.constexpr = BLOCK_K // 16 if IS_NVFP4 else BLOCK_K // 8
    if USE_DOT:
        acc = acc_init(BLOCK_N, BLOCK_F, SWAP)
        acc2 = acc_init(BLOCK_N, BLOCK_F, SWAP)
    elif ACC_FULL:
        acc = tl.zeros((BLOCK_N, BLOCK_F, KB, 8), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_F, KB, 8), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_F, KB), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_F, KB), dtype=tl.float32)
    # x tiles (L2) always one step ahead: no L2 round trip on the critical path per step
    xa_cur, xb_cur = _load_x(x_rows, mask_x, k_start, k_end, BLOCK_K, IS_NVFP4)
    for it in range(n_iters):
        k0 = k_start + it * BLOCK_K
        if PREFETCH:
            w_nxt, s_nxt = _load_w(w_rows, s_rows, mask_f, k0 + BLOCK_K, k_end, BLOCK_K,
                                   IS_NVFP4)
            if TWO:
                v_nxt, t_nxt = _load_w(v_rows, t_rows, mask_f, k0 + BLOCK_K, k_end, BLOCK_K,
                                       IS_NVFP4)
        else:
            w0, s0 = _load_w(w_rows, s_rows, mask_f, k0, k_end, BLOCK_K, IS_NVFP4)
            if TWO:
                v0, t0 = _load_w(v_rows, t_rows, mask_f, k0, k_end, BLOCK_K, IS_NVFP4)
        xa_nxt, xb_nxt = _load_x(x_rows, mask_x, k0 + BLOCK_K, k_end, BLOCK_K, IS_NVFP4)
        x_a = xa_cur
        x_b = xb_cur
        acc = _mac(acc, w0, s0, x_a, x_b, BLOCK_N, BLOCK_F, BLOCK_K, IS_NVFP4, USE_DOT,
                   SCALE_AFTER, GPU, ACC_FULL, SWAP)
        if TWO:
            acc2 = _mac(acc2, v0, t0, x_a, x_b, BLOCK_N, BLOCK_F, BLOCK_K, IS_NVFP4, USE_DOT,
                        SCALE_AFTER, GPU, ACC_FULL, SWAP)
        if PREFETCH:
            w0 = w_nxt
            s0 = s_nxt
            if TWO:
                v0 = v_nxt
                t0 = t_nxt
        xa_cur = xa_nxt
        xb_cur = xb_nxt
    if USE_DOT:
        acc = acc_final(acc, SWAP)
        acc2 = acc_final(acc2, SWAP)
    elif ACC_FULL:
        acc = tl.sum(tl.sum(acc, axis=3), axis=2)
        acc2 = tl.sum(tl.sum(acc2, axis=3), axis=2)
    else:
        acc = tl.sum(acc, axis=2)
        acc2 = tl.sum(acc2, axis=2)
    if IS_NVFP4 and not (SCALE_AFTER and not USE_DOT and not ACC_FULL):
        acc = acc * DEQUANT_UNSCALE  # exact: undoes dequant_tile's 2^-8
        acc2 = acc2 * DEQUANT_UNSCALE
    return acc, acc2


@triton.jit
def _mul_rn(a, b, GPU: tl.constexpr):
    """a * b rounded on its own (never contracted into an FMA with a following add), as
    torch's separate multiply: `__fmul_rn` on the GPU; numpy never contracts."""
    if GPU:
        return tl.extra.cuda.libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def _arrive(cnt_ptr, idx):
    """Count this program's arrival on counter `idx` (acq_rel, GPU scope) after a barrier
    that orders every thread's workspace stores before it. Returns the count before."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + idx, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _slot_expert(logits_ptr, bias_ptr, ids_in_ptr, wts_ptr, ids_ptr, slot, write, N, E,
                 IDS_STRIDE, scaling, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
                 ROUTE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Expert dedupe of routed slot `slot` = (token slot // K, choice slot % K).

    Reads (ROUTE: computes, `_route`) the ids of all N tokens on a [BLOCK_T >= N, K] tile;
    the slot owns its expert e iff no earlier slot chose e, and the owner computes e for
    every token that chose it. With ROUTE and `write`, stores the slot's routing weight
    and id. Returns (e int32, skip (not the owner), tok [BLOCK_N] (tokens that chose e),
    kpos [BLOCK_N] (their choice index)); BLOCK_N (the GEMV's token tile, 16 for the
    tensor cores) may exceed BLOCK_T, which keeps the routing tile (and its registers)
    at the real batch."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, TOPK_PAD)
    valid = (offs_t < N)[:, None] & (offs_k < TOP_K)[None, :]
    if ROUTE:
        sel, wts = _route(logits_ptr, bias_ptr, N, E, scaling, offs_t, offs_k, BLOCK_E,
                          TOP_K, LIBDEVICE)
    else:
        sel = tl.load(ids_in_ptr + offs_t[:, None] * IDS_STRIDE + offs_k[None, :], mask=valid,
                      other=0).to(tl.int32)
    flat = offs_t[:, None] * TOP_K + offs_k[None, :]
    me = (flat == slot) & valid
    e = tl.sum(tl.where(me, sel, 0))
    if ROUTE:
        if write:
            tl.store(wts_ptr + slot, tl.sum(tl.where(me, wts, 0.0)))
            tl.store(ids_ptr + slot, e.to(tl.int64))
    same = (sel == e) & valid
    skip = tl.sum(tl.where(same & (flat < slot), 1, 0)) > 0
    kpos1 = tl.sum(tl.where(same, offs_k[None, :] + 1, 0), axis=1)  # choice + 1, or 0 [BLOCK_T]
    offs_n = tl.arange(0, BLOCK_N)  # widen [BLOCK_T] -> [BLOCK_N] (rows past BLOCK_T: 0)
    kpos1 = tl.sum(tl.where(offs_n[:, None] == offs_t[None, :], kpos1[None, :], 0), axis=1)
    return e, skip, kpos1 > 0, kpos1 - 1


# ----------------------------------------------------------------------------- kernel 6
@triton.jit
def gate_up_kernel(
    x_ptr,  # bf16 [N, H]
    logits_ptr, bias_ptr,  # ROUTE: fp32 [N, E], fp32 [E]
    ids_in_ptr,  # not ROUTE: int64 [N, K] (rows IDS_STRIDE apart)
    g_ptr, g_s_ptr, g_gs_ptr,  # gate: bf16 [E, F, H] | NVFP4 codes [E, F, H/2], scales, gscale
    u_ptr, u_s_ptr, u_gs_ptr,  # up: same
    sg_ptr, sg_s_ptr, sg_gs_ptr,  # shared gate: [F, H] | NVFP4, gscale []
    su_ptr, su_s_ptr, su_gs_ptr,  # shared up
    h_ptr,  # out: bf16 [N, K + HAS_SHARED, F]
    wts_ptr, ids_ptr,  # out (ROUTE): fp32 [N, K], int64 [N, K]
    ws_ptr,  # SPLIT > 1: fp32 workspace [SPLIT, 2, N, K + HAS_SHARED, F]
    cnt_ptr,  # SPLIT > 1: int32 counters, zero on entry and on exit
    N, E, F, H,
    GS_STRIDE,  # 1: routed global scales [E]; 0: one scalar
    IDS_STRIDE, scaling, K_PER_SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr, SPLIT: tl.constexpr,
    ROUTE: tl.constexpr,
    HAS_SHARED: tl.constexpr, IS_NVFP4: tl.constexpr, USE_DOT: tl.constexpr,
    SCALE_AFTER: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
    ACC_FULL: tl.constexpr,
    GPU: tl.constexpr,
    FLAT: tl.constexpr = False,  # tensor cores with 2-D tiles (`_expert_gemv_flat`)
    SWAP: tl.constexpr = False,  # tensor cores: weight tile as the dot's left operand
):
    # Program (f block, slot, split): slot < N*K is (token, choice), slot N*K the shared
    # expert; columns [pid_k * K_PER_SPLIT, ...) of H. Non-owner slots exit after writing
    # their routing outputs; with SPLIT > 1 the last-arriving split of a (slot, f block)
    # sums the fp32 partials in split order and runs the epilogue.
    pid_f = tl.program_id(0)
    slot = tl.program_id(1)
    pid_k = tl.program_id(2)
    NK = N * TOP_K
    SLOTS: tl.constexpr = TOP_K + HAS_SHARED
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = offs_f < F
    offs_n = tl.arange(0, BLOCK_N)
    KW = H // 2 if IS_NVFP4 else H  # stored row length
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(H, k_start + K_PER_SPLIT)
    n_iters = tl.cdiv(k_end - k_start, BLOCK_K)
    if slot == NK:  # the shared expert: known before the previous kernel ends
        gw = sg_ptr + offs_f.to(tl.int64) * KW
        gs = sg_s_ptr + offs_f.to(tl.int64) * (H // 16)
        uw = su_ptr + offs_f.to(tl.int64) * KW
        us = su_s_ptr + offs_f.to(tl.int64) * (H // 16)
        if PREFETCH:
            g0, gs0 = _load_w(gw, gs, mask_f, k_start, k_end, BLOCK_K, IS_NVFP4)
            u0, us0 = _load_w(uw, us, mask_f, k_start, k_end, BLOCK_K, IS_NVFP4)
        else:
            g0, gs0 = _load_w(gw, gs, mask_f, k_start, k_start, BLOCK_K, IS_NVFP4)  # no-op
            u0, us0 = g0, gs0
        if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
            tl.extra.cuda.gdc_launch_dependents()
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        tok = offs_n < N
        kpos = tl.full((BLOCK_N,), TOP_K, tl.int32)
        skip = slot != NK  # False
        g_gscale = 1.0
        u_gscale = 1.0
        if IS_NVFP4:
            g_gscale = tl.load(sg_gs_ptr)
            u_gscale = tl.load(su_gs_ptr)
    else:
        if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
            tl.extra.cuda.gdc_launch_dependents()
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # logits / ids come from the previous kernel
        e, skip, tok, kpos = _slot_expert(logits_ptr, bias_ptr, ids_in_ptr, wts_ptr, ids_ptr,
                                          slot, (pid_f == 0) & (pid_k == 0), N, E, IDS_STRIDE,
                                          scaling, BLOCK_N, BLOCK_T, BLOCK_E, TOP_K, TOPK_PAD,
                                          ROUTE, GPU)
        e64 = e.to(tl.int64)
        rows = e64 * F + offs_f.to(tl.int64)
        gw = g_ptr + rows * KW
        uw = u_ptr + rows * KW
        gs = g_s_ptr + rows * (H // 16)
        us = u_s_ptr + rows * (H // 16)
        mask_f = offs_f < tl.where(skip, 0, F)  # non-owners load nothing
        if PREFETCH:
            g0, gs0 = _load_w(gw, gs, mask_f, k_start, k_end, BLOCK_K, IS_NVFP4)
            u0, us0 = _load_w(uw, us, mask_f, k_start, k_end, BLOCK_K, IS_NVFP4)
        else:
            g0, gs0 = _load_w(gw, gs, mask_f, k_start, k_start, BLOCK_K, IS_NVFP4)  # no-op
            u0, us0 = g0, gs0
        g_gscale = 1.0
        u_gscale = 1.0
        if IS_NVFP4:
            g_gscale = tl.load(g_gs_ptr + e64 * GS_STRIDE)
            u_gscale = tl.load(u_gs_ptr + e64 * GS_STRIDE)
    if skip:
        return  # an earlier slot computes this expert for every token that chose it

    x_rows = x_ptr + offs_n.to(tl.int64) * H
    if FLAT:
        acc_g, acc_u = _expert_gemv_flat(gw, gs, uw, us, mask_f, x_rows, tok, k_start, k_end,
                                         n_iters, BLOCK_N, BLOCK_F, BLOCK_K, IS_NVFP4, True, GPU,
                                         SWAP)
    else:
        acc_g, acc_u = _expert_gemv(gw, gs, uw, us, g0, gs0, u0, us0, mask_f, x_rows, tok,
                                    k_start, k_end, n_iters, BLOCK_N, BLOCK_F, BLOCK_K, IS_NVFP4,
                                    True, USE_DOT, SCALE_AFTER, GPU, PREFETCH, ACC_FULL, SWAP)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()
    row = offs_n[:, None] * SLOTS + kpos[:, None]  # h[n, kpos[n], :], [BLOCK_N, 1]
    mask = tok[:, None] & mask_f[None, :]
    if SPLIT > 1:
        part = (row * F + offs_f[None, :]).to(tl.int64)
        plane = N * SLOTS * F  # one [N, SLOTS, F] plane of the workspace
        tl.store(ws_ptr + (pid_k * 2) * plane + part, acc_g, mask=mask)
        tl.store(ws_ptr + (pid_k * 2 + 1) * plane + part, acc_u, mask=mask)
        counter = slot * tl.num_programs(0) + pid_f
        arrived = _arrive(cnt_ptr, counter)
        if arrived == SPLIT - 1:  # the last split: sum all partials in split order
            acc_g = tl.zeros((BLOCK_N, BLOCK_F), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_F), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                # .cg: through L2 (L1 is not coherent with the other SMs' stores)
                acc_g += tl.load(ws_ptr + (2 * s) * plane + part, mask=mask, other=0.0,
                                 cache_modifier=".cg")
                acc_u += tl.load(ws_ptr + (2 * s + 1) * plane + part, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + counter, 0)  # zero again for the next launch
            g = _bf16_value(acc_g * g_gscale)  # g rounded to bf16 (reference)
            u = _bf16_value(acc_u * u_gscale)  # u rounded to bf16
            hv = g * _sigmoid(g, GPU) * u  # silu_mul in fp32: (g * sigmoid(g)) * u
            tl.store(h_ptr + row * F + offs_f[None, :], _round_to_bf16(hv), mask=mask)
    else:
        g = _bf16_value(acc_g * g_gscale)
        u = _bf16_value(acc_u * u_gscale)
        hv = g * _sigmoid(g, GPU) * u
        tl.store(h_ptr + row * F + offs_f[None, :], _round_to_bf16(hv), mask=mask)


# ----------------------------------------------------------------------------- kernel 7
@triton.jit
def down_kernel(
    h_ptr,  # bf16 [N, K + HAS_SHARED, F]
    ids_ptr,  # int64 [N, K] (rows IDS_STRIDE apart)
    wts_ptr,  # fp32 [N, K] (rows WTS_STRIDE apart)
    d_ptr, d_s_ptr, d_gs_ptr,  # down: bf16 [E, H, F] | NVFP4 codes [E, H, F/2], scales, gscale
    sd_ptr, sd_s_ptr, sd_gs_ptr,  # shared down: [H, F] | NVFP4
    res_ptr,  # bf16 [N, H] (HAS_RESIDUAL)
    out_ptr,  # out: bf16 [N, H]
    ws_ptr,  # fp32 workspace [SPLIT, N, K + HAS_SHARED, H]
    cnt_ptr,  # int32 counters (one per H block), zero on entry and on exit
    N, F, H,
    GS_STRIDE, IDS_STRIDE, WTS_STRIDE, K_PER_SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr, SPLIT: tl.constexpr,
    HAS_SHARED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, IS_NVFP4: tl.constexpr,
    USE_DOT: tl.constexpr, SCALE_AFTER: tl.constexpr, PREFETCH: tl.constexpr,
    ACC_FULL: tl.constexpr,
    USE_PDL: tl.constexpr, GPU: tl.constexpr,
    FLAT: tl.constexpr = False,  # tensor cores with 2-D tiles (`_expert_gemv_flat`)
    SWAP: tl.constexpr = False,  # tensor cores: weight tile as the dot's left operand
    STAGE_W: tl.constexpr = True,  # weight row pointers built after the if / else (see there)
):
    # Program (h block, slot, split): the owner of a distinct expert (or the shared
    # expert) computes its down GEMV for rows [pid_h * BLOCK_H, ...) over columns
    # [pid_k * K_PER_SPLIT, ...) of F, for all its tokens, and writes the fp32 partial to
    # the workspace; every program (owner or not) then counts itself on the h block's
    # counter, and the last of the (slots x SPLIT) arrivals runs the combine in the
    # reference's order and the residual add.
    pid_h = tl.program_id(0)
    slot = tl.program_id(1)
    pid_k = tl.program_id(2)
    NK = N * TOP_K
    SLOTS: tl.constexpr = TOP_K + HAS_SHARED
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    KW = F // 2 if IS_NVFP4 else F
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(F, k_start + K_PER_SPLIT)
    n_iters = tl.cdiv(k_end - k_start, BLOCK_K)
    if slot == NK:  # the shared expert (HAS_SHARED only): weights before the wait
        sw = sd_ptr + offs_h.to(tl.int64) * KW
        ss = sd_s_ptr + offs_h.to(tl.int64) * (F // 16)
        if PREFETCH:
            w0, s0 = _load_w(sw, ss, mask_h, k_start, k_end, BLOCK_K, IS_NVFP4)
        else:
            w0, s0 = _load_w(sw, ss, mask_h, k_start, k_start, BLOCK_K, IS_NVFP4)  # no-op
        if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
            tl.extra.cuda.gdc_launch_dependents()
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # h comes from the previous kernel
        tok = mask_n
        kpos = tl.full((BLOCK_N,), TOP_K, tl.int32)
        mask_w = mask_h
        row0 = (slot * 0).to(tl.int64)  # first weight row of the expert
        w_b, s_b = sw, ss
    else:
        if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
            tl.extra.cuda.gdc_launch_dependents()
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # h, ids, weights come from the previous kernel
        e, skip, tok, kpos = _slot_expert(ids_ptr, ids_ptr, ids_ptr, wts_ptr, ids_ptr, slot,
                                          False, N, 1, IDS_STRIDE, 0.0, BLOCK_N, BLOCK_T, 2,
                                          TOP_K, TOPK_PAD, False, GPU)
        row0 = e.to(tl.int64) * H
        mask_w = offs_h < tl.where(skip, 0, H)  # non-owners load nothing ...
        n_iters = tl.where(skip, 0, n_iters)  # ... and run no K step
        tok = tok & (kpos >= tl.where(skip, TOP_K, 0))  # ... and store nothing
        rw = d_ptr + (row0 + offs_h.to(tl.int64)) * KW
        rs = d_s_ptr + (row0 + offs_h.to(tl.int64)) * (F // 16)
        if PREFETCH:
            w0, s0 = _load_w(rw, rs, mask_w, k_start, k_end, BLOCK_K, IS_NVFP4)
        else:
            w0, s0 = _load_w(rw, rs, mask_w, k_start, k_start, BLOCK_K, IS_NVFP4)  # no-op
        w_b, s_b = rw, rs
    if STAGE_W:
        # The weight rows' pointers from a scalar row offset and a pointer select here: the
        # pipeliner then stages the weight tiles through shared memory (cp.async). With
        # the pointer tensors out of the if / else above (the else case), triton 3.6's
        # pipeliner leaves them to synchronous loads straight into registers (only x is
        # staged). Measured on the H200 (session 10, N = 8): bf16 staged 28.3 us against
        # 30.2; NVFP4 codes unstaged 32.9 us against 38.4 staged (the staged codes add a
        # shared-memory write and read to the decoded tile's round trip, and the NVFP4
        # loop is bound by shared memory). Triton 3.9 stages both forms. The NVFP4 number
        # predates the conflict-free code tiles (`tiles.load_code_tile`, session 10 run
        # 6), which made staged codes cheaper: worth measuring again.
        rows = row0 + offs_h.to(tl.int64)
        ww = tl.where(slot == NK, sd_ptr, d_ptr) + rows * KW
        ws_rows = tl.where(slot == NK, sd_s_ptr, d_s_ptr) + rows * (F // 16)
    else:
        ww, ws_rows = w_b, s_b

    x_rows = h_ptr + (offs_n.to(tl.int64) * SLOTS + kpos) * F  # h[n, kpos[n], :]
    if FLAT:
        acc, _ = _expert_gemv_flat(ww, ws_rows, ww, ws_rows, mask_w, x_rows, tok, k_start,
                                   k_end, n_iters, BLOCK_N, BLOCK_H, BLOCK_K, IS_NVFP4, False, GPU,
                                   SWAP)
    else:
        acc, _ = _expert_gemv(ww, ws_rows, ww, ws_rows, w0, s0, w0, s0, mask_w, x_rows, tok,
                              k_start, k_end, n_iters, BLOCK_N, BLOCK_H, BLOCK_K, IS_NVFP4, False,
                              USE_DOT, SCALE_AFTER, GPU, PREFETCH, ACC_FULL, SWAP)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()
    plane = N * SLOTS * H  # one [N, SLOTS, H] plane of the workspace
    row = offs_n[:, None] * SLOTS + kpos[:, None]
    tl.store(ws_ptr + pid_k * plane + (row * H + offs_h[None, :]).to(tl.int64), acc,
             mask=tok[:, None] & mask_h[None, :])
    arrived = _arrive(cnt_ptr, pid_h)
    if arrived == tl.num_programs(1) * SPLIT - 1:
        # The last arrival: y_k = bf16(sum over splits * global scale) for each (n, k),
        # m = sum_k w_k * y_k in k order (0 + p_0 is exact, as torch's sum), + y_shared,
        # one rounding; then the residual add.
        tl.atomic_xchg(cnt_ptr + pid_h, 0)  # zero again for the next launch
        mask = mask_n[:, None] & mask_h[None, :]
        m = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
        for k in tl.static_range(SLOTS):
            y = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
            off = ((offs_n[:, None] * SLOTS + k) * H + offs_h[None, :]).to(tl.int64)
            for s in tl.static_range(SPLIT):
                y += tl.load(ws_ptr + s * plane + off, mask=mask, other=0.0,
                             cache_modifier=".cg")
            if k < TOP_K:
                if IS_NVFP4:
                    e_k = tl.load(ids_ptr + offs_n * IDS_STRIDE + k, mask=mask_n, other=0)
                    y = y * tl.load(d_gs_ptr + e_k * GS_STRIDE, mask=mask_n, other=0.0)[:, None]
                w_k = tl.load(wts_ptr + offs_n * WTS_STRIDE + k, mask=mask_n, other=0.0)
                m = m + _mul_rn(w_k[:, None], _bf16_value(y), GPU)  # fp32 w * bf16(y)
            else:  # the shared expert, added after the routed sum
                if IS_NVFP4:
                    y = y * tl.load(sd_gs_ptr)
                m = m + _bf16_value(y)
        out_offs = offs_n[:, None] * H + offs_h[None, :]
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + out_offs, _round_to_bf16(r + _bf16_value(m)), mask=mask)
        else:
            tl.store(out_ptr + out_offs, _round_to_bf16(m), mask=mask)


# ----------------------------------------------------------------------------- launchers
def _err(op: str, name: str, what: str, t=None) -> ValueError:
    got = ""
    if isinstance(t, torch.Tensor):
        got = (f"; got dtype {t.dtype}, shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
               f"device {t.device}")
    elif t is not None:
        got = f"; got {type(t).__name__}"
    return ValueError(f"{op}: {name} must be {what}{got}")


def _check(op: str, name: str, t, dtype, shape, device) -> None:
    """Tensor of exactly `dtype`, `shape` (None entries: any), `device`, contiguous."""
    shape_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    what = f"a contiguous {dtype} tensor of shape {shape_s} on {device}"
    if not isinstance(t, torch.Tensor):
        raise _err(op, name, what, t)
    if (t.dtype != dtype or t.dim() != len(shape) or t.device != device
            or any(s is not None and s != d for s, d in zip(shape, t.shape))):
        raise _err(op, name, what, t)
    if not t.is_contiguous():
        raise _err(op, name, what + " (it is not contiguous)", t)


def _check_rows(op: str, name: str, t, dtype, rows: int, cols: int | None, device) -> None:
    """A [rows, cols] tensor whose rows may be strided (a slice) but whose columns are
    contiguous (stride 1), as the reference's top-k ids are."""
    what = f"a {dtype} tensor [{rows}, {'K' if cols is None else cols}] with unit column stride on {device}"
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 2 or t.shape[0] != rows \
            or (cols is not None and t.shape[1] != cols) or t.device != device:
        raise _err(op, name, what, t)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise _err(op, name, what, t)


def _weight(op: str, name: str, w, rows: int | None, cols: int, stacked: int | None, device):
    """Check a weight list and return (fmt_is_nvfp4, ptr args (3), rows, gs_stride).

    bf16: [w] with w bf16 [(E,) rows, cols]. NVFP4: [codes uint8 [(E,) rows, cols/2],
    scales float8_e4m3fn [(E,) rows, cols/16], global_scale fp32 [] or [E] (stacked)]."""
    if not isinstance(w, (list, tuple)) or len(w) not in (1, 3):
        raise _err(op, name, "a list [weight] (bf16) or [codes, scales, global_scale] (NVFP4)", w)
    lead = () if stacked is None else (stacked,)
    if len(w) == 1:
        t = w[0]
        if not isinstance(t, torch.Tensor) or t.dim() != len(lead) + 2:
            raise _err(op, f"{name}[0]", f"a bf16 tensor [{'E, ' if lead else ''}F, K]", t)
        rows = t.shape[-2] if rows is None else rows
        _check(op, f"{name}[0]", t, torch.bfloat16, (*lead, rows, cols), device)
        return False, (t, t, t), rows, 0
    codes, scales, gs = w
    if not isinstance(codes, torch.Tensor) or codes.dim() != len(lead) + 2:
        raise _err(op, f"{name}[0]", "NVFP4 codes uint8 [(E,) F, K/2]", codes)
    if cols % 64:
        raise _err(op, name, f"NVFP4 with a reduction length divisible by 64 (got {cols})")
    rows = codes.shape[-2] if rows is None else rows
    _check(op, f"{name}[0] (NVFP4 codes)", codes, torch.uint8, (*lead, rows, cols // 2), device)
    _check(op, f"{name}[1] (NVFP4 block scales)", scales, torch.float8_e4m3fn,
           (*lead, rows, cols // NVFP4_BLOCK), device)
    if not isinstance(gs, torch.Tensor) or gs.dim() not in ((0, 1) if lead else (0,)):
        raise _err(op, f"{name}[2] (NVFP4 global scale)",
                   "an fp32 scalar []" + (" or one per expert [E]" if lead else ""), gs)
    _check(op, f"{name}[2] (NVFP4 global scale)", gs, torch.float32,
           tuple(lead[: gs.dim()]), device)
    return True, (codes, scales, gs), rows, (1 if gs.dim() == 1 else 0)


def _on_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def _launch_opts(use_pdl: bool, device: torch.device) -> tuple[bool, dict]:
    pdl = bool(use_pdl) and _on_gpu(device) and not interpreting()
    return pdl, ({"launch_pdl": True} if pdl else {})


def _native(device: torch.device) -> bool:
    """Compiled GPU code (bf16 tensor-core dots, libdevice): not the interpreter."""
    return _on_gpu(device) and not interpreting()


def _reference(name: str):

    return getattr(torch.ops.flintc, name)


def _block_n(N: int, cfg: MoeConfig) -> int:
    """Token tile: 16 (tl.dot's smallest size; <= 8 tokens padded, which costs tensor-core
    cycles only) for the tensor-core reduction, else the next power of two >= N."""
    return 16 if cfg.use_dot else triton.next_power_of_2(N)


def _route_consts(E: int, top_k: int) -> dict:
    return {"BLOCK_E": triton.next_power_of_2(E), "TOP_K": top_k,
            "TOPK_PAD": triton.next_power_of_2(max(top_k, 2))}


def _router(op: str, x2: torch.Tensor, norm, router: torch.Tensor, eps: float, use_pdl: bool):
    """Shared launcher body of norm_router / moe_route's GEMV. x2: bf16 [N, H]."""
    N, H = x2.shape
    dev = x2.device
    if not isinstance(router, torch.Tensor) or router.dim() != 2:
        raise _err(op, "router", "a bf16 tensor [E, H]", router)
    E = router.shape[0]
    _check(op, "router", router, torch.bfloat16, (E, H), dev)
    logits = torch.empty((N, E), dtype=torch.float32, device=dev)
    h = torch.empty((N, H), dtype=torch.bfloat16, device=dev) if norm is not None else logits
    native = _native(dev)
    block_e = 2 if native else 16
    block_k = min(512 if native else 64, triton.next_power_of_2(H))
    pdl, opts = _launch_opts(use_pdl, dev)
    norm_router_kernel[(triton.cdiv(E, block_e),)](
        x2, norm if norm is not None else x2, router, h, logits, N, E, H, float(eps),
        BLOCK_N=triton.next_power_of_2(N), BLOCK_E=block_e, BLOCK_K=block_k,
        APPLY_NORM=norm is not None, USE_PDL=pdl_mode(pdl), LIBDEVICE=native,
        NUM_K=triton.cdiv(H, block_k), num_warps=4, **opts)
    return h, logits


def norm_router(x: torch.Tensor, norm: torch.Tensor, router: torch.Tensor, eps: float, *,
                use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`flintc::norm_router` (kernel 5): post-attention RMSNorm and the router GEMV, one launch.

    Args:
        x: bf16 [..., H], contiguous, N = x.numel() / H tokens.
        norm: fp32 [H] RMSNorm weight.
        router: bf16 [E, H] (both checkpoint formats keep the router in bf16).
        eps: RMSNorm epsilon.
        use_pdl: programmatic dependent launch (CUDA only): the router rows stream in while
            the previous kernel (which writes x) finishes.

    Returns:
        (normed x bf16 [N, H], `bf16(x * rsqrt(mean(x^2) + eps) * norm)`; logits fp32
        [N, E] = normed x @ router^T with fp32 accumulation). Formulas: FLINT_SPEC 2/3.

    Numerics: normed x within one bf16 ulp of the reference (sum-of-squares order, rsqrt);
    logits within a few fp32 ulps (dot order). N > 8 runs the reference op. On CUDA sm_90+
    (`_mma_router_applies`) the CUDA mma kernel `nvfp4_mma.mma_norm_router` runs, else the
    Triton kernel.

    Raises:
        ValueError: a dtype, shape, device or contiguity mismatch (names the argument).
    """
    op = "norm_router"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() < 1:
        raise _err(op, "x", "a bf16 tensor [..., H]", x)
    if not x.is_contiguous():
        raise _err(op, "x", "contiguous", x)
    H = x.shape[-1]
    N = x.numel() // max(H, 1)
    _check(op, "norm", norm, torch.float32, (H,), x.device)
    if not (1 <= N <= MAX_N):
        return _reference(op)(x, norm, router, eps)
    x2 = x.view(N, H)
    if _mma_router_applies(x2, router):
        from flintc.kernels import nvfp4_mma

        return nvfp4_mma.mma_norm_router(x2, norm, router, eps, use_pdl=use_pdl)
    return _router(op, x2, norm, router, eps, use_pdl)


def _mma_router_applies(x2: torch.Tensor, router) -> bool:
    """Whether `norm_router` runs on the CUDA mma kernel (`nvfp4_mma.mma_norm_router`):
    `nvfp4_mma.available` on x's device (sm_90+, NVRTC, FLINTC_NVFP4_MMA not 0), outside
    the interpreter, a contiguous 16-byte aligned bf16 router [E, H] with H % 64 == 0 and
    E % 16 == 0, x 16-byte aligned. Otherwise the Triton kernel runs."""
    from flintc.kernels import nvfp4_mma

    N, H = x2.shape
    if interpreting() or x2.device.type != "cuda" or not isinstance(router, torch.Tensor) \
            or router.dim() != 2 or router.shape[1] != H or router.dtype != torch.bfloat16 \
            or not router.is_contiguous() or router.data_ptr() % 16 or x2.data_ptr() % 16 \
            or router.device != x2.device:
        return False
    return (nvfp4_mma.router_launch_config(H, router.shape[0]) is not None
            and nvfp4_mma.available(x2.device))


TOPK_ROWS_BLOCK_N = 16  # tokens per program of `route_topk_rows` ([16, 256] int64 keys)


def route_topk_rows(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """Steps 2-4 of the MoE router for any number of tokens in one launch (a prefill
    chunk's `moe_route` after its router GEMM), as `flintc.model.ops.select_topk`: sigmoid
    scores, the top-k of `scores + bias` with ties to the lower expert index, weights
    `scores[sel] / sum * scaling`. Replaces select_topk's stable sort of all E keys per
    token and its elementwise launches by K max-reductions per token over packed int64
    keys (`_route`, in `topk_kernel` over blocks of TOPK_ROWS_BLOCK_N tokens).

    logits: fp32 [N, E] contiguous; bias: fp32 [E]. Returns (weights fp32 [N, K], ids
    int64 [N, K]). Numerics as the decode top-k: the sigmoid is Triton's (its exp on
    CUDA), so ids equal the reference's except at ulp-level near-ties of `scores + bias`,
    weights within a few fp32 ulps. Raises ValueError on a bad argument (named).
    """
    op = "route_topk_rows"
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.dim() != 2 \
            or not logits.is_contiguous():
        raise _err(op, "logits", "a contiguous fp32 tensor [N, E]", logits)
    N, E = logits.shape
    dev = logits.device
    _check(op, "bias", bias, torch.float32, (E,), dev)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise _err(op, "top_k", f"an int in [1, E={E}] (got {top_k!r})")
    wts = torch.empty((N, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((N, top_k), dtype=torch.int64, device=dev)
    if N == 0:
        return wts, ids
    topk_kernel[(triton.cdiv(N, TOPK_ROWS_BLOCK_N),)](
        logits, bias, wts, ids, N, E, float(scaling), BLOCK_N=TOPK_ROWS_BLOCK_N,
        **_route_consts(E, top_k), USE_PDL=0, LIBDEVICE=_native(dev),
        **({"num_warps": 4} if _native(dev) else {}))
    return wts, ids


def moe_route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int,
              scaling: float, *, use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`flintc::moe_route`: router GEMV then top-k (two launches: `norm_router_kernel`
    without its norm, then `topk_kernel`; the top-k needs all E logits of a token).

    x: bf16 [N, H]; router: bf16 [E, H]; bias: fp32 [E]. Returns (weights fp32 [N, K],
    ids int64 [N, K]) as `flintc.model.ops.route_topk`. Numerics: see the module doc (ids
    exact barring ulp-level near-ties; weights to a few fp32 ulps). N > 8 runs the
    reference op. Raises ValueError on a bad argument (named).
    """
    op = "moe_route"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise _err(op, "x", "a bf16 tensor [N, H]", x)
    if not x.is_contiguous():
        raise _err(op, "x", "contiguous", x)
    N = x.shape[0]
    if not (1 <= N <= MAX_N):
        return _reference(op)(x, router, bias, top_k, scaling)
    _, logits = _router(op, x, None, router, 0.0, use_pdl)
    return _topk(op, logits, bias, top_k, scaling, use_pdl)


def _topk(op, logits, bias, top_k, scaling, use_pdl):
    N, E = logits.shape
    dev = logits.device
    _check(op, "bias", bias, torch.float32, (E,), dev)
    if not (1 <= top_k <= E):
        raise _err(op, "top_k", f"in [1, E={E}] (got {top_k})")
    wts = torch.empty((N, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((N, top_k), dtype=torch.int64, device=dev)
    pdl, opts = _launch_opts(use_pdl, dev)
    topk_kernel[(1,)](logits, bias, wts, ids, N, E, float(scaling),
                      BLOCK_N=triton.next_power_of_2(N), **_route_consts(E, top_k),
                      USE_PDL=pdl_mode(pdl), LIBDEVICE=_native(dev), num_warps=4, **opts)
    return wts, ids


# ----------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Launch configuration of `gate_up_kernel` / `down_kernel`.

    `block_rows`: weight rows per program (BLOCK_F of gate/up, BLOCK_H of down; >= 16 with
    `use_dot`); `block_k`: reduction columns per step (multiple of 32); `split`: programs
    along the reduction (H for gate/up, F for down), capped so none is empty; `use_dot`:
    tensor-core reduction (tokens padded to 16) vs the FMA reduction; `scale_after`
    (NVFP4 + FMA): block scale applied once per 16-weight block; `prefetch`: register
    prefetch of the next tile (the shared expert's first tile goes out before the PDL
    wait) instead of Triton's pipeliner (`num_stages`); `acc_full` (FMA): accumulate the
    whole product tile and reduce once after the loop (`scale_after` then ignored);
    `flat` (use_dot): 2-D weight and activation tiles in K order staged by the pipeliner
    (`_expert_gemv_flat`; `prefetch` then ignored); `swap` (use_dot): the weight tile is
    the dot's left operand and the tokens its right one (`flintc.kernels.tiles.dot_2d`),
    so Hopper's wgmma may read the decoded NVFP4 tile from registers (block_rows >= 64
    for that; smaller tiles still compile, on mma.sync); `maxnreg` (GPU only): ptxas's
    register cap per thread (Triton's `maxnreg` compile option), e.g. 168 so that three
    4-warp programs fit on an SM (65,536 registers) where ptxas would take 188 (two: the
    NVFP4 gate/up kernel under triton 3.6, 22% faster capped); None leaves ptxas free.
    `stage_w` (down kernel, flat tiles; gate/up ignores it): build the weight-row pointers
    after the kernel's shared / routed expert branch, which lets triton 3.6's pipeliner
    stage the weight tiles through shared memory (`down_kernel`'s STAGE_W); None picks
    per format: bf16 staged (8-12% faster, docs/gpu-runs.md session 10 run 4), NVFP4 not
    (staged measured 17% slower there, before the code tiles lost their bank conflicts;
    the "stage" sweep family measures both)."""

    block_rows: int = 32
    block_k: int = 128
    split: int = 1
    use_dot: bool = True
    scale_after: bool = False
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False
    acc_full: bool = False
    flat: bool = False
    swap: bool = False
    maxnreg: int | None = None
    stage_w: bool | None = None

    def short(self) -> str:
        kind = "dot" if self.use_dot else ("fma-acc" if self.acc_full else
                                           "fma-sa" if self.scale_after else "fma")
        return (f"{kind} r{self.block_rows} k{self.block_k} s{self.split} w{self.num_warps} "
                f"st{self.num_stages}{' pf' if self.prefetch else ''}{' flat' if self.flat else ''}"
                f"{' swap' if self.swap else ''}{f' reg{self.maxnreg}' if self.maxnreg else ''}"
                f"{'' if self.stage_w is None else ' stw' if self.stage_w else ' nostw'}")


# Measured winners. Keys: (kernel, fmt, N) with kernel "gate_up" or "down", fmt "bf16" or
# "nvfp4", N the decode batch. Paste the `TUNED[...] = MoeConfig(...)` lines that
# `python benchmarks/bench_moe.py` prints after its sweep here; shapes not listed use
# the rule in `choose_config`. Entries: the sweep's winners on an H200 (N = 1 and 8:
# 2026-11-30 session 6 run 3, `bash scripts/gpu_tune.sh` with TUNE_MOE_FAMILY=classic
# TUNE_MOE_BATCHES=1,8; bf16: 2026-12-01 session 8 runs 4-5, `bench_moe.py --family flat`;
# docs/gpu-runs.md). NVFP4 at N = 1: the FMA path with the whole-tile accumulator won
# (gate/up 15.3 us, was 21.9; down 8.6, was 12.7; the flat twins took 21-39 / 10-17 us,
# again in session 9 run 1). bf16: the flat 2-D tiles won at every N (1, 2, 4, 8). NVFP4 at
# N = 4 and 8: flat 2-D tiles with 64 rows won (session 9 run 1, `bench_moe.py --family
# swap`, GPU-tested at N = 8); NVFP4 N = 2 uses the rule (the same tiles). The swapped
# dot (`MoeConfig.swap`) won nothing beyond noise.
TUNED: dict[tuple[str, str, int], MoeConfig] = {
    # bf16 N = 1 and 2: flat 2-D tiles (session 8 run 5), gate/up 12.9 us (FMA whole-tile
    # accumulator: 21.4) and 19.9 (43.5), down 8.5 (11.0) and 12.0 (22.0)
    ("gate_up", "bf16", 1): MoeConfig(block_rows=32, block_k=128, split=4, num_warps=4,
                                      num_stages=3, flat=True),
    ("down", "bf16", 1): MoeConfig(block_rows=32, block_k=128, split=1, num_warps=4,
                                   num_stages=4, flat=True),
    ("gate_up", "bf16", 2): MoeConfig(block_rows=32, block_k=128, split=2, num_warps=4,
                                      num_stages=3, flat=True),
    ("down", "bf16", 2): MoeConfig(block_rows=64, block_k=128, split=1, num_warps=4,
                                   num_stages=3, flat=True),
    # bf16 N = 4 and 8: flat 2-D tiles (session 8 run 4), gate/up 29.1 us (was 65.8) and
    # 50.5 (124.9), down 20.4 (37.0) and 30.3 (53.9): 59-83% of copy
    ("gate_up", "bf16", 4): MoeConfig(block_rows=32, block_k=128, split=1, num_warps=4,
                                      num_stages=3, flat=True),
    ("down", "bf16", 4): MoeConfig(block_rows=64, block_k=128, split=1, num_warps=4,
                                   num_stages=4, flat=True),
    ("gate_up", "bf16", 8): MoeConfig(block_rows=64, block_k=128, split=1, num_warps=4,
                                      num_stages=3, flat=True),
    ("down", "bf16", 8): MoeConfig(block_rows=64, block_k=128, split=1, num_warps=4,
                                   num_stages=3, flat=True),
    ("gate_up", "nvfp4", 1): MoeConfig(block_rows=32, block_k=128, split=4, use_dot=False,
                                       num_warps=4, num_stages=1, prefetch=True, acc_full=True),
    ("down", "nvfp4", 1): MoeConfig(block_rows=32, block_k=128, split=1, use_dot=False,
                                    num_warps=4, num_stages=1, prefetch=True, acc_full=True),
    # NVFP4 N = 4 / 8: flat 2-D tiles (session 9 run 1): gate/up 38.7 us (3-D tiles 53.2)
    # and 63.0 (93.9), down at N = 8 35.2 (49.6); with the scales one step ahead (run 7)
    # 36.9 / 59.1 and 33.1. Session 10 run 7, with the conflict-free code tiles
    # (`tiles.load_code_tile`): gate/up capped at 168 registers (three programs per SM;
    # ptxas takes 188 uncapped, two) 33.6 / 52.2 us (uncapped 43.1 / 67.4); down 30.4 at
    # N = 8 uncapped (a cap of 168 costs it 16%)
    ("gate_up", "nvfp4", 4): MoeConfig(block_rows=64, block_k=128, split=2, num_warps=4,
                                       num_stages=3, flat=True, maxnreg=168),
    ("gate_up", "nvfp4", 8): MoeConfig(block_rows=64, block_k=128, split=1, num_warps=4,
                                       num_stages=3, flat=True, maxnreg=168),
    ("down", "nvfp4", 8): MoeConfig(block_rows=64, block_k=128, split=1, num_warps=4,
                                    num_stages=3, flat=True),
    # NVFP4 down at N = 4 with its weight tiles staged (`stage_w`; session 11 run 3, the
    # "stage" family): 18.9 us against 20.5 unstaged; at N = 8 unstaged stays ahead (30.2
    # against 32.4)
    ("down", "nvfp4", 4): MoeConfig(block_rows=64, block_k=128, split=1, num_warps=4,
                                    num_stages=3, flat=True, stage_w=True),
}


def auto_split(programs: int, red: int, block_k: int, device: torch.device,
               per_sm: int = 4, max_split: int = 8) -> int:
    """Split of the reduction (length `red`) so that `programs` (programs per split) x
    split reaches about `per_sm` programs per SM, each split keeping >= 2 BLOCK_K steps
    where the length allows."""
    target = per_sm * sm_count(device)
    steps = max(1, triton.cdiv(red, block_k) // 2)
    return max(1, min(target // max(programs, 1), steps, max_split))


def choose_config(kernel: str, fmt: str, N: int, rows: int, red: int, slots: int,
                  device: torch.device) -> MoeConfig:
    """On CUDA: FLINTC_MOE_TUNED's file, then `TUNED[(kernel, fmt, N)]`, if the sweep
    measured it, else a rule. In the interpreter (not CUDA, or TRITON_INTERPRET=1): small
    tiles, whatever TUNED says (unlike `flintc.kernels.gemv.choose_config`).

    Rule (CUDA, pairs the sweep has not measured): tensor-core reduction over flat 2-D
    tiles, 64 weight rows per program, 128-column steps, 4 warps, 3 stages, both formats
    (the sweeps' winners: bf16 at N = 4 and 8, NVFP4 at N = 4 and 8, session 9 run 1), the
    NVFP4 gate/up kernel capped at 168 registers (its N = 4 / 8 winners, session 10); split
    of the reduction up to ~4 programs per SM counting one program per (slot, row block)
    (slots = N*K + 1 is an upper bound on the distinct experts)."""
    if device.type != "cuda" or interpreting():  # interpreter: fewest programs and steps
        return MoeConfig(block_rows=min(128, max(16, triton.next_power_of_2(rows))),
                         block_k=min(128, max(32, triton.next_power_of_2(red))), split=1,
                         num_stages=1)
    # measured at the full model's shapes; FLINTC_MOE_TUNED's file (flintc.kernels.tuning,
    # written by `bench_moe.py --tuned-json`) first
    hit = overrides("FLINTC_MOE_TUNED", MoeConfig, (str, str, int)).get((kernel, fmt, N))
    if hit is None:
        hit = TUNED.get((kernel, fmt, N))
    if hit is not None:
        return hit
    # flat 2-D tiles won every bf16 sweep at N = 4 and 8 (59-83% of copy) and the NVFP4
    # ones at N = 4 and 8 (gate/up 38.7 / 63.0 us against 53.2 / 93.9 on 3-D tiles); the
    # NVFP4 gate/up kernel capped at 168 registers as its N = 4 / 8 entries (session 10)
    split = auto_split(slots * triton.cdiv(rows, 64), red, 128, device)
    cap = 168 if (kernel, fmt) == ("gate_up", "nvfp4") else None
    return MoeConfig(block_rows=64, block_k=128, split=split, use_dot=True, num_warps=4,
                     num_stages=3, flat=True, maxnreg=cap)


def one_step_configs(kernel: str, fmt: str, N: int, rows: int, red: int, slots: int,
                     device: torch.device, max_tile_bytes: int = 36864) -> list[MoeConfig]:
    """Candidates whose programs make one reduction step (`block_k == red / split`), with
    the register prefetch, so each program issues all its weight loads at once (as
    `flintc.kernels.gemv.one_step_configs`): 4-36 KB of weights per program (gate and up
    tiles counted together; 8 warps above 16 KB), at least half an SM's worth of programs
    counting `slots` experts."""
    wbytes = 0.5 + 1 / 16 if fmt == "nvfp4" else 2.0
    mats = 2 if kernel == "gate_up" else 1
    out: list[MoeConfig] = []
    for bk in (2048, 1024, 512, 256, 128):
        if red % bk:
            continue
        split = red // bk
        for br in (16, 32, 64):
            tile = mats * br * bk * wbytes
            if tile > max_tile_bytes or tile < 4096 or br > rows:
                continue
            if slots * triton.cdiv(rows, br) * split < sm_count(device) // 2:
                continue
            for use_dot in (True, False):
                cfg = MoeConfig(block_rows=br, block_k=bk, split=split, use_dot=use_dot,
                                scale_after=False, num_warps=8 if tile > 16384 else 4,
                                num_stages=1, prefetch=True)
                if cfg not in out:
                    out.append(cfg)
    return out


# FMA + whole-tile accumulator candidates of `sweep_configs` (block_rows, block_k, warps)
ACC_FULL_SHAPES = [(16, 128, 4), (32, 128, 4), (16, 256, 4), (32, 256, 8)]


# (block_rows, block_k, num_warps, num_stages, flat, prefetch) of the "swap" sweep family:
# 64-row tiles (one warpgroup's wgmma M) and 128-row ones, 3-D tiles with the pipeliner
# or the register prefetch, 2-D tiles staged by the pipeliner.
SWAP_SHAPES = [(64, 128, 4, 3, False, False), (64, 128, 8, 3, False, False),
               (64, 128, 4, 1, False, True), (64, 128, 4, 3, True, False),
               (64, 256, 4, 3, True, False), (128, 128, 8, 3, True, False)]


# (block_rows, block_k, num_warps, num_stages) of the "maxnreg" sweep family (flat tiles)
# and its register caps per thread (None: ptxas's choice; 168 and 128 fit three and four
# programs of 4 warps on an SM, 65,536 registers; triton 3.6 gives the NVFP4 gate/up
# kernel 168 registers uncapped)
MAXNREG_SHAPES = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 8, 3), (32, 128, 4, 3)]
MAXNREG_CAPS = (None, 168, 128)


SWEEP_FAMILIES = ("all", "classic", "one-step", "flat", "swap", "maxnreg", "stage")


def sweep_configs(kernel: str, fmt: str, N: int, rows: int, red: int, slots: int,
                  device: torch.device, family: str = "all") -> list[MoeConfig]:
    """Candidates that `benchmarks/bench_moe.py` times (the `gpu` test checks each one
    for correctness): the rule's choice first, then other tile shapes, pipelining modes,
    the FMA reduction (NVFP4: with the per-block scale) and other splits; `family`
    "one-step" gives the rule's choice and `one_step_configs` only, "classic" leaves
    those out, "all" (default) has both; each classic tensor-core shape also comes as a
    `flat` twin (3 and 4 stages), and "flat" gives the rule's choice and those twins only;
    "swap" gives the rule's choice and `SWAP_SHAPES` with the weight tile as the dot's
    left operand (`MoeConfig.swap`), each flat one also without it; "maxnreg" gives the
    rule's choice with each register cap of `MAXNREG_CAPS` (`MoeConfig.maxnreg`), then
    `MAXNREG_SHAPES` as flat tiles with each cap; "stage" gives the rule's choice, and for
    the down kernel its flat twin with the weight tiles staged and unstaged
    (`MoeConfig.stage_w`).

    Raises:
        ValueError: an unknown family.
    """
    if family not in SWEEP_FAMILIES:
        raise ValueError(f"sweep_configs: family must be one of {', '.join(SWEEP_FAMILIES)}; "
                         f"got {family!r}")
    if family == "stage":
        base = choose_config(kernel, fmt, N, rows, red, slots, device)
        out = [base]
        if kernel == "down":
            flat = dataclasses.replace(base, use_dot=True, flat=True, acc_full=False,
                                       prefetch=False, scale_after=False)
            out += [c for c in (dataclasses.replace(flat, stage_w=v) for v in (True, False))
                    if c not in out]
        return out
    if family == "maxnreg":
        base = choose_config(kernel, fmt, N, rows, red, slots, device)
        out = [dataclasses.replace(base, maxnreg=r) for r in MAXNREG_CAPS]
        for br, bk, nw, st in MAXNREG_SHAPES:
            split = auto_split(slots * triton.cdiv(rows, br), red, bk, device)
            out += [c for c in (MoeConfig(block_rows=br, block_k=bk, split=split, use_dot=True,
                                          num_warps=nw, num_stages=st, flat=True, maxnreg=r)
                                for r in MAXNREG_CAPS) if c not in out]
        return out
    if family == "swap":
        out = [choose_config(kernel, fmt, N, rows, red, slots, device)]
        for br, bk, nw, st, flat, pf in SWAP_SHAPES:
            split = auto_split(slots * triton.cdiv(rows, br), red, bk, device)
            for swap in ((True, False) if flat else (True,)):
                cfg = MoeConfig(block_rows=br, block_k=bk, split=split, use_dot=True,
                                num_warps=nw, num_stages=st, prefetch=pf, flat=flat, swap=swap)
                if cfg not in out:
                    out.append(cfg)
        return out
    if family == "flat":
        base = choose_config(kernel, fmt, N, rows, red, slots, device)
        twins = [c for c in sweep_configs(kernel, fmt, N, rows, red, slots, device, "classic")
                 if c.flat and c != base]
        return [base] + twins
    base = choose_config(kernel, fmt, N, rows, red, slots, device)
    one = one_step_configs(kernel, fmt, N, rows, red, slots, device) if family != "classic" else []
    if family == "one-step":
        return [base] + [c for c in one if c != base]
    if fmt == "nvfp4":
        shapes = [(True, 64, 128, 8, 3, False, False), (True, 16, 128, 4, 4, False, False),
                  (True, 16, 256, 4, 1, True, False), (False, 16, 128, 4, 1, True, True),
                  (False, 16, 128, 4, 3, False, True)]
    else:
        shapes = [(True, 64, 128, 4, 3, False, False), (True, 32, 256, 4, 2, False, False),
                  (True, 16, 128, 4, 4, False, False), (True, 32, 128, 4, 1, True, False),
                  (False, 16, 128, 4, 3, False, False)]
    out = [base]
    for br, bk, nw in ACC_FULL_SHAPES:  # FMA + whole-tile accumulator, <= 64 registers
        if triton.next_power_of_2(N) * br * bk * (2 if kernel == "gate_up" else 1) > 8192 * nw // 4:
            continue
        split = auto_split(slots * triton.cdiv(rows, br), red, bk, device)
        cfg = MoeConfig(block_rows=br, block_k=bk, split=split, use_dot=False, num_warps=nw,
                        num_stages=1, prefetch=True, acc_full=True)
        if cfg not in out:
            out.append(cfg)
    for use_dot, br, bk, nw, st, pf, sa in shapes:
        split = auto_split(slots * triton.cdiv(rows, br), red, bk, device)
        cfg = MoeConfig(block_rows=br, block_k=bk, split=split, use_dot=use_dot,
                        scale_after=sa, num_warps=nw, num_stages=st, prefetch=pf)
        if cfg not in out:
            out.append(cfg)
        for st_flat in ((3, 4) if use_dot else ()):
            twin = MoeConfig(block_rows=br, block_k=bk, split=split, use_dot=True,
                             num_warps=nw, num_stages=st_flat, flat=True)
            if twin not in out:
                out.append(twin)
    alt = dataclasses.replace(base, split=max(1, base.split // 2) if base.split > 1 else 2)
    if alt not in out:
        out.append(alt)
    return out + [c for c in one if c not in out]


def _effective_split(red: int, block_k: int, split: int) -> tuple[int, int]:
    """(split, columns per split) with no empty split; columns a multiple of block_k.
    (gemv.py's `_effective_split`.)"""
    tiles = triton.cdiv(red, block_k)
    split = max(1, min(split, tiles))
    per = triton.cdiv(tiles, split) * block_k
    return triton.cdiv(red, per), per


def _check_config(op: str, cfg: MoeConfig) -> None:
    if not isinstance(cfg, MoeConfig):
        raise _err(op, "config", "a MoeConfig or None", cfg)
    if cfg.block_k % 32 or cfg.block_k < 32 or cfg.block_rows < (16 if cfg.use_dot else 1) \
            or cfg.block_rows & (cfg.block_rows - 1) or cfg.block_k & (cfg.block_k - 1) \
            or cfg.split < 1 or (cfg.maxnreg is not None and not 24 <= cfg.maxnreg <= 255):
        raise _err(op, "config", "block_k a power of two >= 32, block_rows a power of two "
                   f"(>= 16 with use_dot), split >= 1, maxnreg None or 24..255 (got {cfg})")


def _flat(cfg: MoeConfig) -> bool:
    """`cfg.flat` where it applies: the tensor-core reduction."""
    return cfg.flat and cfg.use_dot


def _kernel_opts(cfg: MoeConfig, gpu: bool) -> dict:
    opts = {"num_warps": cfg.num_warps}
    if gpu:
        opts["num_stages"] = cfg.num_stages
        if cfg.maxnreg:
            opts["maxnreg"] = cfg.maxnreg
    return opts


def _converted(*weights) -> bool:
    """Whether any of the weight lists is NVFP4 in the mma layout (int32 codes,
    `flintc.kernels.nvfp4_mma.prepack`)."""
    from flintc.kernels.nvfp4_mma import is_mma_layout

    return any(isinstance(w, (list, tuple)) and len(w) == 3 and is_mma_layout(w[0])
               for w in weights)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when it is not contiguous and 16-byte aligned (the CUDA
    kernels' vector loads)."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(
        memory_format=torch.contiguous_format)


def _check_mma(op: str, name: str, w, lead: tuple, F: int, K: int, dev) -> None:
    """w is NVFP4 in the mma layout of a [*lead, F, K] weight on dev: codes int32
    [*lead, F/16, K/64, 32, 4], scales uint8 [..., 2] (checked by `nvfp4_mma.mma_operands`),
    global scale fp32 [] or [*lead]."""
    from flintc.kernels.nvfp4_mma import is_mma_layout, weight_dims

    if isinstance(w, (list, tuple)) and not w and name.startswith("shared"):
        raise _err(op, name, "given: experts in the mma layout run on the CUDA kernel only, "
                   "which needs a shared expert")
    if not isinstance(w, (list, tuple)) or len(w) != 3 or not is_mma_layout(w[0]):
        raise _err(op, name, "NVFP4 in the mma layout, as the other weights of the call",
                   w[0] if isinstance(w, (list, tuple)) and w else w)
    shape = [*lead, F // 16, K // 64, 32, 4]
    if F % 16 or K % 64 or weight_dims(w[0]) != (tuple(lead), F, K) or w[0].device != dev:
        raise _err(op, f"{name}[0] (NVFP4 codes, mma layout)", f"an int32 tensor {shape} on {dev}",
                   w[0])
    sc = w[1]
    if not isinstance(sc, torch.Tensor) or sc.dtype != torch.uint8 or sc.device != dev \
            or tuple(sc.shape) != (*lead, F // 16, K // 64, 32, 2):
        raise _err(op, f"{name}[1] (NVFP4 scale codes, mma layout)",
                   f"a uint8 tensor {[*lead, F // 16, K // 64, 32, 2]} on {dev}", sc)
    gs = w[2]
    if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32 or gs.device != dev \
            or tuple(gs.shape) not in ((), tuple(lead)):
        raise _err(op, f"{name}[2] (NVFP4 global scale)", f"an fp32 tensor [] or {list(lead)} on "
                   f"{dev}", gs)


def _require_mma_stack(op: str, name: str, w, dims: str) -> None:
    """ValueError (`_err`) unless `w` is a stacked NVFP4 weight in the mma layout: a list of
    3 tensors whose codes are int32 of 5 dims (`dims` names them in the message)."""
    if not (isinstance(w, (list, tuple)) and len(w) == 3 and isinstance(w[0], torch.Tensor)
            and w[0].dtype == torch.int32 and w[0].dim() == 5):
        raise _err(op, name, f"a stacked NVFP4 weight in the mma layout {dims}",
                   w[0] if isinstance(w, (list, tuple)) and w else w)


def _mma_gate_up(op, x, logits, bias, gate, up, shared_gate, shared_up, top_k, scaling, use_pdl,
                 config, down_prefetch=None):
    """`_gate_up_launch` for experts in the mma layout: the CUDA kernel, which is the only
    one that reads it (ValueError, saying what is missing, where it cannot run)."""
    from flintc.kernels import nvfp4_mma

    N, H = x.shape
    dev = x.device
    _require_mma_stack(op, "gate", gate, "[E, F/16, H/64, 32, 4]")
    E, F = gate[0].shape[0], gate[0].shape[1] * 16
    for name, w, lead in (("gate", gate, (E,)), ("up", up, (E,)), ("shared_gate", shared_gate, ()),
                          ("shared_up", shared_up, ())):
        _check_mma(op, name, w, lead, F, H, dev)
    if logits is None or config is not None:
        raise _err(op, "gate", "in the packed NVFP4 layout for moe_gate_up (no routing) or with a "
                   "config: the mma layout runs on the CUDA moe_topk_gate_up kernel only")
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 \
            or tuple(logits.shape) != (N, E) or logits.device != dev:
        raise _err(op, "logits", f"an fp32 tensor [{N}, {E}] on {dev}", logits)
    _check(op, "bias", bias, torch.float32, (E,), dev)
    x, logits = _aligned(x), logits.contiguous()
    if not _mma_gate_up_applies(x, logits, E, top_k, H, F, dev, converted=True):
        raise _err(op, "gate", "in the packed NVFP4 layout here: the mma layout runs on the CUDA "
                   "kernel only (sm_90+ with NVRTC, E % 32 == 0, E <= 1024, top_k <= 8, H % 1024 "
                   "== 0, contiguous 16-byte aligned x and logits)"
                   + nvfp4_mma.refusal_note(dev))
    return nvfp4_mma.moe_topk_gate_up(x, logits, bias, list(gate), list(up), list(shared_gate),
                                      list(shared_up), top_k, scaling,
                                      use_pdl=use_pdl and _native(dev),
                                      down=_down_hint(down_prefetch))


def _down_hint(down_prefetch):
    """`down_prefetch` as the CUDA launcher's `down` list (None stays None)."""
    return None if down_prefetch is None else list(down_prefetch)


def _gate_up_launch(op, x, logits, bias, ids, gate, up, shared_gate, shared_up, top_k, scaling,
                    use_pdl, config, down_prefetch=None):
    N, H = x.shape
    dev = x.device
    if _converted(gate, up, shared_gate, shared_up):
        return _mma_gate_up(op, x, logits, bias, gate, up, shared_gate, shared_up, top_k,
                            scaling, use_pdl, config, down_prefetch)
    nv, (g0, g1, g2), F, gs_stride = _stacked(op, "gate", gate, H, dev)
    nv_u, (u0, u1, u2), _, gs_stride_u = _stacked(op, "up", up, H, dev, F=F, E=g0.shape[0])
    if nv_u != nv or gs_stride_u != gs_stride:
        raise _err(op, "up", "in the same format (and global-scale shape) as gate")
    E = g0.shape[0]
    has_shared = bool(shared_gate)
    if has_shared != bool(shared_up):
        raise _err(op, "shared_up", "given exactly when shared_gate is")
    if has_shared:
        nv_s, sg, _, _ = _weight(op, "shared_gate", shared_gate, F, H, None, dev)
        nv_t, su, _, _ = _weight(op, "shared_up", shared_up, F, H, None, dev)
        if nv_s != nv or nv_t != nv:
            raise _err(op, "shared_gate", "in the same format as gate")
    else:
        sg = su = (g0, g1, g2)
    route = logits is not None
    if route:
        _check(op, "logits", logits, torch.float32, (N, E), dev)
        _check(op, "bias", bias, torch.float32, (E,), dev)
        if not (1 <= top_k <= E):
            raise _err(op, "top_k", f"in [1, E={E}] (got {top_k})")
        wts = torch.empty((N, top_k), dtype=torch.float32, device=dev)
        ids_out = torch.empty((N, top_k), dtype=torch.int64, device=dev)
        ids_in = ids_out
    else:
        _check_rows(op, "ids", ids, torch.int64, N, None, dev)
        top_k = ids.shape[1]
        wts = ids_out = None
        ids_in = ids
    slots = top_k + int(has_shared)
    fmt = "nvfp4" if nv else "bf16"
    if route and has_shared and config is None and mma_moe_applies("gate_up", fmt, N) \
            and (nv or _bf16_in_place(gate, up, shared_gate, shared_up)) \
            and _mma_gate_up_applies(x, logits, E, top_k, H, F, dev):
        from flintc.kernels import nvfp4_mma

        try:
            return nvfp4_mma.moe_topk_gate_up(x, logits, bias, list(gate), list(up),
                                              list(shared_gate), list(shared_up), top_k,
                                              scaling, use_pdl=use_pdl and _native(dev),
                                              down=_down_hint(down_prefetch))
        except RuntimeError:  # a weight first seen during CUDA-graph capture: Triton below
            if not torch.cuda.is_current_stream_capturing():
                raise
    cfg = config or choose_config("gate_up", fmt, N, F, H, N * top_k + int(has_shared), dev)
    _check_config(op, cfg)
    split, per_split = _effective_split(H, cfg.block_k, cfg.split)
    num_f = triton.cdiv(F, cfg.block_rows)
    grid = (num_f, N * top_k + int(has_shared), split)
    h = torch.empty((N, slots, F), dtype=torch.bfloat16, device=dev)
    if split > 1:
        ws = torch.empty((split, 2, N, slots, F), dtype=torch.float32, device=dev)
        cnt = split_k_counters(dev, grid[0] * grid[1])
    else:
        ws = cnt = h  # unused
    gpu = _native(dev)
    pdl, opts = _launch_opts(use_pdl, dev)
    gate_up_kernel[grid](
        x, logits if route else x, bias if route else x, ids_in,
        g0, g1, g2, u0, u1, u2, *sg, *su, h,
        wts if route else h, ids_out if route else h, ws, cnt,
        N, E, F, H, gs_stride, ids_in.stride(0), float(scaling), per_split,
        BLOCK_N=_block_n(N, cfg), BLOCK_T=triton.next_power_of_2(N), BLOCK_F=cfg.block_rows, BLOCK_K=cfg.block_k,
        SPLIT=split, ROUTE=route, HAS_SHARED=has_shared, IS_NVFP4=nv, USE_DOT=cfg.use_dot,
        SCALE_AFTER=cfg.scale_after and nv, PREFETCH=cfg.prefetch and not _flat(cfg),
        USE_PDL=pdl_mode(pdl), GPU=gpu, ACC_FULL=cfg.acc_full and not cfg.use_dot, FLAT=_flat(cfg), SWAP=cfg.swap and cfg.use_dot,
        **_route_consts(E, top_k), **_kernel_opts(cfg, gpu), **opts)
    return h, wts, ids_out


def _stacked(op, name, w, cols, dev, F=None, E=None):
    """Check a stacked expert weight [E, F, cols] (either format); returns like `_weight`."""
    if not isinstance(w, (list, tuple)) or len(w) not in (1, 3) or not isinstance(w[0], torch.Tensor):
        raise _err(op, name, "a list [weight] (bf16) or [codes, scales, global_scale] (NVFP4)", w)
    if w[0].dim() != 3:
        raise _err(op, f"{name}[0]", "a stacked expert weight [E, F, K]", w[0])
    E = w[0].shape[0] if E is None else E
    return _weight(op, name, w, F, cols, E, dev)


def moe_topk_gate_up(x, logits, bias, gate, up, shared_gate, shared_up, top_k: int, scaling: float,
                     down_prefetch=None, *, use_pdl: bool = False,
                     config: MoeConfig | None = None):
    """`flintc::moe_topk_gate_up` (kernel 6): top-k routing, the selected and shared experts'
    gate/up GEMVs and SiLU-and-mul, one launch (grid: (F blocks, N*K + 1 slots, split of
    H); each distinct expert streamed once for all tokens that chose it).

    Args:
        x: bf16 [N, H] (the normed x of `norm_router`), contiguous.
        logits: fp32 [N, E] router logits; bias: fp32 [E] e_score_correction_bias.
        gate, up: stacked experts [E, F, H]: `[w]` bf16, or NVFP4 `[codes uint8 [E, F, H/2],
            scales float8_e4m3fn [E, F, H/16], global_scale fp32 [E] or []]`, or NVFP4 in
            the mma layout (`flintc.kernels.nvfp4_mma.prepack`: codes int32 [E, F/16,
            H/64, 32, 4], scales uint8 [E, F/16, H/64, 32, 2]), which runs on the CUDA
            kernel only (module doc).
        shared_gate, shared_up: [F, H] in the same format (global scale []), or both []
            (not with the mma layout).
        top_k, scaling: K and routed_scaling_factor.
        down_prefetch: None, or the routed experts' down stack [E, H, F] in gate's format,
            which the next kernel reads: the CUDA kernel prefetches the selected experts'
            down weights into L2 (`nvfp4_mma.moe_topk_gate_up`'s `down`); the Triton
            kernel ignores it. It never changes the outputs.
        use_pdl: programmatic dependent launch (CUDA only); with `prefetch` configs the
            shared expert's first tiles load before `gdc_wait`.
        config: a `MoeConfig` (None: `choose_config`).

    Returns:
        (h bf16 [N, K(+1), F] = bf16(silu(bf16(g)) * bf16(u)), shared expert last;
        weights fp32 [N, K]; ids int64 [N, K]) as the reference.

    Numerics: module doc. N > 8 runs the reference op.

    Raises:
        ValueError: a dtype, shape, device or contiguity mismatch (names the argument);
            mma-layout weights where the CUDA kernel cannot run (another device, the
            interpreter, a config, no shared expert, shapes it does not take).
    """
    op = "moe_topk_gate_up"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise _err(op, "x", "a bf16 tensor [N, H]", x)
    if not x.is_contiguous():
        raise _err(op, "x", "contiguous", x)
    if not (1 <= x.shape[0] <= MAX_N):
        return _reference(op)(x, logits, bias, gate, up, shared_gate, shared_up, top_k, scaling)
    return _gate_up_launch(op, x, logits, bias, None, gate, up, shared_gate, shared_up, top_k,
                           scaling, use_pdl, config, down_prefetch)


def moe_gate_up(x, ids, gate, up, shared_gate, shared_up, *, use_pdl: bool = False,
                config: MoeConfig | None = None):
    """`flintc::moe_gate_up`: `gate_up_kernel` with the ids read from memory (no routing).
    x: bf16 [N, H]; ids: int64 [N, K] (distinct ids per token, as top-k gives); weights
    as `moe_topk_gate_up`. -> h bf16 [N, K(+1), F]. Numerics: module doc. N > 8 runs the
    reference op. Raises ValueError on a bad argument (named)."""
    op = "moe_gate_up"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise _err(op, "x", "a bf16 tensor [N, H]", x)
    if not x.is_contiguous():
        raise _err(op, "x", "contiguous", x)
    if not (1 <= x.shape[0] <= MAX_N):
        return _reference(op)(x, ids, gate, up, shared_gate, shared_up)
    return _gate_up_launch(op, x, None, None, ids, gate, up, shared_gate, shared_up, 0, 0.0,
                           use_pdl, config)[0]


def _down_launch(op, h, ids, weights, down, shared_down, residual, use_pdl, config):
    if not isinstance(h, torch.Tensor) or h.dtype != torch.bfloat16 or h.dim() != 3:
        raise _err(op, "h", "a bf16 tensor [N, K(+1), F]", h)
    if not h.is_contiguous():
        raise _err(op, "h", "contiguous", h)
    N, slots, F = h.shape
    dev = h.device
    _check_rows(op, "ids", ids, torch.int64, N, None, dev)
    K = ids.shape[1]
    _check_rows(op, "weights", weights, torch.float32, N, K, dev)
    has_shared = bool(shared_down)
    if slots != K + int(has_shared):
        raise _err(op, "h", f"[N, {K + int(has_shared)}, F] (K = {K} routed slots"
                   f"{' + the shared expert' if has_shared else ''})", h)
    if _converted(down, shared_down):
        return _mma_down(op, h, ids, weights, down, shared_down, residual, use_pdl, config)
    if not isinstance(down, (list, tuple)) or not down or not isinstance(down[0], torch.Tensor) \
            or down[0].dim() != 3:
        raise _err(op, "down", "a stacked expert weight list, first tensor [E, H, F(/2)]", down)
    E, H = down[0].shape[:2]
    nv, d, _, gs_stride = _weight(op, "down", down, H, F, E, dev)
    if has_shared:
        nv_s, sd, _, _ = _weight(op, "shared_down", shared_down, H, F, None, dev)
        if nv_s != nv:
            raise _err(op, "shared_down", "in the same format as down")
    else:
        sd = d
    fmt = "nvfp4" if nv else "bf16"
    if has_shared and residual is not None and config is None \
            and mma_moe_applies("down", fmt, N) and (nv or _bf16_in_place(down, shared_down)) \
            and _mma_down_applies(h, H, F, K, dev):
        from flintc.kernels import nvfp4_mma

        try:  # column slices of ids / weights (N x K elements) are copied, not refused
            return nvfp4_mma.moe_down(h, ids.contiguous(), weights.contiguous(), list(down),
                                      list(shared_down), residual,
                                      use_pdl=use_pdl and _native(dev))
        except RuntimeError:  # a weight first seen during CUDA-graph capture: Triton below
            if not torch.cuda.is_current_stream_capturing():
                raise
    cfg = config or choose_config("down", fmt, N, H, F, N * K + int(has_shared), dev)
    _check_config(op, cfg)
    split, per_split = _effective_split(F, cfg.block_k, cfg.split)
    grid = (triton.cdiv(H, cfg.block_rows), N * K + int(has_shared), split)
    out = torch.empty((N, H), dtype=torch.bfloat16, device=dev)
    ws = torch.empty((split, N, slots, H), dtype=torch.float32, device=dev)
    cnt = split_k_counters(dev, grid[0])
    gpu = _native(dev)
    pdl, opts = _launch_opts(use_pdl, dev)
    down_kernel[grid](
        h, ids, weights, *d, *sd, residual if residual is not None else out, out, ws, cnt,
        N, F, H, gs_stride, ids.stride(0), weights.stride(0), per_split,
        BLOCK_N=_block_n(N, cfg), BLOCK_T=triton.next_power_of_2(N), BLOCK_H=cfg.block_rows, BLOCK_K=cfg.block_k,
        TOP_K=K, TOPK_PAD=triton.next_power_of_2(max(K, 2)), SPLIT=split,
        HAS_SHARED=has_shared, HAS_RESIDUAL=residual is not None, IS_NVFP4=nv,
        USE_DOT=cfg.use_dot, SCALE_AFTER=cfg.scale_after and nv,
        PREFETCH=cfg.prefetch and not _flat(cfg), ACC_FULL=cfg.acc_full and not cfg.use_dot,
        FLAT=_flat(cfg), SWAP=cfg.swap and cfg.use_dot,
        STAGE_W=(not nv) if cfg.stage_w is None else cfg.stage_w,
        USE_PDL=pdl_mode(pdl), GPU=gpu, **_kernel_opts(cfg, gpu), **opts)
    return out


def _mma_down(op, h, ids, weights, down, shared_down, residual, use_pdl, config):
    """`_down_launch` for experts in the mma layout (checked arguments h, ids, weights):
    the CUDA kernel, the only one that reads it (ValueError where it cannot run)."""
    from flintc.kernels import nvfp4_mma

    N, slots, F = h.shape
    K = ids.shape[1]
    dev = h.device
    _require_mma_stack(op, "down", down, "[E, H/16, F/64, 32, 4]")
    E, H = down[0].shape[0], down[0].shape[1] * 16
    _check_mma(op, "down", down, (E,), H, F, dev)
    _check_mma(op, "shared_down", shared_down, (), H, F, dev)
    if residual is None or config is not None:
        raise _err(op, "down", "in the packed NVFP4 layout without a residual or with a config: "
                   "the mma layout runs on the CUDA moe_down_combine_residual kernel only")
    _check(op, "residual", residual, torch.bfloat16, (N, H), dev)
    h, ids, weights = _aligned(h), ids.contiguous(), weights.contiguous()
    if not _mma_down_applies(h, H, F, K, dev, converted=True):
        raise _err(op, "down", "in the packed NVFP4 layout here: the mma layout runs on the CUDA "
                   "kernel only (sm_90+ with NVRTC, F % 64 == 0, H % 16 == 0, top-k <= 16, "
                   "16-byte aligned h)" + nvfp4_mma.refusal_note(dev))
    return nvfp4_mma.moe_down(h, ids, weights, list(down), list(shared_down), residual,
                              use_pdl=use_pdl and _native(dev))


# decode batches N at which the bf16 MoE kernels run on the CUDA mma kernels of
# `flintc.kernels.nvfp4_mma` (bf16 weights read in place) rather than the Triton flat
# tiles: measured on the H200, docs/gpu-runs.md session 15. NVFP4 runs them at every N.
BF16_MMA_N = {"gate_up": frozenset((1, 2)), "down": frozenset(range(1, 9))}


def mma_moe_applies(kind: str, fmt: str, N: int) -> bool:
    """Whether the measured rule puts `kind` ("gate_up" or "down") for weights in `fmt`
    ("nvfp4" or "bf16") at N decode tokens on the CUDA mma kernel (`BF16_MMA_N`); the
    device and shape conditions are `_mma_gate_up_applies` / `_mma_down_applies`'."""
    return fmt == "nvfp4" or N in BF16_MMA_N[kind]


def _bf16_in_place(*weights) -> bool:
    """Whether bf16 weights `[w]` can be read in place by the CUDA kernels: contiguous and
    16-byte aligned (they load 16-byte vectors)."""
    return all(w[0].is_contiguous() and w[0].data_ptr() % 16 == 0 for w in weights)


def _mma_gate_up_applies(x, logits, E: int, top_k: int, H: int, F: int,
                         dev: torch.device, converted: bool = False) -> bool:
    """Whether `moe_topk_gate_up` runs on the CUDA mma kernel
    (`flintc.kernels.nvfp4_mma.moe_topk_gate_up`), besides what the caller checks (a
    shared expert, routing in the kernel, no explicit config, `mma_moe_applies`): a CUDA
    sm_90+ device, E % 32 == 0 and E <= 1024, top_k <= 8, H % 1024 == 0, F % 16 == 0,
    contiguous x (16-byte aligned) and logits, outside the interpreter. FLINTC_NVFP4_MMA=0
    keeps the Triton kernel for packed NVFP4 and bf16 weights; `converted` (weights in the
    mma layout, which only the CUDA kernel reads) ignores both."""
    from flintc.kernels import nvfp4_mma

    ok_dev = nvfp4_mma.supported(dev) if converted else nvfp4_mma.available(dev)
    return ((converted or not interpreting()) and E % 32 == 0 and 32 <= E <= 1024 and top_k <= 8
            and H % 1024 == 0 and F % 16 == 0 and x.is_contiguous() and logits.is_contiguous()
            and x.data_ptr() % 16 == 0 and ok_dev)


def _mma_down_applies(h, H: int, F: int, K: int, dev: torch.device,
                      converted: bool = False) -> bool:
    """Whether `moe_down_combine_residual` runs on the CUDA mma kernel
    (`flintc.kernels.nvfp4_mma.moe_down`), besides what the caller checks (a shared
    expert, no explicit config, `mma_moe_applies`): a CUDA sm_90+ device, F % 64 == 0,
    H % 16 == 0, K <= 16, h 16-byte aligned, outside the interpreter (ids and weights:
    the callers pass contiguous copies). FLINTC_NVFP4_MMA=0 keeps the Triton kernel for
    packed NVFP4 and bf16 weights; `converted` (the mma layout, which only the CUDA
    kernel reads) ignores both."""
    from flintc.kernels import nvfp4_mma

    ok_dev = nvfp4_mma.supported(dev) if converted else nvfp4_mma.available(dev)
    return ((converted or not interpreting()) and F % 64 == 0 and H % 16 == 0 and K <= 16
            and h.data_ptr() % 16 == 0 and ok_dev)


def moe_down_combine_residual(h, ids, weights, down, shared_down, residual, *,
                              use_pdl: bool = False, config: MoeConfig | None = None
                              ) -> torch.Tensor:
    """`flintc::moe_down_combine_residual` (kernel 7): down GEMVs of the selected and shared
    experts, fp32 weighted combine, residual add; one launch (grid: (H blocks, N*K + 1
    slots, split of F); each distinct expert's rows read once; the last program to arrive
    at an H block combines the experts' fp32 partials from a workspace).

    Args:
        h: bf16 [N, K(+1), F] from kernel 6; ids: int64 [N, K] (distinct per token);
            weights: fp32 [N, K].
        down: stacked [E, H, F]: `[w]` bf16 or NVFP4 `[codes [E, H, F/2], scales
            [E, H, F/16], global_scale [E] or []]`, or NVFP4 in the mma layout (codes int32
            [E, H/16, F/64, 32, 4], scales uint8 [E, H/16, F/64, 32, 2]; CUDA kernel only);
            shared_down: [H, F] or [] (not with the mma layout).
        residual: bf16 [..., H] with N rows, contiguous.
        use_pdl: programmatic dependent launch (CUDA only); with `prefetch` configs the
            shared expert's first tile loads before `gdc_wait`.
        config: a `MoeConfig` (None: `choose_config`).

    Returns:
        bf16 residual.shape: `bf16(residual + bf16(sum_k w_k * bf16(y_k) + bf16(y_shared)))`.

    Numerics: module doc (combine in the reference's order). N > 8 runs the reference op.

    Raises:
        ValueError: a dtype, shape, device or contiguity mismatch (names the argument);
            mma-layout weights where the CUDA kernel cannot run (as `moe_topk_gate_up`).
    """
    op = "moe_down_combine_residual"
    if not isinstance(residual, torch.Tensor) or residual.dtype != torch.bfloat16 \
            or residual.dim() < 1 or not residual.is_contiguous():
        raise _err(op, "residual", "a contiguous bf16 tensor [..., H]", residual)
    if not isinstance(h, torch.Tensor) or h.dim() != 3:
        raise _err(op, "h", "a bf16 tensor [N, K(+1), F]", h)
    if not (1 <= h.shape[0] <= MAX_N):
        return _reference(op)(h, ids, weights, down, shared_down, residual)
    N = h.shape[0]
    if residual.numel() != N * residual.shape[-1] or residual.device != h.device:
        raise _err(op, "residual", f"a bf16 tensor [..., H] with {N} rows on {h.device}",
                   residual)
    if isinstance(down, (list, tuple)) and down and isinstance(down[0], torch.Tensor) \
            and down[0].dim() == 3 and down[0].shape[1] != residual.shape[-1]:
        raise _err(op, "residual", f"[..., {down[0].shape[1]}] (H of down)", residual)
    out = _down_launch(op, h, ids, weights, down, shared_down,
                       residual.view(N, residual.shape[-1]), use_pdl, config)
    return out.view(residual.shape)


def moe_down_combine(h, ids, weights, down, shared_down, *, use_pdl: bool = False,
                     config: MoeConfig | None = None):
    """`flintc::moe_down_combine`: `down_kernel` without the residual add.
    Shapes as `moe_down_combine_residual`; -> bf16 [N, H] = `bf16(sum_k w_k * bf16(y_k) +
    bf16(y_shared))`. N > 8 runs the reference op. Raises ValueError on a bad argument
    (named)."""
    op = "moe_down_combine"
    if isinstance(h, torch.Tensor) and h.dim() == 3 and not 1 <= h.shape[0] <= MAX_N:
        return _reference(op)(h, ids, weights, down, shared_down)
    return _down_launch(op, h, ids, weights, down, shared_down, None, use_pdl, config)


KERNELS: dict[str, Callable] = {
    "norm_router": norm_router,
    "moe_topk_gate_up": moe_topk_gate_up,
    "moe_down_combine_residual": moe_down_combine_residual,
    "moe_route": moe_route,
    "moe_gate_up": moe_gate_up,
    "moe_down_combine": moe_down_combine,
}
