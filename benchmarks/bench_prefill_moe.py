"""Prefill MoE and dense GEMMs on the full model's shapes (GPU only).

For bf16 and NVFP4 weights (packed, or "nvfp4-mma": in the mma layout the runtime keeps on
CUDA) and N in {512, 2048, 8192} chunk tokens:

* MoE layer (H=2048, E=256 experts of F=512, top-6, one shared expert): time of
  `moe_route`, `moe_gate_up`, `moe_down_combine` and their sum, per implementation
  (`triton`, and `grouped_mm` for bf16), with achieved TFLOP/s of the useful work
  (router 2*N*E*H, routed 6*N*K*F*H, shared 6*N*F*H) and its share of the bf16 peak,
  measured here as `torch.mm` of 8192^3 bf16 matrices; also the minimum HBM bytes (every
  expert's weights once) and the time they need at the measured copy bandwidth.
* The reference ops (`torch.ops.flintc.moe_gate_up` / `moe_down_combine`, which gather an
  expert matrix per (token, k)) where their estimated memory fits in free GPU memory.
* Dense prefill GEMMs of the model's shapes (`flintc.kernels.gemm.gemm`, fp32-output
  "precise" and, for bf16, bf16-output cuBLAS), TFLOP/s and share of peak.

Timing: CUDA-graph replay (`benchmarks/common.py: time_graph`); a function that cannot be
captured (a host sync) falls back to CUDA-event timing of eager calls, marked "eager".
NVFP4 weights are random codes and block scales (the quantizer would take minutes on the
CPU at these sizes; timing does not depend on the values).

    python benchmarks/bench_prefill_moe.py [--out prefill_moe.md] [--tokens 512 2048 8192]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch

try:
    from common import copy_bandwidth_gbs, markdown_table, time_graph, write_out
except ImportError:  # run from the repository root with PYTHONPATH=$PWD
    from benchmarks.common import (
        copy_bandwidth_gbs,
        markdown_table,
        time_graph,
        write_out,
    )

H, E, F, TOPK, SCALING = 2048, 256, 512, 6, 2.5
# [F, K] weights of the model's prefill GEMMs (dense layers and attention).
DENSE_SHAPES = [(4096, 2048, "q_proj"), (512, 2048, "k_proj / v_proj"), (2048, 4096, "o_proj"),
                (10240, 2048, "dense gate / up"), (2048, 10240, "dense down"),
                (512, 2048, "shared expert gate / up"), (2048, 512, "shared expert down")]


def events_time(fn, reps: int = 10) -> float:
    """Median seconds of eager calls, CUDA events (includes CPU launch gaps and syncs)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def timed(fn) -> tuple[float, str]:
    """(seconds per call, how): graph replay when capturable, else eager events."""
    try:
        return time_graph(fn, warmup=3, iters=10, calls_per_replay=3), "graph"
    except Exception as exc:  # noqa: BLE001 - a capture failure (host sync) is expected for some
        torch.cuda.synchronize()
        print(f"  (not capturable: {type(exc).__name__}: {str(exc)[:80]}; eager timing)",
              file=sys.stderr)
        return events_time(fn), "eager"


def bf16_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    s, _ = timed(functools.partial(torch.mm, a, b))
    return 2 * 8192**3 / s / 1e12


def random_weight(shape, fmt: str) -> list[torch.Tensor]:
    """bf16 N(0, 0.02), or NVFP4 with random codes, block scales in [2^-4, 2^-1] and a
    global scale per matrix (per expert for a stack); "nvfp4-mma": the same NVFP4 weight
    converted to the mma layout of the CUDA decode kernels, as the runtime holds it
    (`flintc.kernels.nvfp4_mma.prepack`)."""
    if fmt == "nvfp4-mma":
        from flintc.kernels.nvfp4_mma import pack_mma_stack

        codes, scales, gs = random_weight(shape, "nvfp4")
        return [*pack_mma_stack(codes, scales), gs]
    if fmt == "bf16":
        return [(torch.randn(*shape, device="cuda") * 0.02).to(torch.bfloat16)]
    *lead, rows, k = shape
    codes = torch.randint(0, 256, (*lead, rows, k // 2), dtype=torch.uint8, device="cuda")
    scales = torch.exp2(torch.randint(-4, 0, (*lead, rows, k // 16), device="cuda").float())
    scales = scales.to(torch.float8_e4m3fn)
    gs = (torch.rand(*lead, device="cuda") * 0.01 + 0.005) if lead else torch.tensor(0.007, device="cuda")
    return [codes, scales, gs.float()]


def moe_rows(fmt: str, tokens, peak: float, copy_gbs: float, impls) -> list[list]:
    from flintc.kernels import grouped_gemm as GG

    gate, up = random_weight((E, F, H), fmt), random_weight((E, F, H), fmt)
    down = random_weight((E, H, F), fmt)
    sg, su, sd = random_weight((F, H), fmt), random_weight((F, H), fmt), random_weight((H, F), fmt)
    router = (torch.randn(E, H, device="cuda") * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.01
    w_bytes = sum(t.numel() * t.element_size() for w in (gate, up, down, sg, su, sd) for t in w)
    rows = []
    for N in tokens:
        x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
        weights, ids = GG.moe_route(x, router, bias, TOPK, SCALING)
        flops = 2 * N * E * H + 6 * N * TOPK * F * H + 6 * N * F * H
        t_route, how_r = timed(functools.partial(GG.moe_route, x, router, bias, TOPK, SCALING))
        for impl in impls:
            if impl == "grouped_mm" and fmt != "bf16":
                continue
            gate_up = functools.partial(GG.moe_gate_up, x, ids, gate, up, sg, su, impl=impl)
            h = gate_up()
            t_gu, how_g = timed(gate_up)
            t_dc, how_d = timed(functools.partial(GG.moe_down_combine, h, ids, weights, down, sd,
                                                  impl=impl))
            total = t_route + t_gu + t_dc
            hows = {how_r, how_g, how_d}
            rows.append([fmt, N, impl, f"{t_route * 1e6:.0f}", f"{t_gu * 1e6:.0f}",
                         f"{t_dc * 1e6:.0f}", f"{total * 1e6:.0f}", f"{flops / total / 1e12:.0f}",
                         f"{100 * flops / total / 1e12 / peak:.1f}%",
                         f"{w_bytes / (copy_gbs * 1e9) * 1e6:.0f}", "/".join(sorted(hows))])
            print("| " + " | ".join(str(c) for c in rows[-1]) + " |", flush=True)
            del h
        # The reference ops, where their gathered weights fit: fp32 [N, K, F, H] per
        # matmul, ~3 of them alive at once (bf16), ~6 (NVFP4 decode temporaries).
        need = N * TOPK * F * H * 4 * (3 if fmt == "bf16" else 6)
        free, _ = torch.cuda.mem_get_info()
        if need < 0.7 * free:
            try:
                ref_gate_up = functools.partial(torch.ops.flintc.moe_gate_up, x, ids, gate, up, sg, su)
                h_ref = ref_gate_up()
                t_gu = events_time(ref_gate_up, 3)
                t_dc = events_time(functools.partial(torch.ops.flintc.moe_down_combine, h_ref, ids,
                                                     weights, down, sd), 3)
                total = t_route + t_gu + t_dc
                rows.append([fmt, N, "reference op", f"{t_route * 1e6:.0f}", f"{t_gu * 1e6:.0f}",
                             f"{t_dc * 1e6:.0f}", f"{total * 1e6:.0f}",
                             f"{flops / total / 1e12:.1f}", f"{100 * flops / total / 1e12 / peak:.2f}%",
                             "-", "eager"])
                print("| " + " | ".join(str(c) for c in rows[-1]) + " |", flush=True)
                del h_ref
            except torch.OutOfMemoryError:
                rows.append([fmt, N, "reference op", "OOM", "", "", "", "", "", "-", "eager"])
            torch.cuda.empty_cache()
        else:
            rows.append([fmt, N, "reference op", f"skipped (needs ~{need / 2**30:.0f} GiB)",
                         "", "", "", "", "", "-", "-"])
    return rows


def dense_rows(fmt: str, tokens, peak: float) -> list[list]:
    from flintc.kernels.gemm import gemm

    rows = []
    for Fo, K, name in DENSE_SHAPES:
        w = random_weight((Fo, K), fmt)
        for N in tokens:
            x = torch.randn(N, K, device="cuda").to(torch.bfloat16)
            flops = 2 * N * Fo * K
            variants = [("fp32 out (precise)", functools.partial(gemm, x, w))]
            if fmt == "bf16":
                variants.append(("bf16 out", functools.partial(gemm, x, w, precise=False)))
            for label, fn in variants:
                s, how = timed(fn)
                rows.append([name, f"{Fo}x{K}", fmt, N, label, f"{s * 1e6:.1f}",
                             f"{flops / s / 1e12:.0f}", f"{100 * flops / s / 1e12 / peak:.0f}%", how])
                print("| " + " | ".join(str(c) for c in rows[-1]) + " |", flush=True)
        del w
        torch.cuda.empty_cache()
    return rows


def sweep_rows(fmt: str, tokens, copy_gbs: float) -> list[list]:
    """Block sweep of the Triton grouped GEMM (`GG.BLOCKS_OVERRIDE`): gate/up and down
    each timed alone per `GG.GroupedConfig` candidate: BLOCK_M 16 and 32 (32 and 64 above
    1,024 tokens), BLOCK_F and BLOCK_K 64 / 128, K order, 4 warps (and 8 for bf16 from
    BLOCK_M 32), 2 stages NVFP4 / 3 bf16; plus SWAP at BLOCK_F == BLOCK_M, the other stage
    count, and the rule's own pick."""
    from flintc.kernels import grouped_gemm as GG

    gate, up = random_weight((E, F, H), fmt), random_weight((E, F, H), fmt)
    down = random_weight((E, H, F), fmt)
    sg, su, sd = random_weight((F, H), fmt), random_weight((F, H), fmt), random_weight((H, F), fmt)
    router = (torch.randn(E, H, device="cuda") * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 0.01
    rows = []
    for N in tokens:
        x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
        weights, ids = GG.moe_route(x, router, bias, TOPK, SCALING)
        h = GG.moe_gate_up(x, ids, gate, up, sg, su, impl="triton")
        bms = (16, 32) if N <= 1024 else (32, 64)
        st = 2 if fmt.startswith("nvfp4") else 3
        cands = [None] + [GG.GroupedConfig(bm, bf, bk, w, st, True, False) for bm in bms
                          for bf in (64, 128) for bk in (64, 128)
                          for w in ((4, 8) if fmt == "bf16" and bm >= 32 else (4,))]
        cands += [GG.GroupedConfig(64, 64, 64, 4, st, True, True),  # SWAP (F == M compiles)
                  GG.GroupedConfig(32, 32, 64, 4, st, True, True),
                  GG.GroupedConfig(32, 128, 64, 4, 5 - st, True, False)]  # the other stages
        for op, fn in (("gate_up", functools.partial(GG.moe_gate_up, x, ids, gate, up, sg, su,
                                                     impl="triton")),
                       ("down_combine", functools.partial(GG.moe_down_combine, h, ids, weights,
                                                          down, sd, impl="triton"))):
            best = None
            for cand in cands:
                GG.BLOCKS_OVERRIDE = cand
                try:
                    s, _ = timed(fn)
                except Exception as exc:  # noqa: BLE001 - out of shared memory etc.
                    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
                    why = " / ".join(lines[:1] + lines[-2:])[:400]  # the cause is at the end
                    print(f"  {op} {cand}: {type(exc).__name__}: {why}", file=sys.stderr)
                    continue
                finally:
                    GG.BLOCKS_OVERRIDE = None
                label = "rule" if cand is None else "m{} f{} k{} w{} st{}{}{}".format(
                    *cand[:5], "" if cand.k_order else " even/odd", " swap" if cand.swap else "")
                if best is None or s < best[0]:
                    best = (s, label)
                rows.append([fmt, N, op, label, f"{s * 1e6:.0f}"])
                print("| " + " | ".join(str(c) for c in rows[-1]) + " |", flush=True)
            rows.append([fmt, N, op, f"**best: {best[1]}**", f"**{best[0] * 1e6:.0f}**"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the Markdown report to this file")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--impls", nargs="+", default=["triton", "grouped_mm"],
                        choices=["triton", "grouped_mm", "loop"])
    parser.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"],
                        choices=["bf16", "nvfp4", "nvfp4-mma"])
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--sweep", action="store_true",
                        help="only the Triton grouped GEMM's block sweep (BLOCKS_OVERRIDE)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill_moe needs a CUDA GPU")

    import flintc.ops  # noqa: F401  (registers torch.ops.flintc.* for the reference rows)

    peak = bf16_peak_tflops()
    copy_gbs = copy_bandwidth_gbs()
    head = (f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; bf16 peak "
            f"(torch.mm 8192^3, measured) {peak:.0f} TFLOP/s; copy bandwidth {copy_gbs:.0f} GB/s")
    print(head, flush=True)
    if args.sweep:
        rows = []
        for fmt in args.formats:
            rows += sweep_rows(fmt, args.tokens, copy_gbs)
        text = "\n".join([head, "", "## Triton grouped GEMM block sweep, us per call", "",
                          markdown_table(["fmt", "N", "op", "blocks", "us"], rows)])
        print(text)
        write_out(args.out, text)
        return
    moe = []
    for fmt in args.formats:
        moe += moe_rows(fmt, args.tokens, peak, copy_gbs, args.impls)
        torch.cuda.empty_cache()
    parts = [head, "", "## MoE layer (route + gate_up + down_combine), times in us", "",
             markdown_table(["fmt", "N", "impl", "route", "gate_up", "down_combine", "total",
                             "TFLOP/s", "% bf16 peak", "weights once at copy BW (us)", "timing"],
                            moe)]
    if not args.skip_dense:
        dense = []
        for fmt in args.formats:
            dense += dense_rows(fmt, args.tokens, peak)
        parts += ["", "## Dense prefill GEMMs (flintc.kernels.gemm.gemm)", "",
                  markdown_table(["weight", "F x K", "fmt", "N", "variant", "us", "TFLOP/s",
                                  "% bf16 peak", "timing"], dense)]
    text = "\n".join(parts)
    print(text)
    write_out(args.out, text)


if __name__ == "__main__":
    main()
