"""RMSNormFusionPass: every RMSNorm becomes one `flintc.rms_norm` op.

Why: the captured RMSNorm is eight aten ops (eight kernels in eager PyTorch);
FLINT_SPEC section 3 rounds it once, at its output, which one kernel does.
Handles the hidden-state norms (input, post-attention, final: [B, T, H]) and the
per-head Q/K norms ([B, T, heads, D]); the pattern is traced from
`flintc.model.ops.rms_norm` itself, so it matches exactly what the reference
model emits, for any shape, with the config's epsilon. Bit-exact: the op's
reference implementation is the same function.

Before / after (decode, B=2, tiny):

    _to_copy_88 = aten._to_copy(x, dtype=f32)        [2, 1, 128] f32
    pow_9 = aten.pow(_to_copy_88, 2)
    mean_8 = aten.mean(pow_9, [-1], True)            [2, 1, 1]
    add_14 = aten.add(mean_8, 1e-05)
    rsqrt_8 = aten.rsqrt(add_14)
    mul_30 = aten.mul(_to_copy_88, rsqrt_8)
    mul_31 = aten.mul(mul_30, w_layers_2_input_layernorm)
    _to_copy_89 = aten._to_copy(mul_31, dtype=bf16)  [2, 1, 128] bf16
  ->
    rms_norm = flintc.rms_norm(x, w_layers_2_input_layernorm, 1e-05)  [2, 1, 128] bf16
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.match import find_nodes
from flintc.graph.rewrite import refresh_meta, replace_pattern, trace_pattern
from flintc.model import ops
from flintc.passes.base import GraphPass, PassResult, PassVerifyError

aten = torch.ops.aten


class RMSNormFusionPass(GraphPass):
    name = "fuse_rms_norm"
    stage = "fused"

    def run(self, gm: GraphModule) -> PassResult:
        eps = self.ctx.config.rms_norm_eps
        x = torch.empty(2, 8, dtype=torch.bfloat16)
        w = torch.empty(8, dtype=torch.float32)

        def search(x, w):
            return ops.rms_norm(x, w, eps, torch.float32)

        def replace(x, w):
            return torch.ops.flintc.rms_norm(x, w, eps)

        matches = replace_pattern(gm, trace_pattern(search, (x, w)), trace_pattern(replace, (x, w)))
        refresh_meta(gm)
        return PassResult(matches=len(matches))

    def verify(self, gm: GraphModule) -> None:
        left = find_nodes(gm, aten.rsqrt)
        if left:
            raise PassVerifyError(f"{self.name}: unfused RMSNorm left at {left[0].name}")
