"""Capture by layer replay: trace each kind of decoder layer once, copy it for the rest.

Tracing with `make_fx` costs milliseconds per node, and the full model's 49 layers
are four kinds of layer (dense or MoE, sliding or full attention) repeated: a layer's
forward is a pure function of its inputs (hidden state, positions, slots, RoPE rows,
visibility mask, its weights and its KV cache), with no Python control flow on values
(`flintc.model.reference`). So `capture` traces a reduced model instead: the first
layer plus the first layer of each kind after it (layers 0-3 of the full config),
taking every input of the full step as graph inputs, and `replay` builds the full
step's graph from that trace: the placeholders and the per-step prefix (embedding,
RoPE rows, masks), then for each layer the nodes of the traced layer of its kind with
its own weights, caches and input, then the head (final norm, LM head).

The result is the graph `make_fx` gives for the whole model, node for node: nodes are
created in tracing order and named the way the tracer names them (so the graph's
namer gives the same names: `mm_512` is `mm_512`), with the traced node's metadata
(`val`, `tensor_meta`, `stack_trace`; values are shared between the copies of a
layer, and have the same shapes, strides and dtypes a trace gives), and the layer
spans `_ModuleSpans` would record, so the tags are the same.
`tests/graph/test_layer_replay.py` compares both captures node by node.

`replay_plan` returns None (and `capture` traces every layer) when there is nothing
to gain (every layer is the first of its kind) or when a layer differs from the
traced layer of its kind in anything but its index: module structure, or a weight's
name, shape, dtype or device (e.g. a checkpoint mixing formats between layers).
`replay` returns None, and `capture` traces every layer, when the reduced trace is
not laid out as expected (a node outside the layer spans between layers, a layer
with more than one value leaving it, a name the tracer would not give).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.node import map_arg

from flintc.config import FlintConfig
from flintc.errors import FlintcError
from flintc.graph.rewrite import meta_key


@dataclass
class ReplayPlan:
    """What to trace instead of the whole model, and how to map it back.

    model: the reduced model (layers `reps` of the full model, same module objects).
    reps: full-model layer index of each reduced layer (reps[0] == 0).
    template: full layer index -> reduced layer whose trace it copies (0 for layer 0;
        for later layers the first layer of their kind after layer 0).
    params: (reduced buffer name, index of that buffer among the full model's buffers).
    kv_index: index into the full KV-cache list of each reduced cache.
    """

    model: nn.Module
    reps: list[int]
    template: list[int]
    params: list[tuple[str, int]]
    kv_index: list[int]


def _kind(config: FlintConfig, i: int) -> tuple[bool, bool]:
    """(sliding attention, MoE) of layer `i`: layers of one kind trace alike."""
    return config.is_sliding_layer(i), config.is_moe_layer(i)


def _signature(layer: nn.Module) -> list:
    """What a layer's trace can depend on besides its inputs: module types and
    flags, and each weight's name, shape, dtype and device."""
    mods = [(name, type(m).__name__, getattr(m, "is_sliding", None), getattr(m, "is_moe", None),
             getattr(m, "is_nvfp4", None), getattr(m, "eps", None)) for name, m in layer.named_modules()]
    bufs = [(name, tuple(b.shape), b.dtype, b.device.type) for name, b in layer.named_buffers()]
    return [mods, bufs]


def replay_plan(model, names: list[str]) -> ReplayPlan | None:
    """The reduced model to trace for `model` (a FlintModel) whose buffers are
    `names`, in order; None when every layer must be traced (see the module doc)."""
    c = model.config
    L = c.num_hidden_layers
    reps, first = [0], {}
    template = [0] * L
    for i in range(1, L):
        k = _kind(c, i)
        if k not in first:
            first[k] = len(reps)
            reps.append(i)
        template[i] = first[k]
    if len(reps) == L:
        return None
    for i in range(1, L):
        if _signature(model.layers[i]) != _signature(model.layers[reps[template[i]]]):
            return None
    try:
        cfg = c.replace(num_hidden_layers=len(reps), layer_types=tuple(c.layer_types[i] for i in reps),
                        first_k_dense_replace=sum(1 for i in reps if not c.is_moe_layer(i)))
    except (FlintcError, ValueError):
        return None
    if [_kind(cfg, j) for j in range(len(reps))] != [_kind(c, i) for i in reps]:
        return None
    reduced = copy.copy(model)  # shares the layer modules and weights; own module tables
    reduced._modules = dict(model._modules)
    reduced._buffers = dict(model._buffers)
    reduced._parameters = dict(model._parameters)
    reduced._non_persistent_buffers_set = set(model._non_persistent_buffers_set)
    reduced.layers = nn.ModuleList([model.layers[i] for i in reps])
    reduced.config = cfg
    index = {name: k for k, name in enumerate(names)}
    params = []
    for name, _ in reduced.named_buffers():
        full = _full_name(name, reps)
        if full not in index:
            return None
        params.append((name, index[full]))
    kv_index = [2 * i + kv for i in reps for kv in (0, 1)]
    return ReplayPlan(reduced, reps, template, params, kv_index)


def _full_name(name: str, reps: list[int]) -> str:
    """`layers.<j>.rest` of the reduced model -> `layers.<reps[j]>.rest`."""
    if name.startswith("layers."):
        j, rest = name[len("layers."):].split(".", 1)
        return f"layers.{reps[int(j)]}.{rest}"
    return name


def _candidate(graph: Graph, node: Node) -> str | None:
    """The name the tracer asked the graph for when it made `node` (the graph's
    namer then adds the suffix): make_fx names an op call after its overload packet,
    placeholders after the argument; getitem and output by their target (None)."""
    if node.op == "placeholder":
        return node.target
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return graph._target_to_str(node.target.overloadpacket.__name__)
    return None


def _new_graph(like: Graph) -> Graph:
    """An empty Graph with `like`'s tracer class and code generator."""
    g = Graph(tracer_cls=like._tracer_cls, tracer_extras=like._tracer_extras)
    g._codegen = copy.deepcopy(like._codegen)
    return g


def _copy(graph: Graph, node: Node, arg) -> Node:
    """Append a copy of `node` to `graph`, its inputs mapped by `arg` (Node -> Node), named
    as the tracer named it, with a shallow copy of its meta (values shared)."""
    new = graph.create_node(node.op, node.target, map_arg(node.args, arg), map_arg(node.kwargs, arg),
                            name=_candidate(graph, node), type_expr=node.type)
    new.meta = copy.copy(node.meta)
    return new


def _names_reproduce(traced: GraphModule) -> bool:
    """Whether copying every node of the trace in order, with `_candidate` names,
    gives the trace's own names (no name taken by a node the tracer later removed,
    no node made another way)."""
    g = _new_graph(traced.graph)
    env: dict[Node, Node] = {}
    for n in traced.graph.nodes:
        env[n] = _copy(g, n, env.__getitem__)
        if env[n].name != n.name:
            return False
    return True


def replay(traced: GraphModule, spans: list, plan: ReplayPlan, names: list[str], num_layers: int,
           n_act: int = 3):
    """The whole step's graph from the reduced trace `traced` (with `spans`, the
    reduced model's `_ModuleSpans` records; `n_act` activation inputs between the
    weights and the KV cache: 3, or 4 for a prefill's logits_rows). Returns
    (GraphModule, spans as a trace of the whole model records them), or None (see the
    module doc)."""
    nodes = list(traced.graph.nodes)
    pos = {n.name: k for k, n in enumerate(nodes)}
    R = len(plan.reps)
    # The spans in recording order: each layer's block spans, then its layer span.
    groups, current = [], []
    for span in spans:
        current.append(span)
        if span[0] == "flintc_layer":
            groups.append(current)
            current = []
    if current or [g[-1][1] for g in groups] != list(range(R)):
        return None
    bounds = []
    for g in groups:
        _, _, after, last = g[-1]
        if after not in pos or last not in pos:
            return None
        bounds.append((pos[after] + 1, pos[last] + 1))
    if any(bounds[j][0] != bounds[j - 1][1] for j in range(1, R)):
        return None  # a node between two layers
    n_inputs = len(names) + n_act + 2 * num_layers
    prefix = nodes[:bounds[0][0]]
    if len(prefix) < n_inputs or any(n.op != "placeholder" for n in prefix[:n_inputs]) \
            or any(n.op == "placeholder" for n in nodes[n_inputs:]):
        return None
    segments = [nodes[a:b] for a, b in bounds]
    head = nodes[bounds[-1][1]:]
    if not _names_reproduce(traced):
        return None

    prefix_set = set(prefix)
    inputs = prefix[:n_inputs]
    outs = []
    for j, seg in enumerate(segments):
        inside = set(seg)
        leaving = [n for n in seg if any(u not in inside for u in n.users)]
        if len(leaving) != 1:
            return None
        outs.append(leaving[0])
        for n in seg:
            for a in n.all_input_nodes:
                if a in inside or a in prefix_set or (j and a is outs[j - 1]):
                    continue
                return None
    for n in head:
        for a in n.all_input_nodes:
            if a not in prefix_set and a is not outs[-1] and a not in head:
                return None

    index = {name: k for k, name in enumerate(names)}
    n_w = len(names)

    def input_for(k: int, r: int, i: int) -> int | None:
        """Flat input index that layer i reads where layer r's template reads input k."""
        if k < n_w:
            name = names[k]
            if not name.startswith("layers."):
                return k
            layer, rest = name[len("layers."):].split(".", 1)
            if int(layer) != r:
                return None
            return index.get(f"layers.{i}.{rest}")
        if k < n_w + n_act:
            return k
        layer, kv = divmod(k - n_w - n_act, 2)
        return n_w + n_act + 2 * i + kv if layer == r else None

    graph = _new_graph(traced.graph)
    env: dict[Node, Node] = {}
    for n in prefix:
        env[n] = _copy(graph, n, env.__getitem__)
    flat = [env[n] for n in inputs]
    input_pos = {n: k for k, n in enumerate(inputs)}
    new_spans = []
    out = None  # the last copied layer's output
    before = env[prefix[-1]]  # the node before the current layer in the new graph
    for i in range(num_layers):
        j = plan.template[i]
        r = plan.reps[j]
        x = outs[j - 1] if j else None
        if j and meta_key(x.meta.get("val")) != meta_key(out.meta.get("val")):
            return None
        local: dict[Node, Node] = {}

        def arg(a, r=r, i=i, x=x, out=out, local=local):
            if a in local:
                return local[a]
            if a is x:
                return out
            k = input_pos.get(a)
            if k is None:
                return env[a]
            m = input_for(k, r, i)
            if m is None:
                raise _NoReplay
            return flat[m]

        try:
            for n in segments[j]:
                local[n] = _copy(graph, n, arg)
        except _NoReplay:
            return None
        seg_after = groups[j][-1][2]
        renamed = {n.name: local[n].name for n in segments[j]}
        for key, value, after, last in groups[j]:
            if after == seg_after:
                after = before.name
            elif after in renamed:
                after = renamed[after]
            else:
                return None
            if last not in renamed:
                return None
            new_spans.append((key, i if key == "flintc_layer" else value, after, renamed[last]))
        out = local[outs[j]]
        before = local[segments[j][-1]]
    last_out = outs[-1]
    for n in head:
        env[n] = _copy(graph, n, lambda a: out if a is last_out else env[a])
    with _use_lazy_graph_module(True):
        gm = _make_graph_module(traced, graph, type(traced).__name__)
    return gm, new_spans


class _NoReplay(Exception):
    """A copied layer would read another layer's weight or cache (`replay` then
    returns None)."""

