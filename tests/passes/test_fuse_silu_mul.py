"""SiLUMulFusionPass: dense, shared and routed activations become flintc.silu_mul."""

import pytest

from flintc.passes.canonicalize import CanonicalizationPass
from flintc.passes.fuse_rms_norm import RMSNormFusionPass
from flintc.passes.fuse_silu_mul import SiLUMulFusionPass
from harness import TINY, count_ops, run_passes


@pytest.mark.parametrize("fmt,step,tokens", [("bf16", "decode", None), ("nvfp4", "prefill", 10)])
def test_fuse_silu_mul(fmt, step, tokens):
    g, report = run_passes([CanonicalizationPass, RMSNormFusionPass, SiLUMulFusionPass], step, 2, tokens, fmt)
    n_dense = TINY.first_k_dense_replace
    n_moe = TINY.num_hidden_layers - n_dense
    expected = n_dense + 2 * n_moe  # dense MLPs, then per MoE layer: routed and shared
    assert count_ops(g.gm, "flintc.silu_mul")["flintc.silu_mul"] == expected
    # the only sigmoids left are the routers'
    assert count_ops(g.gm, "aten.sigmoid")["aten.sigmoid"] == n_moe
    assert report.stages[-1].check.bit_exact


def test_pattern_needs_distinct_example_tensors():
    """Regression: tracing a pattern with one tensor passed twice merged both inputs
    into one placeholder, so the pattern never matched (0 rewrites)."""
    import torch

    from flintc.graph.rewrite import trace_pattern

    t = torch.empty(2, 2)
    with pytest.raises(ValueError, match="distinct"):
        trace_pattern(lambda a, b: a * b, (t, t))
