"""MoEFusionPass: each MoE block becomes moe_route + moe_gate_up + moe_down_combine,
bit-exact against the graph before, in bf16 and NVFP4, decode and prefill."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from flintc.checkpoint.dummy import dummy_weights
from flintc.checkpoint.init import random_weights
from flintc.config import FlintConfig
from flintc.graph.match import clone_graph_module, find_nodes, op_name
from flintc.graph.rewrite import refresh_meta, replace_pattern, trace_pattern
from flintc.graph.trace import CapturedGraph, capture
from flintc.model import ops
from flintc.model.reference import FlintModel
from flintc.passes.base import GraphPass, PassResult, PassVerifyError
from flintc.passes.canonicalize import CanonicalizationPass
from flintc.passes.fuse_moe import MoEFusionPass
from flintc.passes.fuse_rms_norm import RMSNormFusionPass
from flintc.passes.fuse_silu_mul import SiLUMulFusionPass
from flintc.passes.manager import NumericChecker, PassManager, PipelineReport
from harness import TINY, context, fresh_graph, tiny_model, tiny_nvfp4_model

aten = torch.ops.aten
MOE_LAYERS = [i for i in range(TINY.num_hidden_layers) if TINY.is_moe_layer(i)]


def model_for(fmt: str) -> FlintModel:
    return tiny_nvfp4_model() if fmt == "nvfp4" else tiny_model()


def moe_ops(gm) -> Counter:
    """Op name -> count over the nodes of every MoE block."""
    return Counter(op_name(n) for n in gm.graph.nodes
                   if n.op == "call_function" and n.meta.get("flintc_block") == "moe")


def fused_counts(num_layers: int) -> Counter:
    return Counter({"flintc.moe_route": num_layers, "flintc.moe_gate_up": num_layers,
                    "flintc.moe_down_combine": num_layers, "getitem": 2 * num_layers})


@dataclass
class Run:
    graph: CapturedGraph
    before: torch.fx.GraphModule
    report: PipelineReport


CASES = [("bf16", "decode", 1, None), ("bf16", "decode", 4, None), ("bf16", "prefill", 2, 12),
         ("nvfp4", "decode", 1, None), ("nvfp4", "decode", 4, None), ("nvfp4", "prefill", 1, 12)]
BF16_DECODE, BF16_PREFILL = CASES[1], CASES[2]


@functools.lru_cache(maxsize=None)
def _captured(case) -> CapturedGraph:
    fmt, step, batch, tokens = case
    return fresh_graph(step, batch=batch, tokens=tokens, model=model_for(fmt))


def run_on_copy(case, passes) -> Run:
    """Run `passes` under the numeric checker on a copy of `case`'s capture (captures
    are the slow part: each is taken once); `before` is that copy before any pass."""
    fmt, captured = case[0], _captured(case)
    g = dataclasses.replace(captured, gm=clone_graph_module(captured.gm))
    report = PassManager(passes, context(g, fmt), checker=NumericChecker(model_for(fmt), g)).run(g)
    return Run(g, captured.gm, report)


@functools.lru_cache(maxsize=None)
def fused_run(case) -> Run:
    return run_on_copy(case, [MoEFusionPass])


def _case_id(case) -> str:
    fmt, step, batch, tokens = case
    return f"{fmt}-{step}-B{batch}" + (f"-T{tokens}" if tokens else "")


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def run(request) -> Run:
    return fused_run(request.param)


def test_moe_blocks_become_three_fused_ops(run):
    before, after = moe_ops(run.before), moe_ops(run.graph.gm)
    for op in ("aten.sort", "aten.sigmoid", "aten.gather", "aten.index", "aten.bmm"):
        assert before[op] >= len(MOE_LAYERS), op
    assert after == fused_counts(len(MOE_LAYERS))
    assert not find_nodes(run.graph.gm, aten.sort) and not find_nodes(run.graph.gm, aten.gather)
    stage = run.report.stages[-1]
    assert stage.result.matches == len(MOE_LAYERS)
    assert stage.kernels.per_kind["moe"] < run.report.stages[0].kernels.per_kind["moe"]


def test_selected_experts_tag_is_on_the_ids_getitem(run):
    gm = run.graph.gm
    tagged = [n for n in gm.graph.nodes if n.meta.get("flintc_role") == "moe_selected"]
    assert sorted(n.meta["flintc_layer"] for n in tagged) == MOE_LAYERS
    N = run.graph.batch * run.graph.tokens
    for n in tagged:
        assert n.args[0].target is torch.ops.flintc.moe_route.default and n.args[1] == 1
        assert n.meta["val"].dtype == torch.int64
        assert tuple(n.meta["val"].shape) == (N, TINY.num_experts_per_tok)
        assert {u.target for u in n.users} == {torch.ops.flintc.moe_gate_up.default,
                                                torch.ops.flintc.moe_down_combine.default}


def test_bit_exact_with_the_same_experts(run):
    check = run.report.stages[-1].check
    assert check.passed and check.bit_exact and check.max_abs == 0, check.message
    assert check.experts_agree == 1.0


def test_verify_rejects_unfused_and_untagged_graphs():
    r = fused_run(BF16_DECODE)
    p = MoEFusionPass(context(r.graph))
    with pytest.raises(PassVerifyError, match="unfused MoE routing"):
        p.verify(r.before)
    gm = clone_graph_module(r.graph.gm)
    next(n for n in gm.graph.nodes if n.meta.get("flintc_role")).meta.pop("flintc_role")
    with pytest.raises(PassVerifyError, match="moe_selected"):
        p.verify(gm)


def test_full_width_few_layers_on_meta_weights():
    """Full-width shapes (H=2048, F=512, K=6) in NVFP4 (the checkpoint format), traced on
    `meta` weights: structure only."""
    fmt = "nvfp4"
    cfg = FlintConfig.preset("full").replace(num_hidden_layers=3, n_routed_experts=16,
                                             vocab_size=1024)
    model = FlintModel(cfg, dummy_weights(cfg, fmt, "meta"), max_positions=64)
    g = capture(model, "decode", batch=8, cache_len=64)
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    report = PassManager([MoEFusionPass], context(g, fmt)).run(g)  # legality + verify, no numerics
    assert report.stages[-1].result.matches == len(layers) == 1
    assert moe_ops(g.gm) == fused_counts(len(layers))
    h = find_nodes(g.gm, torch.ops.flintc.moe_gate_up)[0].meta["val"]
    assert tuple(h.shape) == (8, cfg.num_experts_per_tok + 1, cfg.moe_intermediate_size)


def test_unused_sort_values_do_not_block_the_match():
    """Bug: capture leaves `getitem(sort, 0)` (the sorted values) with no user, and
    torch's SubgraphMatcher rejects a match whose inner node (the sort) has a user
    outside it: without `canonicalize` (which drops dead nodes) no MoE block matched."""
    r = fused_run(BF16_DECODE)
    sorts = find_nodes(r.before, aten.sort)
    assert any(not u.users for s in sorts for u in s.users)  # the capture still leaves them
    assert moe_ops(r.graph.gm) == fused_counts(len(MOE_LAYERS))


class SharedSiLUMulFusion(GraphPass):
    """`fuse_silu_mul` restricted to rank-2 activations (dense MLPs, shared experts):
    leaves the routed experts' [N, K, F] SiLU-and-mul unfused."""

    name = "fuse_shared_silu_mul"

    def run(self, gm):
        g, u = torch.empty(2, 8, dtype=torch.bfloat16), torch.empty(2, 8, dtype=torch.bfloat16)
        search = trace_pattern(lambda g, u: ops.silu_mul(g, u, torch.float32), (g, u))
        replace = trace_pattern(lambda g, u: torch.ops.flintc.silu_mul(g, u), (g, u))
        is_rank2 = lambda m, *_: m.returning_nodes[0].meta["val"].dim() == 2  # noqa: E731
        matches = replace_pattern(gm, search, replace, match_filters=[is_rank2])
        refresh_meta(gm)
        return PassResult(matches=len(matches))


def test_after_the_upstream_passes():
    """In the pipeline's order: after `canonicalize`, `fuse_rms_norm` and
    `fuse_silu_mul`, the traced pattern alone no longer matches; the pass matches it
    as those passes leave it."""
    upstream = [CanonicalizationPass, RMSNormFusionPass, SiLUMulFusionPass]
    r = run_on_copy(BF16_PREFILL, upstream + [MoEFusionPass])
    assert r.report.stages[-2].result.matches == TINY.first_k_dense_replace + 2 * len(MOE_LAYERS)
    assert moe_ops(r.graph.gm) == fused_counts(len(MOE_LAYERS))
    assert "silu_mul" in " ".join(r.report.stages[-1].result.notes)
    check = r.report.stages[-1].check
    assert check.passed and check.bit_exact and check.experts_agree == 1.0


def test_shared_expert_silu_mul_fused_alone():
    """Only the shared expert's SiLU-and-mul fused upstream: the pattern's form is
    read per site (routed [N, K, F], shared [N, F]) from the graph."""
    r = run_on_copy(BF16_DECODE, [SharedSiLUMulFusion, MoEFusionPass])
    assert r.report.stages[-2].result.matches == TINY.first_k_dense_replace + len(MOE_LAYERS)
    assert moe_ops(r.graph.gm) == fused_counts(len(MOE_LAYERS))
    check = r.report.stages[-1].check
    assert check.passed and check.bit_exact and check.experts_agree == 1.0


def test_config_without_shared_expert():
    """`n_shared_experts = 0`: no shared DenseMLP in the pattern, empty weight lists in the
    fused ops (their `[]` form)."""
    cfg = TINY.replace(n_shared_experts=0)
    model = FlintModel(cfg, random_weights(cfg, 0))
    g = fresh_graph("decode", batch=3, model=model)
    report = PassManager([MoEFusionPass], context(g), checker=NumericChecker(model, g)).run(g)
    assert moe_ops(g.gm) == fused_counts(len(MOE_LAYERS))
    gate_up = find_nodes(g.gm, torch.ops.flintc.moe_gate_up)[0]
    assert gate_up.args[4] == [] and gate_up.args[5] == []
    K, F = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    assert tuple(gate_up.meta["val"].shape) == (3, K, F)
    check = report.stages[-1].check
    assert check.passed and check.bit_exact and check.experts_agree == 1.0


def test_pattern_follows_a_canonicalize_that_rewrites_moe_ops(monkeypatch):
    """When `canonicalize` rewrites inside the MoE block (here it also drops no-op
    expands, which the expert matmuls have), the traced pattern no longer matches and
    the pass matches the pattern as `canonicalize` leaves it."""
    original = CanonicalizationPass.run

    def run_and_drop_noop_expands(self, gm):
        result = original(self, gm)
        for n in find_nodes(gm, aten.expand):
            if tuple(n.args[0].meta["val"].shape) == tuple(n.meta["val"].shape):
                n.replace_all_uses_with(n.args[0])
                gm.graph.erase_node(n)
        return result

    monkeypatch.setattr(CanonicalizationPass, "run", run_and_drop_noop_expands)
    r = run_on_copy(BF16_DECODE, [CanonicalizationPass, MoEFusionPass])
    assert moe_ops(r.graph.gm) == fused_counts(len(MOE_LAYERS))
    notes = r.report.stages[-1].result.notes
    assert notes == [f"{len(MOE_LAYERS)} MoE block(s) matched the canonical pattern"]
    check = r.report.stages[-1].check
    assert check.passed and check.bit_exact and check.experts_agree == 1.0
