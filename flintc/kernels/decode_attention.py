"""Split-KV (flash-decoding) attention for one new token per sequence, and the combine
that merges the splits with the learned sink (FLINT_SPEC 2, attention steps 5-7).

`decode_attention` cuts the S cache rows into `num_splits` equal chunks; one program
handles one KV head's G = Hq/Hkv query heads over one chunk, so K and V are read once
per group. It writes per-chunk fp32 partials (normalised within the chunk) and their
log-sum-exp. `attention_combine` merges them with the sink and rounds to bf16 once
(FLINT_SPEC 3). Everything inside is fp32: bf16 loads are upcast right after the load
(the Triton interpreter gets bf16 arithmetic wrong). The contracts and plain-torch
references are `flintc.ops.attention.decode_attention` / `attention_combine`
(`torch.ops.flintc.*`); results match them up to fp32 reduction order and exp ulps.
Assumes contiguous tensors (checked by the launchers). Nothing runs at import.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, positions_ptr, o_part_ptr, lse_ptr,
    S, CHUNK, scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, N: tl.constexpr,
    WINDOW: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BF16_DOT: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (b * HKV + kv head, split): the G query heads of one KV head over the
    # cache rows [split * CHUNK, min((split + 1) * CHUNK, S)) of sequence b.
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    mask_g = offs_g < G  # BLOCK_G >= 16 for tl.dot: rows past G are padding
    mask_d = offs_d < D
    if USE_PDL:
        # q, slots, positions and the cache are written by the previous kernels.
        tl.extra.cuda.gdc_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p = tl.load(positions_ptr + b).to(tl.int64)  # positions [B, 1]
    # q [B, 1, HKV * G, D]: heads hk * G .. hk * G + G - 1.
    q_rows = (b * HKV * G + hk * G + offs_g).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)

    start = split * CHUNK
    end = tl.minimum(start + CHUNK, S)
    if WINDOW == 0:
        # Full cache: rows past p are never visible, so they are never read.
        end = tl.minimum(end, p + 1).to(tl.int32)
    kv_base = slot * S * HKV * D + hk * D  # row j of this head at kv_base + j * HKV * D

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s0 in range(start, end, BLOCK_S):
        rows = s0 + offs_s
        in_chunk = rows < end
        if WINDOW == 0:
            visible = in_chunk  # end <= p + 1 already: key position = row <= p
        else:
            # Ring of WINDOW rows: row j holds p - ((p - j) mod W); negative = never
            # written. The mod is taken non-negative (Triton's % truncates like C).
            r = (p - rows) % WINDOW
            r = tl.where(r < 0, r + WINDOW, r)
            kpos = p - r
            visible = in_chunk & (kpos >= 0) & (kpos <= p) & (p - kpos < WINDOW)
        kv_off = kv_base + rows.to(tl.int64)[:, None] * (HKV * D) + offs_d[None, :]
        kv_mask = visible[:, None] & mask_d[None, :]  # invisible rows are not read
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if BF16_DOT:
            # GPU: a bf16 x bf16 product is exact in fp32 and the MMA accumulates in
            # fp32, so this is the fp32 q.k of the reference up to summation order.
            s = tl.dot(q.to(tl.bfloat16), tl.trans(k))
        else:
            # Interpreter: bf16 arithmetic is wrong there; upcast right after the load.
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = s * scale
        s = tl.where(visible[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_S]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # All keys so far invisible: m_new is -inf; subtract 0 so exp(-inf) = 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        pr = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if BF16_DOT:
            # p is full fp32: split it into three bf16 parts (8 + 8 + 8 mantissa bits,
            # exact for fp32) so the tensor-core p.v equals the fp32 one up to order.
            p1 = pr.to(tl.bfloat16)
            r1 = pr - p1.to(tl.float32)
            p2 = r1.to(tl.bfloat16)
            p3 = (r1 - p2.to(tl.float32)).to(tl.bfloat16)
            pv = tl.dot(p1, v)
            pv = tl.dot(p2, v, pv)
            pv = tl.dot(p3, v, pv)
        else:
            pv = tl.dot(pr, v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0  # an empty chunk: o = 0, lse = -inf, no NaN
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_keys, m_i + tl.log(l_safe), float("-inf"))
    # o_part [B, HKV * G, N, D], lse [B, HKV * G, N].
    heads = (b * HKV * G + hk * G + offs_g).to(tl.int64)
    o_ptrs = o_part_ptr + (heads[:, None] * N + split) * D + offs_d[None, :]
    tl.store(o_ptrs, o, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(lse_ptr + heads * N + split, lse, mask=mask_g)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def attention_combine_kernel(
    o_part_ptr, lse_ptr, sinks_ptr, out_ptr,
    HQ: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program b * HQ + h: merges the N partials of query head h of sequence b.
    pid = tl.program_id(0)
    h = pid % HQ
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    mask_d = offs_d < D
    sink = tl.load(sinks_ptr + h).to(tl.float32)  # a weight: safe before gdc_wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = pid.to(tl.int64)
    # Padding splits read as lse = -inf, o = 0: they add nothing, like empty chunks.
    lse = tl.load(lse_ptr + row * N + offs_n, mask=mask_n, other=float("-inf"))
    o_ptrs = o_part_ptr + (row * N + offs_n[:, None]) * D + offs_d[None, :]
    o = tl.load(o_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    m = tl.maximum(tl.max(lse, axis=0), sink)  # finite because the sink is
    w = tl.exp(lse - m)  # empty splits: exp(-inf) = 0
    denom = tl.exp(sink - m) + tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / denom
    # out [B, 1, HQ * D]: row b * HQ + h.
    tl.store(out_ptr + row * D + offs_d, out.to(tl.bfloat16), mask=mask_d)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


# Launch configuration on the GPU (no autotuning: it synchronizes, which breaks CUDA-graph
# capture). Chosen by benchmarks/bench_decode_attention.py on an H200.
GPU_BLOCK_S = 64
GPU_NUM_WARPS = 8
GPU_NUM_STAGES = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what}")


def _check_tensor(t, name: str, dtype, ndim: int) -> None:
    _check(isinstance(t, torch.Tensor), name, "expected a torch.Tensor")
    _check(t.dtype == dtype, name, f"expected dtype {dtype}, got {t.dtype}")
    _check(t.dim() == ndim, name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    _check(t.is_contiguous(), name, "expected a contiguous tensor")


def decode_attention(q, k_cache, v_cache, slots, positions, window: int, num_splits: int,
                     use_pdl: bool = False):
    """Split-KV decode attention (contract and reference: `flintc.ops.attention.
    decode_attention`, i.e. `torch.ops.flintc.decode_attention`).

    q: bf16 [B, 1, Hq, D]; k_cache, v_cache: bf16 [slots, S, Hkv, D] already holding
    the new token; slots: int32/int64 [B]; positions: int64 [B, 1]; window: W for a
    ring cache of W rows, 0 for a full cache (rows 0..p visible); num_splits: N equal
    chunks of ceil(S / N) rows. Returns (o_part fp32 [B, Hq, N, D], lse fp32 [B, Hq, N]).

    Bytes read: q 2*B*Hq*D, K and V 2 * 2*B*Hkv*D*R where R is the number of rows read
    per sequence (full cache: p + 1; ring: the written rows, up to min(S, W)); written:
    4*B*Hq*N*(D + 1). `use_pdl` launches with programmatic dependent launch (CUDA only).
    """
    _check_tensor(q, "q", torch.bfloat16, 4)
    _check_tensor(k_cache, "k_cache", torch.bfloat16, 4)
    _check_tensor(v_cache, "v_cache", torch.bfloat16, 4)
    _check(isinstance(slots, torch.Tensor) and slots.dtype in (torch.int32, torch.int64)
           and slots.dim() == 1 and slots.is_contiguous(), "slots",
           "expected a contiguous int32/int64 tensor [B]")
    _check_tensor(positions, "positions", torch.int64, 2)
    B, T, Hq, D = q.shape
    num_slots, S, Hkv, Dk = k_cache.shape
    _check(T == 1, "q", f"expected one token per sequence, got shape {tuple(q.shape)}")
    _check(Dk == D, "k_cache", f"head dim {Dk} != q's {D}")
    _check(Hkv > 0 and Hq % Hkv == 0, "k_cache", f"Hkv={Hkv} must divide Hq={Hq}")
    _check(v_cache.shape == k_cache.shape, "v_cache",
           f"shape {tuple(v_cache.shape)} != k_cache's {tuple(k_cache.shape)}")
    _check(slots.shape[0] == B, "slots", f"expected [{B}], got {tuple(slots.shape)}")
    _check(tuple(positions.shape) == (B, 1), "positions",
           f"expected [{B}, 1], got {tuple(positions.shape)}")
    _check(isinstance(window, int) and window >= 0, "window", f"expected an int >= 0, got {window}")
    _check(isinstance(num_splits, int) and num_splits >= 1, "num_splits",
           f"expected an int >= 1, got {num_splits}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots),
                    ("positions", positions)):
        _check(t.device == q.device, name, f"on {t.device}, q on {q.device}")
    G = Hq // Hkv
    o_part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    if B == 0:
        return o_part, lse
    chunk = math.ceil(S / num_splits)
    on_gpu = q.is_cuda and not _interpreting()
    pdl = bool(use_pdl) and on_gpu
    extra = {"launch_pdl": True} if pdl else {}
    stages = {"num_stages": GPU_NUM_STAGES} if on_gpu else {}
    grid = (B * Hkv, num_splits)
    decode_attention_kernel[grid](
        q, k_cache, v_cache, slots, positions, o_part, lse,
        S, chunk, D ** -0.5,
        HKV=Hkv, G=G, D=D, N=num_splits, WINDOW=window,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_S=GPU_BLOCK_S if on_gpu else 16, BF16_DOT=on_gpu, USE_PDL=pdl,
        num_warps=GPU_NUM_WARPS if on_gpu else 4, **stages, **extra,
    )
    return o_part, lse


def attention_combine(o_part, lse, sinks, use_pdl: bool = False):
    """Merge the split-KV partials with the learned sink (contract and reference:
    `flintc.ops.attention.attention_combine`, i.e. `torch.ops.flintc.attention_combine`).

    o_part: fp32 [B, Hq, N, D]; lse: fp32 [B, Hq, N]; sinks: fp32 [Hq].
    Returns bf16 [B, 1, Hq*D], rounded once.
    Bytes read: 4*B*Hq*N*(D + 1) + 4*Hq; written: 2*B*Hq*D.
    """
    _check_tensor(o_part, "o_part", torch.float32, 4)
    _check_tensor(lse, "lse", torch.float32, 3)
    _check_tensor(sinks, "sinks", torch.float32, 1)
    B, Hq, N, D = o_part.shape
    _check(tuple(lse.shape) == (B, Hq, N), "lse", f"expected {(B, Hq, N)}, got {tuple(lse.shape)}")
    _check(tuple(sinks.shape) == (Hq,), "sinks", f"expected ({Hq},), got {tuple(sinks.shape)}")
    for name, t in (("lse", lse), ("sinks", sinks)):
        _check(t.device == o_part.device, name, f"on {t.device}, o_part on {o_part.device}")
    out = torch.empty(B, 1, Hq * D, dtype=torch.bfloat16, device=o_part.device)
    if B == 0:
        return out
    pdl = bool(use_pdl) and o_part.is_cuda and not _interpreting()
    extra = {"launch_pdl": True} if pdl else {}
    attention_combine_kernel[(B * Hq,)](
        o_part, lse, sinks, out,
        HQ=Hq, N=N, D=D, BLOCK_N=triton.next_power_of_2(N), BLOCK_D=triton.next_power_of_2(D),
        USE_PDL=pdl, num_warps=4, **extra,
    )
    return out


def decode_attention_reference(q, k_cache, v_cache, slots, positions, window, num_splits):
    """The plain-torch reference: `flintc.ops.attention.decode_attention`."""
    from flintc.ops import attention  # imported on call: nothing registers at import

    return attention.decode_attention(q, k_cache, v_cache, slots, positions, window, num_splits)


def attention_combine_reference(o_part, lse, sinks):
    """The plain-torch reference: `flintc.ops.attention.attention_combine`."""
    from flintc.ops import attention

    return attention.attention_combine(o_part, lse, sinks)
