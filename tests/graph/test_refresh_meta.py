"""`refresh_meta` propagates fake values only where the graph changed since the last
refresh (or capture), and gets what a whole-graph propagation gets."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from flintc.checkpoint.dummy import dummy_weights
from flintc.config import FlintConfig
from flintc.graph.match import clone_graph_module, find_nodes
from flintc.graph.rewrite import mark_meta_current, meta_key, refresh_meta
from flintc.graph.trace import capture
from flintc.model.reference import FlintModel
from flintc.passes.base import PassContext
from flintc.passes.pipeline import DECODE_PIPELINE

aten = torch.ops.aten
TINY = FlintConfig.preset("tiny")


def full_propagation(gm) -> dict[str, tuple]:
    """Node name -> metadata of its value after FakeTensorProp over the whole graph."""
    copy = clone_graph_module(gm)
    fakes = [n.meta["val"] for n in copy.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(copy, mode=fakes[0].fake_mode).propagate_dont_convert_inputs(*fakes)
    return {n.name: meta_key(n.meta.get("val")) for n in copy.graph.nodes if n.op != "placeholder"}


def metadata(gm) -> dict[str, tuple]:
    return {n.name: meta_key(n.meta.get("val")) for n in gm.graph.nodes if n.op != "placeholder"}


def test_changed_node_and_its_users_are_recomputed():
    def f(x):
        return (x.view(4, 2) * 2).sum(0)

    gm = make_fx(f, tracing_mode="fake")(torch.empty(8))
    mark_meta_current(gm)
    (view,) = find_nodes(gm, aten.view)
    view.args = (view.args[0], [2, 4])  # a rewrite that changes shapes downstream
    refresh_meta(gm)
    assert metadata(gm) == full_propagation(gm)
    (total,) = find_nodes(gm, aten.sum)
    assert tuple(total.meta["val"].shape) == (4,)


def test_every_decode_pass_keeps_values_current():
    model = FlintModel(TINY, dummy_weights(TINY, "bf16", "meta"), max_positions=64)
    g = capture(model, "decode", batch=2, cache_len=40, stack_traces=False)
    ctx = PassContext(TINY, "decode", 2, 1, 40, "bf16")
    for pass_cls in DECODE_PIPELINE:
        pass_cls(ctx).run(g.gm)
        refresh_meta(g.gm)
        assert metadata(g.gm) == full_propagation(g.gm), pass_cls.name
