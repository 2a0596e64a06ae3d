"""The CUDA fused QKV kernel (`flintc.kernels.nvfp4_mma.mma_qkv`: input RMSNorm, Q/K/V
GEMVs on NVFP4 weights in the mma layout, per-head norm, RoPE, KV-cache write) against
the Triton kernel the model ran before (`flintc.kernels.fused_gemv.norm_qkv_rope_kv` with
its `qkv_config`), on the GPU, at the full model's shapes (H 2048, 32 / 4 heads of 128,
sliding layer: ring of 513 rows, RoPE).

    python scripts/gpu_mma_qkv.py [--formats nvfp4,bf16] [--batches 1,2,4,8] [--pdl]
        [--launches 4x8x1,8x4x1,...] [--launches-bf16 8x16x4,...]

Each row: us per call by CUDA-graph replay (median; `benchmarks/common.time_graph`), the
weights rotated through copies larger than the L2 (read from DRAM), GB/s and % of the
copy bandwidth measured in the same run (bytes: codes + scales of the three weights, x,
the norm weights, q and the K / V rows written). "triton" is the model's kernel before
(packed NVFP4 or bf16 weights); "cuda CLxWxRxP" the CUDA kernel with CL blocks per head (a
cluster) of W warps in R row groups, P chunks prefetched (default 1) (NVFP4 weights in the mma layout, bf16 in place); the
largest |q difference| of each CUDA launch to the Triton kernel's q is
printed as a sanity check (the tests hold the bound).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))

H, HQ, HKV, D, W = 2048, 32, 4, 128, 513


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--formats", default="nvfp4,bf16")
    ap.add_argument("--launches", default="4x8x1,8x4x1,2x16x1,2x8x1,1x16x1,4x4x1,8x2x1,2x4x1",
                    help="NVFP4 launches, CLxWxR[xP]")
    ap.add_argument("--launches-bf16", default="8x16x4,4x16x4,8x8x4,4x8x4,8x16x8,8x8x8,"
                    "4x16x8,2x16x4", help="bf16 launches, CLxWxR[xP]")
    ap.add_argument("--pdl", action="store_true", help="launch with programmatic dependent launch")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    from bench_gemv import make_weight, nbytes
    from common import copy_bandwidth_gbs, markdown_table, time_graph

    import flintc.ops  # noqa: F401
    from flintc.kernels import fused_gemv as FG
    from flintc.kernels import nvfp4_mma as M
    from flintc.model import ops

    dev = torch.device("cuda")
    bw = copy_bandwidth_gbs()
    norm = torch.rand(H, device=dev) + 0.5
    qn, kn = torch.rand(D, device=dev) + 0.5, torch.rand(D, device=dev) + 0.5
    cos, sin = (t.to(dev) for t in ops.rope_tables(10000.0, D, 4096, torch.float32))
    rows = []
    print(f"copy bandwidth {bw:.0f} GB/s; PDL {'on' if args.pdl else 'off'}", flush=True)
    for fmt in args.formats.split(","):
        spec = args.launches if fmt == "nvfp4" else args.launches_bf16
        launches = [(*[int(v) for v in s.split("x")], 1)[:4] for s in spec.split(",") if s]
        base = [make_weight(HQ * D, H, fmt), make_weight(HKV * D, H, fmt),
                make_weight(HKV * D, H, fmt)]
        wbytes = nbytes(*base)
        copies = max(2, (256 << 20) // wbytes + 1)
        reps = min(copies, 64)
        packed = [[[t.clone() for t in w] for w in base] for _ in range(copies)]
        conv = packed if fmt == "bf16" else \
            [[[*M.pack_mma_stack(w[0], w[1]), w[2]] for w in grp] for grp in packed]
        print(f"{fmt}: {copies} weight copies of {wbytes / 1e6:.2f} MB", flush=True)
        for N in (int(b) for b in args.batches.split(",")):
            x = torch.randn(N, 1, H, device=dev).to(torch.bfloat16)
            kc = torch.zeros(N, W, HKV, D, dtype=torch.bfloat16, device=dev)
            vc = torch.zeros_like(kc)
            slots = torch.arange(N, device=dev)
            pos = torch.randint(0, 4096, (N, 1), device=dev)
            moved = wbytes + nbytes(x, norm, qn, kn) + 2 * N * HQ * D + 2 * 2 * N * HKV * D
            tail = (qn, kn, cos, sin, kc, vc, slots, pos, 1e-5, HQ, HKV, True, W)
            it = {"i": 0}

            def nxt(groups):
                g = groups[it["i"] % len(groups)]
                it["i"] += 1
                return g

            cfg = FG.qkv_config(N, H, D, HQ, fmt, dev, kv_heads=HKV)
            tri = lambda: FG.norm_qkv_rope_kv(x, norm, *nxt(packed), *tail,  # noqa: E731
                                              use_pdl=args.pdl, config=cfg)
            q_tri = tri().clone()
            s = time_graph(tri, warmup=3, iters=args.iters, calls_per_replay=reps)
            rows.append((fmt, "triton " + cfg.short(), N, s * 1e6, moved / s / 1e9,
                         100 * moved / s / 1e9 / bw, "-"))
            print(rows[-1], flush=True)
            for cl, w, r, pf in launches:
                if (H // 64) % (cl * (w // r)) or D % (16 * r):
                    continue
                q = torch.empty(N, 1, HQ, D, dtype=torch.bfloat16, device=dev)

                def cuda(cl=cl, w=w, r=r, pf=pf, q=q):
                    return M.mma_qkv(x.view(N, H), norm, *nxt(conv), *tail, q, cluster=cl,
                                     warps=w, row_groups=r, prefetch=pf, use_pdl=args.pdl)
                try:
                    got = cuda().clone()
                    s = time_graph(cuda, warmup=3, iters=args.iters, calls_per_replay=reps)
                except Exception as e:  # noqa: BLE001  (one launch shape failing is a result)
                    rows.append((fmt, f"cuda {cl}x{w}x{r}x{pf}", N, float("nan"), 0, 0,
                                 f"{type(e).__name__}: {e}"[:60]))
                    print(rows[-1], flush=True)
                    continue
                diff = (got.float() - q_tri.float()).abs().max().item()
                rows.append((fmt, f"cuda {cl}x{w}x{r}x{pf}", N, s * 1e6, moved / s / 1e9,
                             100 * moved / s / 1e9 / bw, f"{diff:.3g}"))
                print(rows[-1], flush=True)
    table = markdown_table(["weights", "kernel", "N", "us", "GB/s", "% copy", "max |q - triton q|"],
                           [(f, k, n, f"{us:.2f}", f"{g:.0f}", f"{p:.0f}%", d)
                            for f, k, n, us, g, p, d in rows])
    print(table)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mma_qkv.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
