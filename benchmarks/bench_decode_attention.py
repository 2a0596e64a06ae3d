"""Benchmark of `flintc.kernels.decode_attention` + `attention_combine` at the full
model's shapes (Hq=32, Hkv=4, D=128). Needs a CUDA GPU.

Timing: CUDA-graph replays with device events (`common.time_graph`, median), so no
Python launch overhead counts, as in the decode runtime. Bytes: the K and V rows that
are visible and so must be read (rows 0..p of a full cache, the written rows of a
ring), 2 * 2 * B * Hkv * D * rows; GB/s = 10^9 bytes/s; "% copy" is against the
measured device-to-device copy bandwidth (`common.copy_bandwidth_gbs`).

Sections:
1. Full layer: a cache of 262,144 rows per sequence (the model's longest context)
   holding `context` tokens, B = 1, 2, 4, 8, N = `choose_num_splits` (the compiler's
   default, 32). Issue 5 target: >= 75% of copy at 100K for B = 1..8. A reference line:
   torch SDPA (no sink, enable_gqa) on [B, Hkv, context, D] copies of the visible rows.
2. Sliding layer: a ring of W = 513 rows, wrapped, N = 3.
3. Sweep at 100K (B = 1 and 8): launch configurations (BLOCK_S, warps, stages),
   programs per SM and the smallest piece, to re-tune the module constants.

    python benchmarks/bench_decode_attention.py [--out results.md] [--sweep-s 60]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth_gbs, markdown_table, time_graph, write_out

from flintc.kernels import decode_attention as da

HQ, HKV, D = 32, 4, 128
FULL_ROWS = 262144
CONTEXTS = [1024, 8192, 32768, 100_000, 262144]
BATCHES = [1, 2, 4, 8]


def make_case(B: int, S: int, context: int, window: int = 0):
    """Random q, caches [B, S, Hkv, D], positions so that `context` rows are visible."""
    q = torch.randn(B, 1, HQ, D, device="cuda").to(torch.bfloat16)
    k_cache = torch.randn(B, S, HKV, D, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(B, S, HKV, D, device="cuda").to(torch.bfloat16)
    slots = torch.arange(B, device="cuda", dtype=torch.int32)
    p = context - 1 if window == 0 else 10 * window + 7  # a ring: wrapped, all rows visible
    positions = torch.full((B, 1), p, dtype=torch.int64, device="cuda")
    sinks = torch.randn(HQ, device="cuda")
    return q, k_cache, v_cache, slots, positions, sinks


def time_pair(case, window, n, **knobs):
    """(seconds for attention + combine, seconds for attention alone)."""
    q, kc, vc, slots, pos, sinks = case

    def attn():
        return da.launch_decode_attention(q, kc, vc, slots, pos, window, n, use_pdl=True, **knobs)

    def pair():
        return da.attention_combine(*attn(), sinks, use_pdl=True)

    return time_graph(pair, 3, 30), time_graph(attn, 3, 30)


def time_sdpa(B: int, context: int) -> float:
    q = torch.randn(B, HQ, 1, D, device="cuda").to(torch.bfloat16)
    k = torch.randn(B, HKV, context, D, device="cuda").to(torch.bfloat16)
    v = torch.randn(B, HKV, context, D, device="cuda").to(torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        return time_graph(lambda: sdpa(q, k, v, enable_gqa=True), 3, 30)
    except Exception as e:  # noqa: BLE001  (a reference line only)
        print(f"sdpa failed at B={B} context={context}: {type(e).__name__}: {e}")
        return float("nan")


def kv_bytes(B: int, rows: int) -> int:
    return 2 * 2 * B * HKV * D * rows


def full_layer(copy: float, num_sms: int) -> str:
    rows = []
    for B in BATCHES:
        n = da.choose_num_splits(FULL_ROWS, B, num_sms)
        case = make_case(B, FULL_ROWS, CONTEXTS[-1])
        for ctx in CONTEXTS:
            case[4].fill_(ctx - 1)
            t_pair, t_attn = time_pair(case, 0, n)
            t_sdpa = time_sdpa(B, ctx)
            gbs = kv_bytes(B, ctx) / t_pair / 1e9
            rows.append([B, ctx, n, f"{t_pair * 1e6:.1f}", f"{t_attn * 1e6:.1f}", f"{gbs:.0f}",
                         f"{gbs / copy:.0%}", f"{kv_bytes(B, ctx) / t_attn / 1e9 / copy:.0%}",
                         f"{t_sdpa * 1e6:.1f}", f"{kv_bytes(B, ctx) / t_sdpa / 1e9 / copy:.0%}"])
            print(rows[-1], flush=True)
        del case
        torch.cuda.empty_cache()
    return markdown_table(["B", "context", "splits", "attn+combine us", "attn us", "GB/s",
                           "% copy", "attn % copy", "SDPA us", "SDPA % copy"], rows)


def sliding_layer(copy: float) -> str:
    rows = []
    W = 513
    for B in BATCHES:
        n = da.choose_num_splits(W, B, window=W)
        t_pair, t_attn = time_pair(make_case(B, W, W, window=W), W, n)
        rows.append([B, W, n, f"{t_pair * 1e6:.2f}", f"{t_attn * 1e6:.2f}",
                     f"{kv_bytes(B, W) / t_pair / 1e9 / copy:.0%}"])
        print(rows[-1], flush=True)
    return markdown_table(["B", "ring rows", "splits", "attn+combine us", "attn us", "% copy"],
                          rows)


def sweep(copy: float, num_sms: int, budget_s: float) -> str:
    """Trials at 100K context until `budget_s` seconds have passed (the rest is listed
    as not run)."""
    t_end = time.monotonic() + budget_s
    saved = (da.GPU_BLOCK_S, da.GPU_NUM_WARPS, da.GPU_NUM_STAGES)
    rows = []
    ctx = 100_000
    configs = [(64, 8, 3), (64, 8, 4), (64, 4, 3), (32, 4, 4), (32, 8, 4), (128, 8, 2)]
    try:
        for B in (1, 8):
            case = make_case(B, FULL_ROWS, ctx)
            n = da.choose_num_splits(FULL_ROWS, B, num_sms)
            trials = [(cfg, 2, da.GPU_MIN_ROWS) for cfg in configs]
            trials += [(saved, per_sm, min_rows) for per_sm in (1, 2, 4)
                       for min_rows in (128, 256, 512)
                       if (per_sm, min_rows) != (2, da.GPU_MIN_ROWS)]
            for (block_s, warps, stages), per_sm, min_rows in trials:
                da.GPU_BLOCK_S, da.GPU_NUM_WARPS, da.GPU_NUM_STAGES = block_s, warps, stages
                pph = math.ceil(per_sm * num_sms / (B * HKV))
                if time.monotonic() > t_end:
                    rows.append([B, block_s, warps, stages, per_sm, pph, min_rows,
                                 "not run (time budget)", "-"])
                    continue
                try:
                    t, _ = time_pair(case, 0, n, programs_per_head=pph, min_rows=min_rows)
                    share = f"{kv_bytes(B, ctx) / t / 1e9 / copy:.0%}"
                    us = f"{t * 1e6:.1f}"
                except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                    us, share = f"{type(e).__name__}", "-"
                rows.append([B, block_s, warps, stages, per_sm, pph, min_rows, us, share])
                print(rows[-1], flush=True)
            del case
            torch.cuda.empty_cache()
    finally:
        da.GPU_BLOCK_S, da.GPU_NUM_WARPS, da.GPU_NUM_STAGES = saved
    return markdown_table(["B", "BLOCK_S", "warps", "stages", "programs/SM", "programs/head",
                           "min rows", "attn+combine us", "% copy"], rows)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the Markdown tables to this file")
    parser.add_argument("--sweep-s", type=float, default=60.0,
                        help="time budget of the configuration sweep in seconds (0: skip it)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention: needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    copy = copy_bandwidth_gbs("cuda")
    head = (f"Device: {props.name}, {props.multi_processor_count} SMs; copy bandwidth "
            f"{copy:.0f} GB/s; torch {torch.__version__}; CUDA-graph replay, median; "
            f"config BLOCK_S={da.GPU_BLOCK_S} warps={da.GPU_NUM_WARPS} "
            f"stages={da.GPU_NUM_STAGES} programs/SM={da.GPU_CTAS_PER_SM} "
            f"min rows={da.GPU_MIN_ROWS}")
    parts = [head, "", "### Full layer (cache of 262,144 rows, PDL on)", "",
             full_layer(copy, props.multi_processor_count), "",
             "### Sliding layer (ring of 513 rows, wrapped, PDL on)", "", sliding_layer(copy)]
    if args.sweep_s > 0:
        parts += ["", "### Sweep at 100K context (262,144-row cache, PDL on)", "",
                  sweep(copy, props.multi_processor_count, args.sweep_s)]
    text = "\n".join(parts)
    print(text)
    write_out(args.out, text)
    return text


if __name__ == "__main__":
    main()
