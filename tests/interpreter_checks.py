"""A check of interpreted Triton launches for the test process (`tests/conftest.py` runs it
before each test).

Triton's interpreter runs a launch with any num_warps; compiled Triton asserts a power of
two (CUDAOptions: "num_warps must be a power of 2"). prefill_norm.qk_norm_rope gave 3 at
head dim 96: every CPU twin passed and the launch failed on an H100 (session 34). So in
the test process an interpreted launch must pass the options compiled Triton would take.
"""

from __future__ import annotations

import sys


def check_interpreted_launches() -> None:
    """Wrap `InterpretedFunction.run` (once) to refuse a num_warps that is not a power of
    two, naming the kernel (AssertionError). Only once triton is imported: importing it
    here, before a test module sets TRITON_INTERPRET=1, would make triton.language's own
    functions (tl.zeros, ...) JIT functions that an interpreted device function cannot
    call."""
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
