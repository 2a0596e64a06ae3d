"""Decode step time of prebuilt full-size builds at batch 1: CUDA-graph replay (forward,
LM head included) at several context lengths, with random KV-cache contents (the
values do not change the work; see docs/gpu-runs.md), plus kernels per forward counted
from a profiler trace of one replay.

    python3 scripts/gpu_decode_time.py --builds gpu_builds --formats nvfp4,bf16 --contexts 1024,100000
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--builds", default="gpu_builds")
    ap.add_argument("--prefix", default="full")
    ap.add_argument("--formats", default="nvfp4,bf16")
    ap.add_argument("--contexts", default="1024,100000")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from flintc.runtime.compiled import load_build

    lines = ["| format | context | decode ms (graph replay) | kernels in CUDA graph |", "|---|---|---|---|"]
    for fmt in args.formats.split(","):
        runner = load_build(f"{args.builds}/{args.prefix}-{fmt}-b1", load_format="dummy", device="cuda",
                            progress=False)
        for t in runner.kv:
            t.normal_()
        graph, ids, pos, slots, _ = runner.decode_graph(1)
        kernels = runner.graph_kernel_count(1)
        for ctx in (int(c) for c in args.contexts.split(",")):
            if ctx >= runner.max_model_len:
                continue
            ids.fill_(1)
            pos.fill_(ctx)
            slots.fill_(0)
            for _ in range(3):
                graph.replay()
            times = []
            for _ in range(7):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(20):
                    graph.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 20)
            ms = statistics.median(times)
            print(json.dumps({"format": fmt, "context": ctx, "decode_ms": ms, "kernels": kernels}), flush=True)
            lines.append(f"| {fmt} | {ctx} | {ms:.3f} | {kernels} |")
        del runner
        torch.cuda.empty_cache()
    print("\n".join(lines))
    if args.out:
        open(args.out, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
