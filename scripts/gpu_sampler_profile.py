"""Where the sampler's time goes on a GPU: host time, kernels and their device time.

For each batch in --batches, on random fp32 logits [B, V] (V = Flint's 151,552), with
Flint's default settings (temperature 1, top-k 20, top-p 0.95, one seeded generator per
row):

1. `alone`: `flintc.sampling.sample` then the token read, host wall clock between two
   synchronizations (median of --iters);
2. `after busy`: the same queued behind ~2 ms of device work (`torch.cuda._sleep`), as
   in a decode step where the host issues the sampler while the graph replays: wall
   clock minus the busy time alone, i.e. what the sampler adds to a step;
3. a torch.profiler (CUPTI) table of one call: kernels, launches, device us.

for `sample` and `sampling_probs` (the definition: softmax and a sort over the
vocabulary; what `sample` computed before session 18). Prints Markdown (also to --out).

`--launch-sweep`: instead, the one-launch kernel alone (`flintc.kernels.sampler.
launch_sample`, top-k 20) in CUDA-graph replays (`benchmarks/common.time_graph`, median
device time per call) for each logits chunk per program x warps: the chunk phase runs k
rounds of three reductions over its CHUNK logits, so smaller chunks (more programs) and
fewer warps (cheaper cross-warp reductions) trade against the merge's records (NCHUNK x
32 per row).

    python3 scripts/gpu_sampler_profile.py --batches 1,8 [--launch-sweep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
from common import time_graph, write_out  # noqa: E402  (benchmarks/common.py)


def wall(fn, iters: int, busy_cycles: int = 0) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def busy_ms(cycles: int, iters: int) -> float:
    return wall(lambda: None, iters, cycles)


def launch_sweep(batches: list[int], vocab: int) -> str:
    """Markdown table: `launch_sample` (top-k 20, top-p 0.95, temperature 1) device us per
    call for chunk x warps at each batch; the default launch marked."""
    from flintc.kernels import sampler as K

    rows = ["| batch | chunk | warps | programs per row | us per call | |", "|---|---|---|---|---|---|"]
    for B in batches:
        g = torch.Generator(device="cuda").manual_seed(B)
        logits = (torch.randn(B, vocab, device="cuda", generator=g) * 3).float()
        params = K.pack_params([100 + b for b in range(B)], [7] * B, [20] * B, [1.0] * B,
                               [0.95] * B).cuda()
        for chunk in (1024, 2048, 4096, 8192):
            for warps in (1, 2, 4, 8):
                try:
                    t = time_graph(lambda: K.launch_sample(logits, params, 20, chunk=chunk,
                                                           num_warps=warps), 3, 30)
                    cell = f"{t * 1e6:.1f}"
                except Exception as e:  # noqa: BLE001  (a launch that does not compile)
                    cell = f"{type(e).__name__}: {str(e)[:50]}"
                mark = "default" if (chunk, warps) == (K.GPU_CHUNK, K.GPU_NUM_WARPS) else ""
                rows.append(f"| {B} | {chunk} | {warps} | {-(-vocab // chunk)} | {cell} | {mark} |")
                print(rows[-1], flush=True)
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--vocab", type=int, default=151552)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--launch-sweep", action="store_true",
                    help="time the one-launch kernel per chunk x warps instead")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_sampler_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.launch_sweep:
        text = launch_sweep([int(b) for b in args.batches.split(",")], args.vocab)
        print(text)
        write_out(args.out, text)
        return 0
    import flintc.sampling as S
    from torch.profiler import ProfilerActivity, profile

    lines = []
    cycles = 2_000_000  # ~1-2 ms at the H200's clocks
    base = busy_ms(cycles, args.iters)
    lines += [f"busy kernel alone: {base:.3f} ms", ""]
    for B in [int(b) for b in args.batches.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(B)
        logits = (torch.randn(B, args.vocab, device="cuda", generator=g) * 3).to(torch.bfloat16).float()
        params = [S.SamplingParams(seed=100 + b) for b in range(B)]
        gens = [p.make_generator("cuda") for p in params]
        variants = {
            "sample (default path)": lambda: S.sample(logits, params, gens).tolist(),
            "sampling_probs (the definition)": lambda: S.sampling_probs(logits, params[0])[0, 0].item(),
            "greedy (argmax)": lambda: torch.argmax(logits, -1).tolist(),
        }
        lines += [f"### batch {B}", "", "| variant | alone ms | after busy ms (added) |", "|---|---|---|"]
        for name, fn in variants.items():
            a = wall(fn, args.iters)
            b = wall(fn, args.iters, cycles) - 0  # includes the busy wait left after launch
            lines.append(f"| {name} | {a:.3f} | {b:.3f} ({b - base:+.3f}) |")
        lines.append("")
        for name in ("sample (default path)", "sampling_probs (the definition)"):
            fn = variants[name]
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            evs = prof.key_averages()
            rows = sorted((e for e in evs if e.device_time_total > 0 and e.device_type.name == "CUDA"),
                          key=lambda e: -e.device_time_total)
            ops = sum(e.count for e in evs if e.key.startswith("aten::") and e.cpu_parent is None) \
                if hasattr(evs[0], "cpu_parent") else None
            total = sum(e.device_time_total for e in rows)
            lines += [f"{name}, batch {B}: {sum(e.count for e in rows)} kernels, {total:.1f} us device",
                      "", "| kernel | launches | us |", "|---|---|---|"]
            lines += [f"| {e.key[:80]} | {e.count} | {e.device_time_total:.1f} |" for e in rows[:14]]
            lines.append("")
    text = "\n".join(lines)
    print(text)
    write_out(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
