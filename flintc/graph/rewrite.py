"""Rewriting helpers: pattern replacement with torch.fx's subgraph rewriter, and
keeping node metadata current afterwards.

`replace_pattern` traces a search function and a replacement function with
`make_fx` on example inputs (so both are aten-level, like the captured graph),
runs `torch.fx.subgraph_rewriter.replace_pattern_with_filters`, and copies the
flintc tags (`flintc_layer`, `flintc_block`) of the matched nodes onto the nodes
that replace them. `refresh_meta` re-runs fake-tensor propagation so every node's
`meta["val"]` is current (the invariant every pass keeps): over the whole graph the
first time, then only over the nodes that changed since the last refresh and those
whose inputs' shapes, strides or dtypes changed with them (the same values a whole
-graph propagation gives, in time proportional to the rewrite, not to the model).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
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
    placeholders' existing fake values; inherit missing flintc tags from inputs.

    The first call on a graph propagates over every node (torch.fx's `FakeTensorProp`)
    and records each node's target, arguments and value (`capture` records them as
    traced, see `mark_meta_current`). Later calls propagate only
    where that record no longer holds (a node added, re-targeted or re-wired, or its
    value replaced) and, from there, through users whose inputs came out with other
    metadata (shape, stride, dtype, device): every other node would get the same
    metadata again."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [n.meta["val"] for n in placeholders]
    mode = next((v.fake_mode for v in fakes if hasattr(v, "fake_mode")), None)
    gm.recompile()  # deferred to the first call for a captured (lazy) graph module
    record = getattr(gm.graph, _RECORD, None)
    if mode is None or record is None or not _propagate_changed(gm, mode, record):
        FakeTensorProp(gm, mode=mode).propagate_dont_convert_inputs(*fakes)
    for node in gm.graph.nodes:
        if node.op == "call_function" and "flintc_layer" not in node.meta:
            found = [a.meta.get("flintc_layer") for a in node.all_input_nodes]
            found = [f for f in found if f is not None]
            node.meta["flintc_layer"] = max(found) if found else None
    if mode is not None:
        mark_meta_current(gm)


def mark_meta_current(gm: GraphModule) -> None:
    """Record that every node's `meta["val"]` is current (as `capture` leaves a graph:
    make_fx computed them), so the next `refresh_meta` propagates only over what
    changes after this."""
    setattr(gm.graph, _RECORD, {n: _state(n) for n in gm.graph.nodes})


# Attribute of a Graph: node -> _state(node) as of the last refresh_meta (values current).
_RECORD = "_flintc_meta_record"


def _state(node: Node):
    """What `_RECORD` keeps of `node`: (target, args, kwargs, meta["val"])."""
    return node.target, node.args, node.kwargs, node.meta.get("val")


def _changed(node: Node, record: dict) -> bool:
    """Whether `node` is new since `record`, has no value, or has another target,
    other arguments or another value object than `record` holds for it."""
    old = record.get(node)
    if old is None or "val" not in node.meta:
        return True
    target, args, kwargs, val = _state(node)
    return old[0] is not target or old[3] is not val or old[1] != args or old[2] != kwargs


def _propagate_changed(gm: GraphModule, mode, record: dict) -> bool:
    """Propagate over the nodes changed since `record` (see `refresh_meta`). Returns
    False, having changed nothing, when the graph holds a node kind this does not
    handle (the caller then propagates over the whole graph)."""
    todo, moved = [], set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op not in ("call_function", "output"):
            return False
        todo.append(node)
    prop = FakeTensorProp(gm, mode=mode)
    with mode:
        for node in todo:
            if not (_changed(node, record) or any(a in moved for a in node.all_input_nodes)):
                continue
            for a in node.all_input_nodes:
                if a not in prop.env:
                    prop.env[a] = a.meta["val"]
            before = meta_key(node.meta.get("val"))
            prop.env[node] = prop.run_node(node)
            if meta_key(node.meta.get("val")) != before:
                moved.add(node)
    return True


def meta_key(v):
    """What fake propagation reads of a node value `v` (a `meta["val"]`): per tensor
    its shape, strides, storage offset, dtype, device and requires_grad; lists and
    tuples element by element; None, bool, int, float and str as they are; any other
    object by identity. Equal keys: the same metadata."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, v.device,
                v.requires_grad)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(meta_key(x) for x in v))
    if v is None or isinstance(v, (bool, int, float, str)):
        return ("value", type(v).__name__, v)
    return ("object", id(v))
