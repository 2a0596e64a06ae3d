"""MoEFusionPass: each MoE block becomes three fused ops, `flintc.moe_route`,
`flintc.moe_gate_up` and `flintc.moe_down_combine`.

Why: the captured MoE block is some 90 aten ops with bf16 weights and 350 with
NVFP4 ones (each expert weight is dequantized inline): router matmul, sigmoid,
bias add, a stable sort, the top-k slice, a gather and the normalisation; three
gathered expert matmuls per token with SiLU-and-mul between them; the shared
expert's three linears; the fp32 combine. FLINT_SPEC section 5 runs it as routing
plus two GEMV kernels over the selected and shared experts only.

How: one search pattern, traced with `make_fx` from the reference functions that
`MoE.forward` composes (`route_topk`, `routed_experts`, the shared DenseMLP's
`linear`s and `silu_mul`, `expert_combine`), replaced by torch.fx's subgraph
rewriter (`flintc.graph.rewrite.replace_pattern`). The pattern's views and expands
hold literal shapes ([N*K, F, H], ...), so it is traced at the step's N = batch *
tokens with the weight shapes, dtypes and formats of the first MoE layer's
placeholders: a bf16 weight is one placeholder, an NVFP4 weight three (codes,
scales, global scale), and its dequantization is part of the pattern. The same
pattern matches every MoE layer; a guard keeps each match inside one layer,
reading that layer's weights.

Cases: decode and prefill at any batch; bf16 and NVFP4 weights; with or without
a shared expert; SiLU-and-mul still as aten ops or already `flintc.silu_mul`
(`fuse_silu_mul`, read per layer and per site from the graph); with or without
`canonicalize` before it (the pattern also goes through that pass). Bit-exact:
the fused ops run the same reference functions.

Before / after (decode, B=2, tiny: H=128, E=16, K=6, F=64; bf16 weights):

    mm_18 = aten.mm(_to_copy_119, permute_30)                 [2, 16] f32 logits
    sigmoid_2 = aten.sigmoid(mm_18)
    add_21 = aten.add(sigmoid_2, w_layers_2_mlp_gate_e_score_correction_bias)
    sort = aten.sort.stable(add_21, stable=True, descending=True)
    slice_12 = aten.slice(getitem_1, 1, 0, 6)                 [2, 6] i64 selected
    gather = aten.gather(sigmoid_2, 1, slice_12)   ... mul_47 [2, 6] f32 weights
    index_9 = aten.index(w_layers_2_mlp_experts_gate_proj, [slice_12])  [2, 6, 64, 128]
    bmm_6 = aten.bmm(view_38, _unsafe_view_12)     ... 3 expert, 3 shared matmuls
    _to_copy_147 = aten._to_copy(add_22, dtype=bf16)          [2, 128] bf16
  ->
    moe_route = flintc.moe_route(view_37, w_layers_2_mlp_gate, w_..._bias, 6, 2.5)
    getitem = moe_route[0]                                    [2, 6] f32 weights
    getitem_1 = moe_route[1]                                  [2, 6] i64 (moe_selected)
    moe_gate_up = flintc.moe_gate_up(view_37, getitem_1, [gate], [up], [sh_gate], [sh_up])
                                                              [2, 7, 64] bf16
    moe_down_combine = flintc.moe_down_combine(moe_gate_up, getitem_1, getitem,
                                               [down], [sh_down])  [2, 128] bf16
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.config import FlintConfig
from flintc.graph.match import clone_graph_module, find_nodes, is_op
from flintc.graph.rewrite import fake_mode_section, refresh_meta, replace_pattern, trace_pattern
from flintc.model import ops
from flintc.ops.common import CDT, as_weight
from flintc.passes.base import GraphPass, PassContext, PassResult, PassVerifyError
from flintc.passes.patterns import pattern_forms

aten = torch.ops.aten
fused = torch.ops.flintc

# Role -> placeholder name after `w_layers_<i>_mlp_` (flintc.graph.trace's naming).
ROUTER_STEMS = {"router": "gate", "bias": "gate_e_score_correction_bias"}
EXPERT_STEMS = {"gate": "experts_gate_proj", "up": "experts_up_proj", "down": "experts_down_proj"}
SHARED_STEMS = {"shared_gate": "shared_experts_gate_proj", "shared_up": "shared_experts_up_proj",
                "shared_down": "shared_experts_down_proj"}
NVFP4_PARTS = ("codes", "scales", "global_scale")


@dataclass
class MoEPattern:
    """The MoE block at one graph's shapes. `search` and `replace` take the same flat
    inputs: x [N, H], router, bias, then the parts of each weight in `roles` order
    (`sizes`: 1 for bf16, 3 for NVFP4); `example_inputs` trace both; `check` guards
    every match."""

    config: FlintConfig
    roles: tuple[str, ...]
    sizes: tuple[int, ...]
    example_inputs: tuple[torch.Tensor, ...]

    @classmethod
    def from_graph(cls, gm: GraphModule, ctx: PassContext, layer: int) -> "MoEPattern":
        """Shapes from the step (N = batch * tokens) and from `layer`'s weight
        placeholders (every MoE layer has the same)."""
        c = ctx.config
        inputs = _weight_inputs(gm, layer, c.n_shared_experts > 0)
        if len(inputs["router"]) != 1:
            raise PassVerifyError("fuse_moe: the router weight must be one bf16 tensor "
                                  "(FLINT_SPEC 4)")
        device = inputs["router"][0].meta["val"].device
        x = torch.empty(ctx.batch * ctx.tokens, c.hidden_size, dtype=torch.bfloat16, device=device)
        roles = tuple(r for r in inputs if r not in ROUTER_STEMS)
        flat = [x] + [_empty_like(n) for r in ("router", "bias", *roles) for n in inputs[r]]
        return cls(c, roles, tuple(len(inputs[r]) for r in roles), tuple(flat))

    def _unflatten(self, args):
        x, router, bias, rest = args[0], args[1], args[2], list(args[3:])
        parts = {}
        for role, size in zip(self.roles, self.sizes):
            parts[role], rest = rest[:size], rest[size:]
        return x, router, bias, parts

    def search(self, *args):
        """What `MoE.forward` emits, from the reference functions."""
        c = self.config
        x, router, bias, parts = self._unflatten(args)
        w = {role: as_weight(p) for role, p in parts.items()}
        weights, selected = ops.route_topk(x, router, bias, c.num_experts_per_tok,
                                           c.routed_scaling_factor, CDT)  # [N, K] each
        y = ops.routed_experts(x, w["gate"], w["up"], w["down"], selected, CDT)  # [N, K, H]
        shared = None
        if "shared_gate" in w:  # DenseMLP.forward
            g = ops.linear(x, w["shared_gate"], CDT)  # [N, F]
            u = ops.linear(x, w["shared_up"], CDT)
            shared = ops.linear(ops.silu_mul(g, u, CDT), w["shared_down"], CDT)  # [N, H]
        return ops.expert_combine(y, weights, shared, CDT)  # [N, H]

    def replace(self, *args):
        c = self.config
        x, router, bias, parts = self._unflatten(args)
        weights, ids = fused.moe_route(x, router, bias, c.num_experts_per_tok,
                                       c.routed_scaling_factor)  # [N, K] each
        h = fused.moe_gate_up(x, ids, parts["gate"], parts["up"], parts.get("shared_gate", []),
                              parts.get("shared_up", []))  # [N, K(+1), F]
        return fused.moe_down_combine(h, ids, weights, parts["down"], parts.get("shared_down", []))

    def check(self, match, original_graph, pattern_graph) -> bool:
        """Every matched op in one MoE layer; every weight input a placeholder of it."""
        layers = {gn.meta.get("flintc_layer") for pn, gn in match.nodes_map.items()
                  if pn.op not in ("placeholder", "output")}
        layer = layers.pop() if len(layers) == 1 else None
        if layer is None or not self.config.is_moe_layer(layer):
            return False
        prefix = f"w_layers_{layer}_mlp_"
        return all(isinstance(w, Node) and w.op == "placeholder" and w.name.startswith(prefix)
                   for w in match.placeholder_nodes[1:])


class MoEFusionPass(GraphPass):
    name = "fuse_moe"
    stage = "fused"

    def run(self, gm: GraphModule) -> PassResult:
        layers = _moe_layers(self.ctx.config)
        if not _unfused_layers(gm, layers):
            return PassResult(notes=["no unfused MoE block"])
        _drop_unused_sort_values(gm)
        pattern = MoEPattern.from_graph(gm, self.ctx, layers[0])
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
        """(label, search graph) to try in turn, made lazily: the traced pattern, then
        the pattern after `canonicalize` if that pass changes it; each with SiLU-and-mul
        fused at the sites where the graph has it fused."""
        silu_forms = sorted(_silu_forms(gm, layers), reverse=True)

        def with_silu_forms(label: str, form: GraphModule):
            for routed, shared in silu_forms:
                if routed or shared:
                    yield f"{label}+silu_mul", _fuse_silu_mul(form, routed, shared)
                else:
                    yield label, form

        traced = trace_pattern(pattern.search, pattern.example_inputs)
        traced.graph.eliminate_dead_code()  # unused sort values; the matcher refuses dead code
        traced.recompile()
        forms = pattern_forms(traced, self.ctx)
        yield from with_silu_forms("traced", forms[0])
        if len(forms) > 1:
            yield from with_silu_forms("canonical", forms[1])

    def verify(self, gm: GraphModule) -> None:
        layers = _moe_layers(self.ctx.config)
        left = find_nodes(gm, aten.sort, aten.gather) + [
            n for n in find_nodes(gm, aten.index) if _is_expert_weight(n.args[0])]
        if left:
            raise PassVerifyError(f"{self.name}: unfused MoE routing or expert gather left at "
                                  f"{left[0].name} (layer {left[0].meta.get('flintc_layer')})")
        for op in (fused.moe_route, fused.moe_gate_up, fused.moe_down_combine):
            found = sorted(n.meta.get("flintc_layer") for n in find_nodes(gm, op))
            if found != layers:
                raise PassVerifyError(f"{self.name}: expected one {op._qualified_op_name} in each "
                                      f"MoE layer {layers}, found it in layers {found}")
        for route in find_nodes(gm, fused.moe_route):
            ids = [u for u in route.users if u.target is operator.getitem and u.args[1] == 1]
            if len(ids) != 1 or ids[0].meta.get("flintc_role") != "moe_selected":
                raise PassVerifyError(f"{self.name}: the expert ids of {route.name} are not "
                                      f"one getitem tagged flintc_role='moe_selected'")


def _moe_layers(config: FlintConfig) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def _unfused_layers(gm: GraphModule, layers: list[int]) -> list[int]:
    """MoE layers whose routing is still aten ops (an aten.sort)."""
    return sorted({n.meta.get("flintc_layer") for n in find_nodes(gm, aten.sort)} & set(layers))


def _weight_inputs(gm: GraphModule, layer: int, has_shared: bool) -> dict[str, list[Node]]:
    """Role -> the placeholders of one weight of `layer`'s MoE block: `[w]` for a
    plain tensor, `[codes, scales, global_scale]` for NVFP4."""
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    stems = {**ROUTER_STEMS, **EXPERT_STEMS, **(SHARED_STEMS if has_shared else {})}
    out = {}
    for role, stem in stems.items():
        name = f"w_layers_{layer}_mlp_{stem}"
        if name in by_name:
            out[role] = [by_name[name]]
        elif f"{name}_codes" in by_name:
            out[role] = [by_name[f"{name}_{part}"] for part in NVFP4_PARTS]
        else:
            raise PassVerifyError(f"fuse_moe: no placeholder {name} "
                                  f"(layer {layer}'s {role} weight)")
    return out


def _empty_like(node: Node) -> torch.Tensor:
    v = node.meta["val"]
    return torch.empty(v.shape, dtype=v.dtype, device=v.device)


def _is_expert_weight(node) -> bool:
    return isinstance(node, Node) and node.op == "placeholder" and "_mlp_experts_" in node.name


def _drop_unused_sort_values(gm: GraphModule) -> None:
    """Erase the sorted values' `getitem(sort, 0)`, which capture leaves with no user:
    the subgraph matcher refuses a match whose inner node (the sort) has a user
    outside it. (`canonicalize` also drops it, with all dead nodes.)"""
    for sort in find_nodes(gm, aten.sort):
        for user in list(sort.users):
            if user.target is operator.getitem and not user.users:
                gm.graph.erase_node(user)


def _silu_forms(gm: GraphModule, layers: list[int]) -> set[tuple[bool, bool]]:
    """The (routed, shared) pairs of `layers`: whether a layer's routed-expert
    ([N, K, F]) and shared-expert ([N, F]) SiLU-and-mul are already `flintc.silu_mul`
    (one walk over the graph for all layers)."""
    ranks: dict[int, set[int]] = {}
    for n in find_nodes(gm, fused.silu_mul):
        ranks.setdefault(n.meta.get("flintc_layer"), set()).add(n.meta["val"].dim())
    return {(3 in ranks.get(i, ()), 2 in ranks.get(i, ())) for i in layers}


def _fuse_silu_mul(pattern: GraphModule, routed: bool, shared: bool) -> GraphModule:
    """A copy of `pattern` with the routed experts' (rank 3) and/or the shared
    expert's (rank 2) SiLU-and-mul as `flintc.silu_mul`, as `fuse_silu_mul` leaves it."""
    out = clone_graph_module(pattern)
    examples = (torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(2, 8, dtype=torch.bfloat16))
    search = trace_pattern(lambda g, u: ops.silu_mul(g, u, CDT), examples)
    replace = trace_pattern(lambda g, u: fused.silu_mul(g, u), examples)
    ranks = {rank for rank, on in ((3, routed), (2, shared)) if on}

    def at_wanted_site(match, original_graph, pattern_graph) -> bool:
        return match.returning_nodes[0].meta["val"].dim() in ranks

    replace_pattern(out, search, replace, match_filters=[at_wanted_site])
    refresh_meta(out)
    return out


def _tag(match) -> None:
    """Layer and block on every node of one replaced block; the `moe_selected` role
    on the expert ids' getitem (the manager compares selections through it)."""
    layer = next(gn.meta.get("flintc_layer") for pn, gn in match.nodes_map.items()
                 if pn.op not in ("placeholder", "output"))
    for node in match.replacements:
        node.meta["flintc_layer"], node.meta["flintc_block"] = layer, "moe"
        is_ids = node.target is operator.getitem and node.args[1] == 1
        if is_ids and is_op(node.args[0], fused.moe_route):
            node.meta["flintc_role"] = "moe_selected"


def _propagate_meta(gm: GraphModule, nodes: set[Node]) -> None:
    """`meta["val"]` of the new nodes, from their ops' fake implementations. All other
    nodes keep their shapes, so this stands in for a whole-graph `refresh_meta`, which
    would be most of this pass's time on NVFP4 graphs."""
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with fake_mode_section(), placeholder.meta["val"].fake_mode:
        for node in gm.graph.nodes:
            if node in nodes:
                args, kwargs = map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)
