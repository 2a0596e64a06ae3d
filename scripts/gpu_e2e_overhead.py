"""Where a decode step's end-to-end time goes outside the CUDA graph, on one build.

`flintc bench`'s end to end column (`runner.decode` + `flintc.sampling.sample` + the token
read on the host) sits 0.6-0.7 ms above the forward at batch 1 / 1K on the H200
(docs/gpu-runs.md session 17 run 2). This script times, as host wall clock between two
synchronizations (median of --iters, after --warmup), at one batch and context:

1. `replay`: the decode graph's replay alone (inputs already in its static buffers);
2. `decode`: `runner.decode` (the input tensors made from Python lists and copied into the
   static buffers, the replay, the logits cut and cast to fp32);
3. `decode + greedy`: 2 then `torch.argmax` and the token read;
4. `decode + default`: 2 then `sample` with Flint's defaults (temperature 1, top-k 20,
   top-p 0.95) and the token read, as `flintc bench` does;
5. `sample default`: `sample` alone on fixed logits, and the token read;
6. `sampling_probs default (the definition)`: the whole distribution `sample` draws from
   (softmax and a sort over the vocabulary), and one value read: what `sample` cost
   before session 18;
7. `decode, host time to return`: `runner.decode` alone from an idle device (no sync).

The differences name the costs: 2 - 1 the input path, 4 - 3 the sampler. Prints a
Markdown table (also to --out).

    python3 scripts/gpu_e2e_overhead.py --build gpu_builds/full-nvfp4-b1 --context 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
from common import write_out  # noqa: E402  (benchmarks/common.py: --out files)


def timed(fn, iters: int, warmup: int) -> float:
    """Median wall-clock ms of fn() followed by a device synchronization."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_e2e_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from flintc.runtime.compiled import load_build
    from flintc.sampling import SamplingParams, sample, sampling_probs

    runner = load_build(args.build, load_format="dummy", device="cuda", progress=False)
    B = args.batch
    slots, ids, pos = list(range(B)), [7] * B, [args.context - 1] * B
    bucket = next(b for b in runner.buckets if b >= B)
    graph = runner.decode_graph(bucket)[0]
    runner.decode(slots, ids, pos)  # static buffers filled, graph warm
    greedy = [SamplingParams(temperature=0)] * B
    default = [SamplingParams(seed=1000 + j) for j in range(B)]
    gens = [p.make_generator("cuda") for p in default]
    logits = runner.decode(slots, ids, pos).clone()
    rows = [
        ("replay", lambda: graph.replay()),
        ("decode", lambda: runner.decode(slots, ids, pos)),
        ("decode + greedy", lambda: sample(runner.decode(slots, ids, pos), greedy, [None] * B).tolist()),
        ("decode + default", lambda: sample(runner.decode(slots, ids, pos), default, gens).tolist()),
        ("sample default", lambda: sample(logits, default, gens).tolist()),
        ("sampling_probs default (the definition)", lambda: sampling_probs(logits, default[0])[0, 0].item()),
    ]
    ms = {name: timed(fn, args.iters, args.warmup) for name, fn in rows}
    # host time of runner.decode alone (checks, input staging, the replay's launch), from an
    # idle device: what a step pays before its graph starts
    host = []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.decode(slots, ids, pos)
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    ms["decode, host time to return"] = statistics.median(host)
    lines = [f"build {args.build}, batch {B}, context {args.context}: host wall clock, median of "
             f"{args.iters}", "", "| step | ms | over replay |", "|---|---|---|"]
    lines += [f"| {name} | {v:.3f} | {v - ms['replay']:+.3f} |" for name, v in ms.items()]
    text = "\n".join(lines)
    print(text)
    write_out(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
