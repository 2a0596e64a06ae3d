"""AddRMSNormFusionPass: each residual add whose result an RMSNorm reads becomes one
`flintc.add_rms_norm` op returning both (prefill).

Why: in a pre-norm decoder every residual add is read by the next RMSNorm (the
post-attention norm, the next layer's input norm, the final norm). Captured, the add
is 4 aten ops (two upcasts, the fp32 add, the downcast), each a kernel over [T, H], and
the norm re-reads the sum it just wrote; one kernel can add, round once, and normalise
the row it holds. Decode folds the same adds into its GEMVs instead
(`group_low_latency`), so this pass runs for prefill only, last (after `lower_gemm`).

Cases: the residual adds are found with torch's SubgraphMatcher on the pattern of
`flintc.model.ops.residual_add` (as `group_low_latency` does); one is folded when a
`flintc.rms_norm` reads its result directly. The sum h stays an output of the new op
for its other readers (the next residual add); an add no norm reads stays as it is.
Chained adds fold in order (the next add's residual is the previous op's h). The new
op takes the add's layer tags, so the norm after a layer's MLP (the next layer's input
norm, or the final norm) is counted with that layer. Bit-exact: the op's reference
implementation composes `ops.residual_add` and `ops.rms_norm`, the functions it replaces.

Before / after (prefill, B=1, T=8, tiny: H=128; layer 0's post-attention norm):

    _to_copy_26 = aten._to_copy(embedding_default, dtype=f32)   [1, 8, 128] f32
    _to_copy_27 = aten._to_copy(view_11, dtype=f32)             [1, 8, 128] f32
    add_5 = aten.add(_to_copy_26, _to_copy_27)
    _to_copy_28 = aten._to_copy(add_5, dtype=bf16)              [1, 8, 128] bf16
    rms_norm_3 = flintc.rms_norm(_to_copy_28, w_layers_0_post_attention_layernorm, 1e-05)
  ->
    add_rms_norm_default = flintc.add_rms_norm(embedding_default, view_11,
                                               w_layers_0_post_attention_layernorm, 1e-05)
    getitem_16 = add_rms_norm_default[0]                       [1, 8, 128] bf16 (h)
    getitem_17 = add_rms_norm_default[1]                       [1, 8, 128] bf16 (normed)

5 kernels -> 1 per folded add, two per layer: 8 kernels fewer per layer (a tiny prefill
forward: 87 -> 55).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.match import is_op
from flintc.graph.rewrite import TAGS, refresh_meta, trace_pattern
from flintc.model import ops
from flintc.passes.base import GraphPass, PassResult, PassVerifyError

F = torch.ops.flintc


def _residual_adds(gm: GraphModule):
    """SubgraphMatcher matches of `ops.residual_add(x, y, fp32)` in gm's graph."""
    x = torch.empty(2, 8, dtype=torch.bfloat16)
    y = torch.empty(2, 8, dtype=torch.bfloat16)
    pattern = trace_pattern(lambda x, y: ops.residual_add(x, y, torch.float32), (x, y))
    return SubgraphMatcher(pattern.graph, ignore_literals=False).match(gm.graph)


def _norm_reading(out: Node) -> Node | None:
    """The first `flintc.rms_norm` (graph order) whose input is `out`, or None."""
    return next((u for u in out.users if is_op(u, F.rms_norm) and u.args[0] is out), None)


class AddRMSNormFusionPass(GraphPass):
    name = "fuse_add_rms_norm"
    steps = ("prefill",)

    def run(self, gm: GraphModule) -> PassResult:
        done, replaced = 0, {}
        for m in _residual_adds(gm):
            out = m.returning_nodes[0]
            norm = _norm_reading(out)
            if norm is None:
                continue
            x, y = (replaced.get(a, a) for a in m.placeholder_nodes)  # an earlier fold's h
            _, weight, eps = norm.args
            if isinstance(weight, Node) and weight.op != "placeholder":
                continue  # the new op goes right after the add: its weight must exist there
            with gm.graph.inserting_after(out):
                new = gm.graph.call_function(F.add_rms_norm.default, (x, y, weight, eps))
            with gm.graph.inserting_after(new):
                h = gm.graph.call_function(operator.getitem, (new, 0))
            with gm.graph.inserting_after(h):
                normed = gm.graph.call_function(operator.getitem, (new, 1))
            for node in (new, h, normed):
                node.meta.update({t: out.meta[t] for t in TAGS if t in out.meta})
            out.replace_all_uses_with(h)
            norm.replace_all_uses_with(normed)
            gm.graph.erase_node(norm)
            replaced[out] = h
            done += 1
        gm.graph.eliminate_dead_code()
        refresh_meta(gm)
        return PassResult(matches=done)

    def verify(self, gm: GraphModule) -> None:
        for m in _residual_adds(gm):
            norm = _norm_reading(m.returning_nodes[0])
            if norm is not None:
                raise PassVerifyError(f"{self.name}: residual add {m.returning_nodes[0].name} "
                                      f"feeding {norm.name} left unfused")
