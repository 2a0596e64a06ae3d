"""GPU smoke run: the reference model on the full 40B config (dummy weights) and the
pass pipeline's numeric checks on a full-width 4-layer model, on one CUDA device.

Usage (on the GPU machine): python scripts/gpu_smoke.py --out OUT_DIR
Writes OUT_DIR/gpu_smoke.md (a table per section) and prints the same.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch


def reference_decode(fmt: str, prompt_len: int, new_tokens: int) -> dict:
    from flintc.checkpoint.dummy import dummy_weights
    from flintc.config import FlintConfig
    from flintc.model.generate import generate
    from flintc.model.reference import FlintModel
    from flintc.sampling import SamplingParams

    cfg = FlintConfig.preset("full")
    t0 = time.perf_counter()
    weights = dummy_weights(cfg, fmt, "cuda", seed=0)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    model = FlintModel(cfg, weights, max_positions=prompt_len + new_tokens + 1)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    generate(model, [prompt[:8]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    res = generate(model, [prompt], params, prefill_chunk=256)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, weights
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {"format": fmt, "load_s": load_s, "prefill_s": res.prefill_seconds,
            "decode_ms": 1000 * res.decode_seconds / max(res.decode_steps, 1), "peak_gib": peak,
            "tokens": res.output_ids[0]}


def pipeline_checks(fmt: str) -> str:
    from flintc.checkpoint.init import random_weights
    from flintc.cli.graphs import format_table
    from flintc.config import FlintConfig
    from flintc.model.reference import FlintModel
    from flintc.passes.pipeline import compile_step, step_options
    from flintc.quant.nvfp4 import quantize

    cfg = FlintConfig.preset("full").replace(num_hidden_layers=4)
    w = random_weights(cfg, seed=0)
    if fmt == "nvfp4":
        w = {k: quantize(v) if "proj" in k and v.dim() >= 2 else v for k, v in w.items()}
    w = {k: v.to("cuda") for k, v in w.items()}
    model = FlintModel(cfg, w, max_positions=4097)
    out = []
    for step, batch, tokens in (("decode", 8, None), ("prefill", 1, 64)):
        t0 = time.perf_counter()
        _, report = compile_step(model, step, batch=batch, tokens=tokens, cache_len=4096, check_model=model,
                                 options=step_options(step, {"attention_splits": 16}))
        out.append(f"### {fmt} {step} B={batch}{'' if tokens is None else f' T={tokens}'} "
                   f"({time.perf_counter() - t0:.1f} s, passed={report.passed})\n\n```\n{format_table(report)}\n```\n")
    del model, w
    torch.cuda.empty_cache()
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    lines = [f"# GPU smoke run, {datetime.date.today()}",
             f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    lines += ["## Reference model, full config, dummy weights, batch 1, 64-token prompt, 16 greedy tokens",
              "", "| format | weights made (s) | prefill (s) | decode (ms/token) | peak memory (GiB) |",
              "|---|---|---|---|---|"]
    for fmt in ("nvfp4", "bf16"):
        r = reference_decode(fmt, 64, 16)
        lines.append(f"| {fmt} | {r['load_s']:.2f} | {r['prefill_s']:.3f} | {r['decode_ms']:.1f} | {r['peak_gib']:.1f} |")
        print(lines[-1], flush=True)
    lines += ["", "## Pass pipeline numeric checks on the GPU: full widths, first 4 layers, random weights", ""]
    for fmt in ("bf16", "nvfp4"):
        lines.append(pipeline_checks(fmt))
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    Path(args.out, "gpu_smoke.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
