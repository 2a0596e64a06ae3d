"""The device a run uses, shared by the command line and the Python API.

Triton kernels run on a CPU only in Triton's interpreter, which `@triton.jit` selects
when it decorates a kernel: `TRITON_INTERPRET=1` must be set before flintc's kernel
modules are imported. `prepare_device` (the CLI, `flintc.compile`, `flintc.load`) and
`use_triton_interpreter` (`load_build` of a triton build on the CPU) set it.
"""

from __future__ import annotations

import os
import sys

from flintc.errors import InputError

INTERPRET_ENV = "TRITON_INTERPRET"


def prepare_device(name: str) -> None:
    """Select Triton's interpreter for a CPU run before anything imports triton, and
    fail early for a missing GPU (`flintc compile --load-format dummy --no-check` for
    cuda without a GPU cross-compiles instead: weights on the meta device).

    Raises:
        InputError: `name` is neither cpu nor cuda[:N], or cuda without a GPU.
    """
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {name}: no CUDA GPU is available (--device cpu runs on the CPU)")
    elif name == "cpu":
        os.environ.setdefault(INTERPRET_ENV, "1")
    else:
        raise InputError(f"--device: unknown device {name!r} (expected cpu or cuda)")


def _compiled_kernel_modules() -> list[str]:
    """flintc kernel modules already imported whose kernels `@triton.jit` compiled for
    a GPU (imported while TRITON_INTERPRET was not 1)."""
    if "triton" not in sys.modules:
        return []
    from triton.runtime.jit import JITFunction

    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith("flintc.kernels.") and mod is not None
                  and any(isinstance(v, JITFunction) for v in vars(mod).values()))


def use_triton_interpreter(what) -> None:
    """Make the Triton kernels of `what` (a build, named in errors) run on the CPU, in
    Triton's interpreter, as `flintc run --device cpu` does: sets TRITON_INTERPRET=1
    unless the environment sets it, and checks that no flintc kernel module was imported
    before that (its kernels would be compiled for a GPU).

    Raises:
        InputError: TRITON_INTERPRET is set to something other than 1, or flintc's
            kernels were imported before it was set; the message says what to do.
    """
    os.environ.setdefault(INTERPRET_ENV, "1")
    value = os.environ[INTERPRET_ENV]
    if value != "1":
        raise InputError(f"{what} runs Triton kernels on the CPU, which needs Triton's interpreter, but "
                         f"{INTERPRET_ENV}={value!r} is set; unset it or set {INTERPRET_ENV}=1 (or use a "
                         "build compiled with --backend torch)")
    compiled = _compiled_kernel_modules()
    if compiled:
        raise InputError(f"{what} runs Triton kernels on the CPU, but {compiled[0]} was imported before "
                         f"{INTERPRET_ENV}=1 was set (its kernels are compiled for a GPU); set "
                         f"{INTERPRET_ENV}=1 in the environment, or load the build before importing "
                         "flintc.kernels")


__all__ = ["INTERPRET_ENV", "prepare_device", "use_triton_interpreter"]
