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

import functools
import operator
import re
from typing import NamedTuple

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

    What a node's op contributes (schema argument names, the arguments it writes,
    domain, op type, overload) is looked up once per op (`_op_info`), and the type
    of a value once per dtype and shape; the protos are built in place in the
    graph rather than built apart and copied in.
    """
    values = _value_names(gm)
    graph = onnx.GraphProto()
    types: dict = {}  # (dtype, shape) -> TypeProto
    kv_writes, domains = [], {"aten", "flintc"}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            _value_info(graph.input.add(), node.name, node.meta.get("val"), types)
        elif node.op == "call_function" and node.target is not operator.getitem:
            info = _op_info(node.target, node)
            domains.add(info.domain)
            outs = _node_proto(graph.node.add(), node, info, values)
            for out_name, v in outs:
                if isinstance(v, torch.Tensor):
                    _value_info(graph.value_info.add(), out_name, v, types)
            if info.writes and not node.users and _mutated_args(node):
                kv_writes.append(node)  # a KV-cache write: keep it visible
        elif node.op == "output":
            for n in _flatten(node.args[0]):
                if isinstance(n, Node):
                    _value_info(graph.output.add(), values[n], n.meta.get("val"), types)
    for node in kv_writes:  # graph outputs after the FX output
        _value_info(graph.output.add(), values[node], node.meta.get("val"), types)
    graph.name = name
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


class _OpInfo(NamedTuple):
    """What the export needs of one op, read from its schema once."""

    args: tuple[tuple[str, bool], ...] | None  # (name, kwarg_only) per schema argument
    writes: bool  # some argument is written in place (see spec._mutated_args)
    overload: str
    domain: str
    op_type: str


_OP_INFOS: dict = {}


def _op_info(target, node: Node) -> _OpInfo:
    """`target`'s _OpInfo, cached: walking `_schema.arguments` crosses into C++ on
    every access, and a graph calls the same few dozen ops thousands of times."""
    try:
        return _OP_INFOS[target]
    except (KeyError, TypeError):  # TypeError: an unhashable callable, never cached
        pass
    schema = getattr(target, "_schema", None)
    args = writes = None
    if schema is not None:
        arguments = list(schema.arguments)
        args = tuple((a.name, a.kwarg_only) for a in arguments)
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in arguments)
    info = _OpInfo(args, bool(writes), getattr(target, "_overloadname", "default"),
                   namespace(node) or "python", getattr(target, "_opname", None) or op_name(node))
    if isinstance(target, torch._ops.OpOverload):  # long-lived and hashable; plain callables are not kept
        _OP_INFOS[target] = info
    return info


def _node_proto(proto: onnx.NodeProto, node: Node, info: _OpInfo, values: dict[Node, str]):
    """Fill `proto` for one call_function node; returns [(output name, FakeTensor)]."""
    ins, attrs = [], {}
    if info.args is not None:
        args, kwargs = node.args, node.kwargs
        for i, (arg_name, kwarg_only) in enumerate(info.args):
            if i < len(args) and not kwarg_only:
                _add_arg(arg_name, args[i], values, ins, attrs)
            elif arg_name in kwargs:
                _add_arg(arg_name, kwargs[arg_name], values, ins, attrs)
    else:  # a plain Python callable: positional names arg0, arg1, ...
        for i, a in enumerate(node.args):
            _add_arg(f"arg{i}", a, values, ins, attrs)
        for k, a in node.kwargs.items():
            _add_arg(k, a, values, ins, attrs)
    if info.overload != "default":
        attrs["overload"] = info.overload
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        readers = {u.args[1]: values[u] for u in node.users if u.target is operator.getitem}
        outs = [(readers.get(i, f"{node.name}.out{i}"), v) for i, v in enumerate(val)]
    else:
        outs = [(node.name, val)]
    # The fields helper.make_node sets, in its order.
    proto.op_type = info.op_type
    proto.input.extend(ins)
    proto.output.extend(o for o, _ in outs)
    if node.name:
        proto.name = node.name
    doc = _doc(node)
    if doc:
        proto.doc_string = doc
    proto.domain = info.domain
    for key, value in attrs.items():  # not make_node(**attrs): `overload` is a NodeProto field
        kind = AttributeProto.INTS if value == [] else None  # an empty list has no type
        proto.attribute.append(helper.make_attribute(key, value, attr_type=kind))
    return outs


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


def _value_info(info: onnx.ValueInfoProto, name: str, val, types: dict) -> None:
    """Fill `info` as helper.make_tensor_value_info would (make_empty_tensor_value_info
    for a value that is not a tensor); `types` caches one TypeProto per dtype and shape."""
    info.name = name
    if not isinstance(val, torch.Tensor):
        return
    shape = tuple(d if isinstance(d, int) else str(d) for d in val.shape)
    key = (val.dtype, shape)
    tp = types.get(key)
    if tp is None:
        tp = types[key] = helper.make_tensor_type_proto(elem_type(val.dtype), shape)
    if val.dtype not in _DTYPES:
        info.doc_string = f"torch dtype {val.dtype}"
    info.type.CopyFrom(tp)


def _doc(node: Node) -> str:
    """Where the node came from: its layer and block, and its innermost source line."""
    layer = node.meta.get("flintc_layer")
    parts = ["shared" if layer is None else f"layer {layer}"]
    if node.meta.get("flintc_block"):
        parts.append(f"block {node.meta['flintc_block']}")
    frame = _last_frame(node.meta.get("stack_trace") or "")
    if frame:
        parts.append(frame)
    return "; ".join(parts)


@functools.lru_cache(maxsize=16384)
def _last_frame(stack_trace: str) -> str:
    """`file.py:LINE: code` of the innermost frame of an FX stack trace ("" if none).
    Cached: a node keeps its stack trace string from pass to pass, so every stage
    after the first finds most of them here."""
    frames = _FRAME_RE.findall(stack_trace)
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}: {code.strip()}"


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in \S+\n(.*)')
