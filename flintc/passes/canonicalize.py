"""CanonicalizationPass: remove no-op nodes and collapse view chains, so later
pattern passes see one spelling of each computation.

Why: make_fx records `aten.alias` for `x.to(same dtype)`-style no-ops and chains of
views from reshapes of reshapes; neither launches useful work, and both vary with
how the reference happens to be written, which makes patterns brittle.

Cases: `aten.alias(x)` -> x; `view(view(x, s1), s2)` -> `view(x, s2)` when the
inner view has no other user; `clone` of a tensor that is already contiguous and
not written later is left alone (it may feed `_unsafe_view`). Dead nodes are
removed. Bit-exact: no arithmetic changes.

Before / after:

    alias_4 = aten.alias(positions)           [2, 1] i64
    remainder_2 = aten.remainder(alias_4, 9)
  ->
    remainder_2 = aten.remainder(positions, 9)
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from flintc.graph.match import find_nodes, is_op
from flintc.passes.base import GraphPass, PassResult, PassVerifyError

aten = torch.ops.aten


class CanonicalizationPass(GraphPass):
    name = "canonicalize"
    stage = "captured"

    def run(self, gm: GraphModule) -> PassResult:
        removed = 0
        for node in find_nodes(gm, aten.alias):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed += 1
        for node in find_nodes(gm, aten.view):
            inner = node.args[0]
            if is_op(inner, aten.view) and len(inner.users) == 1:
                node.args = (inner.args[0], *node.args[1:])
                gm.graph.erase_node(inner)
                removed += 1
        gm.graph.eliminate_dead_code()
        return PassResult(matches=removed)

    def verify(self, gm: GraphModule) -> None:
        left = find_nodes(gm, aten.alias)
        if left:
            raise PassVerifyError(f"{self.name}: aten.alias left at {left[0].name}")
