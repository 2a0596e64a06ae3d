"""LowLatencyGroupingPass: 7 kernels per MoE layer, 6 per dense layer, bit-exact, and
only flintc ops left (stage `lowered`)."""

import pytest

from flintc.graph.accounting import kernels_of
from flintc.graph.match import op_name
from harness import TINY, compiled, count_ops, stage


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_group_low_latency(fmt):
    g, report = compiled("decode", fmt)
    s = stage(report, "group_low_latency")
    assert s.check.bit_exact and s.stage == "lowered"
    assert s.kernels.per_kind == {"dense": 6, "moe": 7}
    n_moe = TINY.num_hidden_layers - TINY.first_k_dense_replace
    counts = count_ops(g.gm, "flintc.norm_qkv_rope_kv", "flintc.norm_router", "flintc.moe_topk_gate_up",
                       "flintc.moe_down_combine_residual", "flintc.norm_gate_up_silu", "flintc.norm_lm_head",
                       "flintc.rms_norm", "flintc.lm_head")
    # the head: the final rms_norm and the plain lm_head apart (SPLIT_LM_HEAD_NORM, the default)
    assert counts == {"flintc.norm_qkv_rope_kv": TINY.num_hidden_layers, "flintc.norm_router": n_moe,
                      "flintc.moe_topk_gate_up": n_moe, "flintc.moe_down_combine_residual": n_moe,
                      "flintc.norm_gate_up_silu": TINY.first_k_dense_replace, "flintc.norm_lm_head": 0,
                      "flintc.rms_norm": 1, "flintc.lm_head": 1}
    for n in g.gm.graph.nodes:
        if kernels_of(n):
            assert op_name(n).startswith("flintc."), n.name
    # K6 gets K7's routed down weights (its L2 prefetch hint): the same graph inputs
    for n in g.gm.graph.nodes:
        if op_name(n) == "flintc.moe_topk_gate_up":
            downs = list({u for h in n.users for u in h.users if op_name(u) == "flintc.moe_down_combine_residual"})
            assert len(downs) == 1 and len(n.args) == 10 and n.args[9] == downs[0].args[3], n.name


def test_old_cache_writers_are_erased():
    """Regression: the replaced qk_norm_rope_kv_write ops write the cache, so dead-code
    elimination kept them (and the RoPE row gathers feeding them) after grouping."""
    g, _ = compiled("decode", "bf16")
    assert count_ops(g.gm, "flintc.qk_norm_rope_kv_write", "aten.index") == {
        "flintc.qk_norm_rope_kv_write": 0, "aten.index": 0}


def test_chained_residual_adds_fold():
    """Regression: the residual adds were matched all at once; a later add's residual
    input was an earlier add's output, which had been replaced, so the stale node kept
    aten casts alive in the lowered graph. Each layer's two adds now fold in order."""
    g, _ = compiled("decode", "bf16", batch=1)
    assert count_ops(g.gm, "aten.add", "aten._to_copy") == {"aten.add": 0, "aten._to_copy": 0}
    assert count_ops(g.gm, "flintc.gemv_residual")["flintc.gemv_residual"] == \
        TINY.num_hidden_layers + TINY.first_k_dense_replace


def test_fold_attention_combine_needs_sole_readers():
    """With `fold_attention_combine`, a decode_attention whose partials something else also
    reads (here an extra aten.sum of one layer's o_part) keeps its two kernels; the other
    layers fold. Without the option nothing folds."""
    import operator

    import torch

    from flintc.passes.group_low_latency import LowLatencyGroupingPass
    from flintc.passes.pipeline import pipeline_for
    from harness import context, run_passes

    upto = pipeline_for("decode")[:pipeline_for("decode").index(LowLatencyGroupingPass)]
    for fold in (False, True):
        g, _ = run_passes(upto)
        gm = g.gm
        attn = [n for n in gm.graph.nodes if op_name(n) == "flintc.decode_attention"]
        o_part = next(u for u in attn[0].users if u.target is operator.getitem and u.args[1] == 0)
        with gm.graph.inserting_after(o_part):
            extra = gm.graph.call_function(torch.ops.aten.sum.default, (o_part,))
        out = next(n for n in gm.graph.nodes if n.op == "output")
        out.args = ((*out.args[0], extra),) if isinstance(out.args[0], tuple) else ((out.args[0], extra),)
        gm.recompile()
        ctx = context(g)
        ctx.options["fold_attention_combine"] = fold
        LowLatencyGroupingPass(ctx).run(gm)
        got = count_ops(gm, "flintc.decode_attention", "flintc.attention_combine",
                        "flintc.decode_attention_combine")
        layers = TINY.num_hidden_layers
        want = ({"flintc.decode_attention": 1, "flintc.attention_combine": 1,
                 "flintc.decode_attention_combine": layers - 1} if fold else
                {"flintc.decode_attention": layers, "flintc.attention_combine": layers,
                 "flintc.decode_attention_combine": 0})
        assert got == want, (fold, got)


def test_split_lm_head_norm_leaves_the_head_apart():
    """With `split_lm_head_norm` the pass folds everything but the head: the final rms_norm
    and the lm_head stay two kernels (one more per forward) and verify allows them; without
    the option the head is one norm_lm_head, and verify refuses a head of two kernels."""
    import copy

    from flintc.graph.accounting import count_kernels
    from flintc.passes.base import PassVerifyError
    from flintc.passes.group_low_latency import LowLatencyGroupingPass
    from flintc.passes.manager import PassManager
    from flintc.passes.pipeline import pipeline_for
    from harness import context, fresh_graph

    upto = pipeline_for("decode")[:pipeline_for("decode").index(LowLatencyGroupingPass)]
    g = fresh_graph()
    ctx = context(g)
    PassManager(upto, ctx).run(g)  # no numeric checks: test_pipeline checks the option's
    got = {}
    for split in (False, True):
        gm = copy.deepcopy(g.gm)  # the pass rewrites in place
        ctx.options["split_lm_head_norm"] = split
        grouping = LowLatencyGroupingPass(ctx)
        grouping.run(gm)
        grouping.verify(gm)
        got[split] = (count_ops(gm, "flintc.norm_lm_head", "flintc.rms_norm", "flintc.lm_head"),
                      count_kernels(gm, TINY).per_forward)
    assert got[False][0] == {"flintc.norm_lm_head": 1, "flintc.rms_norm": 0, "flintc.lm_head": 0}
    assert got[True][0] == {"flintc.norm_lm_head": 0, "flintc.rms_norm": 1, "flintc.lm_head": 1}
    assert got[True][1] == got[False][1] + 1
    ctx.options["split_lm_head_norm"] = False  # the split graph checked as a default one
    with pytest.raises(PassVerifyError, match="the LM head has 2 kernels, more than 1"):
        LowLatencyGroupingPass(ctx).verify(gm)
