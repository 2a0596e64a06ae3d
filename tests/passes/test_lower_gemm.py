"""GEMMLoweringPass: the prefill twin of lower_gemv; bit-exact."""

import pytest

from harness import TINY, compiled, count_ops, stage


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_lower_gemm(fmt):
    g, report = compiled("prefill", fmt, batch=1, tokens=12)
    s = stage(report, "lower_gemm")
    linears = 4 * TINY.num_hidden_layers + 3 * TINY.first_k_dense_replace
    counts = count_ops(g.gm, "flintc.gemm", "flintc.gemv", "flintc.lm_head", "aten.mm")
    assert counts == {"flintc.gemm": linears, "flintc.gemv": 0, "flintc.lm_head": 1, "aten.mm": 0}
    assert s.check.bit_exact and s.stage == "fused"
