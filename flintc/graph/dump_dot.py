"""Pictures of a flintc FX graph: networkx views, written as DOT and as SVG.

A whole graph has thousands of nodes, so the pictures are views: `layer_graph`
shows one decoder layer (its op nodes, its weight and cache placeholders, and a
dashed oval for every value it reads from or hands to the rest of the graph), and
`summary_graph` shows one box per layer with its kernel count. Views are
`networkx.DiGraph`s whose node and edge attributes are Graphviz attributes, so
`to_dot` exports them unchanged through pydot. `to_svg` draws the same view
without Graphviz: a small layered layout (longest-path ranks, a few barycenter
sweeps to order each rank) written as plain SVG, so no `dot` binary is needed;
the DOT file is there for anyone who wants Graphviz's nicer layout.

Styling: weight placeholders are yellow boxes, caches and step inputs green,
`flintc` ops orange (other custom namespaces pink), and nodes that launch no
kernel (`accounting.kernels_of == 0`: views, getitem) grey and dashed.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

import networkx as nx
import torch
from networkx.drawing import nx_pydot
from torch.fx import GraphModule, Node
from torch.fx.graph import dtype_abbrs

from flintc.config import FlintConfig
from flintc.graph.accounting import KernelCount, kernels_of
from flintc.graph.match import namespace, op_name
from flintc.graph.trace import activation_inputs

# Hex colours only: they mean the same in Graphviz and in SVG.
WEIGHT, INPUT, FLINTC, CUSTOM, OP = "#ffe9a8", "#d5e8d4", "#ff9f43", "#f7b6d2", "#dae8fc"
DIM, EDGE, DENSE_LAYER, MOE_LAYER = "#999999", "#555555", "#dae8fc", "#e1d5e7"

_GRAPH_ATTRS = {"rankdir": "TB", "nodesep": "0.2", "ranksep": "0.3"}
_NODE_ATTRS = {"fontname": "monospace", "fontsize": "10", "shape": "box"}


def layer_views(gm: GraphModule, config: FlintConfig) -> list[tuple[str, int]]:
    """(view name, layer) for the first dense and the first MoE layer present in `gm`,
    e.g. [("layer0-dense", 0), ("layer2-moe", 2)]."""
    present = {n.meta.get("flintc_layer") for n in gm.graph.nodes if n.op == "call_function"}
    views = []
    for kind in ("dense", "moe"):
        layers = [i for i in range(config.num_hidden_layers)
                  if i in present and config.is_moe_layer(i) == (kind == "moe")]
        if layers:
            views.append((f"layer{layers[0]}-{kind}", layers[0]))
    return views


def describe_value(val) -> str:
    """`bf16[2, 1, 128]` for a tensor; several joined by ", " for a tuple."""
    if isinstance(val, torch.Tensor):
        dims = ", ".join(str(d) for d in val.shape)
        return f"{dtype_abbrs.get(val.dtype, str(val.dtype))}[{dims}]"
    if isinstance(val, (tuple, list)):
        return ", ".join(describe_value(v) for v in val)
    return "" if val is None else type(val).__name__


def node_attrs(node: Node) -> dict[str, str]:
    """Graphviz attributes of one FX node (label and style, see the module doc)."""
    shape = describe_value(node.meta.get("val"))
    if node.op == "placeholder":
        is_weight = node.name not in activation_inputs("prefill") and "_cache_" not in node.name
        return {"label": f"{node.name}\n{shape}", "style": "filled",
                "fillcolor": WEIGHT if is_weight else INPUT}
    label = f"{node.name}\n{op_name(node)}\n{shape}"
    ns = namespace(node)
    if ns not in (None, "aten"):
        return {"label": label, "style": "rounded,filled", "penwidth": "2",
                "fillcolor": FLINTC if ns == "flintc" else CUSTOM}
    if kernels_of(node) == 0:
        return {"label": label, "style": "rounded,dashed", "color": DIM, "fontcolor": DIM}
    return {"label": label, "style": "rounded,filled", "fillcolor": OP}


def _new_graph(title: str) -> nx.DiGraph:
    g = nx.DiGraph()
    g.graph["graph"] = {**_GRAPH_ATTRS, "label": title, "labelloc": "t"}
    g.graph["node"] = dict(_NODE_ATTRS)
    g.graph["edge"] = {"color": EDGE, "arrowsize": "0.6"}
    return g


def layer_graph(gm: GraphModule, layer: int, title: str = "") -> nx.DiGraph:
    """The nodes of decoder layer `layer` (`meta["flintc_layer"]`), with a dashed oval
    per outside value the layer reads or outside node that reads the layer."""
    g = _new_graph(title or f"layer {layer}")
    inside = [n for n in gm.graph.nodes
              if n.op in ("placeholder", "call_function") and n.meta.get("flintc_layer") == layer]
    members = set(inside)
    for n in inside:
        g.add_node(n.name, **node_attrs(n))
    for n in inside:
        for src in n.all_input_nodes:
            if src not in members:
                _add_boundary(g, src, "from")
            g.add_edge(_id(src, members), n.name)
        for user in n.users:
            if user not in members:
                _add_boundary(g, user, "to")
                g.add_edge(n.name, _id(user, members))
    return g


def _id(node: Node, members: set) -> str:
    return node.name if node in members else f"ext_{node.name}"


def _add_boundary(g: nx.DiGraph, node: Node, direction: str) -> None:
    where = node.meta.get("flintc_layer")
    where = "shared" if where is None else f"layer {where}"
    label = "output" if node.op == "output" else f"{direction} {node.name}\n({where})"
    g.add_node(f"ext_{node.name}", label=label, shape="ellipse", style="dashed",
               color=DIM, fontcolor=DIM)


def summary_graph(config: FlintConfig, kernels: KernelCount, title: str = "") -> nx.DiGraph:
    """One box per layer (embedding, decoder layers, head) with its kernel count, in a
    chain, plus the launches that belong to no layer (masks, RoPE rows)."""
    L = config.num_hidden_layers
    g = _new_graph(title or f"{kernels.per_forward} kernels per forward")
    g.add_node("shared", label=f"shared (masks, RoPE rows)\n{_kernels(kernels.shared)}",
               style="dashed", color=DIM, fontcolor=DIM)
    prev = None
    for i in range(-1, L + 1):
        count = kernels.per_layer.get(i, 0)
        if i == -1:
            label, fill = "embedding", INPUT
        elif i == L:
            label, fill = "head (norm, lm_head)", INPUT
        else:
            moe = config.is_moe_layer(i)
            attn = "sliding" if config.is_sliding_layer(i) else "full"
            label = f"layer {i} {'moe' if moe else 'dense'} {attn}"
            fill = MOE_LAYER if moe else DENSE_LAYER
        name = f"layer{i}" if 0 <= i < L else ("embedding" if i < 0 else "head")
        g.add_node(name, label=f"{label}\n{_kernels(count)}", style="filled", fillcolor=fill)
        if prev is not None:
            g.add_edge(prev, name)
        prev = name
    if L:
        g.add_edge("shared", "layer0", style="dashed", color=DIM)
    return g


def _kernels(n: int) -> str:
    return f"{n} kernel{'' if n == 1 else 's'}"


def to_dot(g: nx.DiGraph) -> str:
    """The view as DOT source (through pydot; no Graphviz needed)."""
    return nx_pydot.to_pydot(g).to_string()


# ----------------------------------------------------------------------- SVG drawing
CHAR_W, LINE_H, PAD, GAP_X, GAP_Y, MARGIN = 6.6, 13.0, 5.0, 14.0, 26.0, 20.0


def to_svg(g: nx.DiGraph) -> str:
    """The view as a standalone SVG document, laid out in ranks top to bottom."""
    size = {v: _box_size(g.nodes[v].get("label", v)) for v in g}
    rows = _ranks(g)
    x = _order_and_place(g, rows, size)
    y, top = {}, MARGIN + (2 * LINE_H if _title(g) else 0)
    for row in rows:
        height = max(size[v][1] for v in row)
        for v in row:
            y[v] = top + height / 2
        top += height + GAP_Y
    left = min((x[v] - size[v][0] / 2 for v in g), default=0.0)
    for v in x:
        x[v] += MARGIN - left
    width = max([x[v] + size[v][0] / 2 for v in g] + [len(_title(g)) * 8.0]) + MARGIN
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
             f'height="{top + MARGIN:.0f}" font-family="monospace" font-size="11">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
             'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555555"/>'
             '</marker></defs>',
             '<rect width="100%" height="100%" fill="#ffffff"/>']
    if _title(g):
        parts.append(f'<text x="{MARGIN}" y="{MARGIN + LINE_H}" font-size="13">'
                     f'{escape(_title(g))}</text>')
    for u, v, attrs in g.edges(data=True):
        x0, y0, x1, y1 = x[u], y[u] + size[u][1] / 2, x[v], y[v] - size[v][1] / 2
        mid = (y0 + y1) / 2
        dash = ' stroke-dasharray="4,3"' if "dashed" in attrs.get("style", "") else ""
        curve = f"M{x0:.1f},{y0:.1f} C{x0:.1f},{mid:.1f} {x1:.1f},{mid:.1f} {x1:.1f},{y1:.1f}"
        parts.append(f'<path d="{curve}" fill="none" stroke="{attrs.get("color", EDGE)}"{dash} '
                     'marker-end="url(#arrow)"/>')
    for v in g:
        parts.append(_svg_node(v, g.nodes[v], x[v], y[v], size[v]))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _title(g: nx.DiGraph) -> str:
    return g.graph.get("graph", {}).get("label", "")


def _box_size(label: str) -> tuple[float, float]:
    lines = label.split("\n")
    return max(len(s) for s in lines) * CHAR_W + 2 * PAD, len(lines) * LINE_H + 2 * PAD


def _ranks(g: nx.DiGraph) -> list[list]:
    """Longest-path ranks, then every source, and every chain of one-input nodes
    hanging off a source, pulled down to just above its first reader (so a weight
    and its cast sit next to the matmul that reads them); rows in rank order."""
    order = list(nx.topological_sort(g))
    rank, movable = {}, {}
    for v in order:
        rank[v] = max((rank[u] + 1 for u in g.predecessors(v)), default=0)
        preds = list(g.predecessors(v))
        movable[v] = not preds or (len(preds) == 1 and movable[preds[0]])
    for v in reversed(order):  # readers first, so a whole chain follows its reader down
        if movable[v] and g.out_degree(v):
            rank[v] = min(rank[s] for s in g.successors(v)) - 1
    base = min(rank.values(), default=0)
    rows = [[] for _ in range(max(rank.values(), default=base) - base + 1)]
    for v in order:
        rows[rank[v] - base].append(v)
    return rows


def _order_and_place(g: nx.DiGraph, rows: list[list], size: dict, sweeps: int = 4) -> dict:
    """x centres: each rank ordered by the mean x of its neighbours (down sweeps use
    predecessors, up sweeps successors), then packed without overlaps."""
    x = {}
    for row in rows:
        _pack(row, {v: 0.0 for v in row}, size, x)
    for sweep in range(2 * sweeps):
        down = sweep % 2 == 0
        for row in (rows if down else reversed(rows)):
            want = {}
            for v in row:
                nbrs = list(g.predecessors(v) if down else g.successors(v))
                want[v] = sum(x[u] for u in nbrs) / len(nbrs) if nbrs else x[v]
            row.sort(key=lambda v: want[v])
            _pack(row, want, size, x)
    return x


def _pack(row: list, want: dict, size: dict, x: dict) -> None:
    """Place `row` left to right as near `want` as overlaps allow, then shift it so
    its mean displacement is zero."""
    right = float("-inf")
    for v in row:
        w = size[v][0]
        x[v] = max(want[v], right + GAP_X + w / 2)
        right = x[v] + w / 2
    shift = sum(want[v] - x[v] for v in row) / len(row) if row else 0.0
    for v in row:
        x[v] += shift


def _svg_node(name: str, attrs: dict, cx: float, cy: float, size: tuple[float, float]) -> str:
    w, h = size
    style = attrs.get("style", "")
    fill = attrs.get("fillcolor", "#ffffff") if "filled" in style else "#ffffff"
    stroke = attrs.get("color", "#333333")
    extra = ' stroke-dasharray="4,3"' if "dashed" in style else ""
    extra += f' stroke-width="{attrs.get("penwidth", "1")}"'
    if attrs.get("shape") == "ellipse":
        shape = f'<ellipse cx="{cx:.1f}" cy="{cy:.1f}" rx="{w / 2 + 4:.1f}" ry="{h / 2 + 2:.1f}"'
    else:
        rx = 6 if "rounded" in style else 0
        shape = (f'<rect x="{cx - w / 2:.1f}" y="{cy - h / 2:.1f}" width="{w:.1f}" '
                 f'height="{h:.1f}" rx="{rx}"')
    lines = attrs.get("label", name).split("\n")
    y0 = cy - h / 2 + PAD + LINE_H * 0.8
    spans = "".join(f'<tspan x="{cx:.1f}" y="{y0 + k * LINE_H:.1f}">{escape(s)}</tspan>'
                    for k, s in enumerate(lines))
    return (f'<g><title>{escape(name)}</title>{shape} fill="{fill}" stroke="{stroke}"{extra}/>'
            f'<text text-anchor="middle" fill="{attrs.get("fontcolor", "#000000")}">{spans}'
            '</text></g>')
