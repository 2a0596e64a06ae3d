"""AddRMSNormFusionPass: every residual add of a prefill graph, each read by an RMSNorm
(post-attention, the next layer's input norm, the final norm), becomes one
`flintc.add_rms_norm`, bit-exact; an add that no norm reads stays; decode is untouched."""

import itertools
import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.match import is_op
from flintc.model import ops
from flintc.passes.base import PassVerifyError
from flintc.passes.fuse_add_rms_norm import AddRMSNormFusionPass
from flintc.passes.pipeline import pipeline_for
from harness import TINY, compiled, count_ops, stage

F = torch.ops.flintc
L = TINY.num_hidden_layers


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fuse_add_rms_norm(fmt):
    g, report = compiled("prefill", fmt, batch=1, tokens=12)
    s = stage(report, "fuse_add_rms_norm")
    before = stage(report, "lower_gemm")
    assert s.check.passed and s.check.bit_exact and s.stage == "fused"
    assert s.result.matches == 2 * L
    # 5 kernels (4 for the add, the norm) -> 1, twice per layer
    assert before.kernels.per_forward - s.kernels.per_forward == 8 * L
    counts = count_ops(g.gm, "flintc.add_rms_norm", "flintc.rms_norm", "aten.add", "aten._to_copy")
    # the one norm left reads the embedding (layer 0's input norm): no add before it
    assert counts == {"flintc.add_rms_norm": 2 * L, "flintc.rms_norm": 1, "aten.add": 0, "aten._to_copy": 0}
    fused = [n for n in g.gm.graph.nodes if is_op(n, F.add_rms_norm)]
    # chained in order: each op's residual is the previous op's h (the first: the embedding)
    assert is_op(fused[0].args[0], F.embedding)
    for prev, node in itertools.pairwise(fused):
        h = node.args[0]
        assert h.target is operator.getitem and h.args == (prev, 0)
    # the last residual add folds into the final norm, before the LM head
    assert fused[-1].args[2].name == "w_norm"
    assert [n.meta["flintc_layer"] for n in fused] == [i for i in range(L) for _ in (0, 1)]
    AddRMSNormFusionPass(None).verify(g.gm)


def _two_adds(x, y, w):
    """A residual add read by an RMSNorm, then one that nothing normalises."""
    h = ops.residual_add(x, y, torch.float32)
    normed = F.rms_norm(h, w, 1e-5)
    return normed, ops.residual_add(h, normed, torch.float32)


def test_add_without_a_norm_stays():
    x, y = torch.randn(3, 16).to(torch.bfloat16), torch.randn(3, 16).to(torch.bfloat16)
    w = torch.rand(16) + 0.5
    gm = make_fx(_two_adds, tracing_mode="fake")(x, y, w)
    with pytest.raises(PassVerifyError, match="left unfused"):
        AddRMSNormFusionPass(None).verify(gm)
    want = make_fx(_two_adds)(x, y, w)(x, y, w)
    result = AddRMSNormFusionPass(None).run(gm)
    gm.recompile()
    assert result.matches == 1
    assert count_ops(gm, "flintc.add_rms_norm", "flintc.rms_norm", "aten.add") == {
        "flintc.add_rms_norm": 1, "flintc.rms_norm": 0, "aten.add": 1}
    AddRMSNormFusionPass(None).verify(gm)
    got = gm(x, y, w)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want))


def test_decode_is_untouched():
    assert AddRMSNormFusionPass not in pipeline_for("decode")
    assert AddRMSNormFusionPass.steps == ("prefill",)
    g, _ = compiled("decode", "bf16")
    assert count_ops(g.gm, "flintc.add_rms_norm")["flintc.add_rms_norm"] == 0
