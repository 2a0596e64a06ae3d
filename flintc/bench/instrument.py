"""Looking inside one decode step of a `CompiledRunner`: the experts it selected, its
kernel count, and where its time goes.

- `record_step(runner, name, ids, positions, slots, time_ops)`: runs the generated
  function `name` once, eagerly (not from the CUDA graph), through a recording kernel
  table: every `K.<op>` call is matched, in order, to the launches of `plan.json`
  (op, layer), its integer outputs of width top-k in MoE layers are taken as the
  selected expert ids, and (`time_ops`) it is timed with `time.perf_counter` around a
  synchronized call (the CPU breakdown). This is the step's own routing, on the step's
  own hidden states: the distinct experts per layer are the ones its MoE kernels read.
- `profile_graph(graph, replays, device)`: the kernels of `replays` replays of a CUDA
  graph from `torch.profiler` (name, start, end in us), in time order.
- `breakdown_from_kernels(kernels, launches)`: per op kind and per layer, the time each
  kernel adds to the step's critical path (see `critical_path`), matched to the plan's
  launches by position when the counts agree, else grouped by kernel name.

Critical-path time: with programmatic dependent launch a kernel starts while the one
before it is still running and waits (`gdc_wait`) before reading its inputs, so kernel
durations overlap and their sum exceeds the step. Each kernel is charged
`end_i - max(start_i, end_{i-1})`, the time from the previous kernel's end to its own;
idle time between kernels (`start_i - end_{i-1}` when positive) is reported as gaps.
The charges and gaps add up to the step's span exactly.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict

import torch


class _RecordingTable:
    """Wraps a KernelTable: calls go through, each recorded with its plan launch."""

    def __init__(self, table, launches, top_k: int, moe_layers: set[int], time_ops: bool, device):
        self._table = table
        self._launches = [l for l in launches if not l["op"].startswith("aten.")]
        self._top_k, self._moe, self._time, self._device = top_k, moe_layers, time_ops, device
        self.calls: list[dict] = []
        self.experts: dict[int, list[torch.Tensor]] = defaultdict(list)

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)
        fn = getattr(self._table, op)

        def call(*args, **kwargs):
            i = len(self.calls)
            launch = self._launches[i] if i < len(self._launches) else None
            layer = launch["layer"] if launch and launch["op"] == op else None
            if self._time:
                _sync(self._device)
                t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds = None
            if self._time:
                _sync(self._device)
                seconds = time.perf_counter() - t0
            self.calls.append({"op": op, "layer": layer, "seconds": seconds})
            if layer in self._moe:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if (isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() >= 1
                            and t.shape[-1] == self._top_k):
                        self.experts[layer].append(t.detach().reshape(-1, self._top_k).clone())
                        break
            return out

        return call


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _swapped_table(runner, step: str, table):
    # CompiledRunner keeps its kernel tables in `_tables` (flintc/runtime/compiled.py);
    # the generated function receives the table as its first argument.
    old = runner._tables[step]
    runner._tables[step] = table
    try:
        yield
    finally:
        runner._tables[step] = old


@torch.inference_mode()
def record_step(runner, name: str, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                time_ops: bool = False) -> dict:
    """Run the generated function `name` once through a recording kernel table.

    Args:
        runner: a CompiledRunner.
        name: a function of its plan (e.g. "decode_b2").
        ids, positions: int64 [B, T]; slots: int64 [B] (the function's shapes).
        time_ops: time each kernel-table call (synchronized; for the CPU breakdown).

    Returns {"calls": [{"op", "layer", "seconds"}], "launches_matched": bool,
    "kernel_calls": number of K.<op> calls, "aten_launches": the plan's aten launches,
    "distinct_experts": {layer: distinct expert ids over all rows},
    "selected": {layer: int64 [rows, top_k] on the CPU}}.

    Raises InputError (from the runner) for shapes the function was not built for.
    """
    step = runner.plan[name]
    cfg = runner.config
    moe = {i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)}
    rec = _RecordingTable(runner._tables[step["step"]], step["launches"], cfg.num_experts_per_tok, moe,
                          time_ops, runner.device)
    with _swapped_table(runner, step["step"], rec):
        runner.forward(name, ids, positions, slots)
    _sync(runner.device)
    selected = {layer: torch.cat(ts).cpu() for layer, ts in rec.experts.items()}
    kernel_launches = [l for l in step["launches"] if not l["op"].startswith("aten.")]
    matched = len(rec.calls) == len(kernel_launches) and all(
        c["op"] == l["op"] for c, l in zip(rec.calls, kernel_launches))
    return {
        "calls": rec.calls,
        "launches_matched": matched,
        "kernel_calls": len(rec.calls),
        "aten_launches": len(step["launches"]) - len(kernel_launches),
        "selected": selected,
        "distinct_experts": {layer: int(sel.unique().numel()) for layer, sel in selected.items()},
    }


def profile_graph(graph, replays: int, device) -> list[dict]:
    """Kernels of `replays` replays of CUDA graph `graph`, from torch.profiler (CUPTI):
    [{"name", "start_us", "end_us"}] in start order; memcpy/memset are left out.
    Raises RuntimeError when the profiler reports no kernel."""
    graph.replay()
    torch.cuda.synchronize(device)

    def replay_all():
        for _ in range(replays):
            graph.replay()

    return profile_call(replay_all, device, what="the graph replays")


def profile_call(fn, device, what: str = "the call") -> list[dict]:
    """Kernels that `fn()` runs on the GPU (eager launches or graph replays), from
    torch.profiler (CUPTI): [{"name", "start_us", "end_us"}] in start order;
    memcpy/memset are left out. Raises RuntimeError when the profiler reports no kernel."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        if name.startswith(("Memcpy", "Memset", "memcpy", "memset")):
            continue
        kernels.append({"name": name, "start_us": float(e.time_range.start), "end_us": float(e.time_range.end)})
    if not kernels:
        raise RuntimeError(f"torch.profiler reported no CUDA kernel for {what} (CUPTI unavailable?)")
    kernels.sort(key=lambda k: (k["start_us"], k["end_us"]))
    return kernels


def critical_path(kernels: list[dict]) -> tuple[list[float], list[float]]:
    """Per kernel (in start order) the critical-path charge `end_i - max(start_i,
    end_{i-1})` and the idle gap before it `max(0, start_i - end_{i-1})`, in us (module
    doc). A kernel that ends before its predecessor is charged 0."""
    charges, gaps = [], []
    prev_end = None
    for k in kernels:
        if prev_end is None:
            charges.append(k["end_us"] - k["start_us"])
            gaps.append(0.0)
            prev_end = k["end_us"]
            continue
        begin = max(k["start_us"], prev_end)
        charges.append(max(0.0, k["end_us"] - begin))
        gaps.append(max(0.0, k["start_us"] - prev_end))
        prev_end = max(prev_end, k["end_us"])
    return charges, gaps


def split_replays(kernels: list[dict], per_replay: int) -> list[list[dict]]:
    """Cut a time-ordered kernel list into consecutive replays of `per_replay` kernels.
    Raises ValueError when the count is not a multiple of per_replay."""
    if per_replay < 1 or len(kernels) % per_replay:
        raise ValueError(f"{len(kernels)} kernels are not a whole number of replays of {per_replay}")
    return [kernels[i:i + per_replay] for i in range(0, len(kernels), per_replay)]


def breakdown_from_kernels(replays: list[list[dict]], launches: list[dict], labels=None) -> dict:
    """Where one step's time goes, from the kernels of several replays of it.

    Args:
        replays: per replay, its kernels [{"name", "start_us", "end_us"}] in order.
        launches: the plan's launches of the step ({"op", "layer"}); used when each
            replay has exactly that many kernels (kernel i is launch i).
        labels: optional explicit [(op, layer)] per kernel (overrides `launches`).

    Returns {"step_us" (median span), "kernel_us" (median sum of charges), "gap_us",
    "kernels", "matched_to_plan", "ops": [{"op", "calls", "us", "share", "us_per_call",
    "per_layer": {layer: us}}] largest first, "kernel_names": {op: [names]}}; times are
    medians over the replays of the per-kernel charges (`critical_path`).
    """
    if not replays:
        raise ValueError("replays: expected at least one replay")
    n = len(replays[0])
    if any(len(r) != n for r in replays):
        raise ValueError("replays: every replay must have the same number of kernels")
    if labels is None and len(launches) == n:
        labels = [(l["op"], l["layer"]) for l in launches]
    matched = labels is not None
    if labels is None:
        labels = [(_short_name(k["name"]), None) for k in replays[0]]
    charges = [critical_path(r)[0] for r in replays]
    gaps = [sum(critical_path(r)[1]) for r in replays]
    spans = [r[-1]["end_us"] - r[0]["start_us"] if r else 0.0 for r in replays]
    per_kernel = [statistics.median(c[i] for c in charges) for i in range(n)]
    ops: dict[str, dict] = {}
    names: dict[str, set] = defaultdict(set)
    for i, (op, layer) in enumerate(labels):
        d = ops.setdefault(op, {"op": op, "calls": 0, "us": 0.0, "per_layer": defaultdict(float)})
        d["calls"] += 1
        d["us"] += per_kernel[i]
        d["per_layer"][-1 if layer is None else int(layer)] += per_kernel[i]
        names[op].add(replays[0][i]["name"])
    total = sum(per_kernel)
    rows = []
    for d in sorted(ops.values(), key=lambda d: -d["us"]):
        rows.append({"op": d["op"], "calls": d["calls"], "us": d["us"],
                     "share": d["us"] / total if total else 0.0, "us_per_call": d["us"] / d["calls"],
                     "per_layer": {str(k): v for k, v in sorted(d["per_layer"].items())}})
    return {"step_us": statistics.median(spans), "kernel_us": total, "gap_us": statistics.median(gaps),
            "kernels": n, "matched_to_plan": matched, "ops": rows,
            "kernel_names": {op: sorted(v)[:4] for op, v in names.items()}}


def breakdown_from_calls(calls: list[dict]) -> dict:
    """The same report as `breakdown_from_kernels` from `record_step(time_ops=True)`
    calls (host-timed, synchronized: the CPU's breakdown; no overlap, no gaps)."""
    kernels, t = [], 0.0
    for c in calls:
        us = (c["seconds"] or 0.0) * 1e6
        kernels.append({"name": c["op"], "start_us": t, "end_us": t + us})
        t += us
    labels = [(c["op"], c["layer"]) for c in calls]
    return breakdown_from_kernels([kernels], [], labels=labels)


def _short_name(name: str) -> str:
    """A kernel's name without template arguments and launch suffixes."""
    return name.split("(")[0].split("<")[0].strip()[:80]


def count_kernels_profiled(graph, device, replays: int = 2) -> int:
    """Kernels per replay of `graph`, counted in a torch.profiler trace of `replays`
    replays (the fallback when cuda-python cannot read the graph's nodes). Raises
    ValueError when the count is not a whole number per replay."""
    kernels = profile_graph(graph, replays, device)
    if len(kernels) % replays:
        raise ValueError(f"{len(kernels)} kernels in {replays} replays: not a whole number per replay")
    return len(kernels) // replays


__all__ = ["breakdown_from_calls", "breakdown_from_kernels", "count_kernels_profiled", "critical_path",
           "profile_call", "profile_graph", "record_step", "split_replays"]
