"""Checks of the test process's Triton state, which `tests/conftest.py` runs around each
test: interpreted launches (below), and TRITON_INTERPRET between tests
(`interpret_for_a_test`).

Triton's interpreter runs a launch with any num_warps; compiled Triton asserts a power of
two (CUDAOptions: "num_warps must be a power of 2"). prefill_norm.qk_norm_rope gave 3 at
head dim 96: every CPU twin passed and the launch failed on an H100 (session 34). So in
the test process an interpreted launch must pass the options compiled Triton would take.
"""

from __future__ import annotations

import sys


def check_interpreted_launches() -> None:
    """Wrap `InterpretedFunction.run` (once) to refuse a num_warps that is not a power of
    two, naming the kernel (AssertionError), and give tl.dot NVIDIA's shape bounds
    (`_nvidia_dot_bounds`). Only once `triton.runtime.interpreter` is imported (by the
    first @triton.jit under TRITON_INTERPRET=1): importing it here, before a test module
    sets TRITON_INTERPRET=1, would make triton.language's own functions (tl.zeros, ...)
    JIT functions that an interpreted device function cannot call. So a test that imports
    the first kernel module itself runs unchecked, and so do subprocesses."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    cls = getattr(interpreter, "InterpretedFunction", None)
    real = getattr(cls, "run", None)
    if real is None or getattr(real, "_flintc_checked", False):
        return

    def run(self, *args, **kwargs):
        warps = kwargs.get("num_warps")
        if warps is not None and (int(warps) < 1 or int(warps) & (int(warps) - 1)):
            name = getattr(getattr(self, "fn", None), "__name__", "a kernel")
            raise AssertionError(f"{name} launched with num_warps={warps}: compiled Triton takes only "
                                 "a power of two (the interpreter does not check)")
        return real(self, *args, **kwargs)

    run._flintc_checked = True
    cls.run = run
    _nvidia_dot_bounds(interpreter)


def _nvidia_dot_bounds(interpreter) -> None:
    """The interpreter's tl.dot takes any shape (its builder's min_dot_size is (1, 1, 1));
    compiled for NVIDIA, K must be at least 16 for 16-bit operands (8 for fp32, 32 for
    8-bit): the NVIDIA backend's bounds (`triton.backends.nvidia.compiler.min_dot_size`, sm_90)
    go into the interpreter's builder, so a CPU twin with a smaller tile fails as the GPU
    compile would. Without that backend (a triton build for another target), nothing."""
    builder = getattr(interpreter, "interpreter_builder", None)
    fns = getattr(builder, "codegen_fns", None)
    if not isinstance(fns, dict):
        return
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import min_dot_size

        fns["min_dot_size"] = min_dot_size(GPUTarget("cuda", 90, 32))
    except Exception:  # another triton's backend API: the interpreter keeps its own bounds
        return


# ------------------------------------------------ TRITON_INTERPRET between tests
INTERPRET_COLLECTED: list[str | None] = []  # the value once collection finished


def interpret_for_a_test(current: str | None) -> str | None:
    """TRITON_INTERPRET as a test should start: the value collection left
    (`INTERPRET_COLLECTED`) when a fixture of a wider scope changed it, e.g. a
    module-scoped `flintc compile` with the default `--device cpu`, which sets it
    (`prepare_device`) for the rest of the process: on a GPU machine every later GPU
    test's launches then took the interpreter's paths, and the CUDA kernels refused the
    weights `prepack` had converted (session 35, `docs/gpu-runs.md`). Kept: "1" on a
    machine without a CUDA GPU, where the kernels can only run interpreted."""
    if not INTERPRET_COLLECTED or current == INTERPRET_COLLECTED[0]:
        return current
    if current == "1":
        import torch

        if not torch.cuda.is_available():
            return current
    return INTERPRET_COLLECTED[0]


def import_kernel_modules() -> None:
    """Import every `flintc.kernels` module now (with whatever TRITON_INTERPRET is set:
    Triton decorates their kernels for it, for the rest of the process). Used by
    tests/conftest.py on a GPU machine and by the gpu_imports plugin."""
    import importlib
    import pkgutil

    import flintc.kernels

    for module in pkgutil.iter_modules(flintc.kernels.__path__):
        importlib.import_module(f"flintc.kernels.{module.name}")
