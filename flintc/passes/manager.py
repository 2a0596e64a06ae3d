"""The pass manager: runs an ordered list of passes and checks every one.

The order is the explicit list the caller gives (see `flintc.passes.pipeline` for
flintc's default decode and prefill pipelines); any pass can be switched off by
name. After every pass the manager:

1. checks the graph's legality for the pass's stage (`flintc.graph.spec`);
2. runs the pass's own `verify`;
3. when a numeric checker is given, runs the graphs from before and after the pass
   on the same random inputs and compares the logits and every KV cache
   (`flintc.graph.compare`) against the pass's declared expectation;
4. counts kernels per forward, per layer and per layer kind
   (`flintc.graph.accounting`);
5. dumps the graph when a dump directory is set (`flintc.graph.dump`).

A pass that misses its expectation stops the pipeline with :class:`PassCheckError`
naming the pass, the output and the first differing node. The manager knows
nothing about a pass beyond constructing it with a `PassContext`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flintc.errors import FlintcError
from flintc.graph.accounting import KernelCount, count_kernels
from flintc.graph.compare import BIT_EXACT, CheckResult, compare_graphs, merge_checks, run_graph
from flintc.graph.match import clone_graph_module
from flintc.graph.spec import GraphLegalityError, check_graph
from flintc.graph.trace import CapturedGraph
from flintc.passes.base import GraphPass, PassContext, PassResult, PassVerifyError


class PassCheckError(FlintcError):
    """A pass missed its declared numerical expectation."""

    def __init__(self, message: str, report: "PipelineReport"):
        super().__init__(message)
        self.report = report


@dataclass
class StageReport:
    """One row of the per-pass table: the graph after `name` (index 0: captured)."""

    index: int
    name: str
    stage: str
    nodes: int
    kernels: KernelCount
    check: CheckResult | None = None
    result: PassResult | None = None
    seconds: float = 0.0
    # why the pass failed before its numeric check: "legality check failed: ..." or
    # "verify failed: ..." (the pipeline stopped at this stage; None: it did not fail so)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and (self.check is None or self.check.passed)

    def as_dict(self) -> dict:
        check = self.check.as_dict() if self.check else None
        return {
            "index": self.index, "name": self.name, "stage": self.stage, "nodes": self.nodes,
            "kernels_per_forward": self.kernels.per_forward,
            "kernels_per_layer": dict(self.kernels.per_kind),
            "kernels": self.kernels.as_dict(),
            "matches": self.result.matches if self.result else None,
            "notes": self.result.notes if self.result else [],
            "check": check, "error": self.error, "seconds": round(self.seconds, 3),
        }


@dataclass
class PipelineReport:
    step: str
    batch: int
    tokens: int
    stages: list[StageReport] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.stages)

    @property
    def checked(self) -> bool:
        """Whether any pass was checked numerically (False with --no-check: `passed` is
        then vacuously true)."""
        return any(s.check is not None for s in self.stages)

    def as_dict(self) -> dict:
        return {"step": self.step, "batch": self.batch, "tokens": self.tokens,
                "checked": self.checked, "passed": self.passed, "skipped": self.skipped,
                "stages": [s.as_dict() for s in self.stages]}


class NumericChecker:
    """Real weights and random inputs for checking a captured graph.

    model: a FlintModel with real weights, the one `graph` was captured from (or one
    of the same config and format). Inputs are drawn once per checker (`seed`); a
    prefill step's `logits_rows` too (a random token of each sequence), so its logits
    are checked on those rows and its hidden states on every token. A prefill step is
    checked on two input sets, merged into one result (`merge_checks`): chunks after
    earlier ones (the cached-key path) and, where those do not start at 0, the same
    inputs with every chunk at position 0 (a prompt's first chunk; outputs named
    "NAME (chunk at 0)").
    The manager checks passes in sequence, so the run of the graph after one pass
    is the run of the graph before the next: it is kept and each graph runs once.
    """

    def __init__(self, model, graph: CapturedGraph, seed: int = 0):
        self.weights = graph.weight_args(model)
        self.inputs = graph.example_inputs(model, seed=seed)
        at_zero = None
        if graph.step == "prefill":  # the rows whose logits the graph computes: one per sequence, drawn
            B, T = self.inputs[0].shape
            g = torch.Generator().manual_seed(seed + 1)
            rows = (torch.arange(B) * T + torch.randint(0, T, (B,), generator=g)).to(self.inputs[0].device)
            self.inputs = (*self.inputs, rows)
            ids, positions, slots, kv = self.inputs[:4]
            if bool((positions[:, 0] != 0).any()):  # the same inputs, each chunk at 0 (run_graph copies kv)
                at_zero = (ids, positions - positions[:, :1], slots, kv, rows)
        self.input_sets = [(self.inputs, "")] + ([(at_zero, "chunk at 0")] if at_zero is not None else [])
        self.cache_names = [f"{kv}_cache_{i}" for i in range(graph.config.num_hidden_layers) for kv in "kv"]
        self._prev_runs = None  # run_graph() of the graph as it was before the pass now checked, per input set

    def check(self, new, old, expectation) -> CheckResult:
        results, runs = [], []
        for k, (inputs, _) in enumerate(self.input_sets):
            old_run = self._prev_runs[k] if self._prev_runs else run_graph(old, self.weights, inputs)
            new_run = run_graph(new, self.weights, inputs)
            runs.append(new_run)
            results.append(compare_graphs(new, old, self.weights, inputs, expectation, self.cache_names,
                                          old_run, new_run))
        self._prev_runs = runs
        return merge_checks(results, [label for _, label in self.input_sets])


class PassManager:
    """Runs `passes` in order on a captured graph (see the module doc).

    Args:
        passes: pass classes, in order.
        ctx: the PassContext each pass is constructed with.
        disabled: names of passes to skip.
        checker: a NumericChecker, or None to skip the numeric checks.
        dump_dir: write each stage's dumps here (None: no dumps).
    """

    def __init__(self, passes: list[type[GraphPass]], ctx: PassContext, disabled=(), checker=None,
                 dump_dir: str | Path | None = None):
        unknown = set(disabled) - {p.name for p in passes}
        if unknown:
            raise FlintcError(f"unknown pass name(s) to disable: {sorted(unknown)}; "
                              f"passes are {[p.name for p in passes]}")
        self.passes = [p for p in passes if p.name not in set(disabled) and ctx.step in p.steps]
        self.skipped = [p.name for p in passes if p not in self.passes]
        self.disabled = [p.name for p in passes if p.name in set(disabled) and ctx.step in p.steps]
        self.ctx, self.checker = ctx, checker
        self.dump_dir = Path(dump_dir) if dump_dir else None

    def run(self, graph: CapturedGraph) -> PipelineReport:
        """Run every pass on `graph.gm` (rewritten in place). Returns the report.

        Raises:
            GraphLegalityError / PassVerifyError: a pass left an illegal graph (the message
                names the passes disabled, when some were: a later pass or stage needs
                their output). The pass's stage is in the dumps first, failed, with the
                error (`StageReport.error`), and the report so far is the error's
                `report` (as PassCheckError's; a captured graph that fails its legality
                check has none).
            PassCheckError: a pass missed its numerical expectation, or the captured graph
                fails its check against itself before any pass runs (NaN in its outputs).
        """
        gm, cfg = graph.gm, graph.config
        report = PipelineReport(graph.step, graph.batch, graph.tokens, skipped=list(self.skipped))
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        check_graph(gm, "captured", placeholders, where="after capture")
        base_check = None
        if self.checker is not None:
            base_check = self.checker.check(gm, gm, BIT_EXACT)  # the capture against itself: runs it once
        report.stages.append(StageReport(0, "captured", "captured", _num_nodes(gm), count_kernels(gm, cfg), base_check))
        self._dump(gm, report)
        if base_check is not None and not base_check.passed:  # else the first pass took the blame
            raise PassCheckError(
                f"the captured graph does not reproduce itself before any pass ({base_check.message}; first "
                f"differing node: {base_check.first_differing_node or 'none found'}): the check model's outputs "
                "hold NaN (from NaN or inf in its weights, or activations past the bf16 range) or are not "
                "deterministic, so no pass can be checked on them", report)
        for i, pass_cls in enumerate(self.passes, start=1):
            before = clone_graph_module(gm) if self.checker is not None else None
            t0 = time.perf_counter()
            p = pass_cls(self.ctx)
            n_before = _num_nodes(gm)
            result = p.run(gm) or PassResult()
            gm.recompile()
            result.nodes_before, result.nodes_after = n_before, _num_nodes(gm)
            where = f"after pass '{p.name}'"
            try:
                check_graph(gm, p.stage, placeholders, where=where)
                p.verify(gm)
            except (GraphLegalityError, PassVerifyError) as exc:
                error = exc
                if self.disabled:
                    error = type(exc)(f"{exc} (passes disabled: {', '.join(self.disabled)}; the later passes and "
                                      "stages expect their output)")
                # recorded as a failed stage (the dump's table and report.json), as a missed
                # numeric expectation is: the dump said "Overall: passed" up to the stage before
                what = "legality check failed" if isinstance(exc, GraphLegalityError) else "verify failed"
                report.stages.append(StageReport(i, p.name, p.stage, _num_nodes(gm), count_kernels(gm, cfg),
                                                 None, result, time.perf_counter() - t0, error=f"{what}: {error}"))
                error.report = report  # the table of the passes that ran (`flintc dump`)
                try:
                    self._dump(gm, report)
                except Exception as dump_exc:  # the pass's error is the one to tell
                    raise error from dump_exc
                if error is exc:
                    raise
                raise error from None
            check = None
            if self.checker is not None:
                check = self.checker.check(gm, before, p.expectation)
            stage = StageReport(i, p.name, p.stage, _num_nodes(gm), count_kernels(gm, cfg), check, result,
                                time.perf_counter() - t0)
            report.stages.append(stage)
            self._dump(gm, report)
            if check is not None and not check.passed:
                raise PassCheckError(
                    f"pass '{p.name}' missed its expectation ({check.expected}): {check.message}; "
                    f"first differing node: {check.first_differing_node or 'none found'}", report)
        return report

    def _dump(self, gm, report: PipelineReport) -> None:
        if self.dump_dir is None:
            return
        from flintc.graph.dump import dump_stage

        dump_stage(gm, report, self.ctx, self.dump_dir)


def _num_nodes(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")
