"""Attention-side fused ops: Q/K norm + RoPE + KV-cache write, split-KV decode
attention with its combine, and prefill attention with sinks."""

from __future__ import annotations

import math

import torch

from flintc.model import ops
from flintc.ops.common import CDT


def write_kv(k_cache, v_cache, k, v, slots, positions, window: int) -> None:
    """Write k, v [B, T, Hkv, D] for `positions` [B, T] into cache rows `slots` [B]:
    by position (window 0, full layers) or into a ring of `window` slots, position p
    in slot p % W (only the last min(T, W) tokens survive)."""
    if window == 0:
        k_cache[slots[:, None], positions] = k
        v_cache[slots[:, None], positions] = v
        return
    T = k.shape[1]
    n = min(T, window)
    ring = positions[:, T - n:] % window
    k_cache[slots[:, None], ring] = k[:, T - n:]
    v_cache[slots[:, None], ring] = v[:, T - n:]


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
    write_kv(k_cache, v_cache, k, v, slots, positions, window)
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


@torch.library.custom_op("flintc::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, window: int, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV (flash-decoding) attention of one new token per sequence over its cache.

    q: bf16 [B, 1, Hq, D] (normed, rotated); caches: bf16 [slots, S, Hkv, D] already
    holding the new token; positions: int64 [B, 1]; window: W for a ring cache, 0 for
    a full one (keys 0..p). The S rows are cut into `num_splits` equal chunks; each
    gives an fp32 partial output normalised within the chunk and its log-sum-exp
    (-inf and o = 0 for a chunk with no visible key). Returns (o_part fp32
    [B, Hq, num_splits, D], lse fp32 [B, Hq, num_splits]); `attention_combine` adds
    the sink and merges them.
    """
    B, _, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    keys = k_cache[slots].to(CDT)  # [B, S, Hkv, D]
    values = v_cache[slots].to(CDT)
    kpos = key_positions(positions, S, window)  # [B, S]
    p = positions[:, -1:]
    visible = (kpos >= 0) & (kpos <= p)  # [B, S]
    if window:
        visible &= (p - kpos) < window
    qh = q[:, 0].to(CDT).view(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bshd->bhgs", qh, keys) * (D ** -0.5)  # [B, Hkv, G, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf")).reshape(B, Hq, S)
    chunk = math.ceil(S / num_splits)
    pad = chunk * num_splits - S
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")).view(B, Hq, num_splits, chunk)
    vals = torch.nn.functional.pad(values, (0, 0, 0, 0, 0, pad)).view(B, num_splits, chunk, Hkv, D)
    m = scores.amax(dim=-1, keepdim=True)  # [B, Hq, N, 1]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m_safe)  # [B, Hq, N, C]; masked keys give 0
    l = e.sum(dim=-1)  # [B, Hq, N]
    vh = vals.permute(0, 3, 1, 2, 4).repeat_interleave(Hq // Hkv, dim=1)  # [B, Hq, N, C, D]
    o = torch.einsum("bhnc,bhncd->bhnd", e, vh) / torch.where(l > 0, l, torch.ones_like(l))[..., None]
    lse = torch.where(l > 0, m_safe[..., 0] + torch.log(l), torch.full_like(l, float("-inf")))
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


@torch.library.custom_op("flintc::prefill_attention", mutates_args=())
def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                      sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks for T new tokens per sequence over given keys (causal and
    window mask in `visible`). Shapes as `flintc.model.ops.attention_with_sink`."""
    return ops.attention_with_sink(q, keys, values, visible, sinks, CDT)


@prefill_attention.register_fake
def _(q, keys, values, visible, sinks):
    B, T, Hq, D = q.shape
    return q.new_empty(B, T, Hq * D)
