"""Attention-side fused ops: Q/K norm + RoPE (+ KV-cache write at decode), split-KV
decode attention with its combine, and prefill attention with sinks that reads and
writes the KV cache itself (`prefill_attention_kv`, bounded memory at any context)."""

from __future__ import annotations

import math

import torch

from flintc.model import ops
from flintc.ops.common import CDT


def pad_slot(free_slot: int) -> int:
    """The slot id of a padding row of a decode bucket: `-1 - free_slot`, where
    `free_slot` is a cache slot that no live row of the same call uses (vLLM's convention
    of a negative slot for padded tokens, `PAD_SLOT_ID`). Kernels skip the KV-cache write
    of such a row and read no cache row for it (its attention output is 0); the torch ops
    here read slot `free_slot` instead and write back what they read, a no-op that keeps
    them sync-free (CUDA-graph capturable). Padding rows so need no scratch slot (which
    held a whole sequence of full-attention KV: 7 GiB at 262K tokens).

    Raises:
        ValueError: free_slot < 0.
    """
    if free_slot < 0:
        raise ValueError(f"pad_slot: free_slot must be a cache slot (>= 0), got {free_slot}")
    return -1 - int(free_slot)


def cache_slots(slots: torch.Tensor) -> torch.Tensor:
    """The cache slot each row addresses: `slots` itself for live rows, `-1 - s` (the
    free slot of `pad_slot`) for padding rows. int64 [B] -> int64 [B]."""
    return torch.where(slots < 0, -1 - slots, slots)


def write_kv(k_cache, v_cache, k, v, slots, positions, window: int) -> None:
    """Write k, v [B, T, Hkv, D] for `positions` [B, T] into cache rows `slots` [B]:
    by position (window 0, full layers) or into a ring of `window` slots, position p
    in slot p % W (only the last min(T, W) tokens survive). Every slot must be a live
    one (>= 0). This is the reference model's write, the search pattern of
    `flintc.passes.fuse_qk_norm_rope_kv`; the fused ops write with `write_kv_padded`."""
    if window == 0:
        k_cache[slots[:, None], positions] = k
        v_cache[slots[:, None], positions] = v
        return
    T = k.shape[1]
    n = min(T, window)
    ring = positions[:, T - n:] % window
    k_cache[slots[:, None], ring] = k[:, T - n:]
    v_cache[slots[:, None], ring] = v[:, T - n:]


def write_kv_padded(k_cache, v_cache, k, v, slots, positions, window: int) -> None:
    """`write_kv` where rows with a negative slot (padding, `pad_slot`) write nothing:
    their free slot's cells are read and written back unchanged (no host sync, no
    data-dependent shapes, so CUDA graphs can capture it). Same arguments."""
    live = (slots >= 0).view(-1, 1, 1, 1)
    s = cache_slots(slots)[:, None]
    if window == 0:
        rows = positions
    else:
        T = k.shape[1]
        n = min(T, window)
        rows = positions[:, T - n:] % window
        k, v = k[:, T - n:], v[:, T - n:]
    k_cache[s, rows] = torch.where(live, k, k_cache[s, rows])
    v_cache[s, rows] = torch.where(live, v, v_cache[s, rows])


@torch.library.custom_op("flintc::qk_norm_rope_kv_write", mutates_args=("k_cache", "v_cache"))
def qk_norm_rope_kv_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor, positions: torch.Tensor, eps: float, rope: bool, window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, RoPE (when `rope`), and the KV-cache write.

    q: bf16 [B, T, Hq, D]; k, v: bf16 [B, T, Hkv, D]; q_norm, k_norm: fp32 [D];
    cos, sin: fp32 [B, T, D/2] (table rows at each position); caches: bf16
    [slots, S, Hkv, D], written in place (see `write_kv`). Returns the normed (and
    rotated) q and k, bf16, each rounded once per operation as in the reference.
    """
    q = ops.rms_norm(q, q_norm, eps, CDT)
    k = ops.rms_norm(k, k_norm, eps, CDT)
    if rope:
        q = ops.apply_rope(q, cos, sin, CDT)
        k = ops.apply_rope(k, cos, sin, CDT)
    write_kv_padded(k_cache, v_cache, k, v, slots, positions, window)
    return q, k


@qk_norm_rope_kv_write.register_fake
def _(q, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, positions, eps, rope, window):
    return torch.empty_like(q), torch.empty_like(k)


def key_positions(positions: torch.Tensor, num_rows: int, window: int) -> torch.Tensor:
    """The position held by each cache row after the write of `positions` [B, 1]:
    row j itself (full layers), or in a ring of W rows p - ((p - j) mod W), negative
    when never written. -> int64 [B, S]."""
    rows = torch.arange(num_rows, device=positions.device)[None, :]  # [1, S]
    if window == 0:
        return rows.expand(positions.shape[0], -1)
    p = positions[:, -1:]  # [B, 1]
    return p - torch.remainder(p - rows, window)


# The target chunk length of `decode_attention`'s split layout, in cache rows: a context of
# R rows is cut into ceil(R / SPLIT_ROWS) chunks while that is at most N (`split_layout`),
# so a short context gets fewer chunks, not thinner ones. 64 = the GPU kernel's BLOCK_S:
# such a chunk is one block, read by one program.
SPLIT_ROWS = 64


def visible_rows(position: int, slot: int, num_rows: int, window: int) -> int:
    """R, the rows of a cache of `num_rows` rows that can hold a visible key for the token
    at `position` (rows 0..R-1): 0 for a padding row (slot < 0), else min(position + 1,
    num_rows) for a full cache or a ring of at most `window` rows (rows fill in order until
    the ring wraps), and every row of a ring longer than the window (masked row by row)."""
    if slot < 0:
        return 0
    if window == 0 or num_rows <= window:
        return max(0, min(position + 1, num_rows))
    return num_rows


def split_layout(rows: int, num_splits: int, split_rows: int | None = None) -> tuple[int, int]:
    """(C, n): the chunk length in rows and the chunks used when `decode_attention` cuts
    R = `rows` visible rows into at most `num_splits` (N) chunks: n' = min(N, ceil(R /
    split_rows)) chunks wanted, C = ceil(R / n') rows each (the last may be shorter), n =
    ceil(R / C) <= n' of them hold rows; chunks n..N-1 are empty. So C <= split_rows while
    R <= N x split_rows, and C = ceil(R / N) past that. `split_rows` defaults to SPLIT_ROWS
    (read at call time). R = 0 gives (1, 0).

    The layout follows the visible rows, not the cache length, as FlashDecoding's and
    vLLM's paged attention v2 partitions follow the sequence (ceil(len / 512) partitions):
    1,024 tokens in a 262,144-row cache are 16 chunks of 64 rows, not one chunk of 8,192
    rows that every program shares.

    Raises:
        ValueError: rows < 0, num_splits < 1 or split_rows < 1.
    """
    split_rows = SPLIT_ROWS if split_rows is None else split_rows
    if rows < 0 or num_splits < 1 or split_rows < 1:
        raise ValueError(f"split_layout: expected rows >= 0, num_splits >= 1, split_rows >= 1; "
                         f"got {rows}, {num_splits}, {split_rows}")
    if rows == 0:
        return 1, 0
    wanted = min(num_splits, math.ceil(rows / split_rows))
    chunk = math.ceil(rows / wanted)
    return chunk, math.ceil(rows / chunk)


@torch.library.custom_op("flintc::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, window: int, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV (flash-decoding) attention of one new token per sequence over its cache.

    q: bf16 [B, 1, Hq, D] (normed, rotated); caches: bf16 [slots, S, Hkv, D] already
    holding the new token; positions: int64 [B, 1]; window: W for a ring cache, 0 for
    a full one (keys 0..p). Each sequence's R visible rows (`visible_rows`) are cut into
    at most `num_splits` chunks of C rows (`split_layout`: ceil(R / SPLIT_ROWS) chunks
    while that is at most num_splits, so fewer for a short context); each chunk gives an fp32
    partial output normalised within the chunk and its log-sum-exp (-inf and o = 0 for a
    chunk with no visible key, and for the unused chunks). A padding row (negative slot,
    `pad_slot`) sees no key: all its chunks are empty. Returns (o_part fp32
    [B, Hq, num_splits, D], lse fp32 [B, Hq, num_splits]); `attention_combine` adds
    the sink and merges them.
    """
    B, _, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    p = positions[:, -1:]
    # Each sequence's visible rows R (`visible_rows`) and layout (`split_layout`) on the
    # device: no host sync on CUDA, so the op stays capturable in a CUDA graph.
    R = torch.where(slots >= 0, torch.clamp(p[:, 0] + 1, 0, S) if window == 0 or S <= window
                    else torch.full_like(p[:, 0], S), torch.zeros_like(p[:, 0]))  # [B]
    if not q.is_cuda:  # rows past every sequence's R hold no visible key: leave them out
        S = max(1, int(R.max()))
    keys = k_cache[cache_slots(slots), :S].to(CDT)  # [B, S, Hkv, D]
    values = v_cache[cache_slots(slots), :S].to(CDT)
    kpos = key_positions(positions, S, window)  # [B, S]
    visible = (kpos >= 0) & (kpos <= p) & (slots >= 0)[:, None]  # [B, S]; padding: none
    if window:
        visible &= (p - kpos) < window
    qh = q[:, 0].to(CDT).view(B, Hkv, G, D)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bshd->bhgs", qh, keys) * (D ** -0.5)  # [B, Hkv, G, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf")).reshape(B, Hq, S)
    wanted = torch.clamp((R + SPLIT_ROWS - 1) // SPLIT_ROWS, 1, num_splits)
    chunk = torch.clamp((R + wanted - 1) // wanted, min=1)  # [B]
    rows = torch.arange(S, device=q.device)
    idx = torch.clamp(rows[None, :] // chunk[:, None], max=num_splits - 1)  # [B, S] chunk of each row
    idx_h = idx[:, None, :].expand(B, Hq, S)
    m = torch.full((B, Hq, num_splits), float("-inf"), dtype=CDT, device=q.device)
    m = m.scatter_reduce(2, idx_h, scores, "amax")  # [B, Hq, N]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m_safe.gather(2, idx_h))  # [B, Hq, S]; masked keys give 0
    l = torch.zeros_like(m).scatter_add(2, idx_h, e)  # [B, Hq, N]
    onehot = (idx[:, None, :] == torch.arange(num_splits, device=q.device)[None, :, None]).to(CDT)
    e_n = e.view(B, Hkv, G, 1, S) * onehot.view(B, 1, 1, num_splits, S)  # [B, Hkv, G, N, S]
    o = e_n @ values.permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, G, N, D]
    o = o.reshape(B, Hq, num_splits, D) / torch.where(l > 0, l, torch.ones_like(l))[..., None]
    lse = torch.where(l > 0, m_safe + torch.log(l), torch.full_like(l, float("-inf")))
    return o, lse


@decode_attention.register_fake
def _(q, k_cache, v_cache, slots, positions, window, num_splits):
    B, _, Hq, D = q.shape
    return (q.new_empty(B, Hq, num_splits, D, dtype=torch.float32),
            q.new_empty(B, Hq, num_splits, dtype=torch.float32))


@torch.library.custom_op("flintc::attention_combine", mutates_args=())
def attention_combine(o_part: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Merge split-KV partials with the learned sink (FLINT_SPEC 2, step 6):
    `o = sum_n exp(lse_n - m) o_n / (exp(sink - m) + sum_n exp(lse_n - m))`, with
    m = max(sink, max_n lse_n); an empty split (lse -inf) adds nothing, the sink is
    counted once. o_part: fp32 [B, Hq, N, D]; lse: fp32 [B, Hq, N]; sinks: fp32 [Hq].
    -> bf16 [B, 1, Hq*D], rounded once."""
    B, Hq, N, D = o_part.shape
    sink = sinks.to(CDT)[None, :].expand(B, Hq)  # [B, Hq]
    m = torch.maximum(lse.amax(dim=-1), sink)  # [B, Hq]; finite because the sink is
    w = torch.exp(lse - m[..., None])  # [B, Hq, N]
    denom = torch.exp(sink - m) + w.sum(dim=-1)  # [B, Hq]
    o = (w[..., None] * o_part).sum(dim=2) / denom[..., None]  # [B, Hq, D]
    return o.reshape(B, 1, Hq * D).to(torch.bfloat16)


@attention_combine.register_fake
def _(o_part, lse, sinks):
    B, Hq, N, D = o_part.shape
    return o_part.new_empty(B, 1, Hq * D, dtype=torch.bfloat16)


@torch.library.custom_op("flintc::qk_norm_rope", mutates_args=())
def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, rope: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k and RoPE (when `rope`): `qk_norm_rope_kv_write`
    without the cache write, for prefill, where `prefill_attention_kv` writes the
    cache after reading the old ring.

    q: bf16 [B, T, Hq, D]; k: bf16 [B, T, Hkv, D]; q_norm, k_norm: fp32 [D]; cos, sin:
    fp32 [B, T, D/2] (ignored when not `rope`). Returns the normed (and rotated) q and
    k, bf16, rounded once per operation as in the reference (FLINT_SPEC 2, steps 2-3).
    """
    q = ops.rms_norm(q, q_norm, eps, CDT)
    k = ops.rms_norm(k, k_norm, eps, CDT)
    if rope:
        q = ops.apply_rope(q, cos, sin, CDT)
        k = ops.apply_rope(k, cos, sin, CDT)
    return q, k


@qk_norm_rope.register_fake
def _(q, k, q_norm, k_norm, cos, sin, eps, rope):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("flintc::prefill_attention", mutates_args=())
def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                      sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks for T new tokens per sequence over given keys (causal and
    window mask in `visible`). Shapes as `flintc.model.ops.attention_with_sink`.

    Superseded in the prefill pipeline by `prefill_attention_kv` (this one needs the
    gathered keys and a materialised [B, T, S] mask); kept as a plain wrapper of the
    reference function."""
    return ops.attention_with_sink(q, keys, values, visible, sinks, CDT)


@prefill_attention.register_fake
def _(q, keys, values, visible, sinks):
    B, T, Hq, D = q.shape
    return q.new_empty(B, T, Hq * D)


PREFILL_KEY_BLOCK = 256  # keys per step of `prefill_attention_kv`'s online softmax


def prefill_key_range(p0: int, T: int, window: int) -> tuple[int, int]:
    """Positions [lo, p0) of the cached keys that some query of a chunk at positions
    p0..p0+T-1 may see: all of 0..p0-1 in a full layer (window 0); in a sliding layer
    the last W-1 before p0 (the first query, p0, sees back to p0-W+1)."""
    lo = 0 if window == 0 else max(0, p0 - window + 1)
    return lo, p0


@torch.library.custom_op("flintc::prefill_attention_kv", mutates_args=("k_cache", "v_cache"))
def prefill_attention_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor, window: int,
) -> torch.Tensor:
    """Prefill attention of T new tokens per sequence over the cached keys and the new
    ones, with the sliding window and the learned sink; then the KV-cache write.

    q: bf16 [B, T, Hq, D] (normed, rotated); k, v: bf16 [B, T, Hkv, D] (k normed and
    rotated), the chunk's new keys and values; k_cache, v_cache: bf16 [slots, S, Hkv, D]
    holding positions < p0 of each sequence, where p0 = positions[b, 0]: a full layer
    (window 0) keeps position j in row j; a sliding layer keeps a ring of S = W rows,
    row j holding position p0-1-((p0-1-j) mod W) when that is >= 0 (FlintModel's ring).
    slots: int [B]; positions: int64 [B, T], p0, p0+1, ..., p0+T-1 per row (a prefill
    chunk; not checked); sinks: fp32 [Hq]; window: W (sliding layer) or 0 (full).

    Query i (position p_i) sees key position j when j <= p_i and, if W > 0,
    p_i - j < W (FLINT_SPEC 2, step 5); scores (q . k) * D**-0.5, softmax with the
    sink (step 6), o = sum p v (step 7), all in fp32, rounded to bf16 once.
    Returns o bf16 [B, T, Hq*D]. Afterwards k, v are in the cache (`write_kv`:
    rows p0..p0+T-1, or the ring slots p % W of the last min(T, W) tokens).

    Memory: bounded independently of S. Key blocks of `PREFILL_KEY_BLOCK` positions
    are read one at a time, only the ones some query can see (`prefill_key_range`,
    then the new keys), with an online (flash-attention) softmax that starts from
    the sink (m = sink, l = 1); the largest temporary is fp32 [Hq, T, block].
    Takes p0 to the host (`.tolist()`): a reference, not for CUDA-graph capture.
    The reduction order differs from `attention_with_sink`, so results agree with it
    to fp32 rounding (one bf16 ulp at the output where a value sits on a boundary).
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5
    out = torch.empty(B, T, Hq * D, dtype=torch.bfloat16, device=q.device)
    sink = sinks.to(CDT).view(Hkv, G, 1)  # [Hkv, G, 1]
    starts = positions[:, 0].tolist()
    rows = slots.tolist()
    for b in range(B):
        p0, slot = int(starts[b]), int(rows[b])
        qpos = positions[b].to(torch.int64)  # [T]
        qh = q[b].to(CDT).permute(1, 0, 2).reshape(Hkv, G * T, D)  # [Hkv, G*T, D], row g*T + t
        m = sink.expand(Hkv, G, T).reshape(Hkv, G * T).clone()  # running max, from the sink
        l = torch.ones_like(m)  # running sum: exp(sink - m) with m = sink
        acc = torch.zeros(Hkv, G * T, D, dtype=CDT, device=q.device)

        def step(kb, vb, kpos):  # kb, vb: bf16 [n, Hkv, D]; kpos: int64 [n]
            nonlocal m, l, acc
            s = torch.einsum("hrd,nhd->hrn", qh, kb.to(CDT)) * scale  # [Hkv, G*T, n]
            vis = kpos[None, :] <= qpos[:, None]  # [T, n]
            if window:
                vis &= (qpos[:, None] - kpos[None, :]) < window
            s = s.masked_fill(~vis.repeat(G, 1)[None], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))  # finite: m starts at the sink
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])  # [Hkv, G*T, n]
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.einsum("hrn,nhd->hrd", p, vb.to(CDT))
            m = m_new

        lo, hi = prefill_key_range(p0, T, window)
        for j0 in range(lo, hi, PREFILL_KEY_BLOCK):  # cached keys, positions < p0
            kpos = torch.arange(j0, min(j0 + PREFILL_KEY_BLOCK, hi), device=q.device)
            r = kpos % window if window else kpos
            step(k_cache[slot, r], v_cache[slot, r], kpos)
        for t0 in range(0, T, PREFILL_KEY_BLOCK):  # the new keys, causal
            t1 = min(t0 + PREFILL_KEY_BLOCK, T)
            step(k[b, t0:t1], v[b, t0:t1], qpos[t0:t1])
        o = acc / l[..., None]  # [Hkv, G*T, D]
        out[b] = o.view(Hkv, G, T, D).permute(2, 0, 1, 3).reshape(T, Hq * D).to(torch.bfloat16)
    write_kv(k_cache, v_cache, k, v, slots, positions, window)
    return out


@prefill_attention_kv.register_fake
def _(q, k, v, k_cache, v_cache, slots, positions, sinks, window):
    B, T, Hq, D = q.shape
    return q.new_empty(B, T, Hq * D, dtype=torch.bfloat16)
