"""The kernel table a generated step calls: `K.<op>(*args, use_pdl=...)`.

backend "torch": every op runs its reference implementation (`torch.ops.flintc.<op>`,
plain PyTorch; `use_pdl` is ignored). backend "triton": ops with a Triton kernel for
the step (`flintc.kernels.registry`) run it, the rest fall back to the reference op;
`implementations()` says which is which, and the build report records it.
"""

from __future__ import annotations

from typing import Callable

import torch

BACKENDS = ("torch", "triton")


def _reference(op: str) -> Callable:
    packet = getattr(torch.ops.flintc, op)
    fn = packet.default

    def call(*args, use_pdl: bool = False):
        return fn(*args)

    call.__name__ = op
    return call


class KernelTable:
    """Attribute access by op short name (`K.gemv_residual`).

    Args:
        backend: "torch" or "triton".
        step: "decode" or "prefill" (which Triton kernels apply).

    Raises:
        ValueError: unknown backend.
        ImportError: backend "triton" without triton installed.
    """

    def __init__(self, backend: str, step: str):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        import flintc.ops  # noqa: F401  (registers torch.ops.flintc.*)

        self.backend, self.step = backend, step
        self._triton = {}
        if backend == "triton":
            from flintc.kernels.registry import kernels_for

            self._triton = kernels_for(step)
        self._cache: dict[str, Callable] = {}

    def __getattr__(self, op: str) -> Callable:
        if op.startswith("_"):
            raise AttributeError(op)
        fn = self._cache.get(op)
        if fn is None:
            fn = self._triton[op][1] if op in self._triton else _reference(op)
            self._cache[op] = fn
        return fn

    def implementation(self, op: str) -> str:
        """Where `op` runs: "<module>.<launcher>" or "reference (torch.ops.flintc.<op>)"."""
        if op in self._triton:
            module, fn = self._triton[op]
            return f"{module}.{getattr(fn, '__name__', op)}"
        return f"reference (torch.ops.flintc.{op})"

    def implementations(self, ops) -> dict[str, str]:
        return {op: self.implementation(op) for op in sorted(set(ops))}
