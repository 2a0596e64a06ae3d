"""Benchmark of `flintc.kernels.decode_attention` (+ `attention_combine`) on one full
attention layer's cache at the full model's shapes (Hq=32, Hkv=4, D=128), B=1 and 8,
contexts 1K..262144. Reports median times (CUDA events), GB/s over the K and V bytes
actually read (rows 0..p), the share of the measured copy bandwidth, and torch's
`scaled_dot_product_attention` (no sink, GQA expanded via enable_gqa) on the same
data as a reference line. Needs a CUDA GPU. Usage:
    python benchmarks/bench_decode_attention.py [--out results.md]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flintc.kernels.decode_attention import attention_combine, decode_attention

HQ, HKV, D = 32, 4, 128
CONTEXTS = [1024, 8192, 32768, 100_000, 262144]
NUM_SMS = 132


def time_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median over `reps` of one call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 2 GiB: read + written bytes per second."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    ms = time_ms(lambda: src.clone())
    del src
    return 2 * (2 << 30) / ms / 1e6


def choose_num_splits(B: int, S: int) -> int:
    """About 4 waves of programs over the SMs, chunks of at least 256 rows."""
    want = max(1, (4 * NUM_SMS) // (B * HKV))
    return max(1, min(want, S // 256))


def bench_one(B: int, ctx: int, copy_gbs: float) -> dict:
    S = ctx
    q = torch.randn(B, 1, HQ, D, device="cuda").to(torch.bfloat16)
    k_cache = torch.randn(B, S, HKV, D, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(B, S, HKV, D, device="cuda").to(torch.bfloat16)
    slots = torch.arange(B, device="cuda")
    positions = torch.full((B, 1), S - 1, dtype=torch.int64, device="cuda")
    sinks = torch.randn(HQ, device="cuda")
    n = choose_num_splits(B, S)

    def kernel_only():
        return decode_attention(q, k_cache, v_cache, slots, positions, 0, n)

    def full():
        return attention_combine(*kernel_only(), sinks)

    ms_full, ms_kernel = time_ms(full), time_ms(kernel_only)
    kv_bytes = 2 * B * S * HKV * D * 2  # K and V rows 0..p (p = S - 1), bf16
    qs = q.transpose(1, 2)  # [B, Hq, 1, D]
    ks, vs = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)  # [B, Hkv, S, D] views
    ks, vs = ks.contiguous(), vs.contiguous()  # SDPA wants heads-major; copy outside timing
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        ms_sdpa = time_ms(lambda: sdpa(qs, ks, vs, enable_gqa=True))
    except Exception as e:  # noqa: BLE001  (a reference line only)
        print(f"sdpa failed at B={B} ctx={ctx}: {e}")
        ms_sdpa = float("nan")
    gbs = kv_bytes / ms_full / 1e6
    return dict(B=B, ctx=ctx, splits=n, ms_full=ms_full, ms_kernel=ms_kernel, gbs=gbs,
                gbs_kernel=kv_bytes / ms_kernel / 1e6, share=gbs / copy_gbs,
                ms_sdpa=ms_sdpa, gbs_sdpa=kv_bytes / ms_sdpa / 1e6)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the Markdown table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    copy_gbs = copy_bandwidth_gbs()
    lines = [f"Copy bandwidth (2 GiB clone, median of 20): {copy_gbs:.0f} GB/s", "",
             "| B | context | splits | kernel+combine ms | kernel ms | GB/s (K+V) "
             "| kernel GB/s | share of copy | SDPA ms | SDPA GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for B in (1, 8):
        for ctx in CONTEXTS:
            r = bench_one(B, ctx, copy_gbs)
            lines.append(
                f"| {r['B']} | {r['ctx']} | {r['splits']} | {r['ms_full']:.4f} | "
                f"{r['ms_kernel']:.4f} | {r['gbs']:.0f} | {r['gbs_kernel']:.0f} | "
                f"{r['share']:.0%} | {r['ms_sdpa']:.4f} | {r['gbs_sdpa']:.0f} |")
            torch.cuda.empty_cache()
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return table


if __name__ == "__main__":
    main()
