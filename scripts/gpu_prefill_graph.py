"""Prefill from a CUDA graph against eager prefill, on prebuilt builds (dummy weights).

For each build (<builds>/<prefix>-<fmt>-b1, as scripts/gpu_decode_time.py): load it with
`--load-format dummy`, fill the KV caches with seeded random values, then

1. capture the prefill graphs (`runner.prefill_graph(C)` for the chunk and, a build
   whose chunk is longer than the sliding window, the tail chunk): the caches must be
   unchanged afterwards (the capture warms up on slot 0 and restores the rows it wrote);
2. prefill the same prompt (--prompt-len tokens, default 1,300 = chunks of 512, 512 and
   276 + 236 padding, so the sliding rows of a padded last chunk are saved and
   restored around the replay; with --prefill-chunk 2048 and --prompt-len 4700: 2048,
   2048, then tail chunks of 512 and 92 + 420 padding) and then --continue-len more tokens at the next position,
   once with prefill graphs off (eager, slot 0) and once on (slot 1 when the build has
   two slots, else slot 0 again), each from the same cache contents (every slot filled
   alike). Every prompt token's logits, the continuation's last logits and the slot's
   whole KV cache must be bit-identical: both runs launch the same kernels on the same
   inputs;
3. time a prefill of --prompt-len and of --time-len tokens (default 8,192) with graphs
   off and on (host wall clock between two synchronizations, median of --iters).

Prints one JSON line per result and a Markdown table (also to --out); exits 1 on any
mismatch, 2 when a build cannot use prefill graphs (torch backend, FLINTC_PREFILL_GRAPHS=0).

    python3 scripts/gpu_prefill_graph.py --builds gpu_builds --formats nvfp4,bf16 --out $OUT/prefill_graph.md
    python3 scripts/gpu_prefill_graph.py --build BUILD --prompt-len 20 --continue-len 5   # any build

Memory: the full model's weights, its KV caches, and about three copies of one slot's KV
cache for the comparisons (3.6 GB each for the full model at 131K rows).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def fill(runner, seed: int) -> None:
    """Seeded random KV caches, the same values in every slot and for the same seed."""
    g = torch.Generator(device=runner.device).manual_seed(seed)
    for t in runner.kv:
        t.copy_(torch.randn(t.shape[1:], generator=g, device=t.device, dtype=torch.float32).to(t.dtype))


def diff_caches(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[dict]:
    """The caches (one slot's, per runner.kv entry) that differ: index, layer, k or v, rows."""
    bad = []
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            rows = (a != b).flatten(1).any(dim=1).nonzero().flatten()
            bad.append({"cache": i, "layer": i // 2, "kv": "kv"[i % 2], "rows_differing": int(rows.numel()),
                        "first_rows": rows[:5].tolist(), "max_abs": float((a.float() - b.float()).abs().max())})
    return bad


def prefill_once(runner, slot: int, prompt: list[int], extra: list[int], graphs: bool, seed: int):
    """Fill the caches, prefill `prompt` (all logits) then `extra` (last logits) into
    `slot` with prefill graphs on or off. -> (logits [len(prompt), V], logits [V], the
    slot's caches)."""
    fill(runner, seed)
    runner.prefill_graphs = graphs
    a = runner.prefill(slot, prompt, all_logits=True)
    b = runner.prefill(slot, extra, start=len(prompt)) if extra else None
    torch.cuda.synchronize()
    return a, b, [t[slot].clone() for t in runner.kv]


def time_prefill(runner, prompt: list[int], graphs: bool, iters: int) -> float:
    runner.prefill_graphs = graphs
    runner.prefill(0, prompt)  # warm-up (and capture, the first time)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.prefill(0, prompt)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check_build(path: str, fmt: str, args) -> tuple[list[str], bool]:
    from flintc.runtime.compiled import load_build

    rows, ok = [], True
    runner = load_build(path, load_format="dummy", device="cuda", progress=False)
    if not (runner.use_cuda_graphs and runner.prefill_graphs):
        print(f"{path}: prefill graphs are off (backend {runner.backend}, FLINTC_PREFILL_GRAPHS); "
              "nothing to compare", file=sys.stderr)
        sys.exit(2)
    V = runner.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (args.prompt_len,), generator=gen).tolist()
    extra = torch.randint(0, V, (args.continue_len,), generator=gen).tolist()
    slot_e = 0
    slot_g = 1 if runner.max_batch > 1 else 0

    # 1. capture leaves every cache as it was
    fill(runner, args.seed)
    before = [t.clone() for t in runner.kv]
    t0 = time.perf_counter()
    for size in sorted(runner.prefill_sizes):
        runner.prefill_graph(size)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    changed = [i for i, (t, b) in enumerate(zip(runner.kv, before)) if not torch.equal(t, b)]
    del before
    rec = {"format": fmt, "check": "capture leaves caches unchanged", "ok": not changed,
           "changed_caches": changed[:10], "capture_s": round(capture_s, 2)}
    print(json.dumps(rec), flush=True)
    ok &= not changed
    rows.append(f"| {fmt} | capture leaves the KV caches unchanged ({capture_s:.1f} s) | "
                f"{'ok' if not changed else 'FAIL: caches ' + str(changed[:10])} |")

    # 2. graph vs eager, bit for bit
    a_e, b_e, kv_e = prefill_once(runner, slot_e, prompt, extra, False, args.seed)
    a_g, b_g, kv_g = prefill_once(runner, slot_g, prompt, extra, True, args.seed)
    logits_same = torch.equal(a_e, a_g) and (b_e is None or torch.equal(b_e, b_g))
    max_abs = float((a_e - a_g).abs().max())
    if b_e is not None:
        max_abs = max(max_abs, float((b_e - b_g).abs().max()))
    bad = diff_caches(kv_g, kv_e)
    del kv_e, kv_g
    rec = {"format": fmt, "check": "graph vs eager", "prompt_len": args.prompt_len,
           "continue_len": args.continue_len, "chunk": runner.prefill_chunk,
           "pieces": [p[2] for p in runner.prefill_pieces(args.prompt_len)], "slots": [slot_e, slot_g],
           "logits_bit_identical": logits_same, "logits_max_abs": max_abs,
           "last_logits_max_abs": float((a_e[-1] - a_g[-1]).abs().max()),
           "kv_bit_identical": not bad, "kv_differences": bad[:10]}
    print(json.dumps(rec), flush=True)
    ok &= logits_same and not bad
    rows.append(f"| {fmt} | graph vs eager: {args.prompt_len} + {args.continue_len} tokens, all logits and "
                f"the slot's KV cache | {'ok (bit-identical)' if logits_same and not bad else 'FAIL'}"
                f"{'' if logits_same else f', logits max abs diff {max_abs:.3g}'}"
                f"{'' if not bad else f', {len(bad)} caches differ'} |")
    del a_e, a_g, b_e, b_g
    gc.collect()

    # 3. timing
    for n in dict.fromkeys([args.prompt_len, args.time_len]):
        if n > runner.max_model_len or n < 1:
            continue
        p = torch.randint(0, V, (n,), generator=gen).tolist()
        eager = time_prefill(runner, p, False, args.iters)
        graph = time_prefill(runner, p, True, args.iters)
        rec = {"format": fmt, "check": "timing", "tokens": n, "eager_ms": round(eager, 2),
               "graph_ms": round(graph, 2), "speedup": round(eager / graph, 3)}
        print(json.dumps(rec), flush=True)
        rows.append(f"| {fmt} | prefill {n} tokens: eager {eager:.1f} ms, graph {graph:.1f} ms "
                    f"({eager / graph:.2f}x) | timing |")
    runner.prefill_graphs = True
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return rows, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builds", default="gpu_builds")
    ap.add_argument("--prefix", default="full")
    ap.add_argument("--formats", default="nvfp4,bf16")
    ap.add_argument("--build", action="append", default=None,
                    help="a build folder to check instead of <builds>/<prefix>-<fmt>-b1 (repeatable)")
    ap.add_argument("--prompt-len", type=int, default=1300)
    ap.add_argument("--continue-len", type=int, default=100)
    ap.add_argument("--time-len", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_prefill_graph.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    lines = ["| format | check | result |", "|---|---|---|"]
    all_ok = True
    todo = [(b, Path(b).name) for b in args.build] if args.build else \
        [(f"{args.builds}/{args.prefix}-{fmt}-b1", fmt) for fmt in args.formats.split(",")]
    for path, fmt in todo:
        rows, ok = check_build(path, fmt, args)
        lines += rows
        all_ok &= ok
    print("\n".join(lines))
    if args.out:
        open(args.out, "w").write("\n".join(lines) + "\n")
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
