"""Matching glue shared by the fusion passes: per-layer subgraph matching with torch.fx's
`SubgraphMatcher`, binding matched inputs back to a pattern's shapes, and search
patterns in both the traced and the canonicalized spelling. No pass logic here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from flintc.graph.match import clone_graph_module
from flintc.passes.base import PassContext, PassVerifyError
from flintc.passes.canonicalize import CanonicalizationPass

aten = torch.ops.aten


@dataclass
class LayerMatch:
    """One match of a pattern in the graph: `inputs` bound to the pattern's
    placeholders and `outputs` to its returned values (both in pattern order),
    `nodes`, the matched op nodes that a rewrite replaces, and `shapes`, the shape
    each input has in the pattern (None for a non-tensor)."""

    inputs: list
    outputs: list[Node]
    nodes: set[Node]
    shapes: list


def _shape(node) -> tuple | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def match_in_layer(gm: GraphModule, pattern: GraphModule, layer: int) -> list[LayerMatch]:
    """Matches of `pattern` (torch.fx `SubgraphMatcher`) among the nodes of one decoder
    layer (`meta["flintc_layer"] == layer`).

    The layer's nodes are copied into a small graph whose placeholders stand for
    values from outside the layer and whose output takes every value leaving it, so
    the matcher's containment rule still sees users outside the layer."""
    return _match_layer_graph(_layer_graph(gm, layer), pattern)


def _layer_graph(gm: GraphModule, layer: int) -> tuple[Graph, dict[Node, Node]]:
    """The small graph `match_in_layer` searches for `layer`, and its node -> the
    graph's node."""
    members = [n for n in gm.graph.nodes
               if n.op == "call_function" and n.meta.get("flintc_layer") == layer]
    inside = set(members)
    sub, env = Graph(), {}
    for n in members:
        for a in n.all_input_nodes:
            if a not in inside and a not in env:
                env[a] = sub.placeholder(a.name)
    for n in members:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[n] for n in members if any(u not in inside for u in n.users)))
    return sub, {copy: n for n, copy in env.items()}


def _match_layer_graph(layer_graph: tuple[Graph, dict[Node, Node]], pattern: GraphModule) -> list[LayerMatch]:
    sub, back = layer_graph
    found = []
    ins = [p for p in pattern.graph.nodes if p.op == "placeholder"]
    shapes = [_shape(p) for p in ins]
    for m in SubgraphMatcher(pattern.graph).match(sub):
        nodes = {back[gn] for pn, gn in m.nodes_map.items()
                 if pn.op not in ("placeholder", "output")}
        inputs = [back.get(v, v) if isinstance(v, Node) else v for v in m.placeholder_nodes]
        if all(_fits(v, p) for v, p in zip(inputs, ins)):
            found.append(LayerMatch(inputs, [back[v] for v in m.returning_nodes], nodes, shapes))
    return found


def _fits(value, pattern_input: Node) -> bool:
    """Whether a bound input can stand for a pattern input: same shape, or (when the
    pattern only views that input) as many elements: a view chain that `canonicalize`
    folded into the pattern's first view (see `bind_inputs`)."""
    shape = _shape(pattern_input)
    if shape is None:
        return True
    have = _shape(value)
    views_only = all(u.target is aten.view.default for u in pattern_input.users)
    if have == shape:
        return True
    return views_only and have is not None and math.prod(have) == math.prod(shape)


def bind_inputs(gm: GraphModule, m: LayerMatch, before: Node, layer: int) -> list:
    """The match's inputs, each with the pattern's shape. `canonicalize` folds
    `view(view(x, s1), s2)` into `view(x, s2)`, so a pattern input `v` [B, T, Hkv, D]
    that the pattern views as s2 can bind to x [N, Hkv*D]; such an input gets its
    view to the pattern's shape back, inserted before `before`."""
    out = []
    for value, shape in zip(m.inputs, m.shapes):
        if shape is not None and _shape(value) != shape:
            with gm.graph.inserting_before(before):
                value = gm.graph.call_function(aten.view.default, (value, list(shape)))
            value.meta.update(flintc_layer=layer, flintc_block="attn")
        out.append(value)
    return out


def pattern_forms(pattern: GraphModule, ctx: PassContext) -> list[GraphModule]:
    """`pattern` as traced and, when `canonicalize` changes it, as that pass leaves it
    (no `aten.alias`, collapsed view chains): a search pattern then matches a graph
    with or without `canonicalize` applied (it can be switched off by name)."""
    canonical = clone_graph_module(pattern)
    CanonicalizationPass(ctx).run(canonical)
    canonical.recompile()
    return [pattern] if str(canonical.graph) == str(pattern.graph) else [pattern, canonical]


def like(node: Node) -> torch.Tensor:
    """An empty tensor with `node`'s shape, dtype and device (to trace patterns with)."""
    v = node.meta["val"]
    return torch.empty(v.shape, dtype=v.dtype, device=v.device)


def move_before(node: Node, anchor: Node, order: dict[Node, int]) -> None:
    """Move `node` (which must need only values defined before `anchor`) right before it."""
    late = [a for a in node.all_input_nodes if order[a] >= order[anchor]]
    if late:
        raise PassVerifyError(f"cannot move {node.name} before {anchor.name}: "
                              f"it needs {late[0].name}")
    anchor.prepend(node)


def first_match_per_layer(gm: GraphModule, ctx: PassContext, build_pattern, accept):
    """For each decoder layer in order, yield (layer, sliding, match): the first match of
    its layer kind's pattern, in either spelling (`pattern_forms`), that
    `accept(match, layer)` takes, or None. `build_pattern(gm, layer, sliding)` runs
    once per layer kind. Lazy: a caller that rewrites layer i before asking for layer
    i + 1 is matched against the rewritten graph."""
    forms: dict[bool, list[GraphModule]] = {}
    for layer in range(ctx.config.num_hidden_layers):
        sliding = ctx.config.is_sliding_layer(layer)
        if sliding not in forms:
            forms[sliding] = pattern_forms(build_pattern(gm, layer, sliding), ctx)
        yield layer, sliding, _first_match(gm, layer, forms[sliding], accept)


def _first_match(gm: GraphModule, layer: int, forms: list[GraphModule], accept) -> LayerMatch | None:
    """The first match of `forms`, in order, in `layer` that `accept` takes: what
    `match_in_layer` finds, with the layer's graph made once for all forms."""
    layer_graph = None
    for form in forms:
        layer_graph = layer_graph or _layer_graph(gm, layer)
        for m in _match_layer_graph(layer_graph, form):
            if accept(m, layer):
                return m
    return None
