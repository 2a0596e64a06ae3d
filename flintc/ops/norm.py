"""RMSNorm (alone and after a residual add) and SiLU-and-mul as fused ops (one kernel each)."""

from __future__ import annotations

import torch

from flintc.model import ops
from flintc.ops.common import CDT


@torch.library.custom_op("flintc::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. x: bf16 [..., H]; weight: fp32 [H]. -> bf16 [..., H]."""
    return ops.rms_norm(x, weight, eps, CDT)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("flintc::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`bf16(silu(g) * u)`, fp32 inside. gate, up: bf16 [..., F]. -> bf16 [..., F]."""
    return ops.silu_mul(gate, up, CDT)


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("flintc::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm that reads its result (prefill,
    `flintc.passes.fuse_add_rms_norm`): `h = bf16(fp32 x + fp32 y)`, `rms_norm(h)`.
    x, y: bf16 [..., H]; weight: fp32 [H]. -> (h, normed), both bf16 [..., H]."""
    h = ops.residual_add(x, y, CDT)
    return h, ops.rms_norm(h, weight, eps, CDT)


@add_rms_norm.register_fake
def _(x, y, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)
