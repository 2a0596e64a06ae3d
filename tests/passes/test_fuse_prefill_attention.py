"""fuse_prefill_attention: each layer's prefill attention core becomes one
`flintc.prefill_attention` over the keys and mask the reference builds; bit-exact
against the graph before it (logits and KV caches)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from flintc.checkpoint.dummy import dummy_weights
from flintc.config import FlintConfig
from flintc.graph.match import clone_graph_module, find_nodes
from flintc.graph.trace import capture
from flintc.model.reference import FlintModel
from flintc.passes.base import PassContext
from flintc.passes.fuse_prefill_attention import PrefillAttentionFusionPass
from flintc.passes.fuse_qk_norm_rope_kv import QKNormRopeKVWriteFusionPass
from flintc.passes.fuse_rms_norm import RMSNormFusionPass
from flintc.passes.manager import NumericChecker, PassManager
from harness import tiny_model

aten, fused = torch.ops.aten, torch.ops.flintc
PASSES = [RMSNormFusionPass, QKNormRopeKVWriteFusionPass, PrefillAttentionFusionPass]


@functools.lru_cache(maxsize=None)
def _captured(batch, tokens):
    return capture(tiny_model(), "prefill", batch=batch, tokens=tokens, cache_len=48)


def graph(batch, tokens):
    """A private copy of a captured tiny prefill graph (passes rewrite in place)."""
    g = _captured(batch, tokens)
    return dataclasses.replace(g, gm=clone_graph_module(g.gm))


def run(g, passes=PASSES):
    ctx = PassContext(g.config, "prefill", g.batch, g.tokens, g.cache_len)
    report = PassManager(passes, ctx, checker=NumericChecker(tiny_model(), g)).run(g)
    return report.stages[-1]


def assert_fused(g):
    gm, c = g.gm, g.config
    assert not find_nodes(gm, aten._softmax, aten.masked_fill)
    attn = find_nodes(gm, fused.prefill_attention)
    assert sorted(n.meta["flintc_layer"] for n in attn) == list(range(c.num_hidden_layers))
    T, W = g.tokens, c.sliding_window
    for n in attn:
        i = n.meta["flintc_layer"]
        S = W + T if c.is_sliding_layer(i) else g.cache_len
        q, keys, values, visible, sinks = n.args
        assert keys.meta["val"].shape[1] == S and visible.meta["val"].shape == (g.batch, T, S)
        assert visible.meta["flintc_layer"] is None  # the shared mask, kept as it was
        assert sinks.name == f"w_layers_{i}_self_attn_sinks"


def assert_bit_exact(stage):
    check = stage.check
    assert check.passed and check.bit_exact, check.message
    assert {"logits", "k_cache_0", "v_cache_1"} <= {d.name for d in check.outputs}


def test_prefill_is_fused_and_bit_exact():
    """A chunk shorter than the window (T=5 < W=9)."""
    g = graph(2, 5)
    stage = run(g)
    assert stage.result.matches == 4
    assert_fused(g)
    assert_bit_exact(stage)


def test_long_prefill_with_canonicalize_and_without_the_qk_fusion():
    """A 32-token chunk over a W=9 ring; the pattern depends neither on how q and the
    keys were produced (the Q/K norms, RoPE and writes stay aten ops here) nor on
    `canonicalize`."""
    from flintc.passes.canonicalize import CanonicalizationPass

    g = graph(1, 32)
    assert_bit_exact(run(g, [CanonicalizationPass, RMSNormFusionPass, PrefillAttentionFusionPass]))
    assert_fused(g)
    assert find_nodes(g.gm, aten.index_put_)


def test_full_width_config_on_meta_weights():
    """Structure at the full model's widths (NVFP4 in test_fuse_decode_attention.py)."""
    cfg = FlintConfig.preset("full").replace(
        num_hidden_layers=3, n_routed_experts=16, vocab_size=1024,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"))
    meta = FlintModel(cfg, dummy_weights(cfg, "bf16", "meta"), max_positions=1024)
    g = capture(meta, "prefill", batch=2, tokens=16, cache_len=1024)
    PassManager(PASSES, PassContext(cfg, "prefill", 2, 16, 1024, "bf16")).run(g)
    assert_fused(g)
