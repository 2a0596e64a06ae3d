"""Pipeline dumps (`flintc.graph.dump`): files per stage, index.md, report.json, ONNX.

Runs `PassManager` on tiny decode and prefill captures with an empty pass list,
and once with a hand-made pass that swaps two aten ops for custom ops in a
`flintc_test` namespace (one of them with two outputs), to see op domains and
`getitem` outputs handled before the real `flintc` ops exist.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
from xml.dom import minidom

import onnx
import pydot
import pytest
import torch

import flintc.passes.manager as manager_module
from flintc.checkpoint.init import random_weights
from flintc.config import FlintConfig
from flintc.graph.dump_dot import CUSTOM
from flintc.graph.match import clone_graph_module
from flintc.graph.spec import _mutated_args
from flintc.graph.trace import capture
from flintc.model.reference import FlintModel
from flintc.graph.spec import GraphLegalityError
from flintc.passes.base import GraphPass, PassContext, PassResult, PassVerifyError
from flintc.passes.manager import NumericChecker, PassManager

aten = torch.ops.aten
STAGE_KEYS = ("name", "nodes", "kernels_per_forward", "kernels_per_layer", "check")
CHECK_KEYS = ("expected", "passed", "max_abs", "max_rel", "share_differing")


@torch.library.custom_op("flintc_test::rsqrt", mutates_args=())
def _test_rsqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x)


@_test_rsqrt.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("flintc_test::sort_stable", mutates_args=())
def _test_sort(x: torch.Tensor, dim: int, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.sort(x, dim=dim, descending=descending, stable=True)
    return values, indices


@_test_sort.register_fake
def _(x, dim, descending):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.long)


class SwapToTestOpsPass(GraphPass):
    """Retargets `aten.rsqrt` and `aten.sort.stable` to the `flintc_test` ops above
    (bit-exact: they call the same torch functions)."""

    name = "swap_test_ops"
    stage = "fused"

    def run(self, gm):
        matches = 0
        for node in gm.graph.nodes:
            if node.target is aten.rsqrt.default:
                node.target = torch.ops.flintc_test.rsqrt.default
            elif node.target is aten.sort.stable:
                dim, descending = node.kwargs.get("dim", -1), node.kwargs.get("descending", False)
                node.target = torch.ops.flintc_test.sort_stable.default
                node.args, node.kwargs = (node.args[0], dim, descending), {}
            else:
                continue
            matches += 1
        return PassResult(matches=matches)


@pytest.fixture(scope="module")
def tiny_model():
    cfg = FlintConfig.preset("tiny")
    return FlintModel(cfg, random_weights(cfg, seed=0))


@pytest.fixture(scope="module")
def captures(tiny_model):
    """step -> a capture, made once (capturing costs seconds); tests run passes on a
    copy, see `run_pipeline`."""
    steps = ("decode", "prefill")
    return {step: capture(tiny_model, step, batch=2, cache_len=64) for step in steps}


def run_pipeline(model, captured, out_dir, passes=(), check=True, options=None):
    """Run `passes` on a copy of `captured` (pass options `options`), dumping into
    `out_dir`; (graph, report)."""
    g = dataclasses.replace(captured, gm=clone_graph_module(captured.gm))
    ctx = PassContext(model.config, g.step, g.batch, g.tokens, g.cache_len, options=dict(options or {}))
    checker = NumericChecker(model, g) if check else None
    report = PassManager(list(passes), ctx, checker=checker, dump_dir=out_dir).run(g)
    return g, report


def fx_op_count(gm) -> int:
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    return sum(1 for n in ops if n.target is not operator.getitem)


def check_stage_files(out, prefix, gm):
    """Every dump of one stage exists and parses; returns the ONNX model."""
    views = ["summary", "layer0-dense", "layer2-moe"]  # tiny: layers 0-1 dense, 2-3 MoE
    expected = [f"{prefix}.py", f"{prefix}.onnx"]
    expected += [f"{prefix}.{v}.{ext}" for v in views for ext in ("dot", "svg")]
    for name in expected:
        assert (out / name).is_file(), f"missing {name}"
    for v in views:
        minidom.parse(str(out / f"{prefix}.{v}.svg"))  # valid XML
    # pydot's parser takes seconds on a layer view: parse the summary, spot-check the rest.
    assert pydot.graph_from_dot_file(str(out / f"{prefix}.summary.dot"))
    dense = (out / f"{prefix}.layer0-dense.dot").read_text()
    assert dense.startswith("strict digraph") and dense.rstrip().endswith("}")
    layer0 = [n.name for n in gm.graph.nodes if n.meta.get("flintc_layer") == 0]
    assert all(f"\n{name} [" in dense or f"\n{name};" in dense for name in layer0)
    code = (out / f"{prefix}.py").read_text()
    assert "def forward" in code and 'bf16[2, ' in code  # dtype and shape per line
    ast.parse(code)
    model = onnx.load(str(out / f"{prefix}.onnx"))
    onnx.checker.check_model(model, full_check=False)
    assert len(model.graph.node) == fx_op_count(gm)
    assert not model.graph.initializer  # weights are inputs, not embedded
    return model


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_dump_of_capture(tiny_model, captures, tmp_path, step):
    g, report = run_pipeline(tiny_model, captures[step], tmp_path)
    model = check_stage_files(tmp_path, "00-captured", g.gm)

    placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
    assert [i.name for i in model.graph.input] == [n.name for n in placeholders]
    ids = next(i for i in model.graph.input if i.name == "input_ids")
    assert ids.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [d.dim_value for d in ids.type.tensor_type.shape.dim] == [2, g.tokens]
    outs = g.gm.graph.output_node().args[0]
    outs = list(outs) if isinstance(outs, tuple) else [outs]  # prefill: logits of logits_rows, hidden states
    assert len(outs) == (2 if step == "prefill" else 1)
    assert [o.name for o in model.graph.output][:len(outs)] == [o.name for o in outs]  # logits first
    # then every in-place cache write that nothing reads, in graph order
    writes = [n.name for n in g.gm.graph.nodes
              if n.op == "call_function" and _mutated_args(n) and not n.users]
    assert writes and [o.name for o in model.graph.output][len(outs):] == writes
    domains = {o.domain: o.version for o in model.opset_import}
    assert domains["aten"] == 1 and domains["flintc"] == 1 and domains[""] >= 1
    assert {n.domain for n in model.graph.node} == {"aten"}
    typed = {v.name for v in model.graph.value_info}
    assert all(out in typed for n in model.graph.node for out in n.output)

    index = (tmp_path / "index.md").read_text()
    assert "| 0 | captured | captured |" in index and "(00-captured.onnx)" in index
    data = json.loads((tmp_path / "report.json").read_text())
    assert {"config", "step", "batch", "options", "stages"} <= set(data)
    assert data["step"] == step and data["batch"] == 2 and data["options"] == {}
    (stage,) = data["stages"]
    assert all(k in stage for k in STAGE_KEYS)
    assert set(stage["kernels_per_layer"]) == {"dense", "moe"}
    assert all(k in stage["check"] for k in CHECK_KEYS) and stage["check"]["passed"]
    assert stage["kernels_per_forward"] == report.stages[0].kernels.per_forward
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_dump_of_custom_ops(tiny_model, captures, tmp_path, monkeypatch):
    # flintc_test ops are legal at no stage; this test is about the dumps, so skip legality.
    monkeypatch.setattr(manager_module, "check_graph", lambda *args, **kwargs: None)
    g, report = run_pipeline(tiny_model, captures["decode"], tmp_path, [SwapToTestOpsPass])
    assert report.stages[1].result.matches > 0 and report.stages[1].check.passed
    model = check_stage_files(tmp_path, "01-swap_test_ops", g.gm)

    assert {o.domain for o in model.opset_import} >= {"", "aten", "flintc", "flintc_test"}
    custom = [n for n in model.graph.node if n.domain == "flintc_test"]
    assert {n.op_type for n in custom} == {"rsqrt", "sort_stable"}
    sort = next(n for n in custom if n.op_type == "sort_stable")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in sort.attribute}
    assert attrs["dim"] == -1 and attrs["descending"] == 1
    fx_sort = next(n for n in g.gm.graph.nodes if n.name == sort.name)
    readers = sorted((u.args[1], u.name) for u in fx_sort.users)
    assert list(sort.output) == [name for _, name in readers]  # getitem -> node outputs
    assert CUSTOM in (tmp_path / "01-swap_test_ops.layer2-moe.svg").read_text()  # highlighted

    index = (tmp_path / "index.md").read_text()
    assert "| 1 | swap_test_ops | fused |" in index and "| 0 | captured |" in index
    data = json.loads((tmp_path / "report.json").read_text())
    assert [s["name"] for s in data["stages"]] == ["captured", "swap_test_ops"]
    assert data["stages"][1]["check"]["expected"] == "bit-exact"

    # A new pipeline into the same folder starts over: the old stage 1 is gone.
    run_pipeline(tiny_model, captures["decode"], tmp_path, check=False)
    assert not list(tmp_path.glob("01-*"))
    assert "swap_test_ops" not in (tmp_path / "index.md").read_text()


class FailsItsVerifyPass(GraphPass):
    """Changes nothing, and says its post-condition does not hold."""

    name = "fails_its_verify"

    def run(self, gm):
        return PassResult()

    def verify(self, gm):
        raise PassVerifyError("fails_its_verify: the test's post-condition does not hold")


@pytest.mark.parametrize("failing, error, what", [
    (SwapToTestOpsPass, GraphLegalityError, "legality check failed: fused graph after pass 'swap_test_ops': "),
    (FailsItsVerifyPass, PassVerifyError, "verify failed: fails_its_verify: the test's post-condition"),
])
def test_dump_records_a_pass_that_fails_its_legality_check_or_verify(tiny_model, captures, tmp_path, failing,
                                                                      error, what):
    """Regression: a pass whose graph failed its legality check (or its own verify) raised
    before its stage was dumped: index.md ended in "Overall: passed." and report.json said
    "passed": true, its table stopping at the stage before. Now the failing pass is a
    stage of the dumps with its error, Overall FAILED, as a missed numeric expectation."""
    class Identity(GraphPass):
        name = "identity"

        def run(self, gm):
            return PassResult()

    with pytest.raises(error) as info:
        run_pipeline(tiny_model, captures["decode"], tmp_path, [Identity, failing], check=False)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["passed"] is False
    assert [s["name"] for s in data["stages"]] == ["captured", "identity", failing.name]
    # the error carries the report so far, as PassCheckError does: `flintc dump` prints its table
    from flintc.cli.graphs import format_table

    assert [s.name for s in info.value.report.stages] == ["captured", "identity", failing.name]
    *_, before, last = format_table(info.value.report).splitlines()
    cell = "FAILED (legality check)" if error is GraphLegalityError else "FAILED (verify)"
    assert "FAILED" not in before and f"  {cell}  " in last, last
    assert [s["error"] is None for s in data["stages"]] == [True, True, False]
    assert data["stages"][2]["error"].startswith(what), data["stages"][2]["error"]
    index = (tmp_path / "index.md").read_text()
    assert f"| 2 | {failing.name} | fused |" in index and "| **NO** |" in index
    assert f"\nPass 2 '{failing.name}' failed: {what}" in index
    assert index.rstrip().endswith("Overall: **FAILED**.")
    assert f"# FAILED: {what}" in (tmp_path / f"02-{failing.name}.py").read_text()


@pytest.mark.parametrize("view", ["readable_code", "to_svg", "graph_to_onnx"])
def test_a_failed_stage_is_recorded_even_when_one_of_its_views_fails(tiny_model, captures, tmp_path, monkeypatch,
                                                                      view):
    """Regression: `dump_stage` wrote a stage's .py, dot/svg and ONNX views first and
    index.md/report.json last, so when a view of a pass's illegal graph failed to write,
    the pass manager raised the pass's error but index.md still ended "Overall: passed."
    (report.json "passed": true), the table stopping at the stage before. Now a failed
    stage's index is written even so."""
    import flintc.graph.dump as dump_module

    real = getattr(dump_module, view)

    def of_stage_2(a) -> bool:  # the stage (readable_code), a view's graph (its title), the ONNX name
        title = a.graph.get("graph", {}).get("label", "") if hasattr(a, "graph") and isinstance(a.graph, dict) else ""
        return getattr(a, "index", None) == 2 or str(a).startswith("02-") or title.startswith("02-")

    def fails_for_the_failed_stage(*args, **kwargs):
        if any(of_stage_2(a) for a in (*args, *kwargs.values())):
            raise RuntimeError(f"{view}: cannot render this graph")
        return real(*args, **kwargs)

    monkeypatch.setattr(dump_module, view, fails_for_the_failed_stage)

    class Identity(GraphPass):
        name = "identity"

        def run(self, gm):
            return PassResult()

    with pytest.raises(GraphLegalityError) as info:
        run_pipeline(tiny_model, captures["decode"], tmp_path, [Identity, SwapToTestOpsPass], check=False)
    assert "cannot render this graph" in str(info.value.__cause__)  # the view's error is its cause
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["passed"] is False
    assert [s["name"] for s in data["stages"]] == ["captured", "identity", "swap_test_ops"]
    assert data["stages"][2]["error"].startswith("legality check failed: ")
    index = (tmp_path / "index.md").read_text()
    assert "| 2 | swap_test_ops | fused |" in index and "\nPass 2 'swap_test_ops' failed: legality check" in index
    assert index.rstrip().endswith("Overall: **FAILED**.")
    assert (tmp_path / "01-identity.onnx").is_file()  # the stages before: dumped in full


def test_report_json_records_the_pass_options(tiny_model, captures, tmp_path):
    """report.json says which decode-schedule options the dumped pipeline ran with
    (`flintc dump --split-lm-head-norm / --fold-attention-combine / --attention-splits`):
    two dumps of one step told apart only by them looked the same."""
    options = {"split_lm_head_norm": True, "fold_attention_combine": True, "attention_splits": 4}
    run_pipeline(tiny_model, captures["decode"], tmp_path, check=False, options=options)
    assert json.loads((tmp_path / "report.json").read_text())["options"] == options


def test_compiled_build_dumps_record_only_the_options_of_their_step(tmp_path):
    """Regression: a BUILD compiled with the decode schedule's options recorded them in its
    prefill dumps too (dumps/prefill_t8/report.json: fold_attention_combine, split_lm_head_norm,
    attention_splits, full_attention_rows), though no prefill pass reads them and `flintc
    dump --step prefill` refuses them. Each step's dumps now record only its own."""
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.runtime.build import BuildOptions, compile_model

    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt="bf16", progress=False)
    out = tmp_path / "build"
    compile_model(ckpt, out, BuildOptions(max_batch=1, max_model_len=16, prefill_chunk=8, backend="torch",
                                          check=False, attention_splits=2, fold_attention_combine=True,
                                          split_lm_head_norm=True),
                  progress=False, log=lambda m: None)
    reports = {p.parent.name: json.loads(p.read_text()) for p in (out / "dumps").glob("*/report.json")}
    assert sorted(reports) == ["decode_b1", "prefill_t8"], sorted(reports)
    assert reports["prefill_t8"]["options"] == {}
    assert reports["decode_b1"]["options"] == {"full_attention_rows": 24, "attention_splits": 2,
                                               "fold_attention_combine": True, "split_lm_head_norm": True}
