"""Where a kernel launch runs: Triton's CPU interpreter or a CUDA device, how many SMs
that device has (the launchers size their grids from it), and whether torch's grouped
GEMM runs there without a host sync. Plain torch: no Triton import, so the plain-torch
baselines (`flintc.bench.fast_model`) use it too."""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["grouped_mm_fn", "grouped_mm_sync_free", "interpreting", "sm_count"]


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


@functools.cache
def capability_major(index: int | None) -> int:
    """The major compute capability of CUDA device `index` (9 for Hopper), queried once."""
    return torch.cuda.get_device_capability(index)[0]


def grouped_mm_fn():
    """torch's grouped GEMM (`torch.nn.functional.grouped_mm`, torch >= 2.9; else the
    private `torch._grouped_mm`, torch 2.8), or None."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def grouped_mm_sync_free(device: torch.device) -> bool:
    """Whether torch's grouped_mm runs on CUDA `device` without a host sync: its CUTLASS
    path (bf16, sm_90 / sm_100, `_grouped_mm_cuda`'s fast path) reads the group offsets
    on the device; on other GPUs it takes `_grouped_mm_fallback`, which copies them to
    the host (no CUDA-graph capture, a stall per call). False for non-CUDA devices."""
    return device.type == "cuda" and capability_major(device.index) in (9, 10)
