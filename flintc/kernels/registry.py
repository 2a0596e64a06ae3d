"""Which Triton kernel implements which flintc op, per step.

Every kernel module ends with `KERNELS: dict[str, Callable]` (op short name ->
launcher taking the op's arguments plus keyword `use_pdl`). Decode and prefill may
implement the same op differently (a GEMV-style MoE kernel for <= 8 tokens, a
grouped GEMM after sorting tokens by expert for a prefill chunk), so each step has
its own ordered list of modules; the first module that has an op wins.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

DECODE_MODULES = (
    "flintc.kernels.fused_gemv",
    "flintc.kernels.moe",
    "flintc.kernels.decode_attention",
    "flintc.kernels.gemv",
)
PREFILL_MODULES = (
    "flintc.kernels.prefill_attention",
    "flintc.kernels.grouped_gemm",
    "flintc.kernels.gemm",
    "flintc.kernels.prefill_ops",
)


def _load(module: str) -> dict[str, Callable]:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:  # the module is not written (yet); others' errors propagate
            return {}
        raise
    return dict(getattr(mod, "KERNELS", {}))


def kernels_for(step: str) -> dict[str, tuple[str, Callable]]:
    """op short name -> (module, launcher) for `step` ("decode" or "prefill").

    Raises:
        ValueError: unknown step.
        ImportError: triton is not installed.
    """
    if step not in ("decode", "prefill"):
        raise ValueError(f"unknown step {step!r}; expected 'decode' or 'prefill'")
    import triton  # noqa: F401  (a clear ImportError when the backend cannot work)

    found: dict[str, tuple[str, Callable]] = {}
    for module in DECODE_MODULES if step == "decode" else PREFILL_MODULES:
        for name, fn in _load(module).items():
            found.setdefault(name, (module, fn))
    return found
