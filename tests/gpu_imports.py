"""A pytest plugin that gives a CPU run a GPU machine's kernel imports.

On a machine with a CUDA GPU the test modules leave TRITON_INTERPRET unset, so flintc's
kernel modules are imported with Triton's JIT; a test that runs those kernels on CPU
tensors in the pytest process then fails there (session 33 found eight in
tests/runtime, `docs/gpu-runs.md`). Without a GPU, this plugin reproduces that state:
it imports every `flintc.kernels` module with TRITON_INTERPRET unset before any test
module is collected. A test that needs the interpreter in-process then fails on the CPU
too, and should carry `harness.cpu_interpreter_only`:

    PYTHONPATH=tests python -m pytest -p gpu_imports --ignore=tests/kernels -n 2

(tests/kernels is left out: its CPU tests run their kernels in the interpreter and its
GPU tests take over on a GPU, so under this plugin they fail by design.) With
FLINTC_TEST_FAKE_CUDA=1 the plugin also makes `torch.cuda.is_available()` return True,
so that the marked tests skip as on a GPU machine; use it only with the files to check,
since code that then believes in a GPU takes CUDA paths.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)
if os.environ.get("FLINTC_TEST_FAKE_CUDA") == "1":
    import torch

    torch.cuda.is_available = lambda: True

from interpreter_checks import import_kernel_modules  # noqa: E402

import_kernel_modules()  # after TRITON_INTERPRET is unset
