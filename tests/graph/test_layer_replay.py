"""Capture by layer replay (`flintc.graph.layer_replay`) gives the graph that tracing
every layer gives: same nodes, names, arguments, metadata and tags, same namer state
(the names later passes get), and the same numbers."""

from __future__ import annotations

import pytest
import torch
from torch.fx.node import map_arg

from flintc.checkpoint.dummy import dummy_weights
from flintc.checkpoint.init import random_weights
from flintc.config import FlintConfig
from flintc.graph.layer_replay import replay_plan
from flintc.graph.rewrite import meta_key
from flintc.graph.trace import capture
from flintc.model.reference import FlintModel

S, F = "sliding_attention", "full_attention"
# Seven layers, four dense: layer 0's kind and a MoE kind repeated;
# traced: layers 0, 1, 2, 4, 5; copied: 3 (from 2), 6 (from 4).
CFG = FlintConfig.preset("tiny").replace(num_hidden_layers=7, first_k_dense_replace=4,
                                         layer_types=(S, F, S, S, F, S, F))


def assert_same_graph(a, b) -> None:
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    assert [n.name for n in na] == [n.name for n in nb]
    for x, y in zip(na, nb):
        where = f"node {x.name}"
        assert (x.op, x.target, x.type) == (y.op, y.target, y.type), where
        names = lambda n: n.name  # noqa: E731
        assert map_arg(x.args, names) == map_arg(y.args, names), where
        assert map_arg(x.kwargs, names) == map_arg(y.kwargs, names), where
        assert list(x.meta) == list(y.meta), where
        for k in x.meta:
            if k == "val":
                assert meta_key(x.meta[k]) == meta_key(y.meta[k]), where
            else:
                assert x.meta[k] == y.meta[k], f"{where}: meta[{k!r}]"
    ga, gb = a.graph._graph_namespace, b.graph._graph_namespace
    assert ga._used_names == gb._used_names
    assert dict(ga._base_count) == dict(gb._base_count)
    assert type(a).__name__ == type(b).__name__
    assert sorted(vars(a)) == sorted(vars(b))


@pytest.mark.parametrize("step,batch,tokens", [("decode", 2, None), ("prefill", 1, 8)])
def test_replay_is_the_traced_graph(step, batch, tokens):
    model = FlintModel(CFG, dummy_weights(CFG, "bf16", "meta"), max_positions=64)
    plan = replay_plan(model, [n for n, _ in model.named_buffers()])
    assert plan is not None and plan.reps == [0, 1, 2, 4, 5]
    replayed = capture(model, step, batch=batch, tokens=tokens, cache_len=40)
    traced = capture(model, step, batch=batch, tokens=tokens, cache_len=40, replay_layers=False)
    assert_same_graph(replayed.gm, traced.gm)


def test_replay_runs_like_the_model():
    model = FlintModel(CFG, random_weights(CFG, 0))
    g = capture(model, "decode", batch=2, cache_len=24, stack_traces=False)
    ids, positions, slots, kv = g.example_inputs(model, seed=1)
    kv_ref = [t.clone() for t in kv]
    out = g.gm(*g.weight_args(model), ids, positions, slots, *kv)
    assert torch.equal(out, model(ids, positions, slots, kv_ref))
    assert all(torch.equal(a, b) for a, b in zip(kv, kv_ref))


def test_no_replay_when_a_layer_differs():
    """A layer whose weights differ from its kind's first layer (here: one layer's
    linears in NVFP4, the rest BF16) is traced, not copied."""
    w = dummy_weights(CFG, "bf16", "meta")
    nv = dummy_weights(CFG, "nvfp4", "meta")
    w.update({k: v for k, v in nv.items() if k.startswith("model.layers.6.")})
    model = FlintModel(CFG, w, max_positions=64)
    assert replay_plan(model, [n for n, _ in model.named_buffers()]) is None
