"""Small graph helpers shared by passes and checks (no pass logic here)."""

from __future__ import annotations

import operator
from typing import Callable, Iterable

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx._lazy_graph_module import _LazyGraphModule

aten = torch.ops.aten


def is_op(node: Node, *targets) -> bool:
    """Whether `node` calls one of `targets` (OpOverloads, OpOverloadPackets or callables)."""
    if node.op != "call_function":
        return False
    for t in targets:
        if node.target is t:
            return True
        packet = getattr(node.target, "overloadpacket", None)
        if packet is not None and packet is t:
            return True
    return False


def find_nodes(graph: Graph | GraphModule, *targets) -> list[Node]:
    """All call_function nodes calling one of `targets`, in graph order."""
    g = graph.graph if isinstance(graph, GraphModule) else graph
    return [n for n in g.nodes if is_op(n, *targets)]


def users_of(node: Node, *targets) -> list[Node]:
    """Users of `node` that call one of `targets` (all users when none given)."""
    return [u for u in node.users if not targets or is_op(u, *targets)]


def getitem_users(node: Node) -> dict[int, Node]:
    """index -> the `operator.getitem` user that takes output `index` of a multi-output node."""
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


def op_name(node: Node) -> str:
    """A short name for a node's target: `aten.mm`, `flintc.rms_norm`, `getitem`."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return f"{t._qualified_op_name.replace('::', '.')}"
    if callable(t):
        return getattr(t, "__name__", str(t))
    return str(t)


def namespace(node: Node) -> str | None:
    """`aten`, `flintc`, ... for an op node; None for placeholders, getitem and output."""
    t = node.target
    return t.namespace if isinstance(t, torch._ops.OpOverload) else None


def val(node: Node):
    """The node's FakeTensor (or tuple of them) from `meta["val"]`, or None."""
    return node.meta.get("val")


def layer_of(node: Node) -> int | None:
    return node.meta.get("flintc_layer")


def placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def placeholder(gm: GraphModule, name: str) -> Node:
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name == name:
            return n
    raise KeyError(f"no placeholder named {name!r}")


def topo_filter(graph: Graph, pred: Callable[[Node], bool]) -> Iterable[Node]:
    return (n for n in graph.nodes if pred(n))


def clone_graph_module(gm: GraphModule) -> GraphModule:
    """A structural copy of `gm` (new Graph and Nodes, shared attributes and meta
    values), cheap enough to keep the graph from before a pass. Its Python code is
    generated when it is first called (a lazy GraphModule): most copies are never run."""
    new_graph = Graph()
    env: dict[Node, Node] = {}
    new_graph.output(new_graph.graph_copy(gm.graph, env))
    return _LazyGraphModule(gm, new_graph)
