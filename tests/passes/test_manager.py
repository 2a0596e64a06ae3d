"""The pass manager: checks every pass, catches wrong ones by name, counts kernels."""

from __future__ import annotations

import json

import pytest
import torch

from flintc.checkpoint.init import random_weights
from flintc.graph.compare import Expectation
from flintc.graph.match import find_nodes, placeholder
from flintc.graph.rewrite import refresh_meta
from flintc.model.reference import FlintModel
from flintc.passes.base import GraphPass, PassResult
from flintc.passes.manager import NumericChecker, PassCheckError, PassManager
from harness import TINY, context, fresh_graph, tiny_model

aten = torch.ops.aten


class DropResidualAddPass(GraphPass):
    """Deliberately wrong: replaces layer 1's attention residual add by its input."""

    name = "drop_residual_add"

    def run(self, gm):
        # The residual add of layer 1: an add of two bf16 values upcast to fp32,
        # whose output is cast back to bf16 (ops.residual_add).
        adds = [n for n in find_nodes(gm, aten.add) if n.meta.get("flintc_layer") == 1
                and n.meta.get("flintc_block") is None and len(n.all_input_nodes) == 2]
        target = adds[0]
        target.replace_all_uses_with(target.args[0])
        gm.graph.eliminate_dead_code()
        return PassResult(matches=1)


class SwapExpertsPass(GraphPass):
    """Deliberately wrong: layer 2 reads expert 1's gate weights for expert 0 and back."""

    name = "swap_experts"

    def run(self, gm):
        w = placeholder(gm, "w_layers_2_mlp_experts_gate_proj")
        users = list(w.users)
        perm = torch.arange(w.meta["val"].shape[0])
        perm[0], perm[1] = 1, 0
        first_user = min(users, key=lambda u: list(gm.graph.nodes).index(u))
        with gm.graph.inserting_before(first_user):
            const = gm.graph.call_function(aten.arange.default, (w.meta["val"].shape[0],),
                                           {"device": torch.device("cpu")})
            swapped_idx = gm.graph.call_function(aten.bitwise_xor.Scalar, (const, 1))
            swapped = gm.graph.call_function(aten.index_select.default, (w, 0, swapped_idx))
        for u in users:
            u.replace_input_with(w, swapped)
        for n in (const, swapped_idx, swapped):
            n.meta["flintc_layer"] = 2
        refresh_meta(gm)
        return PassResult(matches=1)


class IdentityCopyPass(GraphPass):
    """Correct and bit-exact: inserts nothing, changes nothing."""

    name = "identity"

    def run(self, gm):
        return PassResult()


class LooseTolerancePass(DropResidualAddPass):
    name = "drop_residual_add_loose"
    expectation = Expectation("tolerance", atol=1e9, rtol=0, max_flip_share=1.0, why="test only")


def manager(passes, g, **kw):
    return PassManager(passes, context(g), checker=NumericChecker(tiny_model(), g), **kw)


def test_bit_exact_pass_passes_and_reports():
    g = fresh_graph()
    report = manager([IdentityCopyPass], g).run(g)
    assert [s.name for s in report.stages] == ["captured", "identity"]
    s = report.stages[1]
    assert s.check.passed and s.check.bit_exact and s.check.max_abs == 0 and s.check.experts_agree == 1.0
    assert s.kernels.per_forward == report.stages[0].kernels.per_forward
    json.dumps(report.as_dict())


def test_dropped_residual_add_is_caught_and_named():
    g = fresh_graph()
    with pytest.raises(PassCheckError) as info:
        manager([IdentityCopyPass, DropResidualAddPass], g).run(g)
    msg = str(info.value)
    assert "pass 'drop_residual_add'" in msg and "bit-exact" in msg
    assert "first differing node:" in msg and "none found" not in msg
    assert "output logits" in msg or "output k_cache_2" in msg or "cache" in msg
    assert not info.value.report.passed


def test_swapped_experts_are_caught():
    g = fresh_graph(batch=4)
    with pytest.raises(PassCheckError, match="swap_experts"):
        manager([SwapExpertsPass], g).run(g)


def test_nan_outputs_are_blamed_on_the_model_not_the_first_pass():
    """A check model whose logits hold NaN (here from a NaN weight) made the first pass
    fail its bit-exact check ("pass 'identity' missed its expectation", max abs nan): the
    captured graph already fails its check against itself, and the error now says so
    before any pass runs."""
    weights = dict(random_weights(TINY, 0))
    weights["model.norm.weight"] = weights["model.norm.weight"].clone()
    weights["model.norm.weight"][0] = float("nan")  # the final norm: every logit
    model = FlintModel(TINY, weights)
    g = fresh_graph(model=model)
    with pytest.raises(PassCheckError, match="captured graph does not reproduce itself before any pass .*"
                                             "outputs hold NaN") as info:
        PassManager([IdentityCopyPass], context(g), checker=NumericChecker(model, g)).run(g)
    assert "identity" not in str(info.value)
    assert [s.name for s in info.value.report.stages] == ["captured"]


def test_tolerance_is_honoured():
    g = fresh_graph()
    report = manager([LooseTolerancePass], g).run(g)
    check = report.stages[-1].check
    assert check.passed and not check.bit_exact and check.max_abs > 0


def test_passes_can_be_disabled_by_name():
    g = fresh_graph()
    report = manager([IdentityCopyPass, DropResidualAddPass], g, disabled=["drop_residual_add"]).run(g)
    assert [s.name for s in report.stages] == ["captured", "identity"]
    assert report.skipped == ["drop_residual_add"]
    with pytest.raises(Exception, match="unknown pass"):
        manager([IdentityCopyPass], g, disabled=["nope"])
