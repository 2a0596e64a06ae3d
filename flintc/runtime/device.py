"""The device a run uses, shared by the command line and the Python API.

Triton kernels run on a CPU only in Triton's interpreter, which `@triton.jit` selects
when it decorates a kernel: `TRITON_INTERPRET=1` must be set before flintc's kernel
modules are imported. `prepare_device` (the CLI, `flintc.compile`, `flintc.load`) and
`use_triton_interpreter` (`load_build` of a triton build on the CPU) set it.
`check_weights_fit` refuses weights the CPU has not the memory for (the checkpoint
loader calls it before making or reading any).
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


def available_memory_bytes() -> int | None:
    """Bytes of memory a new allocation can take on this machine: MemAvailable of
    /proc/meminfo, else the free pages (`os.sysconf`); None when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# A run needs more than its weights (activations, KV caches, a compile's checks): the
# weights may take at most 1/WEIGHTS_HEADROOM of the available memory.
WEIGHTS_HEADROOM = 1.1


def check_weights_fit(config, fmt: str, device) -> None:
    """Refuse to make or load the `fmt` weights of `config` on a CPU without the memory
    for them, before any allocation: the process would be killed part-way (out of
    memory) without a word. The full config needs about 74 GiB in bf16, 22 GiB in NVFP4
    (`flintc.bench.roofline.weight_bytes` of every expert and the whole vocabulary),
    the tiny one a few MB; refused when that times WEIGHTS_HEADROOM is more than the
    available memory (`available_memory_bytes`). Nothing is checked for
    another device (CUDA's own out-of-memory error says what happened; "meta" allocates
    nothing) or when the available memory cannot be read.

    Raises:
        InputError: the weights (times WEIGHTS_HEADROOM) need more than the available
            memory; the message names the config, the sizes in GiB, and suggests
            --config tiny or a GPU.
    """
    import torch

    if torch.device(device).type != "cpu":
        return
    from flintc.bench.roofline import weight_bytes

    need = weight_bytes(config, fmt, config.n_routed_experts, config.vocab_size).total
    avail = available_memory_bytes()
    if avail is None or need * WEIGHTS_HEADROOM <= avail:
        return
    source = str(getattr(config, "source", "") or "")
    name = (f"the {source[len('<preset '):-1]} config" if source.startswith("<preset ") and source.endswith(">")
            else f"the config {source}" if source else "the model's config")
    raise InputError(f"{name}: its {fmt} weights take about {need / 2**30:.1f} GiB (a run about "
                     f"{need * WEIGHTS_HEADROOM / 2**30:.1f} GiB), but only {avail / 2**30:.1f} GiB of memory is "
                     "available on this machine: a CPU run of it would be killed for lack of memory; use a smaller "
                     "config (--config tiny) or a CUDA GPU (--device cuda)")


def _compiled_kernel_modules() -> list[str]:
    """flintc kernel modules already imported whose kernels `@triton.jit` compiled for
    a GPU (imported while TRITON_INTERPRET was not 1)."""
    if "triton" not in sys.modules:
        return []
    from triton.runtime.jit import JITFunction

    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith("flintc.kernels.") and mod is not None
                  and any(isinstance(v, JITFunction) for v in vars(mod).values()))


def interpreted_kernel_modules() -> list[str]:
    """flintc kernel modules already imported whose kernels `@triton.jit` made interpreted
    functions (imported while TRITON_INTERPRET was 1): they run only in Triton's
    interpreter, on any device, for the rest of the process."""
    if "triton.runtime.interpreter" not in sys.modules:
        return []
    from triton.runtime.interpreter import InterpretedFunction

    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith("flintc.kernels.") and mod is not None
                  and any(isinstance(v, InterpretedFunction) for v in vars(mod).values()))


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


__all__ = ["INTERPRET_ENV", "available_memory_bytes", "check_weights_fit", "interpreted_kernel_modules",
           "prepare_device",
           "use_triton_interpreter"]
