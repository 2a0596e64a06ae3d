"""PrefillAttentionFusionPass: at prefill, each layer's attention core becomes one
`flintc.prefill_attention(q, keys, values, visible, sinks)`.

Why: the captured core is some 30 aten ops per layer (upcasts, the scores bmm with
its expand/clone copies, scale, mask, sink concat, softmax, p @ v, the head
reshape, the downcast); FLINT_SPEC section 3 rounds attention once, at o, which
one kernel does. The keys stay as the reference builds them: in sliding layers
`cat(old ring, new k)` read before this step's write, in full layers the cache
read after it; the visibility masks (`FlintModel._visibility`) are kept as they
are, since they are the op's input.

How: the pattern is `ops.attention_with_sink` traced with `make_fx` at the graph's
shapes, one per key length (S = W + T in sliding layers, S_max in full ones), as
traced and as `canonicalize` leaves it; torch.fx's subgraph rewriter
(`flintc.graph.rewrite.replace_pattern`) replaces each match, guarded to stay in
one layer and read that layer's sinks. Bit-exact: the op's reference
implementation is the same function.

Cases: any batch and chunk length T (T > W too), sliding and full layers, bf16 or
NVFP4 weights, with or without `fuse_qk_norm_rope_kv` and `canonicalize`.

Before / after (sliding layer 0, prefill B=2, T=12, tiny: W=9, S=21):

    _to_copy_20 = aten._to_copy(cat_3, dtype=f32)                     [2, 21, 2, 32] f32
    bmm = aten.bmm(_unsafe_view, _unsafe_view_1)                       [16, 12, 21]
    mul_14 = aten.mul(_unsafe_view_2, 0.1767766952966369)
    masked_fill = aten.masked_fill(mul_14, bitwise_not, -inf)          (mask bitwise_and_1)
    cat_5 = aten.cat([masked_fill, expand_2], -1)                       [2, 2, 4, 12, 22] sink
    _softmax = aten._softmax(cat_5, -1, False)
    bmm_1 = aten.bmm(view_6, _unsafe_view_3)                           [16, 12, 32] p @ v
    _to_copy_22 = aten._to_copy(_unsafe_view_5, dtype=bf16)            [2, 12, 256] bf16
  ->
    prefill_attention = flintc.prefill_attention(getitem_4, cat_3, cat_4, bitwise_and_1,
                                                 w_layers_0_self_attn_sinks)  [2, 12, 256] bf16
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.match import find_nodes, placeholder
from flintc.graph.rewrite import refresh_meta, replace_pattern, trace_pattern
from flintc.model import ops
from flintc.ops.common import CDT
from flintc.passes.base import GraphPass, PassResult, PassVerifyError
from flintc.passes.patterns import pattern_forms

aten = torch.ops.aten
fused = torch.ops.flintc


def _search(q, keys, values, visible, sinks):
    return ops.attention_with_sink(q, keys, values, visible, sinks, CDT)  # [B, T, Hq*D]


def _replace(q, keys, values, visible, sinks):
    return fused.prefill_attention(q, keys, values, visible, sinks)


class PrefillAttentionFusionPass(GraphPass):
    name = "fuse_prefill_attention"
    stage = "fused"
    steps = ("prefill",)

    def run(self, gm: GraphModule) -> PassResult:
        c = self.ctx.config
        result = PassResult()
        lengths = sorted({self._key_length(gm, layer) for layer in range(c.num_hidden_layers)})
        for S in lengths:  # key lengths S: W + T (sliding layers), S_max (full layers)
            example = self._example(gm, S)
            replacement = trace_pattern(_replace, example)
            for search in pattern_forms(trace_pattern(_search, example), self.ctx):
                done = replace_pattern(gm, search, replacement, match_filters=[_in_one_layer])
                result.matches += len(done)
        refresh_meta(gm)
        left = sorted({n.meta.get("flintc_layer") for n in find_nodes(gm, aten._softmax)})
        if left:
            result.notes.append(f"attention left unfused in layers {left}")
        return result

    def _key_length(self, gm: GraphModule, layer: int) -> int:
        """S: the ring and the T new tokens in sliding layers, the cache in full ones."""
        rows = placeholder(gm, f"k_cache_{layer}").meta["val"].shape[1]
        return rows + self.ctx.tokens if self.ctx.config.is_sliding_layer(layer) else rows

    def _example(self, gm: GraphModule, S: int) -> tuple[torch.Tensor, ...]:
        c, B, T = self.ctx.config, self.ctx.batch, self.ctx.tokens
        Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        dev, bf16 = placeholder(gm, "k_cache_0").meta["val"].device, torch.bfloat16
        return (torch.empty(B, T, Hq, D, dtype=bf16, device=dev),
                torch.empty(B, S, Hkv, D, dtype=bf16, device=dev),
                torch.empty(B, S, Hkv, D, dtype=bf16, device=dev),
                torch.empty(B, T, S, dtype=torch.bool, device=dev),
                torch.empty(Hq, device=dev))

    def verify(self, gm: GraphModule) -> None:
        left = find_nodes(gm, aten._softmax, aten.masked_fill)
        if left:
            raise PassVerifyError(f"{self.name}: unfused attention left at {left[0].name} "
                                  f"(layer {left[0].meta.get('flintc_layer')})")
        found = sorted(n.meta.get("flintc_layer") for n in find_nodes(gm, fused.prefill_attention))
        if found != list(range(self.ctx.config.num_hidden_layers)):
            raise PassVerifyError(f"{self.name}: expected one prefill_attention per layer, "
                                  f"found one in layers {found}")


def _in_one_layer(match, original, pattern) -> bool:
    """All matched ops in one layer, reading that layer's sinks; every input of the
    pattern's shape (a view chain folded by `canonicalize` could bind another)."""
    layers = {gn.meta.get("flintc_layer") for pn, gn in match.nodes_map.items()
              if pn.op not in ("placeholder", "output")}
    sinks = match.placeholder_nodes[-1]
    wanted = [p.meta["val"].shape for p in pattern.nodes if p.op == "placeholder"]
    return (len(layers) == 1 and None not in layers and isinstance(sinks, Node)
            and sinks.name == f"w_layers_{layers.pop()}_self_attn_sinks"
            and all(isinstance(n, Node) and n.meta["val"].shape == s
                    for n, s in zip(match.placeholder_nodes, wanted)))
