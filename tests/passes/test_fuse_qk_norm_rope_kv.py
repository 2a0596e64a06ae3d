"""fuse_qk_norm_rope_kv: per layer, at decode the Q/K norms, RoPE and both KV-cache
writes become one `flintc.qk_norm_rope_kv_write`, placed between the reads of the old
ring and the reads of the new cache; at prefill the norms and RoPE become one
`flintc.qk_norm_rope` and the writes stay for fuse_prefill_attention (whose op reads
the old ring, then writes). Bit-exact against the graph before it (logits and caches).

The manager checks every pass it runs, so this pass is also checked (bit-exact) on
the prefill chunks of test_fuse_prefill_attention.py (at position 0 and at offsets)
and at the batch sizes of test_fuse_decode_attention.py."""

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
from flintc.passes.fuse_qk_norm_rope_kv import QKNormRopeKVWriteFusionPass
from flintc.passes.fuse_rms_norm import RMSNormFusionPass
from flintc.passes.manager import NumericChecker, PassManager
from harness import tiny_model

aten, fused = torch.ops.aten, torch.ops.flintc
PASSES = [RMSNormFusionPass, QKNormRopeKVWriteFusionPass]


@functools.lru_cache(maxsize=None)
def _captured(step, batch, tokens):
    return capture(tiny_model(), step, batch=batch, tokens=tokens, cache_len=48)


def graph(step="decode", batch=2, tokens=None):
    """A private copy of a captured tiny graph (passes rewrite in place)."""
    g = _captured(step, batch, tokens)
    return dataclasses.replace(g, gm=clone_graph_module(g.gm))


def run(g, passes=PASSES, at_zero=False):
    """Run `passes` through the manager with numeric checks; `at_zero` puts sequence 0
    at position 0 (an empty ring / cache before it). Returns the last stage's report."""
    ctx = PassContext(g.config, g.step, g.batch, g.tokens, g.cache_len)
    checker = NumericChecker(tiny_model(), g)
    if at_zero:
        checker.inputs[1][0] = torch.arange(g.tokens)
    report = PassManager(passes, ctx, checker=checker).run(g)
    return report.stages[-1]


def assert_fused(g):
    c = g.config
    gm = g.gm
    assert not find_nodes(gm, aten.index_put_)
    ops = find_nodes(gm, fused.qk_norm_rope_kv_write)
    assert sorted(n.meta["flintc_layer"] for n in ops) == list(range(c.num_hidden_layers))
    for n in ops:
        i = n.meta["flintc_layer"]
        sliding = c.is_sliding_layer(i)
        assert n.args[7].name == f"k_cache_{i}" and n.args[8].name == f"v_cache_{i}"
        assert n.args[-2:] == (sliding, c.sliding_window if sliding else 0)
    per_head = [n for n in find_nodes(gm, fused.rms_norm)
                if n.args[1].name.endswith(("q_norm", "k_norm"))]
    assert not per_head
    assert not find_nodes(gm, aten.remainder) or all(n.meta["flintc_layer"] is None
                                                      for n in find_nodes(gm, aten.remainder))


def assert_bit_exact(stage):
    check = stage.check
    assert check.passed and check.bit_exact, check.message
    assert {"logits", "k_cache_0", "v_cache_0", "k_cache_3"} <= {d.name for d in check.outputs}


def test_decode_is_fused_and_bit_exact():
    """Decode positions are random in [0, 48), so the W=9 rings have wrapped; sequence
    0 sits at position 0 (its ring and cache hold nothing it may see)."""
    g = graph("decode", 8)
    stage = run(g, at_zero=True)
    assert stage.result.matches == 4
    assert_fused(g)
    assert_bit_exact(stage)
    assert_old_ring_read_first(g)


def assert_old_ring_read_first(g):
    """Regression: torch's subgraph rewriter puts a replacement before the first user
    of its outputs, here `cat(ring, k)`, which the reference emits between the reads
    of the old k ring and of the old v ring, so v would be read after its overwrite.
    The pass moves the old-ring reads in front of the fused op; full layers read the
    cache after it."""
    order = {n: i for i, n in enumerate(g.gm.graph.nodes)}
    for op in find_nodes(g.gm, fused.qk_norm_rope_kv_write):
        sliding = op.args[-2]
        reads = [u for cache in op.args[7:9] for u in cache.users if u is not op]
        assert len(reads) == 2
        assert all((order[r] < order[op]) == sliding for r in reads), op.name


def assert_prefill_fused(g):
    """One `qk_norm_rope` per layer reading that layer's norm weights (and the RoPE rows
    in every layer, as the decode op); no per-head norm left; the two cache writes per
    layer left as captured, for fuse_prefill_attention."""
    c, gm = g.config, g.gm
    ops = find_nodes(gm, fused.qk_norm_rope)
    assert sorted(n.meta["flintc_layer"] for n in ops) == list(range(c.num_hidden_layers))
    assert not find_nodes(gm, fused.qk_norm_rope_kv_write)
    for n in ops:
        i = n.meta["flintc_layer"]
        assert [a.name for a in n.args[2:4]] == [f"w_layers_{i}_self_attn_q_norm",
                                                  f"w_layers_{i}_self_attn_k_norm"]
        assert n.args[-1] == c.is_sliding_layer(i)
    per_head = [n for n in find_nodes(gm, fused.rms_norm)
                if n.args[1].name.endswith(("q_norm", "k_norm"))]
    assert not per_head
    writes = sorted(n.args[0].name for n in find_nodes(gm, aten.index_put_))
    assert writes == sorted(f"{kv}_cache_{i}" for i in range(c.num_hidden_layers) for kv in "kv")


def test_long_prefill_with_canonicalize():
    """A chunk longer than the window (T=32 > W=9), with `canonicalize` first.

    Regression: at B=1 the full layers' write views v [1, T, 2, 32] as [T, 2, 32], and
    `canonicalize` folds that view chain into the linear's [T, 64] output, so a pattern's
    input can bind a tensor of another shape; `bind_inputs` views it back."""
    from flintc.passes.canonicalize import CanonicalizationPass

    g = graph("prefill", 1, 32)
    stage = run(g, [CanonicalizationPass, *PASSES])
    assert stage.result.matches == 4
    assert_prefill_fused(g)
    assert_bit_exact(stage)


def test_prefill_at_an_offset():
    """B=2, a 5-token chunk at p0 = 20 (wrapped rings; full layers' rows 20..24):
    bit-exact, the writes untouched."""
    g = graph("prefill", 2, 5)
    ctx = PassContext(g.config, g.step, g.batch, g.tokens, g.cache_len)
    checker = NumericChecker(tiny_model(), g)
    positions = checker.inputs[1]
    checker.inputs = (checker.inputs[0], positions - positions[:, :1] + 20, *checker.inputs[2:])
    stage = PassManager(PASSES, ctx, checker=checker).run(g).stages[-1]
    assert_prefill_fused(g)
    assert_bit_exact(stage)


def test_full_width_config_on_meta_weights():
    """Structure at the full model's widths (bf16 here; NVFP4 in the attention tests)."""
    cfg = FlintConfig.preset("full").replace(
        num_hidden_layers=3, n_routed_experts=16, vocab_size=1024,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"))
    meta = FlintModel(cfg, dummy_weights(cfg, "bf16", "meta"), max_positions=1024)
    g = capture(meta, "decode", batch=4, cache_len=1024)
    PassManager(PASSES, PassContext(cfg, "decode", 4, 1, 1024, "bf16")).run(g)
    assert_fused(g)
