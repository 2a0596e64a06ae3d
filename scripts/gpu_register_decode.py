"""NVFP4 decoded straight into the wgmma A-operand registers: an experiment, kept so it
can be run again (docs/gpu-runs.md, session 11 runs 1-2; it did not pay).

Two flat NVFP4 GEMV kernels with the swapped dot (out [N, F] = x [N, K] @ W [F, K]^T,
without the global scale), times by CUDA-graph replay with the weights rotated so they come
from DRAM, as a share of the copy bandwidth measured in the same run:

- "base" (`nvfp4_gemv_kernel` with REG_DECODE=False): `tiles.load_flat_tile` +
  `tiles.dot_2d(SWAP)`, the model kernels' loop; the decoded bf16 tile goes through
  shared memory on its way to the wgmma A operand;
- "regdecode" (REG_DECODE=True): the code bytes [F, K/2] decoded into the low- and
  high-nibble tiles, each the A operand of its own dot against x's even / odd columns;
  Triton then loads the bytes from shared memory straight into the A-operand layout and
  decodes them there (no bf16 tile in shared memory).

    python scripts/gpu_register_decode.py          # on a GPU; env CFGS, SHAPES, NS

CFGS: "BLOCK_F,BLOCK_K,num_warps,num_stages ..." (default "64,128,4,3 64,256,4,3");
SHAPES: "F,K ..." (default "16384,2048"); NS: batches (default "1,8"). Prints one
Markdown row per (shape, N, kernel, config): us, % of copy, max |difference| to the first
config's "base" relative to its max |value|.
"""

import itertools
import os
import sys

import torch
import triton
import triton.language as tl

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
from common import copy_bandwidth_gbs, time_graph

from flintc.kernels.tiles import (
    _DEQUANT_PTX,
    DEQUANT_UNSCALE,
    SCALE_BIAS,
    dot_2d,
    first_scales,
    load_flat_tile,
)


@triton.jit
def nvfp4_gemv_kernel(w_ptr, s_ptr, x_ptr, out_ptr, N, F, K, BLOCK_N: tl.constexpr,
                      BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, REG_DECODE: tl.constexpr):
    """out fp32 [N, F] = x bf16 [N, K] @ W^T without the global scale, W NVFP4 (codes uint8
    [F, K/2], scales float8_e4m3fn [F, K/16]); K a multiple of BLOCK_K.

    REG_DECODE=False: the model's flat swapped loop. REG_DECODE=True: the decode in the
    A-operand layout: the low and the high nibbles of the code bytes are two elementwise
    outputs of the inline asm, each the left operand of its own dot against x's even /
    odd columns (the sum over K does not care about the order), so nothing but
    elementwise ops stands between the code tile and the dot and Triton hoists the
    layout conversion onto the bytes."""
    pid = tl.program_id(0)
    offs_f = pid * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = offs_f < F
    w_rows = w_ptr + offs_f * (K // 2)
    s_rows = s_ptr + offs_f * (K // 16)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_F, BLOCK_N), dtype=tl.float32)
    if REG_DECODE:
        b = tl.arange(0, BLOCK_K // 2)
        kb = tl.arange(0, BLOCK_K // 16)
        for k0 in range(0, K, BLOCK_K):
            codes = tl.load(w_rows[:, None] + (k0 // 2 + b)[None, :], mask=mask_f[:, None],
                            other=0)
            s2 = tl.load(s_rows[:, None] + (k0 // 16 + kb)[None, :], mask=mask_f[:, None],
                         other=0.0)
            sb2 = (s2.to(tl.float32) * SCALE_BIAS).to(tl.bfloat16)
            sb = tl.reshape(tl.broadcast_to(sb2[:, :, None], (BLOCK_F, BLOCK_K // 16, 8)),
                            (BLOCK_F, BLOCK_K // 2))
            lo, hi = tl.inline_asm_elementwise(_DEQUANT_PTX, "=r,=r,=r,=r,r,r,r", [codes, sb],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                               pack=4)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None],
                        other=0.0)
            xe, xo = tl.split(tl.reshape(x, (BLOCK_N, BLOCK_K // 2, 2)))
            acc = tl.dot(lo, tl.trans(xe), acc)
            acc = tl.dot(hi, tl.trans(xo), acc)
    else:
        s_cur = first_scales(s_rows, mask_f, 0, K, BLOCK_F, BLOCK_K, True)
        for k0 in range(0, K, BLOCK_K):
            w, s_cur = load_flat_tile(w_rows, s_rows, s_cur, mask_f, k0, K, BLOCK_F, BLOCK_K,
                                      True, True, True)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None],
                        other=0.0)
            acc = dot_2d(acc, x, w, True, True)
    acc = tl.trans(acc) * DEQUANT_UNSCALE
    tl.store(out_ptr + offs_n[:, None] * F + offs_f[None, :], acc,
             mask=mask_n[:, None] & mask_f[None, :])


def _ints(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in item.split(",")) for item in text.split()]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_register_decode.py needs a CUDA GPU")
    cfgs = _ints(os.environ.get("CFGS", "64,128,4,3 64,256,4,3"))
    shapes = _ints(os.environ.get("SHAPES", "16384,2048"))
    batches = [int(v) for v in os.environ.get("NS", "1,8").split(",")]
    copy_bw = copy_bandwidth_gbs() * 1e9
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s\n")
    print("| F x K | N | kernel | config | us | % copy | rel. diff |\n|---|---|---|---|---|---|---|")
    for F, K in shapes:
        copies = max(1, int(200e6 // (F * K * 0.5625)))  # > 4x the 50 MB L2
        codes = [torch.randint(0, 256, (F, K // 2), dtype=torch.uint8, device="cuda")
                 for _ in range(copies)]
        scales = [(torch.rand(F, K // 16, device="cuda") * 2 + 0.25).to(torch.float8_e4m3fn)
                  for _ in range(copies)]
        nbytes = F * K // 2 + F * K // 16
        for N in batches:
            x = torch.randn(N, K, device="cuda").to(torch.bfloat16)
            first = None
            for name, reg in (("base", False), ("regdecode", True)):
                for bf, bk, nw, st in cfgs:
                    out = torch.empty(N, F, device="cuda")

                    def run(i, reg=reg, bf=bf, bk=bk, nw=nw, st=st, out=out, codes=codes,
                            scales=scales, x=x, N=N, F=F, K=K):
                        nvfp4_gemv_kernel[(triton.cdiv(F, bf),)](
                            codes[i], scales[i], x, out, N, F, K, BLOCK_N=16, BLOCK_F=bf,
                            BLOCK_K=bk, REG_DECODE=reg, num_warps=nw, num_stages=st)

                    try:
                        run(0)
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001  (a config that does not compile)
                        print(f"| {F}x{K} | {N} | {name} | f{bf} k{bk} w{nw} st{st} | failed: "
                              f"{type(e).__name__} | | |")
                        continue
                    result = out.clone()
                    first = result if first is None else first
                    diff = ((result - first).abs().max() / first.abs().max()).item()
                    turn = itertools.count()  # the graph's calls cycle through the copies
                    def step(run=run, turn=turn, copies=copies):
                        run(next(turn) % copies)

                    us = 1e6 * time_graph(step, calls_per_replay=2 * copies)
                    print(f"| {F}x{K} | {N} | {name} | f{bf} k{bk} w{nw} st{st} | {us:.2f} | "
                          f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
