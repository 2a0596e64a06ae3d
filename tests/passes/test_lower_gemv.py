"""SmallBatchGEMVLoweringPass: every decode linear, the LM head and the embedding become
flintc ops over the packed weights; bit-exact."""

import pytest

from harness import TINY, compiled, count_ops, stage


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_lower_gemv(fmt):
    g, report = compiled("decode", fmt, disabled=("group_low_latency", "mark_pdl"))
    s = stage(report, "lower_gemv")
    # q, k, v, o per layer + the dense gate/up/down, + LM head + embedding
    linears = 4 * TINY.num_hidden_layers + 3 * TINY.first_k_dense_replace
    assert s.result.matches == linears + 2
    counts = count_ops(g.gm, "flintc.gemv", "flintc.lm_head", "flintc.embedding", "aten.mm", "aten.bmm")
    assert counts == {"flintc.gemv": linears, "flintc.lm_head": 1, "flintc.embedding": 1,
                      "aten.mm": 0, "aten.bmm": 0}
    assert s.check.bit_exact and s.kernels.per_forward < report.stages[s.index - 1].kernels.per_forward


def test_unfused_router_is_left_for_fuse_moe():
    """Regression: with fuse_moe switched off, lower_gemv's check took the router's matmul
    (which feeds a sigmoid, not a bf16 cast) for an unlowered linear and stopped the
    pipeline; it now lowers the linears and leaves the router to fuse_moe."""
    g, report = compiled("decode", "bf16", disabled=("fuse_moe", "group_low_latency", "mark_pdl"))
    assert stage(report, "lower_gemv").check.bit_exact
    assert count_ops(g.gm, "aten.mm")["aten.mm"] == TINY.num_hidden_layers - TINY.first_k_dense_replace
