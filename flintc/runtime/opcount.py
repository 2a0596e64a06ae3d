"""Count the aten ops (and Triton launches) of one call of a generated step function,
per layer and per line of `runtime.py` that issued them: where a prefill chunk's glue
kernels (`at::native::*elementwise_kernel`, sorts, gathers, scans) come from.

Every aten op that reaches the dispatcher is counted once (a `TorchDispatchMode`, so
composite ops are counted as the ops they decompose into, e.g. `argsort` as `sort`),
except the ones that launch no kernel on a GPU: views and metadata ops (`NO_KERNEL`)
and empty allocations. Ops issued by Triton's interpreter (its CPU emulation of a
kernel) are not counted; each Triton kernel launch is counted once under its name.
Op counts do not depend on shapes, so the `tiny` config shows the per-layer counts of
the full model (47 MoE layers, 2 dense, plus the model-level ops).

On the CPU, `gpu_like=True` makes the count follow what a GPU runs where the code
branches on the device: the MoE expert GEMMs take the implementation "auto" picks on an
GPU (triton, both formats), the norms and elementwise ops of `flintc.kernels.prefill_ops`
their Triton kernels (`flintc.kernels.prefill_norm`), and `flintc.kernels.gemm._mm_fp32`
(cuBLAS `aten::mm.dtype` on CUDA, upcasts + an fp32 matmul on the CPU) is counted as the
one `mm.dtype` it is on CUDA.

    from flintc.runtime.opcount import count_step_ops, format_counts
    counts = count_step_ops(runner, f"prefill_t{runner.prefill_chunk}")
    print(format_counts(counts))
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch no kernel on a GPU (views, metadata, uninitialised allocations)
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "alias", "as_strided", "slice", "select",
    "unsqueeze", "squeeze", "expand", "permute", "transpose", "t", "detach", "unbind", "split",
    "split_with_sizes", "narrow", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "lift_fresh", "view_as", "numpy_T", "_local_scalar_dense", "sym_size",
    "sym_stride", "sym_numel", "is_same_size", "set_",
})

_LINE = re.compile(r"^\s*(\w+) = (K\.(\w+)|aten\.(\w+)\.\w+)\(.*# (?:kernel \d+|view): \w+, (layer (\d+)|model)\s*$")


@dataclass
class OpCounts:
    """Counts of one call: `by_layer[layer][(caller, op)]`, layer an int or "model",
    caller the runtime.py launch (`K.<op>` or `aten.<op>`), op `aten.<name>` or
    `triton.<kernel>`; `function`: the step function's name."""

    function: str
    by_layer: dict = field(default_factory=dict)

    def layer_total(self, layer, prefix: str = "aten.") -> int:
        """Ops of `layer` whose name starts with `prefix` ("aten." or "triton.")."""
        return sum(n for (_, op), n in self.by_layer.get(layer, {}).items() if op.startswith(prefix))


def _line_map(path) -> dict[int, tuple]:
    """runtime.py line number -> (caller, layer) for every launch line."""
    out = {}
    for i, line in enumerate(open(path).read().splitlines(), start=1):
        m = _LINE.match(line)
        if m:
            caller = f"K.{m.group(3)}" if m.group(3) else f"aten.{m.group(4)}"
            out[i] = (caller, int(m.group(6)) if m.group(6) else "model")
    return out


class _Counter(TorchDispatchMode):
    def __init__(self, code, lines):
        super().__init__()
        self.code, self.lines = code, lines
        self.counts: dict = {}
        self.quiet = 0  # > 0 inside a Triton launch or a stand-in

    def where(self):
        f = sys._getframe(1)
        while f is not None and f.f_code is not self.code:
            f = f.f_back
        return self.lines.get(f.f_lineno, ("?", "model")) if f is not None else ("outside", "model")

    def record(self, op: str) -> None:
        caller, layer = self.where()
        c = self.counts.setdefault(layer, Counter())
        c[(caller, op)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.quiet:
            return func(*args, **kwargs)
        if func.namespace != "aten":  # a flintc reference op: count the ops of its body
            from torch._library.custom_ops import OPDEFS

            opdef = OPDEFS.get(f"{func.namespace}::{func.overloadpacket.__name__}")
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
        with self:  # a composite op (e.g. `to`, `argsort`): count what it decomposes into
            out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.record(f"aten.{name}" + (".dtype" if func._overloadname == "dtype" else ""))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _patched(mode: _Counter, gpu_like: bool, device: torch.device):
    """Count Triton launches (quietly: the interpreter's own torch calls are not counted)
    and, with `gpu_like` on a CPU, the GPU's choices (module docstring)."""
    import triton

    undo = []

    def patch(owner, name, value):
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    from triton.runtime.jit import JITFunction

    targets = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        targets.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - triton without an interpreter
        pass
    for cls in targets:
        real_run = cls.run

        def run(self, *args, _real=real_run, **kwargs):
            if not kwargs.get("warmup"):
                mode.record(f"triton.{getattr(self, '__name__', None) or self.fn.__name__}")
            mode.quiet += 1
            try:
                return _real(self, *args, **kwargs)
            finally:
                mode.quiet -= 1

        patch(cls, "run", run)
    if gpu_like and device.type != "cuda":
        from flintc.kernels import gemm as G
        from flintc.kernels import grouped_gemm as GG
        from flintc.kernels import prefill_ops as PO

        real_mm = G._mm_fp32

        def mm_fp32(a, b_t):
            mode.record("aten.mm.dtype")
            mode.quiet += 1
            try:
                return real_mm(a, b_t)
            finally:
                mode.quiet -= 1

        real_pick = GG._pick_impl
        patch(G, "_mm_fp32", mm_fp32)
        patch(GG, "_pick_impl", lambda op, impl, nvfp4, dev: real_pick(op, "triton", nvfp4, dev))
        patch(PO, "_use_triton", lambda t: True)
    del triton
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def count_step_ops(runner, name: str, gpu_like: bool = True, seed: int = 1) -> OpCounts:
    """Run the generated function `name` of `runner` (a `CompiledRunner`) once on seeded
    token ids (positions from 0, slot 0) and count its aten ops and Triton launches.

    Args:
        runner: a loaded build (`flintc.runtime.compiled.load_build`); its KV cache slot 0
            is written as by a real call.
        name: a function of the build ("prefill_t8", "decode_b1", ...).
        gpu_like: on a CPU, count what a GPU would run (module docstring).

    Returns:
        OpCounts (per layer, per runtime.py caller and op).

    Raises:
        InputError: `name` is not a function of the build.
    """
    from flintc.errors import InputError

    if name not in runner.plan:
        raise InputError(f"no function {name!r} in {runner.build}; it has {sorted(runner.plan)}")
    B, T = runner.plan[name]["batch"], runner.plan[name]["tokens"]
    dev = runner.device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, runner.config.vocab_size, (B, T), generator=g).to(dev)
    pos = torch.arange(T).expand(B, T).contiguous().to(dev)
    slots = torch.arange(B).to(dev)
    fn = runner._module.STEPS[name]
    mode = _Counter(fn.__code__, _line_map(runner.build / "runtime.py"))
    with _patched(mode, gpu_like, dev), mode:
        runner.forward(name, ids, pos, slots)
    return OpCounts(name, {k: dict(v) for k, v in mode.counts.items()})


def format_counts(counts: OpCounts, title: str = "") -> str:
    """A Markdown table: one row per (caller, op), one column per layer and the model-level
    ops, then the totals (aten ops and Triton launches) per column."""
    layers = sorted(k for k in counts.by_layer if k != "model") + \
        (["model"] if "model" in counts.by_layer else [])
    keys = sorted({k for c in counts.by_layer.values() for k in c},
                  key=lambda k: (k[1].startswith("triton."), k[0], k[1]))
    head = ["caller", "op"] + [f"L{x}" if x != "model" else "model" for x in layers]
    lines = ([f"{title}", ""] if title else []) + \
        ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for caller, op in keys:
        row = [caller, op] + [str(counts.by_layer.get(x, {}).get((caller, op), "")) for x in layers]
        lines.append("| " + " | ".join(row) + " |")
    for label, prefix in (("aten ops", "aten."), ("Triton launches", "triton.")):
        lines.append("| **total** | " + label + " | " +
                     " | ".join(str(counts.layer_total(x, prefix)) for x in layers) + " |")
    return "\n".join(lines)


__all__ = ["NO_KERNEL", "OpCounts", "count_step_ops", "format_counts"]
