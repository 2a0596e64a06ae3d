"""Helpers shared by the GPU benchmarks in `benchmarks/` (import, do not copy them).

The API is small and stable; other benchmark scripts depend on it:

- `copy_bandwidth_gbs(device) -> float`: measured device-to-device copy bandwidth in
  GB/s (10^9 bytes/s, read + written bytes), the practical ceiling that bandwidth-bound
  kernels are compared with ("share of copy").
- `time_graph(fn, warmup, iters) -> float`: median seconds per call of `fn`, replayed
  from a CUDA graph and timed with device events, so Python launch overhead does not
  count (the decode runtime replays CUDA graphs too).
- `markdown_table(headers, rows) -> str`: a GitHub Markdown table.
- `write_out(path, text)`: the `--out FILE.md` option: write `text` to `path` (no-op
  when `path` is None or empty).
- `int_list(parser, flag, text, lo, hi)` / `choice_list(parser, flag, text, choices)`:
  parse a comma-separated option (`--batches 1,8`, `--formats bf16,nvfp4`), or end the
  script through `parser.error` (one line naming the flag, exit status 2) before any
  GPU work.

Importing: a script run as `python benchmarks/bench_x.py` has `benchmarks/` on
`sys.path`, so `from common import time_graph, ...` works; from the repository root
with `PYTHONPATH=$PWD`, `from benchmarks.common import ...` works too. Nothing here
touches the GPU at import, so the scripts can print a clear message without one.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["choice_list", "copy_bandwidth_gbs", "int_list", "markdown_table", "time_graph",
           "write_out"]


def _cuda_device(device) -> torch.device:
    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {dev}")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU available (torch.cuda.is_available() is False)")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@functools.cache
def _copy_bandwidth_cached(device: torch.device, nbytes: int, iters: int) -> float:
    with torch.cuda.device(device):
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        for _ in range(3):  # warm-up
            dst.copy_(src)
        torch.cuda.synchronize(device)
        times = []
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # ms -> s
        del src, dst
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times) / 1e9


def copy_bandwidth_gbs(device="cuda") -> float:
    """Device-to-device copy bandwidth of `device`, in GB/s (10^9 bytes per second).

    Copies a 1 GiB buffer into another (`dst.copy_(src)`, one copy kernel, far larger
    than any L2), median of 20 CUDA-event timings after 3 warm-up copies, and counts the
    bytes read plus the bytes written (2 GiB per copy), as the earlier runs in
    docs/gpu-runs.md did (~4245 GB/s on an H200). The result is cached per device, so
    calling it from several benchmarks costs one measurement. Needs 2 GiB of free
    device memory.

    Raises ValueError if `device` is not a CUDA device, RuntimeError without a GPU.
    """
    return _copy_bandwidth_cached(_cuda_device(device), 1 << 30, 20)


def time_graph(fn: Callable[[], object], warmup: int = 3, iters: int = 20,
               *, calls_per_replay: int = 10) -> float:
    """Median device time of one call of `fn`, in seconds, from CUDA-graph replays.

    `fn` (no arguments; its return value is ignored) is first run eagerly
    max(1, warmup) times on the current stream (compiles Triton kernels, fills caches: nothing may
    compile or synchronize during capture), then captured `calls_per_replay` times in
    a row into one CUDA graph. The graph is replayed `warmup` times, then `iters` times
    each between two CUDA events; the result is the median replay time divided by
    `calls_per_replay`. Consecutive calls within the graph are dependent launches on
    one stream, like the kernels of a decode step, so the per-call time includes the
    launch gap between kernels but no Python or CPU launch overhead. Data smaller than
    the L2 cache (60 MB on an H200) stays hot between calls; size inputs accordingly.

    `fn` must be capturable: no host synchronization (`.item()`, `.cpu()`, printing
    tensors), no autotuning; it may allocate with torch (the graph's private pool) and
    must be safe to run repeatedly (in-place updates are repeated).

    Raises ValueError for warmup < 0, iters < 1 or calls_per_replay < 1;
    RuntimeError without a GPU; whatever `fn` or the capture raises.
    """
    if warmup < 0:
        raise ValueError(f"warmup: expected >= 0, got {warmup}")
    if iters < 1:
        raise ValueError(f"iters: expected >= 1, got {iters}")
    if calls_per_replay < 1:
        raise ValueError(f"calls_per_replay: expected >= 1, got {calls_per_replay}")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU available (torch.cuda.is_available() is False)")
    for _ in range(max(1, warmup)):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_replay):
            fn()
    torch.cuda.synchronize()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls_per_replay)  # ms -> s
    del graph
    return statistics.median(times)


def first_call(fn: Callable[[], object], label: str) -> tuple[object, str | None]:
    """`fn()` once, then a device synchronize: (its result, None); or, when it raises,
    (None, "Type: message") after printing `label` and the error. In the kernel sweeps a
    variant that does not fit or compile is a result: they report it and go on."""
    try:
        out = fn()
        torch.cuda.synchronize()
        return out, None
    except Exception as e:  # noqa: BLE001  (reported by the caller's table)
        err = f"{type(e).__name__}: {str(e)[:100]}"
        print(f"{label}: {err}", flush=True)
        return None, err


def _cell(v) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub Markdown table (no trailing newline).

    headers: the column names; rows: sequences of cells, each as long as `headers`.
    Cells: str as is (format numbers yourself where the digits matter), float with 4
    significant digits (whole numbers from 10^4 up), anything else with str(); `|` in a
    cell is escaped. Raises ValueError when a row's length differs from the headers'.
    """
    headers = [_cell(h) for h in headers]
    if not headers:
        raise ValueError("headers: expected at least one column")
    lines = ["| " + " | ".join(h.replace("|", "\\|") for h in headers) + " |",
             "|" + "---|" * len(headers)]
    for i, row in enumerate(rows):
        cells = [_cell(c).replace("|", "\\|") for c in row]
        if len(cells) != len(headers):
            raise ValueError(f"rows[{i}]: expected {len(headers)} cells, got {len(cells)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_out(path, text: str) -> None:
    """`--out FILE.md`: write `text` (plus a final newline if missing) to `path`,
    creating its parent folders; does nothing when `path` is None or empty."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")


def _items(parser, flag: str, text: str, expected: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        parser.error(f"{flag}: expected {expected}, with no empty items; got {text!r}")
    return items


def int_list(parser, flag: str, text: str, lo: int, hi: int) -> list[int]:
    """The comma-separated integers of option `flag` (e.g. `--batches 1,2,8`), each in
    [lo, hi]. Bad input (empty, an empty item, not an integer, out of range) ends the
    script through `parser.error(...)`: one line naming `flag` on stderr, exit status 2."""
    expected = f"comma-separated integers in [{lo}, {hi}]"
    out = []
    for t in _items(parser, flag, text, expected):
        try:
            v = int(t)
        except ValueError:
            parser.error(f"{flag}: {t!r} is not an integer; expected {expected} (got {text!r})")
        if not lo <= v <= hi:
            parser.error(f"{flag}: {v} is outside [{lo}, {hi}] (got {text!r})")
        out.append(v)
    return out


def choice_list(parser, flag: str, text: str, choices: Sequence[str]) -> list[str]:
    """The comma-separated names of option `flag` (e.g. `--formats bf16,nvfp4`), each one
    of `choices`, duplicates dropped, in the given order. Bad input (empty, an empty item,
    an unknown name) ends the script through `parser.error(...)`: one line naming `flag`
    and the choices, exit status 2."""
    expected = f"a comma-separated subset of {','.join(choices)}"
    out: list[str] = []
    for t in _items(parser, flag, text, expected):
        if t not in choices:
            parser.error(f"{flag}: unknown {t!r}; expected {expected} (got {text!r})")
        if t not in out:
            out.append(t)
    return out
