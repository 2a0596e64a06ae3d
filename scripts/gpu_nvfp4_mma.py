"""The CUDA `mma.sync` NVFP4 GEMV (`flintc.kernels.nvfp4_mma`) against the Triton NVFP4
kernels, on the GPU: correctness, then time and share of copy bandwidth
(docs/gpu-runs.md, session 12).

    python scripts/gpu_nvfp4_mma.py      # on a GPU; env CASES, OPS, NS

CASES: "F,K,row_tiles,splits,warps[,prefetch] ..." raw kernel variants, fp32 out (warps
0 / no prefetch: `gemv_launch`'s, or with splits the `warps_for` rule and 2); default: the 16384 x 2048 matrix of the register-decode runs (an
asymptote), and the model's shapes. Each row: us per call by CUDA-graph replay with the
weights rotated through copies larger than the L2 (so they come from DRAM), % of the
copy bandwidth measured in the same run (bytes = codes + scales), the largest
|difference| to the fp64 reference relative to its largest |value|; with splits > 1 the
call includes zeroing `out` (the split-K blocks add into it). "triton flat" rows: the
flat swapped Triton loop of the model's kernels (`scripts/gpu_register_decode.py`, f64
k256 w4 st3) at 16384 x 2048.

OPS: "F,K ..." shapes for the model's op `gemv_residual` (O projection 2048 x 4096,
dense down 2048 x 10240) with PDL, once on the CUDA kernel and once with
FLINTC_NVFP4_MMA=0 (the Triton kernel and TUNED config the model ran before), same
weights, inputs and timing. NS: batches (default "1,8").

MOE=0 skips the MoE rows (`_moe_down_rows`, `_moe_gate_up_rows`: their variants
MOE_DOWN_CFGS / MOE_GATE_UP_CFGS ("warps,prefetch[,row_tiles[,min_blocks]]"), the formats MOE_FMTS, default nvfp4, and the routing
probe MOE_ROUTE_PROBE=1; docs/gpu-runs.md session 15; MOE_COPIES weight copies the
calls rotate through, `_copies`). MOE_CHAIN=1 adds the gate/up
variants inside the model's MoE block (router -> gate/up -> down, `_moe_chain_rows`;
session 16). The table ends with each compiled variant's registers and spill bytes.
"""

import contextlib
import ctypes
import inspect
import itertools
import os
import re
import sys

import torch
import triton

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(_ROOT, "scripts"))
from bench_moe import (
    make_weight,  # random NVFP4 experts, as the MoE benchmark makes them
)
from common import copy_bandwidth_gbs, first_call, time_graph
from gpu_register_decode import nvfp4_gemv_kernel

from flintc.kernels import fused_gemv, nvfp4_mma
from flintc.quant.nvfp4 import dequantize_packed

_DEFAULT_CASES = ("16384,2048,2,1,8 16384,2048,1,1,16 16384,2048,4,1,8 65536,2048,2,1,8 "
                  "2048,4096,1,1,16 2048,4096,1,2,16 4096,2048,1,1,16 5120,2048,1,1,16 "
                  "7168,2048,1,1,8 2048,3584,1,1,14 2048,10240,1,1,16")
_DEFAULT_OPS = "2048,4096 2048,10240"


def _func_attr(kernel, attr: int) -> int:
    lib = torch.cuda._utils._get_gpu_runtime_library()
    value = ctypes.c_int()
    lib.cuFuncGetAttribute(ctypes.byref(value), attr, kernel.func)
    return value.value


class _Mats:
    """Copies of one random NVFP4 matrix shape, together larger than the L2."""

    def __init__(self, F: int, K: int, gen: torch.Generator):
        self.copies = max(2, int(200e6 // (F * K * 0.5625)))
        raw = torch.randint(0, 127, (F, K // 16), dtype=torch.uint8, device="cuda",
                            generator=gen)  # every E4M3 value >= 0, subnormals and 0
        self.codes = [torch.randint(0, 256, (F, K // 2), dtype=torch.uint8, device="cuda",
                                    generator=gen) for _ in range(self.copies)]
        self.scales = [raw.roll(i, 0).view(torch.float8_e4m3fn) for i in range(self.copies)]
        self.gs = torch.tensor(0.0125, device="cuda")
        self.packed = [nvfp4_mma.pack_mma_layout(c, s) for c, s in zip(self.codes, self.scales)]
        self.nbytes = F * K // 2 + F * K // 16
        self.ref_w = dequantize_packed(self.codes[0], self.scales[0], self.gs, torch.float64)


def _timed(fn, copies: int) -> float:
    """us per call of fn(i), i rotating over `copies` input sets, by CUDA-graph replay;
    every set runs once first (an NVFP4 weight first seen during capture is refused)."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    turn = itertools.count()
    return 1e6 * time_graph(lambda: fn(next(turn) % copies), calls_per_replay=2 * copies)


def _fmts() -> list[str]:
    return os.environ.get("MOE_FMTS", "nvfp4").split(",")


def _gate_up_cfgs() -> list[tuple[int, int, int, int]]:
    """MOE_GATE_UP_CFGS "warps,prefetch[,row_tiles[,min_blocks]] ..." (row tiles default 1,
    min_blocks, the resident blocks per SM the registers are capped for, default 0: none)."""
    out = []
    for c in os.environ.get("MOE_GATE_UP_CFGS", "8,2 4,2 2,2").split():
        try:
            v = [int(x) for x in c.split(",")]
            if not 2 <= len(v) <= 4:
                raise ValueError
        except ValueError:
            raise SystemExit(f"MOE_GATE_UP_CFGS: expected warps,prefetch[,row_tiles[,min_blocks]]"
                             f" entries; got {c!r}") from None
        out.append(tuple(v + [1, 0][len(v) - 2:])[:4])
    return out


def _cfg_label(c) -> str:
    return f"w{c[0]} pf{c[1]} rt{c[2]}" + (f" mb{c[3]}" if c[3] else "")


def _distinct(logits: list, bias: torch.Tensor, k: int) -> float:
    """Mean distinct experts per call over the logit sets (top-k of sigmoid + bias)."""
    return sum(len(torch.unique(torch.topk(torch.sigmoid(lg) + bias, k).indices))
               for lg in logits) / len(logits)


def _copies() -> range:
    """MOE_COPIES (default 1): copies of the expert weights the MoE rows rotate through
    (a divisor of 64, the input sets). With 1, the previous call's experts can still be in
    the L2 (64 random sets share ~16% of their experts); the model's layers have their own
    weights, so several copies are closer to it."""
    n = int(os.environ.get("MOE_COPIES", "1"))
    if n < 1 or 64 % n:
        raise SystemExit(f"MOE_COPIES must divide 64, got {n}")
    return range(n)


@contextlib.contextmanager
def _patched_source(old: str, new: str):
    """Compile the MoE kernels with `old` replaced by `new` in their source (a probe:
    separate kernel cache, restored after)."""
    render, cache = nvfp4_mma._render, nvfp4_mma._KERNELS

    def patched(body, subs):
        src = render(body, subs)
        return src.replace(old, new) if old in src else src

    nvfp4_mma._render, nvfp4_mma._KERNELS = patched, {}
    try:
        yield
    finally:
        nvfp4_mma._render, nvfp4_mma._KERNELS = render, cache


# the routed blocks' routing (`route_slot_block`: the keys and the top-k rounds of every
# warp, and warp 0's merge) replaced by an id from one logit load (kept dependent on the
# logits, so on the previous kernel): what the routing costs. Session 15's run 1 replaced
# the whole `route_token` call of the code then, sessions 16-21 warp 0's rounds alone.
_ROUTE = re.search(r"const long long e = route_slot_block\([^;]*\);",
                   nvfp4_mma._MOE_GATE_UP_SOURCE).group(0)
_NO_ROUTE = ("const long long e = (__float_as_uint(ld_act_f32(logits + (size_t)n * NE + k)) >> 8)"
             " % NE;")


def _moe_down_rows(batches, gen, row) -> None:
    """`moe_down_combine_residual` (E = 256, H = 2048, I = 512, top-6 + shared), CUDA
    variants (MOE_DOWN_CFGS "warps,prefetch,splits ...") against the op (its default) and
    Triton (FLINTC_NVFP4_MMA=0); formats MOE_FMTS (default nvfp4); 64 random id sets rotate
    so the experts come from DRAM; bytes = the distinct experts' (and the shared
    expert's) weights (NVFP4: codes + scales)."""
    from flintc.kernels import moe

    E, H, I, K = 256, 2048, 512, 6
    for fmt in _fmts():
        ws = [(make_weight((E, H, I), fmt, gen), make_weight((H, I), fmt, gen))
              for _ in _copies()]
        per_expert = H * I * 2 if fmt == "bf16" else H * I // 2 + H * I // 16
        for N in batches:
            sets = 64
            ids = [torch.stack([torch.randperm(E, device="cuda", generator=gen)[:K]
                                for _ in range(N)]) for _ in range(sets)]
            distinct = sum(len(torch.unique(i)) for i in ids) / sets
            h = torch.randn(N, K + 1, I, device="cuda", generator=gen).to(torch.bfloat16)
            wts = torch.rand(N, K, device="cuda", generator=gen)
            res = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
            ref = None
            variants = [(f"{fmt} moe_down w{w} pf{pf} s{sp}", w, pf, sp) for w, pf, sp in
                        (tuple(int(v) for v in c.split(",")) for c in
                         os.environ.get("MOE_DOWN_CFGS", "8,3,1 16,2,1 32,2,1").split())]
            variants += [(f"{fmt} op moe_down_combine_residual, cuda", 0, 0, 0),
                         (f"{fmt} op moe_down_combine_residual, triton (TUNED)", -1, 0, 0)]
            for label, warps, pf, sp in variants:
                os.environ["FLINTC_NVFP4_MMA"] = "0" if warps < 0 else "1"

                def op(i, ids=ids, h=h, wts=wts, res=res, warps=warps, pf=pf, sp=sp, ws=ws):
                    down, sd = ws[i % len(ws)]
                    if warps > 0:
                        return nvfp4_mma.moe_down(h, ids[i], wts, down, sd, res, warps=warps,
                                                  prefetch=pf, splits=sp, use_pdl=True)
                    return moe.moe_down_combine_residual(h, ids[i], wts, down, sd, res,
                                                         use_pdl=True)

                y, err = first_call(lambda op=op: op(0), label)
                if err:
                    continue
                ref = y if ref is None else ref
                diff = ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
                row(2048, f"{I} x{distinct:.1f}+1", N, label, _timed(op, sets), diff,
                    (distinct + 1) * per_expert)


def _moe_gate_up_rows(batches, gen, row) -> None:
    """`moe_topk_gate_up` (E = 256, H = 2048, I = 512, top-6 + shared), CUDA (variants
    MOE_GATE_UP_CFGS "warps,prefetch[,row_tiles[,min_blocks]] ...", then the op's default) against
    Triton; formats
    MOE_FMTS; 64 random logit sets rotate; bytes = the distinct experts' gate and up
    weights. MOE_ROUTE_PROBE=1 adds the default warps with the routed blocks' top-k rounds
    replaced by one logit load (`_NO_ROUTE`: what the rounds cost)."""
    from flintc.kernels import moe

    E, H, I, K = 256, 2048, 512, 6
    for fmt in _fmts():
        ws = [tuple(make_weight(shape, fmt, gen) for shape in ((E, I, H), (E, I, H), (I, H),
                                                               (I, H))) for _ in _copies()]
        bias = torch.randn(E, device="cuda", generator=gen) * 0.05
        per_expert = 2 * (I * H * 2 if fmt == "bf16" else I * H // 2 + I * H // 16)
        for N in batches:
            sets = 64
            logits = [torch.randn(N, E, device="cuda", generator=gen) for _ in range(sets)]
            x = torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
            distinct = _distinct(logits, bias, K)
            cfgs = _gate_up_cfgs()
            variants = [(f"{fmt} moe_gate_up {_cfg_label(c)}", c[0], c[1], c[2], False, c[3])
                        for c in cfgs]
            if os.environ.get("MOE_ROUTE_PROBE") == "1":
                w0, r0 = nvfp4_mma.GATE_UP_LAUNCH[fmt][N]
                variants.append((f"{fmt} moe_gate_up w{w0} pf2 rt{r0}, no top-k (probe)", w0, 2,
                                 r0, True, 0))
            variants += [(f"{fmt} op moe_topk_gate_up, cuda", 0, 0, 0, False, 0),
                         (f"{fmt} op moe_topk_gate_up, triton (TUNED)", -1, 0, 0, False, 0)]
            ref = None
            for label, warps, pf, rows, probe, mb in variants:
                os.environ["FLINTC_NVFP4_MMA"] = "0" if warps < 0 else "1"

                def op(i, logits=logits, x=x, warps=warps, pf=pf, rows=rows, ws=ws, bias=bias,
                       mb=mb):
                    w = ws[i % len(ws)]
                    if warps > 0:
                        return nvfp4_mma.moe_topk_gate_up(x, logits[i], bias, *w, K, 2.5,
                                                          warps=warps, row_tiles=rows,
                                                          prefetch=pf, min_blocks=mb,
                                                          use_pdl=True)[0]
                    return moe.moe_topk_gate_up(x, logits[i], bias, *w, K, 2.5, use_pdl=True)[0]

                with _patched_source(_ROUTE, _NO_ROUTE) if probe else contextlib.nullcontext():
                    y, err = first_call(lambda op=op: op(0), label)
                    if err:
                        continue
                    us = _timed(op, sets)
                if probe:
                    diff = float("nan")  # other experts: not comparable
                else:
                    ref = y if ref is None else ref
                    diff = ((y.double() - ref.double()).abs().max()
                            / ref.double().abs().max()).item()
                row(f"{2 * I}", f"{H} x{distinct:.1f}+1", N, label, us, diff,
                    (distinct + 1) * per_expert)


def _moe_chain_rows(batches, gen, row) -> None:
    """The model's MoE block as it runs in the decode step, for the gate/up variants of
    MOE_GATE_UP_CFGS: `norm_router` -> `moe_topk_gate_up` (the variant) -> the default
    `moe_down_combine_residual`, chained with PDL in one CUDA graph (E = 256, H = 2048,
    I = 512, top-6 + shared; 64 random residual streams rotate): the MoE block's time per
    layer. It does not replace a model A/B: 4 row tiles at N = 8 win here (37.7 against
    38.8 us, docs/gpu-runs.md session 16 run 5) as they do alone, and lose in the model's
    step (session 15 run 7). Bytes: the router, the distinct experts' and the shared
    expert's gate, up and down weights."""
    from flintc.kernels import moe

    E, H, I, K = 256, 2048, 512, 6
    for fmt in _fmts():
        ws = [tuple(make_weight(shape, fmt, gen) for shape in ((E, I, H), (E, I, H), (I, H),
                                                               (I, H), (E, H, I), (H, I)))
              for _ in _copies()]
        bias = torch.randn(E, device="cuda", generator=gen) * 0.05
        norm = 1.0 + 0.1 * torch.randn(H, device="cuda", generator=gen)
        router = (0.05 * torch.randn(E, H, device="cuda", generator=gen)).to(torch.bfloat16)
        elem = 2 if fmt == "bf16" else 0.5 + 1 / 16
        per_expert = 3 * I * H * elem
        for N in batches:
            sets = 64
            xs = [torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
                  for _ in range(sets)]
            logits = [moe.norm_router(x, norm, router, 1e-5)[1] for x in xs]
            distinct = _distinct(logits, bias, K)
            cfgs = _gate_up_cfgs()
            variants = [(f"{fmt} chain, gate/up {_cfg_label(c)}", c[0], c[1], c[2], c[3])
                        for c in cfgs] + [(f"{fmt} chain, op defaults", 0, 0, 0, 0)]
            ref = None
            for label, warps, pf, rows, mb in variants:
                os.environ["FLINTC_NVFP4_MMA"] = "1"

                def op(i, xs=xs, warps=warps, pf=pf, rows=rows, ws=ws, norm=norm, router=router,
                       bias=bias, mb=mb):
                    *w, down, sd = ws[i % len(ws)]
                    h, lg = moe.norm_router(xs[i], norm, router, 1e-5, use_pdl=True)
                    if warps > 0:
                        hm, wts, ids = nvfp4_mma.moe_topk_gate_up(
                            h, lg, bias, *w, K, 2.5, warps=warps, row_tiles=rows, prefetch=pf,
                            min_blocks=mb, use_pdl=True, down=down)
                    else:
                        hm, wts, ids = moe.moe_topk_gate_up(h, lg, bias, *w, K, 2.5, down,
                                                            use_pdl=True)
                    return moe.moe_down_combine_residual(hm, ids, wts, down, sd, xs[i],
                                                         use_pdl=True)

                y, err = first_call(lambda op=op: op(0), label)
                if err:
                    continue
                ref = y if ref is None else ref
                diff = ((y.double() - ref.double()).abs().max()
                        / ref.double().abs().max()).item()
                row(f"{E}/{2 * I}/{H}", f"{H}/{I} x{distinct:.1f}+1", N, label,
                    _timed(op, sets), diff, E * H * 2 + (distinct + 1) * per_expert)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_nvfp4_mma.py needs a CUDA GPU")
    cases = [tuple(int(v) for v in c.split(",")) for c in
             os.environ.get("CASES", _DEFAULT_CASES).split()]
    if any(len(c) not in (5, 6) for c in cases):
        raise SystemExit(f"CASES: expected F,K,row_tiles,splits,warps[,prefetch] entries; "
                         f"got {os.environ.get('CASES')!r}")
    cases = [c + (-1,) * (6 - len(c)) for c in cases]
    ops = [tuple(int(v) for v in c.split(",")) for c in
           os.environ.get("OPS", _DEFAULT_OPS).split()]
    batches = [int(v) for v in os.environ.get("NS", "1,8").split(",")]
    copy_bw = copy_bandwidth_gbs() * 1e9
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s\n", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    mats: dict[tuple[int, int], _Mats] = {}
    rows = []

    def row(F, K, N, name, us, diff, nbytes):
        rows.append(f"| {F}x{K} | {N} | {name} | {us:.2f} | "
                    f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}% | {diff:.1e} |")
        print(rows[-1], flush=True)

    for F, K, rt, splits, warps, pf in cases:
        m = mats.setdefault((F, K), _Mats(F, K, gen))
        for N in batches:
            x = torch.randn(N, K, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.double() @ m.ref_w.T
            out = torch.zeros(N, F, device="cuda")
            dw, dp = nvfp4_mma.gemv_launch("nvfp4", F, K) if splits == 1 \
                else (nvfp4_mma.warps_for(K // splits), 2)
            name = f"cuda rt{rt} s{splits} w{warps or dw} pf{dp if pf < 0 else pf}"

            def run(i, x=x, out=out, rt=rt, splits=splits, warps=warps, m=m, pf=pf):
                if splits > 1:
                    out.zero_()
                nvfp4_mma.mma_gemv(x, *m.packed[i], m.gs, out, row_tiles=rt, splits=splits,
                                   warps=warps or None, prefetch=None if pf < 0 else pf,
                                   use_pdl=True)

            _, err = first_call(lambda run=run: run(0), f"{F}x{K} N={N} {name}")
            if err:
                rows.append(f"| {F}x{K} | {N} | {name} | failed: {err[:80]} | | |")
                continue
            diff = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            row(F, K, N, name, _timed(run, m.copies), diff, m.nbytes)
            if (F, K) == (16384, 2048) and rt == 2:
                tout = torch.empty(N, F, device="cuda")

                def trun(i, x=x, tout=tout, N=N, F=F, K=K, m=m):
                    nvfp4_gemv_kernel[(triton.cdiv(F, 64),)](
                        m.codes[i], m.scales[i], x, tout, N, F, K, BLOCK_N=16, BLOCK_F=64,
                        BLOCK_K=256, REG_DECODE=False, num_warps=4, num_stages=3)

                trun(0)
                torch.cuda.synchronize()
                tdiff = ((tout.double() * 0.0125 - ref).abs().max() / ref.abs().max()).item()
                row(F, K, N, "triton flat f64 k256 w4 st3", _timed(trun, m.copies), tdiff,
                    m.nbytes)

    for F, K in ops:
        m = mats.setdefault((F, K), _Mats(F, K, gen))
        ws = [[c, s, m.gs] for c, s in zip(m.codes, m.scales)]
        for N in batches:
            x = torch.randn(N, K, device="cuda", generator=gen).to(torch.bfloat16)
            res = torch.randn(N, F, device="cuda", generator=gen).to(torch.bfloat16)
            ref = (res.double() + (x.double() @ m.ref_w.T).to(torch.bfloat16).double())
            for label, flag in (("op gemv_residual, cuda", "1"),
                                ("op gemv_residual, triton (TUNED)", "0")):
                os.environ["FLINTC_NVFP4_MMA"] = flag

                def op(i, x=x, res=res, ws=ws):
                    return fused_gemv.gemv_residual(x, ws[i], res, use_pdl=True)

                for i in range(m.copies):  # repack every copy before capture
                    y = op(i)
                torch.cuda.synchronize()
                y = op(0)
                diff = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                row(F, K, N, label, _timed(op, m.copies), diff, m.nbytes)
    if os.environ.get("MOE", "1") != "0":
        _moe_down_rows(batches, gen, row)
        _moe_gate_up_rows(batches, gen, row)
        if os.environ.get("MOE_CHAIN") == "1":
            _moe_chain_rows(batches, gen, row)
    os.environ.pop("FLINTC_NVFP4_MMA", None)

    print("\n| F x K | N | kernel | us | % copy | max rel. diff to fp64 reference |\n"
          "|---|---|---|---|---|---|")
    print("\n".join(rows))
    for key, kern in nvfp4_mma._KERNELS.items():
        if not str(key[1]).startswith(("nvfp4_mma_gemv", "nvfp4_mma_moe")):
            continue  # (device, name, `_kernel`'s arguments); not the QKV / router kernels
        # named by `_kernel`'s parameters, so a new field cannot shift them
        a = dict(zip(inspect.signature(nvfp4_mma._kernel).parameters, key[2:]))
        print(f"cuda {key[1]} {'bf16' if a['bf16'] else 'nvfp4'} rt{a['row_tiles']} K={a['k']} "
              f"s{a['splits']} w{a['warps']} pf{a['prefetch']} epi{a['epilogue']} "
              f"pdl{int(a['pdl'])} trigger {'early' if a['trigger_early'] else 'late'} "
              f"min_blocks {a['min_blocks']} route {'block' if a['block_route'] else 'warp'} "
              f"L2 prefetch {int(a['l2_prefetch'])}: "
              f"{_func_attr(kern, 4)} registers, {_func_attr(kern, 3)} spill bytes")


if __name__ == "__main__":
    main()
