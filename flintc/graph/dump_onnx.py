"""Export a flintc FX graph as an ONNX ModelProto, for looking at it in Netron.

The export is a picture of the graph, not a runnable model: every `call_function`
node becomes one NodeProto whose `op_type` is the op's name (`mm`, `_to_copy`,
`rms_norm`) in the op's own domain (`aten`, `flintc`, or whatever namespace a
custom op lives in), with the overload (`Tensor`, `dim`) as the attribute
`overload` when it is not `default`. Tensor arguments become inputs, in schema
order (a list of tensors gives several inputs, a missing optional one gives the
empty name); every other argument becomes an attribute named after its schema
argument (ints, floats, int and float lists, strings; bools as ints; dtypes,
devices and memory formats as strings). A multi-output op gets one output per
result, named after the `getitem` node that reads it, so `getitem` itself never
appears. Placeholders are the graph inputs (weights included: nothing is
embedded), the FX output plus every in-place KV-cache write are the graph
outputs, and `value_info` carries the dtype and shape of every intermediate from
`meta["val"]`. Assumes static shapes (a symbolic size is written as a name).
"""

from __future__ import annotations

import operator
import re

import onnx
import torch
from onnx import AttributeProto, TensorProto, helper
from torch.fx import GraphModule, Node

from flintc.graph.match import namespace, op_name
from flintc.graph.spec import _mutated_args

# The standard ("") opset is listed so Netron and the checker accept the model; no
# node uses it.
ONNX_OPSET = 18

_DTYPES = {
    torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16, torch.float64: TensorProto.DOUBLE,
    torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16, torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8, torch.bool: TensorProto.BOOL,
    torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN, torch.float8_e5m2: TensorProto.FLOAT8E5M2,
    torch.complex64: TensorProto.COMPLEX64, torch.complex128: TensorProto.COMPLEX128,
}


def elem_type(dtype: torch.dtype) -> int:
    """The ONNX element type of a torch dtype; UINT8 for dtypes ONNX lacks (packed
    FP4 pairs, for one), which the value's doc string then names."""
    return _DTYPES.get(dtype, TensorProto.UINT8)


def graph_to_onnx(gm: GraphModule, name: str = "flintc", doc: str = "") -> onnx.ModelProto:
    """The whole of `gm` as an ONNX model (see the module doc).

    Args:
        name: the ONNX graph's name (the dump's stage prefix, say).
        doc: the model's doc string.
    """
    values = _value_names(gm)
    nodes, inputs, outputs, infos, domains = [], [], [], [], {"aten", "flintc"}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inputs.append(_value_info(node.name, node.meta.get("val")))
        elif node.op == "call_function" and node.target is not operator.getitem:
            proto, outs = _node_proto(node, values)
            domains.add(proto.domain)
            nodes.append(proto)
            for out_name, v in outs:
                if isinstance(v, torch.Tensor):
                    infos.append(_value_info(out_name, v))
            if _mutated_args(node) and not node.users:  # a KV-cache write: keep it visible
                outputs.append(_value_info(values[node], node.meta.get("val")))
        elif node.op == "output":
            results = [n for n in _flatten(node.args[0]) if isinstance(n, Node)]
            outputs[:0] = [_value_info(values[n], n.meta.get("val")) for n in results]
    graph = helper.make_graph(nodes, name, inputs, outputs, value_info=infos)
    opsets = [helper.make_opsetid("", ONNX_OPSET)]
    opsets += [helper.make_opsetid(d, 1) for d in sorted(domains)]
    # IR version 10 (onnx 1.16): new enough for the float8 types, old enough for any Netron.
    return helper.make_model(graph, opset_imports=opsets, producer_name="flintc", doc_string=doc,
                             ir_version=10)


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _flatten(item)
    else:
        yield x


def _value_names(gm: GraphModule) -> dict[Node, str]:
    """The ONNX value each FX node stands for: its own name, except that a `getitem`
    stands for one output of its source (repeated reads share the first's name)."""
    values: dict[Node, str] = {}
    taken: dict[tuple[Node, int], str] = {}
    for node in gm.graph.nodes:
        if node.target is operator.getitem and isinstance(node.args[0], Node):
            key = (node.args[0], node.args[1])
            values[node] = taken.setdefault(key, node.name)
        else:
            values[node] = node.name
    return values


def _node_proto(node: Node, values: dict[Node, str]):
    """(NodeProto, [(output name, FakeTensor)]) for one call_function node."""
    ins, attrs = [], {}
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if i < len(node.args) and not arg.kwarg_only:
                _add_arg(arg.name, node.args[i], values, ins, attrs)
            elif arg.name in node.kwargs:
                _add_arg(arg.name, node.kwargs[arg.name], values, ins, attrs)
    else:  # a plain Python callable: positional names arg0, arg1, ...
        for i, a in enumerate(node.args):
            _add_arg(f"arg{i}", a, values, ins, attrs)
        for k, a in node.kwargs.items():
            _add_arg(k, a, values, ins, attrs)
    overload = getattr(target, "_overloadname", "default")
    if overload != "default":
        attrs["overload"] = overload
    domain = namespace(node) or "python"
    op_type = getattr(target, "_opname", None) or op_name(node)
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        readers = {u.args[1]: values[u] for u in node.users if u.target is operator.getitem}
        outs = [(readers.get(i, f"{node.name}.out{i}"), v) for i, v in enumerate(val)]
    else:
        outs = [(node.name, val)]
    proto = helper.make_node(op_type, ins, [o for o, _ in outs], name=node.name, domain=domain,
                             doc_string=_doc(node))
    for key, value in attrs.items():  # not make_node(**attrs): `overload` is a NodeProto field
        kind = AttributeProto.INTS if value == [] else None  # an empty list has no type
        proto.attribute.append(helper.make_attribute(key, value, attr_type=kind))
    return proto, outs


def _add_arg(name: str, value, values: dict[Node, str], ins: list[str], attrs: dict) -> None:
    """Tensors (and lists of them) to `ins`, everything else to `attrs[name]`."""
    if isinstance(value, Node):
        ins.append(values[value])
    elif isinstance(value, (list, tuple)) and any(isinstance(v, Node) for v in value):
        ins.extend(values[v] if isinstance(v, Node) else "" for v in value)
    elif value is not None:
        attrs[name] = _attribute_value(value)


def _attribute_value(value):
    """A Python argument as something `helper.make_attribute` takes."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        items = [int(v) if isinstance(v, bool) else v for v in value]
        if all(isinstance(v, int) for v in items):
            return [int(v) for v in items]
        if all(isinstance(v, (int, float)) for v in items):
            return [float(v) for v in items]
        return [str(v) for v in items]
    return str(value)


def _value_info(name: str, val) -> onnx.ValueInfoProto:
    if not isinstance(val, torch.Tensor):
        return helper.make_empty_tensor_value_info(name)
    shape = [d if isinstance(d, int) else str(d) for d in val.shape]
    info = helper.make_tensor_value_info(name, elem_type(val.dtype), shape)
    if val.dtype not in _DTYPES:
        info.doc_string = f"torch dtype {val.dtype}"
    return info


def _doc(node: Node) -> str:
    """Where the node came from: its layer and block, and its innermost source line."""
    layer = node.meta.get("flintc_layer")
    parts = ["shared" if layer is None else f"layer {layer}"]
    if node.meta.get("flintc_block"):
        parts.append(f"block {node.meta['flintc_block']}")
    frames = _FRAME_RE.findall(node.meta.get("stack_trace") or "")
    if frames:
        path, line, code = frames[-1]
        parts.append(f"{path.rsplit('/', 1)[-1]}:{line}: {code.strip()}")
    return "; ".join(parts)


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in \S+\n(.*)')
