"""CanonicalizationPass: aliases gone, view chains collapsed, numerics unchanged."""

import pytest

from flintc.passes.canonicalize import CanonicalizationPass
from harness import count_ops, run_passes


@pytest.mark.parametrize("step,batch,tokens", [("decode", 2, None), ("prefill", 1, 12)])
def test_canonicalize(step, batch, tokens):
    g, report = run_passes([CanonicalizationPass], step, batch, tokens)
    assert count_ops(g.gm, "aten.alias")["aten.alias"] == 0
    for node in g.gm.graph.nodes:
        if node.op == "call_function" and node.target.__name__.startswith("view"):
            assert not getattr(node.args[0], "target", None) or "view" not in str(node.args[0].target) \
                or len(node.args[0].users) > 1
    stage = report.stages[-1]
    assert stage.result.matches > 0 and stage.check.bit_exact
    assert stage.nodes < report.stages[0].nodes
