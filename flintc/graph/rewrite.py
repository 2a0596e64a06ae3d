"""Rewriting helpers: pattern replacement with torch.fx's subgraph rewriter, and
keeping node metadata current afterwards.

`replace_pattern` traces a search function and a replacement function with
`make_fx` on example inputs (so both are aten-level, like the captured graph),
runs `torch.fx.subgraph_rewriter.replace_pattern_with_filters`, and copies the
flintc tags (`flintc_layer`, `flintc_block`) of the matched nodes onto the nodes
that replace them. `refresh_meta` re-runs fake-tensor propagation over the whole
graph so every node's `meta["val"]` is current (the invariant every pass keeps).
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

TAGS = ("flintc_layer", "flintc_block")


def trace_pattern(fn: Callable, example_inputs: Sequence) -> GraphModule:
    """An aten-level graph of `fn` (a search pattern or a replacement), traced on
    fake tensors shaped like `example_inputs`. Pass distinct tensor objects: make_fx
    maps one object passed twice to one placeholder."""
    if len({id(t) for t in example_inputs}) != len(example_inputs):
        raise ValueError("trace_pattern needs distinct example tensors (one object per input)")
    return make_fx(fn, tracing_mode="fake")(*example_inputs)


def replace_pattern(gm: GraphModule, pattern: GraphModule, replacement: GraphModule,
                    match_filters: list[Callable] | None = None, ignore_literals: bool = False):
    """Replace every non-overlapping match of `pattern` in `gm` with `replacement`;
    new nodes inherit the flintc tags of the matched anchor. Returns the list of
    `ReplacedPatterns` (one per match). Call `refresh_meta` afterwards."""
    matches = replace_pattern_with_filters(gm, pattern, replacement, match_filters=match_filters,
                                           ignore_literals=ignore_literals)
    for m in matches:
        source = _anchor(m)
        for node in m.replacements:
            for tag in TAGS:
                if tag in source.meta and tag not in node.meta:
                    node.meta[tag] = source.meta[tag]
    return matches


def _anchor(match) -> Node:
    """A representative matched node: the one producing the (first) returned value."""
    anchors = list(match.nodes_map.values())
    outputs = [n for n in match.anchor.all_input_nodes] if match.anchor.op == "output" else [match.anchor]
    for n in outputs:
        mapped = match.nodes_map.get(n)
        if mapped is not None:
            return mapped
    return anchors[-1]


def refresh_meta(gm: GraphModule) -> None:
    """Recompute `meta["val"]` of every node by fake-tensor propagation from the
    placeholders' existing fake values; inherit missing flintc tags from inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [n.meta["val"] for n in placeholders]
    mode = next((v.fake_mode for v in fakes if hasattr(v, "fake_mode")), None)
    gm.recompile()
    FakeTensorProp(gm, mode=mode).propagate_dont_convert_inputs(*fakes)
    for node in gm.graph.nodes:
        if node.op == "call_function" and "flintc_layer" not in node.meta:
            found = [a.meta.get("flintc_layer") for a in node.all_input_nodes]
            found = [f for f in found if f is not None]
            node.meta["flintc_layer"] = max(found) if found else None
