"""`flintc bench`: flintc's decode and prefill times next to the device's ceilings,
the roofline of each step, and the eager / `torch.compile` baselines on the same weights.

Modules:

- `core`: `BenchOptions`, `run_bench` (the measurement run);
- `roofline`: bytes and FLOPs a step must move / do (from the weight table);
- `timing`: copy bandwidth, matmul rate, CUDA-event and host timers, step timeout;
- `instrument`: a step's selected experts, kernel counts, the per-kernel breakdown;
- `baselines`: the eager reference step and its `torch.compile` (max-autotune), and
  the "fast" baseline: `torch.compile` of `fast_model.FastFlintModel`;
- `fast_model`: the Flint decoder in plain PyTorch written for speed (bf16 GEMMs);
- `report`: targets of issue 8, JSON, Markdown, plots, merging runs.

See docs/benchmarks.md for how to run it on the GPU.
"""

from flintc.bench.core import BenchOptions, run_bench

__all__ = ["BenchOptions", "run_bench"]
