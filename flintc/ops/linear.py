"""Linear layers as fused ops: GEMV (decode, batch <= 8) and GEMM (prefill) over
bf16 or NVFP4 (W4A16) weights, the embedding lookup and the LM head."""

from __future__ import annotations

import torch

from flintc.model import ops
from flintc.ops.common import CDT, as_weight, out_features


def _linear_fake(x, w):
    return x.new_empty(*x.shape[:-1], out_features(w))


@torch.library.custom_op("flintc::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """Small-batch `x @ W^T` with fp32 accumulation, one rounding (NVFP4: global
    scale applied to the accumulator). x: bf16 [N <= 8, K]; W [F, K]. -> bf16 [N, F]."""
    return ops.linear(x, as_weight(w), CDT)


@gemv.register_fake
def _(x, w):
    return _linear_fake(x, w)


@torch.library.custom_op("flintc::gemm", mutates_args=())
def gemm(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """Large-batch (prefill) `x @ W^T`, same numerics as `gemv`. x: bf16 [N, K]."""
    return ops.linear(x, as_weight(w), CDT)


@gemm.register_fake
def _(x, w):
    return _linear_fake(x, w)


@torch.library.custom_op("flintc::embedding", mutates_args=())
def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Row lookup. ids: int64 [B, T]; table: bf16 [V, H]. -> bf16 [B, T, H]."""
    return table[ids].clone()


@embedding.register_fake
def _(ids, table):
    return table.new_empty(*ids.shape, table.shape[1])


@torch.library.custom_op("flintc::lm_head", mutates_args=())
def lm_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Logits with fp32 accumulation, never rounded. x: bf16 [N, H]; w: bf16 [V, H].
    -> fp32 [N, V]."""
    return ops.lm_head(x, w, CDT)


@lm_head.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)
