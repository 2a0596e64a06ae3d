"""GEMV bandwidth on the model's shapes: flintc's Triton kernel against torch (GPU only).

Measures device-to-device copy bandwidth first (the practical ceiling), then for each
weight shape, batch N in {1, 2, 4, 8} and bf16 / NVFP4 weights the median kernel time,
the achieved GB/s counting weight bytes + x + y, and its share of the copy bandwidth.
torch's line is `x @ w.T` for bf16 and dequantize-then-matmul (`gemv_reference`) for
NVFP4. Prints a Markdown table; `--out FILE` also writes it there.

    python benchmarks/bench_gemv.py [--out gemv.md] [--pdl]
"""

from __future__ import annotations

import argparse

import torch

# [F, K] weights: q_proj, o_proj, expert gate/up, expert down, lm_head-sized (bf16 only).
SHAPES = [(4096, 2048, "q_proj"), (2048, 4096, "o_proj"), (512, 2048, "expert_gate_up"),
          (2048, 512, "expert_down"), (151552, 2048, "lm_head")]
BATCHES = [1, 2, 4, 8]


def time_ms(fn, reps: int) -> float:
    """Median of `reps` CUDA-event timings of `fn` (after warm-up), in ms. Includes any CPU
    launch overhead that the GPU has to wait for (used for the copy only)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def kernel_ms(fn, reps: int) -> float:
    """Median device time of `fn` in ms, replayed from a CUDA graph so that Python launch
    overhead does not count (decode runs these kernels from graphs too)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="median")


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of a 2 GiB tensor (read + write), median of 20."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    ms = time_ms(lambda: src.clone(), 20)
    del src
    return 2 * 2**31 / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the Markdown table to this file")
    parser.add_argument("--pdl", action="store_true", help="launch the kernel with PDL")
    parser.add_argument("--reps", type=int, default=100, help="ms of graph replays")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA GPU")

    from flintc.kernels.gemv import gemv, gemv_reference
    from flintc.quant.nvfp4 import quantize

    copy_bw = copy_bandwidth_gbs()
    lines = [f"Device: {torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s; "
             f"PDL {'on' if args.pdl else 'off'}; CUDA-graph replay, median", "",
             "| weight | F x K | fmt | N | flintc us | flintc GB/s | % copy | torch us "
             "| torch GB/s | % copy |", "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for F, K, name in SHAPES:
        w_bf16 = (torch.randn(F, K, device="cuda") * 0.05).to(torch.bfloat16)
        fmts = [("bf16", [w_bf16])]
        if name != "lm_head":
            q = quantize(w_bf16.cpu())
            fmts.append(("nvfp4", [q.codes.cuda(), q.scales.cuda(), q.global_scale.cuda()]))
        for fmt, w in fmts:
            w_bytes = sum(t.numel() * t.element_size() for t in w)
            for N in BATCHES:
                x = torch.randn(N, K, device="cuda").to(torch.bfloat16)
                out = torch.empty(N, F, dtype=torch.bfloat16, device="cuda")
                nbytes = w_bytes + x.numel() * 2 + out.numel() * 2
                ms = kernel_ms(lambda: gemv(x, w, out=out, use_pdl=args.pdl), args.reps)
                if fmt == "bf16":
                    ms_t = kernel_ms(lambda: x @ w[0].T, args.reps)
                else:
                    ms_t = kernel_ms(lambda: gemv_reference(x, w), args.reps)
                gbs, gbs_t = nbytes / ms / 1e6, nbytes / ms_t / 1e6
                row = (f"| {name} | {F}x{K} | {fmt} | {N} | {ms * 1e3:.1f} | {gbs:.0f} | "
                       f"{100 * gbs / copy_bw:.0f}% | {ms_t * 1e3:.1f} | {gbs_t:.0f} | "
                       f"{100 * gbs_t / copy_bw:.0f}% |")
                lines.append(row)
                print(row, flush=True)
        del w_bf16, fmts
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
