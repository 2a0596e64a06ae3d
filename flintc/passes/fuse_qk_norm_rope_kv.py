"""QKNormRopeKVWriteFusionPass: per layer, the per-head Q/K RMSNorms, RoPE (sliding
layers) and the two KV-cache writes become one `flintc.qk_norm_rope_kv_write` at
decode; at prefill the norms and RoPE become one `flintc.qk_norm_rope` and the writes
are left to `fuse_prefill_attention` (its op reads the old ring, then writes).

Why: FLINT_SPEC section 5 puts the per-head norms, RoPE and the cache write in the
epilogue of the QKV GEMV (kernel 1). After `fuse_rms_norm` a sliding layer still
spends some 30 aten ops here: two `flintc.rms_norm`, two RoPEs (upcast, slices,
four multiplies, sub/add, cat, downcast each), the ring index `positions % W`, and
two `index_put_` writes; a full layer has the norms and the writes at `positions`.

How: one search pattern per layer kind, traced with `make_fx` at the graph's
shapes from the reference functions (`flintc.rms_norm`, `ops.apply_rope`, and
`flintc.ops.attention.write_kv`, the op's own statement of `Attention.forward`'s
writes), matched with torch.fx's `SubgraphMatcher` among one layer's nodes (see
`match_in_layer`: the pattern's q path and its writes meet only at shared inputs, so
a whole-graph search would pair every layer's q with every layer's writes). The
pattern is tried as traced and as the `canonicalize` pass leaves it.

Ordering (the writes are the graph's only side effects): a sliding layer reads the
old ring (`index(k_cache, [slots])`, then `cat` with the new k) before it writes;
a full layer reads the cache after the write, through the `index_put_` result. The
fused op goes right before the first consumer of q, k or the written cache; reads
of the old ring that sat between that point and the original writes move up in
front of it (they read only the cache and `slots`); readers of `index_put_`'s
result read the cache placeholder itself, after the fused op. Bit-exact: the op
runs the same reference functions.

Prefill: a chunk's attention must read the old ring before the chunk's own keys
overwrite it, and the prefill attention op (`flintc.prefill_attention_kv`) reads the
cache rows itself, so it also does the write; this pass then fuses only the q / k
path (search pattern: the two norms and the RoPEs, no write), replaced at the first
consumer of q or k by `qk_norm_rope(q, k, q_norm, k_norm, cos, sin, eps, rope)`. The
`index_put_` writes and their ring index stay as captured for the attention pass.
Bit-exact (same reference functions).

Cases: decode and prefill (T > W keeps the last W tokens), any batch, sliding and
full layers, bf16 or NVFP4 weights (only the linears differ), with or without
`canonicalize`.

Before / after (sliding layer 0, decode B=2, tiny, after `canonicalize`; full layers
have no RoPE and read the cache after the write):

    rms_norm_1 = flintc.rms_norm(view_1, w_layers_0_self_attn_q_norm, 1e-05)  [2, 1, 8, 32] bf16
    _to_copy_15 = aten._to_copy(rms_norm_1, dtype=f32)
    slice_1, slice_2, unsqueeze_5, mul_6 ... cat_1                             (RoPE of q)
    _to_copy_16 = aten._to_copy(cat_1, dtype=bf16)                            [2, 1, 8, 32] bf16
    rms_norm_2 = flintc.rms_norm(view_2, w_layers_0_self_attn_k_norm, 1e-05)  ... (RoPE of k)
    _to_copy_18 = aten._to_copy(cat_2, dtype=bf16)                            [2, 1, 2, 32] bf16
    index_3 = aten.index(k_cache_0, [slots])                                  [2, 9, 2, 32] old ring
    cat_3 = aten.cat([index_3, _to_copy_18], 1)
    index_4 = aten.index(v_cache_0, [slots])
    remainder_1 = aten.remainder(positions, 9)                                [2, 1] i64
    index_put_ = aten.index_put_(k_cache_0, [unsqueeze_9, remainder_1], _to_copy_18)
    index_put__1 = aten.index_put_(v_cache_0, [unsqueeze_10, remainder_1], view_3)
  ->
    index_3 = aten.index(k_cache_0, [slots])
    index_4 = aten.index(v_cache_0, [slots])                                  (moved up)
    qk_norm_rope_kv_write = flintc.qk_norm_rope_kv_write(view_1, view_2, view_3,
        w_..._q_norm, w_..._k_norm, index_1, index_2, k_cache_0, v_cache_0, slots,
        positions, 1e-05, True, 9)
    getitem = qk_norm_rope_kv_write[0]                                        [2, 1, 8, 32] bf16
    getitem_1 = qk_norm_rope_kv_write[1]                                      [2, 1, 2, 32] bf16
    cat_3 = aten.cat([index_3, getitem_1], 1)

The matching glue it shares with the attention passes is in `flintc.passes.patterns`.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.match import find_nodes, placeholder
from flintc.graph.rewrite import refresh_meta, trace_pattern
from flintc.model import ops
from flintc.ops.attention import write_kv
from flintc.ops.common import CDT
from flintc.passes.base import GraphPass, PassResult, PassVerifyError
from flintc.passes.patterns import LayerMatch, bind_inputs, first_match_per_layer, like, move_before

aten = torch.ops.aten
fused = torch.ops.flintc


class QKNormRopeKVWriteFusionPass(GraphPass):
    name = "fuse_qk_norm_rope_kv"
    stage = "fused"

    def run(self, gm: GraphModule) -> PassResult:
        result = PassResult()
        for layer, sliding, match in first_match_per_layer(gm, self.ctx, self._pattern, self._check):
            if match is None and self.ctx.step == "prefill" and not sliding:
                match = self._norm_pair(gm, layer)
            if match is None:
                result.notes.append(f"layer {layer}: no Q/K norm + KV write matched")
                continue
            self._fuse(gm, match, layer, sliding)
            result.matches += 1
        gm.graph.lint()
        refresh_meta(gm)
        return result

    def _pattern(self, gm: GraphModule, layer: int, sliding: bool) -> GraphModule:
        """The search pattern of one layer kind at this graph's shapes. Decode: inputs
        q, k, v, q_norm, k_norm, [cos, sin,] k_cache, v_cache, slots, positions; returns
        q, k and the two written caches (the `index_put_` results). Prefill: inputs q,
        k, q_norm, k_norm, [cos, sin]; returns q, k (no write)."""
        if self.ctx.step == "prefill":
            return self._prefill_pattern(gm, sliding)
        c, B, T = self.ctx.config, self.ctx.batch, self.ctx.tokens
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps, W = c.rms_norm_eps, c.sliding_window if sliding else 0
        kc = like(placeholder(gm, f"k_cache_{layer}"))
        dev = kc.device
        bf16, i64 = torch.bfloat16, torch.int64
        act = [torch.empty(B, T, h, D, dtype=bf16, device=dev) for h in (Hq, Hkv, Hkv)]
        norms = [torch.empty(D, device=dev) for _ in range(2)]
        tables = [torch.empty(B, T, D // 2, device=dev) for _ in range(2)] if sliding else []
        rest = [kc, torch.empty_like(kc), torch.empty(B, dtype=i64, device=dev),
                torch.empty(B, T, dtype=i64, device=dev)]

        def search(q, k, v, q_norm, k_norm, *args):
            cos, sin = args[:2] if sliding else (None, None)
            k_cache, v_cache, slots, positions = args[-4:]
            q = fused.rms_norm(q, q_norm, eps)  # [B, T, Hq, D]
            k = fused.rms_norm(k, k_norm, eps)  # [B, T, Hkv, D]
            if sliding:
                q, k = ops.apply_rope(q, cos, sin, CDT), ops.apply_rope(k, cos, sin, CDT)
            write_kv(k_cache, v_cache, k, v, slots, positions, W)
            return q, k, k_cache, v_cache

        return trace_pattern(search, (*act, *norms, *tables, *rest))

    def _prefill_pattern(self, gm: GraphModule, sliding: bool) -> GraphModule:
        c, B, T = self.ctx.config, self.ctx.batch, self.ctx.tokens
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps = c.rms_norm_eps
        dev, bf16 = placeholder(gm, "k_cache_0").meta["val"].device, torch.bfloat16
        act = [torch.empty(B, T, h, D, dtype=bf16, device=dev) for h in (Hq, Hkv)]
        norms = [torch.empty(D, device=dev) for _ in range(2)]
        tables = [torch.empty(B, T, D // 2, device=dev) for _ in range(2)] if sliding else []

        def search(q, k, q_norm, k_norm, *tables):
            q = fused.rms_norm(q, q_norm, eps)  # [B, T, Hq, D]
            k = fused.rms_norm(k, k_norm, eps)  # [B, T, Hkv, D]
            if sliding:
                q, k = ops.apply_rope(q, *tables, CDT), ops.apply_rope(k, *tables, CDT)
            return q, k

        return trace_pattern(search, (*act, *norms, *tables))

    def _norm_pair(self, gm: GraphModule, layer: int) -> LayerMatch | None:
        """Prefill, full layer: the pattern is two unconnected `rms_norm`s, which torch.fx's
        matcher pairs with the layer's other norms first and then drops as overlapping;
        so they are found by their weights, `w_layers_<i>_self_attn_{q,k}_norm`."""
        found = {}
        for n in find_nodes(gm, fused.rms_norm):
            w = n.args[1]
            for key in ("q", "k"):
                if n.meta.get("flintc_layer") == layer and getattr(w, "name", None) == \
                        f"w_layers_{layer}_self_attn_{key}_norm":
                    found.setdefault(key, []).append(n)
        if [len(found.get(key, ())) for key in "qk"] != [1, 1]:
            return None
        nq, nk = found["q"][0], found["k"][0]
        if nq.args[2] != self.ctx.config.rms_norm_eps or nk.args[2] != self.ctx.config.rms_norm_eps:
            return None
        c, B, T = self.ctx.config, self.ctx.batch, self.ctx.tokens
        shapes = [(B, T, c.num_attention_heads, c.head_dim), (B, T, c.num_key_value_heads, c.head_dim),
                  (c.head_dim,), (c.head_dim,)]
        have = [tuple(n.meta["val"].shape) for n in (nq, nk)]
        if have != shapes[:2]:
            return None
        return LayerMatch([nq.args[0], nk.args[0], nq.args[1], nk.args[1]], [nq, nk], {nq, nk}, shapes)

    def _check(self, m: LayerMatch, layer: int) -> bool:
        """The match reads this layer's norm weights and (decode) writes this layer's caches."""
        names = [getattr(n, "name", None) for n in m.inputs]
        if self.ctx.step == "prefill":
            return names[2:4] == [f"w_layers_{layer}_self_attn_q_norm",
                                  f"w_layers_{layer}_self_attn_k_norm"]
        kc, vc = names[-4:-2]
        return (names[3] == f"w_layers_{layer}_self_attn_q_norm"
                and names[4] == f"w_layers_{layer}_self_attn_k_norm"
                and kc == f"k_cache_{layer}" and vc == f"v_cache_{layer}")

    def _fuse(self, gm: GraphModule, m: LayerMatch, layer: int, sliding: bool) -> None:
        if self.ctx.step == "prefill":
            return self._fuse_prefill(gm, m, layer, sliding)
        c = self.ctx.config
        k_cache, v_cache, slots, positions = m.inputs[-4:]
        q_out, k_out, k_put, v_put = m.outputs
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        puts = (k_put, v_put)
        first_put, last_put = min(order[p] for p in puts), max(order[p] for p in puts)
        readers = [u for cache in (k_cache, v_cache) for u in cache.users if u not in m.nodes]
        consumers = [u for r in m.outputs for u in r.users if u not in m.nodes]
        consumers += [r for r in readers if order[r] > last_put]  # reads of the new cache
        if consumers:
            anchor = min(consumers, key=order.__getitem__)
        else:
            anchor = max(puts, key=order.__getitem__).next
        for r in sorted(readers, key=order.__getitem__):  # reads of the old cache go first
            if order[anchor] < order[r] < first_put:
                move_before(r, anchor, order)
        late = [a for a in m.inputs if isinstance(a, Node) and order[a] >= order[anchor]]
        if late:
            raise PassVerifyError(f"{self.name}: layer {layer}: input {late[0].name} is defined "
                                  f"after {anchor.name}, the first reader of the op's results")
        inputs = bind_inputs(gm, m, anchor, layer)
        q, k, v, q_norm, k_norm = inputs[:5]
        cos, sin = inputs[5:7] if sliding else _rope_rows(gm, positions)
        args = (q, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache, slots, positions)
        window = c.sliding_window if sliding else 0
        with gm.graph.inserting_before(anchor):
            node = gm.graph.create_node("call_function", fused.qk_norm_rope_kv_write.default,
                                        (*args, c.rms_norm_eps, sliding, window),
                                        name="qk_norm_rope_kv_write")
            outs = [gm.graph.call_function(operator.getitem, (node, i)) for i in range(2)]
        for new in (node, *outs):
            new.meta.update(flintc_layer=layer, flintc_block="attn")
        for old, new in ((q_out, outs[0]), (k_out, outs[1])):
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in m.nodes)
        for put, cache in ((k_put, k_cache), (v_put, v_cache)):
            put.replace_all_uses_with(cache)  # index_put_ returns the cache it wrote
        for n in sorted(m.nodes, key=order.__getitem__, reverse=True):
            gm.graph.erase_node(n)
        for out in outs:
            if not out.users:
                gm.graph.erase_node(out)

    def _fuse_prefill(self, gm: GraphModule, m: LayerMatch, layer: int, sliding: bool) -> None:
        """q, k -> `qk_norm_rope` at the first consumer of either; no cache involved."""
        c = self.ctx.config
        q_out, k_out = m.outputs
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        consumers = [u for r in m.outputs for u in r.users if u not in m.nodes]
        anchor = min(consumers, key=order.__getitem__)
        late = [a for a in m.inputs if isinstance(a, Node) and order[a] >= order[anchor]]
        if late:
            raise PassVerifyError(f"{self.name}: layer {layer}: input {late[0].name} is defined "
                                  f"after {anchor.name}, the first reader of the op's results")
        inputs = bind_inputs(gm, m, anchor, layer)
        q, k, q_norm, k_norm = inputs[:4]
        cos, sin = inputs[4:6] if sliding else _rope_rows(gm, placeholder(gm, "positions"))
        with gm.graph.inserting_before(anchor):
            node = gm.graph.create_node("call_function", fused.qk_norm_rope.default,
                                        (q, k, q_norm, k_norm, cos, sin, c.rms_norm_eps, sliding),
                                        name="qk_norm_rope")
            outs = [gm.graph.call_function(operator.getitem, (node, i)) for i in range(2)]
        for new in (node, *outs):
            new.meta.update(flintc_layer=layer, flintc_block="attn")
        for old, new in ((q_out, outs[0]), (k_out, outs[1])):
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in m.nodes)
        for n in sorted(m.nodes, key=order.__getitem__, reverse=True):
            gm.graph.erase_node(n)

    def verify(self, gm: GraphModule) -> None:
        c = self.ctx.config
        prefill = self.ctx.step == "prefill"
        left = find_nodes(gm, aten.index_put_)
        if left and not prefill:  # prefill: fuse_prefill_attention takes the writes
            raise PassVerifyError(f"{self.name}: unfused KV-cache write left at {left[0].name} "
                                  f"(layer {left[0].meta.get('flintc_layer')})")
        op = fused.qk_norm_rope if prefill else fused.qk_norm_rope_kv_write
        found = sorted(n.meta.get("flintc_layer") for n in find_nodes(gm, op))
        if found != list(range(c.num_hidden_layers)):
            raise PassVerifyError(f"{self.name}: expected one {op._qualified_op_name} per layer, "
                                  f"found one in layers {found}")
        for n in find_nodes(gm, fused.rms_norm):
            w = n.args[1]
            if getattr(w, "name", "").endswith(("_q_norm", "_k_norm")):
                raise PassVerifyError(f"{self.name}: per-head norm {n.name} left unfused")


def _rope_rows(gm: GraphModule, positions: Node) -> tuple[Node, Node]:
    """The RoPE table rows `rope_cos[positions]`, `rope_sin[positions]` (the op takes
    them in full layers too, where it ignores them); made if the graph has none."""
    rows = []
    for table in ("rope_cos", "rope_sin"):
        ph = placeholder(gm, table)
        found = [u for u in ph.users if u.target is aten.index.Tensor and u.args[1] == [positions]]
        row = found[0] if found else None
        if row is None:
            first_op = next(n for n in gm.graph.nodes if n.op != "placeholder")
            with gm.graph.inserting_before(first_op):
                row = gm.graph.call_function(aten.index.Tensor, (ph, [positions]))
            row.meta["flintc_layer"] = None
        rows.append(row)
    return rows[0], rows[1]
