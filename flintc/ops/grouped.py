"""The low-latency decode schedule's kernels: fused ops that fold neighbours into the
GEMVs (FLINT_SPEC section 5). Each is one kernel launch and composes the reference
functions of the ops it replaces, so grouping is bit-exact.

MoE layer (7): norm_qkv_rope_kv, decode_attention, attention_combine,
gemv_residual (O projection), norm_router, moe_topk_gate_up,
moe_down_combine_residual. Dense layer (6): the first four, norm_gate_up_silu,
gemv_residual (down). Per forward: embedding and norm_lm_head. With the
`fold_attention_combine` option, decode_attention_combine replaces decode_attention and
attention_combine: 6 and 5.
"""

from __future__ import annotations

import torch

from flintc.model import ops
from flintc.ops.attention import attention_combine, decode_attention, write_kv_padded
from flintc.ops.common import CDT, as_weight, out_features
from flintc.ops.moe import moe_down_combine, moe_gate_up


@torch.library.custom_op("flintc::norm_qkv_rope_kv", mutates_args=("k_cache", "v_cache"))
def norm_qkv_rope_kv(
    x: torch.Tensor, norm: torch.Tensor, wq: list[torch.Tensor], wk: list[torch.Tensor],
    wv: list[torch.Tensor], q_norm: torch.Tensor, k_norm: torch.Tensor, cos_table: torch.Tensor,
    sin_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, eps: float, num_heads: int, num_kv_heads: int, rope: bool, window: int,
) -> torch.Tensor:
    """Kernel 1: input RMSNorm, QKV GEMV, per-head Q/K RMSNorm, RoPE (rows of the
    cos/sin tables [P, D/2] at `positions`), KV-cache write (see `write_kv_padded`: padding rows write nothing).

    x: bf16 [B, T, H]; -> q bf16 [B, T, Hq, D]; caches written in place.
    """
    B, T, H = x.shape
    h = ops.rms_norm(x, norm, eps, CDT).view(B * T, H)
    q = ops.linear(h, as_weight(wq), CDT).view(B, T, num_heads, -1)
    k = ops.linear(h, as_weight(wk), CDT).view(B, T, num_kv_heads, -1)
    v = ops.linear(h, as_weight(wv), CDT).view(B, T, num_kv_heads, -1)
    q = ops.rms_norm(q, q_norm, eps, CDT)
    k = ops.rms_norm(k, k_norm, eps, CDT)
    if rope:
        cos, sin = cos_table[positions], sin_table[positions]  # [B, T, D/2]
        q = ops.apply_rope(q, cos, sin, CDT)
        k = ops.apply_rope(k, cos, sin, CDT)
    write_kv_padded(k_cache, v_cache, k, v, slots, positions, window)
    return q


@norm_qkv_rope_kv.register_fake
def _(x, norm, wq, wk, wv, q_norm, k_norm, cos_table, sin_table, k_cache, v_cache, slots, positions,
      eps, num_heads, num_kv_heads, rope, window):
    B, T, _ = x.shape
    return x.new_empty(B, T, num_heads, out_features(wq) // num_heads)


@torch.library.custom_op("flintc::decode_attention_combine", mutates_args=())
def decode_attention_combine(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, sinks: torch.Tensor, window: int, num_splits: int,
) -> torch.Tensor:
    """Kernel 2 with the combine folded in: split-KV decode attention and the merge of
    its splits with the learned sinks, `attention_combine(*decode_attention(...), sinks)`
    (FLINT_SPEC 2, attention steps 5-7). The partials are internal.

    q: bf16 [B, 1, Hq, D]; caches: bf16 [slots, S, Hkv, D] holding the new token; slots:
    [B] (negative: a padding row, output 0); positions: int64 [B, 1]; sinks: fp32 [Hq];
    window: W or 0; num_splits: N. -> bf16 [B, 1, Hq * D].
    """
    o_part, lse = decode_attention(q, k_cache, v_cache, slots, positions, window, num_splits)
    return attention_combine(o_part, lse, sinks)


@decode_attention_combine.register_fake
def _(q, k_cache, v_cache, slots, positions, sinks, window, num_splits):
    B, _, Hq, D = q.shape
    return q.new_empty(B, 1, Hq * D, dtype=torch.bfloat16)


@torch.library.custom_op("flintc::gemv_residual", mutates_args=())
def gemv_residual(x: torch.Tensor, w: list[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
    """`bf16(residual + bf16(x @ W^T))`: a GEMV with the residual add in its epilogue.
    x: bf16 [..., K]; residual: bf16 [..., F]. -> bf16 [..., F]."""
    y = ops.linear(x.reshape(-1, x.shape[-1]), as_weight(w), CDT).view(residual.shape)
    return ops.residual_add(residual, y, CDT)


@gemv_residual.register_fake
def _(x, w, residual):
    return torch.empty_like(residual)


@torch.library.custom_op("flintc::norm_router", mutates_args=())
def norm_router(x: torch.Tensor, norm: torch.Tensor, router: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel 5 (MoE): post-attention RMSNorm and the router GEMV. x: bf16 [..., H].
    -> (normed x bf16 [N, H], router logits fp32 [N, E])."""
    h = ops.rms_norm(x, norm, eps, CDT).reshape(-1, x.shape[-1])
    return h, h.to(CDT) @ router.to(CDT).T


@norm_router.register_fake
def _(x, norm, router, eps):
    n = x.numel() // x.shape[-1]
    return x.new_empty(n, x.shape[-1]), x.new_empty(n, router.shape[0], dtype=torch.float32)


@torch.library.custom_op(
    "flintc::moe_topk_gate_up", mutates_args=(),
    # written out: infer_schema does not take an optional tensor list (Tensor[]?)
    schema="(Tensor x, Tensor logits, Tensor bias, Tensor[] gate, Tensor[] up, "
           "Tensor[] shared_gate, Tensor[] shared_up, SymInt top_k, float scaling, "
           "Tensor[]? down_prefetch=None) -> (Tensor, Tensor, Tensor)")
def moe_topk_gate_up(
    x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, gate: list[torch.Tensor],
    up: list[torch.Tensor], shared_gate: list[torch.Tensor], shared_up: list[torch.Tensor],
    top_k: int, scaling: float, down_prefetch: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel 6 (MoE): top-k routing in the prologue, then the selected and shared
    experts' gate/up GEMVs with SiLU-and-mul. -> (h bf16 [N, K+1, F], weights fp32
    [N, K], ids int64 [N, K]). `down_prefetch`: the routed experts' down weights that
    kernel 7 reads (set by the LowLatencyGroupingPass), a hint for the kernel to prefetch
    the selected experts' rows into L2; it does not change the values."""
    weights, ids = ops.select_topk(logits, bias, top_k, scaling)
    return moe_gate_up(x, ids, gate, up, shared_gate, shared_up), weights, ids


@moe_topk_gate_up.register_fake
def _(x, logits, bias, gate, up, shared_gate, shared_up, top_k, scaling, down_prefetch=None):
    n = top_k + (1 if shared_gate else 0)
    N = x.shape[0]
    return (x.new_empty(N, n, out_features(gate)), x.new_empty(N, top_k, dtype=torch.float32),
            x.new_empty(N, top_k, dtype=torch.int64))


@torch.library.custom_op("flintc::moe_down_combine_residual", mutates_args=())
def moe_down_combine_residual(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                              down: list[torch.Tensor], shared_down: list[torch.Tensor],
                              residual: torch.Tensor) -> torch.Tensor:
    """Kernel 7 (MoE): down GEMVs, weighted combine, residual add. residual: bf16
    [..., H]. -> bf16 [..., H]."""
    m = moe_down_combine(h, ids, weights, down, shared_down).view(residual.shape)
    return ops.residual_add(residual, m, CDT)


@moe_down_combine_residual.register_fake
def _(h, ids, weights, down, shared_down, residual):
    return torch.empty_like(residual)


@torch.library.custom_op("flintc::norm_gate_up_silu", mutates_args=())
def norm_gate_up_silu(x: torch.Tensor, norm: torch.Tensor, gate: list[torch.Tensor],
                      up: list[torch.Tensor], eps: float) -> torch.Tensor:
    """Kernel 5 (dense): post-attention RMSNorm, gate/up GEMV, SiLU-and-mul.
    x: bf16 [..., H]. -> bf16 [N, I]."""
    h = ops.rms_norm(x, norm, eps, CDT).reshape(-1, x.shape[-1])
    g = ops.linear(h, as_weight(gate), CDT)
    u = ops.linear(h, as_weight(up), CDT)
    return ops.silu_mul(g, u, CDT)


@norm_gate_up_silu.register_fake
def _(x, norm, gate, up, eps):
    return x.new_empty(x.numel() // x.shape[-1], out_features(gate))


@torch.library.custom_op("flintc::norm_lm_head", mutates_args=())
def norm_lm_head(x: torch.Tensor, norm: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Final RMSNorm and the LM head GEMV, logits kept in fp32. x: bf16 [B, T, H].
    -> fp32 [B, T, V]."""
    h = ops.rms_norm(x, norm, eps, CDT)
    return ops.lm_head(h.reshape(-1, x.shape[-1]), w, CDT).view(*x.shape[:-1], w.shape[0])


@norm_lm_head.register_fake
def _(x, norm, w, eps):
    return x.new_empty(*x.shape[:-1], w.shape[0], dtype=torch.float32)
