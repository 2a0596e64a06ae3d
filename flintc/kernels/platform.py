"""Where a kernel launch runs: Triton's CPU interpreter or a CUDA device, and how many
SMs that device has (the launchers size their grids from it)."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["interpreting", "sm_count"]


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`, read at
    each call, so a test can set it after import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, cpu: int = 1) -> int:
    """The SM count of a CUDA device (queried once per device index; an index-less
    device is the current one); `cpu` for any other device, where the interpreter runs
    the programs in turn."""
    if device.type != "cuda":
        return cpu
    return _cuda_sm_count(device.index if device.index is not None
                          else torch.cuda.current_device())
