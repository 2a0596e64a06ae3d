"""Flash-attention prefill over the KV cache, with GQA, the causal mask, the sliding
window over a ring cache, and the learned sink; then the KV-cache write of the chunk
(FLINT_SPEC 2, attention steps 4-7).

Contract and plain-torch reference: `flintc.ops.attention.prefill_attention_kv`
(`torch.ops.flintc.prefill_attention_kv`). A chunk of T new tokens per sequence at
positions p0..p0+T-1 attends over the keys cached for positions < p0 (a full layer:
rows 0..p0-1; a sliding layer: the ring of W rows, position j in row j % W) and over
its own new keys (causal), each query seeing itself and, in a sliding layer, the W-1
positions before it. Then the new k, v go into the cache.

`prefill_attention_kernel`: one program per (tile of BLOCK_T query tokens, sequence b,
KV head). Its rows are the tile's tokens x the G = Hq/Hkv query heads that share the
KV head (row = token * G_PAD + head), so each K/V block is loaded once for the whole
group. It walks two key ranges with an online softmax in fp32: the cached positions
the tile can see ([max(0, p_first - W + 1), p0) in a sliding layer, [0, p0) in a full
one), then the new keys up to the tile's last token; key blocks nobody in the tile
can see are never visited, and masked rows are never loaded. The softmax state starts
at the sink (m = sink, l = 1, acc = 0), so `acc / l` is the softmax with the sink
taking its share of the mass and no value. o is rounded to bf16 once, at the store.
`kv_write_kernel`: copies the chunk's k and v rows into the cache (rows p, or ring
slots p % W of the last min(T, W) tokens, as `write_kv`), bit for bit (int16 copy).
It runs after the attention kernel on the same stream, so every old row is read
before it is overwritten; with PDL it waits (`gdc_wait`) for the attention grid.

Numerics: q.k is exact products with fp32 accumulation (bf16 x bf16 MMA on the GPU,
fp32 `tl.dot` in the interpreter); on the GPU p.v splits the fp32 probabilities into
`GPU_PV_SPLITS` bf16 parts (2: 16 mantissa bits of p, relative error <= 2^-17 per
term; 3: exact) and accumulates in fp32. The reduction order (blocks of keys, MMA
order) and exp (Triton's against torch's) differ from the reference, so outputs
agree to fp32 rounding: measured within one bf16 ulp of the reference on every
element in tests/kernels/test_prefill_attention.py. The cache write is bit-exact.
Nothing runs at import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flintc.kernels.pdl import pdl_mode
from flintc.kernels.platform import interpreting


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_blk_ptr, v_blk_ptr, kpos, key_ok, qpos, row_ok, offs_d,
                  scale, WINDOW: tl.constexpr, D: tl.constexpr, BF16_DOT: tl.constexpr,
                  PV_SPLITS: tl.constexpr):
    # One block of keys: kpos [BLOCK_N] positions (key_ok: in range); k/v pointers
    # [BLOCK_N, BLOCK_D]. Returns the updated online-softmax state.
    visible = key_ok[None, :] & (kpos[None, :] <= qpos[:, None]) & row_ok[:, None]
    if WINDOW > 0:
        visible = visible & (qpos[:, None] - kpos[None, :] < WINDOW)
    kv_mask = key_ok[:, None] & (offs_d[None, :] < D)  # rows out of range are not read
    k = tl.load(k_blk_ptr, mask=kv_mask, other=0.0)
    v = tl.load(v_blk_ptr, mask=kv_mask, other=0.0)
    if BF16_DOT:
        # q is bf16 here: bf16 x bf16 products are exact in fp32, the MMA accumulates in fp32.
        s = tl.dot(q, tl.trans(k))
    else:
        # Interpreter: bf16 arithmetic is wrong there; upcast right after the load.
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = tl.where(visible, s * scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: m starts at the sink
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])  # invisible keys: exp(-inf) = 0
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if BF16_DOT:
        # p is fp32: split it into PV_SPLITS bf16 parts (8 mantissa bits each) so the
        # tensor-core p.v carries 8 * PV_SPLITS bits of p, accumulated in fp32.
        p1 = p.to(tl.bfloat16)
        acc = tl.dot(p1, v, acc)
        if PV_SPLITS >= 2:
            r1 = p - p1.to(tl.float32)
            p2 = r1.to(tl.bfloat16)
            acc = tl.dot(p2, v, acc)
            if PV_SPLITS >= 3:
                p3 = (r1 - p2.to(tl.float32)).to(tl.bfloat16)
                acc = tl.dot(p3, v, acc)
    else:
        acc += tl.dot(p, v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, positions_ptr, sinks_ptr, out_ptr,
    T, S, scale,
    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    WINDOW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, PV_SPLITS: tl.constexpr, BF16_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program (query tile, b * HKV + kv head): tokens t0..t0+BLOCK_T-1 of sequence b,
    # query heads hk*G .. hk*G+G-1; rows r = token * G_PAD + head (BLOCK_M = BLOCK_T * G_PAD).
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    t0 = pid_t * BLOCK_T
    t = t0 + offs_m // G_PAD  # token of each row
    g = offs_m % G_PAD  # query head within the group
    row_ok = (t < T) & (g < G)
    mask_d = offs_d < D
    # The sinks are weights: safe to load before gdc_wait. Padding rows get 0 (finite).
    sink = tl.load(sinks_ptr + hk * G + g, mask=g < G, other=0.0).to(tl.float32)
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        # q, k, v and the cache are written by earlier kernels.
        tl.extra.cuda.gdc_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p0 = tl.load(positions_ptr + b * T).to(tl.int64)  # positions [B, T]: p0, p0+1, ...
    qpos = p0 + t  # [BLOCK_M]
    # q [B, T, HQ, D] row (b, t, hk*G + g).
    q_rows = (b * T + t).to(tl.int64) * (HKV * G) + hk * G + g
    q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :],
                mask=row_ok[:, None] & mask_d[None, :], other=0.0)
    if not BF16_DOT:
        q = q.to(tl.float32)  # interpreter: no bf16 arithmetic

    m_i = sink
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)  # exp(sink - m) with m = sink
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    t_last = tl.minimum(t0 + BLOCK_T, T) - 1
    q_first = p0 + t0
    q_last = p0 + t_last
    # 1. Cached keys (positions < p0) that some query of the tile can see.
    if WINDOW > 0:
        lo = tl.maximum(q_first - WINDOW + 1, 0)
    else:
        lo = q_first * 0
    kv_row_stride = HKV * D
    cache_base = slot * S * kv_row_stride + hk * D
    for j0 in range(lo, p0, BLOCK_N):
        kpos = j0 + offs_n
        key_ok = kpos < p0
        if WINDOW > 0:
            row = kpos % WINDOW  # kpos >= 0 here
        else:
            row = kpos
        off = cache_base + row.to(tl.int64)[:, None] * kv_row_stride + offs_d[None, :]
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_cache_ptr + off, v_cache_ptr + off,
                                      kpos, key_ok, qpos, row_ok, offs_d, scale,
                                      WINDOW, D, BF16_DOT, PV_SPLITS)
    # 2. The chunk's own keys, up to the tile's last token (causal).
    if WINDOW > 0:
        lo2 = tl.maximum(q_first - WINDOW + 1, p0)
    else:
        lo2 = p0
    new_base = b.to(tl.int64) * T * kv_row_stride + hk * D
    for j0 in range(lo2, q_last + 1, BLOCK_N):
        kpos = j0 + offs_n
        key_ok = kpos <= q_last
        off = new_base + (kpos - p0).to(tl.int64)[:, None] * kv_row_stride + offs_d[None, :]
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_ptr + off, v_ptr + off,
                                      kpos, key_ok, qpos, row_ok, offs_d, scale,
                                      WINDOW, D, BF16_DOT, PV_SPLITS)

    o = acc / l_i[:, None]  # l_i >= exp(sink - m) > 0
    if not BF16_DOT:
        # Interpreter: its fp32 -> bf16 cast truncates (measured: triton 3.9), the GPU
        # rounds to nearest even. Round here (o is finite), so the cast below is exact.
        bits = o.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        o = bits.to(tl.float32, bitcast=True)
    # out [B, T, HQ * D]: the same layout as q.
    tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :], o.to(tl.bfloat16),
             mask=row_ok[:, None] & mask_d[None, :])
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, positions_ptr, T, S, FIRST,
    ROW: tl.constexpr, WINDOW: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (b, i): token FIRST + i of sequence b -> cache row p (full) or p % WINDOW.
    # Tensors are int16 views of the bf16 data: a bit-exact copy.
    b = tl.program_id(0)
    i = FIRST + tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        # The attention grid before this one reads the rows written here.
        tl.extra.cuda.gdc_wait()
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p = tl.load(positions_ptr + b * T + i).to(tl.int64)
    if WINDOW > 0:
        row = p % WINDOW
    else:
        row = p
    src = (b * T + i).to(tl.int64) * ROW + offs
    dst = (slot * S + row) * ROW + offs
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()


# Launch configuration on the GPU (no autotuning: it synchronizes, which breaks CUDA-graph
# capture). Rows per program BLOCK_T * G_PAD = GPU_BLOCK_M; see benchmarks/bench_prefill_attention.py.
GPU_BLOCK_M = 128
GPU_BLOCK_N = 64
GPU_NUM_WARPS = 8
GPU_NUM_STAGES = 2
GPU_PV_SPLITS = 2
# Interpreter (CPU tests): small tiles so T is rarely a multiple and rings wrap mid-block.
CPU_BLOCK_M = 16
CPU_BLOCK_N = 16


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {what}")


def _check_tensor(t, name: str, dtype, ndim: int) -> None:
    _check(isinstance(t, torch.Tensor), name, "expected a torch.Tensor")
    _check(t.dtype == dtype, name, f"expected dtype {dtype}, got {t.dtype}")
    _check(t.dim() == ndim, name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    _check(t.is_contiguous(), name, "expected a contiguous tensor")


def prefill_attention_kv(q, k, v, k_cache, v_cache, slots, positions, sinks, window: int,
                         use_pdl: bool = False):
    """Flash-attention prefill over the KV cache, then the cache write (contract and
    reference: `flintc.ops.attention.prefill_attention_kv`, i.e.
    `torch.ops.flintc.prefill_attention_kv`).

    q: bf16 [B, T, Hq, D] (normed, rotated); k, v: bf16 [B, T, Hkv, D]; k_cache,
    v_cache: bf16 [num_slots, S, Hkv, D] (S = W for a sliding layer's ring); slots:
    int32/int64 [B], live slots only (>= 0: prefill has no padding rows; a negative
    slot would be used as an address); positions: int64 [B, T], p0..p0+T-1 per row
    (slots and positions are not checked: that would need a host sync, and the runtime
    captures this launch into a CUDA graph), with p0 + T <= S in a full layer; sinks: fp32 [Hq];
    window: W > 0 (sliding layer, S must equal W) or 0 (full layer). All contiguous,
    on one device. Returns o, bf16 [B, T, Hq*D]; writes k, v into the caches in place
    (rows p, or ring slots p % W of the last min(T, W) tokens).

    Launches 2 kernels (attention, then the write). FLOPs: 4 * Hq * D per visible
    (query, key) pair. Bytes read: q, k, v once; each visible cached K/V block once per
    query tile (L2 serves the repeats). `use_pdl` launches both with programmatic
    dependent launch (CUDA only). Raises ValueError naming a bad argument.
    """
    _check_tensor(q, "q", torch.bfloat16, 4)
    _check_tensor(k, "k", torch.bfloat16, 4)
    _check_tensor(v, "v", torch.bfloat16, 4)
    _check_tensor(k_cache, "k_cache", torch.bfloat16, 4)
    _check_tensor(v_cache, "v_cache", torch.bfloat16, 4)
    _check(isinstance(slots, torch.Tensor) and slots.dtype in (torch.int32, torch.int64)
           and slots.dim() == 1 and slots.is_contiguous(), "slots",
           "expected a contiguous int32/int64 tensor [B]")
    _check_tensor(positions, "positions", torch.int64, 2)
    _check_tensor(sinks, "sinks", torch.float32, 1)
    B, T, Hq, D = q.shape
    num_slots, S, Hkv, Dk = k_cache.shape
    _check(Dk == D, "k_cache", f"head dim {Dk} != q's {D}")
    _check(Hkv > 0 and Hq % Hkv == 0, "k_cache", f"Hkv={Hkv} must divide Hq={Hq}")
    _check(tuple(k.shape) == (B, T, Hkv, D), "k", f"expected {(B, T, Hkv, D)}, got {tuple(k.shape)}")
    _check(tuple(v.shape) == (B, T, Hkv, D), "v", f"expected {(B, T, Hkv, D)}, got {tuple(v.shape)}")
    _check(v_cache.shape == k_cache.shape, "v_cache",
           f"shape {tuple(v_cache.shape)} != k_cache's {tuple(k_cache.shape)}")
    _check(slots.shape[0] == B, "slots", f"expected [{B}], got {tuple(slots.shape)}")
    _check(tuple(positions.shape) == (B, T), "positions",
           f"expected [{B}, {T}], got {tuple(positions.shape)}")
    _check(tuple(sinks.shape) == (Hq,), "sinks", f"expected ({Hq},), got {tuple(sinks.shape)}")
    _check(isinstance(window, int) and window >= 0, "window", f"expected an int >= 0, got {window}")
    _check(window == 0 or S == window, "k_cache",
           f"a sliding layer's ring has W = {window} rows, got {S}")
    _check(window > 0 or T <= S, "positions", f"a chunk of {T} tokens does not fit {S} cache rows")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slots", slots), ("positions", positions), ("sinks", sinks)):
        _check(t.device == q.device, name, f"on {t.device}, q on {q.device}")
    out = torch.empty(B, T, Hq * D, dtype=torch.bfloat16, device=q.device)
    if B == 0 or T == 0:
        return out
    G = Hq // Hkv
    G_PAD = triton.next_power_of_2(G)
    on_gpu = q.is_cuda and not interpreting()
    pdl = bool(use_pdl) and on_gpu
    extra = {"launch_pdl": True} if pdl else {}
    block_m = GPU_BLOCK_M if on_gpu else CPU_BLOCK_M
    block_t = max(1, block_m // G_PAD)
    block_m = block_t * G_PAD  # >= 16 (tl.dot) since both configs are >= 16
    gpu_opts = {"num_stages": GPU_NUM_STAGES} if on_gpu else {}
    grid = (triton.cdiv(T, block_t), B * Hkv)
    prefill_attention_kernel[grid](
        q, k, v, k_cache, v_cache, slots, positions, sinks, out,
        T, S, D ** -0.5,
        HKV=Hkv, G=G, G_PAD=G_PAD, D=D, WINDOW=window,
        BLOCK_T=block_t, BLOCK_N=GPU_BLOCK_N if on_gpu else CPU_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m,
        PV_SPLITS=GPU_PV_SPLITS, BF16_DOT=on_gpu, USE_PDL=pdl_mode(pdl),
        num_warps=GPU_NUM_WARPS if on_gpu else 4, **gpu_opts, **extra,
    )
    n = min(T, window) if window else T  # a ring keeps only the last W tokens
    row = Hkv * D
    i16 = torch.int16
    kv_write_kernel[(B, n)](
        k.view(i16), v.view(i16), k_cache.view(i16), v_cache.view(i16), slots, positions,
        T, S, T - n, ROW=row, WINDOW=window, BLOCK=triton.next_power_of_2(row), USE_PDL=pdl_mode(pdl),
        num_warps=4, **extra,
    )
    return out


def prefill_attention_kv_reference(q, k, v, k_cache, v_cache, slots, positions, sinks, window):
    """The plain-torch reference: `flintc.ops.attention.prefill_attention_kv`."""
    from flintc.ops import attention  # imported on call: nothing registers at import

    return attention.prefill_attention_kv(q, k, v, k_cache, v_cache, slots, positions, sinks, window)


KERNELS = {"prefill_attention_kv": prefill_attention_kv}
