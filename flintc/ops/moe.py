"""MoE fused ops: routing (sigmoid, bias-corrected top-k, normalised weights), the
selected and shared experts' gate/up with SiLU-and-mul, and down with the weighted
combine. They read only the selected experts' weights (a gather per token), never
all E, and have no per-expert Python loop."""

from __future__ import annotations

import torch

from flintc.model import ops
from flintc.ops.common import CDT, as_weight, out_features


@torch.library.custom_op("flintc::moe_route", mutates_args=())
def moe_route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x: bf16 [N, H]; router: bf16 [E, H]; bias: fp32 [E]. -> (weights fp32 [N, K],
    expert ids int64 [N, K]); see `flintc.model.ops.route_topk`."""
    return ops.route_topk(x, router, bias, top_k, scaling, CDT)


@moe_route.register_fake
def _(x, router, bias, top_k, scaling):
    return (x.new_empty(x.shape[0], top_k, dtype=torch.float32),
            x.new_empty(x.shape[0], top_k, dtype=torch.int64))


@torch.library.custom_op("flintc::moe_gate_up", mutates_args=())
def moe_gate_up(x: torch.Tensor, ids: torch.Tensor, gate: list[torch.Tensor], up: list[torch.Tensor],
                shared_gate: list[torch.Tensor], shared_up: list[torch.Tensor]) -> torch.Tensor:
    """Gate/up GEMVs of each token's K selected experts and the shared expert, then
    SiLU-and-mul. x: bf16 [N, H]; ids: int64 [N, K]; gate, up: stacked [E, F, H];
    shared_*: [F, H] (empty lists: no shared expert). -> h bf16 [N, K(+1), F], the
    shared expert last."""
    g = ops.expert_matmul(x, as_weight(gate), ids, CDT).to(x.dtype)  # [N, K, F]
    u = ops.expert_matmul(x, as_weight(up), ids, CDT).to(x.dtype)
    if shared_gate:
        g = torch.cat([g, ops.linear(x, as_weight(shared_gate), CDT)[:, None]], dim=1)
        u = torch.cat([u, ops.linear(x, as_weight(shared_up), CDT)[:, None]], dim=1)
    return ops.silu_mul(g, u, CDT)


@moe_gate_up.register_fake
def _(x, ids, gate, up, shared_gate, shared_up):
    n = ids.shape[1] + (1 if shared_gate else 0)
    return x.new_empty(x.shape[0], n, out_features(gate))


@torch.library.custom_op("flintc::moe_down_combine", mutates_args=())
def moe_down_combine(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, down: list[torch.Tensor],
                     shared_down: list[torch.Tensor]) -> torch.Tensor:
    """Down GEMVs of the same experts and the fp32 weighted combine,
    `bf16(sum_k w_k * y_k + y_shared)`. h: bf16 [N, K(+1), F]; ids: [N, K];
    weights: fp32 [N, K]; down: stacked [E, H, F]; shared_down: [H, F] or [].
    -> bf16 [N, H]."""
    K = ids.shape[1]
    y = ops.expert_matmul(h[:, :K], as_weight(down), ids, CDT).to(h.dtype)  # [N, K, H]
    shared = ops.linear(h[:, K], as_weight(shared_down), CDT) if shared_down else None
    return ops.expert_combine(y, weights, shared, CDT)


@moe_down_combine.register_fake
def _(h, ids, weights, down, shared_down):
    return h.new_empty(h.shape[0], out_features(down))
