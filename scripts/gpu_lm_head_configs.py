"""The decode LM head with its final RMSNorm (`flintc::norm_lm_head`, bf16 [151552, 2048])
under several launch configurations, against the plain LM head (`flintc::lm_head`, no
norm) and the two-kernel split (`flintc.kernels.prefill_norm.rms_norm`, then the plain LM
head), on the GPU (session 36: the fused kernel took 220.6 / 237.1 us at N = 1 / 8 on an
H100 where the plain one took 198.0 / 202.6, `bench_gemv.py`; the norm prologue, redone
by each of the 1,184 programs before its first weight load, costs ~10%).

    python scripts/gpu_lm_head_configs.py [--batches 1,8] [--out lm_head.md]

Each row: us per call by CUDA-graph replay (`benchmarks/common.time_graph`, median), the
calls alternating between two copies of the weight (1.2 GB: read from DRAM), GB/s of the
weight + x + logits bytes and the share of the copy bandwidth measured in the same run;
the largest |difference| of the logits to the default configuration's (0 where the
configuration changes no rounding: the norm and the fp32 logits are the same sums in
another tiling, up to fp32 summation order).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))

H, V, EPS = 2048, 151552, 1e-5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from common import copy_bandwidth_gbs, int_list, time_graph, write_out

    batches = int_list(ap, "--batches", args.batches, 1, 8)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_lm_head_configs needs a CUDA GPU")
    from flintc.kernels import fused_gemv as fg
    from flintc.kernels.gemv import GemvConfig, choose_config
    from flintc.kernels.prefill_norm import rms_norm

    copy_bw = copy_bandwidth_gbs()
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(V, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(2)]
    norm = 1 + 0.1 * torch.randn(H, device="cuda", generator=g)
    configs = [
        ("f128 k128 w4 st3 (f256 x2 programs)", dict(block_f=128, block_k=128, num_warps=4, num_stages=3)),
        ("f256 k128 w4 st3", dict(block_f=256, block_k=128, num_warps=4, num_stages=3)),
        ("f256 k128 w8 st3", dict(block_f=256, block_k=128, num_warps=8, num_stages=3)),
        ("f256 k64 w8 st4", dict(block_f=256, block_k=64, num_warps=8, num_stages=4)),
        ("f512 k64 w8 st3", dict(block_f=512, block_k=64, num_warps=8, num_stages=3)),
        ("f128 k256 w4 st3", dict(block_f=128, block_k=256, num_warps=4, num_stages=3)),
        ("f128 k128 w8 st4", dict(block_f=128, block_k=128, num_warps=8, num_stages=4)),
        ("f64 k128 w4 st4", dict(block_f=64, block_k=128, num_warps=4, num_stages=4)),
    ]
    lines = [f"Device: {torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s; "
             "PDL on; CUDA-graph replay, median; 2 weight copies alternating (DRAM)", "",
             "| N | variant | config | us | GB/s | % copy | max abs diff to default |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for N in batches:
        x = torch.randn(N, 1, H, device="cuda", generator=g).to(torch.bfloat16)
        nbytes = V * H * 2 + N * H * 2 + N * V * 4
        default = choose_config(N, V, H, "bf16", dev, norm=True)  # what norm_lm_head launches
        ref = fg.norm_lm_head(x, norm, ws[0], EPS, use_pdl=True)
        variants = [("norm_lm_head (default)", default.short(),
                     lambda w, c=default: fg.norm_lm_head(x, norm, w, EPS, use_pdl=True, config=c))]
        for name, kw in configs:
            cfg = GemvConfig(use_dot=True, split_k=1, prefetch=False, flat=True, **kw)
            variants.append(("norm_lm_head", cfg.short(),
                             lambda w, c=cfg: fg.norm_lm_head(x, norm, w, EPS, use_pdl=True, config=c)))
        variants.append(("lm_head alone (no norm)", "default",
                         lambda w: fg.lm_head(x.view(N, H), w, use_pdl=True)))
        variants.append(("rms_norm + lm_head (2 kernels)", "default",
                         lambda w: fg.lm_head(rms_norm(x, norm, EPS).view(N, H), w, use_pdl=True)))
        for name, short, fn in variants:
            turn = [0]

            def call(fn=fn, turn=turn):
                turn[0] += 1
                return fn(ws[turn[0] % 2])
            try:
                out = fn(ws[0])
                torch.cuda.synchronize()
                diff = (out.view(N, V).float() - ref.view(N, V)).abs().max().item()
                us = time_graph(call, warmup=3, iters=20, calls_per_replay=10) * 1e6
            except Exception as e:  # noqa: BLE001  (a config that does not fit is a result)
                row = f"| {N} | {name} | {short} | failed: {type(e).__name__}: {str(e)[:80]} | - | - | - |"
            else:
                gbs = nbytes / us / 1e3
                row = (f"| {N} | {name} | {short} | {us:.1f} | {gbs:.0f} | {100 * gbs / copy_bw:.0f}% | "
                       f"{diff:.3g} |")
            lines.append(row)
            print(row, flush=True)
            write_out(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
