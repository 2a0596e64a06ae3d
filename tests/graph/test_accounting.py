"""The kernel count rule, node kind by node kind."""

import torch

import flintc.ops  # noqa: F401
from flintc.graph.accounting import count_kernels, kernels_of
from flintc.graph.rewrite import trace_pattern
from harness import TINY


def _nodes(fn, *inputs):
    gm = trace_pattern(fn, inputs)
    return {n.name: kernels_of(n) for n in gm.graph.nodes}


def test_views_launch_nothing_and_ops_launch_one():
    x, w = torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.float32)
    counts = _nodes(lambda x, w: torch.ops.flintc.rms_norm(x.view(2, 2, 4).reshape(2, 8), w, 1e-5)
                    .to(torch.float32).t().sum(), x, w)
    assert counts["view"] == 0 and counts["t"] == 0 and counts["x_1"] == 0  # view, permute, placeholder
    assert counts["rms_norm"] == 1 and counts["_to_copy"] == 1 and counts["sum_1"] == 1
    assert counts["output"] == 0


def test_counts_group_by_layer(tmp_path):
    from harness import fresh_graph

    g = fresh_graph()
    c = count_kernels(g.gm, TINY)
    assert c.per_forward == sum(c.per_layer.values()) + c.shared
    assert set(c.per_kind) == {"dense", "moe"}
    assert c.per_kind["moe"] > c.per_kind["dense"]
