"""Split-KV (flash-decoding) attention for one new token per sequence, and the combine
that merges the splits with the learned sink (FLINT_SPEC 2, attention steps 5-7).

Contract and references: `flintc.ops.attention.decode_attention` and
`flintc.ops.attention.attention_combine` (`torch.ops.flintc.*`). The op cuts each
sequence's R visible rows into at most `num_splits` (N) equal chunks
(`flintc.ops.attention.split_layout`: ceil(R / SPLIT_ROWS) chunks of at most 64 rows
while that is at most N, else N chunks of ceil(R / N) rows) and returns one fp32
partial per chunk, normalised within the chunk, with its log-sum-exp (o = 0 and
lse = -inf for a chunk without a visible key, and for the unused chunks); the combine
merges them with the sink. (Until session 26 the chunks cut the whole cache, C =
ceil(S / N): 1,024 tokens in a 131,072-row cache were one chunk of 4,096 rows that 8
programs shared and merged in-kernel, 12.4 us per call against 4.8 for a sliding layer's
ring of 9 chunks read by one program each; docs/gpu-runs.md.)

Work decomposition (`decode_attention_kernel`): stream-K over the visible rows. N is a
graph constant chosen by the compiler for the longest context, but the visible rows R
(full cache: rows 0..p; ring: the written rows) change every step and live on the
device, so the launcher sizes the grid from the GPU alone: T programs per (sequence,
KV head), T = GPU_CTAS_PER_SM x SMs / (B x Hkv) (one wave, all resident at once), and
each program derives its work from p at run time:
- The R rows are cut into blocks of BLOCK_S rows aligned to chunk starts (a chunk's
  last block may be short; no block straddles two chunks): nblk blocks in all.
- T_eff = min(T, ceil(nblk / min(MIN_BLOCKS, bpc)), nchunks x MAX_PIECES) programs take
  contiguous, balanced runs of blocks (program t: blocks [t nblk / T_eff,
  (t+1) nblk / T_eff)); the others only zero-fill. A run may cross chunk boundaries: it
  is then one segment per chunk it touches, each with its own online softmax.
- A segment that covers its whole chunk stores (o, lse) directly. Otherwise the chunk
  has several contributors (consecutive programs, at most MAX_PIECES + 2; the merger
  derives them from the block ranges): each writes an fp32 partial to a
  workspace slot, bumps the chunk's arrival counter (atomic, acq_rel), and the last to
  arrive merges the partials by log-sum-exp (MERGE_P of them per load) into o_part and
  resets the counter to 0.
- Empty chunks [nchunks, N) get o = 0, lse = -inf from the highest-numbered programs
  (the idle ones when the context is short).
Rows past R are never read, so a 262,144-row cache holding 1K tokens costs 1K rows of
reads in 16 chunks of 64 rows, each one block read by one busy program, and
no merge: short contexts are cheap whatever N and S are. (The previous version, measured
in docs/gpu-runs.md 2026-11-30 session 3, launched T + N programs per head with pieces
confined to chunks, zero-fill programs for the empty chunks, and a merge that read the
partials one query head at a time: ~20 us of fixed cost per call. Here the grid is one
wave, runs are balanced across chunk boundaries, and the merge reads MERGE_P partials of
all G heads at once.)
Sliding layers (a ring of W rows, cut by the compiler into ceil(W / 64) splits): the
GPU launcher sets the smallest run to one whole split (`ring_min_rows`), so each busy
program reads exactly one split and stores it directly, with no partials, counters or
merge: 4.9 us per call at batch 1 in the model (13.1 us when 9 programs shared 3 splits;
docs/gpu-runs.md session 13).
One program handles the G = Hq / Hkv query heads of one KV head, so K and V are read
once per group (GQA).
With the combine in the same launch (`decode_attention_combine`, FUSE_COMBINE; the build
option `fold_attention_combine`), the busy programs of each (sequence, KV head) then
bump a second arrival counter once their chunks are stored or merged, and the last to
arrive merges the visible chunks with the sinks for its G query heads and writes the
bf16 output (split-K's "last block reduces", as TensorRT-LLM's multi-block XQA kernels
do): no zero-fill of the empty chunks, no combine kernel. Within one bf16 ulp of the
reference (interpreter and H200 tests; 254 registers on sm_90 with triton 3.6, no spill),
but slower on the H200 (session 25: 14.2 us per call in the NVFP4 model at b1/1K against
7.3 + 1.7 for the two launches; the last program's tail, an atomic round trip and the
chunks' loads, costs more than the kernel boundary), so the compiler emits it only when
asked (`flintc compile --fold-attention-combine`).
Sliding layers from batch 8 on launch BLOCK_S 32, 2 warps, one program per split
(`ring_launch`): 10.3 -> 8.4 us per call at b8 (session 25).

Numerics: scores, online softmax and p.v in fp32. On the GPU q.k is a bf16 x bf16
tensor-core product (exact products, fp32 accumulation) and p.v splits fp32 p into
three bf16 parts (exact), so both equal the fp32 sums of the reference up to summation
order; in the interpreter everything is upcast to fp32 right after the load (bf16
arithmetic is wrong there, ../shared/NOTES.md). Differences from the reference are
fp32 reordering (online softmax, merges of segments) and exp/log ulps: o_part and lse
agree to ~1e-6 relative (measured in the interpreter over the test module's CPU cases:
max |diff| 4.8e-7 on o and on lse; tests allow 1e-5, 2e-5 on the GPU), the combined
bf16 output to one bf16 ulp where an fp32 value sits on a rounding boundary.
`attention_combine` rounds to bf16 once, to nearest even (FLINT_SPEC 3); in the
interpreter, whose fp32 -> bf16 cast truncates, the rounding is done in integer
arithmetic.

Scratch state: the arrival counters (per chunk, then per (sequence, KV head) when the
combine is fused) are a persistent int32 buffer per (device, size),
allocated zeroed on first use and left zeroed by every launch. Two decode_attention
launches of the same B x Hkv x N must therefore not run concurrently on different
streams (in one stream, and with PDL, they are ordered: every kernel calls gdc_wait
before touching them). Nothing runs at import.

Compile check without a GPU: `python scripts/triton_aot_probe.py
flintc.kernels.decode_attention` compiles `aot_probe_specs()` for sm_90.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from flintc.kernels.pdl import PDL_EARLY, pdl_mode
from flintc.kernels.platform import interpreting, sm_count


@triton.jit
def _segment_attention(q, k_cache_ptr, v_cache_ptr, kv_base, lo, hi, p, scale,
                       k_pre, v_pre, pre_lo,
                       HKV: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
                       CLAMP_TO_P: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_S: tl.constexpr, BF16_DOT: tl.constexpr, PRELOAD: tl.constexpr):
    # Online softmax of the G queries in q [BLOCK_G, BLOCK_D] (bf16 when BF16_DOT, else
    # fp32) over cache rows [lo, hi)
    # of one (slot, KV head): returns (o normalised, lse), o = 0 and lse = -inf when no
    # row is visible. PRELOAD: the block starting at row pre_lo is k_pre / v_pre (loaded
    # before the PDL wait by the caller, masked as here), not loaded again.
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s0 in range(lo, hi, BLOCK_S):
        rows = s0 + offs_s
        in_seg = rows < hi
        if CLAMP_TO_P:
            visible = in_seg  # every row below R is visible (see the caller)
        else:
            # Ring of S > WINDOW rows: row r holds p - ((p - r) mod W); negative = never
            # written. The mod is taken non-negative (Triton's % truncates like C).
            r = (p - rows) % WINDOW
            r = tl.where(r < 0, r + WINDOW, r)
            kpos = p - r
            visible = in_seg & (kpos >= 0) & (kpos <= p) & (p - kpos < WINDOW)
        kv_off = kv_base + rows.to(tl.int64)[:, None] * (HKV * D) + offs_d[None, :]
        kv_mask = visible[:, None] & mask_d[None, :]  # invisible rows are not read
        if PRELOAD:
            take = s0 == pre_lo  # the caller's block: no second load (masked off)
            m_load = (kv_mask & (s0 != pre_lo)) != 0  # (!= 0: bool in the interpreter too)
            k = tl.where(take, k_pre, tl.load(k_cache_ptr + kv_off, mask=m_load, other=0.0))
            v = tl.where(take, v_pre, tl.load(v_cache_ptr + kv_off, mask=m_load, other=0.0))
        else:
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if BF16_DOT:
            # GPU: a bf16 x bf16 product is exact in fp32 and the MMA accumulates in fp32,
            # so this is the fp32 q.k of the reference up to summation order.
            s = tl.dot(q, tl.trans(k))
        else:
            # Interpreter: bf16 arithmetic is wrong there; upcast right after the load.
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = s * scale
        s = tl.where(visible[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_S]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # No visible key so far: m_new is -inf; subtract 0 so exp(-inf) = 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        pr = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if BF16_DOT:
            # pr is full fp32: split it into three bf16 parts (8 + 8 + 8 mantissa bits,
            # exact for fp32) so the tensor-core p.v is the fp32 one up to order.
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
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_keys, m_i + tl.log(l_safe), float("-inf"))
    return o, lse


@triton.jit
def _segment_rows(n, u0, u1, R, CHUNK, bpc, BLOCK_S: tl.constexpr):
    # Rows [lo, hi) of chunk n that a run of blocks [u0, u1) covers (blocks of BLOCK_S
    # rows aligned to chunk starts, bpc per chunk; R visible rows).
    c_lo = n * CHUNK
    c_hi = tl.minimum(c_lo + CHUNK, R)
    first = n * bpc
    nb = (c_hi - c_lo + BLOCK_S - 1) // BLOCK_S
    lo = c_lo + (tl.maximum(u0, first) - first) * BLOCK_S
    hi = tl.minimum(c_lo + (tl.minimum(u1, first + nb) - first) * BLOCK_S, c_hi)
    return lo, hi


@triton.jit
def decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, positions_ptr, o_part_ptr, lse_ptr,
    ws_o_ptr, ws_lse_ptr, counter_ptr, sinks_ptr, out_ptr, done_ptr,
    S, SPLIT_ROWS, N, T, MIN_BLOCKS, MAX_PIECES, scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
    CLAMP_TO_P: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_P: tl.constexpr,
    BF16_DOT: tl.constexpr, USE_PDL: tl.constexpr, PRELOAD: tl.constexpr,
    POISON_CURRENT: tl.constexpr, FUSE_COMBINE: tl.constexpr, SOFT_RNE: tl.constexpr,
    COMBINE_P: tl.constexpr,
):
    # Program (bh = b * HKV + kv head, t): a balanced run of blocks of the visible rows
    # (see the module docstring), and some empty chunks.
    # PRELOAD (CLAMP_TO_P only): slots, positions and the first block of the program's run
    # load before the PDL wait (`preload_enabled`); after it, the current token's row (the
    # one the previous kernel, the fused QKV, writes this step) is loaded again into that
    # block. POISON_CURRENT (tests): that row of the early load is NaN first, standing in
    # for an early load that raced the write, so a missed reload shows.
    # FUSE_COMBINE (`decode_attention_combine`): the busy programs of (b, KV head) count
    # their arrivals on done_ptr[bh] once their chunks are stored (or merged), and the
    # last to arrive merges the chunks with the sinks into out (bf16 [B, 1, Hq * D]), as
    # `attention_combine_kernel` does; empty chunks are neither zero-filled nor read.
    bh = tl.program_id(0)
    t = tl.program_id(1)
    b = bh // HKV
    hk = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G  # BLOCK_G >= 16 for tl.dot: rows past G are padding
    mask_d = offs_d < D
    out_mask = mask_g[:, None] & mask_d[None, :]
    heads = (bh * G + offs_g).to(tl.int64)  # rows of o_part [B * HKV * G, N, D]
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL and not PRELOAD:
        # q, slots, positions and the cache are written by the previous kernels; the
        # counters by the previous launch of this kernel.
        tl.extra.cuda.gdc_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p = tl.load(positions_ptr + b).to(tl.int32)  # positions [B, 1]
    # A negative slot is a padding row (flintc.ops.attention.pad_slot): it reads no cache
    # row (R = 0 below), so every chunk is empty (o = 0, lse = -inf).
    live = slot >= 0
    slot = tl.maximum(slot, 0)

    # Visible rows are all in [0, R): full cache rows 0..p; a ring of S <= W rows holds
    # rows 0..p until it wraps, then all of them. (A ring longer than W: all S rows,
    # masked row by row as in the reference.)
    if CLAMP_TO_P:
        R = tl.maximum(tl.minimum(p + 1, S), 0)
    else:
        R = S + 0 * p
    R = tl.where(live, R, 0)
    # The split layout of the visible rows (`flintc.ops.attention.split_layout`): at most
    # N chunks of CHUNK rows: ceil(R / SPLIT_ROWS) of them while that is at most N.
    wanted = tl.minimum(tl.maximum((R + SPLIT_ROWS - 1) // SPLIT_ROWS, 1), N)
    CHUNK = tl.maximum((R + wanted - 1) // wanted, 1)
    nchunks = (R + CHUNK - 1) // CHUNK
    # Blocks of BLOCK_S rows aligned to chunk starts, bpc per chunk; the last chunk's
    # blocks past its rows are empty (so that runs of whole chunks stay aligned to them).
    # Program t takes blocks [u0, u1) of nblk; block u is owned by program
    # ceil((u + 1) T_eff / nblk) - 1.
    bpc = (CHUNK + BLOCK_S - 1) // BLOCK_S
    nblk = nchunks * bpc
    # The smallest run: MIN_BLOCKS, or one whole chunk when chunks are shorter (a short
    # context's chunks are one block each: one program per chunk, stored directly)
    min_blocks = tl.minimum(MIN_BLOCKS, bpc)
    t_eff = tl.minimum(tl.minimum((nblk + min_blocks - 1) // min_blocks, T), nchunks * MAX_PIECES)
    t_eff = tl.maximum(t_eff, 1)
    busy = (t < t_eff) & (nblk > 0)
    u0 = ((t.to(tl.int64) * nblk) // t_eff).to(tl.int32)
    u1 = (((t + 1).to(tl.int64) * nblk) // t_eff).to(tl.int32)
    n0 = u0 // bpc
    offs_s = tl.arange(0, BLOCK_S)
    if PRELOAD:
        # The run's first block (its first segment's first rows, as the loop below
        # takes them), read before the wait: every row but the current one was written
        # by kernels that completed before the previous kernel started.
        pre_lo, hi0 = _segment_rows(n0, u0, u1, R, CHUNK, bpc, BLOCK_S)
        rows0 = pre_lo + offs_s
        in0 = (rows0 < hi0) & busy
        off0 = slot * S * HKV * D + hk * D + rows0.to(tl.int64)[:, None] * (HKV * D) + offs_d[None, :]
        # (!= 0: the interpreter's & of a scalar and a vector of bools holds int32)
        m0 = (in0[:, None] & mask_d[None, :]) != 0
        k_pre = tl.load(k_cache_ptr + off0, mask=m0, other=0.0)
        v_pre = tl.load(v_cache_ptr + off0, mask=m0, other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()  # q, the current row and the counters: after it
        if WINDOW > 0:
            cur = p % WINDOW  # the ring row of position p (flintc.ops.attention.write_kv)
        else:
            cur = p
        is_cur = ((in0 & (rows0 == cur))[:, None] & mask_d[None, :]) != 0
        if POISON_CURRENT:  # (through fp32, exact: triton 3.8's interpreter has no bf16 constant)
            k_pre = tl.where(is_cur, float("nan"), k_pre.to(tl.float32)).to(k_pre.dtype)
            v_pre = tl.where(is_cur, float("nan"), v_pre.to(tl.float32)).to(v_pre.dtype)
        k_pre = tl.where(is_cur, tl.load(k_cache_ptr + off0, mask=is_cur, other=0.0), k_pre)
        v_pre = tl.where(is_cur, tl.load(v_cache_ptr + off0, mask=is_cur, other=0.0), v_pre)
        pre_lo = tl.where(busy, pre_lo, -1)
    else:
        k_pre = 0.0
        v_pre = 0.0
        pre_lo = -1
    # q [B, 1, HKV * G, D]: heads hk * G .. hk * G + G - 1.
    q = tl.load(q_ptr + heads[:, None] * D + offs_d[None, :], mask=out_mask, other=0.0)
    if not BF16_DOT:
        q = q.to(tl.float32)  # interpreter: no bf16 arithmetic (the GPU keeps bf16 q)

    # Empty chunks nchunks.. N-1: o = 0, lse = -inf (the op's convention), written by
    # programs T-1, T-2, ... (idle unless the context is long). With FUSE_COMBINE the
    # partials are scratch and the combine reads chunks < nchunks only: no zero-fill.
    for z in range(nchunks + T - 1 - t, N if not FUSE_COMBINE else 0, T):
        zero_ptrs = o_part_ptr + (heads[:, None] * N + z) * D + offs_d[None, :]
        tl.store(zero_ptrs, tl.zeros([BLOCK_G, BLOCK_D], tl.float32), mask=out_mask)
        tl.store(lse_ptr + heads * N + z, tl.full([BLOCK_G], float("-inf"), tl.float32),
                 mask=mask_g)

    if busy:
        kv_base = slot * S * HKV * D + hk * D  # row r of this head: kv_base + r * HKV * D
        # Chunks whose merge falls to this program (the last contributor to arrive): at
        # most its first and its last chunk (a middle chunk is covered whole). Merged
        # after the loop, so the merge's registers do not add to the main loop's.
        merge_first = -1
        merge_last = -1
        for n in range(n0, (u1 - 1) // bpc + 1):
            lo, hi = _segment_rows(n, u0, u1, R, CHUNK, bpc, BLOCK_S)  # segment of chunk n
            if lo < hi:  # (a run ending in the last chunk's empty blocks: nothing there)
                o, lse = _segment_attention(q, k_cache_ptr, v_cache_ptr, kv_base, lo, hi, p, scale,
                                            k_pre, v_pre, tl.where(n == n0, pre_lo, -1),
                                            HKV, D, WINDOW, CLAMP_TO_P, BLOCK_G, BLOCK_D, BLOCK_S,
                                            BF16_DOT, PRELOAD)
                ta, tb = _contributors(n, CHUNK, R, bpc, nblk, t_eff, BLOCK_S)
                if ta == tb:
                    o_ptrs = o_part_ptr + (heads[:, None] * N + n) * D + offs_d[None, :]
                    tl.store(o_ptrs, o, mask=out_mask)
                    tl.store(lse_ptr + heads * N + n, lse, mask=mask_g)
                else:
                    # Workspace ws_o [B * HKV, T, 2, G, D], ws_lse [B * HKV, T, 2, G]: slot
                    # (t, 0) for the program's first chunk, (t, 1) for its last.
                    e = (n != n0).to(tl.int32)
                    ws_rows = (((bh * T + t) * 2 + e) * G + offs_g).to(tl.int64)
                    tl.store(ws_o_ptr + ws_rows[:, None] * D + offs_d[None, :], o, mask=out_mask)
                    tl.store(ws_lse_ptr + ws_rows, lse, mask=mask_g)
                    # All threads' stores before the release of the arrival count.
                    tl.debug_barrier()
                    arrived = tl.atomic_add(counter_ptr + bh * N + n, 1, sem="acq_rel", scope="gpu")
                    if arrived == tb - ta:
                        if n == n0:
                            merge_first = n
                        else:
                            merge_last = n
        for i in range(2):
            n = tl.where(i == 0, merge_first, merge_last)
            if n >= 0:
                # Last contributor of chunk n: merge its partials by log-sum-exp, MERGE_P at
                # a time, as `attention_combine` does without a sink.
                tl.debug_barrier()
                ta, tb = _contributors(n, CHUNK, R, bpc, nblk, t_eff, BLOCK_S)
                _merge_chunk(ws_o_ptr, ws_lse_ptr, o_part_ptr, lse_ptr, bh, n, ta, tb, T, N,
                             nblk, t_eff, bpc, G, D, BLOCK_GM, BLOCK_D, MERGE_P)
                tl.atomic_xchg(counter_ptr + bh * N + n, 0)  # ready for the next launch
    if FUSE_COMBINE:
        # Programs 0..t_eff-1 take part (program 0 alone when no row is visible: it
        # writes the sink-only output, 0). Their o_part / lse stores (and merges) before
        # the release of the arrival count, as for the chunk counters above.
        if t < t_eff:
            tl.debug_barrier()
            arrived = tl.atomic_add(done_ptr + bh, 1, sem="acq_rel", scope="gpu")
            if arrived == t_eff - 1:
                tl.debug_barrier()
                _combine_heads(o_part_ptr, lse_ptr, sinks_ptr, out_ptr, bh, hk, nchunks, N, G,
                               D, BLOCK_GM, BLOCK_D, COMBINE_P, SOFT_RNE)
                tl.atomic_xchg(done_ptr + bh, 0)  # ready for the next launch
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _contributors(n, CHUNK, R, bpc, nblk, t_eff, BLOCK_S: tl.constexpr):
    # Programs ta..tb whose runs touch chunk n: the owners of its first and last blocks
    # (block u belongs to program ceil((u + 1) t_eff / nblk) - 1).
    c_lo = n * CHUNK
    nb = (tl.minimum(c_lo + CHUNK, R) - c_lo + BLOCK_S - 1) // BLOCK_S
    first = n * bpc
    ta = ((first + 1).to(tl.int64) * t_eff + nblk - 1) // nblk - 1
    tb = ((first + nb).to(tl.int64) * t_eff + nblk - 1) // nblk - 1
    return ta, tb


@triton.jit
def _merge_chunk(ws_o_ptr, ws_lse_ptr, o_part_ptr, lse_ptr, bh, n, ta, tb, T, N, nblk, t_eff,
                 bpc, G: tl.constexpr, D: tl.constexpr, BLOCK_GM: tl.constexpr,
                 BLOCK_D: tl.constexpr, MERGE_P: tl.constexpr):
    # Merge the partials of chunk n written by programs ta..tb into o_part / lse.
    offs_c = tl.arange(0, MERGE_P)
    offs_g = tl.arange(0, BLOCK_GM)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    m = tl.full([BLOCK_GM], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_GM], tl.float32)
    acc = tl.zeros([BLOCK_GM, BLOCK_D], tl.float32)
    for c0 in range(ta, tb + 1, MERGE_P):
        c = c0 + offs_c  # contributor programs [MERGE_P]
        mask_c = c <= tb
        # Slot 0 if chunk n is program c's first chunk, else 1 (its last).
        e = ((c.to(tl.int64) * nblk // t_eff) // bpc != n).to(tl.int64)
        rows = ((bh * T + c).to(tl.int64) * 2 + e)[:, None] * G + offs_g[None, :]  # [P, GM]
        mask = mask_c[:, None] & mask_g[None, :]
        # .cg: read at L2, where the other programs' stores are.
        lse_c = tl.load(ws_lse_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o_c = tl.load(ws_o_ptr + rows[:, :, None] * D + offs_d[None, None, :],
                      mask=mask[:, :, None] & mask_d[None, None, :], other=0.0,
                      cache_modifier=".cg")  # [P, GM, D]
        m_new = tl.maximum(m, tl.max(lse_c, axis=0))
        m_s = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_s)
        w = tl.exp(lse_c - m_s[None, :])  # empty partials and padding: exp(-inf) = 0
        den = den * alpha + tl.sum(w, axis=0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_c, axis=0)
        m = m_new
    den_s = tl.where(den > 0.0, den, 1.0)
    m_s = tl.where(m == float("-inf"), 0.0, m)
    o = acc / den_s[:, None]
    lse = tl.where(den > 0.0, m_s + tl.log(den_s), float("-inf"))
    heads = bh.to(tl.int64) * G + offs_g
    tl.store(o_part_ptr + (heads[:, None] * N + n) * D + offs_d[None, :], o,
             mask=mask_g[:, None] & mask_d[None, :])
    tl.store(lse_ptr + heads * N + n, lse, mask=mask_g)


@triton.jit
def _combine_heads(o_part_ptr, lse_ptr, sinks_ptr, out_ptr, bh, hk, nchunks, N,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_GM: tl.constexpr,
                   BLOCK_D: tl.constexpr, COMBINE_P: tl.constexpr, SOFT_RNE: tl.constexpr):
    # `attention_combine_kernel` for the G query heads of one (sequence, KV head), over
    # chunks 0..nchunks-1 (the others are empty: weight 0), COMBINE_P chunks per round:
    # each round issues its lse and o loads together (o in two halves of D), so the
    # program's tail is one round trip to L2 per COMBINE_P chunks (one for nchunks <=
    # COMBINE_P: the combine kernel's formula exactly, m = max(sink, lse) first; more
    # rounds merge online, rescaling by exp(m - m_new)). .cg loads: the other programs'
    # partials are at L2. Chunks below nchunks are all written (o = 0 where empty).
    HALF: tl.constexpr = BLOCK_D // 2
    offs_c = tl.arange(0, COMBINE_P)
    offs_g = tl.arange(0, BLOCK_GM)
    offs_lo = tl.arange(0, HALF)
    offs_hi = HALF + offs_lo
    mask_g = offs_g < G
    heads = bh.to(tl.int64) * G + offs_g  # rows b * Hq + hk * G + g of o_part and out
    sink = tl.load(sinks_ptr + hk * G + offs_g, mask=mask_g, other=0.0).to(tl.float32)
    m = sink  # finite: the sink is
    den = tl.zeros([BLOCK_GM], tl.float32)
    acc_lo = tl.zeros([BLOCK_GM, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_GM, HALF], tl.float32)
    for c0 in range(0, nchunks, COMBINE_P):
        c = c0 + offs_c
        mask = (c < nchunks)[:, None] & mask_g[None, :]  # [P, GM]
        rows = heads[None, :] * N + c[:, None]
        lse_c = tl.load(lse_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o_lo = tl.load(o_part_ptr + rows[:, :, None] * D + offs_lo[None, None, :],
                       mask=mask[:, :, None] & (offs_lo < D)[None, None, :], other=0.0,
                       cache_modifier=".cg")  # [P, GM, D / 2]
        o_hi = tl.load(o_part_ptr + rows[:, :, None] * D + offs_hi[None, None, :],
                       mask=mask[:, :, None] & (offs_hi < D)[None, None, :], other=0.0,
                       cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse_c, axis=0))
        alpha = tl.exp(m - m_new)
        w = tl.where(lse_c > float("-inf"), tl.exp(lse_c - m_new[None, :]), 0.0)  # [P, GM]
        den = den * alpha + tl.sum(w, axis=0)
        acc_lo = acc_lo * alpha[:, None] + tl.sum(w[:, :, None] * o_lo, axis=0)
        acc_hi = acc_hi * alpha[:, None] + tl.sum(w[:, :, None] * o_hi, axis=0)
        m = m_new
    denom = (tl.exp(sink - m) + den)[:, None]
    for half in tl.static_range(2):
        out = (acc_lo if half == 0 else acc_hi) / denom
        offs_d = offs_lo if half == 0 else offs_hi
        if SOFT_RNE:
            out_bf16 = _to_bf16_rne(out)  # interpreter: round like torch, not truncate
        else:
            out_bf16 = out.to(tl.bfloat16)
        tl.store(out_ptr + heads[:, None] * D + offs_d[None, :], out_bf16,
                 mask=mask_g[:, None] & (offs_d < D)[None, :])


@triton.jit
def _to_bf16_rne(x):
    # fp32 -> bf16 rounding to nearest, ties to even, in integer arithmetic (finite x and
    # inf). The GPU's `.to(tl.bfloat16)` already does this; the interpreter truncates.
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def attention_combine_kernel(
    o_part_ptr, lse_ptr, sinks_ptr, out_ptr,
    HQ: tl.constexpr, N: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFT_RNE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program b * HQ + h: merges the N partials of query head h of sequence b.
    pid = tl.program_id(0)
    h = pid % HQ
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    mask_d = offs_d < D
    sink = tl.load(sinks_ptr + h).to(tl.float32)  # a weight: safe before gdc_wait
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = pid.to(tl.int64)
    # lse and o in one round trip (o of every split, not only the live ones: one
    # dependent load less; empty splits hold o = 0 by contract, and their weight is
    # forced to 0 below, so nothing of theirs reaches the output).
    lse = tl.load(lse_ptr + row * N + offs_n, mask=mask_n, other=float("-inf"))
    o_ptrs = o_part_ptr + (row * N + offs_n[:, None]) * D + offs_d[None, :]
    o = tl.load(o_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    live = lse > float("-inf")  # padding splits read as -inf too
    m = tl.maximum(tl.max(lse, axis=0), sink)  # finite because the sink is
    w = tl.where(live, tl.exp(lse - m), 0.0)  # the sink is counted once, below
    denom = tl.exp(sink - m) + tl.sum(w, axis=0)
    out = tl.sum(tl.where(live[:, None], w[:, None] * o, 0.0), axis=0) / denom
    if SOFT_RNE:
        out_bf16 = _to_bf16_rne(out)  # interpreter: round like torch, not truncate
    else:
        out_bf16 = out.to(tl.bfloat16)
    # out [B, 1, HQ * D]: row b * HQ + h.
    tl.store(out_ptr + row * D + offs_d, out_bf16, mask=mask_d)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()


# Launch configuration on the GPU (no autotuning: it synchronizes, which breaks CUDA-graph
# capture). Measured on an H200 with the previous version (docs/gpu-runs.md, 2026-11-30
# session 3): at 100K context 4 warps x 3 stages of 64 K and V rows beat 8 warps (69% vs
# 58% of copy at B=1, 103% vs 91% at B=8). This version at 4 warps: 235 registers, 74 KiB
# of shared memory, no spills (scripts/triton_aot_probe.py, triton 3.9), so two programs
# per SM. benchmarks/bench_decode_attention.py's sweep re-measures all of these.
GPU_BLOCK_S = 64
GPU_NUM_WARPS = 4
GPU_NUM_STAGES = 3
# With PRELOAD the first block's K and V tiles stay in registers across the wait: at 4
# warps ptxas then spills (255 registers, 72 / 90 bytes stored / loaded, sm_90 probe),
# at 8 warps it does not (232 registers)
GPU_PRELOAD_NUM_WARPS = 8
GPU_CTAS_PER_SM = 2  # programs per SM the grid is sized for (one wave, all resident)
# Smallest run of rows per program in a full cache (short contexts). 256, from session 29's
# H100 run (docs/gpu-runs.md): a full layer's attention + combine at 8K tokens, b1 18.7 ->
# 13.4 us, b2 24.4 -> 14.5 us; 16K b1 24.4 -> 22.5 us; equal within 0.3 us at 4K-100K and
# at b4-b8; NVFP4 forward b1/8K 1.92 -> 1.82 ms (128 before).
GPU_MIN_ROWS = 256
# A ring's programs each take one whole split (`ring_min_rows`): no in-kernel merge.
GPU_MERGE_P = 8  # partials per load of the in-kernel merge ([8, G, D] fp32 tiles)
# Chunks per round of the fused combine (FUSE_COMBINE): 16 covers a sliding layer's 9
# splits and a full layer's chunks up to 16 x 8,192 rows in one round ([16, G, D / 2] x 2)
GPU_COMBINE_P = 16
MAX_PIECES_PER_SPLIT = 32  # at most ~this many programs share one split (merge length)
# Interpreter (CPU) configuration: tiny blocks so that tests exercise many programs.
CPU_BLOCK_S = 16
# A sliding layer's ring launch by batch (`ring_launch`): {smallest batch: (BLOCK_S, warps,
# stages, one program per split)}, the entry with the largest key <= B applying;
# FLINTC_DECODE_ATTN_RING_LAUNCH overrides entries. Session 25 (H200, W = 513, 9 splits):
# BLOCK_S 32, 2 warps, 2 stages, one program per split took 8.4 us per attention + combine
# at batch 8 against 10.3 for the default launch (which has 8 programs per head for 9
# splits from batch 8 on), 13.9 against 14.5 at 16, but 6.7-7.4 against 6.1-7.4 at 1-4; in
# the model b8/1K 3.17 -> 3.09 ms. So from batch 8 on.
RING_LAUNCH = {1: (GPU_BLOCK_S, GPU_NUM_WARPS, GPU_NUM_STAGES, 0), 8: (32, 2, 2, 1)}
# Whether the kernel reads slots, positions and its first block of K / V rows before the
# PDL wait (`preload_enabled`; FLINTC_DECODE_ATTN_PRELOAD overrides). Written in session
# 23; measured slower in session 25 (it needs 8 warps: NVFP4 b1/100K 2.39 -> 3.25 ms,
# b8/1K 3.13 -> 3.40; docs/gpu-runs.md), so off.
PRELOAD = False
CPU_MIN_ROWS = 16
CPU_MERGE_P = 4
CPU_COMBINE_P = 2  # the interpreter: small rounds so that tests merge online
CPU_NUM_SMS = 4

_COUNTERS: dict[tuple, torch.Tensor] = {}


def _num_sms(device: torch.device) -> int:
    return CPU_NUM_SMS if interpreting() else sm_count(device, cpu=CPU_NUM_SMS)


def _counters(device: torch.device, numel: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one buffer per (device, size), kept for the life
    of the process (CUDA graphs captured with them keep pointing at them). Each launch
    leaves them zeroed. Allocated on first use (a memset; inside a graph capture, a
    memset node that re-zeroes them on each replay, which is harmless)."""
    key = (device.type, device.index, numel)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = torch.zeros(numel, dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def default_programs_per_head(batch: int, num_kv_heads: int, num_sms: int,
                      ctas_per_sm: int = GPU_CTAS_PER_SM) -> int:
    """T, the programs per (sequence, KV head): floor(ctas_per_sm x num_sms / (batch x
    num_kv_heads)), at least 1, so that the whole grid is resident in one wave (66 for
    B = 1, Hkv = 4 on 132 SMs; 8 for B = 8). Raises ValueError for inputs < 1."""
    for name, v in (("batch", batch), ("num_kv_heads", num_kv_heads), ("num_sms", num_sms),
                    ("ctas_per_sm", ctas_per_sm)):
        if int(v) < 1:
            raise ValueError(f"{name}: expected >= 1, got {v}")
    return max(1, (ctas_per_sm * num_sms) // (batch * num_kv_heads))


def choose_num_splits(max_context: int, batch: int, num_sms: int = 132, num_kv_heads: int = 4,
                      window: int = 0) -> int:
    """The `attention_splits` value for a cache of `max_context` rows (W for a ring of
    window W), batch `batch`, on a GPU of `num_sms` SMs with `num_kv_heads` KV heads.

    This kernel picks its own parallelism from the visible rows at run time, so N only
    has to (a) let enough programs share the rows: at most about `MAX_PIECES_PER_SPLIT`
    programs per split, so N >= ceil(T / 32) with T = `default_programs_per_head`, and (b) keep
    o_part (4*B*Hq*N*(D+1) bytes, written here and read by the combine) small. Returns
    ceil(rows / 256) clamped to [that lower bound, 32] for full caches (32 for 262,144
    rows, the compiler's current default), and ceil(W / GPU_BLOCK_S) clamped to 32 for
    rings (9 for W = 513: one block per split, each read and stored by one program,
    `ring_min_rows`; `flintc.passes.fuse_decode_attention.num_splits_for` makes the same
    choice).
    Raises ValueError for non-positive inputs.
    """
    for name, v in (("max_context", max_context), ("batch", batch), ("num_sms", num_sms),
                    ("num_kv_heads", num_kv_heads)):
        if int(v) < 1:
            raise ValueError(f"{name}: expected >= 1, got {v}")
    if int(window) < 0:
        raise ValueError(f"window: expected >= 0, got {window}")
    if window:
        return max(1, min(32, math.ceil(min(max_context, window) / GPU_BLOCK_S)))
    programs = default_programs_per_head(batch, num_kv_heads, num_sms)
    lower = math.ceil(programs / MAX_PIECES_PER_SPLIT)
    return max(lower, min(32, math.ceil(max_context / 256)))


def ring_min_rows(num_rows: int, num_splits: int) -> int:
    """The GPU launcher's smallest run of rows per program for a sliding layer's ring of
    `num_rows` rows cut into `num_splits` splits: one whole split, ceil(num_rows /
    num_splits) rows, so that every split is read by exactly one program, which stores its
    (o, lse) directly, with no partials, arrival counters or in-kernel merge (`plan`: one
    contributor per split whenever the last split has as many blocks as the others, as for
    a wrapped W = 513 ring with 3 or 9 splits; with fewer programs than splits, batch 8,
    a program takes two whole splits; a ring not yet full, or other W, may still share a
    split and merge it). Measured on the H200 at batch 1 (docs/gpu-runs.md
    session 13): 3 splits 12.1 -> 8.8 us per attention + combine, 9 splits 6.0 us; batch
    8: 16.5 -> 9.2 / 9.9 us. Raises ValueError for inputs < 1."""
    for name, v in (("num_rows", num_rows), ("num_splits", num_splits)):
        if int(v) < 1:
            raise ValueError(f"{name}: expected >= 1, got {v}")
    return math.ceil(num_rows / num_splits)


def plan(rows: int, num_rows: int, num_splits: int, programs: int, min_rows: int,
         block_s: int, max_pieces: int = MAX_PIECES_PER_SPLIT) -> dict:
    """The kernel's stream-K decomposition, computed in Python with the same integer
    arithmetic (for tests, and for the benchmark to report what a launch does).

    rows: R, the visible rows (rows 0..R-1; full cache min(p + 1, S)); num_rows: S;
    num_splits: N; programs: T per (sequence, KV head); min_rows, block_s, max_pieces:
    as `launch_decode_attention`. Returns {"t_eff": busy programs, "nblk": blocks,
    "segments": per program t < T a list of (chunk, lo, hi, ta, tb) row ranges [lo, hi)
    (ta..tb: the programs sharing that chunk; ta == tb: stored directly),
    "zero_fill": per program the empty chunks it writes}. Raises ValueError for
    rows > num_rows or a parameter < 1.
    """
    for name, v in (("num_rows", num_rows), ("num_splits", num_splits), ("programs", programs),
                    ("min_rows", min_rows), ("block_s", block_s), ("max_pieces", max_pieces)):
        if int(v) < 1:
            raise ValueError(f"{name}: expected >= 1, got {v}")
    if not 0 <= rows <= num_rows:
        raise ValueError(f"rows: expected 0..{num_rows}, got {rows}")
    from flintc.ops.attention import split_layout  # on call: nothing registers at import

    chunk, nchunks = split_layout(rows, num_splits)
    bpc = (chunk + block_s - 1) // block_s
    nblk = nchunks * bpc  # the last chunk's blocks past its rows are empty
    min_blocks = min(math.ceil(min_rows / block_s), bpc)
    t_eff = max(1, min((nblk + min_blocks - 1) // min_blocks, programs, nchunks * max_pieces))

    def contributors(n):
        c_lo = n * chunk
        nb = (min(c_lo + chunk, rows) - c_lo + block_s - 1) // block_s
        first = n * bpc
        return (((first + 1) * t_eff + nblk - 1) // nblk - 1,
                ((first + nb) * t_eff + nblk - 1) // nblk - 1)

    segments = [[] for _ in range(programs)]
    zero_fill = [list(range(nchunks + programs - 1 - t, num_splits, programs))
                 for t in range(programs)]
    for t in range(min(t_eff, programs) if nblk else 0):
        u0, u1 = t * nblk // t_eff, (t + 1) * nblk // t_eff
        for n in range(u0 // bpc, (u1 - 1) // bpc + 1):
            c_lo, c_hi, first = n * chunk, min(n * chunk + chunk, rows), n * bpc
            nb = (c_hi - c_lo + block_s - 1) // block_s
            lo = c_lo + (max(u0, first) - first) * block_s
            hi = min(c_lo + (min(u1, first + nb) - first) * block_s, c_hi)
            if lo < hi:
                segments[t].append((n, lo, hi, *contributors(n)))
    return {"t_eff": t_eff, "nblk": nblk, "segments": segments, "zero_fill": zero_fill}


def preload_enabled() -> bool:
    """FLINTC_DECODE_ATTN_PRELOAD: "1" reads slots, positions and each program's first
    block of cache rows before the PDL wait (the current token's row again after it),
    "0" after the wait; unset or empty: `PRELOAD`. Only for caches where the visible rows
    are 0..p (full layers, rings of at most W rows); the outputs do not change.

    Raises:
        TuningEnvError (a ValueError): another value, naming the variable.
    """
    from flintc.kernels.tuning import env_choice

    return env_choice("FLINTC_DECODE_ATTN_PRELOAD", ("0", "1"), "1" if PRELOAD else "0") == "1"


def full_min_rows() -> int:
    """The GPU launcher's smallest run of rows per program in a full cache: the integer in
    FLINTC_DECODE_ATTN_MIN_ROWS, else `GPU_MIN_ROWS` (unset or empty). At short contexts
    the chunks are at most `flintc.ops.attention.SPLIT_ROWS` rows (`split_layout`): a value
    up to that length gives one program per chunk (no in-kernel merge), a larger one
    several chunks per program.

    Raises:
        TuningEnvError (a ValueError): not an integer >= 1, naming the variable.
    """
    from flintc.kernels.tuning import TuningEnvError

    value = os.environ.get("FLINTC_DECODE_ATTN_MIN_ROWS", "").strip()
    if not value:
        return GPU_MIN_ROWS
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        raise TuningEnvError(f"FLINTC_DECODE_ATTN_MIN_ROWS must be an integer >= 1, got {value!r}")
    return rows


def ring_launch(batch: int) -> tuple[int, int, int, bool]:
    """(BLOCK_S, warps, stages, one program per split) of a sliding layer's ring launch on
    the GPU at batch `batch`: the `RING_LAUNCH` entry with the largest smallest-batch key
    <= batch, after the entries of FLINTC_DECODE_ATTN_RING_LAUNCH (`/`-separated
    `B=block_s,warps,stages,per_split`, e.g. "8=32,2,2,1": from batch 8 on, BLOCK_S 32,
    2 warps, 2 stages, one program per split), which replace or add keys. One program per
    split: programs_per_head = the ring's splits, each read by one program (else the
    one-wave default, `default_programs_per_head`).

    Raises:
        ValueError: batch < 1.
        TuningEnvError (a ValueError): an entry not of that form (B >= 1, BLOCK_S a power
            of two >= 16, warps 1-16 a power of two, stages 1-8, per_split 0 or 1), naming
            the variable.
    """
    if type(batch) is not int or batch < 1:
        raise ValueError(f"ring_launch: batch must be an int >= 1, got {batch!r}")
    def parse(entry: str) -> tuple:
        key, value = entry.split("=")
        b = int(key)
        bs, w, st, per = (int(v) for v in value.split(","))
        if b < 1 or bs < 16 or bs & (bs - 1) or not 1 <= w <= 16 or w & (w - 1) \
                or not 1 <= st <= 8 or per not in (0, 1):
            raise ValueError
        return b, (bs, w, st, per)

    from flintc.kernels.tuning import env_entries

    table = {**RING_LAUNCH, **dict(env_entries(
        "FLINTC_DECODE_ATTN_RING_LAUNCH", parse,
        "B=block_s,warps,stages,per_split (B >= 1, block_s a power of two >= 16, warps a "
        "power of two 1-16, stages 1-8, per_split 0 or 1)"))}
    key = max((k for k in table if k <= batch), default=None)
    bs, w, st, per = table[key] if key is not None else (GPU_BLOCK_S, GPU_NUM_WARPS,
                                                         GPU_NUM_STAGES, 0)
    return bs, w, st, bool(per)


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what}")


def _check_tensor(t, name: str, dtype, ndim: int) -> None:
    _check(isinstance(t, torch.Tensor), name, "expected a torch.Tensor")
    _check(t.dtype == dtype, name, f"expected dtype {dtype}, got {t.dtype}")
    _check(t.dim() == ndim, name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    _check(t.is_contiguous(), name, "expected a contiguous tensor")


def _positive_int(v, name: str) -> None:
    _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name,
           f"expected an int >= 1, got {v!r}")


def launch_decode_attention(q, k_cache, v_cache, slots, positions, window: int, num_splits: int,
                            *, use_pdl: bool = False, programs_per_head: int | None = None,
                            min_rows: int | None = None, max_pieces: int | None = None,
                            block_s: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, preload: bool | None = None,
                            sinks=None, _poison_current_row: bool = False):
    """`decode_attention` with the decomposition and launch knobs exposed (tests and
    benchmarks); None takes the module's default.

    programs_per_head: T, the grid's programs per (sequence, KV head); default
    `default_programs_per_head(B, Hkv, SMs)` (interpreter: 4 "SMs", 1 per SM).
    min_rows: the smallest run of rows a program takes (rounded up to whole blocks);
    default `full_min_rows()` (GPU_MIN_ROWS unless FLINTC_DECODE_ATTN_MIN_ROWS),
    `ring_min_rows` (one whole split) for a sliding layer (window > 0; interpreter:
    CPU_MIN_ROWS); a chunk shorter than it is one program's whole run.
    max_pieces: at most max_pieces x nchunks busy programs (default MAX_PIECES_PER_SPLIT).
    block_s, num_warps, num_stages: the GPU launch configuration (BLOCK_S a power of two
    >= 16; defaults GPU_*, for a sliding layer's ring `ring_launch(B)`, which may also
    set programs_per_head to one program per split; in the interpreter BLOCK_S defaults
    to CPU_BLOCK_S and the others are ignored; num_warps defaults to
    GPU_PRELOAD_NUM_WARPS with the early
    reads). preload: the early reads of `preload_enabled` (None: that function's; only
    where the visible rows are 0..p, else ignored); `_poison_current_row` (tests, with preload): the early read of the
    current token's row is replaced by NaN, as a read that raced the QKV kernel's write
    would be stale, so that the reload after the wait is checked.
    sinks: fp32 [Hq]: the combine runs in the same launch (`decode_attention_combine`)
    and the result is its bf16 [B, 1, Hq * D] output instead of (o_part, lse).
    Other arguments, results and errors as `decode_attention`; also
    raises ValueError for a knob that is not an int >= 1 (block_s: a power of two >= 16).
    """
    _check_tensor(q, "q", torch.bfloat16, 4)
    _check_tensor(k_cache, "k_cache", torch.bfloat16, 4)
    _check_tensor(v_cache, "v_cache", torch.bfloat16, 4)
    _check(isinstance(slots, torch.Tensor) and slots.dtype in (torch.int32, torch.int64)
           and slots.dim() == 1 and slots.is_contiguous(), "slots",
           "expected a contiguous int32/int64 tensor [B]")
    _check_tensor(positions, "positions", torch.int64, 2)
    B, T_q, Hq, D = q.shape
    num_slots, S, Hkv, Dk = k_cache.shape
    _check(T_q == 1, "q", f"expected one token per sequence, got shape {tuple(q.shape)}")
    _check(Dk == D, "k_cache", f"head dim {Dk} != q's {D}")
    _check(Hkv > 0 and Hq % Hkv == 0, "k_cache", f"Hkv={Hkv} must divide Hq={Hq}")
    _check(S >= 1 and num_slots >= 1, "k_cache", f"expected S >= 1 rows and >= 1 slot, got "
           f"shape {tuple(k_cache.shape)}")
    _check(v_cache.shape == k_cache.shape, "v_cache",
           f"shape {tuple(v_cache.shape)} != k_cache's {tuple(k_cache.shape)}")
    _check(slots.shape[0] == B, "slots", f"expected [{B}], got {tuple(slots.shape)}")
    _check(tuple(positions.shape) == (B, 1), "positions",
           f"expected [{B}, 1], got {tuple(positions.shape)}")
    _check(isinstance(window, int) and window >= 0, "window", f"expected an int >= 0, got {window}")
    _positive_int(num_splits, "num_splits")
    _check(num_slots * S * Hkv * D < 2**62, "k_cache", "too large for int64 offsets")
    _check(S < 2**30, "k_cache", f"expected fewer than 2**30 rows, got {S}")
    fuse = sinks is not None
    if fuse:
        _check_tensor(sinks, "sinks", torch.float32, 1)
        _check(tuple(sinks.shape) == (Hq,), "sinks", f"expected ({Hq},), got {tuple(sinks.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots),
                    ("positions", positions)) + ((("sinks", sinks),) if fuse else ()):
        _check(t.device == q.device, name, f"on {t.device}, q on {q.device}")
    on_gpu = q.is_cuda and not interpreting()
    r_warps = None
    if on_gpu and window and B > 0:  # a sliding layer's ring: `ring_launch` by batch
        r_bs, r_warps, r_stages, per_split = ring_launch(B)
        block_s = r_bs if block_s is None else block_s
        num_stages = r_stages if num_stages is None else num_stages
        if per_split and programs_per_head is None:
            programs_per_head = num_splits
    if programs_per_head is None and B > 0:
        programs_per_head = default_programs_per_head(B, Hkv, _num_sms(q.device),
                                                      GPU_CTAS_PER_SM if on_gpu else 1)
    if min_rows is None:
        if not on_gpu:
            min_rows = CPU_MIN_ROWS  # small runs: the CPU tests exercise the merges
        elif window:  # a sliding layer's ring (S = W rows): one program per split
            min_rows = ring_min_rows(S, num_splits)
        else:
            min_rows = full_min_rows()
    max_pieces = MAX_PIECES_PER_SPLIT if max_pieces is None else max_pieces
    block_s = (GPU_BLOCK_S if on_gpu else CPU_BLOCK_S) if block_s is None else block_s
    clamp = window == 0 or S <= window  # the visible rows are 0..p (or the whole ring)
    preload = bool(preload_enabled() if preload is None else preload) and clamp
    if num_warps is None:
        num_warps = GPU_PRELOAD_NUM_WARPS if preload else (r_warps or GPU_NUM_WARPS)
    num_stages = GPU_NUM_STAGES if num_stages is None else num_stages
    for name, v in (("programs_per_head", programs_per_head), ("min_rows", min_rows),
                    ("max_pieces", max_pieces), ("num_warps", num_warps),
                    ("num_stages", num_stages)):
        if v is not None:
            _positive_int(v, name)
    _check(isinstance(block_s, int) and block_s >= 16 and block_s & (block_s - 1) == 0,
           "block_s", f"expected a power of two >= 16, got {block_s!r}")
    from flintc.ops import attention  # the split layout's SPLIT_ROWS (on call, see above)

    G = Hq // Hkv
    o_part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(B, 1, Hq * D, dtype=torch.bfloat16, device=q.device) if fuse else None
    if B == 0:
        return out if fuse else (o_part, lse)
    T = programs_per_head
    # Scratch: two partial slots per program (its first and last split).
    ws_o = torch.empty(B * Hkv * T * 2 * G * D, dtype=torch.float32, device=q.device)
    ws_lse = torch.empty(B * Hkv * T * 2 * G, dtype=torch.float32, device=q.device)
    # Arrival counters: one per chunk, then (fused) one per (sequence, KV head).
    counters = _counters(q.device, B * Hkv * (num_splits + fuse))
    done = counters[B * Hkv * num_splits:] if fuse else counters
    pdl = bool(use_pdl) and on_gpu
    extra = {"launch_pdl": True} if pdl else {}
    if on_gpu:
        extra.update(num_warps=num_warps, num_stages=num_stages)
    decode_attention_kernel[(B * Hkv, T)](
        q, k_cache, v_cache, slots, positions, o_part, lse, ws_o, ws_lse, counters,
        sinks if fuse else lse, out if fuse else o_part, done,
        S, attention.SPLIT_ROWS, num_splits, T, math.ceil(min_rows / block_s), max_pieces,
        D ** -0.5,
        HKV=Hkv, G=G, D=D, WINDOW=window, CLAMP_TO_P=clamp,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_GM=triton.next_power_of_2(G),
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_S=block_s,
        MERGE_P=GPU_MERGE_P if on_gpu else CPU_MERGE_P, BF16_DOT=on_gpu, USE_PDL=pdl_mode(pdl),
        PRELOAD=preload, POISON_CURRENT=bool(_poison_current_row), FUSE_COMBINE=fuse,
        SOFT_RNE=not on_gpu, COMBINE_P=GPU_COMBINE_P if on_gpu else CPU_COMBINE_P, **extra,
    )
    return out if fuse else (o_part, lse)


def decode_attention(q, k_cache, v_cache, slots, positions, window: int, num_splits: int,
                     *, use_pdl: bool = False):
    """Split-KV decode attention (contract and reference: `flintc.ops.attention.
    decode_attention`, i.e. `torch.ops.flintc.decode_attention`); handles every input
    the op accepts (no fallback).

    q: bf16 [B, 1, Hq, D]; k_cache, v_cache: bf16 [slots, S, Hkv, D] already holding
    the new token; slots: int32/int64 [B] (a negative slot is a padding row, which
    reads no cache row: all its chunks empty; `flintc.ops.attention.pad_slot`);
    positions: int64 [B, 1]; window: W for a
    ring cache of W rows, 0 for a full cache (rows 0..p visible); num_splits: N, the
    most chunks a sequence's visible rows are cut into (`flintc.ops.attention.
    split_layout`). Returns (o_part fp32 [B, Hq, N, D], lse fp32 [B, Hq, N]),
    o = 0 and lse = -inf for chunks without a visible key. All tensors contiguous, on
    one device. Raises ValueError naming the argument on a wrong dtype, shape, layout
    or device (and for S >= 2**30 rows).

    Bytes read: q 2*B*Hq*D, K and V 2 * 2*B*Hkv*D*R where R is the number of visible
    rows per sequence (full cache: p + 1, not S; ring: the written rows, up to W);
    written: 4*B*Hq*N*(D + 1), plus 4*G*(D + 1) per partial of a split shared by several
    programs (read back once by the merge). `use_pdl` launches with programmatic
    dependent launch (CUDA only; ignored in the interpreter).
    """
    return launch_decode_attention(q, k_cache, v_cache, slots, positions, window, num_splits,
                                   use_pdl=use_pdl)


def decode_attention_combine(q, k_cache, v_cache, slots, positions, sinks, window: int,
                             num_splits: int, *, use_pdl: bool = False):
    """`decode_attention` and `attention_combine` in one launch (contract and reference:
    `flintc.ops.grouped.decode_attention_combine`, i.e.
    `torch.ops.flintc.decode_attention_combine`, which composes the two references).

    The split-KV decomposition is `decode_attention`'s; the busy programs of each
    (sequence, KV head) then count their arrivals on a counter (atomic, acq_rel, after
    their partials are stored or merged), and the last to arrive merges the visible
    chunks with the sinks for the G query heads of that KV head and writes the bf16
    output, as `attention_combine_kernel` does for one head (the split-K "last block
    reduces" pattern, as TensorRT-LLM's multi-block XQA attention does). The partials
    are scratch: empty chunks are neither written nor read. One launch less per layer.

    q, k_cache, v_cache, slots, positions, window, num_splits: as `decode_attention`;
    sinks: fp32 [Hq]. Returns bf16 [B, 1, Hq * D], rounded once; as the two kernels up
    to summation order (within one bf16 ulp of the reference; tests check it).
    Bytes: `decode_attention`'s reads and partials, plus 4*Hq for the sinks and
    2*B*Hq*D written. Raises ValueError naming the argument on a wrong dtype, shape,
    layout or device. `use_pdl`: programmatic dependent launch (CUDA only).
    """
    return launch_decode_attention(q, k_cache, v_cache, slots, positions, window, num_splits,
                                   use_pdl=use_pdl, sinks=sinks)


def attention_combine(o_part, lse, sinks, *, use_pdl: bool = False):
    """Merge the split-KV partials with the learned sink (contract and reference:
    `flintc.ops.attention.attention_combine`, i.e. `torch.ops.flintc.attention_combine`):
    `o = sum_n exp(lse_n - m) o_n / (exp(sink - m) + sum_n exp(lse_n - m))`,
    m = max(sink, max_n lse_n) (FLINT_SPEC 2, step 6). An empty split (lse = -inf) adds
    nothing (its o, 0 by contract, is read but weighted by an exact 0); the sink is
    counted once; no NaN when every split is empty (the output is then 0).

    o_part: fp32 [B, Hq, N, D]; lse: fp32 [B, Hq, N]; sinks: fp32 [Hq]; contiguous, one
    device. Returns bf16 [B, 1, Hq*D], rounded once; fp32 inside, equal to the
    reference up to summation order and exp ulps (one bf16 ulp at most).
    Bytes read: 4*B*Hq*N*(D + 1) + 4*Hq; written: 2*B*Hq*D.
    Raises ValueError naming the argument on a wrong dtype, shape, layout or device.
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
    pdl = bool(use_pdl) and o_part.is_cuda and not interpreting()
    extra = {"launch_pdl": True} if pdl else {}
    attention_combine_kernel[(B * Hq,)](
        o_part, lse, sinks, out,
        HQ=Hq, N=N, D=D, BLOCK_N=triton.next_power_of_2(N), BLOCK_D=triton.next_power_of_2(D),
        SOFT_RNE=not (o_part.is_cuda and not interpreting()), USE_PDL=pdl_mode(pdl), num_warps=4, **extra,
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


def aot_probe_specs(configs=None):
    """Compile specs for `scripts/triton_aot_probe.py` (sm_90 without a GPU): the full
    model's shapes (Hq=32, Hkv=4, D=128); the attention kernel for a full cache (the
    same code as a ring of S <= W rows) with each launch configuration of `configs`
    ((BLOCK_S, warps, stages) tuples, the first one also for a ring longer than W and
    with the early reads (PRELOAD) of a full cache and of a ring; default: the GPU_*
    constants and the benchmark sweep's others), a sliding layer's ring with each other
    `RING_LAUNCH` configuration, and the combine."""
    configs = configs or [(GPU_BLOCK_S, GPU_NUM_WARPS, GPU_NUM_STAGES), (64, 8, 3), (128, 4, 2),
                          (32, 4, 4)]
    types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
             "slots_ptr": "*i64", "positions_ptr": "*i64", "o_part_ptr": "*fp32",
             "lse_ptr": "*fp32", "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32",
             "counter_ptr": "*i32", "sinks_ptr": "*fp32", "out_ptr": "*bf16", "done_ptr": "*i32",
             "S": "i32", "SPLIT_ROWS": "i32", "N": "i32", "T": "i32",
             "MIN_BLOCKS": "i32", "MAX_PIECES": "i32", "scale": "fp32"}
    names = decode_attention_kernel.arg_names
    specs = []
    # full cache, or a ring of S <= W rows; a ring longer than W: the row-by-row mask;
    # the early reads (PRELOAD) of a full cache and of a sliding layer's ring (W = 513)
    # with the combine in the launch (FUSE_COMBINE) for a full cache and a ring
    variants = [(0, True, cfg, False, False) for cfg in configs]
    pre = (GPU_BLOCK_S, GPU_PRELOAD_NUM_WARPS, GPU_NUM_STAGES)
    variants += [(513, False, configs[0], False, False), (0, True, pre, True, False),
                 (513, True, pre, True, False), (0, True, configs[0], False, True),
                 (513, True, configs[0], False, True)]
    # the sliding layers' ring launches (`RING_LAUNCH`) other than the first configuration
    variants += [(513, True, cfg, False, False) for cfg in
                 sorted({tuple(v[:3]) for v in RING_LAUNCH.values()} - {tuple(configs[0])})]
    for window, clamp, (block_s, warps, stages), preload, fuse in variants:
        consts = {"HKV": 4, "G": 8, "D": 128, "WINDOW": window, "CLAMP_TO_P": clamp,
                  "BLOCK_G": 16, "BLOCK_GM": 8, "BLOCK_D": 128, "BLOCK_S": block_s,
                  "MERGE_P": GPU_MERGE_P, "BF16_DOT": True, "USE_PDL": PDL_EARLY,
                  "PRELOAD": preload, "POISON_CURRENT": False, "FUSE_COMBINE": fuse,
                  "SOFT_RNE": False, "COMBINE_P": GPU_COMBINE_P}
        kind = "ring > W" if not clamp else ("ring" if window else "full")
        specs.append({
            "name": f"decode_attention {kind}{' preload' if preload else ''}"
                    f"{' fused combine' if fuse else ''} BLOCK_S={block_s} "
                    f"warps={warps} stages={stages}",
            "fn": decode_attention_kernel,
            "signature": {n: types.get(n, "constexpr") for n in names},
            "constexprs": consts, "num_warps": warps, "num_stages": stages,
            # as a launch specialises them: SPLIT_ROWS = 64; S of a full cache (a ring: 513)
            "divisible": ("S", "SPLIT_ROWS") if window == 0 else ("SPLIT_ROWS",),
        })
    combine_names = attention_combine_kernel.arg_names
    ctypes = {"o_part_ptr": "*fp32", "lse_ptr": "*fp32", "sinks_ptr": "*fp32", "out_ptr": "*bf16"}
    for n in (3, 32):
        specs.append({
            "name": f"attention_combine N={n}", "fn": attention_combine_kernel,
            "signature": {a: ctypes.get(a, "constexpr") for a in combine_names},
            "constexprs": {"HQ": 32, "N": n, "D": 128, "BLOCK_N": triton.next_power_of_2(n),
                           "BLOCK_D": 128, "SOFT_RNE": False, "USE_PDL": PDL_EARLY},
            "num_warps": 4, "num_stages": 1,
        })
    return specs


KERNELS = {
    "decode_attention": decode_attention,
    "attention_combine": attention_combine,
    "decode_attention_combine": decode_attention_combine,
}
