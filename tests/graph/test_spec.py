"""The legality checker rejects each kind of malformed graph it claims to catch."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx import Graph

from flintc.graph.match import find_nodes, placeholder
from flintc.graph.spec import GraphLegalityError, check_graph
from harness import fresh_graph

aten = torch.ops.aten


def names(gm):
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def test_captured_graph_is_legal():
    g = fresh_graph()
    check_graph(g.gm, "captured", names(g.gm))
    check_graph(g.gm, "fused", names(g.gm))


def test_dangling_use_is_rejected():
    g = fresh_graph()
    foreign = Graph().placeholder("elsewhere")
    node = find_nodes(g.gm, aten.rsqrt)[0]
    node.args = (foreign,)
    with pytest.raises(GraphLegalityError, match="rsqrt"):
        check_graph(g.gm, "captured")


def test_missing_metadata_is_named():
    g = fresh_graph()
    node = find_nodes(g.gm, aten.sigmoid)[0]
    del node.meta["val"]
    with pytest.raises(GraphLegalityError, match=rf"meta\['val'\].*{node.name}"):
        check_graph(g.gm, "captured")
    node.meta["val"] = None
    g2 = fresh_graph()
    del find_nodes(g2.gm, aten.mm)[0].meta["flintc_layer"]
    with pytest.raises(GraphLegalityError, match="flintc_layer"):
        check_graph(g2.gm, "captured")


def test_op_not_allowed_at_stage():
    g = fresh_graph()
    with pytest.raises(GraphLegalityError, match="not allowed at this stage.*input_ids"):
        check_graph(g.gm, "lowered")


def test_write_into_a_weight_is_rejected():
    g = fresh_graph()
    put = find_nodes(g.gm, aten.index_put_)[0]
    weight = placeholder(g.gm, "w_layers_0_self_attn_q_proj")
    put.args = (weight, *put.args[1:])
    with pytest.raises(GraphLegalityError, match="w_layers_0_self_attn_q_proj.*not a KV-cache"):
        check_graph(g.gm, "captured")


def test_dead_node_is_rejected():
    g = fresh_graph()
    x = find_nodes(g.gm, aten.rsqrt)[0]
    with g.gm.graph.inserting_after(x):
        dead = g.gm.graph.call_function(aten.neg.default, (x,))
    dead.meta.update(val=x.meta["val"], flintc_layer=0)
    with pytest.raises(GraphLegalityError, match="dead node.*neg"):
        check_graph(g.gm, "captured")


def test_changed_placeholders_are_rejected():
    g = fresh_graph()
    expected = names(g.gm)
    placeholder(g.gm, "slots")._rename("slot_ids")
    with pytest.raises(GraphLegalityError, match=r"placeholders changed \(missing slots, new slot_ids\)"):
        check_graph(g.gm, "captured", expected)
    with pytest.raises(GraphLegalityError, match=r"placeholders changed \(the same names in another order\)"):
        check_graph(g.gm, "captured", list(reversed(names(g.gm))))


def test_non_fp32_logits_are_rejected():
    g = fresh_graph()
    out = next(n for n in g.gm.graph.nodes if n.op == "output")
    logits = out.args[0]
    with g.gm.graph.inserting_before(out):
        cast = g.gm.graph.call_function(aten._to_copy.default, (logits,), {"dtype": torch.bfloat16})
    cast.meta.update(val=logits.meta["val"].to(torch.bfloat16), flintc_layer=4)
    out.args = (cast,)
    with pytest.raises(GraphLegalityError, match="fp32"):
        check_graph(g.gm, "captured")


def test_getitem_of_multi_output_is_not_dead():
    g = fresh_graph()
    sort = find_nodes(g.gm, aten.sort)[0]
    assert any(u.target is operator.getitem for u in sort.users)
    check_graph(g.gm, "captured")
