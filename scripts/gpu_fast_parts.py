"""Which part of `flintc.bench.fast_model` costs what, on a GPU: the fast baseline's decode
step on a few full-width layers (FLINT_SPEC's full config cut to `--layers` layers: 2 dense,
then MoE layers, sliding and full as the full model has them), compiled with
`torch.compile(mode="reduce-overhead")` (CUDA graphs, no autotuning: seconds per compile,
not the minutes of the bench's max-autotune) in four variants:

- experts: one grouped GEMM per projection (`grouped`) or the gathered matrices (`gather`,
  `w[ids] @ x`), set through `FastFlintModel.grouped_experts`;
- full-attention caches: read in place (`inplace`: one cache slot per sequence) or
  gathered per sequence (`gather`: one spare slot, so `k_cache[slots]` runs).

Prints a table of forward ms per variant and batch (CUDA-graph replays timed with device
events, median of `--reps` runs of `--iters` steps) and, with `--profile`, torch.profiler's
kernels of one step of each b1 variant (top 12 by device time); exits 1 when a variant
failed to compile or run (its error is in the table). Why (session 38): the bench's
fast baseline became slower at b1/1K on an H100 (4.31 -> 7.93 ms forward, no graph break)
after the grouped experts and in-place caches came in.

    python scripts/gpu_fast_parts.py [--layers 6] [--batches 1,8] [--context 1024] [--profile]
        [--experts grouped,gather] [--attention inplace,gather] [--grouped-min-rows N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flintc.bench import fast_model  # noqa: E402
from flintc.bench.baselines import CompiledStep  # noqa: E402
from flintc.bench.fast_model import FastFlintModel  # noqa: E402
from flintc.checkpoint.init import random_weights  # noqa: E402
from flintc.config import FlintConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--config", default="full", help="preset or config.json (tiny: a CPU smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", default="grouped,gather", help="expert variants to run: grouped, gather")
    ap.add_argument("--attention", default="inplace,gather", help="full-attention cache variants: inplace, gather")
    ap.add_argument("--grouped-min-rows", type=int, default=None,
                    help="override fast_model.GROUPED_MIN_ROWS (rows N x K from which the grouped "
                         "variant runs one grouped GEMM; below it, it gathers w[ids] as the gather variant)")
    a = ap.parse_args()
    if a.grouped_min_rows is not None:
        if a.grouped_min_rows < 1:
            ap.error(f"--grouped-min-rows must be at least 1, got {a.grouped_min_rows}")
        fast_model.GROUPED_MIN_ROWS = a.grouped_min_rows
    for opt, val, allowed in (("--experts", a.experts, ("grouped", "gather")),
                              ("--attention", a.attention, ("inplace", "gather"))):
        bad = [v for v in val.split(",") if v not in allowed]
        if bad or not val:
            ap.error(f"{opt}: expected a comma-separated subset of {', '.join(allowed)}, got {val!r}")
    dev = torch.device(a.device)
    cfg = FlintConfig.from_preset_or_path(a.config).replace(num_hidden_layers=a.layers)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; {a.layers} layers: "
          f"{', '.join(t.split('_')[0] for t in cfg.layer_types)}")
    model = FastFlintModel(cfg, random_weights(cfg, seed=0, device=dev))
    print(f"grouped experts available here: {model.grouped_experts}; "
          f"GROUPED_MIN_ROWS {fast_model.GROUPED_MIN_ROWS}")
    rows = []
    for B in [int(b) for b in a.batches.split(",")]:
        g = torch.Generator(device="cpu").manual_seed(B)
        ids = torch.randint(0, cfg.vocab_size, (B, 1), generator=g).to(dev)
        pos = torch.full((B, 1), a.context - 1, dtype=torch.long, device=dev)
        slots = torch.arange(B, device=dev)
        for experts in a.experts.split(","):
            for attn in a.attention.split(","):
                model.grouped_experts = experts == "grouped"
                kv = model.new_kv_cache(B + (attn == "gather"), a.context, device=dev)
                for t in kv:
                    t.normal_()
                step = CompiledStep(model, kv, (ids, pos, slots), mode="reduce-overhead", name="fast")
                if step.error:
                    rows.append((B, experts, attn, float("nan"), step.compile_s, step.graph_breaks, step.error))
                    continue
                times = []
                for _ in range(a.reps):
                    if dev.type != "cuda":
                        t0 = time.perf_counter()
                        for _ in range(a.iters):
                            step(ids, pos, slots)
                        times.append((time.perf_counter() - t0) * 1e3 / a.iters)
                        continue
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(a.iters):
                        step(ids, pos, slots)
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / a.iters)
                ms = sorted(times)[len(times) // 2]
                rows.append((B, experts, attn, ms, step.compile_s, step.graph_breaks, ""))
                print(f"b{B} experts={experts} attention={attn}: {ms:.3f} ms/step "
                      f"(compile {step.compile_s:.0f} s, graph breaks {step.graph_breaks})", flush=True)
                if a.profile and B == 1:
                    from torch.profiler import ProfilerActivity, profile

                    cuda = dev.type == "cuda"
                    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                        step(ids, pos, slots)
                        if cuda:
                            torch.cuda.synchronize()
                    print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=12, max_name_column_width=70))
                step.release()
                del kv
    print(f"\n| batch | experts | full-attention caches | ms per step ({a.layers} layers) | compile s | graph breaks |")
    print("|---|---|---|---|---|---|")
    for B, e, at, ms, cs, gb, err in rows:
        print(f"| {B} | {e} | {at} | {ms:.3f} | {cs or 0:.0f} | {gb} |" + (f" {err}" if err else ""))
    return 1 if any(r[-1] for r in rows) else 0  # a variant that did not compile or run


if __name__ == "__main__":
    raise SystemExit(main())
