"""The GEMV kernels of the low-latency decode schedule (FLINT_SPEC section 5), one launch each.

References (the oracles, `torch.ops.flintc.<op>`): `flintc.ops.grouped.norm_qkv_rope_kv`,
`gemv_residual`, `norm_gate_up_silu`, `norm_lm_head`; `flintc.ops.linear.gemv`,
`lm_head`, `embedding`; and `flintc.ops.norm.rms_norm` (the final norm when a build splits
it from the LM head, `split_lm_head_norm`: the prefill's kernel, with PDL). Every launcher
takes the op's positional arguments (weights as `[w]` bf16 or `[codes, scales,
global_scale]` NVFP4, packed layout of `flintc.quant.nvfp4`) plus keyword-only `use_pdl`,
and returns what the op returns.

Shared machinery is `flintc.kernels.gemv`: the GEMV main loop (bf16 / NVFP4 W4A16,
tensor-core or FMA reduction), the RMSNorm prologue recomputed per program (x is only
[N, H]: 2 * 8 * 2048 bytes, L2-resident), and one-launch split-K (the last-arriving
split per output block sums the partials in split order and runs the epilogue, so
epilogues that need a whole row, like the per-head norm, see the full reduction).

Numerics: every rounding point of the references is kept (normed x rounded to bf16;
q, k, v, gate, up, the O / down GEMV each rounded once after the GEMV; after the head
norm; after RoPE; after SiLU-and-mul; after the residual add; logits never rounded).
Differences from the references come only from (a) the GEMV's summation order (bounded
by `K * 2^-24 * sum_k |x_k w_k|`), (b) the order of the RMSNorm sums of squares and, on
the GPU, Triton's exp (sigmoid) and FMA contraction in RoPE: a value that lands on a bf16
rounding boundary can come out one bf16 ulp away, which then propagates through the
following rounding points. `embedding` is bit-exact.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from flintc.kernels import prefill_norm
from flintc.kernels.gemv import (
    EPI_BF16,
    EPI_FP32,
    EPI_RESIDUAL,
    MAX_N,
    GemvConfig,
    _bf16_grid,
    _effective_split,
    _gemv_loop,
    _gemv_loop_flat,
    _is_last,
    _load_w,
    _rms_rstd,
    _round_to_bf16,
    _splitk_combine,
    auto_split_k,
    check_tensor,
    check_weight,
    check_x2d,
    choose_config,
    fail,
    launch_gemv,
    split_k_counters,
    tuned_config,
)
from flintc.kernels.gemv import gemv as _gemv
from flintc.kernels.gemv import lm_head as lm_head
from flintc.kernels.pdl import pdl_mode
from flintc.kernels.platform import interpreting


# ----------------------------------------------------------------------------- kernels
@triton.jit
def norm_qkv_rope_kv_kernel(
    x_ptr, nw_ptr,  # x bf16 [N, H] (N = B, T = 1); input RMSNorm weight fp32/bf16 [H]
    wq_ptr, sq_ptr, gq_ptr,  # Wq bf16 [HQ*D, H] or NVFP4 codes / scales / global scale
    wk_ptr, sk_ptr, gk_ptr,  # Wk [HKV*D, H]
    wv_ptr, sv_ptr, gv_ptr,  # Wv [HKV*D, H]
    qn_ptr, kn_ptr,  # per-head RMSNorm weights fp32/bf16 [D]
    cos_ptr, sin_ptr,  # RoPE tables fp32 [P, D/2]
    kc_ptr, vc_ptr,  # caches bf16 [num_slots, S, HKV, D], contiguous
    slots_ptr, pos_ptr,  # slots int [B]; positions int64 [B, 1]
    q_ptr,  # out: q bf16 [B, 1, HQ, D]
    ws_ptr, cnt_ptr,  # split-K workspace fp32 [SPLIT_K, N, (HQ + 2 HKV) * D]; counters
    N, H, S, eps, window,
    K_PER_SPLIT,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    IS_NVFP4: tl.constexpr, ROPE: tl.constexpr, USE_DOT: tl.constexpr,
    SCALE_AFTER: tl.constexpr, USE_PDL: tl.constexpr, GPU: tl.constexpr,
    PREFETCH: tl.constexpr,
    ACC_FULL: tl.constexpr,  # FMA path: whole-tile accumulator (see _gemv_loop)
    NR: tl.constexpr, NORM_H: tl.constexpr,  # next_pow2(N), next_pow2(H): RMSNorm prologue
    FLAT: tl.constexpr = False,  # tensor cores with 2-D tiles (`_gemv_loop_flat`)
    SWAP: tl.constexpr = False,  # tensor cores: weight tile as the dot's left operand
):
    # Tile-to-program mapping: program (head, pid_k) owns one whole head of the
    # concatenated [Q; K; V] rows (D rows: heads 0..HQ-1 are q, then HKV k heads, then
    # HKV v heads) over columns [pid_k * K_PER_SPLIT, ...). Its D rows are loaded
    # interleaved, local row j -> head row (j % 2) * D/2 + j // 2, so that the
    # accumulator splits into the two RoPE halves [N, D/2] without a shuffle.
    head = tl.program_id(0)
    pid_k = tl.program_id(1)
    j = tl.arange(0, D)
    local = (j % 2) * (D // 2) + j // 2
    mask_f = j < D
    if head < HQ:
        r0 = head * D
        w_base = wq_ptr
        s_base = sq_ptr
        g_ptr = gq_ptr
    elif head < HQ + HKV:
        r0 = (head - HQ) * D
        w_base = wk_ptr
        s_base = sk_ptr
        g_ptr = gk_ptr
    else:
        r0 = (head - HQ - HKV) * D
        w_base = wv_ptr
        s_base = sv_ptr
        g_ptr = gv_ptr
    rows = (r0 + local).to(tl.int64)
    if IS_NVFP4:
        w_rows = w_base + rows * (H // 2)
        s_rows = s_base + rows * (H // 16)
    else:
        w_rows = w_base + rows * H
        s_rows = w_rows
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(H, k_start + K_PER_SPLIT)
    n_iters = tl.cdiv(k_end - k_start, BLOCK_K)
    # the first weight tile goes out before gdc_wait (PDL overlap); a no-op without PREFETCH
    w0, s0 = _load_w(w_rows, s_rows, mask_f, k_start, k_end if PREFETCH else k_start,
                     BLOCK_K, IS_NVFP4)
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by the previous kernel
    rstd = _rms_rstd(x_ptr, H, offs_n, N, H, eps, NR, NORM_H)
    if FLAT:
        acc = _gemv_loop_flat(w_rows, s_rows, mask_f, x_ptr, H, nw_ptr, rstd, offs_n, mask_n,
                              k_start, k_end, n_iters, BLOCK_N, D, BLOCK_K, IS_NVFP4, True, GPU,
                              SWAP)
    else:
        acc = _gemv_loop(w0, s0, w_rows, s_rows, mask_f, x_ptr, H, nw_ptr, rstd, offs_n,
                         mask_n, k_start, k_end, n_iters, BLOCK_N, D, BLOCK_K, IS_NVFP4, True,
                         USE_DOT, SCALE_AFTER, GPU, PREFETCH, ACC_FULL, SWAP)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()

    d2 = tl.arange(0, D // 2)
    mask_h = mask_n[:, None] & (d2 < D // 2)[None, :]  # [N, D/2]
    if SPLIT_K > 1:
        acc, arrived = _splitk_combine(acc, ws_ptr, cnt_ptr, head, pid_k, offs_n, head * D + j,
                                       mask_n, mask_f, N, (HQ + 2 * HKV) * D, SPLIT_K,
                                       BLOCK_N, D)
        mask_h = mask_h & _is_last(arrived, SPLIT_K, BLOCK_N, D // 2)
    if IS_NVFP4:
        acc = acc * tl.load(g_ptr)
    y = _bf16_grid(acc)  # q / k / v rounded after the GEMV
    lo, hi = tl.split(tl.reshape(y, (BLOCK_N, D // 2, 2)))  # dims [0, D/2) and [D/2, D)
    if head < HQ + HKV:
        # The head norm's weights, loaded in each branch as fp32: q_norm and k_norm may
        # differ in dtype (fp32 / bf16), and a pointer chosen by the branch would not
        # compile then (Triton needs one type per variable across an if).
        if head < HQ:
            nw_lo = tl.load(qn_ptr + d2).to(tl.float32)
            nw_hi = tl.load(qn_ptr + D // 2 + d2).to(tl.float32)
        else:
            nw_lo = tl.load(kn_ptr + d2).to(tl.float32)
            nw_hi = tl.load(kn_ptr + D // 2 + d2).to(tl.float32)
        # per-head RMSNorm over D (fp32, one rounding)
        ss = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)
        r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, D * 1.0) + eps))
        lo = _bf16_grid(lo * r[:, None] * nw_lo[None, :])
        hi = _bf16_grid(hi * r[:, None] * nw_hi[None, :])
        if ROPE:
            # rotate-half RoPE (flintc.model.ops.apply_rope) with the table rows at
            # each sequence's position, fp32 from the normed bf16 values, one rounding.
            pos = tl.load(pos_ptr + offs_n, mask=mask_n, other=0)
            t_offs = pos[:, None] * (D // 2) + d2[None, :]
            c = tl.load(cos_ptr + t_offs, mask=mask_n[:, None], other=0.0)
            s = tl.load(sin_ptr + t_offs, mask=mask_n[:, None], other=0.0)
            new_lo = _bf16_grid(lo * c - hi * s)
            new_hi = _bf16_grid(hi * c + lo * s)
            lo = new_lo
            hi = new_hi
    if head < HQ:
        q_offs = offs_n[:, None] * (HQ * D) + head * D + d2[None, :]
        tl.store(q_ptr + q_offs, lo.to(tl.bfloat16), mask=mask_h)
        tl.store(q_ptr + q_offs + D // 2, hi.to(tl.bfloat16), mask=mask_h)
    else:
        # KV-cache write (flintc.ops.attention.write_kv, T = 1): row = position (full
        # layers, window 0) or position % window (ring of a sliding layer).
        pos = tl.load(pos_ptr + offs_n, mask=mask_n, other=0)
        slot = tl.load(slots_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        live = slot >= 0  # a negative slot is a padding row (flintc.ops.attention.pad_slot)
        slot = tl.maximum(slot, 0)
        if window > 0:
            row = pos % window
        else:
            row = pos
        kvh = (head - HQ) % HKV
        c_offs = ((slot * S + row) * HKV + kvh) * D
        c_offs = c_offs[:, None] + d2[None, :]
        # never write outside the cache, nor for padding rows
        mask_c = mask_h & (live & (row >= 0) & (row < S))[:, None]
        if head < HQ + HKV:
            tl.store(kc_ptr + c_offs, lo.to(tl.bfloat16), mask=mask_c)
            tl.store(kc_ptr + c_offs + D // 2, hi.to(tl.bfloat16), mask=mask_c)
        else:
            tl.store(vc_ptr + c_offs, lo.to(tl.bfloat16), mask=mask_c)
            tl.store(vc_ptr + c_offs + D // 2, hi.to(tl.bfloat16), mask=mask_c)


@triton.jit
def norm_gate_up_silu_kernel(
    x_ptr, nw_ptr,  # x bf16 [N, H]; post-attention RMSNorm weight fp32/bf16 [H]
    wg_ptr, sg_ptr, gg_ptr,  # gate bf16 [F, H] or NVFP4 codes / scales / global scale
    gu_ptr,  # up's NVFP4 global scale
    w_delta, s_delta,  # up's weight (scales) start minus gate's, in elements (same dtype)
    out_ptr,  # bf16 [N, F]
    ws_ptr, cnt_ptr,  # split-K workspace fp32 [SPLIT_K, N, 2F]; counters
    N, F, H, eps,
    K_PER_SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, IS_NVFP4: tl.constexpr, USE_DOT: tl.constexpr,
    SCALE_AFTER: tl.constexpr, USE_PDL: tl.constexpr, GPU: tl.constexpr,
    PREFETCH: tl.constexpr,
    ACC_FULL: tl.constexpr,  # FMA path: whole-tile accumulator (see _gemv_loop)
    NR: tl.constexpr, NORM_H: tl.constexpr,  # next_pow2(N), next_pow2(H): RMSNorm prologue
    FLAT: tl.constexpr = False,  # tensor cores with 2-D tiles (`_gemv_loop_flat`)
    SWAP: tl.constexpr = False,  # tensor cores: weight tile as the dot's left operand
):
    # Tile-to-program mapping: program (pid_f, pid_k) owns output columns
    # [pid_f * BLOCK_F, (pid_f + 1) * BLOCK_F): 2 * BLOCK_F weight rows, gate and up rows
    # interleaved (local row j: gate row f0 + j // 2 when j is even, up row when odd),
    # one K loop for both; the accumulator splits into (gate, up) [N, BLOCK_F].
    pid_f = tl.program_id(0)
    pid_k = tl.program_id(1)
    j = tl.arange(0, 2 * BLOCK_F)
    f = pid_f * BLOCK_F + j // 2
    mask_f = f < F
    is_up = (j % 2) == 1
    # One base pointer plus an integer offset to up's rows: a select (tl.where) between
    # two pointers or offsets hides the alignment from Triton's axis analysis and turns
    # the 16-byte weight loads into 2-byte ones (checked in the sm_90 PTX).
    if IS_NVFP4:
        w_rows = wg_ptr + (is_up.to(tl.int64) * w_delta + f.to(tl.int64) * (H // 2))
        s_rows = sg_ptr + (is_up.to(tl.int64) * s_delta + f.to(tl.int64) * (H // 16))
    else:
        w_rows = wg_ptr + (is_up.to(tl.int64) * w_delta + f.to(tl.int64) * H)
        s_rows = w_rows
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(H, k_start + K_PER_SPLIT)
    n_iters = tl.cdiv(k_end - k_start, BLOCK_K)
    # the first weight tile goes out before gdc_wait (PDL overlap); a no-op without PREFETCH
    w0, s0 = _load_w(w_rows, s_rows, mask_f, k_start, k_end if PREFETCH else k_start,
                     BLOCK_K, IS_NVFP4)
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    rstd = _rms_rstd(x_ptr, H, offs_n, N, H, eps, NR, NORM_H)
    if FLAT:
        acc = _gemv_loop_flat(w_rows, s_rows, mask_f, x_ptr, H, nw_ptr, rstd, offs_n, mask_n,
                              k_start, k_end, n_iters, BLOCK_N, 2 * BLOCK_F, BLOCK_K, IS_NVFP4,
                              True, GPU, SWAP)
    else:
        acc = _gemv_loop(w0, s0, w_rows, s_rows, mask_f, x_ptr, H, nw_ptr, rstd, offs_n,
                         mask_n, k_start, k_end, n_iters, BLOCK_N, 2 * BLOCK_F, BLOCK_K,
                         IS_NVFP4, True, USE_DOT, SCALE_AFTER, GPU, PREFETCH, ACC_FULL, SWAP)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()

    offs_o = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_o = mask_n[:, None] & (offs_o < F)[None, :]
    if SPLIT_K > 1:
        acc, arrived = _splitk_combine(acc, ws_ptr, cnt_ptr, pid_f, pid_k, offs_n,
                                       pid_f * 2 * BLOCK_F + j, mask_n, mask_f, N, 2 * F,
                                       SPLIT_K, BLOCK_N, 2 * BLOCK_F)
        mask_o = mask_o & _is_last(arrived, SPLIT_K, BLOCK_N, BLOCK_F)
    g, u = tl.split(tl.reshape(acc, (BLOCK_N, BLOCK_F, 2)))
    if IS_NVFP4:
        g = g * tl.load(gg_ptr)
        u = u * tl.load(gu_ptr)
    g = _bf16_grid(g)  # gate and up rounded after their GEMVs
    u = _bf16_grid(u)
    h = g * tl.sigmoid(g) * u  # SiLU-and-mul in fp32, one rounding
    tl.store(out_ptr + offs_n[:, None] * F + offs_o[None, :], _round_to_bf16(h), mask=mask_o)


@triton.jit
def embedding_kernel(ids_ptr, table_ptr, out_ptr, V, H, BLOCK_H: tl.constexpr,
                     USE_PDL: tl.constexpr):
    # One program per token: out[t, :] = table[ids[t], :] (ids outside [0, V) give zeros).
    t = tl.program_id(0)
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # ids may be written by the previous kernel (sampling)
    idx = tl.load(ids_ptr + t + tl.zeros((BLOCK_H,), dtype=tl.int32))  # the id, per lane
    ok = (idx >= 0) & (idx < V)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        m = offs < H
        row = tl.load(table_ptr + idx.to(tl.int64) * H + offs, mask=m & ok, other=0.0)
        tl.store(out_ptr + t.to(tl.int64) * H + offs, row, mask=m)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()


# ----------------------------------------------------------------------------- helpers
def _launch_opts(device: torch.device, use_pdl: bool, cfg: GemvConfig | None):
    gpu = device.type == "cuda" and not interpreting()
    pdl = bool(use_pdl) and gpu
    extra = {"launch_pdl": True} if pdl else {}
    if gpu and cfg is not None:
        extra["num_stages"] = cfg.num_stages
    return gpu, pdl, extra


def _check_norm(op: str, name: str, t, size: int, device) -> None:
    check_tensor(op, name, t, (torch.float32, torch.bfloat16), (size,), device)


def _elem_delta(b: torch.Tensor, a: torch.Tensor) -> int:
    """(b's address - a's address) in elements of their common dtype: lets one kernel
    pointer reach two tensors (same device, flat address space)."""
    diff = b.data_ptr() - a.data_ptr()
    size = a.element_size()
    if b.dtype != a.dtype or diff % size:
        raise ValueError(f"tensors {a.dtype} and {b.dtype} are not element-aligned to each other")
    return diff // size


def _workspace(split: int, N: int, F: int, num_counters: int, like: torch.Tensor):
    if split > 1:
        return (torch.empty((split, N, F), dtype=torch.float32, device=like.device),
                split_k_counters(like.device, num_counters))
    return like, like  # unused


def qkv_config(N: int, H: int, D: int, num_heads: int, fmt: str,
               device: torch.device, *, kv_heads: int) -> GemvConfig:
    """Config of the fused QKV kernel: one head (D rows) per program, so only the
    reduction kind, block_k, split-K, warps and stages are free. From `gemv.TUNED` under
    ("qkv:" + fmt, Hq * D, H, N) (num_heads = Hq) when present, else: dot, block_k 128, 8
    warps (128-row tiles spill with 4), bf16 over flat 2-D tiles staged by Triton's
    pipeliner (3 stages; the session 9 sweep's winner at N = 1 and 8), NVFP4 3-D tiles
    with the register prefetch; split-K to ~2 programs per SM over all Hq + 2 Hkv head
    programs (kv_heads = Hkv; counting only the Hq query heads gave the full model 320
    programs of 8 warps for 264 resident slots, 1.21 waves; Nsight Compute, session 11)."""
    hit = tuned_config(("qkv:" + fmt, num_heads * D, H, N))
    if hit is not None:
        return hit
    if device.type != "cuda":
        return GemvConfig(use_dot=True, block_f=D, block_k=64, split_k=1)
    split = auto_split_k(num_heads + 2 * kv_heads, H, 128, device)
    if fmt == "nvfp4":
        return GemvConfig(use_dot=True, block_f=D, block_k=128, split_k=split, num_warps=8,
                          num_stages=1, prefetch=True)
    return GemvConfig(use_dot=True, block_f=D, block_k=128, split_k=split, num_warps=8,
                      num_stages=3, prefetch=False, flat=True)


# ----------------------------------------------------------------------------- launchers
def norm_qkv_rope_kv(x, norm, wq, wk, wv, q_norm, k_norm, cos_table, sin_table, k_cache,
                     v_cache, slots, positions, eps, num_heads, num_kv_heads, rope, window,
                     *, use_pdl: bool = False, config: GemvConfig | None = None):
    """Kernel 1 of the decode schedule, as `flintc::norm_qkv_rope_kv` (reference:
    `flintc.ops.grouped.norm_qkv_rope_kv`): input RMSNorm, Q/K/V GEMVs in one launch over
    the concatenated rows, per-head Q/K RMSNorm, rotate-half RoPE from the table rows at
    `positions` (when `rope`), KV-cache write; returns q.

    Args:
        x: bf16 [B, 1, H] (decode: T = 1; T > 1 or B > 8 falls back to the reference op).
        norm: fp32/bf16 [H]. wq: [Hq*D, H], wk, wv: [Hkv*D, H], bf16 or NVFP4 (all
            three the same format; NVFP4 in the packed layout or the mma layout of
            `flintc.kernels.nvfp4_mma.prepack`, which runs on the CUDA kernel only).
            Without a config both formats run on the CUDA kernel `nvfp4_mma.mma_qkv`
            where it applies (sm_90+, H % 64 == 0, D % 16 == 0 and <= 256), else on
            Triton.
            q_norm, k_norm: fp32/bf16 [D].
        cos_table, sin_table: fp32 [P, D/2] contiguous.
        k_cache, v_cache: bf16 [num_slots, S, Hkv, D] contiguous, written in place at
            row positions[b] (window 0) or positions[b] % window (ring); only those
            rows change. positions must be < S for full layers (rows outside [0, S) are
            not written; the reference would raise).
        slots: int32/int64 [B]; a negative slot marks a padding row, whose K/V are not
            written (`flintc.ops.attention.pad_slot`). positions: int64 [B, 1]
            (non-negative, < P).
        eps: RMSNorm epsilon; num_heads, num_kv_heads: Hq, Hkv; D a power of two.
        use_pdl: programmatic dependent launch (CUDA only).
        config: GemvConfig (block_f is ignored: one head per program).

    Returns:
        q bf16 [B, 1, Hq, D] (normed, rotated).

    Numerics: the reference's rounding points; see the module docstring for the bound.
    Bytes read: weights ((Hq + 2 Hkv) * D * H * 2 bf16, / 4 + scales NVFP4), x and norm
    per program from L2, 2 table rows; written: q, one K and one V row per sequence.

    Raises:
        ValueError: a dtype, shape, device or contiguity mismatch, naming the argument;
            mma-layout weights where the CUDA kernel cannot run.
    """
    op = "norm_qkv_rope_kv"
    if isinstance(x, torch.Tensor) and x.dim() == 3 and (x.shape[1] != 1 or x.shape[0] > MAX_N):
        from flintc.ops import grouped
        return grouped.norm_qkv_rope_kv(x, norm, wq, wk, wv, q_norm, k_norm, cos_table,
                                        sin_table, k_cache, v_cache, slots, positions, eps,
                                        num_heads, num_kv_heads, rope, window)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 3 \
            or not 1 <= x.shape[0] <= MAX_N:
        fail(op, "x", f"a bf16 tensor [B, 1, H] with 1 <= B <= {MAX_N}", x)
    check_tensor(op, "x", x, torch.bfloat16, None, x.device)
    B, _, H = x.shape
    dev = x.device
    Hq, Hkv = int(num_heads), int(num_kv_heads)
    if Hq < 1 or Hkv < 1 or Hq % Hkv:
        fail(op, "num_heads", f"a multiple of num_kv_heads >= 1 (got {Hq} and {Hkv})")
    fmt, FQ, wq_args = check_weight(op, "wq", wq, H, dev, mma_ok=True)
    if FQ % Hq:
        fail(op, "wq", f"[num_heads * D, H] (F = {FQ}, num_heads = {Hq})")
    D = FQ // Hq
    if D < 16 or D & (D - 1):
        fail(op, "wq", f"heads of a power-of-two dim >= 16 (D = {D})")
    fk, _, wk_args = check_weight(op, "wk", wk, H, dev, F=Hkv * D, mma_ok=True)
    fv, _, wv_args = check_weight(op, "wv", wv, H, dev, F=Hkv * D, mma_ok=True)
    if not fk == fv == fmt:
        fail(op, "wk/wv", f"the same format as wq ({fmt})")
    _check_norm(op, "norm", norm, H, dev)
    _check_norm(op, "q_norm", q_norm, D, dev)
    _check_norm(op, "k_norm", k_norm, D, dev)
    check_tensor(op, "cos_table", cos_table, torch.float32, None, dev)
    if cos_table.dim() != 2 or cos_table.shape[1] != D // 2:
        fail(op, "cos_table", f"fp32 [P, {D // 2}]", cos_table)
    check_tensor(op, "sin_table", sin_table, torch.float32, tuple(cos_table.shape), dev)
    check_tensor(op, "k_cache", k_cache, torch.bfloat16, None, dev)
    if k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (Hkv, D):
        fail(op, "k_cache", f"bf16 [num_slots, S, {Hkv}, {D}]", k_cache)
    check_tensor(op, "v_cache", v_cache, torch.bfloat16, tuple(k_cache.shape), dev)
    check_tensor(op, "slots", slots, (torch.int32, torch.int64), (B,), dev)
    check_tensor(op, "positions", positions, torch.int64, (B, 1), dev)
    S = k_cache.shape[1]
    if not isinstance(window, int) or window < 0 or window > S:
        fail(op, "window", f"an int in [0, S = {S}] (0: full layer), got {window!r}")
    q = torch.empty((B, 1, Hq, D), dtype=torch.bfloat16, device=dev)
    if config is None and _mma_qkv(
            x.view(B, H), norm, wq, wk, wv, q_norm, k_norm, cos_table, sin_table, k_cache,
            v_cache, slots, positions, eps, Hq, Hkv, rope, window, q, fmt == "nvfp4-mma",
            use_pdl):
        return q
    if fmt == "nvfp4-mma":
        from flintc.kernels.nvfp4_mma import refusal_note

        fail(op, "wq", "in the packed NVFP4 layout here: the mma layout runs on the CUDA kernel "
             "only (sm_90+, NVRTC, no config; H % 64 == 0, "
             "D % 16 == 0 and D <= 256)" + refusal_note(dev, config))
    cfg = config or qkv_config(B, H, D, Hq, fmt, dev, kv_heads=Hkv)
    gpu, pdl, extra = _launch_opts(dev, use_pdl, cfg)
    split, k_per_split = _effective_split(H, cfg.block_k, cfg.split_k)
    n_heads = Hq + 2 * Hkv
    ws, cnt = _workspace(split, B, n_heads * D, n_heads, x)
    norm_qkv_rope_kv_kernel[(n_heads, split)](
        x, norm, *wq_args, *wk_args, *wv_args, q_norm, k_norm, cos_table, sin_table,
        k_cache, v_cache, slots, positions, q, ws, cnt,
        B, H, S, float(eps), int(window), k_per_split,
        HQ=Hq, HKV=Hkv, D=D, BLOCK_N=16 if cfg.use_dot else triton.next_power_of_2(B),
        BLOCK_K=cfg.block_k, SPLIT_K=split, IS_NVFP4=fmt == "nvfp4", ROPE=bool(rope),
        USE_DOT=cfg.use_dot, SCALE_AFTER=cfg.scale_after and fmt == "nvfp4", USE_PDL=pdl_mode(pdl),
        GPU=gpu, PREFETCH=cfg.prefetch and not (cfg.flat and cfg.use_dot),
        ACC_FULL=cfg.acc_full and not cfg.use_dot, FLAT=cfg.flat and cfg.use_dot,
        SWAP=cfg.swap and cfg.use_dot, NR=triton.next_power_of_2(B),
        NORM_H=triton.next_power_of_2(H), num_warps=cfg.num_warps, **extra,
    )
    return q


def _mma_qkv(x2, norm, wq, wk, wv, q_norm, k_norm, cos_table, sin_table, k_cache, v_cache,
             slots, positions, eps, Hq, Hkv, rope, window, q, converted: bool,
             use_pdl: bool) -> bool:
    """The fused QKV on the CUDA `mma.sync` kernel (`nvfp4_mma.mma_qkv`; NVFP4 or bf16
    weights) where it applies: a CUDA sm_90+ device (`nvfp4_mma.supported` for converted
    weights, else `nvfp4_mma.available`, which FLINTC_NVFP4_MMA=0 turns off), outside the
    interpreter (converted weights: even inside it, having no Triton path), H % 64 == 0, D % 16 == 0 and D <= 256, bf16 weights 16-byte aligned (x
    is copied when it is not). Returns False (the caller runs the Triton kernel) otherwise, or
    when packed weights are first seen during CUDA-graph capture (their repack cannot be
    captured)."""
    from flintc.kernels import nvfp4_mma

    B, H = x2.shape
    D = q.shape[-1]
    if (interpreting() and not converted) \
            or not nvfp4_mma.qkv_applies(H, D, "bf16" if len(wq) == 1 else "nvfp4"):
        return False  # converted weights: no Triton path, so the CUDA kernel even then
    if not (nvfp4_mma.supported(x2.device) if converted else nvfp4_mma.available(x2.device)):
        return False
    if x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    if len(wq) == 1 and any(w[0].data_ptr() % 16 for w in (wq, wk, wv)):
        return False  # bf16 is read in place in 16-byte vectors
    try:
        nvfp4_mma.mma_qkv(x2, norm, wq, wk, wv, q_norm, k_norm, cos_table, sin_table, k_cache,
                          v_cache, slots, positions.reshape(B, 1), float(eps), Hq, Hkv,
                          bool(rope), int(window), q, use_pdl=use_pdl)
    except RuntimeError:  # packed weights first seen while capturing a CUDA graph (their
        if not torch.cuda.is_current_stream_capturing():  # repack is eager): Triton
            raise
        return False
    return True


def gemv_residual(x, w, residual, *, use_pdl: bool = False, config: GemvConfig | None = None):
    """O projection / dense down projection with the residual add in the epilogue, as
    `flintc::gemv_residual` (reference: `flintc.ops.grouped.gemv_residual`):
    `bf16(residual + bf16(x @ W^T))`.

    x: bf16 [..., K] contiguous with N = x.numel() / K rows (N > 8 falls back to the
    reference op); w: bf16 [F, K] or NVFP4, packed or in the mma layout (as `gemv`);
    residual: bf16 [...] contiguous with N * F
    elements and last dim F. -> bf16 shaped like residual. Numerics: the GEMV bound, then
    the reference's two roundings. Raises ValueError naming a bad argument.
    """
    op = "gemv_residual"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() < 1:
        fail(op, "x", "a bf16 tensor [..., K]", x)
    K = x.shape[-1]
    N = x.numel() // max(K, 1)
    if N > MAX_N:
        from flintc.ops import grouped
        return grouped.gemv_residual(x, w, residual)
    check_tensor(op, "x", x, torch.bfloat16, None, x.device)
    x2 = x.view(N, K)
    check_x2d(op, x2)
    fmt, F, wargs = check_weight(op, "w", w, K, x.device, mma_ok=True)
    check_tensor(op, "residual", residual, torch.bfloat16, None, x.device)
    if residual.numel() != N * F or residual.shape[-1] != F:
        fail(op, "residual", f"a bf16 tensor [..., {F}] with {N} rows", residual)
    out = torch.empty_like(residual)
    return launch_gemv(op, x2, wargs, fmt, F, out, EPI_RESIDUAL, residual=residual,
                       config=config, use_pdl=use_pdl)


def norm_gate_up_silu(x, norm, gate, up, eps, *, use_pdl: bool = False,
                      config: GemvConfig | None = None):
    """Dense MLP kernel 5, as `flintc::norm_gate_up_silu` (reference:
    `flintc.ops.grouped.norm_gate_up_silu`): RMSNorm prologue, gate and up GEMVs in one
    K loop, `bf16(silu(g) * u)` with g, u rounded to bf16 first.

    x: bf16 [..., H] contiguous, N = x.numel() / H rows (N > 8 falls back to the
    reference op); norm: fp32/bf16 [H]; gate, up: [F, H] bf16 or NVFP4 (same format;
    NVFP4 packed, or in the mma layout of `flintc.kernels.nvfp4_mma.prepack`, which only
    the CUDA kernel reads). Without a config, NVFP4 and bf16 at N = 2-4
    (`nvfp4_mma.norm_gate_up_formats`, `NORM_GATE_UP_BF16_N`) run on the CUDA kernel
    `nvfp4_mma.mma_norm_gate_up` where it applies
    (`_mma_norm_gate_up`), else the Triton kernel here. `config.block_f` counts output
    columns (2 * block_f weight rows per program); the default is `gate_up_config`'s.
    -> bf16 [N, F]. Raises ValueError naming a bad argument, or for mma-layout weights
    where the CUDA kernel cannot run.
    """
    op = "norm_gate_up_silu"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() < 1:
        fail(op, "x", "a bf16 tensor [..., H]", x)
    H = x.shape[-1]
    N = x.numel() // max(H, 1)
    if N > MAX_N:
        from flintc.ops import grouped
        return grouped.norm_gate_up_silu(x, norm, gate, up, eps)
    check_tensor(op, "x", x, torch.bfloat16, None, x.device)
    x2 = x.view(N, H)
    check_x2d(op, x2)
    dev = x.device
    fmt, F, g_args = check_weight(op, "gate", gate, H, dev, mma_ok=True)
    fu, _, u_args = check_weight(op, "up", up, H, dev, F=F, mma_ok=True)
    if fu != fmt:
        fail(op, "up", f"the same format as gate ({fmt})")
    _check_norm(op, "norm", norm, H, dev)
    if config is None:
        h = _mma_norm_gate_up(x2, norm, gate, up, eps, fmt, use_pdl)
        if h is not None:
            return h
    if fmt == "nvfp4-mma":
        from flintc.kernels.nvfp4_mma import refusal_note

        fail(op, "gate", "in the packed NVFP4 layout here: the mma layout runs on the CUDA "
             "kernel only (sm_90+, NVRTC, no config, and a "
             "launch that fits H and F: nvfp4_mma.norm_gate_up_fits)" + refusal_note(dev, config))
    out = torch.empty((N, F), dtype=torch.bfloat16, device=dev)
    cfg = config or gate_up_config(fmt, F, H, N, dev)
    gpu, pdl, extra = _launch_opts(dev, use_pdl, cfg)
    split, k_per_split = _effective_split(H, cfg.block_k, cfg.split_k)
    num_f = triton.cdiv(F, cfg.block_f)
    ws, cnt = _workspace(split, N, 2 * F, num_f, x)
    w_delta = _elem_delta(u_args[0], g_args[0])
    s_delta = _elem_delta(u_args[1], g_args[1]) if fmt == "nvfp4" else 0
    norm_gate_up_silu_kernel[(num_f, split)](
        x2, norm, *g_args, u_args[2], w_delta, s_delta, out, ws, cnt, N, F, H, float(eps),
        k_per_split,
        BLOCK_N=16 if cfg.use_dot else triton.next_power_of_2(N), BLOCK_F=cfg.block_f,
        BLOCK_K=cfg.block_k, SPLIT_K=split, IS_NVFP4=fmt == "nvfp4", USE_DOT=cfg.use_dot,
        SCALE_AFTER=cfg.scale_after and fmt == "nvfp4", USE_PDL=pdl_mode(pdl), GPU=gpu,
        PREFETCH=cfg.prefetch and not (cfg.flat and cfg.use_dot),
        ACC_FULL=cfg.acc_full and not cfg.use_dot, FLAT=cfg.flat and cfg.use_dot,
        SWAP=cfg.swap and cfg.use_dot, NR=triton.next_power_of_2(N),
        NORM_H=triton.next_power_of_2(H), num_warps=cfg.num_warps, **extra,
    )
    return out


def _mma_norm_gate_up(x2, norm, gate, up, eps, fmt: str, use_pdl: bool):
    """The dense gate/up on the CUDA `mma.sync` kernel (`nvfp4_mma.mma_norm_gate_up`) where
    it applies: weights in the mma layout (`nvfp4_mma.supported`), or a format of
    `nvfp4_mma.norm_gate_up_formats()` (`nvfp4_mma.available`, which FLINTC_NVFP4_MMA=0
    turns off), bf16 at the batches of `nvfp4_mma.NORM_GATE_UP_BF16_N` only; outside the
    interpreter unless converted (no Triton path reads them); a launch (`norm_gate_up_launch`) that fits H, F and N
    (`norm_gate_up_fits`); bf16 weights 16-byte aligned (x is copied when it is not).
    Returns h bf16 [N, F], or None (the caller runs the Triton kernel) otherwise, or when
    packed weights are first seen during CUDA-graph capture (their repack cannot be
    captured)."""
    from flintc.kernels import nvfp4_mma

    converted = fmt == "nvfp4-mma"
    base = "nvfp4" if converted else fmt
    if (interpreting() and not converted) or not (converted or base in nvfp4_mma.norm_gate_up_formats()):
        return None  # converted weights: no Triton path, so the CUDA kernel even then
    if base == "bf16" and x2.shape[0] not in nvfp4_mma.NORM_GATE_UP_BF16_N:
        return None
    if not (nvfp4_mma.supported(x2.device) if converted else nvfp4_mma.available(x2.device)):
        return None
    N, H = x2.shape
    F = nvfp4_mma.weight_dims(gate[0])[1] if base == "nvfp4" else gate[0].shape[0]
    launch = nvfp4_mma.norm_gate_up_launch(base, N)
    if nvfp4_mma.norm_gate_up_fits(H, F, N, launch):
        return None
    if base == "bf16" and any(w[0].data_ptr() % 16 or not w[0].is_contiguous()
                              for w in (gate, up)):
        return None  # bf16 is read in place in 16-byte vectors
    if x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    try:
        return nvfp4_mma.mma_norm_gate_up(x2, norm, list(gate), list(up), float(eps),
                                          launch=launch, use_pdl=use_pdl)
    except RuntimeError:  # packed weights first seen while capturing a CUDA graph (their
        if not torch.cuda.is_current_stream_capturing():  # repack is eager): Triton
            raise
        return None


def gate_up_config(fmt: str, F: int, H: int, N: int, device: torch.device) -> GemvConfig:
    """`norm_gate_up_silu`'s default configuration for weights in `fmt` ("bf16" or
    "nvfp4"), F output columns, H inputs, N tokens: the measured `gemv.TUNED` entry for N;
    bf16 without one, the tensor-core entry of the next larger tuned N (it serves any N up
    to 16); else `choose_config`'s pick for the 2F interleaved rows with block_f halved
    (block_f counts output columns). Raises ValueError for another format or N outside
    [1, 8]."""
    if fmt not in ("bf16", "nvfp4") or not isinstance(N, int) or not 1 <= N <= MAX_N:
        raise ValueError(f"gate_up_config: fmt must be 'bf16' or 'nvfp4' and N in [1, {MAX_N}]; "
                         f"got {fmt!r}, {N!r}")
    # bf16: the rule's 3-D tiles took 782.7 / 64.6 us at N = 2 / 4, the N = 8 entry 38.2 /
    # 39.4 (the N = 2 / 4 entries since session 17: 32.2 / 33.7); NVFP4: the rule (36.2 /
    # 35.4) beats the N = 8 entry (45.6 / 46.3) (docs/gpu-runs.md session 15, runs 9 and 11)
    for n in range(N, MAX_N + 1):
        cfg = tuned_config(("gate_up:" + fmt, F, H, n))
        if cfg is not None and (n == N or (cfg.use_dot and fmt == "bf16")):
            return cfg
    # every other field of the rule's pick kept (dropping acc_full sent NVFP4 N = 1 to the
    # slow FMA path: 50.2 us against 30.6, session 9 run 4)
    base = choose_config(N, 2 * F, H, fmt, device, flat_ok=False)
    return dataclasses.replace(base, block_f=max(16, base.block_f // 2))


def norm_lm_head(x, norm, w, eps, *, use_pdl: bool = False, config: GemvConfig | None = None):
    """Final RMSNorm + LM head, as `flintc::norm_lm_head` (reference:
    `flintc.ops.grouped.norm_lm_head`): logits fp32, never rounded; the normed x is
    rounded to bf16 as in the reference.

    x: bf16 [B, T, H] contiguous (B * T > 8 falls back to the reference op); norm:
    fp32/bf16 [H]; w: bf16 [V, H]. -> fp32 [B, T, V]. Raises ValueError naming a bad
    argument.
    """
    op = "norm_lm_head"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() < 2:
        fail(op, "x", "a bf16 tensor [B, T, H]", x)
    H = x.shape[-1]
    N = x.numel() // max(H, 1)
    if N > MAX_N:
        from flintc.ops import grouped
        return grouped.norm_lm_head(x, norm, w, eps)
    check_tensor(op, "x", x, torch.bfloat16, None, x.device)
    x2 = x.view(N, H)
    check_x2d(op, x2)
    if not isinstance(w, torch.Tensor):
        fail(op, "w", "a bf16 tensor [V, H]", w)
    fmt, V, wargs = check_weight(op, "w", [w], H, x.device)
    _check_norm(op, "norm", norm, H, x.device)
    out = torch.empty((*x.shape[:-1], V), dtype=torch.float32, device=x.device)
    launch_gemv(op, x2, wargs, fmt, V, out.view(N, V), EPI_FP32, norm=norm, eps=eps,
                config=config, use_pdl=use_pdl)
    return out


def embedding(ids, table, *, use_pdl: bool = False):
    """Row lookup, as `flintc::embedding` (reference: `flintc.ops.linear.embedding`),
    bit-exact. ids: int32/int64 [B, T] contiguous, values in [0, V) (not checked: that
    would need a host sync; rows of out-of-range ids come out zero, where the reference
    raises); table: bf16 [V, H] contiguous. -> bf16 [B, T, H]. Raises ValueError naming
    a bad argument."""
    op = "embedding"
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        fail(op, "ids", "an int64 tensor [B, T]", ids)
    check_tensor(op, "ids", ids, (torch.int32, torch.int64), None, ids.device)
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        fail(op, "table", "a bf16 tensor [V, H]", table)
    check_tensor(op, "table", table, torch.bfloat16, None, ids.device)
    V, H = table.shape
    out = torch.empty((*ids.shape, H), dtype=torch.bfloat16, device=ids.device)
    if ids.numel() == 0:
        return out
    _, pdl, extra = _launch_opts(ids.device, use_pdl, None)
    embedding_kernel[(ids.numel(),)](ids, table, out, V, H,
                                     BLOCK_H=min(1024, triton.next_power_of_2(H)),
                                     USE_PDL=pdl_mode(pdl), num_warps=4, **extra)
    return out


def gemv(x, w, *, use_pdl: bool = False, config: GemvConfig | None = None):
    """`flintc::gemv` (reference: `flintc.ops.linear.gemv`): see
    `flintc.kernels.gemv.gemv`; N > 8 falls back to the reference op."""
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] > MAX_N:
        from flintc.ops import linear
        return linear.gemv(x, w)
    return _gemv(x, w, use_pdl=use_pdl, config=config)


def rms_norm(x, weight, eps, *, use_pdl: bool = False):
    """`flintc::rms_norm` in the decode schedule (reference: `flintc.ops.norm.rms_norm`):
    the final norm, left standalone before the plain `lm_head` by the build option
    `split_lm_head_norm` (the default; `flintc compile --no-split-lm-head-norm` has
    `group_low_latency` fold the two into `norm_lm_head`). The prefill's kernel
    (`flintc.kernels.prefill_norm.rms_norm`, one program per row, the same rounding
    points), launched with PDL on CUDA: the weight before `gdc_wait`, x after it.

    Its sum of squares runs in another order than `norm_lm_head`'s prologue (one sum
    over the row against chunks of the rows), so a normed value next to a bf16 rounding
    boundary may come out one ulp apart (`prefill_norm`'s bound); session 36 found the
    logits identical at N = 1 and 8 on an H100 (docs/gpu-runs.md, "The LM head's tiles").

    x: bf16 [..., H]; weight: fp32 / bf16 [H]. -> bf16 [..., H], contiguous. Raises
    ValueError naming a bad argument.
    """
    return prefill_norm.rms_norm(x, weight, eps, use_pdl=use_pdl)


KERNELS = {
    "norm_qkv_rope_kv": norm_qkv_rope_kv,
    "gemv_residual": gemv_residual,
    "norm_gate_up_silu": norm_gate_up_silu,
    "norm_lm_head": norm_lm_head,
    "embedding": embedding,
    "gemv": gemv,
    "lm_head": lm_head,
    "rms_norm": rms_norm,
}

__all__ = [
    "EPI_BF16",
    "KERNELS",
    "embedding",
    "gate_up_config",
    "gemv",
    "gemv_residual",
    "lm_head",
    "norm_gate_up_silu",
    "norm_lm_head",
    "norm_qkv_rope_kv",
    "qkv_config",
    "rms_norm",
]
