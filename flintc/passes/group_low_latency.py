"""LowLatencyGroupingPass: fold neighbours into the GEMVs so that a decode step runs
7 kernels per MoE layer and 6 per dense layer (FLINT_SPEC section 5's split).

Why: at batch <= 8 every kernel is short and launch gaps dominate; an RMSNorm, a
residual add or a top-k is cheap to recompute or apply inside the GEMV next to it.
It runs last, on a graph where every op is already a flintc op (plus the aten
residual adds and the RoPE row gathers it folds here):

    K1 norm_qkv_rope_kv   <- rms_norm, gemv q/k/v, qk_norm_rope_kv_write (+ cos/sin rows)
    K2 decode_attention   (unchanged; with the option `fold_attention_combine`:
    K3 attention_combine   decode_attention_combine <- decode_attention + attention_combine,
                           one kernel whose last program per KV head merges the splits)
    K4 gemv_residual      <- gemv (o_proj) + residual add
    MoE:   K5 norm_router <- rms_norm + the router GEMV of moe_route
           K6 moe_topk_gate_up <- top-k of moe_route + moe_gate_up (given K7's down
              weights: the kernel prefetches the selected experts' rows into L2)
           K7 moe_down_combine_residual <- moe_down_combine + residual add
    dense: K5 norm_gate_up_silu <- rms_norm, gemv gate/up, silu_mul
           K6 gemv_residual     <- gemv (down) + residual add
    head:  rms_norm, lm_head   (the option `split_lm_head_norm`, default True: the
                           standalone rms_norm kernel then the plain lm_head; False:
                           norm_lm_head <- rms_norm + lm_head, 1 kernel instead of 2)

The matching walks from each anchor flintc op through its (view) inputs and checks
every producer has no other user; it only ever sees flintc ops, whose signatures
flintc defines. The residual adds are found with torch's SubgraphMatcher on the
pattern of `flintc.model.ops.residual_add`. Bit-exact: each grouped op's reference
implementation composes the same functions as the ops it replaces.

Before / after (MoE layer, decode B=2):

    rms_norm_9 = flintc.rms_norm(add_x, w_..._post_attention_layernorm, 1e-05)
    view_37 = aten.view(rms_norm_9, [2, 128])
    moe_route = flintc.moe_route(view_37, w_..._mlp_gate, w_..._bias, 6, 2.5)
    moe_gate_up = flintc.moe_gate_up(view_37, ids, [gate], [up], [sg], [su])
    moe_down_combine = flintc.moe_down_combine(moe_gate_up, ids, weights, [down], [sd])
    + residual add (4 aten ops)
  ->
    norm_router = flintc.norm_router(add_x, w_..._post_attention_layernorm, w_..._mlp_gate, 1e-05)
    moe_topk_gate_up = flintc.moe_topk_gate_up(xn, logits, w_..._bias, [gate], [up], [sg], [su], 6, 2.5, [down])
    moe_down_combine_residual = flintc.moe_down_combine_residual(h, ids, weights, [down], [sd], add_x)
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.match import getitem_users, is_op
from flintc.graph.rewrite import refresh_meta, trace_pattern
from flintc.model import ops
from flintc.passes.base import GraphPass, PassResult, PassVerifyError

# The option `split_lm_head_norm`'s default: the final RMSNorm a kernel of its own (the
# prefill's `rms_norm`, with PDL) before the plain LM head, not the fused `norm_lm_head`.
# Measured (docs/gpu-runs.md): on an H200 alone 8-29 us per decode step less (session 46);
# in the NVFP4 model on an H100 level at b1 (1.69 ms), 3.22 -> 3.20 ms at b8, the head
# 207 -> 200 us (session 47). {"split_lm_head_norm": False} keeps the fused kernel.
SPLIT_LM_HEAD_NORM = True

aten = torch.ops.aten
F = torch.ops.flintc
FREE_VIEWS = (aten.view, aten._unsafe_view, aten.reshape)


def _through_views(node: Node) -> Node:
    """The producer behind a chain of views."""
    while is_op(node, *FREE_VIEWS):
        node = node.args[0]
    return node


def _new(gm: GraphModule, before: Node, target, args, like: Node) -> Node:
    """Insert `target(*args)` before `before`, with `like`'s flintc tags."""
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(target, tuple(args))
    for tag in ("flintc_layer", "flintc_block"):
        if tag in like.meta:
            node.meta[tag] = like.meta[tag]
    return node


def _getitem(gm, before, node, i, like):
    return _new(gm, before, operator.getitem, (node, i), like)


class LowLatencyGroupingPass(GraphPass):
    name = "group_low_latency"
    stage = "lowered"
    steps = ("decode",)

    def run(self, gm: GraphModule) -> PassResult:
        eps = self.ctx.config.rms_norm_eps
        n = self._fold_residual_adds(gm)
        n += self._group_qkv(gm, eps)
        n += self._group_moe(gm, eps)
        n += self._group_dense_mlp(gm, eps)
        if not self.ctx.options.get("split_lm_head_norm", SPLIT_LM_HEAD_NORM):
            n += self._group_head(gm, eps)
        if self.ctx.options.get("fold_attention_combine"):
            n += self._fold_attention_combine(gm)
        gm.graph.eliminate_dead_code()
        refresh_meta(gm)
        return PassResult(matches=n)

    def verify(self, gm: GraphModule) -> None:
        counts = {}
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.meta.get("flintc_layer") is not None:
                layer = node.meta["flintc_layer"]
                if 0 <= layer < self.ctx.config.num_hidden_layers and node.target is not operator.getitem \
                        and getattr(node.target, "namespace", None) == "flintc":
                    counts[layer] = counts.get(layer, 0) + 1
        cfg = self.ctx.config
        fold = 1 if self.ctx.options.get("fold_attention_combine") else 0  # one kernel less per layer
        for i in range(cfg.num_hidden_layers):
            limit = (7 if cfg.is_moe_layer(i) else 6) - fold
            if counts.get(i, 0) > limit:
                raise PassVerifyError(f"{self.name}: layer {i} has {counts[i]} kernels, more than {limit}")
        # the head (tagged layer L): norm_lm_head, or with `split_lm_head_norm` the final
        # rms_norm and the plain lm_head (one kernel more per forward)
        L = cfg.num_hidden_layers
        limit = 2 if self.ctx.options.get("split_lm_head_norm", SPLIT_LM_HEAD_NORM) else 1
        head = sum(1 for node in gm.graph.nodes
                   if node.op == "call_function" and node.meta.get("flintc_layer") == L
                   and node.target is not operator.getitem and getattr(node.target, "namespace", None) == "flintc")
        if head > limit:
            raise PassVerifyError(f"{self.name}: the LM head has {head} kernels, more than {limit}")

    # ------------------------------------------------------------------ residual adds
    def _fold_residual_adds(self, gm: GraphModule) -> int:
        x = torch.empty(2, 8, dtype=torch.bfloat16)
        y = torch.empty(2, 8, dtype=torch.bfloat16)
        pattern = trace_pattern(lambda x, y: ops.residual_add(x, y, torch.float32), (x, y))
        matches = SubgraphMatcher(pattern.graph, ignore_literals=False).match(gm.graph)
        done, replaced = 0, {}
        for m in matches:
            residual, branch = m.placeholder_nodes
            residual = replaced.get(residual, residual)  # an earlier match's output, now folded
            out = m.returning_nodes[0]
            src = _through_views(branch)
            if is_op(src, F.gemv) and len(src.users) == 1:
                new = _new(gm, out, F.gemv_residual.default, (src.args[0], src.args[1], residual), src)
            elif is_op(src, F.moe_down_combine) and len(src.users) == 1:
                new = _new(gm, out, F.moe_down_combine_residual.default, (*src.args, residual), src)
            else:
                continue
            out.replace_all_uses_with(new)
            replaced[out] = new
            done += 1
        gm.graph.eliminate_dead_code()
        return done

    # ------------------------------------------------------------------ K1
    def _group_qkv(self, gm: GraphModule, eps: float) -> int:
        cfg, done = self.ctx.config, 0
        for node in [n for n in gm.graph.nodes if is_op(n, F.qk_norm_rope_kv_write)]:
            q, k, v, qn, kn, cos, sin, kc, vc, slots, positions, _eps, rope, window = node.args
            gemvs = [_through_views(t) for t in (q, k, v)]
            if not all(is_op(g, F.gemv) for g in gemvs):
                continue
            normed = _through_views(gemvs[0].args[0])
            if not is_op(normed, F.rms_norm) or any(_through_views(g.args[0]) is not normed for g in gemvs):
                continue
            x, w_in, _ = normed.args
            tables = [_table(cos, "rope_cos"), _table(sin, "rope_sin")]
            args = (x, w_in, gemvs[0].args[1], gemvs[1].args[1], gemvs[2].args[1], qn, kn, *tables,
                    kc, vc, slots, positions, eps, cfg.num_attention_heads, cfg.num_key_value_heads, rope, window)
            new = _new(gm, node, F.norm_qkv_rope_kv.default, args, node)
            outs = getitem_users(node)
            if 1 in outs and outs[1].users:
                continue  # prefill-style graphs that still read k: not a decode schedule
            outs[0].replace_all_uses_with(new)
            # The old op writes the cache, so dead-code elimination keeps it: erase it.
            for item in outs.values():
                gm.graph.erase_node(item)
            gm.graph.erase_node(node)
            done += 1
        gm.graph.eliminate_dead_code()
        return done

    # ------------------------------------------------------------------ MoE K5-K7
    def _group_moe(self, gm: GraphModule, eps: float) -> int:
        done = 0
        for route in [n for n in gm.graph.nodes if is_op(n, F.moe_route)]:
            x2d, router, bias, top_k, scaling = route.args
            normed = _through_views(x2d)
            gate_up = [u for u in x2d.users if is_op(u, F.moe_gate_up)]
            if not is_op(normed, F.rms_norm) or len(gate_up) != 1:
                continue
            gu = gate_up[0]
            x, w_post, _ = normed.args
            nr = _new(gm, route, F.norm_router.default, (x, w_post, router, eps), route)
            xn, logits = _getitem(gm, route, nr, 0, route), _getitem(gm, route, nr, 1, route)
            _, _, gate, up, sg, su = gu.args
            # K7's routed down weights, for K6 to prefetch the selected experts' rows into L2
            down = [u.args[3] for u in gu.users if is_op(u, F.moe_down_combine_residual)]
            args = (xn, logits, bias, gate, up, sg, su, top_k, scaling)
            tg = _new(gm, gu, F.moe_topk_gate_up.default, args + tuple(down[:1]) if len(down) == 1 else args, gu)
            h, weights, ids = (_getitem(gm, gu, tg, i, gu) for i in range(3))
            old = getitem_users(route)
            ids.meta["flintc_role"] = "moe_selected"
            old[1].meta.pop("flintc_role", None)
            gu.replace_all_uses_with(h)
            old[0].replace_all_uses_with(weights)
            old[1].replace_all_uses_with(ids)
            done += 1
        gm.graph.eliminate_dead_code()
        return done

    # ------------------------------------------------------------------ dense K5
    def _group_dense_mlp(self, gm: GraphModule, eps: float) -> int:
        done = 0
        for sm in [n for n in gm.graph.nodes if is_op(n, F.silu_mul)]:
            g, u = (_through_views(a) for a in sm.args)
            if not (is_op(g, F.gemv) and is_op(u, F.gemv)) or g.args[0] is not u.args[0]:
                continue
            normed = _through_views(g.args[0])
            if not is_op(normed, F.rms_norm):
                continue
            x, w_post, _ = normed.args
            new = _new(gm, sm, F.norm_gate_up_silu.default, (x, w_post, g.args[1], u.args[1], eps), sm)
            sm.replace_all_uses_with(new)
            done += 1
        gm.graph.eliminate_dead_code()
        return done

    # ------------------------------------------------------------------ K2 + K3
    def _fold_attention_combine(self, gm: GraphModule) -> int:
        """decode_attention -> (o_part, lse) -> attention_combine, where nothing else
        reads the partials: one decode_attention_combine."""
        done = 0
        for comb in [n for n in gm.graph.nodes if is_op(n, F.attention_combine)]:
            o_part, lse, sinks = comb.args
            if not (o_part.target is operator.getitem and lse.target is operator.getitem):
                continue
            attn = o_part.args[0]
            if not (is_op(attn, F.decode_attention)
                    and lse.args[0] is attn and len(o_part.users) == 1 and len(lse.users) == 1
                    and set(attn.users) <= {o_part, lse}):
                continue
            q, k_cache, v_cache, slots, positions, window, num_splits = attn.args
            new = _new(gm, comb, F.decode_attention_combine.default,
                       (q, k_cache, v_cache, slots, positions, sinks, window, num_splits), attn)
            comb.replace_all_uses_with(new)
            done += 1
        gm.graph.eliminate_dead_code()
        return done

    # ------------------------------------------------------------------ head
    def _group_head(self, gm: GraphModule, eps: float) -> int:
        done = 0
        for head in [n for n in gm.graph.nodes if is_op(n, F.lm_head)]:
            normed = _through_views(head.args[0])
            out = next(iter(head.users)) if len(head.users) == 1 else head
            if not is_op(normed, F.rms_norm):
                continue
            new = _new(gm, out, F.norm_lm_head.default, (normed.args[0], normed.args[1], head.args[1], eps), head)
            out.replace_all_uses_with(new)
            done += 1
        gm.graph.eliminate_dead_code()
        return done


def _table(rows: Node, name: str) -> Node:
    """The RoPE table placeholder behind `aten.index(table, [positions])`."""
    if is_op(rows, aten.index) and getattr(rows.args[0], "name", None) == name:
        return rows.args[0]
    raise PassVerifyError(f"expected the rows of {name} (aten.index), found {rows.name}")
