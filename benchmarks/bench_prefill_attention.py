"""Prefill attention over the KV cache at the full model's shapes (GPU only).

`flintc.kernels.prefill_attention.prefill_attention_kv` (attention + cache write, the
op's two launches) for one sequence, chunks of T in {512, 2048} tokens at context
offsets p0 in {0, 8192, 100000}, full layers (a 131072-row cache) and sliding layers
(a ring of W = 513), Hq = 32, Hkv = 4, D = 128. For each: time, achieved TFLOP/s
counting only the visible (query, key) pairs (4 * Hq * D FLOPs each: q.k and p.v),
the kernel with p.v in 1, 2 (default) and 3 bf16 parts, and for comparison:

* `flex`: `torch.nn.attention.flex_attention` (compiled) with a block mask for the
  causal window and `return_lse`, the sink applied after the fact
  (o * 1 / (1 + exp(sink - lse))), over the keys laid out heads-major in position
  order (full layers: the cache rows after the write, copied outside the timing;
  sliding: the ring re-ordered + the new keys, a gather timed with it); its max
  |difference| from the reference op;
* `sdpa`: `scaled_dot_product_attention` without a sink (full layers: flash with a
  lower-right causal bias; sliding: a materialised window mask, efficient backend),
  on K/V already laid out and head-expanded outside the timing: a speed reference.

Timing: CUDA-graph replay (`benchmarks/common.py: time_graph`); a function that cannot
be captured falls back to CUDA-event timing of eager calls, marked "eager".

    python benchmarks/bench_prefill_attention.py [--out prefill_attention.md]
"""

from __future__ import annotations

import argparse
import statistics

import torch

try:
    from common import markdown_table, time_graph, write_out
except ImportError:  # run from the repository root with PYTHONPATH=$PWD
    from benchmarks.common import markdown_table, time_graph, write_out

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.kernels import prefill_attention as kernels

HQ, HKV, D, W = 32, 4, 128, 513
S_FULL = 131072
CHUNKS = (512, 2048)
OFFSETS = (0, 8192, 100_000)


def visible_pairs(p0: int, T: int, window: int) -> int:
    """(query, key) pairs that some query sees: sum over queries at p0+i of p0+i+1
    keys (full) or min(p0+i+1, W) (sliding)."""
    return sum(min(p0 + i + 1, window) if window else p0 + i + 1 for i in range(T))


def time_s(fn) -> tuple[float, str]:
    """(seconds per call, how): CUDA-graph replay, else eager CUDA events."""
    try:
        return time_graph(fn), "graph"
    except Exception:  # noqa: BLE001  (not capturable: time it eagerly)
        torch.cuda.synchronize()
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times), "eager"


def make(p0: int, T: int, window: int, gen):
    S = window or S_FULL
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, T, HQ, D, generator=gen, device=dev).to(bf16)
    k = torch.randn(1, T, HKV, D, generator=gen, device=dev).to(bf16)
    v = torch.randn(1, T, HKV, D, generator=gen, device=dev).to(bf16)
    k_cache = torch.randn(1, S, HKV, D, generator=gen, device=dev).to(bf16)
    v_cache = torch.randn(1, S, HKV, D, generator=gen, device=dev).to(bf16)
    slots = torch.zeros(1, dtype=torch.int64, device=dev)
    positions = (p0 + torch.arange(T, device=dev))[None]
    sinks = torch.randn(HQ, generator=gen, device=dev)
    return q, k, v, k_cache, v_cache, slots, positions, sinks


def keys_in_order(args, p0: int, T: int, window: int):
    """K, V [1, Hkv, n, D] in position order and the first position: full layers the
    cache rows 0..p0+T-1 after the write; sliding the visible old ring + the new keys."""
    q, k, v, kc, vc, slots, positions, sinks = args
    if not window:
        kc[0, p0:p0 + T], vc[0, p0:p0 + T] = k[0], v[0]
        return kc[0, :p0 + T].transpose(0, 1)[None], vc[0, :p0 + T].transpose(0, 1)[None], 0
    lo = max(0, p0 - window + 1)
    rows = torch.arange(lo, p0, device=q.device) % window
    keys = torch.cat([kc[0, rows], k[0]], 0).transpose(0, 1)[None]
    values = torch.cat([vc[0, rows], v[0]], 0).transpose(0, 1)[None]
    return keys, values, lo


def flex_runner(args, p0: int, T: int, window: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v, kc, vc, slots, positions, sinks = args
    flex = torch.compile(flex_attention, dynamic=False)
    keys, values, first = keys_in_order(args, p0, T, window)
    keys, values = keys.contiguous(), values.contiguous()  # heads-major copy, outside the timing
    n = keys.shape[2]

    def mask_mod(b, h, q_idx, kv_idx):
        qp, kp = p0 + q_idx, first + kv_idx
        ok = kp <= qp
        return ok & (qp - kp < window) if window else ok

    block_mask = create_block_mask(mask_mod, None, None, T, n, device="cuda")
    qh = q.transpose(1, 2)  # [1, Hq, T, D]
    scale = D ** -0.5

    def run():
        if window:  # the ring re-ordered + new keys: part of the work
            kk, vv, _ = keys_in_order(args, p0, T, window)
        else:
            kk, vv = keys, values
        o, lse = flex(qh, kk.contiguous(), vv.contiguous(), block_mask=block_mask, scale=scale, enable_gqa=True, return_lse=True)
        o = o.float() * torch.sigmoid(lse - sinks[None, :, None])[..., None]  # sink after the fact
        return o.transpose(1, 2).reshape(1, T, HQ * D).to(torch.bfloat16)

    return run


def sdpa_runner(args, p0: int, T: int, window: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q, k, v, kc, vc, slots, positions, sinks = args
    keys, values, first = keys_in_order(args, p0, T, window)
    G = HQ // HKV
    kk = keys.repeat_interleave(G, dim=1).contiguous()  # [1, Hq, n, D], outside the timing
    vv = values.repeat_interleave(G, dim=1).contiguous()
    qh = q.transpose(1, 2).contiguous()
    n = kk.shape[2]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not window:
        bias = causal_lower_right(T, n)
        return lambda: sdpa(qh, kk, vv, attn_mask=bias)
    qp = (p0 + torch.arange(T, device="cuda"))[:, None]
    kp = (first + torch.arange(n, device="cuda"))[None, :]
    mask = (kp <= qp) & (qp - kp < window)

    def run():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return sdpa(qh, kk, vv, attn_mask=mask)

    return run


def bench(p0: int, T: int, window: int) -> list:
    gen = torch.Generator(device="cuda").manual_seed(p0 + T + window)
    args = make(p0, T, window, gen)
    pairs = visible_pairs(p0, T, window)
    flops = 4 * HQ * D * pairs
    ref_cache = [t.clone() for t in args[3:5]]
    ref = torch.ops.flintc.prefill_attention_kv(*args[:3], *ref_cache, *args[5:], window)
    del ref_cache
    row = [("sliding" if window else "full"), T, p0, pairs]
    base = kernels.GPU_PV_SPLITS
    try:
        for splits in (1, 2, 3):
            kernels.GPU_PV_SPLITS = splits
            kc, vc = args[3].clone(), args[4].clone()
            fn = lambda: kernels.prefill_attention_kv(*args[:3], kc, vc, *args[5:], window)  # noqa: E731
            diff = (fn().float() - ref.float()).abs().max().item()
            s, how = time_s(fn)
            row += [f"{s * 1e3:.3f}{'' if how == 'graph' else ' eager'}", f"{flops / s / 1e12:.0f}",
                    f"{diff:.2g}"]
    finally:
        kernels.GPU_PV_SPLITS = base
    for name, make_fn in (("flex", flex_runner), ("sdpa", sdpa_runner)):
        try:
            fn = make_fn([t.clone() if i in (3, 4) else t for i, t in enumerate(args)], p0, T, window)
            out = fn()
            s, how = time_s(fn)
            cell = f"{s * 1e3:.3f}{'' if how == 'graph' else ' eager'}"
            tf = f"{flops / s / 1e12:.0f}"
            if name == "flex":
                row += [cell, tf, f"{(out.float() - ref.float()).abs().max().item():.2g}"]
            else:
                row += [cell, tf]
        except Exception as e:  # noqa: BLE001  (a comparison line only)
            print(f"{name} failed at {row[:3]}: {type(e).__name__}: {str(e)[:200]}")
            row += ["n/a", "n/a", "n/a"] if name == "flex" else ["n/a", "n/a"]
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the Markdown table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    headers = ["layer", "T", "p0", "visible pairs"]
    for s in (1, 2, 3):
        headers += [f"triton pv x{s} ms", f"TFLOP/s x{s}", f"max diff x{s}"]
    headers += ["flex ms", "flex TFLOP/s", "flex max diff", "sdpa (no sink) ms", "sdpa TFLOP/s"]
    rows = []
    for window in (0, W):
        for T in CHUNKS:
            for p0 in OFFSETS:
                rows.append(bench(p0, T, window))
                print(rows[-1], flush=True)
    text = ("Prefill attention, Hq=32, Hkv=4, D=128, B=1; full layers: a 131072-row cache; "
            "sliding: W=513. TFLOP/s over the visible (query, key) pairs only; max diff "
            "against torch.ops.flintc.prefill_attention_kv (bf16 output).\n\n"
            + markdown_table(headers, rows))
    print(text)
    write_out(args.out, text)
    return text


if __name__ == "__main__":
    main()
