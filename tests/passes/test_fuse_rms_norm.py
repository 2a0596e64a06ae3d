"""RMSNormFusionPass: 4 norms per layer + the final one become flintc.rms_norm, bit-exact."""

import pytest

from flintc.passes.canonicalize import CanonicalizationPass
from flintc.passes.fuse_rms_norm import RMSNormFusionPass
from harness import TINY, count_ops, run_passes


@pytest.mark.parametrize("fmt,step,batch,tokens", [("bf16", "decode", 1, None), ("nvfp4", "decode", 3, None),
                                                   ("bf16", "prefill", 2, 11)])
def test_fuse_rms_norm(fmt, step, batch, tokens):
    g, report = run_passes([CanonicalizationPass, RMSNormFusionPass], step, batch, tokens, fmt)
    counts = count_ops(g.gm, "flintc.rms_norm", "aten.rsqrt")
    assert counts == {"flintc.rms_norm": 4 * TINY.num_hidden_layers + 1, "aten.rsqrt": 0}
    stage = report.stages[-1]
    assert stage.result.matches == 4 * TINY.num_hidden_layers + 1
    assert stage.check.passed and stage.check.bit_exact
    assert stage.kernels.per_forward < report.stages[1].kernels.per_forward
