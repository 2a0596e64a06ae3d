"""Code generation: a compiled step's final FX graph -> one plain Python function.

The generated function has one line per node that does something: a kernel launch
(`K.<op>(...)`, the flintc op through the backend's kernel table), a glue aten op
(`aten.view.default(...)`, free views or the few small kernels the count rule
counts), or a tuple unpack (`x[0]`). Each launch line ends with a comment naming the
graph node it came from and its layer, so a build can be read next to the pass dumps
and two builds can be diffed line by line.

A prefill function (`free=True`) drops each intermediate after its last use (`del a,
b`, as torch.fx's own code generation does with `a = b = None`): a straight-line
function otherwise keeps every layer's intermediates alive until it returns, about 6
MB per token at full size (a 2,048-token chunk: 12 GB, in the CUDA graph's pool too).
Decode functions keep theirs (a few MB at batch 8), so that no kernel launched with
PDL ever gets memory that an earlier, possibly still running kernel reads.

Signature of a generated decode function, and of a prefill function:

    def <name>(K, w, input_ids, positions, slots, kv, device):
    def <name>(K, w, input_ids, positions, slots, logits_rows, kv, device):

K: the kernel table (`flintc.runtime.kernels.KernelTable`); w: the weights and RoPE
tables as attributes named like the graph's placeholders without the `w_` prefix
(`w.layers_0_self_attn_q_proj_codes`, `w.rope_cos`); input_ids, positions: int64
[B, T]; slots: int64 [B]; logits_rows (prefill): int64 [B], the row of the B*T tokens
whose logits each sequence wants (b*T + t); kv: the list of KV caches, K and V per
layer (`[k_0, v_0, k_1, ...]`, mutated in place); device: the torch.device the step
runs on. Returns the graph's output: decode fp32 logits [B, 1, V]; prefill the tuple
(fp32 logits [B, V] of logits_rows, final-normed hidden states bf16 [B, T, H]).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from flintc.graph.accounting import kernels_of

INPUTS = ("input_ids", "positions", "slots", "logits_rows")


@dataclass
class StepSource:
    """Generated source of one step and what the build plan records about it."""

    name: str
    source: str
    weights: dict[str, str] = field(default_factory=dict)  # attribute -> model buffer name
    kernels: int = 0  # launches per call under the count rule (`flintc.graph.accounting`)
    launches: list[dict] = field(default_factory=list)  # per launching line: op, node, layer, pdl, kernels (its launches)
    intermediates: list[dict] = field(default_factory=list)  # node, shape, dtype, bytes


def _weight_attr(placeholder: str) -> str:
    return placeholder[2:] if placeholder.startswith("w_") else placeholder


def _fmt(arg, names: dict[Node, str]) -> str:
    """Python source for one argument of a node."""
    if isinstance(arg, Node):
        return names[arg]
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_fmt(a, names) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, torch.device):
        return "device"
    if isinstance(arg, torch.dtype):
        return str(arg)  # "torch.bfloat16"
    if isinstance(arg, (torch.memory_format, torch.layout)):
        return f"torch.{str(arg).split('.')[-1]}"
    if isinstance(arg, float) and (arg != arg or arg in (float("inf"), float("-inf"))):
        return f"float({str(arg)!r})"
    if isinstance(arg, (int, float, bool, str, type(None))):
        return repr(arg)
    raise ValueError(f"codegen: cannot write a constant of type {type(arg).__name__}: {arg!r}")


def _call_args(node: Node, names: dict[Node, str], extra: str = "") -> str:
    parts = [_fmt(a, names) for a in node.args]
    parts += [f"{k}={_fmt(v, names)}" for k, v in node.kwargs.items()]
    if extra:
        parts.append(extra)
    return ", ".join(parts)


def _meta_tensor(node: Node):
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def generate_step(gm: GraphModule, name: str, buffer_names: list[str], doc: str,
                  pdl: bool = False, free: bool = False) -> StepSource:
    """Write the function `name` for the final graph `gm` of one step.

    Args:
        gm: the final graph of `compile_step` (flintc ops, getitems, glue aten ops).
        buffer_names: the model buffer behind each weight placeholder, in placeholder
            order (`CapturedGraph.buffer_names`).
        doc: the generated function's docstring (what step, bucket and shapes).
        pdl: pass `use_pdl=True` to every kernel `mark_pdl` marked.
        free: `del` each intermediate after its last use (module doc).

    Raises:
        ValueError: a node of a kind the runtime cannot call (call_module, get_attr)
            or a constant that has no source form.
    """
    names: dict[Node, str] = {}
    body: list[str] = []
    out = StepSource(name, "")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weights = [n for n in placeholders if n.name not in INPUTS and not n.name.startswith(("k_cache_", "v_cache_"))]
    if len(weights) != len(buffer_names):
        raise ValueError(f"codegen: {len(weights)} weight placeholders but {len(buffer_names)} buffer names")
    caches = [n for n in placeholders if n.name.startswith(("k_cache_", "v_cache_"))]
    for node, buf in zip(weights, buffer_names):
        attr = _weight_attr(node.name)
        names[node] = f"w.{attr}"
        out.weights[attr] = buf
    for node in placeholders:
        if node.name in INPUTS:
            names[node] = node.name
    for node in caches:
        names[node] = node.name
    if caches:
        body.append(f"{', '.join(n.name for n in caches)}, = kv")

    last_use: dict[Node, Node] = {}  # intermediate -> the node that reads it last
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if arg.op == "call_function":
                last_use[arg] = node
    freed_by: dict[Node, list[str]] = {}
    for value, user in last_use.items():
        if user.op != "output":
            freed_by.setdefault(user, []).append(value.name)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            body.append(f"return {_fmt(node.args[0], names)}")
            break
        if node.op != "call_function":
            raise ValueError(f"codegen: node {node.name} is a {node.op}; only call_function is supported")
        var = node.name
        names[node] = var
        target = node.target
        layer = node.meta.get("flintc_layer")
        where = f"layer {layer}" if isinstance(layer, int) and layer >= 0 else "model"
        if target is operator.getitem:
            body.append(f"{var} = {names[node.args[0]]}[{node.args[1]!r}]")
            if free:
                _free(body, node, freed_by)
            continue
        namespace = getattr(target, "namespace", None)
        launches = kernels_of(node)
        if namespace == "flintc":
            op = target._opname
            mark = node.meta.get("pdl") if pdl else None
            extra = "use_pdl=True" if mark else ""
            line = f"{var} = K.{op}({_call_args(node, names, extra)})"
            out.launches.append({"op": op, "node": node.name, "layer": layer, "pdl": bool(mark),
                                 "kernels": launches})
        else:
            packet = getattr(target, "overloadpacket", None)
            if packet is None or getattr(target, "namespace", None) != "aten":
                raise ValueError(f"codegen: node {node.name} calls {target!r}, not a flintc or aten op")
            line = f"{var} = aten.{packet.__name__}.{target._overloadname}({_call_args(node, names)})"
            if launches:
                out.launches.append({"op": f"aten.{packet.__name__}", "node": node.name, "layer": layer,
                                     "pdl": False, "kernels": launches})
        first = out.kernels + 1
        out.kernels += launches
        # numbered by kernel, not by line: a call of several kernels (prefill_attention_kv:
        # the attention, then the KV-cache write) says "kernels 9-10", so the last number
        # is the function's kernel count (plan.json's "kernels", flintc compile's line)
        if not launches:
            tag = "view"
        elif launches == 1:
            tag = f"kernel {first}:"
        else:
            tag = f"kernels {first}-{out.kernels}:"
        body.append(f"{line}  # {tag} {node.name}, {where}")
        t = _meta_tensor(node)
        if t is not None and launches:
            out.intermediates.append({"node": node.name, "shape": list(t.shape), "dtype": str(t.dtype),
                                      "bytes": t.numel() * t.element_size()})
        if free:
            _free(body, node, freed_by)
    rows = "logits_rows, " if any(n.name == "logits_rows" for n in placeholders) else ""
    header = f"def {name}(K, w, input_ids, positions, slots, {rows}kv, device):"
    lines = [header, f'    """{doc}"""'] + [f"    {b}" for b in body]
    out.source = "\n".join(lines) + "\n"
    return out


def _free(body: list[str], node: Node, freed_by: dict[Node, list[str]]) -> None:
    """Append `del ...` for the intermediates `node` reads last, and for its own value
    when nothing reads it."""
    names = freed_by.get(node, []) + ([node.name] if not node.users else [])
    if names:
        body.append(f"del {', '.join(names)}")


def module_source(steps: list[StepSource], header: str) -> str:
    """The whole generated module: header comment, imports, one function per step."""
    parts = [header.rstrip() + "\n", "import torch\n\naten = torch.ops.aten\n"]
    parts += ["\n" + s.source for s in steps]
    table = ", ".join(f"{s.name!r}: {s.name}" for s in steps)
    parts.append(f"\nSTEPS = {{{table}}}\n")
    return "\n".join(parts)
