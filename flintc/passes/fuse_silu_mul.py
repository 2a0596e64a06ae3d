"""SiLUMulFusionPass: every SwiGLU activation `bf16(silu(g) * u)` becomes one
`flintc.silu_mul` op.

Why: the captured activation is six aten ops (two upcasts, sigmoid, two
multiplies, a downcast); FLINT_SPEC section 3 rounds it once. Handles the dense
MLPs and shared experts ([N, F]) and the routed experts ([N, K, F]); the pattern is
traced from `flintc.model.ops.silu_mul`. Bit-exact (same function inside the op).

Before / after (dense layer, decode B=2, tiny):

    _to_copy_20 = aten._to_copy(gate, dtype=f32)     [2, 256] f32
    sigmoid = aten.sigmoid(_to_copy_20)
    mul_12 = aten.mul(_to_copy_20, sigmoid)
    _to_copy_21 = aten._to_copy(up, dtype=f32)
    mul_13 = aten.mul(mul_12, _to_copy_21)
    _to_copy_22 = aten._to_copy(mul_13, dtype=bf16)  [2, 256] bf16
  ->
    silu_mul = flintc.silu_mul(gate, up)            [2, 256] bf16
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.rewrite import refresh_meta, replace_pattern, trace_pattern
from flintc.model import ops
from flintc.passes.base import GraphPass, PassResult


class SiLUMulFusionPass(GraphPass):
    name = "fuse_silu_mul"
    stage = "fused"

    def run(self, gm: GraphModule) -> PassResult:
        g, u = torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(2, 8, dtype=torch.bfloat16)

        def search(gate, up):
            return ops.silu_mul(gate, up, torch.float32)

        def replace(gate, up):
            return torch.ops.flintc.silu_mul(gate, up)

        matches = replace_pattern(gm, trace_pattern(search, (g, u)), trace_pattern(replace, (g, u)))
        refresh_meta(gm)
        return PassResult(matches=len(matches))
