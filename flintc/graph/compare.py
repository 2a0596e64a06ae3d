"""Numerical equivalence of two graphs of the same step (before and after a pass).

`compare_graphs` runs both graphs on the same inputs (fresh copies of the KV
cache each) and compares every output: the logits (a prefill step: the logits of its
`logits_rows` and the final-normed hidden states of every token) and each KV-cache
input the graph writes. For every output it records the largest absolute difference, the
largest difference relative to the reference's largest magnitude (`max_rel`),
the share of elements that differ at all, and bit-exactness; for MoE layers it
compares the selected experts token by token (FLINT_SPEC section 3). When the
graphs disagree beyond the expectation, it re-runs both, recording every node,
and names the first node of the new graph that differs from its namesake.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
from torch.fx import GraphModule, Interpreter

from flintc.graph.spec import _mutated_args


@dataclass(frozen=True)
class Expectation:
    """What a pass promises about its output against its input graph.

    kind: "bit-exact", or "tolerance": |new - old| <= atol + rtol * |old| on every
    token whose expert selection agrees in every MoE layer, with at most
    `max_flip_share` of (layer, token) selections differing. `why` justifies a
    tolerance (which reduction order or math function changed).
    """

    kind: str = "bit-exact"
    atol: float = 0.0
    rtol: float = 0.0
    max_flip_share: float = 0.0
    why: str = ""

    def describe(self) -> str:
        if self.kind == "bit-exact":
            return "bit-exact"
        return f"atol={self.atol:g}, rtol={self.rtol:g}, expert flips <= {self.max_flip_share:.0%}"


BIT_EXACT = Expectation()


@dataclass
class TensorDiff:
    name: str
    max_abs: float
    max_rel: float
    share_differing: float
    bit_exact: bool
    within: bool = True


@dataclass
class CheckResult:
    """The outcome of one equivalence check (one row of the per-pass table)."""

    expected: str
    passed: bool
    max_abs: float
    max_rel: float
    share_differing: float
    bit_exact: bool
    experts_agree: float | None = None
    outputs: list[TensorDiff] = field(default_factory=list)
    first_differing_node: str | None = None
    message: str = ""

    def as_dict(self) -> dict:
        d = asdict(self)
        d["outputs"] = [asdict(o) for o in self.outputs]
        return d


class _Recorder(Interpreter):
    """Runs a graph, keeping each recorded node's value (a clone, since the KV cache
    is written in place later)."""

    def __init__(self, gm: GraphModule, record_all: bool):
        super().__init__(gm)
        self.record_all = record_all
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n):
        out = super().run_node(n)
        keep = self.record_all or n.meta.get("flintc_role") == "moe_selected"
        if keep and isinstance(out, torch.Tensor) and not _mutated_args(n) and n.op == "call_function":
            self.values[n.name] = out.detach().clone()
        return out


def run_graph(gm: GraphModule, weights, inputs, record_all: bool = False):
    """Run `gm` on weights + (input_ids, positions, slots, kv[, logits_rows]) (a prefill
    graph without logits_rows gets each sequence's last token, `graph_args`). The KV
    cache is cloned first. Returns (output, kv after, recorded node values): the output
    is the logits (decode) or the tuple (logits of the rows, hidden states) (prefill);
    the recorded values are the selected-experts nodes always, every node with
    `record_all` (slow: an fx Interpreter)."""
    from flintc.graph.trace import graph_args

    kv = [t.clone() for t in inputs[3]]
    args = graph_args(gm, weights, (*inputs[:3], kv, *inputs[4:]))
    if record_all:
        rec = _Recorder(gm, True)
        out = rec.run(*args)
        return out, kv, rec.values
    probe, names = _probe(gm)
    out = probe(*args)
    return out[0], kv, dict(zip(names, out[1:]))


def named_outputs(out) -> list[tuple[str, torch.Tensor]]:
    """A step graph's output as (name, tensor) pairs: [("logits", ...)] for a decode
    step, [("logits", rows' logits), ("hidden", final-normed hidden states)] for a
    prefill step."""
    if isinstance(out, (tuple, list)):
        return list(zip(("logits", "hidden"), out))
    return [("logits", out)]


def _probe(gm: GraphModule):
    """A copy of `gm` that also returns its selected-experts nodes (compiled Python,
    much faster than an Interpreter); cached on `gm` while its nodes are unchanged."""
    key = tuple(n.name for n in gm.graph.nodes)
    cached = getattr(gm, "_flintc_probe", None)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    from flintc.graph.match import clone_graph_module

    probe = clone_graph_module(gm)
    out = next(n for n in probe.graph.nodes if n.op == "output")
    tagged = [n for n in probe.graph.nodes if n.meta.get("flintc_role") == "moe_selected"]
    out.args = ((out.args[0], *tagged),)
    probe.recompile()
    names = [n.name for n in tagged]
    gm._flintc_probe = (key, probe, names)
    return probe, names


def _diff(name: str, new: torch.Tensor, old: torch.Tensor, exp: Expectation, rows=None) -> TensorDiff:
    a, b = new.double(), old.double()
    d = (a - b).abs()
    finite = torch.isfinite(a) == torch.isfinite(b)
    bit_exact = bool(torch.equal(new, old))
    scale = float(b.abs().max()) if b.numel() else 0.0
    max_abs = float(d.max()) if d.numel() else 0.0
    if not bool(finite.all()):
        max_abs = float("inf")
    within = bit_exact
    if exp.kind == "tolerance":
        ok = (d <= exp.atol + exp.rtol * b.abs()) & finite
        if rows is not None:  # judge only rows whose expert selection agreed
            ok = ok | ~rows.view(*rows.shape, *([1] * (ok.dim() - rows.dim())))
        within = bool(ok.all())
    return TensorDiff(name, max_abs, max_abs / scale if scale else max_abs,
                      float((new != old).double().mean()) if new.numel() else 0.0, bit_exact, within)


def _selection_agreement(new_vals, old_vals):
    """(share of (layer, token) selections that agree, token rows [N] with no flip in
    any layer, or None when the graphs have no tagged selection)."""
    names = sorted(set(new_vals) & set(old_vals))
    if not names:
        return None, None
    agree_all, agree_rows = [], None
    for name in names:
        a, b = new_vals[name].sort(-1).values, old_vals[name].sort(-1).values  # [N, K]
        same = (a == b).all(-1)  # [N]
        agree_all.append(same)
        agree_rows = same if agree_rows is None else agree_rows & same
    return float(torch.cat(agree_all).double().mean()), agree_rows


def compare_graphs(new: GraphModule, old: GraphModule, weights, inputs, exp: Expectation,
                   cache_names: list[str], old_run=None, new_run=None) -> CheckResult:
    """Compare `new` against `old` on the same inputs under expectation `exp`.

    Args:
        weights, inputs: as for `run_graph`.
        cache_names: the KV-cache placeholder names, in input order.
        old_run, new_run: cached `run_graph` results, to skip re-running a graph.
    """
    old_out, old_kv, old_vals = old_run or run_graph(old, weights, inputs)
    new_out, new_kv, new_vals = new_run or run_graph(new, weights, inputs)
    experts_agree, rows = _selection_agreement(_selections(new, new_vals), _selections(old, old_vals))
    B, T = inputs[0].shape
    token_rows = rows.view(B, T) if rows is not None else None
    if token_rows is not None and T > 1:
        # Once a token's selection flips, its K/V differ and every later token of the same
        # sequence attends to them: judge those with the flipped token, not as agreeing.
        token_rows = token_rows.int().cumprod(-1).bool()
    diffs = []
    for (name, a), (_, b) in zip(named_outputs(new_out), named_outputs(old_out)):
        mask = token_rows
        if mask is not None and name == "logits" and a.dim() == 2:  # [M, V]: the logits of logits_rows
            from flintc.graph.trace import last_rows

            picked = inputs[4] if len(inputs) > 4 else last_rows(B, T, device=mask.device)
            mask = mask.reshape(-1)[picked]
        diffs.append(_diff(name, a, b, exp, mask))
    seq_rows = token_rows.all(-1) if token_rows is not None else None  # [B]
    for name, a, b in zip(cache_names, new_kv, old_kv):
        if seq_rows is not None and exp.kind == "tolerance":
            slots = inputs[2]
            keep = torch.ones(a.shape[0], dtype=torch.bool, device=a.device)
            keep[slots] = seq_rows
            diffs.append(_diff(name, a, b, exp, keep))
        else:
            diffs.append(_diff(name, a, b, exp))
    flips_ok = experts_agree is None or (1 - experts_agree) <= exp.max_flip_share + 1e-12
    passed = all(d.within for d in diffs) and flips_ok
    worst = max(diffs, key=lambda d: d.max_rel)
    res = CheckResult(
        expected=exp.describe(), passed=passed, max_abs=max(d.max_abs for d in diffs),
        max_rel=max(d.max_rel for d in diffs),
        share_differing=max(d.share_differing for d in diffs),
        bit_exact=all(d.bit_exact for d in diffs), experts_agree=experts_agree, outputs=diffs)
    if not passed:
        bad = next((d for d in diffs if not d.within), worst)
        res.first_differing_node = first_differing_node(new, old, weights, inputs, exp)
        why = f"output {bad.name} differs (max abs {bad.max_abs:.3g}, share {bad.share_differing:.2%})"
        if not flips_ok:
            why = f"expert selection agrees on only {experts_agree:.1%} of (layer, token) pairs; " + why
        res.message = why
    return res


def merge_checks(results: list[CheckResult], labels: list[str]) -> CheckResult:
    """One row of the per-pass table from checks of one pass on several input sets
    (`flintc.passes.manager.NumericChecker`: a prefill chunk after earlier ones, then one
    at position 0): passed and bit-exact when every check is; the worst errors, share
    and expert agreement of them; every check's outputs, those of a set with a label
    named "NAME (label)"; the first failed check's message (prefixed with its label)
    and first differing node.

    Raises:
        ValueError: no results, or not one label per result.
    """
    if not results or len(labels) != len(results):
        raise ValueError(f"merge_checks: expected one label per result, got {len(results)} result(s) and "
                         f"{len(labels)} label(s)")
    if len(results) == 1:
        return results[0]
    agree = [r.experts_agree for r in results if r.experts_agree is not None]
    out = CheckResult(
        expected=results[0].expected, passed=all(r.passed for r in results),
        max_abs=max(r.max_abs for r in results), max_rel=max(r.max_rel for r in results),
        share_differing=max(r.share_differing for r in results),
        bit_exact=all(r.bit_exact for r in results), experts_agree=min(agree) if agree else None,
        outputs=[replace(d, name=f"{d.name} ({label})") if label else d
                 for r, label in zip(results, labels) for d in r.outputs])
    failed = next(((r, label) for r, label in zip(results, labels) if not r.passed), None)
    if failed is not None:
        r, label = failed
        out.first_differing_node = r.first_differing_node
        out.message = f"{label}: {r.message}" if label else r.message
    return out


def _selections(gm: GraphModule, values: dict) -> dict:
    """Selected-expert values keyed by layer, so renamed nodes still pair up."""
    out = {}
    for n in gm.graph.nodes:
        if n.meta.get("flintc_role") == "moe_selected" and n.name in values:
            out[f"layer{n.meta.get('flintc_layer')}"] = values[n.name]
    return out


def first_differing_node(new: GraphModule, old: GraphModule, weights, inputs, exp: Expectation):
    """The first node of `new` (graph order) whose value differs from the same-named
    node of `old` beyond `exp`; None if every shared node agrees."""
    _, _, new_vals = run_graph(new, weights, inputs, record_all=True)
    _, _, old_vals = run_graph(old, weights, inputs, record_all=True)
    for node in new.graph.nodes:
        a, b = new_vals.get(node.name), old_vals.get(node.name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            continue
        if exp.kind == "bit-exact":
            if not torch.equal(a, b):
                return node.name
        elif a.is_floating_point():
            ad, bd = a.double(), b.double()
            if not bool(((ad - bd).abs() <= exp.atol + exp.rtol * bd.abs()).all()):
                return node.name
        elif not torch.equal(a, b):
            return node.name
    return None
