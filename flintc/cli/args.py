"""Argument types and checks shared by the CLI commands (argparse `type=` callables raise
`argparse.ArgumentTypeError`, which argparse prints as one line with exit code 2)."""

from __future__ import annotations

import argparse

SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes a 64-bit integer


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63) (`torch.Generator.manual_seed`'s range, the
    one `flintc run --seed` checks too). Raises argparse.ArgumentTypeError otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {text!r}") from None
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got {text}")
    return value


def device_name(text: str) -> str:
    """A --device value as given (cpu, cuda or cuda:N; checked where it is used:
    `torch_device`, `flintc.runtime.device.prepare_device`). An empty one is refused: it
    used to mean the default device (an unset shell variable, most often). Raises
    argparse.ArgumentTypeError."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty: expected cpu or cuda (or cuda:N); leave --device "
                                         "out for the default")
    return text


def buckets(text: str) -> tuple[int, ...]:
    """--buckets: comma-separated decode batch sizes, '1,8' -> (1, 8). An empty value is
    refused (it used to mean the default buckets), and so is an item that is not an
    integer; the sizes themselves (each >= 1, the largest --max-batch) are checked with
    --max-batch (`flintc.runtime.build.BuildOptions.resolve`). Raises
    argparse.ArgumentTypeError."""
    expected = "comma-separated decode batch sizes, e.g. 1,8"
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty: expected {expected}; leave --buckets out for "
                                         "1,2,4,8 up to --max-batch")
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def torch_device(text: str, flag: str = "--device"):
    """`text` as a torch.device, which must be the CPU or an available CUDA GPU.

    Raises:
        InputError: not a device torch knows (e.g. "bogus"), another device type, or CUDA
            on a machine without a usable GPU (the message names `flag`).
    """
    import torch

    from flintc.errors import InputError

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise InputError(f"{flag} {text!r}: expected cpu or cuda (or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"{flag} {text}: expected cpu or cuda (or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"{flag} {text}: no CUDA GPU is available (--device cpu runs on the CPU)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(f"{flag} {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
