"""Split-KV (flash-decoding) attention for one new token per sequence, and the combine
that merges the splits with the learned sink (FLINT_SPEC 2, attention steps 5-7).

Contract and references: `flintc.ops.attention.decode_attention` and
`flintc.ops.attention.attention_combine` (`torch.ops.flintc.*`). The op cuts the S cache
rows into `num_splits` (N) equal chunks of C = ceil(S / N) rows and returns one fp32
partial per chunk, normalised within the chunk, with its log-sum-exp (o = 0 and
lse = -inf for a chunk without a visible key); the combine merges them with the sink.

Work decomposition (`decode_attention_kernel`). N is a graph constant chosen by the
compiler for the longest context, but the visible rows R (full cache: rows 0..p; ring:
the written rows) change every step. So the grid does not map one program to one chunk:
per (sequence, KV head) it has T = TARGET + N programs, and each derives its work from
p at run time. The R visible rows are cut into about TARGET - nchunks pieces of at
least MIN_ROWS rows, balanced within each chunk (a chunk gets pf pieces, at most
BLOCK_P); pieces never straddle a chunk boundary. A chunk covered by one piece is
written directly; otherwise each piece writes an fp32 partial (o, lse) to a workspace
and bumps the chunk's arrival counter (atomic, acq_rel), and the last piece to arrive
merges the partials of its chunk by log-sum-exp into o_part and resets the counter to
0. Rows past R are never read, so a 262,144-row cache holding 100K tokens costs 100K
rows of reads whatever N is, and the number of busy programs (~TARGET per head, chosen
by the launcher to fill the GPU: `GPU_CTAS_PER_SM` x SMs / (B x Hkv)) does not depend
on the context length or on N. Programs whose chunk index is in [nchunks, N) also
write that empty chunk (o = 0, lse = -inf). One program handles the G = Hq / Hkv query
heads of one KV head, so K and V are read once per group (GQA).

Numerics: scores, online softmax and p.v in fp32. On the GPU q.k is a bf16 x bf16
tensor-core product (exact products, fp32 accumulation) and p.v splits fp32 p into
three bf16 parts (exact), so both equal the fp32 sums of the reference up to summation
order; in the interpreter everything is upcast to fp32 right after the load (bf16
arithmetic is wrong there, ../shared/NOTES.md). Differences from the reference are
fp32 reordering (online softmax, piece merges) and exp/log ulps: o_part and lse agree
to ~1e-6 relative (measured in the interpreter: max |diff| 3.6e-7 on o, 4.8e-7 on lse;
tests allow 1e-5, 2e-5 on the GPU), the combined bf16 output to one bf16 ulp where an
fp32 value sits on a rounding boundary. `attention_combine` rounds to bf16 once, to
nearest even (FLINT_SPEC 3); in the interpreter, whose fp32 -> bf16 cast truncates,
the rounding is done in integer arithmetic.

Scratch state: the arrival counters are a persistent int32 buffer per (device, size),
allocated zeroed on first use and left zeroed by every launch. Two decode_attention
launches of the same B x Hkv x N must therefore not run concurrently on different
streams (in one stream, and with PDL, they are ordered: every kernel calls gdc_wait
before touching them). Nothing runs at import.
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
    ws_o_ptr, ws_lse_ptr, counter_ptr,
    S, CHUNK, N, T, TARGET, MIN_ROWS, scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
    CLAMP_TO_P: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BF16_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program (bh = b * HKV + kv head, t): piece j of chunk n of sequence b (see the
    # module docstring), and the empty chunk t when t is in [nchunks, N).
    bh = tl.program_id(0)
    t = tl.program_id(1)
    b = bh // HKV
    hk = bh % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    mask_g = offs_g < G  # BLOCK_G >= 16 for tl.dot: rows past G are padding
    mask_d = offs_d < D
    out_mask = mask_g[:, None] & mask_d[None, :]
    heads = (bh * G + offs_g).to(tl.int64)  # rows of o_part [B * HKV * G, N, D]
    if USE_PDL:
        # q, slots, positions and the cache are written by the previous kernels; the
        # counters by the previous launch of this kernel.
        tl.extra.cuda.gdc_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p = tl.load(positions_ptr + b).to(tl.int32)  # positions [B, 1]

    # Visible rows are all in [0, R): full cache rows 0..p; a ring of S <= W rows holds
    # rows 0..p until it wraps, then all of them. (A ring longer than W: all S rows,
    # masked row by row below as in the reference.)
    if CLAMP_TO_P:
        R = tl.maximum(tl.minimum(p + 1, S), 0)
    else:
        R = S + 0 * p
    nchunks = (R + CHUNK - 1) // CHUNK

    if (t >= nchunks) & (t < N):
        # Chunk t has no visible row: o = 0, lse = -inf (the op's convention).
        zero_ptrs = o_part_ptr + (heads[:, None] * N + t) * D + offs_d[None, :]
        tl.store(zero_ptrs, tl.zeros([BLOCK_G, BLOCK_D], tl.float32), mask=out_mask)
        tl.store(lse_ptr + heads * N + t, tl.full([BLOCK_G], float("-inf"), tl.float32),
                 mask=mask_g)

    # Piece size: about TARGET - nchunks pieces over R rows (the pieces of a partly
    # filled last chunk add at most nchunks more), at least MIN_ROWS rows, and at most
    # BLOCK_P pieces per chunk; pieces balanced within a chunk.
    avail = tl.maximum(TARGET - nchunks, 1)
    sub = tl.maximum((R + avail - 1) // avail, MIN_ROWS)
    sub = tl.maximum(sub, (CHUNK + BLOCK_P - 1) // BLOCK_P)
    pf = (CHUNK + sub - 1) // sub  # pieces of a full chunk, 1..BLOCK_P
    piece = (CHUNK + pf - 1) // pf
    n = t // pf
    j = t % pf
    c_lo = n * CHUNK
    c_hi = tl.minimum(c_lo + CHUNK, R)
    pn = (c_hi - c_lo + piece - 1) // piece  # pieces of chunk n (<= 0 past the last)

    if (n < nchunks) & (j < pn):
        # q [B, 1, HKV * G, D]: heads hk * G .. hk * G + G - 1.
        q_ptrs = q_ptr + heads[:, None] * D + offs_d[None, :]
        q = tl.load(q_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        lo = c_lo + j * piece
        hi = tl.minimum(lo + piece, c_hi)
        kv_base = slot * S * HKV * D + hk * D  # row r of this head: kv_base + r * HKV * D

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for s0 in range(lo, hi, BLOCK_S):
            rows = s0 + offs_s
            in_piece = rows < hi
            if WINDOW == 0:
                visible = in_piece  # hi <= p + 1 already: key position = row <= p
            else:
                # Ring of WINDOW rows: row r holds p - ((p - r) mod W); negative = never
                # written. The mod is taken non-negative (Triton's % truncates like C).
                r = (p - rows) % WINDOW
                r = tl.where(r < 0, r + WINDOW, r)
                kpos = p - r
                visible = in_piece & (kpos >= 0) & (kpos <= p) & (p - kpos < WINDOW)
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
            # No visible key so far: m_new is -inf; subtract 0 so exp(-inf) = 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            pr = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            if BF16_DOT:
                # pr is full fp32: split it into three bf16 parts (8 + 8 + 8 mantissa
                # bits, exact for fp32) so the tensor-core p.v is the fp32 one up to order.
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

        has_keys = l_i > 0.0  # no visible key (a ring longer than W): o = 0, lse = -inf
        l_safe = tl.where(has_keys, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(has_keys, m_i + tl.log(l_safe), float("-inf"))
        if pn == 1:
            o_ptrs = o_part_ptr + (heads[:, None] * N + n) * D + offs_d[None, :]
            tl.store(o_ptrs, o, mask=out_mask)
            tl.store(lse_ptr + heads * N + n, lse, mask=mask_g)
        else:
            # Workspace ws_o [B * HKV, T, G, D], ws_lse [B * HKV, T, G]: slot t.
            ws_rows = ((bh * T + t) * G + offs_g).to(tl.int64)
            tl.store(ws_o_ptr + ws_rows[:, None] * D + offs_d[None, :], o, mask=out_mask)
            tl.store(ws_lse_ptr + ws_rows, lse, mask=mask_g)
            # All threads' stores before the release of the arrival count.
            tl.debug_barrier()
            cnt = counter_ptr + bh * N + n
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == pn - 1:
                # Last piece of chunk n: merge its pn partials (slots n * pf + 0..pn-1)
                # by log-sum-exp, as `attention_combine` does without a sink.
                tl.debug_barrier()
                offs_p = tl.arange(0, BLOCK_P)
                mask_p = offs_p < pn
                slot_p = bh * T + n * pf + offs_p  # [BLOCK_P]
                for g in range(G):
                    part_rows = (slot_p * G + g).to(tl.int64)
                    # .cg: read at L2, where the other programs' stores are.
                    lse_p = tl.load(ws_lse_ptr + part_rows, mask=mask_p, other=float("-inf"),
                                    cache_modifier=".cg")
                    o_p = tl.load(ws_o_ptr + part_rows[:, None] * D + offs_d[None, :],
                                  mask=mask_p[:, None] & mask_d[None, :], other=0.0,
                                  cache_modifier=".cg")
                    m = tl.max(lse_p, axis=0)
                    m_s = tl.where(m == float("-inf"), 0.0, m)
                    w = tl.exp(lse_p - m_s)  # empty pieces: exp(-inf) = 0
                    den = tl.sum(w, axis=0)
                    den_s = tl.where(den > 0.0, den, 1.0)
                    o_g = tl.sum(w[:, None] * o_p, axis=0) / den_s
                    lse_g = tl.where(den > 0.0, m_s + tl.log(den_s), float("-inf"))
                    head = bh.to(tl.int64) * G + g
                    tl.store(o_part_ptr + (head * N + n) * D + offs_d, o_g, mask=mask_d)
                    tl.store(lse_ptr + head * N + n, lse_g)
                tl.atomic_xchg(cnt, 0)  # ready for the next launch
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


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
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = pid.to(tl.int64)
    # Padding splits read as lse = -inf, o = 0: they add nothing, like empty chunks.
    lse = tl.load(lse_ptr + row * N + offs_n, mask=mask_n, other=float("-inf"))
    # Empty splits (lse = -inf, o = 0 by contract) are not read: weight 0 either way.
    live = mask_n & (lse > float("-inf"))
    o_ptrs = o_part_ptr + (row * N + offs_n[:, None]) * D + offs_d[None, :]
    o = tl.load(o_ptrs, mask=live[:, None] & mask_d[None, :], other=0.0)
    m = tl.maximum(tl.max(lse, axis=0), sink)  # finite because the sink is
    w = tl.exp(lse - m)  # empty splits: exp(-inf) = 0; the sink is counted once, below
    denom = tl.exp(sink - m) + tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / denom
    if SOFT_RNE:
        out_bf16 = _to_bf16_rne(out)  # interpreter: round like torch, not truncate
    else:
        out_bf16 = out.to(tl.bfloat16)
    # out [B, 1, HQ * D]: row b * HQ + h.
    tl.store(out_ptr + row * D + offs_d, out_bf16, mask=mask_d)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


# Launch configuration on the GPU (no autotuning: it synchronizes, which breaks CUDA-graph
# capture). BLOCK_S / warps / stages were measured on an H200 with the one-program-per-chunk
# kernel (benchmarks/bench_decode_attention.py); 3 stages of 64 K and V rows (96 KiB of
# shared memory) let two programs share an SM. The benchmark's sweep section re-measures.
GPU_BLOCK_S = 64
GPU_NUM_WARPS = 8
GPU_NUM_STAGES = 3
GPU_CTAS_PER_SM = 2  # busy programs per SM the decomposition aims for (one wave)
GPU_MIN_ROWS = 256  # smallest piece of a split: below it, fixed costs dominate
MAX_PIECES_PER_SPLIT = 32  # BLOCK_P cap: the merge reads [BLOCK_P, D] tiles
# Interpreter (CPU) configuration: tiny blocks so that tests exercise many pieces.
CPU_BLOCK_S = 16
CPU_MIN_ROWS = 16
CPU_NUM_SMS = 4

_COUNTERS: dict[tuple, torch.Tensor] = {}
_NUM_SMS: dict[int, int] = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or _interpreting():
        return CPU_NUM_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


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


def choose_num_splits(max_context: int, batch: int, num_sms: int = 132, num_kv_heads: int = 4,
                      window: int = 0) -> int:
    """The `attention_splits` value for a cache of `max_context` rows (W for a ring of
    window W), batch `batch`, on a GPU of `num_sms` SMs with `num_kv_heads` KV heads.

    This kernel picks its own parallelism from the visible rows at run time, so N only
    has to (a) allow enough pieces: at most `MAX_PIECES_PER_SPLIT` pieces per split, so
    N >= ceil(target programs per head / 32), and (b) keep o_part (4*B*Hq*N*(D+1) bytes,
    written here and read by the combine) small. Returns ceil(rows / 256) clamped to
    [that lower bound, 32] for full caches (32 for 262,144 rows, the compiler's current
    default), and ceil(W / 256) for rings (3 for W = 513; a ring's 513 rows are read by
    a few programs per head without merges). Raises ValueError for non-positive inputs.
    """
    for name, v in (("max_context", max_context), ("batch", batch), ("num_sms", num_sms),
                    ("num_kv_heads", num_kv_heads)):
        if int(v) < 1:
            raise ValueError(f"{name}: expected >= 1, got {v}")
    if window:
        return max(1, math.ceil(min(max_context, window) / GPU_MIN_ROWS))
    target = math.ceil(GPU_CTAS_PER_SM * num_sms / (batch * num_kv_heads))
    lower = math.ceil(target / MAX_PIECES_PER_SPLIT)
    return max(lower, min(32, math.ceil(max_context / GPU_MIN_ROWS)))


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what}")


def _check_tensor(t, name: str, dtype, ndim: int) -> None:
    _check(isinstance(t, torch.Tensor), name, "expected a torch.Tensor")
    _check(t.dtype == dtype, name, f"expected dtype {dtype}, got {t.dtype}")
    _check(t.dim() == ndim, name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    _check(t.is_contiguous(), name, "expected a contiguous tensor")


def launch_decode_attention(q, k_cache, v_cache, slots, positions, window: int, num_splits: int,
                            *, use_pdl: bool = False, programs_per_head: int | None = None,
                            min_rows: int | None = None):
    """`decode_attention` with the decomposition knobs exposed (tests and benchmarks).

    programs_per_head: TARGET, the busy programs per (sequence, KV head) to aim for;
    default ceil(GPU_CTAS_PER_SM x SMs / (B x Hkv)) (interpreter: 4 "SMs").
    min_rows: the smallest piece in rows; default GPU_MIN_ROWS (interpreter:
    CPU_MIN_ROWS). Other arguments, results and errors as `decode_attention`; also
    raises ValueError for programs_per_head or min_rows < 1.
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
    _check(isinstance(num_splits, int) and num_splits >= 1, "num_splits",
           f"expected an int >= 1, got {num_splits}")
    _check(num_slots * S * Hkv * D < 2**62, "k_cache", "too large for int64 offsets")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots),
                    ("positions", positions)):
        _check(t.device == q.device, name, f"on {t.device}, q on {q.device}")
    G = Hq // Hkv
    o_part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    if B == 0:
        return o_part, lse
    on_gpu = q.is_cuda and not _interpreting()
    if programs_per_head is None:
        programs_per_head = math.ceil((GPU_CTAS_PER_SM if on_gpu else 1) * _num_sms(q.device)
                                      / (B * Hkv))
    if min_rows is None:
        min_rows = GPU_MIN_ROWS if on_gpu else CPU_MIN_ROWS
    _check(isinstance(programs_per_head, int) and programs_per_head >= 1, "programs_per_head",
           f"expected an int >= 1, got {programs_per_head}")
    _check(isinstance(min_rows, int) and min_rows >= 1, "min_rows",
           f"expected an int >= 1, got {min_rows}")
    chunk = math.ceil(S / num_splits)
    grid_t = programs_per_head + num_splits  # busy pieces <= TARGET + nchunks <= this
    block_p = min(MAX_PIECES_PER_SPLIT, triton.next_power_of_2(grid_t))
    # Scratch: per-program partials (written only where a split has several pieces).
    ws_o = torch.empty(B * Hkv * grid_t * G * D, dtype=torch.float32, device=q.device)
    ws_lse = torch.empty(B * Hkv * grid_t * G, dtype=torch.float32, device=q.device)
    counters = _counters(q.device, B * Hkv * num_splits)
    pdl = bool(use_pdl) and on_gpu
    extra = {"launch_pdl": True} if pdl else {}
    stages = {"num_stages": GPU_NUM_STAGES} if on_gpu else {}
    decode_attention_kernel[(B * Hkv, grid_t)](
        q, k_cache, v_cache, slots, positions, o_part, lse, ws_o, ws_lse, counters,
        S, chunk, num_splits, grid_t, programs_per_head, min_rows, D ** -0.5,
        HKV=Hkv, G=G, D=D, WINDOW=window, CLAMP_TO_P=(window == 0 or S <= window),
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_S=GPU_BLOCK_S if on_gpu else CPU_BLOCK_S, BLOCK_P=max(2, block_p),
        BF16_DOT=on_gpu, USE_PDL=pdl,
        num_warps=GPU_NUM_WARPS if on_gpu else 4, **stages, **extra,
    )
    return o_part, lse


def decode_attention(q, k_cache, v_cache, slots, positions, window: int, num_splits: int,
                     *, use_pdl: bool = False):
    """Split-KV decode attention (contract and reference: `flintc.ops.attention.
    decode_attention`, i.e. `torch.ops.flintc.decode_attention`); handles every input
    the op accepts (no fallback).

    q: bf16 [B, 1, Hq, D]; k_cache, v_cache: bf16 [slots, S, Hkv, D] already holding
    the new token; slots: int32/int64 [B]; positions: int64 [B, 1]; window: W for a
    ring cache of W rows, 0 for a full cache (rows 0..p visible); num_splits: N equal
    chunks of ceil(S / N) rows. Returns (o_part fp32 [B, Hq, N, D], lse fp32 [B, Hq, N]),
    o = 0 and lse = -inf for chunks without a visible key. All tensors contiguous, on
    one device. Raises ValueError naming the argument on a wrong dtype, shape, layout
    or device.

    Bytes read: q 2*B*Hq*D, K and V 2 * 2*B*Hkv*D*R where R is the number of visible
    rows per sequence (full cache: p + 1, not S; ring: the written rows, up to W);
    written: 4*B*Hq*N*(D + 1), plus 4*G*(D + 1) per piece of a split that has several
    (read back once by the merge). `use_pdl` launches with programmatic dependent
    launch (CUDA only; ignored in the interpreter).
    """
    return launch_decode_attention(q, k_cache, v_cache, slots, positions, window, num_splits,
                                   use_pdl=use_pdl)


def attention_combine(o_part, lse, sinks, *, use_pdl: bool = False):
    """Merge the split-KV partials with the learned sink (contract and reference:
    `flintc.ops.attention.attention_combine`, i.e. `torch.ops.flintc.attention_combine`):
    `o = sum_n exp(lse_n - m) o_n / (exp(sink - m) + sum_n exp(lse_n - m))`,
    m = max(sink, max_n lse_n) (FLINT_SPEC 2, step 6). An empty split (lse = -inf) adds
    nothing and its o is not read; the sink is counted once; no NaN when every split is
    empty (the output is then 0).

    o_part: fp32 [B, Hq, N, D]; lse: fp32 [B, Hq, N]; sinks: fp32 [Hq]; contiguous, one
    device. Returns bf16 [B, 1, Hq*D], rounded once; fp32 inside, equal to the
    reference up to summation order and exp ulps (one bf16 ulp at most).
    Bytes read: 4*B*Hq*(N + D*live splits) + 4*Hq; written: 2*B*Hq*D.
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
    pdl = bool(use_pdl) and o_part.is_cuda and not _interpreting()
    extra = {"launch_pdl": True} if pdl else {}
    attention_combine_kernel[(B * Hq,)](
        o_part, lse, sinks, out,
        HQ=Hq, N=N, D=D, BLOCK_N=triton.next_power_of_2(N), BLOCK_D=triton.next_power_of_2(D),
        SOFT_RNE=not (o_part.is_cuda and not _interpreting()), USE_PDL=pdl, num_warps=4, **extra,
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


KERNELS = {
    "decode_attention": decode_attention,
    "attention_combine": attention_combine,
}
