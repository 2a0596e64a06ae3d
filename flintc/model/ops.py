"""Reference numerics: the operations of one Flint layer, with FLINT_SPEC section 3's
rounding points.

Every function takes activations in the *activation dtype* `adt` and computes in
the *compute dtype* `cdt`, rounding to `adt` exactly once at its output, where the
spec's table puts the rounding point. Two numeric modes use them:

* `bf16`: adt = bfloat16, cdt = float32 (the reference numerics);
* `float64`: adt = cdt = float64 (the oracle for error measurement: no rounding).

Shape legend: T tokens (B*T flattened where it says N), H hidden, Hq/Hkv heads,
D head dim, S keys, E experts, K top-k, F ffn width. No function branches on
tensor values, so the model built from them traces with torch.fx.
"""

from __future__ import annotations

import torch

from flintc.model.weights import Weight
from flintc.quant.nvfp4 import NVFP4Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cdt: torch.dtype) -> torch.Tensor:
    """RMSNorm over the last dim: `x * rsqrt(mean(x^2) + eps) * w` in `cdt`, one rounding.

    x: [..., H] adt; weight: [H] fp32. Returns [..., H] in x's dtype.
    """
    xc = x.to(cdt)
    y = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(cdt)
    return y.to(x.dtype)


def linear(x: torch.Tensor, weight: Weight, cdt: torch.dtype) -> torch.Tensor:
    """`x @ W^T` with `cdt` accumulation, one rounding to x's dtype.

    x: [N, K]; weight: [F, K] bf16, or NVFP4 (W4A16: accumulate x * (e2m1 * block
    scale), then multiply the accumulator by the global scale). Returns [N, F].
    """
    if isinstance(weight, NVFP4Tensor):
        w = weight.dequantize(cdt, with_global_scale=False)  # [F, K]
        y = (x.to(cdt) @ w.T) * weight.global_scale.to(cdt)
    else:
        y = x.to(cdt) @ weight.to(cdt).T  # [N, F]
    return y.to(x.dtype)


def lm_head(x: torch.Tensor, weight: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """Logits `x @ lm_head^T` with `cdt` accumulation, never rounded. x: [N, H]; -> [N, V]."""
    return x.to(cdt) @ weight.to(cdt).T


def residual_add(x: torch.Tensor, y: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """`x + y` summed in `cdt`, one rounding."""
    return (x.to(cdt) + y.to(cdt)).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """SwiGLU activation `silu(g) * u` in `cdt`, one rounding. [..., F] -> [..., F]."""
    g = gate.to(cdt)
    return (g * torch.sigmoid(g) * up.to(cdt)).to(gate.dtype)


def rope_tables(theta: float, head_dim: int, max_positions: int, cdt: torch.dtype):
    """RoPE cos/sin tables [max_positions, D/2] in `cdt`, computed as the runtime does:
    `inv_freq[d] = theta ** (-2d/D)`, `angle = position * inv_freq[d]` (FLINT_SPEC 2)."""
    d = torch.arange(head_dim // 2, dtype=cdt)
    inv_freq = theta ** (-2.0 * d / head_dim)  # [D/2]
    angle = torch.arange(max_positions, dtype=cdt)[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cos(angle), torch.sin(angle)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """NeoX rotate-half RoPE over the whole head, in `cdt` from the (normed) input, one rounding.

    x: [B, T, heads, D]; cos, sin: [B, T, D/2] (rows of the tables at each token's position).
    """
    half = x.shape[-1] // 2
    xc = x.to(cdt)
    x1, x2 = xc[..., :half], xc[..., half:]  # [B, T, heads, D/2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)  # [B, T, heads, D]
    return out.to(x.dtype)


def attention_with_sink(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor,
    cdt: torch.dtype,
) -> torch.Tensor:
    """Scaled dot-product attention with a learned sink per query head (FLINT_SPEC 2, steps 5-7).

    q: [B, T, Hq, D]; keys, values: [B, S, Hkv, D]; visible: bool [B, T, S] (which key
    each query may see); sinks: [Hq] fp32. Query head h reads KV head h // G.
    Scores `(q . k) * D**-0.5` and the softmax over [scores, sink] are in `cdt`;
    the sink takes probability mass and adds no value. Returns o [B, T, Hq*D],
    rounded once. A query that sees no key gets o = 0 (all mass on the sink).
    """
    B, T, Hq, D = q.shape
    Hkv = keys.shape[2]
    G = Hq // Hkv
    qh = q.to(cdt).view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kh = keys.to(cdt).permute(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, D, S]
    vh = values.to(cdt).permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, S, D]
    scores = (qh @ kh) * (D**-0.5)  # [B, Hkv, G, T, S]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    sink = sinks.to(cdt).view(1, Hkv, G, 1, 1).expand(B, Hkv, G, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [B, Hkv, G, T, S]
    o = probs @ vh  # [B, Hkv, G, T, D]
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq * D).to(q.dtype)


def route_topk(
    x: torch.Tensor,
    router: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    scaling: float,
    cdt: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with bias-corrected top-k selection (FLINT_SPEC 2, MoE steps 1-4).

    x: [N, H]; router: [E, H] bf16; bias: [E] fp32. Returns (weights [N, K] in `cdt`,
    never rounded; selected expert ids [N, K] int64). Ties in `scores + bias` go to
    the lower expert index (a stable descending sort). The bias selects, never weights.
    """
    logits = x.to(cdt) @ router.to(cdt).T  # [N, E]
    return select_topk(logits, bias, top_k, scaling)


def select_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float):
    """Steps 2-4 of the MoE router from fp32 logits [N, E]: sigmoid scores, top-k of
    `scores + bias` (ties to the lower index), weights `scores / sum * scaling`."""
    scores = torch.sigmoid(logits)  # [N, E]
    order = torch.sort(scores + bias.to(logits.dtype), dim=-1, descending=True, stable=True).indices
    selected = order[:, :top_k]  # [N, K]
    w = scores.gather(1, selected)  # [N, K]
    w = w / w.sum(dim=-1, keepdim=True) * scaling
    return w, selected


def expert_matmul(x: torch.Tensor, weight: Weight, selected: torch.Tensor, cdt: torch.dtype):
    """Per-token matmul with each token's selected experts only.

    x: [N, K, In] (or [N, In], broadcast over K); weight: stacked [E, Out, In];
    selected: [N, K]. Gathers the K selected matrices per token (never all E).
    Returns [N, K, Out] in `cdt`, unrounded.
    """
    if isinstance(weight, NVFP4Tensor):
        sel = weight[selected]  # codes [N, K, Out, In/2]
        w = sel.dequantize(cdt, with_global_scale=False)  # [N, K, Out, In]
        g = sel.global_scale.to(cdt)[..., None]  # [N, K, 1]
    else:
        w = weight[selected].to(cdt)  # [N, K, Out, In]
        g = None
    xk = x.to(cdt)
    if xk.dim() == 2:
        xk = xk[:, None, :].expand(-1, selected.shape[1], -1)
    y = (w @ xk[..., None])[..., 0]  # [N, K, Out]
    return y * g if g is not None else y


def routed_experts(
    x: torch.Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
    selected: torch.Tensor,
    cdt: torch.dtype,
) -> torch.Tensor:
    """The selected experts' SwiGLU MLPs, y_e = down_e(bf16(silu(gate_e x) * up_e x)).

    x: [N, H]; gate, up: [E, F, H]; down: [E, H, F]; selected: [N, K].
    Returns y [N, K, H] in x's dtype (each expert's output rounded once).
    """
    g = expert_matmul(x, gate, selected, cdt).to(x.dtype)  # [N, K, F]
    u = expert_matmul(x, up, selected, cdt).to(x.dtype)  # [N, K, F]
    h = silu_mul(g, u, cdt)  # [N, K, F]
    return expert_matmul(h, down, selected, cdt).to(x.dtype)  # [N, K, H]


def expert_combine(
    y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, cdt: torch.dtype
) -> torch.Tensor:
    """`bf16(sum_k w_k * y_k + y_shared)` in `cdt`. y: [N, K, H]; weights: [N, K];
    shared: [N, H] or None. Returns [N, H], rounded once."""
    m = (weights.to(cdt)[..., None] * y.to(cdt)).sum(dim=1)  # [N, H]
    if shared is not None:
        m = m + shared.to(cdt)
    return m.to(y.dtype)
