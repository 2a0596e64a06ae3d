"""GEMMLoweringPass: the prefill twin of `lower_gemv`: every linear of a prefill step
becomes `flintc.gemm` (large-batch GEMM through torch/cuBLAS, or a Triton GEMM over
NVFP4 weights), plus `flintc.lm_head` and `flintc.embedding`.

Why a separate pass: at prefill the same weights serve T tokens, so the linear is
compute-bound and its kernel differs; the graph rewrite is the same as
`lower_gemv`'s (see there for the before/after). Bit-exact.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.passes.base import GraphPass, PassResult
from flintc.passes.lower_gemv import check_no_linear_left, lower_linears


class GEMMLoweringPass(GraphPass):
    name = "lower_gemm"
    steps = ("prefill",)

    def run(self, gm: GraphModule) -> PassResult:
        n = lower_linears(gm, torch.ops.flintc.gemm, self.ctx.batch * self.ctx.tokens)
        return PassResult(matches=n)

    def verify(self, gm: GraphModule) -> None:
        check_no_linear_left(gm, self.name)
