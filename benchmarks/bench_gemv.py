"""GEMV bandwidth of the decode schedule's kernels on the model's shapes (GPU only).

Measures the device-to-device copy bandwidth first (the practical ceiling, same run), then
for each case (a plain GEMV or one of the fused ops of `flintc.kernels.fused_gemv`),
weight format (bf16 / NVFP4) and batch N in {1, 2, 4, 8}:
- flintc: the Triton launcher with its default configuration (`choose_config` /
  `qkv_config`), timed by CUDA-graph replay (`triton.testing.do_bench_cudagraph`, median);
  NVFP4 `gemv` / `gemv_residual` on sm_90+ run the CUDA kernel of `flintc.kernels.nvfp4_mma`
  there, as in the model (FLINTC_NVFP4_MMA=0: Triton; `--sweep` times Triton configs);
- eager: the reference op `torch.ops.flintc.<op>` (plain torch: fp32 upcast / dequantize,
  not a fast path, a sanity line);
- torch bf16: the op's fast plain-torch expression (`torch_baselines.py`: bf16 GEMMs on
  cuBLAS, NVFP4 dequantized to bf16 on every call, norms and RoPE in fp32), what a
  PyTorch user gets without custom kernels; graph-replayed over the same rotated weights;
- compile: `torch.compile` of that expression (default mode, compiled afresh for each row:
  `torch_baselines.compile_fresh`; before session 36 this column compiled the fp32
  expression, and rows past Dynamo's limit of 8 variants timed it eagerly), graph-replayed;
- mul-sum (plain GEMVs, `gemv` / `gemv_residual` cases): `torch.compile` of the GEMV
  written as a multiply-and-sum over K (`torch_baselines.linear_mulsum`: fp32 products,
  the NVFP4 decode inside the expression), which Inductor fuses into one reduction
  kernel over the packed weight instead of writing a bf16 copy before a GEMM;
  "vs compile" = the faster compiled form's us / flintc us;
and prints the achieved GB/s (bytes = weights + activations in and out + cache rows) and
its share of the copy bandwidth.

With `--floor` each row also gets the case's read floor (`read_floor.weight_floor`: a
kernel that only reads the weights, every load issued before the PDL wait, best of
`read_floor.LAUNCHES`, timed the same way over the same rotated copies) as a share of the copy
bandwidth with the row's bytes: the most the op could reach (issue 5 asks 70% of the large
GEMVs). Not for `qkv` (three matrices of two sizes).

With `--sweep` each flintc case also times every candidate of `sweep_configs` and reports
the best; at the end it prints `TUNED` entries to paste into `flintc/kernels/gemv.py`
(keys as documented at `TUNED`).

    python benchmarks/bench_gemv.py [--sweep] [--pdl] [--floor] [--no-compile] [--out gemv.md]
        [--cases q_proj,qkv]
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch

H, HQ, HKV, D, FFN, VOCAB, WINDOW = 2048, 32, 4, 128, 10240, 151552, 513
BATCHES = [1, 2, 4, 8]
FORMATS = ["bf16", "nvfp4"]  # --formats


def kernel_ms(fn, reps: int) -> float:
    """Median device time of `fn` in ms from CUDA-graph replays (decode runs from graphs)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="median")


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (`benchmarks/common.py`: 1 GiB, after warm-up
    copies, median of CUDA-event timings). The earlier graph-replayed copy of a freshly
    allocated, never-written buffer read 2715-2771 GB/s on the H200 where every other
    benchmark of the same call read ~4210 (session 4, runs 1-2): it under-stated the
    ceiling, so those runs' "% copy" columns are too high by a factor ~1.55."""
    from common import copy_bandwidth_gbs as measured

    return measured()


def make_weight(F: int, K: int, fmt: str) -> list[torch.Tensor]:
    from flintc.quant.nvfp4 import quantize

    w = (torch.randn(F, K, device="cuda") * 0.05).to(torch.bfloat16)
    if fmt == "bf16":
        return [w]
    q = quantize(w.cpu())
    return [q.codes.cuda(), q.scales.cuda(), q.global_scale.cuda()]


def nbytes(*ts) -> int:
    total = 0
    for t in ts:
        if isinstance(t, (list, tuple)):
            total += nbytes(*t)
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


ROTATE_BYTES = 256 << 20  # weight copies cycled per call: > 5x the H200's 50 MB L2


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    return type(obj)(_clone(o) for o in obj)


class Rotation:
    """Copies of a group of weights, handed out in turn (`next()`), so that consecutive
    launches in the timed CUDA graph read different memory: `triton.testing.
    do_bench_cudagraph` does not flush the L2 cache, and every decode weight but the LM
    head fits in the H200's 50 MB L2, so without rotation the kernels would be timed on
    L2-resident weights (sessions 1-5 did: their bench_gemv "% copy" of shapes under
    ~50 MB are L2 figures). `ROTATE_BYTES` of copies at most 64; 1 copy with ROTATE off."""

    def __init__(self, group):
        self.first = group
        n = 1 if not ROTATE else max(1, min(64, -(-ROTATE_BYTES // max(nbytes(group), 1))))
        self.copies = [group] + [_clone(group) for _ in range(n - 1)]
        self.i = 0

    def next(self):
        g = self.copies[self.i % len(self.copies)]
        self.i += 1
        return g


class Case:
    """One benchmark row family: builds inputs for (fmt, N) and returns the callables."""

    def __init__(self, name, F, K, fmts, kind):
        self.name, self.F, self.K, self.fmts, self.kind = name, F, K, fmts, kind

    def build(self, fmt: str, N: int):
        """-> (ours(cfg=None), eager(), fast, fast_args(), bytes moved, TUNED key, rows
        fixed): flintc's launcher on the next rotated weights, the reference op, the fast
        plain-torch expression of `torch_baselines` and a callable giving its arguments
        (the next rotated weights: the torch columns read DRAM as flintc's does)."""
        from flintc.kernels import fused_gemv as fg
        from flintc.model import ops
        import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
        import torch_baselines as TB

        F32 = torch.float32

        F, K = self.F, self.K
        x = torch.randn(N, K, device="cuda").to(torch.bfloat16)
        self.rot = None  # the weights' Rotation, for `--floor` (1-2 equal-size matrices)
        self.mulsum = None  # (expression, arguments) of the multiply-and-sum form, plain GEMVs
        if self.kind == "gemv":
            w = make_weight(F, K, fmt)
            rot = self.rot = Rotation(w)
            ours = lambda cfg=None: fg.gemv(x, rot.next(), use_pdl=PDL, config=cfg)  # noqa: E731
            eager = lambda: torch.ops.flintc.gemv(x, w)  # noqa: E731
            self.mulsum = (TB.linear_mulsum, lambda: (x, rot.next()))
            return (ours, eager, TB.linear, lambda: (x, rot.next()), nbytes(w, x) + 2 * N * F,
                    (fmt, F, K, N), None)
        if self.kind == "gemv_residual":
            w = make_weight(F, K, fmt)
            res = torch.randn(N, F, device="cuda").to(torch.bfloat16)
            rot = self.rot = Rotation(w)
            ours = lambda cfg=None: fg.gemv_residual(x, rot.next(), res, use_pdl=PDL, config=cfg)  # noqa: E731
            eager = lambda: torch.ops.flintc.gemv_residual(x, w, res)  # noqa: E731
            fast = lambda x, w, r: ops.residual_add(r, TB.linear(x, w), F32)  # noqa: E731
            self.mulsum = (lambda x, w, r: ops.residual_add(r, TB.linear_mulsum(x, w), F32),
                           lambda: (x, rot.next(), res))
            return (ours, eager, fast, lambda: (x, rot.next(), res), nbytes(w, x, res) + 2 * N * F,
                    (fmt, F, K, N), None)
        norm = torch.rand(K, device="cuda") + 0.5
        if self.kind == "gate_up":
            g, u = make_weight(F, K, fmt), make_weight(F, K, fmt)
            rot = self.rot = Rotation([g, u])
            ours = lambda cfg=None: fg.norm_gate_up_silu(x, norm, *rot.next(), 1e-5, use_pdl=PDL, config=cfg)  # noqa: E731
            eager = lambda: torch.ops.flintc.norm_gate_up_silu(x, norm, g, u, 1e-5)  # noqa: E731

            def fast(x, norm, gu):
                h = ops.rms_norm(x, norm, 1e-5, F32)
                return ops.silu_mul(TB.linear(h, gu[0]), TB.linear(h, gu[1]), F32)
            return (ours, eager, fast, lambda: (x, norm, rot.next()), nbytes(g, u, x, norm) + 2 * N * F,
                    ("gate_up:" + fmt, F, K, N), None)
        if self.kind == "lm_head_plain":  # the LM head without the final RMSNorm
            w = make_weight(F, K, "bf16")[0]
            rot = self.rot = Rotation([w])
            ours = lambda cfg=None: fg.lm_head(x, rot.next()[0], use_pdl=PDL, config=cfg)  # noqa: E731
            eager = lambda: torch.ops.flintc.lm_head(x, w)  # noqa: E731
            return (ours, eager, TB.logits, lambda: (x, rot.next()[0]), nbytes(w, x) + 4 * N * F,
                    (fmt, F, K, N), None)
        if self.kind == "lm_head":
            w = make_weight(F, K, "bf16")[0]
            x3 = x.view(N, 1, K)
            rot = self.rot = Rotation([w])
            ours = lambda cfg=None: fg.norm_lm_head(x3, norm, rot.next()[0], 1e-5, use_pdl=PDL, config=cfg)  # noqa: E731
            eager = lambda: torch.ops.flintc.norm_lm_head(x3, norm, w, 1e-5)  # noqa: E731

            def fast(x3, norm, w):
                return TB.logits(ops.rms_norm(x3, norm, 1e-5, F32).view(-1, K), w)
            return (ours, eager, fast, lambda: (x3, norm, rot.next()[0]),
                    nbytes(w, x, norm) + 4 * N * F, ("norm:" + fmt, F, K, N), None)
        assert self.kind == "qkv"
        wq, wk, wv = make_weight(HQ * D, K, fmt), make_weight(HKV * D, K, fmt), make_weight(HKV * D, K, fmt)
        qn, kn = torch.rand(D, device="cuda") + 0.5, torch.rand(D, device="cuda") + 0.5
        cos, sin = ops.rope_tables(10000.0, D, 4096, torch.float32)
        cos, sin = cos.cuda(), sin.cuda()
        kc = torch.zeros(N, WINDOW, HKV, D, dtype=torch.bfloat16, device="cuda")
        vc = torch.zeros_like(kc)
        slots = torch.arange(N, device="cuda")
        pos = torch.randint(0, 4096, (N, 1), device="cuda")
        x3 = x.view(N, 1, K)
        args = (x3, norm, wq, wk, wv, qn, kn, cos, sin, kc, vc, slots, pos, 1e-5, HQ, HKV, True, WINDOW)
        rot = Rotation([wq, wk, wv])

        def ours(cfg=None):
            q_, k_, v_ = rot.next()
            return fg.norm_qkv_rope_kv(x3, norm, q_, k_, v_, *args[5:], use_pdl=PDL, config=cfg)
        eager = lambda: torch.ops.flintc.norm_qkv_rope_kv(*args)  # noqa: E731

        def fast(x3, norm, wqkv, qn, kn, cos, sin, kc, vc, slots, pos):
            wq, wk, wv = wqkv
            B = x3.shape[0]
            h = ops.rms_norm(x3, norm, 1e-5, F32).view(B, -1)
            q = ops.rms_norm(TB.linear(h, wq).view(B, 1, HQ, D), qn, 1e-5, F32)
            k = ops.rms_norm(TB.linear(h, wk).view(B, 1, HKV, D), kn, 1e-5, F32)
            v = TB.linear(h, wv).view(B, 1, HKV, D)
            c, s = cos[pos], sin[pos]
            q, k = ops.apply_rope(q, c, s, F32), ops.apply_rope(k, c, s, F32)
            ring = pos % WINDOW
            kc[slots[:, None], ring] = k
            vc[slots[:, None], ring] = v
            return q
        moved = nbytes(wq, wk, wv, x, norm) + 2 * N * HQ * D + 2 * 2 * N * HKV * D + 2 * 4 * N * D
        return (ours, eager, fast, lambda: (x3, norm, rot.next(), *args[5:13]), moved,
                ("qkv:" + fmt, HQ * D, K, N), D)


CASES = [
    Case("q_proj", HQ * D, H, ("bf16", "nvfp4"), "gemv"),
    Case("qkv", (HQ + 2 * HKV) * D, H, ("bf16", "nvfp4"), "qkv"),
    Case("o_proj+res", H, HQ * D, ("bf16", "nvfp4"), "gemv_residual"),
    Case("gate_up", FFN, H, ("bf16", "nvfp4"), "gate_up"),
    Case("down+res", H, FFN, ("bf16", "nvfp4"), "gemv_residual"),
    Case("expert_gate", 512, H, ("bf16", "nvfp4"), "gemv"),
    Case("expert_down", H, 512, ("bf16", "nvfp4"), "gemv"),
    Case("lm_head", VOCAB, H, ("bf16",), "lm_head"),
    Case("lm_head_plain", VOCAB, H, ("bf16",), "lm_head_plain"),
]
PDL = False
ROTATE = True


def weight_floors(rot: Rotation) -> list:
    """One `read_floor.weight_floor` per rotated copy of a case's weights: a plain weight
    (`[codes, scales, global_scale]` or `[w]`) is one matrix, the dense gate/up's `[gate,
    up]` two. Raises ValueError (from `weight_floor`) for other groups (QKV's three)."""
    from read_floor import weight_floor

    def matrices(group):
        return group if isinstance(group[0], (list, tuple)) else [group]

    return [weight_floor(matrices(c)) for c in rot.copies]


def floor_us(rot: Rotation, reps: int) -> tuple[float, str]:
    """The read floor of a case's weights (`read_floor.weight_floor`: a kernel that only
    reads them, every load issued before `griddepcontrol.wait` as a GEMV's may be), over
    the same rotated copies and timed as the op is (`kernel_ms`, PDL as `--pdl`): the best
    of `read_floor.LAUNCHES` that split the weights, in ms, and that launch. The first
    copy's reads are checked against numpy's XOR of its bytes first."""
    from read_floor import NO_IDS, best_launch

    floors = weight_floors(rot)
    ids = NO_IDS.cuda()
    floors[0].check(ids)

    def timed(t, ld):
        turn = itertools.count()  # each launch in the graph reads the next copy
        return kernel_ms(lambda: floors[next(turn) % len(floors)](ids, t, ld, "dependent", PDL),
                         reps)

    ms, t, ld = best_launch(floors[0], timed)
    return ms, f"{t} x {ld}"


def main() -> None:
    global PDL, ROTATE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the Markdown tables to this file")
    parser.add_argument("--pdl", action="store_true", help="launch flintc's kernels with PDL")
    parser.add_argument("--sweep", action="store_true", help="time every sweep_configs candidate")
    parser.add_argument("--reps", type=int, default=50, help="ms of graph replays per timing")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    parser.add_argument("--family", default="all", choices=("all", "classic", "one-step", "flat", "swap"),
                        help="sweep candidates: all, the classic tiles (with their bf16 flat "
                             "twins), the one-step configs (whole weight slice issued before the "
                             "PDL wait), flat (bf16 2-D tiles only), or swap (the weight tile as "
                             "the dot's left operand, 3-D and 2-D tiles, both formats)")
    parser.add_argument("--sweep-seconds", type=float, default=0.0,
                        help="stop trying sweep candidates after this many seconds (compile time "
                             "included; >= 0, 0 = no limit, unlike bench_moe.py's); the rows and "
                             "winners so far are kept")
    parser.add_argument("--l2-resident", action="store_true",
                        help="do not rotate weight copies (the kernels then read L2-resident weights; "
                             "the pre-session-5 behaviour)")
    parser.add_argument("--tuned-json", help="write the sweep winners as a FLINTC_GEMV_TUNED file")
    parser.add_argument("--floor", action="store_true",
                        help="add each case's read floor (benchmarks/read_floor.py: a kernel "
                             "that only reads the weights, loads issued before the PDL wait), "
                             "with the row's bytes: the most the op could reach; not for qkv")
    parser.add_argument("--formats", default="bf16,nvfp4",
                        help="comma-separated weight formats (default bf16,nvfp4)")
    parser.add_argument("--batches", default="1,2,4,8",
                        help="comma-separated decode batch sizes N (default 1,2,4,8)")
    args = parser.parse_args()
    from common import choice_list, int_list, write_out
    from torch_baselines import compile_fresh

    # bad arguments are reported (exit 2) before the GPU check
    BATCHES[:] = int_list(parser, "--batches", args.batches, 1, 8)
    FORMATS[:] = choice_list(parser, "--formats", args.formats, ("bf16", "nvfp4"))
    if args.cases:
        choice_list(parser, "--cases", args.cases, [c.name for c in CASES])
    if not args.sweep_seconds >= 0:  # NaN too
        parser.error(f"--sweep-seconds: expected >= 0 (0 = no limit); got {args.sweep_seconds:g}")
    if args.reps < 1:
        parser.error(f"--reps: expected >= 1; got {args.reps}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA GPU")
    PDL = args.pdl
    ROTATE = not args.l2_resident

    from flintc.kernels.gemv import choose_config, sweep_configs
    from flintc.kernels.fused_gemv import qkv_config

    copy_bw = copy_bandwidth_gbs()
    head = [f"Device: {torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s "
            f"(graph-replayed 1 GiB copy, same run); PDL {'on' if PDL else 'off'}; "
            "CUDA-graph replay, median; bytes = weights + activations + outputs (+ cache rows); "
            + (f"flintc's weights rotate over copies of >= {ROTATE_BYTES >> 20} MiB (read from DRAM; "
               "so do the torch bf16 and compile columns; the eager reference op reads one copy, "
               "L2-resident where it fits)" if ROTATE
               else "weights NOT rotated (--l2-resident): small shapes are timed from L2")
            + "; torch bf16 = the fast plain-torch expression (benchmarks/torch_baselines.py: bf16 "
            "GEMMs, NVFP4 dequantized to bf16 per call), compile = torch.compile of it (default "
            "mode, compiled afresh per row), mul-sum = torch.compile of the GEMV as a multiply-and-sum "
            "over K (torch_baselines.linear_mulsum; plain GEMVs); compile % copy and vs compile: the "
            "faster compiled form", "",
            "| case | F x K | fmt | N | flintc us | GB/s | % copy | config | eager us | torch bf16 us "
            "| compile us | mul-sum us | compile % copy | vs compile |"
            + (" best us | best % copy | best config |" if args.sweep else "")
            + (" floor us | floor % copy | floor launch |" if args.floor else ""),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.sweep else "")
            + ("---|---|---|" if args.floor else "")]
    lines = list(head)
    print("\n".join(lines), flush=True)
    tuned = []
    tuned_json = []
    wanted = {c for c in args.cases.split(",") if c}
    deadline = time.monotonic() + args.sweep_seconds if args.sweep_seconds > 0 else math.inf
    skipped = 0
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        for fmt in [f for f in case.fmts if f in FORMATS]:
            floor = None  # (ms, launch) of the case's read floor: the same for every N
            for N in BATCHES:
                ours, eager, fast, fast_args, moved, key, rows_fixed = case.build(fmt, N)
                if case.kind == "qkv":
                    cfg0 = qkv_config(N, case.K, D, HQ, fmt, torch.device("cuda"), kv_heads=HKV)
                elif case.kind == "gate_up":
                    cfg0 = None
                else:
                    cfg0 = choose_config(N, case.F, case.K, fmt, torch.device("cuda"),
                                         norm=case.kind == "lm_head")
                for _ in range(64):  # every rotated copy (at most 64) once before capture:
                    ours()           # compiles, allocates split-K counters, and repacks
                    # NVFP4 copies for the CUDA kernels (one first seen during capture would
                    # run the Triton fallback; session 15 found bench_moe timing that mix)
                ms = kernel_ms(lambda: ours(), args.reps)
                ms_e = kernel_ms(eager, args.reps)
                ms_t = kernel_ms(lambda: fast(*fast_args()), args.reps)
                ms_c = math.nan
                if not args.no_compile:
                    try:
                        comp = compile_fresh(fast)
                        comp(*fast_args())
                        ms_c = kernel_ms(lambda: comp(*fast_args()), args.reps)
                    except Exception as e:  # noqa: BLE001  (a comparison column only)
                        print(f"  torch.compile failed for {case.name}: {type(e).__name__}: {e}")
                ms_m = math.nan
                if not args.no_compile and case.mulsum is not None:
                    expr, expr_args = case.mulsum
                    try:
                        comp_m = compile_fresh(expr)
                        comp_m(*expr_args())
                        ms_m = kernel_ms(lambda: comp_m(*expr_args()), args.reps)
                    except Exception as e:  # noqa: BLE001  (a comparison column only)
                        print(f"  torch.compile (mul-sum) failed for {case.name}: "
                              f"{type(e).__name__}: {e}")
                ms_best = min((t for t in (ms_c, ms_m) if not math.isnan(t)), default=math.nan)
                gbs = moved / ms / 1e6
                row = (f"| {case.name} | {case.F}x{case.K} | {fmt} | {N} | {ms * 1e3:.1f} | {gbs:.0f} | "
                       f"{100 * gbs / copy_bw:.0f}% | {cfg0.short() if cfg0 else 'default'} | "
                       f"{ms_e * 1e3:.1f} | {ms_t * 1e3:.1f} | "
                       # "-": not run (--no-compile, no mul-sum form) or failed (printed above)
                       + " | ".join("-" if math.isnan(t) else f"{t * 1e3:.1f}" for t in (ms_c, ms_m)) + " | "
                       + ("- | - |" if math.isnan(ms_best) else
                          f"{100 * moved / ms_best / 1e6 / copy_bw:.0f}% | {ms_best / ms:.1f}x |"))
                if args.sweep:
                    # all rows the kernel's programs cover (for QKV: the q, k and v heads, not
                    # the q rows of its TUNED key)
                    F_rows = 2 * case.F if case.kind == "gate_up" else case.F
                    cands = sweep_configs(fmt, N, F_rows, case.K, torch.device("cuda"), rows_fixed,
                                          family=args.family,
                                          flat_ok=True)
                    best = (ms, cfg0)
                    for cfg in cands:
                        if time.monotonic() > deadline:
                            skipped += 1
                            continue
                        if case.kind == "gate_up":
                            cfg = type(cfg)(**{**cfg.__dict__, "block_f": max(16, cfg.block_f // 2)})
                        try:
                            ours(cfg)
                            t = kernel_ms(lambda: ours(cfg), args.reps)
                        except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                            print(f"  {cfg.short()}: failed ({type(e).__name__}: {str(e)[:80]})")
                            continue
                        print(f"  {case.name} {fmt} N={N} {cfg.short()}: {t * 1e3:.1f} us", flush=True)
                        if t < best[0]:
                            best = (t, cfg)
                    bt, bc = best
                    row += (f" {bt * 1e3:.1f} | {100 * moved / bt / 1e6 / copy_bw:.0f}% | "
                            f"{bc.short() if bc else 'default'} |")
                    if bc is not None:
                        tuned_json.append({"key": list(key), "config": dict(bc.__dict__),
                                           "us": bt * 1e3, "default_us": ms * 1e3})
                        tuned.append(f"    {key!r}: {bc!r},  # {case.name} {100 * moved / bt / 1e6 / copy_bw:.0f}%")
                if args.floor:
                    if floor is None and case.rot is not None:
                        floor = floor_us(case.rot, args.reps)
                    row += (f" {floor[0] * 1e3:.1f} | {100 * moved / floor[0] / 1e6 / copy_bw:.0f}% | "
                            f"{floor[1]} |" if floor else " - | - | - |")
                lines.append(row)
                print(row, flush=True)
                if args.out:  # the rows so far: a run cut by a timeout keeps them
                    write_out(args.out, "\n".join(lines))
                torch.cuda.empty_cache()
    if skipped:
        note = f"Sweep: {skipped} candidates not tried (--sweep-seconds {args.sweep_seconds:g} spent)."
        lines += ["", note]
        print(note, flush=True)
    if tuned:
        lines += ["", "TUNED entries (paste into flintc/kernels/gemv.py):", "", "```python"] + tuned + ["```"]
        print("\n".join(lines[-len(tuned) - 2:]), flush=True)
    if args.tuned_json:
        import json
        with open(args.tuned_json, "w") as f:
            json.dump({"entries": tuned_json}, f, indent=1)
    write_out(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
