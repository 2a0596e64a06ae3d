"""The CUDA `mma.sync` GEMV on row-major bf16 weights (`flintc.kernels.nvfp4_mma.mma_gemv`
with a bf16 weight; session 14) against the Triton GEMV the model ran before, on the GPU,
at the model's bf16 decode shapes.

    python scripts/gpu_bf16_gemv.py      # env SHAPES "F,K ...", NS "1,8", CFGS "rt,splits,warps,pf ..."

Each row: us per call by CUDA-graph replay (`benchmarks/common.time_graph`, PDL on) with
the weights rotated through copies larger than the L2 (read from DRAM), % of the copy
bandwidth measured in the same run (bytes: the weight, x, the residual and the output),
and the largest |difference| to the Triton kernel's output. Every op is
`gemv_residual` (`bf16(residual + bf16(x @ W^T))`, the O projection / dense down
projection's op); "cuda rtR sS wW pfP" is `mma_gemv` with R row tiles per block, split-K
S (fp32 out, no residual: S > 1 rows are the raw kernel), W warps, P chunks prefetched;
"op cuda" the op's default launch, "op triton" the op with FLINTC_NVFP4_MMA=0.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bf16_gemv.py needs a CUDA GPU")
    from common import copy_bandwidth_gbs, first_call, markdown_table, time_graph

    from flintc.kernels import fused_gemv as FG
    from flintc.kernels import nvfp4_mma as M

    shapes = [tuple(int(v) for v in s.split(",")) for s in
              os.environ.get("SHAPES", "2048,4096 2048,10240 4096,2048 512,2048").split()]
    batches = [int(v) for v in os.environ.get("NS", "1,8").split(",")]
    cfgs = [tuple(int(v) for v in s.split(",")) for s in
            os.environ.get("CFGS", "1,1,16,2 1,1,8,2 1,1,16,1 2,1,8,2 1,1,8,3 1,1,4,2").split()]
    bw = copy_bandwidth_gbs() * 1e9
    rows = []
    for F, K in shapes:
        copies = max(2, int(256e6 // (F * K * 2)) + 1)
        ws = [(torch.randn(F, K, device="cuda") * 0.05).to(torch.bfloat16) for _ in range(copies)]
        for N in batches:
            x = torch.randn(N, K, device="cuda").to(torch.bfloat16)
            res = torch.randn(N, F, device="cuda").to(torch.bfloat16)
            nbytes = F * K * 2 + N * K * 2 + 2 * N * F * 2
            os.environ["FLINTC_NVFP4_MMA"] = "0"
            ref = FG.gemv_residual(x, [ws[0]], res)
            variants = [(f"cuda rt{rt} s{sp} w{w} pf{pf}", (rt, sp, w, pf)) for rt, sp, w, pf in cfgs
                        if (F // 16) % rt == 0 and (K // 64) % (sp * w) == 0]
            variants += [("op cuda", "cuda"), ("op triton", "triton")]
            for label, how in variants:
                os.environ["FLINTC_NVFP4_MMA"] = "0" if how == "triton" else "1"
                out = torch.empty(N, F, device="cuda", dtype=torch.bfloat16)
                outf = torch.zeros(N, F, device="cuda")

                def op(i, how=how, out=out, outf=outf, x=x, res=res):
                    if isinstance(how, tuple):
                        rt, sp, w, pf = how
                        if sp > 1:
                            outf.zero_()
                            return M.mma_gemv(x, ws[i], None, None, outf, row_tiles=rt,
                                              splits=sp, warps=w, prefetch=pf, use_pdl=True)
                        return M.mma_gemv(x, ws[i], None, None, out, row_tiles=rt, warps=w,
                                          prefetch=pf, residual=res, use_pdl=True)
                    return FG.gemv_residual(x, [ws[i]], res, use_pdl=True)

                y, err = first_call(lambda op=op: op(0), f"{F}x{K} N={N} {label}")
                if err:
                    continue
                diff = float((y.float() - ref.float()).abs().max()) if y.dtype == ref.dtype else float("nan")
                turn = itertools.count()
                us = 1e6 * time_graph(lambda: op(next(turn) % copies), calls_per_replay=copies)
                rows.append((f"{F}x{K}", N, label, f"{us:.2f}", f"{100 * nbytes / (us * 1e-6) / bw:.0f}%",
                             f"{diff:.2g}"))
                print(rows[-1], flush=True)
    table = markdown_table(["F x K", "N", "kernel", "us", "% copy", "max |y - triton y|"], rows)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bf16_gemv.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
