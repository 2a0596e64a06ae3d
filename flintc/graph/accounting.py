"""Kernel accounting: how many kernel launches one forward of a graph makes.

The count rule, written down once (graph/README.md repeats it):

* a `call_function` node whose op only re-describes memory (views, reshapes,
  permutes, expands, slices, selects, aliases, `getitem` of a multi-output op)
  launches nothing: 0;
* every other aten op launches 1 (eager PyTorch launches at least one kernel per
  such op; `_to_copy`, `clone` and `index_put_` are real copies);
* a `flintc` fused op launches the number in :data:`FLINTC_OP_KERNELS` (1 unless
  listed): the launches of its kernel schedule;
* placeholders, `get_attr` and the output launch nothing.

Counts are grouped by the layer a node belongs to (`meta["flintc_layer"]`, see
`flintc.graph.trace.tag_layers`) and by layer kind (`dense`, `moe`); nodes of no
layer (masks, RoPE rows), the embedding and the LM head count per forward only.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from flintc.config import FlintConfig

aten = torch.ops.aten

FREE_OPS = {
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t,
    aten.expand, aten.unsqueeze, aten.squeeze, aten.slice, aten.select, aten.alias,
    aten.detach, aten.split, aten.split_with_sizes, aten.unbind, aten.as_strided,
    aten._reshape_alias, aten.view_as, aten.flatten, aten.unflatten, aten.narrow,
}

# flintc ops that launch more than one kernel (name without namespace -> launches).
FLINTC_OP_KERNELS: dict[str, int] = {
    # flash-attention prefill, then the KV-cache write (flintc/kernels/prefill_attention.py):
    # the write must wait for every read of the old ring, so it is a second launch.
    "prefill_attention_kv": 2,
}


def kernels_of(node: Node) -> int:
    """Launches made by one node under the count rule above."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet in FREE_OPS:
        return 0
    namespace = getattr(target, "namespace", None)
    if namespace == "flintc":
        return FLINTC_OP_KERNELS.get(target._opname, 1)
    return 1


@dataclass
class KernelCount:
    """Kernel launches of one forward.

    per_forward: everything; per_layer: layer index -> launches (-1 embedding,
    L head); per_kind: `dense` / `moe` -> launches of the most expensive layer of
    that kind; shared: launches in no layer (per-step masks and tables).
    """

    per_forward: int
    per_layer: dict[int, int] = field(default_factory=dict)
    per_kind: dict[str, int] = field(default_factory=dict)
    shared: int = 0

    def as_dict(self) -> dict:
        return {"per_forward": self.per_forward, "per_kind": dict(self.per_kind),
                "shared": self.shared, "per_layer": {str(k): v for k, v in sorted(self.per_layer.items())}}


def count_kernels(gm: GraphModule, config: FlintConfig) -> KernelCount:
    """Apply the count rule to every node of `gm` (see the module doc)."""
    per_layer: dict[int, int] = {}
    shared = total = 0
    for node in gm.graph.nodes:
        k = kernels_of(node)
        if not k:
            continue
        total += k
        layer = node.meta.get("flintc_layer")
        if layer is None:
            shared += k
        else:
            per_layer[layer] = per_layer.get(layer, 0) + k
    per_kind: dict[str, int] = {}
    for i in range(config.num_hidden_layers):
        kind = "moe" if config.is_moe_layer(i) else "dense"
        per_kind[kind] = max(per_kind.get(kind, 0), per_layer.get(i, 0))
    return KernelCount(total, per_layer, per_kind, shared)
