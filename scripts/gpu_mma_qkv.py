"""The CUDA fused QKV kernel (`flintc.kernels.nvfp4_mma.mma_qkv`: input RMSNorm, Q/K/V
GEMVs on NVFP4 weights in the mma layout, per-head norm, RoPE, KV-cache write) against
the Triton kernel the model ran before (`flintc.kernels.fused_gemv.norm_qkv_rope_kv` with
its `qkv_config`), on the GPU, at the full model's shapes (H 2048, 32 / 4 heads of 128,
sliding layer: ring of 513 rows, RoPE).

    python scripts/gpu_mma_qkv.py [--batches 1,2,4,8] [--launches 4x8,8x4,...] [--pdl]

Each row: us per call by CUDA-graph replay (median; `benchmarks/common.time_graph`), the
weights rotated through copies larger than the L2 (read from DRAM), GB/s and % of the
copy bandwidth measured in the same run (bytes: codes + scales of the three weights, x,
the norm weights, q and the K / V rows written). "triton" is the model's kernel before
(packed weights); "cuda CLxW" the CUDA kernel with CL blocks per head (a cluster) of W
warps; the largest |q difference| of each CUDA launch to the Triton kernel's q is
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
    ap.add_argument("--launches", default="4x8,8x4,2x16,2x8,1x16,4x4,8x2,2x4")
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
    launches = [tuple(int(v) for v in s.split("x")) for s in args.launches.split(",") if s]
    base = [make_weight(HQ * D, H, "nvfp4"), make_weight(HKV * D, H, "nvfp4"),
            make_weight(HKV * D, H, "nvfp4")]
    wbytes = nbytes(*base)
    copies = max(2, (256 << 20) // wbytes + 1)
    packed = [[[t.clone() for t in w] for w in base] for _ in range(copies)]
    conv = [[[*M.pack_mma_stack(w[0], w[1]), w[2]] for w in grp] for grp in packed]
    norm = torch.rand(H, device=dev) + 0.5
    qn, kn = torch.rand(D, device=dev) + 0.5, torch.rand(D, device=dev) + 0.5
    cos, sin = (t.to(dev) for t in ops.rope_tables(10000.0, D, 4096, torch.float32))
    rows = []
    print(f"copy bandwidth {bw:.0f} GB/s; {copies} weight copies of {wbytes / 1e6:.2f} MB; "
          f"PDL {'on' if args.pdl else 'off'}", flush=True)
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

        cfg = FG.qkv_config(N, H, D, HQ, "nvfp4", dev, kv_heads=HKV)
        tri = lambda: FG.norm_qkv_rope_kv(x, norm, *nxt(packed), *tail, use_pdl=args.pdl,  # noqa: E731
                                          config=cfg)
        q_tri = tri().clone()
        s = time_graph(tri, warmup=3, iters=args.iters, calls_per_replay=min(copies, 64))
        rows.append(("triton " + cfg.short(), N, s * 1e6, moved / s / 1e9,
                     100 * moved / s / 1e9 / bw, "-"))
        print(rows[-1], flush=True)
        for cl, w in launches:
            if (H // 64) % (cl * w):
                continue
            q = torch.empty(N, 1, HQ, D, dtype=torch.bfloat16, device=dev)

            def cuda(cl=cl, w=w, q=q):
                return M.mma_qkv(x.view(N, H), norm, *nxt(conv), *tail, q, cluster=cl, warps=w,
                                 use_pdl=args.pdl)
            try:
                got = cuda().clone()
                s = time_graph(cuda, warmup=3, iters=args.iters, calls_per_replay=min(copies, 64))
            except Exception as e:  # noqa: BLE001  (one launch shape failing is a result)
                rows.append((f"cuda {cl}x{w}", N, float("nan"), 0, 0, f"{type(e).__name__}: {e}"[:60]))
                print(rows[-1], flush=True)
                continue
            diff = (got.float() - q_tri.float()).abs().max().item()
            rows.append((f"cuda {cl}x{w}", N, s * 1e6, moved / s / 1e9, 100 * moved / s / 1e9 / bw,
                         f"{diff:.3g}"))
            print(rows[-1], flush=True)
    table = markdown_table(["kernel", "N", "us", "GB/s", "% copy", "max |q - triton q|"],
                           [(k, n, f"{us:.2f}", f"{g:.0f}", f"{p:.0f}%", d)
                            for k, n, us, g, p, d in rows])
    print(table)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mma_qkv.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
