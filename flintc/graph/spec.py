"""Graph legality per stage: what a well-formed graph looks like after each pass.

Stages, in pipeline order (a pass declares the stage its output is in):

* `captured`: aten ops only, as `flintc.graph.trace.capture` produced them;
* `fused`: aten ops and `flintc` fused ops;
* `lowered`: the final schedule: `flintc` ops plus free view ops and `getitem`
  (every launch is a flintc kernel).

Every stage also requires: FX's own lint passes (no dangling uses, topological
order); every placeholder and op node carries `meta["val"]` and
`meta["flintc_layer"]`; the placeholders are the captured ones, in order; no
pure node is dead; the only side effects are writes into KV-cache placeholders.
Errors name the offending node and its inputs (:class:`GraphLegalityError`).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from flintc.errors import FlintcError, listing
from flintc.graph.accounting import FREE_OPS
from flintc.graph.match import namespace, op_name

STAGES = ("captured", "fused", "lowered")


class GraphLegalityError(FlintcError):
    """A graph breaks an invariant of its stage; the message names the node. `report`:
    the pipeline's report up to the failed stage, last, when `PassManager.run` raised it
    after a pass (None otherwise: the captured graph's own check, a direct `check_graph`)."""

    report = None


def describe(node: Node) -> str:
    """`name = op(input names...)`, for error messages."""
    if node.op == "placeholder":
        return f"placeholder {node.name}"
    ins = ", ".join(a.name for a in node.all_input_nodes)
    return f"{node.name} = {op_name(node)}({ins})"


def _mutated_args(node: Node) -> list[Node]:
    """Node arguments that `node`'s op writes in place (from the op schema)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, Node):
                out.append(value)
    return out


def _allowed(node: Node, stage: str) -> bool:
    if node.target is operator.getitem:
        return True
    ns = namespace(node)
    packet = getattr(node.target, "overloadpacket", None)
    if stage == "captured":
        return ns == "aten"
    if stage == "fused":
        return ns in ("aten", "flintc")
    return ns == "flintc" or packet in FREE_OPS


def check_graph(gm: GraphModule, stage: str, placeholders: list[str] | None = None,
                where: str = "") -> None:
    """Raise GraphLegalityError if `gm` breaks an invariant of `stage`.

    Args:
        placeholders: the expected placeholder names, in order (the captured ones).
        where: context for the message, e.g. "after pass 'fuse_rms_norm'".
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
    ctx = f"{stage} graph{' ' + where if where else ''}"
    try:
        gm.graph.lint()
    except Exception as exc:  # FX raises RuntimeError for dangling uses / bad order
        raise GraphLegalityError(f"{ctx}: {exc}") from None
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if placeholders is not None and names != list(placeholders):
        missing = sorted(set(placeholders) - set(names))
        extra = sorted(set(names) - set(placeholders))
        what = (f"missing {listing(missing, 3) or 'none'}, new {listing(extra, 3) or 'none'}"
                if missing or extra else "the same names in another order")
        raise GraphLegalityError(f"{ctx}: placeholders changed ({what})")
    caches = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith(("k_cache_", "v_cache_"))}
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function", "output", "get_attr"):
            raise GraphLegalityError(f"{ctx}: node {node.name} has op kind {node.op!r}")
        if node.op == "call_function" and not _allowed(node, stage):
            raise GraphLegalityError(f"{ctx}: op {op_name(node)} is not allowed at this stage: {describe(node)}")
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            raise GraphLegalityError(f"{ctx}: node has no meta['val'] (shape/dtype): {describe(node)}")
        if node.op in ("placeholder", "call_function") and "flintc_layer" not in node.meta:
            raise GraphLegalityError(f"{ctx}: node has no meta['flintc_layer']: {describe(node)}")
        if node.op != "call_function":
            continue
        written = _mutated_args(node)
        for w in written:
            if w not in caches:
                raise GraphLegalityError(
                    f"{ctx}: {describe(node)} writes in place into {w.name}, which is not a KV-cache input")
        if not node.users and not written and node.target is not operator.getitem:
            raise GraphLegalityError(f"{ctx}: dead node (its value is never used): {describe(node)}")
    _check_output(gm, ctx)


def _check_output(gm: GraphModule, ctx: str) -> None:
    out = [n for n in gm.graph.nodes if n.op == "output"]
    if len(out) != 1:
        raise GraphLegalityError(f"{ctx}: expected one output node, found {len(out)}")
    value = out[0].args[0]
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, Node) for v in value):
        value = value[0]  # a prefill step: (logits of logits_rows, final-normed hidden states)
    if not isinstance(value, Node):
        raise GraphLegalityError(f"{ctx}: the output must be the logits node (or, for a prefill step, the "
                                 f"logits and hidden states nodes), found {type(value).__name__}")
    fake = value.meta.get("val")
    if isinstance(fake, torch.Tensor) and fake.dtype not in (torch.float32, torch.float64):
        raise GraphLegalityError(f"{ctx}: the logits ({value.name}) must be fp32, found {fake.dtype}")
