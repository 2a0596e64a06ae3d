"""Compile the decode kernels' GPU code paths for sm_90 (H200) on a machine without a GPU.

Triton's interpreter never runs the `GPU=True` branches (inline-asm NVFP4 decode, bf16
tensor-core dots, PDL waits), so a typo or an unsupported layout there is first seen on
the H200, at the cost of device time. This script calls each launcher with CPU tensors,
captures the kernel call instead of launching it, and compiles the captured signature
with GPU=True and PDL on through `scripts/triton_aot_probe.py`'s `compile_sm90` (Triton's
full pipeline down to ptxas, no launch; pointers and 16-divisible integers specialised
as a launch would), plus the decode attention kernels' own `aot_probe_specs`. Each line
gives the probe's resource report (registers, spills, shared memory, MMA kinds). It
checks that the code compiles, not what it computes (that is the GPU tests' job).

    python scripts/sm90_compile_check.py            # every case (~2-3 min on 2 cores)
    python scripts/sm90_compile_check.py --quick    # one case per kernel and format,
                                                    # decode attention's default and the
                                                    # sampler's (CI)

Exit status: 0 when every case compiled, 1 when one failed (each failure printed with
Triton's message), 2 for bad arguments or a Triton without these compiler entry points.
Must run without TRITON_INTERPRET (the kernels would be interpreter objects); the script
clears it before importing Triton. Uses the installed Triton (3.9 here; the H200 has
3.6), whose code can differ a lot from what runs there: for register counts and loop
lengths that match the H200, run it with triton 3.6 on the path (`pip install --no-deps
--target /tmp/tri36 triton==3.6.0`, then `PYTHONPATH=/tmp/tri36 python
scripts/sm90_compile_check.py`; see `triton_aot_probe.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

try:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from triton_aot_probe import compile_sm90 as _probe_compile  # noqa: E402
    from triton_aot_probe import format_report, report  # noqa: E402
except ImportError as e:  # pragma: no cover (an old or changed Triton)
    print(f"sm90_compile_check: this Triton ({triton.__version__}) lacks {e.name}", file=sys.stderr)
    sys.exit(2)

TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8", torch.int32: "i32",
         torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float16: "fp16"}


class _Capture:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kw)` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def capture(module, name: str, call):
    """(args, kwargs) of the first launch of `module.<name>` made by `call()`."""
    kern = getattr(module, name)
    cap = _Capture()
    setattr(module, name, cap)
    try:
        call()
    finally:
        setattr(module, name, kern)
    if not cap.calls:
        raise RuntimeError(f"{name} was not launched (the launcher took another path)")
    return kern, cap.calls[0]


def compile_sm90(kern, args, kw, num_warps: int, num_stages: int, maxnreg: int | None = None):
    """Compile the captured call for sm_90 with GPU=True and PDL on (USE_PDL=1) and the
    register cap `maxnreg` (None: none); returns Triton's CompiledKernel."""
    kw = dict(kw)
    for k in ("num_warps", "num_stages", "launch_pdl", "maxnreg"):
        kw.pop(k, None)
    kw["GPU"] = True
    if "USE_PDL" in kw:
        kw["USE_PDL"] = 1
    vals = dict(zip(kern.arg_names, args))
    vals.update(kw)
    sig, consts, divisible = {}, {}, []
    for name, p in zip(kern.arg_names, kern.params):
        v = vals.get(name, p.default)
        if p.is_constexpr:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32"
            if v % 16 == 0:  # a launch specialises such integers too
                divisible.append(name)
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"argument {name}: {type(v).__name__}")
    return _probe_compile(kern, sig, consts, num_warps, num_stages, divisible, maxnreg=maxnreg)


def _weight(F: int, K: int, fmt: str, gen):
    from flintc.quant.nvfp4 import quantize

    w = (torch.randn(F, K, generator=gen) * 0.05).to(torch.bfloat16)
    if fmt == "bf16":
        return [w]
    q = quantize(w, use_global_scale=True)
    return [q.codes, q.scales, q.global_scale]


def n1(cfg) -> int | None:
    """Rows of the decode batch a case compiles for: 1 for the FMA whole-tile accumulator
    (`acc_full`, TUNED only at N = 1; at N = 8 its accumulator would not fit in registers
    and the report would show a stack instead), else all 8 (None: no slicing)."""
    return 1 if cfg.acc_full and not cfg.use_dot else None


def cases(quick: bool):
    """(label, module, kernel name, launcher call, config) for every case: decode batch
    N = 8, or 1 for the FMA whole-tile accumulator configurations (`n1`)."""
    from flintc.kernels import fused_gemv as FG
    from flintc.kernels import gemv as G
    from flintc.kernels import moe as M
    from flintc.model.ops import rope_tables

    gen = torch.Generator().manual_seed(0)
    GC, MC = G.GemvConfig, M.MoeConfig
    out = []
    for fmt in ("bf16", "nvfp4"):
        N, H, D, HQ, HKV = 8, 2048, 128, 32, 4
        x = torch.randn(N, 4096, generator=gen).to(torch.bfloat16)
        w = _weight(2048, 4096, fmt, gen)
        gemv_cfgs = [GC(use_dot=True, block_f=64, block_k=256, split_k=8, num_warps=4,
                        num_stages=3, prefetch=False, flat=True, swap=True)]
        if not quick:
            gemv_cfgs += [GC(use_dot=True, block_f=64, block_k=128, split_k=16, num_warps=4,
                             num_stages=3, prefetch=False, flat=True),
                          GC(use_dot=True, block_f=64, block_k=128, split_k=4, num_warps=4,
                             num_stages=1, prefetch=True, swap=True),
                          GC(use_dot=False, block_f=32, block_k=256, split_k=8, num_warps=4,
                             num_stages=1, prefetch=True, acc_full=True)]
        for cfg in gemv_cfgs:
            out.append((f"gemv {fmt} {cfg.short()}", G, "gemv_kernel",
                        lambda x=x[:n1(cfg)], w=w, cfg=cfg: G.gemv(x, w, config=cfg), cfg))
        xh = torch.randn(N, 1, H, generator=gen).to(torch.bfloat16)
        norm = torch.rand(H, generator=gen) + 0.5
        wq, wk, wv = (_weight(HQ * D, H, fmt, gen), _weight(HKV * D, H, fmt, gen),
                      _weight(HKV * D, H, fmt, gen))
        # q_norm fp32 and k_norm bf16: the launcher takes each in either dtype, and a
        # kernel that picked one pointer for both by branch did not compile (session 30)
        qn = torch.rand(D, generator=gen) + 0.5
        kn = (torch.rand(D, generator=gen) + 0.5).to(torch.bfloat16)
        cos, sin = rope_tables(10000.0, D, 4096, torch.float32)
        kc = torch.zeros(2, 513, HKV, D, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        slots = torch.zeros(N, dtype=torch.int64)
        pos = torch.arange(N, dtype=torch.int64).view(N, 1)
        qkv_cfgs = [GC(use_dot=True, block_f=D, block_k=128, split_k=8, num_warps=8,
                       num_stages=3, prefetch=False, flat=True, swap=fmt == "nvfp4")]
        if not quick:
            qkv_cfgs += [GC(use_dot=True, block_f=D, block_k=128, split_k=8, num_warps=8,
                            num_stages=1, prefetch=True)]
        for cfg in qkv_cfgs:
            out.append((f"norm_qkv_rope_kv {fmt} {cfg.short()}", FG, "norm_qkv_rope_kv_kernel",
                        lambda cfg=cfg, args=(xh, norm, wq, wk, wv, qn, kn, cos, sin, kc, vc,
                                              slots, pos), hq=HQ, hkv=HKV:
                        FG.norm_qkv_rope_kv(*args, 1e-6, hq, hkv, True, 513, config=cfg), cfg))
        gate, up = _weight(10240, H, fmt, gen), _weight(10240, H, fmt, gen)
        mlp_cfgs = [GC(use_dot=True, block_f=32, block_k=128, split_k=1, num_warps=4,
                       num_stages=3, prefetch=False, flat=True, swap=fmt == "bf16")]
        if not quick:
            mlp_cfgs += [GC(use_dot=False, block_f=16, block_k=256, split_k=1, num_warps=4,
                            num_stages=1, prefetch=True, acc_full=True)]
        for cfg in mlp_cfgs:
            out.append((f"norm_gate_up_silu {fmt} {cfg.short()}", FG, "norm_gate_up_silu_kernel",
                        lambda cfg=cfg, gate=gate, up=up, xh=xh[:n1(cfg)], norm=norm:
                        FG.norm_gate_up_silu(xh, norm, gate, up, 1e-6, config=cfg), cfg))
        E, F, K = 16, 512, 6
        experts = [(_weight(F, H, fmt, gen), _weight(F, H, fmt, gen), _weight(H, F, fmt, gen))
                   for _ in range(E)]

        def stack(i, experts=experts):
            parts = [e[i] for e in experts]
            return [torch.stack([p[j] for p in parts]) for j in range(len(parts[0]))]
        g_e, u_e, d_e = stack(0), stack(1), stack(2)
        sg, su, sd = _weight(F, H, fmt, gen), _weight(F, H, fmt, gen), _weight(H, F, fmt, gen)
        logits = torch.randn(N, E, generator=gen)
        bias = torch.zeros(E)
        h = torch.randn(N, K + 1, F, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
        wts = torch.rand(N, K, generator=gen)
        res = torch.randn(N, H, generator=gen).to(torch.bfloat16)
        xm = torch.randn(N, H, generator=gen).to(torch.bfloat16)
        moe_cfgs = [MC(block_rows=64, block_k=128, split=2, num_warps=4, num_stages=3, flat=True,
                       swap=fmt == "nvfp4"),
                    MC(block_rows=64, block_k=128, split=1, num_warps=4, num_stages=3, flat=True,
                       maxnreg=128)]
        if not quick:
            moe_cfgs += [MC(block_rows=64, block_k=128, split=1, num_warps=4, num_stages=3,
                            flat=True),
                         MC(block_rows=64, block_k=128, split=1, num_warps=8, num_stages=3),
                         MC(block_rows=32, block_k=128, split=4, use_dot=False, num_warps=4,
                            num_stages=1, prefetch=True, acc_full=True)]
        for cfg in moe_cfgs:
            out.append((f"moe gate_up {fmt} {cfg.short()}", M, "gate_up_kernel",
                        lambda cfg=cfg, a=(xm[:n1(cfg)], logits[:n1(cfg)], bias, g_e, u_e, sg, su), k=K:
                        M.moe_topk_gate_up(*a, k, 2.5, config=cfg), cfg))
            out.append((f"moe down {fmt} {cfg.short()}", M, "down_kernel",
                        lambda cfg=cfg, a=(h[:n1(cfg)], ids[:n1(cfg)], wts[:n1(cfg)], d_e, sd,
                                           res[:n1(cfg)]):
                        M.moe_down_combine_residual(*a, config=cfg), cfg))
    # the prefill chunk's routing on CUDA (grouped_gemm.moe_route): 4,096 tokens, 256 experts
    logits = torch.randn(4096, 256, generator=gen)
    launch = types.SimpleNamespace(num_warps=4, num_stages=1)  # route_topk_rows's launch
    out.append(("prefill route_topk_rows N=4096 E=256", M, "topk_kernel",
                lambda logits=logits: M.route_topk_rows(logits, torch.zeros(256), 6, 2.5), launch))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one configuration per kernel and format (the CI test)")
    args = parser.parse_args()
    import flintc.ops  # noqa: F401  (registers torch.ops.flintc)

    from flintc.kernels import decode_attention as DA

    from flintc.kernels import sampler as SK

    specs = DA.aot_probe_specs()
    if args.quick:  # the default launch configuration, the ring > W mask, a ring's early
        # reads (PRELOAD), a ring with the combine in the launch (FUSE_COMBINE), the combine
        specs = [specs[0]] + [s for s in specs if s["name"].startswith(
            ("decode_attention ring > W", "decode_attention ring preload",
             "decode_attention ring fused combine"))] + [specs[-1]]
    # the one-launch sampler (FLINTC_SAMPLER=triton): top_k <= 32 (quick), and <= 64
    specs += SK.aot_probe_specs()[:1] if args.quick else SK.aot_probe_specs()
    fails = 0
    for label, module, name, call, cfg in cases(args.quick) + [(s["name"], None, None, s, None)
                                                             for s in specs]:
        t = time.time()
        try:
            if module is None:  # an aot_probe_specs spec (decode attention, sampler)
                k = _probe_compile(call["fn"], call["signature"], call["constexprs"],
                                   call.get("num_warps", 4), call.get("num_stages", 3),
                                   call.get("divisible", ()))
            else:
                kern, (a, kw) = capture(module, name, call)
                k = compile_sm90(kern, a, kw, cfg.num_warps, cfg.num_stages,
                                 getattr(cfg, "maxnreg", None))
            line = format_report(label, report(k))
            print(f"ok    {line} ({time.time() - t:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001  (report every failing case, then exit 1)
            fails += 1
            print(f"FAIL  {label}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
    print(f"{fails} of the cases failed to compile for sm_90" if fails else
          "every case compiled for sm_90", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
