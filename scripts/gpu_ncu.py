"""Launch a few decode kernels once each inside a CUDA profiler range, for Nsight Compute.

Meant to run under `ncu --profile-from-start off` (see scripts/gpu_profile.sh): every case
is compiled and run once first (outside the range), then each is launched once between
`cudaProfilerStart` / `cudaProfilerStop`, in the order printed on stdout, with a device
synchronize between cases. ncu flushes the caches before each profiled kernel by default
(`--cache-control all`), so weights are read from DRAM as in the model. PDL is off (ncu
serialises kernels anyway).

Cases (model shapes of FLINT_SPEC, batch 1 unless named): the O projection + residual
(2048 x 4096) NVFP4 and bf16 with the default configuration, and NVFP4 with a one-step
configuration; cuBLAS's bf16 GEMV of the same shape (`torch.nn.functional.linear`); the
fused QKV kernel NVFP4; the MoE gate/up and down kernels NVFP4 (batch 1, 2, 4, 8) and bf16
(batch 8); the dense gate/up kernel NVFP4 at
batch 1 and 8 (`dense_gate_up_nvfp4_n1`, `_n8`); decode attention at batch 1 (the
513-row ring of a sliding layer, a full layer at 1K tokens, the combine); the RMSNorm + LM head (bf16,
151552 x 2048) and the plain LM head; and `stream_sum`, a kernel that only reads 4.7 MB
(the NVFP4 O projection's bytes) with every load of a program issued at once: the floor
a kernel of that size can reach.

    ncu --clock-control none --profile-from-start off ... python3 scripts/gpu_ncu.py [--cases a,b]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


@triton.jit
def stream_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Each program sums UNROLL * BLOCK int32 words, all loads issued before the first add."""
    pid = tl.program_id(0)
    base = pid * BLOCK * UNROLL
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for u in tl.static_range(UNROLL):
        offs = base + u * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc))


def stream_sum(x: torch.Tensor, out: torch.Tensor, block: int = 1024, unroll: int = 8):
    n = x.numel()
    grid = (triton.cdiv(n, block * unroll),)
    stream_sum_kernel[grid](x, out, n, BLOCK=block, UNROLL=unroll, num_warps=4)
    return out


def build_cases(wanted: set[str]):
    import bench_gemv as bg

    bg.ROTATE = False
    bg.PDL = False
    from flintc.kernels import fused_gemv as fg
    from flintc.kernels.gemv import GemvConfig

    cases = {}

    def gemv_case(name, case_name, fmt, N=1, cfg=None):
        case = next(c for c in bg.CASES if c.name == case_name)
        ours = case.build(fmt, N)[0]
        cases[name] = lambda: ours(cfg)

    gemv_case("o_proj_nvfp4", "o_proj+res", "nvfp4")
    gemv_case("o_proj_bf16", "o_proj+res", "bf16")
    gemv_case("o_proj_nvfp4_onestep", "o_proj+res", "nvfp4",
              cfg=GemvConfig(use_dot=True, block_f=32, block_k=1024, split_k=4, num_warps=8,
                             num_stages=1, prefetch=True))
    gemv_case("o_proj_nvfp4_n8", "o_proj+res", "nvfp4", N=8)
    gemv_case("qkv_nvfp4", "qkv", "nvfp4")
    gemv_case("qkv_bf16", "qkv", "bf16")
    gemv_case("lm_head_bf16", "lm_head", "bf16")
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    w = (torch.randn(2048, 4096, device="cuda") * 0.05).to(torch.bfloat16)
    cases["o_proj_cublas_bf16"] = lambda: torch.nn.functional.linear(x, w)
    xl = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    wl = (torch.randn(151552, 2048, device="cuda") * 0.05).to(torch.bfloat16)
    cases["lm_head_plain_bf16"] = lambda: fg.gemv(xl, [wl])
    buf = torch.randint(0, 100, (4_718_592 // 4,), device="cuda", dtype=torch.int32)
    out = torch.empty(4096, device="cuda", dtype=torch.int32)
    cases["stream_sum_4.7MB"] = lambda: stream_sum(buf, out)
    if not wanted or "moe_gate_up_nvfp4" in wanted:
        import bench_moe as bm
        from flintc.kernels import moe as K

        s = bm.Setup("nvfp4", 1, torch.Generator(device="cuda").manual_seed(0))
        cases["moe_gate_up_nvfp4"] = lambda: K.moe_topk_gate_up(
            s.xn[0], s.logits[0], s.bias[0], s.gate, s.up, s.sg[0], s.su[0], bm.TOP_K,
            bm.SCALING)
        cases["moe_down_nvfp4"] = lambda: K.moe_down_combine_residual(
            s.h[0], s.ids[0], s.w[0], s.down, s.sd[0], s.x[0])
        cases["norm_router_nvfp4"] = lambda: K.norm_router(s.x[0], s.norm[0], s.router[0], bm.EPS)
    # batch 8, each format's TUNED configuration (flat 2-D tiles): why NVFP4 takes longer
    # than bf16 for 3.6x fewer bytes (session 9: 63 against 50 us for gate/up)
    # (and NVFP4 at batch 4, 50% of copy against a read floor of 87%: session 22)
    # (and NVFP4 at batches 2-4 on the H200, 1.7x its read floor: session 46)
    for fmt, n in (("nvfp4", 2), ("nvfp4", 4), ("nvfp4", 8), ("bf16", 8)):
        if not wanted or {f"moe_gate_up_{fmt}_n{n}", f"moe_down_{fmt}_n{n}"} & wanted:
            import bench_moe as bm
            from flintc.kernels import moe as K

            sn = bm.Setup(fmt, n, torch.Generator(device="cuda").manual_seed(0))
            cases[f"moe_gate_up_{fmt}_n{n}"] = lambda sn=sn: K.moe_topk_gate_up(
                sn.xn[0], sn.logits[0], sn.bias[0], sn.gate, sn.up, sn.sg[0], sn.su[0],
                bm.TOP_K, bm.SCALING, sn.down)
            cases[f"moe_down_{fmt}_n{n}"] = lambda sn=sn: K.moe_down_combine_residual(
                sn.h[0], sn.ids[0], sn.w[0], sn.down, sn.sd[0], sn.x[0])
    # the read floor of the NVFP4 gate/up (benchmarks/read_floor.py: only the op's weight
    # loads, 128 threads x 8 loads each) at N = 1, 2, 4 and 8, next to the op's cases above
    for n in (1, 2, 4, 8):
        if wanted and f"read_floor_gate_up_nvfp4_n{n}" not in wanted:
            continue
        import bench_moe as bm
        from read_floor import ReadFloor

        sf = bm.Setup("nvfp4", n, torch.Generator(device="cuda").manual_seed(0))
        rf = ReadFloor([sf.gate[0], sf.up[0]], [sf.gate[1].view(torch.uint8),
                                                sf.up[1].view(torch.uint8)],
                       [sf.sg[0][0], sf.su[0][0]], [sf.sg[0][1].view(torch.uint8),
                                                    sf.su[0][1].view(torch.uint8)])
        cases[f"read_floor_gate_up_nvfp4_n{n}"] = lambda rf=rf, sf=sf: rf(sf.ids[0], 128, 8,
                                                                          use_pdl=False)
    # the dense layers' NVFP4 gate/up on the CUDA kernel (session 21: 40-50% of copy against
    # a 93% read floor) at N = 1 and 8, each with its default launch (`norm_gate_up_launch`)
    for n in (1, 8):
        if wanted and f"dense_gate_up_nvfp4_n{n}" not in wanted:
            continue
        from flintc.kernels import nvfp4_mma

        g = torch.Generator(device="cuda").manual_seed(n)
        F, H = 10240, 2048
        pair = []
        for _ in range(2):
            codes = torch.randint(0, 256, (F, H // 2), dtype=torch.uint8, device="cuda",
                                  generator=g)
            scales = (torch.rand(F, H // 16, device="cuda", generator=g) + 0.5) \
                .to(torch.float8_e4m3fn)
            pair.append([*nvfp4_mma.pack_mma_layout(codes, scales),
                         torch.tensor(0.01, device="cuda")])
        xd = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
        nd = torch.ones(H, device="cuda")
        cases[f"dense_gate_up_nvfp4_n{n}"] = lambda xd=xd, nd=nd, pair=pair: \
            nvfp4_mma.mma_norm_gate_up(xd, nd, pair[0], pair[1], 1e-5)
    # decode attention at batch 1 (session 13): the ring of a sliding layer (513 rows, 3
    # splits) and a full layer at 1K tokens, each with its combine: why ~10-13 us per call
    # for ~1 MB of K / V (its fixed cost: 4.3 us with one visible row, session 7)
    if not wanted or {"attn_ring_b1", "attn_full1k_b1", "attn_combine_b1"} & wanted:
        import bench_decode_attention as bda

        from flintc.kernels import decode_attention as da

        ring = bda.make_case(1, bda.W, bda.W, bda.W)
        n_ring = da.choose_num_splits(bda.W, 1, window=bda.W)
        cases["attn_ring_b1"] = lambda: da.launch_decode_attention(
            ring[0], ring[1], ring[2], ring[3], ring[4], bda.W, n_ring)
        full = bda.make_case(1, 4096, 1024)
        n_full = da.choose_num_splits(262144, 1)
        cases["attn_full1k_b1"] = lambda: da.launch_decode_attention(
            full[0], full[1], full[2], full[3], full[4], 0, n_full)
        o, lse = da.launch_decode_attention(ring[0], ring[1], ring[2], ring[3], ring[4], bda.W,
                                            n_ring)
        cases["attn_combine_b1"] = lambda: da.attention_combine(o, lse, ring[5])
    if wanted:
        cases = {k: v for k, v in cases.items() if k in wanted}
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_ncu.py needs a CUDA GPU")
    import flintc.ops  # noqa: F401  (registers torch.ops.flintc)

    cases = build_cases({c for c in args.cases.split(",") if c})
    for fn in cases.values():  # compile, allocate split-K counters and workspaces
        fn()
        fn()
    torch.cuda.synchronize()
    print("profiled order:", ", ".join(cases), flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in cases.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("done", flush=True)


if __name__ == "__main__":
    main()
