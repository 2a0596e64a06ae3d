"""DecodeAttentionFusionPass: at decode, each layer's attention core becomes split-KV
(flash-decoding) attention, `flintc.decode_attention`, plus `flintc.attention_combine`.

Why: FLINT_SPEC section 5 runs decode attention as two kernels: one that reads the
KV cache in at most `num_splits` chunks along its length (the chunks cut the visible
rows, `flintc.ops.attention.split_layout`), each chunk giving a partial
output and its log-sum-exp, and a combine that merges them with the learned sink.
The captured core is some 35 aten ops per layer: the cache gathers (plus the `cat`
with the new token in sliding layers), the scores bmm, the mask, the sink concat,
the softmax, p @ v and the reshape to [B, 1, Hq*D]; and every layer reads a
visibility mask built once per step (`FlintModel._visibility`).

How: one search pattern per layer kind, traced with `make_fx` at the graph's shapes
from `ops.attention_with_sink` and the gathers of `Attention.forward` /
`_sliding_kv`, matched per layer (`match_in_layer`). The fused pair reads the cache
after this step's write, which `fuse_qk_norm_rope_kv` placed before it: the new
token is in the cache, and in a ring the slot it overwrote held position p - W,
outside the window anyway. The ops compute visibility from `positions` (causal;
ring slots by position, in the window), so the shared mask nodes die and are
removed. `num_splits`: `ctx.options["attention_splits"]` if given, else
ceil(S / 256) clamped to [1, 32] for a full layer's cache of S rows
(`ctx.options["full_attention_rows"]` when given, since the runtime's caches are longer
than the ones traced for checking), and ceil(W / 64) for a sliding layer's ring of W
rows (`num_splits_for`).

Expectation, a tolerance: the op sums keys in its own order (one einsum per chunk
instead of one bmm) and merges chunks through their log-sum-exp, so scores, the
softmax sums and p @ v round differently in fp32 (relative 1e-7); where the
attention output lands near a bf16 rounding boundary it moves one bf16 ulp, and
that ulp travels through the later layers (O projection, norms, MoE) into the
logits and the later layers' KV caches; it could tip a near-tie in a router.
Measured on tiny, B in {1, 2, 4, 8} x splits {default, 3, 5} x 12 seeds (144 runs
per format): bf16 weights: 11 runs not bit-exact, largest logit difference 0.036
(logits up to 3.7), largest KV-cache difference 0.039, at most 0.031 beyond
rtol 0.02 * |ref|; NVFP4: 9 runs, 0.023 / 0.023 / 0.020; no expert flips in any.
So atol 0.06 + rtol 0.02 (about twice the worst), and at most 10% of (layer, token)
expert selections flipped. Wrong variants exceed it several times over: a sink
counted twice needs atol >= 0.16, a position off by one >= 0.19 (B in {1, 2, 8},
3 seeds each; tests/passes/test_fuse_decode_attention.py checks both fail).

Before / after (full layer 1, decode B=2, tiny: Hq=8, Hkv=2, D=32, S=48):

    index_5 = aten.index(k_cache_1, [slots])                          [2, 48, 2, 32] bf16
    bmm_2 = aten.bmm(view_18, _unsafe_view_4)                          [16, 1, 48] f32
    masked_fill_1 = aten.masked_fill(mul_25, bitwise_not_1, -inf)      (mask le [2, 1, 48])
    cat_6 = aten.cat([masked_fill_1, expand_7], -1)                     [2, 2, 4, 1, 49] sink
    _softmax_1 = aten._softmax(cat_6, -1, False)
    bmm_3 = aten.bmm(view_20, _unsafe_view_6)                          [16, 1, 32] p @ v
    _to_copy_64 = aten._to_copy(view_21, dtype=bf16)                   [2, 1, 256] bf16
  ->
    decode_attention_1 = flintc.decode_attention(getitem_6, k_cache_1, v_cache_1, slots,
                                                 positions, 0, 1)   (window 0, 1 split)
    getitem_14 = decode_attention_1[0]                                 [2, 8, 1, 32] f32 o_part
    getitem_15 = decode_attention_1[1]                                 [2, 8, 1] f32 lse
    attention_combine_1 = flintc.attention_combine(getitem_14, getitem_15,
                                                   w_layers_1_self_attn_sinks)  [2, 1, 256] bf16
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import GraphModule

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.compare import Expectation
from flintc.graph.match import find_nodes, placeholder
from flintc.graph.rewrite import refresh_meta, trace_pattern
from flintc.graph.spec import _mutated_args
from flintc.model import ops
from flintc.ops.common import CDT
from flintc.passes.base import GraphPass, PassResult, PassVerifyError
from flintc.passes.patterns import LayerMatch, bind_inputs, first_match_per_layer, like

aten = torch.ops.aten
fused = torch.ops.flintc

MAX_SPLITS = 32
ROWS_PER_SPLIT = 256
# A sliding layer's ring: one split per 64 rows (the decode kernel's GPU_BLOCK_S), so each
# split is one block that one program reads and stores without an in-kernel merge (the
# kernel's launcher gives each program one whole split of a ring): 9 splits for W = 513,
# 6.0 us per call at batch 1 on the H200 against 12.1 with 3 splits shared by 9 programs
# (docs/gpu-runs.md session 13).
ROWS_PER_RING_SPLIT = 64


def num_splits_for(rows: int, option: int | None = None, ring: bool = False) -> int:
    """Splits of a cache of `rows` rows: `option` if given, else ceil(rows / 256)
    clamped to [1, 32], or for a sliding layer's ring (`ring`) ceil(rows / 64) clamped to
    [1, 32]. Raises ValueError for an option < 1."""
    if option is not None:
        if int(option) < 1:
            raise ValueError(f"attention_splits must be >= 1, found {option}")
        return int(option)
    per = ROWS_PER_RING_SPLIT if ring else ROWS_PER_SPLIT
    return max(1, min(MAX_SPLITS, math.ceil(rows / per)))


class DecodeAttentionFusionPass(GraphPass):
    name = "fuse_decode_attention"
    stage = "fused"
    steps = ("decode",)
    expectation = Expectation(
        "tolerance", atol=0.06, rtol=0.02, max_flip_share=0.1,
        why="split-KV attention sums keys in another order and merges splits by log-sum-exp: "
            "fp32 rounding differs, an output near a bf16 boundary moves one ulp and travels on "
            "(worst measured on tiny: 0.031 beyond rtol; see the module doc)")

    def run(self, gm: GraphModule) -> PassResult:
        result = PassResult()
        for layer, sliding, match in first_match_per_layer(gm, self.ctx, self._pattern, _reads_layer):
            if match is None:
                result.notes.append(f"layer {layer}: no decode attention core matched")
                continue
            splits = self._fuse(gm, match, layer, sliding)
            result.matches += 1
            result.notes.append(f"layer {layer}: {splits} split(s)")
        gm.graph.eliminate_dead_code()  # the shared visibility masks, unused k outputs
        refresh_meta(gm)
        return result

    def _pattern(self, gm: GraphModule, layer: int, sliding: bool) -> GraphModule:
        """The attention core of one layer kind at this graph's shapes. Inputs: q,
        k_cache, v_cache, slots, [k, v (the new token),] visible, sinks; returns o."""
        c, B = self.ctx.config, self.ctx.batch
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        kc = like(placeholder(gm, f"k_cache_{layer}"))
        dev, bf16 = kc.device, torch.bfloat16
        S = kc.shape[1] + (1 if sliding else 0)
        q = torch.empty(B, 1, Hq, D, dtype=bf16, device=dev)
        new = [torch.empty(B, 1, Hkv, D, dtype=bf16, device=dev) for _ in range(2 * sliding)]
        visible = torch.empty(B, 1, S, dtype=torch.bool, device=dev)
        sinks = torch.empty(Hq, device=dev)

        def search(q, k_cache, v_cache, slots, *args):
            visible, sinks = args[-2:]
            keys, values = k_cache[slots], v_cache[slots]  # [B, S, Hkv, D]
            if sliding:  # _sliding_kv: the ring as it was, then the new token
                keys = torch.cat([keys, args[0]], dim=1)  # [B, W+1, Hkv, D]
                values = torch.cat([values, args[1]], dim=1)
            return ops.attention_with_sink(q, keys, values, visible, sinks, CDT)  # [B, 1, Hq*D]

        slots = torch.empty(B, dtype=torch.int64, device=dev)
        return trace_pattern(search, (q, kc, torch.empty_like(kc), slots, *new, visible, sinks))

    def _fuse(self, gm: GraphModule, m: LayerMatch, layer: int, sliding: bool) -> int:
        c = self.ctx.config
        (o,) = m.outputs
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        anchor = min((u for u in o.users if u not in m.nodes), key=order.__getitem__)
        inputs = bind_inputs(gm, m, anchor, layer)
        q, k_cache, v_cache, slots = inputs[:4]
        sinks = inputs[-1]
        writers = [u for cache in (k_cache, v_cache) for u in cache.users
                   if cache in _mutated_args(u)]
        late = [w for w in writers if order[w] > order[anchor]]
        if late:  # reading after the write is what makes the ring read right
            raise PassVerifyError(f"{self.name}: layer {layer}: cache write {late[0].name} comes "
                                  f"after the attention that must read it ({anchor.name})")
        rows = k_cache.meta["val"].shape[1]
        if not sliding and self.ctx.options.get("full_attention_rows"):
            # The runtime's caches may be longer than the ones traced for checking.
            rows = int(self.ctx.options["full_attention_rows"])
        splits = num_splits_for(rows, self.ctx.options.get("attention_splits"), ring=sliding)
        window = c.sliding_window if sliding else 0
        positions = placeholder(gm, "positions")
        graph = gm.graph
        with graph.inserting_before(anchor):
            part = graph.create_node("call_function", fused.decode_attention.default,
                                     (q, k_cache, v_cache, slots, positions, window, splits),
                                     name="decode_attention")
            o_part = graph.call_function(operator.getitem, (part, 0))
            lse = graph.call_function(operator.getitem, (part, 1))
            new = graph.create_node("call_function", fused.attention_combine.default,
                                    (o_part, lse, sinks), name="attention_combine")
        for n in (part, o_part, lse, new):
            n.meta.update(flintc_layer=layer, flintc_block="attn")
        o.replace_all_uses_with(new, delete_user_cb=lambda u: u not in m.nodes)
        for n in sorted(m.nodes, key=order.__getitem__, reverse=True):
            graph.erase_node(n)
        return splits

    def verify(self, gm: GraphModule) -> None:
        c = self.ctx.config
        left = find_nodes(gm, aten._softmax, aten.masked_fill)
        if left:
            raise PassVerifyError(f"{self.name}: unfused attention left at {left[0].name} "
                                  f"(layer {left[0].meta.get('flintc_layer')})")
        layers = list(range(c.num_hidden_layers))
        for op in (fused.decode_attention, fused.attention_combine):
            found = sorted(n.meta.get("flintc_layer") for n in find_nodes(gm, op))
            if found != layers:
                raise PassVerifyError(f"{self.name}: expected one {op._qualified_op_name} per "
                                      f"layer, found one in layers {found}")
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for attn in find_nodes(gm, fused.decode_attention):
            for cache in attn.args[1:3]:
                late = [u for u in cache.users
                        if cache in _mutated_args(u) and order[u] > order[attn]]
                if late:
                    raise PassVerifyError(f"{self.name}: {attn.name} reads {cache.name} before "
                                          f"this step's write {late[0].name}")


def _reads_layer(m: LayerMatch, layer: int) -> bool:
    """The match reads this layer's caches and sinks."""
    names = [getattr(n, "name", None) for n in m.inputs]
    return names[1:3] == [f"k_cache_{layer}", f"v_cache_{layer}"] and \
        names[-1] == f"w_layers_{layer}_self_attn_sinks"
