"""MoEFusionPass: each MoE block becomes three fused ops, `flintc.moe_route`,
`flintc.moe_gate_up` and `flintc.moe_down_combine`.

Why: the captured MoE block is some 90 aten ops (bf16) or 350 (NVFP4, where every
expert weight is dequantized inline): router matmul, sigmoid, bias add, a stable
sort, the top-k slice, a gather and the normalisation; three gathered expert
matmuls per token with SiLU-and-mul between them; the shared expert's three
linears; the fp32 combine. FLINT_SPEC section 5 schedules it as routing plus two
GEMV kernels over the selected and shared experts only.

How: one search pattern per graph shape, traced with `make_fx` from the reference
functions `MoE.forward` composes (`route_topk`, `routed_experts`, the shared
DenseMLP's `linear`s and `silu_mul`, `expert_combine`), replaced with
torch.fx's subgraph rewriter (`flintc.graph.rewrite.replace_pattern`). Its
views and expands carry literal shapes ([N*K, F, H], ...), so it is traced at
the step's N = batch * tokens with the layer's own weight shapes and formats,
read from its placeholders: a bf16 weight is one placeholder, an NVFP4 one is
three (codes, scales, global scale) and its dequantization is part of the
pattern. One pattern matches every MoE layer; a guard keeps each match inside one
layer and reading that layer's weights.

Cases: decode and prefill, any batch; bf16 and NVFP4 weights; with or without a
shared expert; SiLU-and-mul still as aten ops or already `flintc.silu_mul`
(`fuse_silu_mul`), read per layer from the graph; a graph with or without the
`canonicalize` pass applied (the pattern is put through the same pass). Bit-exact:
the fused ops run the same reference functions.

Before / after (decode, B=2, tiny: H=128, E=16, K=6, F=64; bf16 weights):

    mm_18 = aten.mm(_to_copy_119, permute_30)               [2, 16] f32  router logits
    sigmoid_2 = aten.sigmoid(mm_18)
    add_21 = aten.add(sigmoid_2, w_layers_2_mlp_gate_e_score_correction_bias)
    sort = aten.sort.stable(add_21, descending=True)
    slice_12 = aten.slice(getitem_1, 1, 0, 6)               [2, 6] i64   selected
    gather = aten.gather(sigmoid_2, 1, slice_12)             ... weights [2, 6] f32
    index_9 = aten.index(w_layers_2_mlp_experts_gate_proj, [slice_12])  [2, 6, 64, 128]
    bmm_6 = aten.bmm(view_38, _unsafe_view_12)               ... x3 experts, x3 shared
    _to_copy_147 = aten._to_copy(add_22, dtype=bf16)        [2, 128] bf16
  ->
    moe_route = flintc.moe_route(x, w_..._mlp_gate, w_..._bias, 6, 2.5)
    getitem = moe_route[0]                                   [2, 6] f32 weights
    getitem_1 = moe_route[1]                                 [2, 6] i64 ids (moe_selected)
    moe_gate_up = flintc.moe_gate_up(x, getitem_1, [gate], [up], [sh_gate], [sh_up])
                                                             [2, 7, 64] bf16
    moe_down_combine = flintc.moe_down_combine(moe_gate_up, getitem_1, getitem,
                                               [down], [sh_down])  [2, 128] bf16
"""

from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.match import clone_graph_module, find_nodes, is_op
from flintc.graph.rewrite import refresh_meta, replace_pattern, trace_pattern
from flintc.model import ops
from flintc.ops.common import CDT, as_weight
from flintc.passes.base import GraphPass, PassContext, PassResult, PassVerifyError

aten = torch.ops.aten
fused = torch.ops.flintc

# Role -> placeholder stem after `w_layers_<i>_mlp_` (flintc.graph.trace naming).
ROUTER_STEMS = {"router": "gate", "bias": "gate_e_score_correction_bias"}
EXPERT_STEMS = {"gate": "experts_gate_proj", "up": "experts_up_proj", "down": "experts_down_proj"}
SHARED_STEMS = {"shared_gate": "shared_experts_gate_proj", "shared_up": "shared_experts_up_proj",
                "shared_down": "shared_experts_down_proj"}
NVFP4_PARTS = ("codes", "scales", "global_scale")


@dataclass
class MoEPattern:
    """One MoE block at one shape: `search` and `replace` take the same flat inputs
    (x, router, bias, then each expert weight's parts), `example_inputs` to trace
    them with, `check` the guard every match must pass. `sizes` gives the number of
    parts of each weight in `roles` order (1 bf16, 3 NVFP4)."""

    roles: tuple[str, ...]
    sizes: tuple[int, ...]
    example_inputs: tuple[torch.Tensor, ...]
    top_k: int
    scaling: float
    check: Callable[..., bool]

    def _weights(self, args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, list]]:
        x, router, bias, rest = args[0], args[1], args[2], list(args[3:])
        parts = {}
        for role, size in zip(self.roles, self.sizes):
            parts[role], rest = rest[:size], rest[size:]
        return x, router, bias, parts

    def search(self, *args):
        """What `MoE.forward` emits, from the reference functions."""
        x, router, bias, parts = self._weights(args)
        w = {role: as_weight(p) for role, p in parts.items()}
        weights, selected = ops.route_topk(x, router, bias, self.top_k, self.scaling, CDT)  # [N, K]
        y = ops.routed_experts(x, w["gate"], w["up"], w["down"], selected, CDT)  # [N, K, H]
        shared = None
        if "shared_gate" in w:  # DenseMLP.forward
            g = ops.linear(x, w["shared_gate"], CDT)  # [N, F]
            u = ops.linear(x, w["shared_up"], CDT)
            shared = ops.linear(ops.silu_mul(g, u, CDT), w["shared_down"], CDT)  # [N, H]
        return ops.expert_combine(y, weights, shared, CDT)  # [N, H]

    def replace(self, *args):
        x, router, bias, parts = self._weights(args)
        weights, ids = fused.moe_route(x, router, bias, self.top_k, self.scaling)
        h = fused.moe_gate_up(x, ids, parts["gate"], parts["up"], parts.get("shared_gate", []),
                              parts.get("shared_up", []))  # [N, K(+1), F]
        return fused.moe_down_combine(h, ids, weights, parts["down"], parts.get("shared_down", []))


class MoEFusionPass(GraphPass):
    name = "fuse_moe"
    stage = "fused"

    def run(self, gm: GraphModule) -> PassResult:
        layers = [i for i in range(self.ctx.config.num_hidden_layers) if self.ctx.config.is_moe_layer(i)]
        if not layers or not find_nodes(gm, aten.sort):
            return PassResult(notes=["no unfused MoE block"])
        _drop_unused_sort_values(gm)
        pattern = _pattern_for(gm, self.ctx, layers[0])
        replacement = trace_pattern(pattern.replace, pattern.example_inputs)
        result, new_nodes = PassResult(), set()
        for label, search in self._search_forms(gm, pattern, layers):
            done = replace_pattern(gm, search, replacement, match_filters=[pattern.check])
            for m in done:
                _tag(m)
                new_nodes.update(m.replacements)
            if done:
                result.matches += len(done)
                result.notes.append(f"{len(done)} MoE block(s) matched the {label} pattern")
            if not _unfused_layers(gm, layers):
                break
        _propagate_meta(gm, new_nodes)
        left = _unfused_layers(gm, layers)
        if left:
            result.notes.append(f"MoE layers left unfused: {left}")
        return result

    def _search_forms(self, gm: GraphModule, pattern: MoEPattern, layers: list[int]):
        """(label, search graph) pairs to try in turn: the traced pattern and, when the
        `canonicalize` pass exists, the pattern as it leaves it; each with SiLU-and-mul
        fused where the graph's layers have it fused (`fuse_silu_mul`)."""
        traced = trace_pattern(pattern.search, pattern.example_inputs)
        traced.graph.eliminate_dead_code()  # the sort's unused values (the matcher rejects dead code)
        traced.recompile()
        forms = [("traced", traced)]
        canonical = _canonicalized(traced, self.ctx)
        if canonical is not None:
            forms.append(("canonical", canonical))
        silu_forms = sorted({_silu_form(gm, i) for i in layers}, reverse=True)
        for label, form in forms:
            for routed, shared in silu_forms:
                if not (routed or shared):
                    yield label, form
                    continue
                yield f"{label}+silu_mul", _fuse_silu_mul(form, routed, shared)

    def verify(self, gm: GraphModule) -> None:
        c = self.ctx.config
        layers = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
        left = find_nodes(gm, aten.sort) + [n for n in find_nodes(gm, aten.index) if _is_expert_weight(n.args[0])]
        if left:
            raise PassVerifyError(f"{self.name}: unfused MoE routing or expert gather left at {left[0].name} "
                                  f"(layer {left[0].meta.get('flintc_layer')})")
        for op in (fused.moe_route, fused.moe_gate_up, fused.moe_down_combine):
            found = sorted(n.meta.get("flintc_layer") for n in find_nodes(gm, op))
            if found != layers:
                raise PassVerifyError(f"{self.name}: expected one {op._qualified_op_name} in each MoE "
                                      f"layer {layers}, found it in layers {found}")
        for route in find_nodes(gm, fused.moe_route):
            ids = [u for u in route.users if u.target is operator.getitem and u.args[1] == 1]
            if len(ids) != 1 or ids[0].meta.get("flintc_role") != "moe_selected":
                raise PassVerifyError(f"{self.name}: the expert ids of {route.name} are not tagged "
                                      f"flintc_role='moe_selected'")


def _pattern_for(gm: GraphModule, ctx: PassContext, layer: int) -> MoEPattern:
    """The MoE pattern at this graph's shapes: N = batch * tokens tokens, the weight
    shapes, dtypes and formats of `layer`'s placeholders (all MoE layers share them)."""
    c = ctx.config
    inputs = _weight_inputs(gm, layer, c.n_shared_experts > 0)
    roles = tuple(r for r in inputs if r not in ROUTER_STEMS)
    router, bias = inputs["router"], inputs["bias"]
    if len(router) != 1:
        raise PassVerifyError("fuse_moe: the router weight must be one bf16 tensor (FLINT_SPEC 4)")
    device = router[0].meta["val"].device
    x = torch.empty(ctx.batch * ctx.tokens, c.hidden_size, dtype=torch.bfloat16, device=device)
    flat = [x] + [_like(n) for n in router + bias] + [_like(n) for r in roles for n in inputs[r]]

    def check(match, original: Graph, pattern: Graph) -> bool:
        """All matched ops in one MoE layer, every weight input a placeholder of it."""
        ops_layers = {gn.meta.get("flintc_layer") for pn, gn in match.nodes_map.items()
                      if pn.op not in ("placeholder", "output")}
        if len(ops_layers) != 1:
            return False
        i = ops_layers.pop()
        prefix = f"w_layers_{i}_mlp_"
        weights = match.placeholder_nodes[1:]
        return (i is not None and c.is_moe_layer(i)
                and all(isinstance(w, Node) and w.op == "placeholder" and w.name.startswith(prefix)
                        for w in weights))

    return MoEPattern(roles, tuple(len(inputs[r]) for r in roles), tuple(flat), c.num_experts_per_tok,
                      c.routed_scaling_factor, check)


def _weight_inputs(gm: GraphModule, layer: int, has_shared: bool) -> dict[str, list[Node]]:
    """Role -> the placeholder(s) of one weight of `layer`'s MoE block: `[w]` for a
    plain tensor, `[codes, scales, global_scale]` for NVFP4."""
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    stems = {**ROUTER_STEMS, **EXPERT_STEMS, **(SHARED_STEMS if has_shared else {})}
    out = {}
    for role, stem in stems.items():
        name = f"w_layers_{layer}_mlp_{stem}"
        if name in by_name:
            out[role] = [by_name[name]]
        elif f"{name}_codes" in by_name:
            out[role] = [by_name[f"{name}_{p}"] for p in NVFP4_PARTS]
        else:
            raise PassVerifyError(f"fuse_moe: no placeholder for {name} (layer {layer}'s {role} weight)")
    return out


def _like(node: Node) -> torch.Tensor:
    v = node.meta["val"]
    return torch.empty(v.shape, dtype=v.dtype, device=v.device)


def _drop_unused_sort_values(gm: GraphModule) -> None:
    """Erase the unused `getitem(sort, 0)` (the sorted values) left by capture: the
    subgraph matcher rejects a match whose inner node (the sort) has a user outside it."""
    for sort in find_nodes(gm, aten.sort):
        for user in list(sort.users):
            if user.target is operator.getitem and not user.users:
                gm.graph.erase_node(user)


def _canonicalized(pattern: GraphModule, ctx: PassContext) -> GraphModule | None:
    """The pattern after the `canonicalize` pass, if that pass exists and changes it.

    HACK: `canonicalize` is optional in the pipeline and may not exist yet; remove the
    lookup once it is always there (then canonicalize every pattern unconditionally)."""
    try:
        module = importlib.import_module("flintc.passes.canonicalize")
    except ImportError:
        return None
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, GraphPass) and c.name == "canonicalize"]
    if not classes:
        return None
    canonical = clone_graph_module(pattern)
    classes[0](ctx).run(canonical)
    canonical.recompile()
    return canonical if str(canonical.graph) != str(pattern.graph) else None


def _silu_form(gm: GraphModule, layer: int) -> tuple[bool, bool]:
    """(routed, shared): whether `layer`'s MoE block already has its routed-expert
    ([N, K, F]) or shared-expert ([N, F]) SiLU-and-mul as `flintc.silu_mul`."""
    ranks = {n.meta["val"].dim() for n in find_nodes(gm, fused.silu_mul) if n.meta.get("flintc_layer") == layer}
    return 3 in ranks, 2 in ranks


def _fuse_silu_mul(pattern: GraphModule, routed: bool, shared: bool) -> GraphModule:
    """A copy of `pattern` with the SiLU-and-mul of the routed experts (rank 3) and/or
    the shared expert (rank 2) rewritten as `flintc.silu_mul`, as `fuse_silu_mul` does."""
    out = clone_graph_module(pattern)
    g, u = torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(2, 8, dtype=torch.bfloat16)
    search = trace_pattern(lambda g, u: ops.silu_mul(g, u, CDT), (g, u))
    replace = trace_pattern(lambda g, u: fused.silu_mul(g, u), (g, u))
    ranks = {r for r, on in ((3, routed), (2, shared)) if on}

    def wanted(match, original, pattern_graph) -> bool:
        return match.returning_nodes[0].meta["val"].dim() in ranks

    replace_pattern(out, search, replace, match_filters=[wanted])
    refresh_meta(out)
    return out


def _tag(match) -> None:
    """The flintc tags on one replaced block: layer and block on every new node, the
    `moe_selected` role on the expert-ids getitem."""
    layer = next(gn.meta.get("flintc_layer") for pn, gn in match.nodes_map.items()
                 if pn.op not in ("placeholder", "output"))
    for node in match.replacements:
        node.meta["flintc_layer"], node.meta["flintc_block"] = layer, "moe"
        if node.target is operator.getitem and is_op(node.args[0], fused.moe_route) and node.args[1] == 1:
            node.meta["flintc_role"] = "moe_selected"


def _propagate_meta(gm: GraphModule, nodes: set[Node]) -> None:
    """`meta["val"]` of the new nodes, from their ops' fake implementations. Every other
    node keeps its shape and dtype, so this replaces a whole-graph `refresh_meta`
    (most of this pass's time on NVFP4 graphs)."""
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with placeholder.meta["val"].fake_mode:
        for node in gm.graph.nodes:
            if node in nodes:
                args, kwargs = map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)


def _unfused_layers(gm: GraphModule, layers: list[int]) -> list[int]:
    """MoE layers that still have an aten.sort (routing not yet fused)."""
    return sorted({n.meta.get("flintc_layer") for n in find_nodes(gm, aten.sort)} & set(layers))


def _is_expert_weight(node) -> bool:
    return isinstance(node, Node) and node.op == "placeholder" and "_mlp_experts_" in node.name
