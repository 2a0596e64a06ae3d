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
  from memory). Grid: (slot, F block), slot = one (token, k) pair, plus one for the shared
  expert. **Expert dedupe**: every program computes the selections of all N tokens (N*E
  logits, a few KiB), and the program of slot (t, k) owns expert e = ids[t, k] only if no
  earlier slot selected e; the owner runs e's gate/up GEMV for *all* tokens that selected e
  (tokens are the N columns of one tensor-core tile), so each distinct expert's weights
  are streamed from HBM exactly once per call; non-owners exit after writing their id and
  weight. SiLU-and-mul in the epilogue, g and u each rounded to bf16 first (the reference's
  rounding points).
* `down_kernel`: `flintc::moe_down_combine_residual` (HAS_RESIDUAL=True) and
  `flintc::moe_down_combine`. Grid: blocks of BLOCK_H output rows; each program walks the
  shared expert and then the slots, skipping duplicate experts the same way (each distinct
  expert's [BLOCK_H, F] tile is read once, for all its tokens), with a software pipeline
  (the next distinct expert's tile is loaded before the current one is used; the shared
  expert's tile before `gdc_wait`). Each expert output is rounded to bf16, weighted in
  fp32, summed in k order, plus the shared expert, rounded once; then the residual add
  (fp32 sum of two bf16, rounded once).

PDL: each kernel loads what does not depend on the previous kernel (router / shared-expert
weight tiles) before `gdc_wait`; routed-expert tiles can only be addressed after the ids
are known. `use_pdl=True` launches with `launch_pdl=True` (CUDA only).

NVFP4 decode. Instead of `flintc.kernels.gemv._e2m1_to_fp32` (about 12 integer/float ops
per weight; gemv.py's NVFP4 path measured decode-bound at 2-6% of copy bandwidth), a code
is turned into an fp16 *bit pattern* in 5 integer ops: sign bit 3 -> bit 15, magnitude
bits 2..0 -> bits 11..9. That fp16 number is exactly `e2m1 * 2^-14` (exponent 0 is the fp16
subnormal range, matching E2M1's subnormal). Multiplying by the E4M3 block scale in fp16 is
exact (both factors have <= 4 significant bits, the product lies in [2^-24, 0.17], all
multiples of 2^-24 that fp16 holds), and so is the conversion to bf16 for the tensor-core
dot. The 2^14 and the global scale are applied to the fp32 accumulator:
`acc * 2^14 * global_scale`; the first multiply is exact, so this is the reference's
`(x @ (e2m1 * scale)^T) * global_scale` up to the summation order.

Numerics against the reference (FLINT_SPEC section 3 rounding points, all kept):
* logits: fp32 dot products in a different order than torch's matmul: a few fp32 ulps.
* normed x, g, u, h, expert outputs, combine, residual: one bf16 rounding each, at the
  reference's points; GEMV sums in a different order and Triton's exp/rsqrt/sigmoid can
  differ from torch's by an ulp, so a value on a rounding boundary can move one bf16 ulp
  (a small share of elements; tests report it). The combine sums the K weighted expert
  outputs in k order, then adds the shared expert, as the reference does.
* top-k ids: exact (ties in `sigmoid(logit) + bias` go to the lower expert index), except
  where two keys are within an ulp of each other and the sigmoids differ by an ulp.
* routing weights: `s_k / sum(s) * scaling` with a tree-ordered sum and a correctly
  rounded division; torch's 6-element sum and its CPU sigmoid use other orders / formulas
  (measured: a sequential 6-term sum differs from torch's CPU sum in 39% of rows), so the
  weights agree to a few fp32 ulps, not bit for bit.

All launchers fall back to the reference op (`torch.ops.flintc.*`) for N > 8 or F > 1024,
which a decode step at batch <= 8 never sees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from flintc.kernels.gemv import _round_to_bf16

MAX_N = 8  # decode batch limit of the kernels (the launchers fall back above it)
MAX_F = 1024  # expert width held as one tile by the down kernel
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
def _mma(acc, w, x, DOT_BF16: tl.constexpr):
    """acc[R, BLOCK_N] += w[R, k] @ x[BLOCK_N, k]^T, exact products, fp32 accumulation.
    Weights are the M side of the tensor-core tile (R >= 16 rows), the <= 8 tokens padded
    to 16 the N side. Every operand is exact in bf16; the interpreter gets an fp32 IEEE dot
    (bf16 math is broken there, NOTES)."""
    if DOT_BF16:
        return tl.dot(w.to(tl.bfloat16), tl.trans(x.to(tl.bfloat16)), acc)
    else:
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")


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
def _nvfp4_decode(codes, scales, BLOCK_K: tl.constexpr):
    """(codes uint8 [R, BLOCK_K/2], scales fp8 [R, BLOCK_K/16]) -> (w_even, w_odd) fp16
    [R, BLOCK_K/2] holding `e2m1 * scale * 2^-14` exactly (see the module doc). w_even is
    weight 2j (low nibble of byte j), w_odd weight 2j + 1."""
    R: tl.constexpr = codes.shape[0]
    s = scales.to(tl.float32).to(tl.float16)  # e4m3 -> fp16 is exact
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (R, BLOCK_K // 16, 8)), (R, BLOCK_K // 2))
    c = codes.to(tl.uint16)
    lo = ((c & 0x8) << 12) | ((c & 0x7) << 9)
    hi = ((c & 0x80) << 8) | ((c & 0x70) << 5)
    return lo.to(tl.float16, bitcast=True) * s, hi.to(tl.float16, bitcast=True) * s


@triton.jit
def _gemv_step(acc, w_raw, s_raw, x_rows, mask_x, k0, K, BLOCK_K: tl.constexpr,
               IS_NVFP4: tl.constexpr, DOT_BF16: tl.constexpr):
    """One BLOCK_K step of acc[R, BLOCK_N] += W[:, k0:k0+BLOCK_K] @ x[:, k0:k0+BLOCK_K]^T.
    `x_rows` are the row pointers [BLOCK_N, 1] of the activations, `mask_x` [BLOCK_N, 1]."""
    if IS_NVFP4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        m = mask_x & (2 * offs_b < K)[None, :]
        x_even = tl.load(x_rows + 2 * offs_b[None, :], mask=m, other=0.0)
        x_odd = tl.load(x_rows + 2 * offs_b[None, :] + 1, mask=m, other=0.0)
        w_even, w_odd = _nvfp4_decode(w_raw, s_raw, BLOCK_K)
        acc = _mma(acc, w_even, x_even, DOT_BF16)
        acc = _mma(acc, w_odd, x_odd, DOT_BF16)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_x & (offs_k < K)[None, :], other=0.0)
        acc = _mma(acc, w_raw, x, DOT_BF16)
    return acc


@triton.jit
def _finish(acc, gscale, IS_NVFP4: tl.constexpr):
    """Accumulator -> fp32 GEMV result before rounding: NVFP4 undoes the 2^-14 of the fp16
    decode (exact) and applies the global scale on the fp32 accumulator."""
    if IS_NVFP4:
        return acc * 16384.0 * gscale
    else:
        return acc


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
):
    # Program p: logits of all N tokens for router rows [p*BLOCK_E, (p+1)*BLOCK_E); CUDA-core
    # products (the tile is [BLOCK_N, BLOCK_E, BLOCK_K]: few rows per program keep 100+ SMs
    # busy on a 1 MiB matrix). Program 0 also stores the normed x.
    pid = tl.program_id(0)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_cur, _ = _load_tile(w_ptr, w_ptr, offs_e, mask_e, 0, H, BLOCK_K, False)  # before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by the previous kernel
    rstd = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if APPLY_NORM:
        ss = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + offs_n[:, None] * H + offs_k[None, :],
                         mask=mask_n[:, None] & (offs_k < H)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xv * xv, axis=1)
        rstd = _rsqrt(ss / H + eps, LIBDEVICE)
    h_rows = tl.where(pid == 0, N, 0)  # program 0 stores the normed x
    acc = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)
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
        acc += tl.sum(xv[:, None, :] * wf[None, :, :], axis=2)
        w_cur = w_next
    if USE_PDL:
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
    # One program: the top-k of all N tokens (second launch of moe_route).
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, TOPK_PAD)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    ids, wts = _route(logits_ptr, bias_ptr, N, E, scaling, offs_n, offs_k, BLOCK_E, TOP_K,
                      LIBDEVICE)
    mask = (offs_n < N)[:, None] & (offs_k < TOP_K)[None, :]
    out = offs_n[:, None] * TOP_K + offs_k[None, :]
    tl.store(wts_ptr + out, wts, mask=mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)


# ----------------------------------------------------------------------------- kernel 6
@triton.jit
def gate_up_kernel(
    x_ptr,  # bf16 [N, H]
    logits_ptr, bias_ptr,  # ROUTE: fp32 [N, E], fp32 [E]
    ids_in_ptr,  # not ROUTE: int64 [N, K]
    g_ptr, g_s_ptr, g_gs_ptr,  # gate: bf16 [E, F, H] | NVFP4 codes [E, F, H/2], scales, gscale
    u_ptr, u_s_ptr, u_gs_ptr,  # up: same
    sg_ptr, sg_s_ptr, sg_gs_ptr,  # shared gate: [F, H] | NVFP4, gscale []
    su_ptr, su_s_ptr, su_gs_ptr,  # shared up
    h_ptr,  # out: bf16 [N, K + HAS_SHARED, F]
    wts_ptr, ids_ptr,  # out (ROUTE): fp32 [N, K], int64 [N, K]
    N, E, F, H,
    GS_STRIDE,  # 1: routed global scales [E]; 0: one scalar
    IDS_STRIDE,  # row stride of ids_in (the reference's ids are a slice of a sort)
    scaling,
    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr, ROUTE: tl.constexpr, HAS_SHARED: tl.constexpr,
    IS_NVFP4: tl.constexpr, USE_PDL: tl.constexpr, DOT_BF16: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    # Program (slot, f block): slot < N*K is (token t, choice k); slot N*K the shared expert.
    slot = tl.program_id(0)
    pid_f = tl.program_id(1)
    NK = N * TOP_K
    SLOTS: tl.constexpr = TOP_K + HAS_SHARED  # h rows per token
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = offs_f < F
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, TOPK_PAD)
    KW = H // 2 if IS_NVFP4 else H  # row length of the stored weight
    if slot == NK:  # the shared expert: its weights are known before the previous kernel ends
        gw = sg_ptr
        gs = sg_s_ptr
        uw = su_ptr
        us = su_s_ptr
        g_cur, gs_cur = _load_tile(gw, gs, offs_f, mask_f, 0, H, BLOCK_K, IS_NVFP4)
        u_cur, us_cur = _load_tile(uw, us, offs_f, mask_f, 0, H, BLOCK_K, IS_NVFP4)
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
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # logits / ids come from the previous kernel
        valid = (offs_n < N)[:, None] & (offs_k < TOP_K)[None, :]
        if ROUTE:
            sel, wts = _route(logits_ptr, bias_ptr, N, E, scaling, offs_n, offs_k, BLOCK_E,
                              TOP_K, LIBDEVICE)
        else:
            sel = tl.load(ids_in_ptr + offs_n[:, None] * IDS_STRIDE + offs_k[None, :], mask=valid,
                          other=0).to(tl.int32)
            wts = tl.zeros((BLOCK_N, TOPK_PAD), dtype=tl.float32)
        flat = offs_n[:, None] * TOP_K + offs_k[None, :]  # slot index of each (token, k)
        me = flat == slot
        e = tl.sum(tl.where(me & valid, sel, 0))
        if ROUTE:
            # Each (token, k) output is written once, by its slot's first F block.
            if pid_f == 0:
                tl.store(wts_ptr + slot, tl.sum(tl.where(me & valid, wts, 0.0)))
                tl.store(ids_ptr + slot, e.to(tl.int64))
        same = (sel == e) & valid
        # Owner of e: no earlier slot chose it. A non-owner loads nothing (masked loads)
        # and returns below; the owner computes e for every token that chose it.
        skip = tl.sum(tl.where(same & (flat < slot), 1, 0)) > 0
        mask_f = offs_f < tl.where(skip, 0, F)  # (a scalar & tensor mask trips the interpreter)
        kpos1 = tl.sum(tl.where(same, offs_k[None, :] + 1, 0), axis=1)  # choice + 1, or 0
        tok = kpos1 > 0  # tokens that selected e
        kpos = kpos1 - 1  # ... at this choice
        e64 = e.to(tl.int64)
        gw = g_ptr + e64 * F * KW
        uw = u_ptr + e64 * F * KW
        gs = g_s_ptr + e64 * F * (H // 16)
        us = u_s_ptr + e64 * F * (H // 16)
        g_cur, gs_cur = _load_tile(gw, gs, offs_f, mask_f, 0, H, BLOCK_K, IS_NVFP4)
        u_cur, us_cur = _load_tile(uw, us, offs_f, mask_f, 0, H, BLOCK_K, IS_NVFP4)
        g_gscale = 1.0
        u_gscale = 1.0
        if IS_NVFP4:
            g_gscale = tl.load(g_gs_ptr + e64 * GS_STRIDE)
            u_gscale = tl.load(u_gs_ptr + e64 * GS_STRIDE)
    if skip:
        return  # top level: an earlier slot computes this expert for every token

    x_rows = x_ptr + offs_n[:, None] * H
    mask_x = tok[:, None]
    acc_g = tl.zeros((BLOCK_F, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_F, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        # Software pipeline: next tiles first (fully masked past H: no traffic).
        g_nxt, gs_nxt = _load_tile(gw, gs, offs_f, mask_f, k0 + BLOCK_K, H, BLOCK_K, IS_NVFP4)
        u_nxt, us_nxt = _load_tile(uw, us, offs_f, mask_f, k0 + BLOCK_K, H, BLOCK_K, IS_NVFP4)
        acc_g = _gemv_step(acc_g, g_cur, gs_cur, x_rows, mask_x, k0, H, BLOCK_K, IS_NVFP4,
                           DOT_BF16)
        acc_u = _gemv_step(acc_u, u_cur, us_cur, x_rows, mask_x, k0, H, BLOCK_K, IS_NVFP4,
                           DOT_BF16)
        g_cur, gs_cur, u_cur, us_cur = g_nxt, gs_nxt, u_nxt, us_nxt
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g = _bf16_value(_finish(acc_g, g_gscale, IS_NVFP4))  # g rounded to bf16 (reference)
    u = _bf16_value(_finish(acc_u, u_gscale, IS_NVFP4))  # u rounded to bf16
    hv = g * _sigmoid(g, LIBDEVICE) * u  # silu_mul in fp32: (g * sigmoid(g)) * u
    # h[n, kpos[n], f], h is [N, SLOTS, F]; acc is [BLOCK_F, BLOCK_N].
    out = (offs_n[None, :] * SLOTS + kpos[None, :]) * F + offs_f[:, None]
    tl.store(h_ptr + out, _round_to_bf16(hv), mask=mask_f[:, None] & tok[None, :])


# ----------------------------------------------------------------------------- kernel 7
@triton.jit
def _down_tile(d_ptr, d_s_ptr, e64, F, H, offs_h, ok, BLOCK_F: tl.constexpr,
               IS_NVFP4: tl.constexpr):
    """The [BLOCK_H, F] tile of expert e64's down matrix [H, F]; nothing read unless `ok`."""
    KW = F // 2 if IS_NVFP4 else F
    rows = offs_h < tl.where(ok, H, 0)  # offs_h < H, or nothing when not `ok`
    return _load_tile(d_ptr + e64 * H * KW, d_s_ptr + e64 * H * (F // 16), offs_h, rows,
                      0, F, BLOCK_F, IS_NVFP4)


@triton.jit
def down_kernel(
    h_ptr,  # bf16 [N, K + HAS_SHARED, F]
    ids_ptr,  # int64 [N, K]
    wts_ptr,  # fp32 [N, K]
    d_ptr, d_s_ptr, d_gs_ptr,  # down: bf16 [E, H, F] | NVFP4 codes [E, H, F/2], scales, gscale
    sd_ptr, sd_s_ptr, sd_gs_ptr,  # shared down: [H, F] | NVFP4
    res_ptr,  # bf16 [N, H] (HAS_RESIDUAL)
    out_ptr,  # out: bf16 [N, H]
    N, F, H,
    GS_STRIDE,
    IDS_STRIDE, WTS_STRIDE,  # row strides of ids / weights [N, K] (unit column stride)
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_NK: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    HAS_SHARED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, IS_NVFP4: tl.constexpr,
    USE_PDL: tl.constexpr, DOT_BF16: tl.constexpr,
):
    # Program p: output rows [p*BLOCK_H, (p+1)*BLOCK_H) of all N tokens; walks the shared
    # expert, then every distinct selected expert once (in slot order).
    pid = tl.program_id(0)
    NK = N * TOP_K
    SLOTS: tl.constexpr = TOP_K + HAS_SHARED
    offs_h = pid * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, TOPK_PAD)
    if HAS_SHARED:  # weights do not depend on the previous kernel: load before the wait
        sd_cur, sds_cur = _load_tile(sd_ptr, sd_s_ptr, offs_h, mask_h, 0, F, BLOCK_F, IS_NVFP4)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # h, ids, weights come from the previous kernel
    valid = mask_n[:, None] & (offs_k < TOP_K)[None, :]
    sel = tl.load(ids_ptr + offs_n[:, None] * IDS_STRIDE + offs_k[None, :], mask=valid, other=-1)
    wts = tl.load(wts_ptr + offs_n[:, None] * WTS_STRIDE + offs_k[None, :], mask=valid, other=0.0)
    offs_s = tl.arange(0, BLOCK_NK)  # flat slots t * K + k
    sel_flat = tl.load(ids_ptr + (offs_s // TOP_K) * IDS_STRIDE + offs_s % TOP_K,
                       mask=offs_s < NK, other=-1)
    # first[s]: no earlier slot chose the same expert. own[s]: the expert if slot s owns
    # it, else -1 (one reduction per slot in the loop gives both).
    earlier = (offs_s[None, :] < offs_s[:, None]) & (sel_flat[None, :] == sel_flat[:, None])
    first = tl.sum(tl.where(earlier, 1, 0), axis=1) == 0
    own = tl.where(first & (offs_s < NK), sel_flat, -1)
    # First routed tile in flight while the shared expert is computed (slot 0 always owns).
    e_cur = tl.sum(tl.where(offs_s == 0, sel_flat, 0))
    w_cur, s_cur = _down_tile(d_ptr, d_s_ptr, e_cur, F, H, offs_h, NK > 0, BLOCK_F, IS_NVFP4)

    y_shared = tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32)
    if HAS_SHARED:
        x_rows = h_ptr + (offs_n[:, None] * SLOTS + TOP_K) * F
        acc = _gemv_step(tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32), sd_cur, sds_cur,
                         x_rows, mask_n[:, None], 0, F, BLOCK_F, IS_NVFP4, DOT_BF16)
        sgs = 1.0
        if IS_NVFP4:
            sgs = tl.load(sd_gs_ptr)
        y_shared = _bf16_value(_finish(acc, sgs, IS_NVFP4))  # shared output rounded to bf16

    # contrib[h, n, k] = w[n, k] * y_{ids[n, k]}[n, h], filled as each expert is computed.
    contrib = tl.zeros((BLOCK_H, BLOCK_N, TOPK_PAD), dtype=tl.float32)
    owner_cur = NK > 0
    for j in range(NK):
        # Prefetch the tile of the next slot if that slot owns a new expert.
        e_nxt = tl.max(tl.where(offs_s == j + 1, own, -1))
        owner_nxt = e_nxt >= 0
        w_nxt, s_nxt = _down_tile(d_ptr, d_s_ptr, e_nxt.to(tl.int64), F, H, offs_h, owner_nxt,
                                  BLOCK_F, IS_NVFP4)
        if owner_cur:
            same = (sel == e_cur) & valid
            kpos1 = tl.sum(tl.where(same, offs_k[None, :] + 1, 0), axis=1)
            tok = kpos1 > 0  # tokens that chose e_cur ...
            kpos = kpos1 - 1  # ... as their choice kpos
            w_tok = tl.sum(tl.where(same, wts, 0.0), axis=1)  # w[n, kpos[n]]
            x_rows = h_ptr + (offs_n[:, None] * SLOTS + kpos[:, None]) * F
            acc = _gemv_step(tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32), w_cur, s_cur,
                             x_rows, tok[:, None], 0, F, BLOCK_F, IS_NVFP4, DOT_BF16)
            egs = 1.0
            if IS_NVFP4:
                egs = tl.load(d_gs_ptr + e_cur.to(tl.int64) * GS_STRIDE)
            y = _bf16_value(_finish(acc, egs, IS_NVFP4))  # each expert output rounded to bf16
            p = w_tok[None, :] * y  # fp32 weight * y, as the reference
            put = (offs_k[None, None, :] == kpos[None, :, None]) & tok[None, :, None]
            contrib = tl.where(put, p[:, :, None], contrib)
        e_cur = e_nxt
        owner_cur = owner_nxt
        w_cur = w_nxt
        s_cur = s_nxt
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # sum_k in k order (torch's sum over dim 1 of [N, K, H] accumulates k sequentially),
    # then + shared, one rounding.
    m = tl.zeros((BLOCK_H, BLOCK_N), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        m = m + tl.sum(tl.where(offs_k[None, None, :] == k, contrib, 0.0), axis=2)
    if HAS_SHARED:
        m = m + y_shared
    out_offs = offs_n[None, :] * H + offs_h[:, None]
    mask_out = mask_h[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        mb = _bf16_value(m)  # the combine's rounding
        r = tl.load(res_ptr + out_offs, mask=mask_out, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_offs, _round_to_bf16(r + mb), mask=mask_out)
    else:
        tl.store(out_ptr + out_offs, _round_to_bf16(m), mask=mask_out)


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


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch_opts(use_pdl: bool, device: torch.device) -> tuple[bool, dict]:
    pdl = bool(use_pdl) and _on_gpu(device) and not _interpreting()
    return pdl, ({"launch_pdl": True} if pdl else {})


def _native(device: torch.device) -> bool:
    """Compiled GPU code (bf16 tensor-core dots, libdevice): not the interpreter."""
    return _on_gpu(device) and not _interpreting()


def _reference(name: str):
    import flintc.ops  # noqa: F401  (registers torch.ops.flintc)

    return getattr(torch.ops.flintc, name)


def _block_n(N: int) -> int:
    """Token tile of the tensor-core GEMVs: 16, tl.dot's smallest size (<= 8 tokens padded;
    the padding costs tensor-core cycles only, no memory traffic)."""
    return 16


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
        APPLY_NORM=norm is not None, USE_PDL=pdl, LIBDEVICE=native, num_warps=4, **opts)
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
    logits within a few fp32 ulps (dot order). N > 8 runs the reference op.

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
    return _router(op, x.view(N, H), norm, router, eps, use_pdl)


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
                      USE_PDL=pdl, LIBDEVICE=_native(dev), num_warps=4, **opts)
    return wts, ids


def _gate_up_launch(op, x, logits, bias, ids, gate, up, shared_gate, shared_up, top_k, scaling,
                    use_pdl):
    N, H = x.shape
    dev = x.device
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
    h = torch.empty((N, slots, F), dtype=torch.bfloat16, device=dev)
    native = _native(dev)
    block_f = 16 if native else min(64, max(16, triton.next_power_of_2(F)))
    block_k = (512 if nv else 256) if native else 64
    block_k = min(block_k, max(64, triton.next_power_of_2(H)))
    grid = (N * top_k + int(has_shared), triton.cdiv(F, block_f))
    pdl, opts = _launch_opts(use_pdl, dev)
    gate_up_kernel[grid](
        x, logits if route else x, bias if route else x, ids_in,
        g0, g1, g2, u0, u1, u2, *sg, *su, h,
        wts if route else h, ids_out if route else h,
        N, E, F, H, gs_stride, ids_in.stride(0), float(scaling),
        BLOCK_N=_block_n(N), BLOCK_F=block_f, BLOCK_K=block_k, ROUTE=route,
        HAS_SHARED=has_shared, IS_NVFP4=nv, USE_PDL=pdl, DOT_BF16=native, LIBDEVICE=native,
        num_warps=4, **_route_consts(E, top_k), **opts)
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
                     *, use_pdl: bool = False):
    """`flintc::moe_topk_gate_up` (kernel 6): top-k routing, the selected and shared experts'
    gate/up GEMVs and SiLU-and-mul, one launch (grid: (N*K + 1 slots, F blocks); each
    distinct expert streamed once for all tokens that chose it).

    Args:
        x: bf16 [N, H] (the normed x of `norm_router`), contiguous.
        logits: fp32 [N, E] router logits; bias: fp32 [E] e_score_correction_bias.
        gate, up: stacked experts [E, F, H]: `[w]` bf16, or NVFP4 `[codes uint8 [E, F, H/2],
            scales float8_e4m3fn [E, F, H/16], global_scale fp32 [E] or []]`.
        shared_gate, shared_up: [F, H] in the same format (global scale []), or both [].
        top_k, scaling: K and routed_scaling_factor.
        use_pdl: programmatic dependent launch (CUDA only); the shared expert's first tiles
            load before `gdc_wait`.

    Returns:
        (h bf16 [N, K(+1), F] = bf16(silu(bf16(g)) * bf16(u)), shared expert last;
        weights fp32 [N, K]; ids int64 [N, K]) as the reference.

    Numerics: module doc. N > 8 runs the reference op.

    Raises:
        ValueError: a dtype, shape, device or contiguity mismatch (names the argument).
    """
    op = "moe_topk_gate_up"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise _err(op, "x", "a bf16 tensor [N, H]", x)
    if not x.is_contiguous():
        raise _err(op, "x", "contiguous", x)
    if not (1 <= x.shape[0] <= MAX_N):
        return _reference(op)(x, logits, bias, gate, up, shared_gate, shared_up, top_k, scaling)
    return _gate_up_launch(op, x, logits, bias, None, gate, up, shared_gate, shared_up, top_k,
                           scaling, use_pdl)


def moe_gate_up(x, ids, gate, up, shared_gate, shared_up, *, use_pdl: bool = False):
    """`flintc::moe_gate_up`: `gate_up_kernel` with the ids read from memory (no routing).
    x: bf16 [N, H]; ids: int64 [N, K]; weights as `moe_topk_gate_up`. -> h bf16
    [N, K(+1), F]. Numerics: module doc. N > 8 runs the reference op. Raises ValueError on
    a bad argument (named)."""
    op = "moe_gate_up"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise _err(op, "x", "a bf16 tensor [N, H]", x)
    if not x.is_contiguous():
        raise _err(op, "x", "contiguous", x)
    if not (1 <= x.shape[0] <= MAX_N):
        return _reference(op)(x, ids, gate, up, shared_gate, shared_up)
    return _gate_up_launch(op, x, None, None, ids, gate, up, shared_gate, shared_up, 0, 0.0,
                           use_pdl)[0]


def _down_launch(op, h, ids, weights, down, shared_down, residual, use_pdl):
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
    out = torch.empty((N, H), dtype=torch.bfloat16, device=dev)
    native = _native(dev)
    block_h = 16 if native else min(128, max(16, triton.next_power_of_2(H)))
    pdl, opts = _launch_opts(use_pdl, dev)
    down_kernel[(triton.cdiv(H, block_h),)](
        h, ids, weights, *d, *sd, residual if residual is not None else out, out, N, F, H,
        gs_stride, ids.stride(0), weights.stride(0), BLOCK_N=_block_n(N), BLOCK_H=block_h,
        BLOCK_F=max(64, triton.next_power_of_2(F)),
        BLOCK_NK=triton.next_power_of_2(max(N * K, 2)), TOP_K=K,
        TOPK_PAD=triton.next_power_of_2(max(K, 2)), HAS_SHARED=has_shared,
        HAS_RESIDUAL=residual is not None, IS_NVFP4=nv, USE_PDL=pdl, DOT_BF16=native,
        num_warps=4, **opts)
    return out


def moe_down_combine_residual(h, ids, weights, down, shared_down, residual, *,
                              use_pdl: bool = False) -> torch.Tensor:
    """`flintc::moe_down_combine_residual` (kernel 7): down GEMVs of the selected and shared
    experts, fp32 weighted combine, residual add; one launch (grid: H / BLOCK_H programs,
    each reading every distinct expert's rows once).

    Args:
        h: bf16 [N, K(+1), F] from kernel 6; ids: int64 [N, K]; weights: fp32 [N, K].
        down: stacked [E, H, F]: `[w]` bf16 or NVFP4 `[codes [E, H, F/2], scales
            [E, H, F/16], global_scale [E] or []]`; shared_down: [H, F] or [].
        residual: bf16 [..., H] with N rows, contiguous.
        use_pdl: programmatic dependent launch (CUDA only); the shared expert's tile loads
            before `gdc_wait`.

    Returns:
        bf16 residual.shape: `bf16(residual + bf16(sum_k w_k * bf16(y_k) + bf16(y_shared)))`.

    Numerics: module doc (combine in the reference's order). N > 8 or F > 1024 runs the
    reference op.

    Raises:
        ValueError: a dtype, shape, device or contiguity mismatch (names the argument).
    """
    op = "moe_down_combine_residual"
    if not isinstance(residual, torch.Tensor) or residual.dtype != torch.bfloat16 \
            or residual.dim() < 1 or not residual.is_contiguous():
        raise _err(op, "residual", "a contiguous bf16 tensor [..., H]", residual)
    if not isinstance(h, torch.Tensor) or h.dim() != 3 or not (1 <= h.shape[0] <= MAX_N) \
            or h.shape[2] > MAX_F:
        if isinstance(h, torch.Tensor) and h.dim() == 3:
            return _reference(op)(h, ids, weights, down, shared_down, residual)
        raise _err(op, "h", "a bf16 tensor [N, K(+1), F]", h)
    N = h.shape[0]
    if residual.numel() != N * residual.shape[-1] or residual.device != h.device:
        raise _err(op, "residual", f"a bf16 tensor [..., H] with {N} rows on {h.device}",
                   residual)
    out = _down_launch(op, h, ids, weights, down, shared_down,
                       residual.view(N, residual.shape[-1]), use_pdl)
    if out.shape[1] != residual.shape[-1]:
        raise _err(op, "residual", f"[..., {out.shape[1]}] (H of down)", residual)
    return out.view(residual.shape)


def moe_down_combine(h, ids, weights, down, shared_down, *, use_pdl: bool = False):
    """`flintc::moe_down_combine`: `down_kernel` without the residual add.
    Shapes as `moe_down_combine_residual`; -> bf16 [N, H] = `bf16(sum_k w_k * bf16(y_k) +
    bf16(y_shared))`. N > 8 or F > 1024 runs the reference op. Raises ValueError on a bad
    argument (named)."""
    op = "moe_down_combine"
    if isinstance(h, torch.Tensor) and h.dim() == 3 and not (
            1 <= h.shape[0] <= MAX_N and h.shape[2] <= MAX_F):
        return _reference(op)(h, ids, weights, down, shared_down)
    return _down_launch(op, h, ids, weights, down, shared_down, None, use_pdl)


KERNELS: dict[str, Callable] = {
    "norm_router": norm_router,
    "moe_topk_gate_up": moe_topk_gate_up,
    "moe_down_combine_residual": moe_down_combine_residual,
    "moe_route": moe_route,
    "moe_gate_up": moe_gate_up,
    "moe_down_combine": moe_down_combine,
}
