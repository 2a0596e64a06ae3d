"""Clocks and ceilings for `flintc bench`.

- `copy_bandwidth_gbs(device)`: the device's copy bandwidth in GB/s (1e9 B/s), bytes
  read plus bytes written, the same method as `benchmarks/common.copy_bandwidth_gbs`
  (1 GiB `dst.copy_(src)`, median of 20 device-event timings after 3 warm-up copies)
  so the two agree; on the CPU a 64 MiB copy timed with `time.perf_counter`.
- `matmul_tflops(device)`: the bf16 matmul rate in TFLOP/s (2 FLOPs per multiply-add),
  `torch.matmul` of two 8192 x 8192 bf16 matrices (256 x 256 on the CPU), median of 20.
- `time_replays(replay, prepare, ...)`: median device time of one call of `replay`,
  each call timed between its own pair of CUDA events, with `prepare(i)` (the input
  rotation) run before each call outside the timed span; calls are queued without
  host synchronization, so the host's launch latency is hidden as in a decode loop.
- `time_host(fn, ...)`: median wall-clock seconds of `fn` (which synchronizes itself or
  is followed by `synchronize`), for end-to-end steps that read a token on the host.
- `step_timeout(seconds)`: a context manager that raises `StepTimeout` when the body
  runs longer (SIGALRM; the main thread of a POSIX process only, a no-op elsewhere).
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import threading
import time
from collections.abc import Callable

import torch


class StepTimeout(Exception):
    """A benchmark step ran past its `--step-timeout`."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbs(device: torch.device, nbytes: int | None = None, iters: int = 20) -> float:
    """Copy bandwidth of `device` in GB/s (read + written bytes per second / 1e9).

    nbytes: buffer size (default 1 GiB on CUDA, 64 MiB on the CPU). Raises ValueError
    for nbytes < 1 or iters < 1."""
    device = torch.device(device)
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    if nbytes < 1 or iters < 1:
        raise ValueError(f"nbytes and iters: expected >= 1, got {nbytes}, {iters}")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), device, iters, warmup=3)
    return 2 * nbytes / seconds / 1e9  # the buffers are freed on return


def matmul_tflops(device: torch.device, n: int | None = None, iters: int = 20) -> float:
    """bf16 matmul rate of `device` in TFLOP/s: 2 n^3 FLOPs per `a @ b` of n x n bf16
    matrices (n = 8192 on CUDA, 256 on the CPU). Raises ValueError for n < 1."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 256)
    if n < 1 or iters < 1:
        raise ValueError(f"n and iters: expected >= 1, got {n}, {iters}")
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    seconds = _median_seconds(lambda: torch.matmul(a, b, out=c), device, iters, warmup=3)
    return 2 * n**3 / seconds / 1e12


def _median_seconds(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_replays(replay: Callable[[], object], prepare: Callable[[int], object], device: torch.device,
                 warmup: int, iters: int) -> dict:
    """Median seconds of one `replay()` (e.g. a CUDA graph replay).

    Before call i, `prepare(i)` runs outside the timed span (copy rotated inputs into the
    static buffers). On CUDA each call is timed with its own pair of device events and
    the calls are queued back to back, synchronizing once at the end; on the CPU with
    `time.perf_counter`. Returns {"median_s", "min_s", "max_s", "iters"}.

    Raises ValueError for warmup < 0 or iters < 1."""
    if warmup < 0 or iters < 1:
        raise ValueError(f"warmup >= 0 and iters >= 1 expected, got {warmup}, {iters}")
    for i in range(warmup):
        prepare(i)
        replay()
    synchronize(device)
    times = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for i, (start, end) in enumerate(events):
            prepare(warmup + i)
            start.record()
            replay()
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) / 1e3 for s, e in events]
    else:
        for i in range(iters):
            prepare(warmup + i)
            t0 = time.perf_counter()
            replay()
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "iters": iters}


def time_host(fn: Callable[[int], object], device: torch.device, warmup: int, iters: int) -> dict:
    """Median wall-clock seconds of `fn(i)`, which must end with the result on the host
    (e.g. `.tolist()` of a sampled token), so each call is a complete step. Returns the
    same keys as `time_replays`. Raises ValueError for warmup < 0 or iters < 1."""
    if warmup < 0 or iters < 1:
        raise ValueError(f"warmup >= 0 and iters >= 1 expected, got {warmup}, {iters}")
    for i in range(warmup):
        fn(i)
    synchronize(device)
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(warmup + i)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "iters": iters}


@contextlib.contextmanager
def step_timeout(seconds: float | None):
    """Raise StepTimeout in the body after `seconds` (None or <= 0: no limit). Uses
    SIGALRM, so it interrupts Python code, not a kernel the host is waiting on; outside
    the main thread or without SIGALRM it does nothing."""
    usable = (seconds and seconds > 0 and hasattr(signal, "SIGALRM")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def _raise(signum, frame):
        raise StepTimeout(f"step ran past its {seconds:g} s timeout")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


__all__ = ["StepTimeout", "copy_bandwidth_gbs", "matmul_tflops", "step_timeout", "synchronize",
           "time_host", "time_replays"]
