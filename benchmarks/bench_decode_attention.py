"""Benchmark of `flintc.kernels.decode_attention` + `attention_combine` at the full
model's shapes (Hq=32, Hkv=4, D=128). Needs a CUDA GPU.

Timing: CUDA-graph replays with device events (`common.time_graph`, median; 10 calls
per replay, so a call's time includes the gap between dependent launches, with PDL on
unless said otherwise), so no Python launch overhead counts, as in the decode runtime.
Bytes: the K and V rows that are visible and so must be read (rows 0..p of a full
cache, the written rows of a ring), 2 * 2 * B * Hkv * D * rows; GB/s = 10^9 bytes/s;
"% copy" is against the measured device-to-device copy bandwidth
(`common.copy_bandwidth_gbs`). "programs" = the busy programs per (sequence, KV head)
of the stream-K plan (`decode_attention.plan`), "shared" = the splits merged in-kernel.

Sections, the rows that matter first:
1. Key rows (issue 5 targets): B = 1 and 8 at 1K, 8K and 100K tokens in a 262,144-row
   full cache (N = 32 splits, the compiler's default) and the 513-row ring (N = 9).
   Targets: attn+combine <= ~6 us at 1K and for the ring; >= 75% of copy at 100K.
   "fused us": the combine in the attention launch (`decode_attention_combine`, the
   build option `fold_attention_combine`), against "attn+combine us" (two launches).
   Reference: torch SDPA (no sink, enable_gqa) on [B, Hkv, context, D] copies.
2. Fixed costs at B = 1: one visible row, the combine alone, one program per split
   (no in-kernel merge), PDL off.
3. Full table: B = 1, 2, 4, 8 x 1K .. 262K tokens, and the ring for B = 1..8.
4. Sweep (time budget `--sweep-s`, default 50 s): launch configurations (BLOCK_S,
   warps, stages, programs per SM) at 100K for B = 1 and 8, the smallest run
   (min_rows) and sharers per split (max_pieces) at 1K / 8K / ring, and the ring's
   launches (`ring_launch`) at B = 1-16 (`--sweep-ring-only`: these alone). The winner
   goes into the module constants GPU_*.

    python benchmarks/bench_decode_attention.py [--out results.md] [--sweep-s 50]
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
W = 513
CONTEXTS = [1024, 8192, 32768, 100_000, 262144]
BATCHES = [1, 2, 4, 8]


def make_case(B: int, S: int, context: int, window: int = 0):
    """Random q, caches [B, S, Hkv, D], positions so that `context` rows are visible
    (a ring: wrapped, all rows visible)."""
    q = torch.randn(B, 1, HQ, D, device="cuda").to(torch.bfloat16)
    k_cache = torch.randn(B, S, HKV, D, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(B, S, HKV, D, device="cuda").to(torch.bfloat16)
    slots = torch.arange(B, device="cuda", dtype=torch.int32)
    p = context - 1 if window == 0 else 10 * window + 7
    positions = torch.full((B, 1), p, dtype=torch.int64, device="cuda")
    sinks = torch.randn(HQ, device="cuda")
    return q, k_cache, v_cache, slots, positions, sinks


def time_calls(case, window, n, pdl=True, **knobs):
    """(seconds for attention + combine, attention alone, combine alone)."""
    q, kc, vc, slots, pos, sinks = case

    def attn():
        return da.launch_decode_attention(q, kc, vc, slots, pos, window, n, use_pdl=pdl, **knobs)

    o, lse = attn()

    def pair():
        return da.attention_combine(*attn(), sinks, use_pdl=pdl)

    def combine():
        return da.attention_combine(o, lse, sinks, use_pdl=pdl)

    return time_graph(pair, 3, 30), time_graph(attn, 3, 30), time_graph(combine, 3, 30)


def time_fused(case, window, n, pdl=True, **knobs):
    """Seconds for attention with the combine in the same launch
    (`decode_attention_combine`, the build option `fold_attention_combine`)."""
    q, kc, vc, slots, pos, sinks = case

    def fused():
        return da.launch_decode_attention(q, kc, vc, slots, pos, window, n, use_pdl=pdl,
                                          sinks=sinks, **knobs)

    return time_graph(fused, 3, 30)


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


def plan_info(B: int, rows: int, S: int, n: int, num_sms: int, window: int = 0, **knobs):
    """(busy programs per head, splits merged in-kernel) of the default launch."""
    T = knobs.get("programs_per_head") or da.default_programs_per_head(B, HKV, num_sms)
    min_rows = knobs.get("min_rows") or (da.ring_min_rows(S, n) if window else da.GPU_MIN_ROWS)
    plan = da.plan(rows, S, n, T, min_rows, knobs.get("block_s") or da.GPU_BLOCK_S,
                   knobs.get("max_pieces") or da.MAX_PIECES_PER_SPLIT)
    shared = {seg[0] for segs in plan["segments"] for seg in segs if seg[3] != seg[4]}
    return plan["t_eff"], len(shared)


def us(t: float) -> str:
    return f"{t * 1e6:.1f}"


def key_rows(copy: float, num_sms: int) -> str:
    rows = []
    for B in (1, 8):
        n = da.choose_num_splits(FULL_ROWS, B, num_sms)
        case = make_case(B, FULL_ROWS, 100_000)
        for ctx in (1024, 8192, 100_000):
            case[4].fill_(ctx - 1)
            t_pair, t_attn, t_comb = time_calls(case, 0, n)
            t_fused = time_fused(case, 0, n)
            t_sdpa = time_sdpa(B, ctx)
            share = kv_bytes(B, ctx) / t_pair / 1e9 / copy
            target = (f"<= 6 us: {'yes' if t_pair <= 6e-6 else 'NO'}" if ctx == 1024 else
                      f">= 75%: {'yes' if share >= 0.75 else 'NO'}" if ctx == 100_000 else "-")
            busy, shared = plan_info(B, ctx, FULL_ROWS, n, num_sms)
            rows.append([B, f"full {ctx}", n, busy, shared, us(t_pair), us(t_attn), us(t_comb),
                         us(t_fused), f"{share:.0%}", us(t_sdpa), target])
            print(rows[-1], flush=True)
        del case
        torch.cuda.empty_cache()
    for B in (1, 8):
        n = da.choose_num_splits(W, B, window=W)
        case = make_case(B, W, W, window=W)
        t_pair, t_attn, t_comb = time_calls(case, W, n)
        t_fused = time_fused(case, W, n)
        busy, shared = plan_info(B, W, W, n, num_sms, window=W)
        rows.append([B, f"ring {W}", n, busy, shared, us(t_pair), us(t_attn), us(t_comb),
                     us(t_fused), f"{kv_bytes(B, W) / t_pair / 1e9 / copy:.0%}", "-",
                     f"<= 6 us: {'yes' if t_pair <= 6e-6 else 'NO'}"])
        print(rows[-1], flush=True)
    return markdown_table(["B", "layer, tokens", "splits", "programs/head", "shared splits",
                           "attn+combine us", "attn us", "combine us", "fused us", "% copy",
                           "SDPA us", "target"], rows)


def fixed_costs(num_sms: int) -> str:
    rows = []
    n = da.choose_num_splits(FULL_ROWS, 1, num_sms)
    case = make_case(1, FULL_ROWS, 1024)
    variants = [
        ("full, 1 visible row", 1, {}, True),
        ("full 1K, default", 1024, {}, True),
        ("full 1K, PDL off", 1024, {}, False),
        ("full 1K, 1 program per split (no merge)", 1024, {"programs_per_head": 1}, True),
        ("full 1K, min_rows 64", 1024, {"min_rows": 64}, True),
    ]
    for name, ctx, knobs, pdl in variants:
        case[4].fill_(ctx - 1)
        t_pair, t_attn, t_comb = time_calls(case, 0, n, pdl=pdl, **knobs)
        busy, shared = plan_info(1, ctx, FULL_ROWS, n, num_sms, **knobs)
        rows.append([name, n, busy, shared, us(t_pair), us(t_attn), us(t_comb)])
        print(rows[-1], flush=True)
    del case
    torch.cuda.empty_cache()
    ring = make_case(1, W, W, window=W)
    for name, knobs in (("ring, default", {}), ("ring, 1 program per split", {"min_rows": 192})):
        t_pair, t_attn, t_comb = time_calls(ring, W, 3, **knobs)
        busy, shared = plan_info(1, W, W, 3, num_sms, window=W, **knobs)
        rows.append([name, 3, busy, shared, us(t_pair), us(t_attn), us(t_comb)])
        print(rows[-1], flush=True)
    return markdown_table(["B=1 case", "splits", "programs/head", "shared splits",
                           "attn+combine us", "attn us", "combine us"], rows)


def plan_chunk(rows: int, S: int, n: int) -> int:
    """The chunk length of this code's split layout for `rows` visible rows (before
    session 26 the chunks cut the whole cache: ceil(S / n))."""
    try:
        from flintc.ops.attention import split_layout
    except ImportError:
        return math.ceil(S / n)
    return split_layout(rows, n)[0]


def short_contexts(copy: float, num_sms: int) -> str:
    """Full layers at short contexts: the cost of the chunk layout. The model's bench
    loads caches of as many rows as the context (S = 1024, N = 32: chunks of 32 rows, two
    per program), a server caches 131,072-262,144 rows (one chunk holds the context, its
    programs merge it in-kernel); smaller N at S = context emulates other chunk sizes
    (N = 16 at S = 1024: one 64-row chunk per program, stored directly). From session 26
    the chunks follow the visible rows (`flintc.ops.attention.split_layout`), so S no
    longer matters; the "chunk rows" column gives the layout of the code that ran."""
    rows = []
    trials = []
    for B in (1, 8):
        for S, ctx, n, knobs in (
                (1024, 1024, 32, {}), (1024, 1024, 32, {"min_rows": 64}),
                (1024, 1024, 32, {"min_rows": 32}),
                (1024, 1024, 32, {"min_rows": 32, "block_s": 32, "num_warps": 2, "num_stages": 2}),
                (1024, 1024, 16, {"min_rows": 64}), (1024, 1024, 16, {}),
                (1024, 1024, 8, {}), (1024, 1024, 8, {"block_s": 128}),
                (1024, 1024, 16, {"min_rows": 64, "block_s": 32, "num_warps": 2, "num_stages": 2}),
                (1024, 1024, 16, {"min_rows": 64, "num_stages": 1}),
                (FULL_ROWS, 1024, 32, {}), (FULL_ROWS, 1024, 32, {"min_rows": 64}),
                (FULL_ROWS, 1024, 32, {"programs_per_head": 8}),
                (2048, 2048, 32, {"min_rows": 64}), (4096, 4096, 32, {}),
                (8192, 8192, 32, {}), (8192, 8192, 32, {"min_rows": 64}),
                (8192, 8192, 32, {"min_rows": 256}), (FULL_ROWS, 8192, 32, {}),
                (FULL_ROWS, 8192, 32, {"min_rows": 256}), (FULL_ROWS, 100_000, 32, {})):
            if B == 1 or (S == FULL_ROWS and "programs_per_head" not in knobs) or \
                    (S == 1024 and n == 32 and len(knobs) <= 1 and knobs.get("min_rows", 64) == 64):
                trials.append((B, S, ctx, n, knobs))
    for B, S, ctx, n, knobs in trials:
        case = make_case(B, S, ctx)
        try:
            t_pair, t_attn, t_comb = time_calls(case, 0, n, **knobs)
            busy, shared = plan_info(B, ctx, S, n, num_sms, **knobs)
            label = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "default"
            rows.append([B, ctx, S, n, plan_chunk(ctx, S, n), label, busy, shared, us(t_pair),
                         us(t_attn), us(t_comb), f"{kv_bytes(B, ctx) / t_pair / 1e9 / copy:.0%}"])
        except Exception as e:  # noqa: BLE001  (a configuration that does not launch)
            rows.append([B, ctx, S, n, "-", str(knobs), "-", "-", f"{type(e).__name__}: {e}"[:80],
                         "-", "-", "-"])
        print(rows[-1], flush=True)
        del case
    torch.cuda.empty_cache()
    return markdown_table(["B", "tokens", "cache rows S", "splits N", "chunk rows", "knobs",
                           "programs/head", "shared splits", "attn+combine us", "attn us",
                           "combine us", "% copy"], rows)


def full_table(copy: float, num_sms: int) -> str:
    rows = []
    for B in BATCHES:
        n = da.choose_num_splits(FULL_ROWS, B, num_sms)
        case = make_case(B, FULL_ROWS, CONTEXTS[-1])
        for ctx in CONTEXTS:
            case[4].fill_(ctx - 1)
            t_pair, t_attn, _ = time_calls(case, 0, n)
            t_sdpa = time_sdpa(B, ctx)
            busy, _ = plan_info(B, ctx, FULL_ROWS, n, num_sms)
            gbs = kv_bytes(B, ctx) / t_pair / 1e9
            rows.append([B, ctx, n, busy, us(t_pair), us(t_attn), f"{gbs:.0f}", f"{gbs / copy:.0%}",
                         f"{kv_bytes(B, ctx) / t_attn / 1e9 / copy:.0%}", us(t_sdpa),
                         f"{kv_bytes(B, ctx) / t_sdpa / 1e9 / copy:.0%}"])
            print(rows[-1], flush=True)
        del case
        torch.cuda.empty_cache()
    for B in BATCHES:
        n = da.choose_num_splits(W, B, window=W)
        t_pair, t_attn, _ = time_calls(make_case(B, W, W, window=W), W, n)
        busy, _ = plan_info(B, W, W, n, num_sms, window=W)
        rows.append([B, f"ring {W}", n, busy, us(t_pair), us(t_attn), "-",
                     f"{kv_bytes(B, W) / t_pair / 1e9 / copy:.0%}", "-", "-", "-"])
        print(rows[-1], flush=True)
    return markdown_table(["B", "context", "splits", "programs/head", "attn+combine us", "attn us",
                           "GB/s", "% copy", "attn % copy", "SDPA us", "SDPA % copy"], rows)


def ring_trials(num_sms: int) -> list:
    """A sliding layer's ring (W = 513, N = 9 splits of 57 rows) at B = 1-16: the default
    launch (`ring_launch`), launch configurations with one program per split
    (programs_per_head = 9, min_rows = one split), and BLOCK_S 32 / 2 warps with the
    one-wave program count. At batch 8 the
    default launch has 8 programs per head for 9 splits, so one program per head reads two
    splits one after the other (9.7 us per call in the model against 4.5 at batch 1,
    session 22). Smaller tiles (BLOCK_S = 32: ~170 registers, 3 programs per SM) or one
    stage (a split is one block) let 288 programs be resident at once."""
    n = da.choose_num_splits(W, 1, window=W)
    rows = da.ring_min_rows(W, n)
    trials = []
    for B in (1, 2, 4, 8, 16):
        bs, warps, stages, per_split = da.ring_launch(B)
        trials.append((B, W, W, f"default launch (ring_launch: BLOCK_S={bs} warps={warps} "
                       f"stages={stages}{', one program per split' if per_split else ''})", {}))
        for bs, warps, stages in ((64, 4, 3), (32, 4, 2), (32, 2, 2), (32, 2, 1), (16, 2, 2),
                                  (32, 1, 2)):
            trials.append((B, W, W, f"one program per split BLOCK_S={bs} warps={warps} stages={stages}",
                           {"block_s": bs, "num_warps": warps, "num_stages": stages,
                            "programs_per_head": n, "min_rows": rows}))
        trials.append((B, W, W, "one-wave programs BLOCK_S=32 warps=2 stages=2",
                       {"block_s": 32, "num_warps": 2, "num_stages": 2, "programs_per_head":
                        da.default_programs_per_head(B, HKV, num_sms, da.GPU_CTAS_PER_SM)}))
    return trials


def sweep(copy: float, num_sms: int, budget_s: float, only_ring: bool = False) -> str:
    """Trials until `budget_s` seconds have passed (the rest is listed as not run);
    `only_ring`: the ring trials alone (`ring_trials`)."""
    t_end = time.monotonic() + budget_s
    rows = []
    # (BLOCK_S, warps, stages, programs per SM) at 100K.
    configs = [(64, 4, 3, 2), (64, 4, 4, 2), (64, 4, 2, 2), (128, 4, 2, 2), (32, 4, 4, 2),
               (64, 4, 3, 3), (64, 8, 3, 1), (64, 8, 3, 2)]
    trials = []
    for B in (1, 8):
        for bs, warps, stages, per_sm in configs:
            knobs = {"block_s": bs, "num_warps": warps, "num_stages": stages,
                     "programs_per_head": max(1, per_sm * num_sms // (B * HKV))}
            label = f"BLOCK_S={bs} warps={warps} stages={stages} programs/SM={per_sm}"
            trials.append((B, 0, 100_000, label, knobs))
    for min_rows in (64, 128, 256):
        trials.append((1, 0, 1024, f"min_rows={min_rows}", {"min_rows": min_rows}))
    for max_pieces in (8, 16, 32, 64):
        trials.append((1, 0, 8192, f"max_pieces={max_pieces}", {"max_pieces": max_pieces}))
    for min_rows in (64, 128, 192):
        trials.append((1, W, W, f"min_rows={min_rows}", {"min_rows": min_rows}))
    trials += ring_trials(num_sms)
    if only_ring:
        trials = ring_trials(num_sms)
    cases = {}
    for B, window, ctx, label, knobs in trials:
        S = W if window else FULL_ROWS
        what = f"ring {W}" if window else f"full {ctx}"
        if time.monotonic() > t_end:
            rows.append([B, what, label, "-", "not run (time budget)", "-"])
            continue
        key = (B, window)
        if key not in cases:
            cases.clear()
            torch.cuda.empty_cache()
            cases[key] = make_case(B, S, ctx, window=window)
        case = cases[key]
        if not window:
            case[4].fill_(ctx - 1)
        n = da.choose_num_splits(W, B, window=W) if window else da.choose_num_splits(S, B, num_sms)
        try:
            t_pair, _, _ = time_calls(case, window, n, **knobs)
            busy, _ = plan_info(B, ctx, S, n, num_sms, window=window, **knobs)
            rows.append([B, what, label, busy, us(t_pair),
                         f"{kv_bytes(B, ctx) / t_pair / 1e9 / copy:.0%}"])
        except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
            rows.append([B, what, label, "-", f"{type(e).__name__}: {str(e)[:60]}", "-"])
        print(rows[-1], flush=True)
    cases.clear()
    torch.cuda.empty_cache()
    return markdown_table(["B", "layer, tokens", "configuration", "programs/head",
                           "attn+combine us", "% copy"], rows)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the Markdown tables to this file")
    parser.add_argument("--sweep-s", type=float, default=50.0,
                        help="time budget of the configuration sweep in seconds (0: skip it)")
    parser.add_argument("--sweep-ring-only", action="store_true",
                        help="the sweep's ring trials alone (one program per split at batch 1 and 8)")
    parser.add_argument("--short-only", action="store_true",
                        help="only the short-context full-layer table (chunk layouts at 1K-8K)")
    parser.add_argument("--no-full-table", action="store_true",
                        help="skip section 3 (the full B x context table)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention: needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    copy = copy_bandwidth_gbs("cuda")
    head = (f"Device: {props.name}, {sms} SMs; copy bandwidth {copy:.0f} GB/s; torch "
            f"{torch.__version__}; CUDA-graph replay, median, PDL on; config "
            f"BLOCK_S={da.GPU_BLOCK_S} warps={da.GPU_NUM_WARPS} stages={da.GPU_NUM_STAGES} "
            f"programs/SM={da.GPU_CTAS_PER_SM} min rows={da.GPU_MIN_ROWS} "
            f"(ring: one split, ring_min_rows) max pieces={da.MAX_PIECES_PER_SPLIT}")
    print(head, flush=True)
    if args.short_only:
        text = "\n".join([head, "", "### Full layers at short contexts (chunk layouts)", "",
                          short_contexts(copy, sms)])
        print(text)
        write_out(args.out, text)
        return text
    parts = [head, "", "### Key rows (262,144-row full cache, N=32; ring of 513 rows, N=9)", "",
             key_rows(copy, sms), "", "### Fixed costs (B=1)", "", fixed_costs(sms)]
    if not args.no_full_table:
        parts += ["", "### Full table (262,144-row cache; ring of 513 rows, wrapped)", "",
                  full_table(copy, sms)]
    if args.sweep_s > 0:
        parts += ["", "### Sweep", "", sweep(copy, sms, args.sweep_s, args.sweep_ring_only)]
    text = "\n".join(parts)
    print(text)
    write_out(args.out, text)
    return text


if __name__ == "__main__":
    main()
