"""Helpers shared by the op definitions: weight lists and the fp32 compute dtype."""

from __future__ import annotations

from typing import Sequence

import torch

from flintc.model.weights import Weight
from flintc.quant.nvfp4 import NVFP4Tensor

CDT = torch.float32  # compute dtype of every fused op (FLINT_SPEC section 3)


def as_weight(parts: Sequence[torch.Tensor]) -> Weight:
    """`[w]` -> the bf16 tensor; `[codes, scales, global_scale]` -> an NVFP4Tensor."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 3:
        return NVFP4Tensor(parts[0], parts[1], parts[2])
    raise ValueError(f"a weight is 1 tensor (bf16) or 3 (NVFP4), got {len(parts)}")


def weight_args(w: Weight) -> list[torch.Tensor]:
    """Inverse of `as_weight`."""
    if isinstance(w, NVFP4Tensor):
        return [w.codes, w.scales, w.global_scale]
    return [w]


def out_features(parts: Sequence[torch.Tensor]) -> int:
    """F of an [..., F, K] weight in either format (NVFP4 packed, or in the mma layout:
    int32 codes [..., F/16, K/64, 32, 4])."""
    if len(parts) == 3 and parts[0].dtype == torch.int32:
        return parts[0].shape[-4] * 16
    return parts[0].shape[-2]
