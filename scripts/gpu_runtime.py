"""The compiled runtime at full size on a GPU, against the reference model.

For each weight format: make the full 40B model's dummy weights on the GPU (same seed
for both backends), `compile_model` it (decode bucket 1 and the prefill chunk), load
the build, and run a prompt of --prompt-len tokens plus --steps greedy decode steps on
both the compiled runtime and the eager reference model (`ReferenceRunner`, the same
weight tensors). Both are fed the reference's tokens (teacher forcing), so every step
compares the same computation:

- logits: max |compiled - reference| and whether it is within atol + rtol * |ref|
  (the decode pipeline's stated tolerance, atol 0.06, rtol 0.02);
- greedy tokens: equal wherever the reference's top two logits are further apart than
  the tolerance (where they are closer, either token is a correct answer).

Then it times the compiled decode step (CUDA-graph replay, device events, median) and
counts the kernels in the captured CUDA graph. Writes a Markdown table to --out.

    python3 scripts/gpu_runtime.py --formats nvfp4,bf16 --out $OUT/runtime.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ATOL, RTOL = 0.06, 0.02
PREFILL_ATOL = 0.09  # fuse_prefill_attention's stated tolerance


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="nvfp4,bf16")
    ap.add_argument("--config", default="full")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--ref-chunk", type=int, default=64, help="reference prefill chunk (memory)")
    ap.add_argument("--long-context", type=int, default=0,
                    help="also prefill this many tokens (e.g. 100000) and compare decode steps after it")
    ap.add_argument("--long-steps", type=int, default=8)
    ap.add_argument("--kernels", default=None,
                    help="override the build's kernel backend at load time: torch (reference ops) "
                         "or triton; to tell kernel bugs from the model's own rounding sensitivity")
    ap.add_argument("--builds", default=None,
                    help="folder with prebuilt full-<fmt>-b1 builds (cross-compiled: flintc compile "
                         "--config full --load-format dummy --format FMT --device cuda --no-check "
                         "--max-batch 1 --out DIR/full-FMT-b1); default: compile here")
    ap.add_argument("--build-prefix", default="full", help="builds are <builds>/<prefix>-<fmt>-b1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from flintc.checkpoint.loader import load_checkpoint
    from flintc.model.reference import FlintModel
    from flintc.runtime.build import BuildOptions, compile_model
    from flintc.runtime.compiled import load_build
    from flintc.runtime.runner import ReferenceRunner

    dev = torch.device("cuda")
    rows, results = [], []
    for fmt in args.formats.split(","):
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        if Path(args.config).exists():  # a folder with config.json (e.g. full widths, fewer layers)
            ckpt = load_checkpoint(args.config, load_format="dummy", fmt=fmt, device=dev, progress=False)
        else:
            ckpt = load_checkpoint(None, load_format="dummy", config=args.config, fmt=fmt, device=dev,
                                   progress=False)
        torch.cuda.synchronize()
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        if args.builds:
            build = Path(args.builds) / f"{args.build_prefix}-{fmt}-b1"
            t_compile = float("nan")  # cross-compiled on another machine
        else:
            build = Path(tempfile.mkdtemp()) / f"build-{fmt}"
            compile_model(ckpt, build, BuildOptions(max_batch=1, max_model_len=args.max_model_len,
                                                    backend=args.backend, device="cuda", check=False,
                                                    dump=False), progress=False, log=print)
            t_compile = time.perf_counter() - t0
        runner = load_build(build, ckpt=ckpt, device="cuda", progress=False)
        if args.kernels:
            from flintc.runtime.kernels import KernelTable

            runner._tables = {st: KernelTable(args.kernels, st) for st in ("decode", "prefill")}
        ref = ReferenceRunner(FlintModel(ckpt.config, ckpt.weights, max_positions=runner.cache_rows),
                              max_batch=1, max_model_len=min(args.max_model_len, runner.max_model_len),
                              prefill_chunk=args.ref_chunk)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, ckpt.config.vocab_size, (args.prompt_len,), generator=g).tolist()

        t0 = time.perf_counter()
        a = runner.prefill(0, prompt)
        torch.cuda.synchronize()
        t_prefill = time.perf_counter() - t0
        b = ref.prefill(0, prompt)
        print(json.dumps({"format": fmt, "kernels": args.kernels or "build", "ref_logits_absmax": float(b.abs().max()),
                          "ref_logits_std": float(b.std()), "prefill_max_abs": float((a - b).abs().max())}), flush=True)
        steps = [_compare(a, b, PREFILL_ATOL)]  # the prefill's last-token logits
        tok = int(b.argmax())
        for i in range(args.steps):
            pos = args.prompt_len + i
            la = runner.decode([0], [tok], [pos])[0]
            lb = ref.decode([0], [tok], [pos])[0]
            steps.append(_compare(la, lb))
            tok = int(lb.argmax())
        within = sum(s["within"] for s in steps)
        decided = [s for s in steps if s["decided"]]
        agree = sum(s["token_equal"] for s in decided)
        worst = max(s["max_abs"] for s in steps)

        print(json.dumps({"format": fmt, "prompt_len": args.prompt_len, "steps": len(steps),
                          "within": within, "worst_abs": worst, "per_step_max_abs":
                          [round(s["max_abs"], 4) for s in steps], "decided": len(decided),
                          "tokens_equal": agree, "prefill_s": t_prefill}), flush=True)
        ms = _time_decode(runner)
        e2e = _time_e2e(runner, args.prompt_len + args.steps)
        print(json.dumps({"format": fmt, "decode_ms_1k": ms, "e2e_ms_1k": e2e}), flush=True)
        try:
            kernels = runner.graph_kernel_count(1)
        except Exception as exc:  # noqa: BLE001 - a diagnostic
            kernels = f"failed: {exc}"[:80]
        print(json.dumps({"format": fmt, "graph_kernels": kernels}), flush=True)
        long = {}
        if args.long_context:
            long = _long_context(runner, ckpt, args)
            long["decode_ms"] = _time_decode(runner)  # the static inputs now sit at the long context
            long["e2e_ms"] = _time_e2e(runner, args.long_context + args.long_steps)
        r = {"format": fmt, "load_s": round(t_load, 1), "compile_s": round(t_compile, 1),
             "prefill_s": round(t_prefill, 2), "prompt_len": args.prompt_len, "steps": len(steps),
             "within_tol": within, "worst_abs": worst, "decided": len(decided), "tokens_equal": agree,
             "decode_ms": ms, "e2e_ms": e2e, "graph_kernels": kernels,
             "kernels_per_forward_plan": runner.kernels_per_forward.get("decode_b1"),
             "implementations": runner.plan["decode_b1"]["implementations"], "long": long}
        results.append(r)
        rows.append(r)
        print(json.dumps(r), flush=True)
        del runner, ref, ckpt, a, b
        torch.cuda.empty_cache()

    lines = [f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; backend {args.backend}; "
             f"config {args.config}; max_model_len {args.max_model_len}; tolerance atol {ATOL} rtol {RTOL}",
             "", "| format | compile s | prefill s (1 x {} tok) | steps within tol | worst abs diff | tokens equal "
             "where decided | decode ms (b1, graph replay) | end to end ms/token | kernels in CUDA graph | kernels (plan) |".format(
                 args.prompt_len),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['compile_s']} | {r['prefill_s']} | {r['within_tol']}/{r['steps']} | "
                     f"{r['worst_abs']:.4g} | {r['tokens_equal']}/{r['decided']} | {r['decode_ms']:.3f} | {r['e2e_ms']:.3f} | "
                     f"{r['graph_kernels']} | {r['kernels_per_forward_plan']} |")
    if args.long_context:
        lines += ["", f"Long context: compiled prefill of {args.long_context} tokens, then {args.long_steps} "
                  "decode steps from the same cache state on both (the reference gets a copy of the "
                  "compiled runtime's KV cache):", "",
                  "| format | prefill s | prefill tok/s | steps within tol | worst abs diff | tokens equal where decided "
                  "| decode ms at this context (graph replay) | end to end ms/token |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lg = r["long"]
            lines.append(f"| {r['format']} | {lg['prefill_s']:.2f} | {lg['tok_per_s']:.0f} | {lg['within']}/{lg['steps']} "
                         f"| {lg['worst_abs']:.4g} | {lg['tokens_equal']}/{lg['decided']} | {lg['decode_ms']:.3f} | {lg['e2e_ms']:.3f} |")
    lines.append("")
    for r in rows:
        lines.append(f"{r['format']} kernel implementations: " + ", ".join(
            f"{k}: {v.split('.')[-1] if not v.startswith('reference') else 'REFERENCE'}"
            for k, v in r["implementations"].items()))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ok = all(r["within_tol"] == r["steps"] and r["tokens_equal"] == r["decided"] for r in rows)
    ok &= all(r["long"].get("within", 0) == r["long"].get("steps", 0) for r in rows)
    return 0 if ok else 1


def _long_context(runner, ckpt, args) -> dict:
    """Prefill --long-context tokens with the compiled runtime (chunked), then decode
    --long-steps tokens on it and on the reference model from a copy of its KV cache."""
    from flintc.model.reference import FlintModel
    from flintc.runtime.runner import ReferenceRunner

    n = args.long_context
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, ckpt.config.vocab_size, (n,), generator=g).tolist()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = runner.prefill(0, prompt)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    _attention_op_check(runner, n)
    ref = ReferenceRunner(FlintModel(ckpt.config, ckpt.weights, max_positions=runner.cache_rows),
                          max_batch=1, max_model_len=n + args.long_steps + 1, prefill_chunk=64)
    for mine, theirs in zip(runner.kv, ref.kv):
        rows = theirs.shape[1]
        theirs[0].copy_(mine[0, :rows])
    tok = int(logits.argmax())
    steps = []
    for i in range(args.long_steps):
        la = runner.decode([0], [tok], [n + i])[0]
        lb = ref.decode([0], [tok], [n + i])[0]
        steps.append(_compare(la, lb))
        tok = int(lb.argmax())
    decided = [s for s in steps if s["decided"]]
    out = {"prefill_s": dt, "tok_per_s": n / dt, "steps": len(steps), "within": sum(s["within"] for s in steps),
           "worst_abs": max(s["max_abs"] for s in steps), "decided": len(decided),
           "tokens_equal": sum(s["token_equal"] for s in decided)}
    del ref
    torch.cuda.empty_cache()
    print(json.dumps({"long_context": out}), flush=True)
    return out


def _attention_op_check(runner, n: int) -> None:
    """The decode-attention kernels against their reference ops on the runtime's own
    caches after the long prefill (a full and a sliding layer, position n)."""
    import flintc.ops  # noqa: F401

    c = runner.config
    K = runner._tables["decode"]
    for i in (c.layer_types.index("full_attention"), c.layer_types.index("sliding_attention")):
        kc, vc = runner.kv[2 * i], runner.kv[2 * i + 1]
        window = 0 if c.layer_types[i] == "full_attention" else c.sliding_window
        q = torch.randn(1, 1, c.num_attention_heads, c.head_dim, device=kc.device).to(torch.bfloat16)
        sinks = torch.randn(c.num_attention_heads, device=kc.device)
        slots = torch.tensor([0], device=kc.device)
        for p in (n - 1, min(n - 1, 4000), 600):
            pos = torch.tensor([[p]], device=kc.device)
            splits = 32 if window == 0 else 3
            o1, l1 = K.decode_attention(q, kc, vc, slots, pos, window, splits)
            a1 = K.attention_combine(o1, l1, sinks)
            o2, l2 = torch.ops.flintc.decode_attention(q, kc, vc, slots, pos, window, splits)
            a2 = torch.ops.flintc.attention_combine(o2, l2, sinks)
            print(json.dumps({"attention_check": {"layer": i, "window": window, "position": p,
                                                  "max_abs": float((a1.float() - a2.float()).abs().max()),
                                                  "lse_max_abs": float((l1 - l2).abs().nan_to_num(0).max()),
                                                  "impl": K.implementation("decode_attention")}}), flush=True)


def _compare(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> dict:
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    within = bool((diff <= atol + RTOL * b.abs()).all())
    top2 = b.topk(2).values
    decided = bool((top2[0] - top2[1]) > 2 * (ATOL + RTOL * top2[0].abs()))
    return {"max_abs": float(diff.max()), "within": within, "decided": decided,
            "token_equal": int(a.argmax()) == int(b.argmax())}


def _time_e2e(runner, pos: int, iters: int = 30) -> float:
    """ms per token of the whole loop at batch 1: copy the token in, replay, greedy
    sampling on the device, the token back to the host (what generation does)."""
    from flintc.sampling import SamplingParams, sample

    params = [SamplingParams(temperature=0)]
    tok = 1
    for _ in range(3):
        tok = int(sample(runner.decode([0], [tok], [pos]), params, [None])[0])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(iters):
        tok = int(sample(runner.decode([0], [tok], [pos]), params, [None])[0])
    return 1000 * (time.perf_counter() - t0) / iters


def _time_decode(runner, iters: int = 50, repeats: int = 7) -> float:
    """Median ms per decode step at batch 1: replays of the captured CUDA graph."""
    graph = runner.decode_graph(1)[0]
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
