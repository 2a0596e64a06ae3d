"""Find host synchronisations and CUDA-graph-illegal operations on any device, the CPU
included: `forbid_host_sync()` makes them raise `HostSyncError` while it is active.

A CUDA graph captures kernels; anything that needs a device value on the host (a
`.item()`, a `.tolist()`, a bool mask's `nonzero`, a Python `if` on a tensor, a grid
or an allocation sized from a device value) or a copy from host memory made inside the
captured function either fails the capture or bakes one call's values into every
replay. On a GPU `torch.cuda.set_sync_debug_mode("error")` finds some of these; this
module finds them on the CPU too (the test machines have no GPU), by two means:

* a `TorchDispatchMode` that refuses the aten ops which read a device value on the host
  or allocate by one: `_local_scalar_dense` (behind `.item()`, `int(t)`, `bool(t)`,
  `if t:`), `nonzero`, `masked_select`, the `unique` family, `bincount`, `histc`,
  `equal`, `repeat_interleave` with a tensor of repeats and no `output_size`, indexing
  or index_put with a bool mask, `lift_fresh` (a tensor made from Python data, e.g.
  `torch.tensor([...])`: a host-to-device copy on a GPU), a `_to_copy` / `copy_` across
  devices;
* patched Python methods that reach host memory without an aten op on a CPU tensor:
  `Tensor.tolist`, `.cpu`, `.numpy`, `torch.cuda.synchronize`.

Calls made by Triton itself (its interpreter runs kernels through numpy on CPU tensors)
are allowed: the check looks for a frame of the `triton` package on the stack when a
forbidden call is seen. What this cannot see: syncs inside C++ kernels (e.g. the
non-sm90 fallback of `torch._grouped_mm`, which copies its offsets to the host) and
implicit CPU-scalar-tensor operands; on a GPU the capture itself reports those.

    with forbid_host_sync():
        runner.forward("prefill_t8", ids, positions, slots)
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """A host synchronisation or a CUDA-graph-illegal operation inside `forbid_host_sync()`."""


def _packets() -> set:
    names = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "unique_dim_consecutive", "bincount", "histc", "equal", "is_nonzero",
             "lift_fresh", "lift_fresh_copy", "argwhere", "_assert_scalar")
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


_FORBIDDEN = _packets()
_TRITON_DIR = None


def _triton_dir() -> str | None:
    global _TRITON_DIR
    if _TRITON_DIR is None:
        try:
            import triton

            _TRITON_DIR = str(Path(triton.__file__).resolve().parent)
        except ImportError:
            _TRITON_DIR = ""
    return _TRITON_DIR or None


def _from_triton() -> bool:
    """Whether the current call comes from inside the triton package (its interpreter)."""
    root = _triton_dir()
    if root is None:
        return False
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.startswith(root):
            return True
        f = f.f_back
    return False


def _has_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _why(func, args, kwargs) -> str | None:
    """Why the aten call `func(*args, **kwargs)` is not capturable, or None."""
    packet = func.overloadpacket
    if packet in _FORBIDDEN:
        return f"aten.{packet.__name__} reads a device value on the host (or copies host data in)"
    if packet is aten.repeat_interleave and func._overloadname == "Tensor" and \
            kwargs.get("output_size", args[1] if len(args) > 1 else None) is None:
        return "repeat_interleave with a tensor of repeats and no output_size sizes its output on the host"
    if packet is aten.repeat_interleave and func._overloadname == "self_Tensor" and \
            kwargs.get("output_size", args[3] if len(args) > 3 else None) is None:
        return "repeat_interleave with a tensor of repeats and no output_size sizes its output on the host"
    if packet in (aten.index, aten._unsafe_index) and _has_bool_index(args[1] if len(args) > 1 else None):
        return "indexing with a bool mask (nonzero on the host)"
    if packet in (aten.index_put, aten.index_put_, aten._index_put_impl_, aten._unsafe_index_put) and \
            _has_bool_index(args[1] if len(args) > 1 else None):
        return "index_put with a bool mask (nonzero on the host)"
    if packet is aten._to_copy:
        dev = kwargs.get("device")
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if dev is not None and src is not None and torch.device(dev) != src.device:
            return f"a copy from {src.device} to {dev}"
    if packet is aten.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor) \
            and args[0].device != args[1].device:
        return f"a copy from {args[1].device} to {args[0].device}"
    return None


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _why(func, args, kwargs)
        if why is not None and not _from_triton():
            raise HostSyncError(f"host sync / not capturable: {func} ({why})")
        return func(*args, **kwargs)


def _refuse(name: str, real):
    def call(*args, **kwargs):
        if not _from_triton():
            raise HostSyncError(f"host sync / not capturable: {name}")
        return real(*args, **kwargs)

    call.__name__ = getattr(real, "__name__", name)
    return call


@contextlib.contextmanager
def forbid_host_sync():
    """Raise `HostSyncError` at the first host sync or graph-illegal op until the block
    exits (see the module docstring for what is caught). Not thread-safe: it patches
    `torch.Tensor` methods for the duration."""
    patched = [(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")] + [(torch.cuda, "synchronize")]
    saved = [(owner, name, owner.__dict__.get(name), getattr(owner, name)) for owner, name in patched]
    for owner, name, _, real in saved:
        label = f"torch.cuda.{name}()" if owner is torch.cuda else f"Tensor.{name}()"
        setattr(owner, name, _refuse(label, real))
    try:
        with _Mode():
            yield
    finally:
        for owner, name, own, _ in saved:
            if own is None:
                delattr(owner, name)  # it was inherited (torch._C.TensorBase)
            else:
                setattr(owner, name, own)


__all__ = ["HostSyncError", "forbid_host_sync"]
