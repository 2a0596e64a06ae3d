"""The dense MLP's gate/up kernel (`flintc::norm_gate_up_silu`, kernel 5 of a dense layer)
on the GPU: the CUDA mma kernel (`nvfp4_mma.mma_norm_gate_up`) in several launches
against the Triton kernel (`fused_gemv.norm_gate_up_silu` called with the packed weights
and an explicit `gate_up_config`, which keeps it on Triton). The read floor of these
weights is `benchmarks/bench_gemv.py --floor`'s gate_up row.

    python scripts/gpu_dense_gate_up.py [--out table.md]   # on a GPU

Environment: FMTS (default "nvfp4,bf16"), NS (default "1,2,4,8"), LAUNCHES (space-separated
"warps,row_tiles,prefetch,blocks_per_sm"; default a sweep), F / H (default the model's
10240 / 2048). Each row: us per call by CUDA-graph replay (PDL on, 10 calls per replay)
with the weights rotated through copies larger than the L2 (so they come from DRAM), the
share of the copy bandwidth measured in the same run (bytes = both weights' codes and
scales, or bf16 values, plus x and h), and the largest difference to the reference op
(`flintc.ops.grouped.norm_gate_up_silu`, bf16) in bf16 ulps of the output's magnitude.
The table ends with each compiled variant's registers and spill bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
from common import copy_bandwidth_gbs, first_call, markdown_table, time_graph, write_out

from flintc.kernels import fused_gemv, nvfp4_mma
from flintc.ops import grouped

_DEFAULT_LAUNCHES = ("8,1,2,0 8,1,1,0 8,1,3,0 4,1,2,0 4,1,3,0 4,1,6,0 16,1,1,0 8,2,2,0 "
                     "4,2,2,0 8,1,2,2 8,1,2,3 4,1,3,4 4,2,2,3 16,1,1,2")


def _weights(fmt: str, F: int, H: int, copies: int, gen: torch.Generator) -> list:
    """`copies` (gate, up) pairs: NVFP4 [codes, scales, global scale] packed, or [w] bf16."""
    out = []
    for _ in range(copies):
        pair = []
        for _ in range(2):
            if fmt == "bf16":
                pair.append([(torch.randn(F, H, device="cuda", generator=gen) * 0.02)
                             .to(torch.bfloat16)])
            else:
                codes = torch.randint(0, 256, (F, H // 2), dtype=torch.uint8, device="cuda",
                                      generator=gen)
                scales = (torch.rand(F, H // 16, device="cuda", generator=gen) * 2 + 0.25) \
                    .to(torch.float8_e4m3fn)
                pair.append([codes, scales, torch.tensor(0.01, device="cuda")])
        out.append(pair)
    return out


def _ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |out - ref| in bf16 ulps at the reference's largest magnitude."""
    scale = ref.float().abs().max().item()
    ulp = 2.0 ** (torch.tensor(max(scale, 1e-30)).log2().floor().item() - 7)
    return (out.float() - ref.float()).abs().max().item() / ulp


def _settings(parser: argparse.ArgumentParser) -> tuple:
    """(formats, batches, launches, F, H) from the environment (module doc); a malformed
    variable ends the script through `parser.error` naming it (exit status 2)."""
    def ints(name: str, text: str) -> list[int]:
        try:
            return [int(v) for v in text.split(",")]
        except ValueError:
            parser.error(f"{name}: expected comma-separated integers, got {text!r}")

    fmts = [f.strip() for f in os.environ.get("FMTS", "nvfp4,bf16").split(",")]
    if not fmts or not set(fmts) <= {"nvfp4", "bf16"}:
        parser.error(f"FMTS: expected formats among nvfp4, bf16; got {os.environ['FMTS']!r}")
    ns = ints("NS", os.environ.get("NS", "1,2,4,8"))
    if not all(1 <= n <= 8 for n in ns):
        parser.error(f"NS: batches must be in 1..8, got {ns}")
    launches = [tuple(ints("LAUNCHES", w)) for w in
                os.environ.get("LAUNCHES", _DEFAULT_LAUNCHES).split()]
    if not launches or any(len(la) != 4 for la in launches):
        parser.error("LAUNCHES: expected space-separated warps,row_tiles,prefetch,"
                     f"blocks_per_sm entries, got {os.environ.get('LAUNCHES')!r}")
    sizes = []
    for name, default in (("F", "10240"), ("H", "2048")):
        v = ints(name, os.environ.get(name, default))
        if len(v) != 1 or v[0] < 1:
            parser.error(f"{name}: expected one positive integer, got {os.environ[name]!r}")
        sizes.append(v[0])
    return fmts, ns, launches, *sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="write the table (Markdown) here too")
    args = parser.parse_args()
    fmts, ns, launches, F, H = _settings(parser)
    if not torch.cuda.is_available():
        parser.exit(1, "gpu_dense_gate_up.py: needs a CUDA GPU (torch.cuda.is_available() is "
                       "False)\n")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth_gbs()
    rows = []
    for fmt in fmts:
        per = 2 * (F * H * 2 if fmt == "bf16" else F * H // 2 + F * H // 16)
        copies = max(2, int(256e6 // per) + 1)
        ws = _weights(fmt, F, H, copies, gen)
        if fmt == "nvfp4":  # the mma layout, as the runtime's prepack leaves them
            conv = [[[*nvfp4_mma.pack_mma_layout(w[0], w[1]), w[2]] for w in pair] for pair in ws]
        else:
            conv = ws
        norm = (torch.rand(H, device="cuda", generator=gen) + 0.5).float()
        for N in ns:
            x = (torch.randn(N, H, device="cuda", generator=gen) * 2).to(torch.bfloat16)
            ref = grouped.norm_gate_up_silu(x, norm, ws[0][0], ws[0][1], 1e-5)
            nbytes = per + N * H * 2 + N * F * 2
            state = {"i": 0}

            def rot(fn):
                def call():
                    i = state["i"] = (state["i"] + 1) % copies
                    return fn(i)
                return call

            cfg = fused_gemv.gate_up_config(fmt, F, H, N, x.device)
            variants = [("triton", None, rot(lambda i: fused_gemv.norm_gate_up_silu(
                x, norm, ws[i][0], ws[i][1], 1e-5, use_pdl=True, config=cfg)))]
            for la in launches:
                variants.append((f"cuda {la}", la, rot(lambda i, la=la: nvfp4_mma.mma_norm_gate_up(
                    x, norm, conv[i][0], conv[i][1], 1e-5, launch=la, use_pdl=True))))
            for name, la, fn in variants:
                state["i"] = -1
                out, err = first_call(fn, f"{fmt} N={N} {name}")
                if err:
                    rows.append([fmt, N, name, "-", "-", "-", err])
                    continue
                ulps = _ulps(out, ref)
                us = time_graph(fn) * 1e6
                gbs = nbytes / us / 1e3
                rows.append([fmt, N, name, f"{us:.2f}", f"{gbs:.0f}", f"{100 * gbs / bw:.0f}%",
                             f"{ulps:.2f}"])
        del ws, conv
        torch.cuda.empty_cache()
    regs = []
    for (index, name, *kargs), kernel in nvfp4_mma._KERNELS.items():
        if name != "nvfp4_mma_norm_gate_up":
            continue
        lib = torch.cuda._utils._get_gpu_runtime_library()
        vals = []
        for attr in (4, 3):  # CU_FUNC_ATTRIBUTE_NUM_REGS, LOCAL_SIZE_BYTES
            v = ctypes.c_int()
            lib.cuFuncGetAttribute(ctypes.byref(v), attr, kernel.func)
            vals.append(v.value)
        regs.append([str(tuple(kargs)), vals[0], vals[1]])
    text = (f"Device: {torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s; F x H = "
            f"{F} x {H}; PDL on; CUDA-graph replay, weights rotated over >= 256 MB\n\n"
            + markdown_table(["fmt", "N", "kernel (warps, row_tiles, prefetch, blocks/SM)",
                              "us", "GB/s", "% copy", "max diff (bf16 ulps)"], rows)
            + "\n\n" + markdown_table(["variant (H, warps, row_tiles, prefetch, pdl, bf16, "
                                       "norm bf16, trigger early, L2 prefetch)", "registers",
                                       "local bytes"], regs) + "\n")
    print(text)
    if args.out:
        write_out(args.out, text)


if __name__ == "__main__":
    main()
