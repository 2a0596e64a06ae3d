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
Both, and every other entry into torch's fake-tensor and proxy modes in flintc (the
capture's `make_fx`, fuse_moe's `with fake_mode`), run inside `fake_mode_section`,
where SIGINT and SIGTERM wait for the section's end.
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from flintc.fileio import signals_deferred

TAGS = ("flintc_layer", "flintc_block")


def fake_mode_section(tracing: bool = False):
    """A block that enters and leaves torch's fake-tensor or proxy dispatch modes
    (`make_fx(..., tracing_mode="fake")`, `FakeTensorProp`, `with fake_mode:`), with
    SIGINT and SIGTERM deferred to its end (`flintc.fileio.signals_deferred`): a Ctrl-C
    or `kill` in the block is raised, as KeyboardInterrupt or flintc's Terminated, right
    after it, never inside it. Use as `with fake_mode_section():`; a section inside
    another defers to the outer one's end. Only the main thread defers (elsewhere the
    block runs as it is, and Python runs signal handlers in the main thread only).

    Why: torch keeps the current fake and proxy modes in thread-local slots, set and
    unset by Python code (`FakeTensorMode.__enter__`, `_push_mode`) that runs many times
    per traced op, also nested inside the C++ dispatcher, which stashes the mode whose
    `__torch_dispatch__` it calls and puts it back from a C++ destructor. A
    KeyboardInterrupt raised just after a mode was set, before its `with` block began,
    leaves the slot occupied; unwinding then reaches that destructor, whose "trying to
    set the current FakeTensorMode, but one already exists" cannot propagate, and the
    process aborts (std::terminate, exit 134) without the CLI's clean-up: about 1
    interrupted `flintc compile` in 50 did, leaving its `.OUT.PID.*` folder. Nothing
    in torch repairs the slots afterwards (the abort comes before any Python code runs
    again), hence deferral rather than a reset while unwinding.

    How long a signal may wait: one section is one capture, one pattern trace, one
    `refresh_meta` or one fuse_moe propagation. A default `flintc compile` of the tiny
    config spends 4.8 s of its 20 s in 131 sections: 5 captures of 0.5 to 0.95 s,
    pattern traces of at most 60 ms, refreshes of at most 21 ms (a 2-core CPU). On the
    full 40B config a capture (layer replay) and the first whole-graph `refresh_meta`
    of a step take 1.2 to 1.9 s each on that CPU (twice that on a busy one), later
    refreshes a fraction. `tracing=True` (a `make_fx` call in the block) first
    imports, before deferring, what make_fx imports on its first call
    (`torch._inductor.config`, and with it torch._dynamo: 2 to 3.5 s of a process's
    first capture, which a Ctrl-C would otherwise have waited for)."""
    if tracing:  # make_fx's own import, done where a signal may act
        importlib.import_module("torch._inductor.config")
    return signals_deferred()


def trace_pattern(fn: Callable, example_inputs: Sequence) -> GraphModule:
    """An aten-level graph of `fn` (a search pattern or a replacement), traced on
    fake tensors shaped like `example_inputs`. Pass distinct tensor objects: make_fx
    maps one object passed twice to one placeholder."""
    if len({id(t) for t in example_inputs}) != len(example_inputs):
        raise ValueError("trace_pattern needs distinct example tensors (one object per input)")
    with fake_mode_section(tracing=True):
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
    with fake_mode_section():
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
