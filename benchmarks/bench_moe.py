"""MoE decode kernels (flintc.kernels.moe) at the model's shapes against torch eager (GPU only).

For BF16 and NVFP4 weights and N in {1, 2, 4, 8} decode tokens, times each kernel
(`norm_router`, `moe_topk_gate_up`, `moe_down_combine_residual`) and the three chained as
one MoE layer, from a CUDA graph of CALLS back-to-back calls (median of REPS replays,
divided by CALLS), and prints a Markdown table: bytes that must be read, achieved GB/s,
share of the device-to-device copy bandwidth measured in the same run, and for comparison:
the reference op (`torch.ops.flintc.<op>`, eager, CUDA events, median; fp32, a sanity
line), the fast plain-torch expression of `torch_baselines.py` ("torch bf16": bf16 GEMMs,
the selected experts only (bf16: one grouped GEMM over the rows sorted by expert from
`fast_model.GROUPED_MIN_ROWS` rows on, else and for NVFP4 gathered per token), NVFP4 dequantized to bf16 on every
call; what a PyTorch user gets without custom kernels) and `torch.compile` of it (default
mode, compiled afresh per row), both timed as flintc's kernels are (the same CUDA graph of
CALLS calls over the same input sets and weight copies). `--no-compile` skips the compile
column.

Keeping the weights out of L2 (60 MB): the CALLS calls of a graph cycle through ROT = 16
input sets, each with its own random router logits (so each call selects fresh random
experts out of 256; the routed tensors are 1.6 GB bf16 / 0.4 GB NVFP4) and its own copy
of the per-layer weights that every call would otherwise re-read (router, shared expert:
16 copies = 16 / 96 MB bf16), as consecutive layers do in a real forward.

`moe_topk_gate_up` is given the routed down weights (`down_prefetch`), as in the model, so
its row includes the L2 prefetch of the selected experts' down rows (bytes not counted in
its row) and the down kernel's row reads them from DRAM (nothing prefetched them); the
MoE layer row is the three as the model runs them.

Bytes counted per call: the distinct selected experts' weights (averaged over the input
sets; tokens that share an expert read it once, as the kernels do), the shared expert's,
the router's, and every activation read or written. NVFP4 bytes include block scales.

    python benchmarks/bench_moe.py [--out moe.md] [--pdl] [--check] [--no-sweep] [--no-floor]
        [--no-compile]

Each (format, N) ends with read-floor rows (`--no-floor` skips them): `read_floor.py`'s
kernel, which only reads the op's weight bytes (ids read after the PDL wait, as the op
must), timed the same way, best of `read_floor.LAUNCHES`; its "% copy" (the op's bytes over the
floor's time) is the most the op could reach in this chain. Also an `ids_known` row (ids
read before the wait: no real kernel can) and a `late trigger` row (`launch_dependents`
after the stores, where the kernels of `flintc.kernels.nvfp4_mma` trigger unless
`EARLY_TRIGGER` names them).

After the table, a sweep (at most `--sweep-seconds`, default 60, compile time included)
times the candidates of `flintc.kernels.moe.sweep_configs` for `moe_topk_gate_up` and
`moe_down_combine_residual`, both formats, N in {1, 8} (then 2, 4 while time is left),
prints a table with the winner of each (kernel, fmt, N) marked, and ends with the
`TUNED[...] = MoeConfig(...)` lines to paste into `flintc/kernels/moe.py`.

`--check` compares every kernel against the reference at the full shapes (ids exactly,
the rest by share of differing elements and largest difference) instead of timing.

NVFP4 on sm_90+: the table's `moe_topk_gate_up` / `moe_down_combine_residual` (default
config) run the CUDA kernels of `flintc.kernels.nvfp4_mma`, as the model does; the sweep's
explicit configs time the Triton kernels. FLINTC_NVFP4_MMA=0 puts the table on Triton too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics

import torch

H, F, E, TOP_K, SCALING, EPS = 2048, 512, 256, 6, 2.5, 1e-5
BATCHES = [1, 2, 4, 8]
FORMATS = ["bf16", "nvfp4"]  # --formats
ROT = 16  # input sets / weight copies cycled through in a graph
CALLS = 64  # calls per graph


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def make_weight(shape, fmt: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Random weights on the GPU: bf16, or NVFP4 (random codes, E4M3 block scales from
    2^-9 to 2, a non-unit global scale per expert / matrix)."""
    if fmt == "bf16":
        return [(torch.randn(shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)]
    *lead, R, C = shape
    codes = torch.randint(0, 256, (*lead, R, C // 2), device="cuda", generator=gen,
                          dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(1, 0x40, (*lead, R, C // 16), device="cuda", generator=gen,
                           dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    gs = (0.5 + torch.rand(tuple(lead), device="cuda", generator=gen)) * 0.02
    return [codes, scales, gs.float()]


def graph_us(fn, reps: int) -> float:
    """Median over `reps` replays of a CUDA graph holding CALLS calls `fn(i)`, per call, us."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(ROT):  # every input set once: NVFP4 weights first seen during capture
            fn(i)             # would run the Triton fallback (their mma repack is eager)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    del g
    return statistics.median(times)


def eager_us(fn, reps: int) -> float:
    """Median of `reps` CUDA-event timings of single eager calls `fn(i)`, us."""
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(r)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of a 2 GiB tensor (read + write), median of 20."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    us = eager_us(lambda i: dst.copy_(src), 20)
    return 2 * 2**31 / us / 1e3


class Setup:
    """One format's weights and ROT input sets for batch N."""

    def __init__(self, fmt: str, N: int, gen: torch.Generator):
        self.fmt, self.N = fmt, N
        self.gate = make_weight((E, F, H), fmt, gen)
        self.up = make_weight((E, F, H), fmt, gen)
        self.down = make_weight((E, H, F), fmt, gen)
        self.sg = [make_weight((F, H), fmt, gen) for _ in range(ROT)]
        self.su = [make_weight((F, H), fmt, gen) for _ in range(ROT)]
        self.sd = [make_weight((H, F), fmt, gen) for _ in range(ROT)]
        self.router = [(torch.randn(E, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
                       for _ in range(ROT)]
        self.norm = [1 + 0.1 * torch.randn(H, device="cuda", generator=gen) for _ in range(ROT)]
        self.bias = [torch.randn(E, device="cuda", generator=gen) * 0.05 for _ in range(ROT)]
        self.x = [torch.randn(N, 1, H, device="cuda", generator=gen).to(torch.bfloat16)
                  for _ in range(ROT)]
        self.xn = [torch.randn(N, H, device="cuda", generator=gen).to(torch.bfloat16)
                   for _ in range(ROT)]
        self.logits = [torch.randn(N, E, device="cuda", generator=gen) for _ in range(ROT)]
        ref = torch.ops.flintc.moe_topk_gate_up
        outs = [ref(self.xn[i], self.logits[i], self.bias[i], self.gate, self.up, self.sg[i],
                    self.su[i], TOP_K, SCALING) for i in range(ROT)]
        # contiguous, as the gate/up kernels return them in the model (the reference's ids
        # and weights are column slices, which the down op would copy inside the timed loop)
        self.h = [o[0].contiguous() for o in outs]
        self.w = [o[1].contiguous() for o in outs]
        self.ids = [o[2].contiguous() for o in outs]
        self.distinct = statistics.mean(len(set(i.flatten().tolist())) for i in self.ids)

    def per_expert(self, w) -> float:
        return nbytes(w) / E  # bytes of one expert in a stacked [E, ...] weight

    def bytes_norm_router(self) -> int:
        N = self.N
        return nbytes([self.router[0], self.norm[0]]) + 2 * N * H * 2 + 4 * N * E

    def bytes_gate_up(self) -> float:
        N = self.N
        act = 2 * N * H + 4 * N * E + 4 * E + 2 * N * (TOP_K + 1) * F + 12 * N * TOP_K
        return (self.distinct * (self.per_expert(self.gate) + self.per_expert(self.up))
                + nbytes(self.sg[0] + self.su[0]) + act)

    def bytes_down(self) -> float:
        N = self.N
        act = 2 * N * (TOP_K + 1) * F + 12 * N * TOP_K + 2 * N * H * 2
        return self.distinct * self.per_expert(self.down) + nbytes(self.sd[0]) + act


def run_bench(args) -> list[str]:
    from common import write_out
    copy_bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    title = (f"Device: {torch.cuda.get_device_name()}; copy bandwidth {copy_bw:.0f} GB/s; "
             f"PDL {'on' if args.pdl else 'off'}; {CALLS} calls per CUDA graph cycling through "
             f"{ROT} input sets / weight copies, median of {args.reps} replays; reference = the "
             f"reference op, eager; torch bf16 = benchmarks/torch_baselines.py's expression, "
             f"compile = torch.compile of it, both in the same CUDA graph as flintc's")
    header = ("| op | fmt | N | distinct experts | MB read | flintc us | GB/s | % copy | "
              "reference us | torch bf16 us | compile us | vs compile |")
    lines = [title, "", header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines[2:]), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for fmt in [f for f in ("bf16", "nvfp4") if f in FORMATS]:
        for N in BATCHES:
            for row in bench_one(Setup(fmt, N, gen), args.pdl, args.reps, copy_bw,
                                 not args.no_floor, not args.no_compile):
                lines.append(row)
                print(row, flush=True)
                write_out(args.out, "\n".join(lines))  # a run cut by a timeout keeps its rows
            torch.cuda.empty_cache()
    return lines


def bench_one(s: Setup, pdl: bool, reps: int, copy_bw: float, floor: bool = False,
              compiled: bool = True) -> list[str]:
    """Rows of the table for one format and batch (with `floor`, then the read floors'
    rows of `floor_rows`; without `compiled`, the compile column is nan)."""
    from flintc.kernels import moe as K
    import torch_baselines as TB

    ref = torch.ops.flintc

    def r(i):
        return i % ROT

    def kw(impl):
        return {"use_pdl": pdl} if impl is K else {}

    def norm_router(i, impl=K):
        return impl.norm_router(s.x[r(i)], s.norm[r(i)], s.router[r(i)], EPS, **kw(impl))

    def gate_up(i, impl=K):
        j = r(i)
        return impl.moe_topk_gate_up(s.xn[j], s.logits[j], s.bias[j], s.gate, s.up, s.sg[j],
                                     s.su[j], TOP_K, SCALING, s.down, **kw(impl))

    def down(i, impl=K):
        j = r(i)
        return impl.moe_down_combine_residual(s.h[j], s.ids[j], s.w[j], s.down, s.sd[j], s.x[j],
                                              **kw(impl))

    def layer(i, impl=K):
        j = r(i)
        xn, logits = impl.norm_router(s.x[j], s.norm[j], s.router[j], EPS, **kw(impl))
        h, w, ids = impl.moe_topk_gate_up(xn, logits, s.bias[j], s.gate, s.up, s.sg[j], s.su[j],
                                          TOP_K, SCALING, s.down, **kw(impl))
        return impl.moe_down_combine_residual(h, ids, w, s.down, s.sd[j], s.x[j], **kw(impl))

    # the fast plain-torch expressions and their arguments for input set i
    def fast_args(op, i):
        j = r(i)
        if op == "norm_router":
            return s.x[j], s.norm[j], s.router[j], EPS
        if op == "moe_topk_gate_up":
            return s.xn[j], s.logits[j], s.bias[j], s.gate, s.up, s.sg[j], s.su[j], TOP_K, SCALING
        if op == "moe_down_combine_residual":
            return s.h[j], s.ids[j], s.w[j], s.down, s.sd[j], s.x[j]
        return (s.x[j], s.norm[j], s.router[j], s.bias[j], s.gate, s.up, s.down, s.sg[j],
                s.su[j], s.sd[j], TOP_K, SCALING, EPS)

    cases = [("norm_router", s.bytes_norm_router(), norm_router, TB.norm_router),
             ("moe_topk_gate_up", s.bytes_gate_up(), gate_up, TB.moe_topk_gate_up),
             ("moe_down_combine_residual", s.bytes_down(), down, TB.moe_down_combine_residual),
             ("MoE layer (3 kernels)",
              s.bytes_norm_router() + s.bytes_gate_up() + s.bytes_down(), layer, TB.moe_layer)]
    rows = []
    for name, nb, fn, fast in cases:
        us = graph_us(fn, reps)
        us_r = eager_us(lambda i, fn=fn: fn(i, ref), 10)
        us_t = graph_us(lambda i, fast=fast, name=name: fast(*fast_args(name, i)), reps)
        us_c = math.nan
        if compiled:
            try:
                comp = TB.compile_fresh(fast)
                us_c = graph_us(lambda i, name=name: comp(*fast_args(name, i)), reps)
            except Exception as e:  # noqa: BLE001  (a comparison column only)
                print(f"  torch.compile failed for {name}: {type(e).__name__}: {str(e)[:200]}",
                      flush=True)
        gbs = nb / us / 1e3
        rows.append(f"| {name} | {s.fmt} | {s.N} | {s.distinct:.1f} | {nb / 1e6:.2f} | {us:.1f} | "
                    f"{gbs:.0f} | {100 * gbs / copy_bw:.0f}% | {us_r:.0f} | {us_t:.1f} | "
                    f"{us_c:.1f} | {us_c / us:.1f}x |")
    if floor:
        rows += floor_rows(s, pdl, reps, copy_bw,
                           {"moe_topk_gate_up": s.bytes_gate_up(),
                            "moe_down_combine_residual": s.bytes_down()})
    return rows


def floor_rows(s: Setup, pdl: bool, reps: int, copy_bw: float, op_bytes: dict) -> list[str]:
    """The read floor of each expert op (`read_floor.ReadFloor`: only the op's weight
    reads, ids read after the wait as the op must): the best of `read_floor.LAUNCHES`, timed
    as the op is. "MB read" and "% copy" count the op's bytes (weights and activations),
    so the row's % copy is the most the op itself could reach in this chain; the
    `ids_known` row (ids read before the wait, which no real kernel can do) shows what
    the dependency on the router costs, the `late trigger` row (`launch_dependents` at
    the end, where the op's kernels have it unless `nvfp4_mma.EARLY_TRIGGER` names them)
    what the trigger's place costs."""
    from read_floor import ReadFloor, best_launch

    def weights(w):  # NVFP4 [codes, scales, global scale]; bf16 [w]
        return ([w[0]], [w[1].view(torch.uint8)]) if s.fmt == "nvfp4" else ([w[0]], [])

    def floor_of(routed: list, shared: list) -> ReadFloor:
        c, sc = zip(*[weights(w) for w in routed])
        shc, shs = zip(*[weights(w) for w in shared])
        return ReadFloor([x[0] for x in c], [x[0] for x in sc if x],
                         [x[0] for x in shc], [x[0] for x in shs if x])

    ops = {"moe_topk_gate_up": [floor_of([s.gate, s.up], [s.sg[j], s.su[j]]) for j in range(ROT)],
           "moe_down_combine_residual": [floor_of([s.down], [s.sd[j]]) for j in range(ROT)]}
    rows = []
    for op, floors in ops.items():
        floors[0].check(s.ids[0])  # reads exactly the op's weight bytes (XOR per item)
        for mode, trigger in (("dependent", "early"), ("dependent", "late"),
                              ("ids_known", "early")):
            def timed(t, ld, mode=mode, trigger=trigger):
                return graph_us(lambda i: floors[i % ROT](s.ids[i % ROT], t, ld, mode, pdl,
                                                          trigger), reps)

            us, t, ld = best_launch(floors[0], timed)
            nb = op_bytes[op]
            gbs = nb / us / 1e3
            rows.append(f"| read floor of {op} ({mode}, {trigger} trigger; {t} threads x {ld} "
                        f"loads) | {s.fmt} | "
                        f"{s.N} | {s.distinct:.1f} | {nb / 1e6:.2f} | {us:.1f} | {gbs:.0f} | "
                        f"{100 * gbs / copy_bw:.0f}% | - | - |")
    return rows


def run_sweep(args, copy_bw: float) -> list[str]:
    """Time every `sweep_configs` candidate per (kernel, fmt, N) within the time budget."""
    import time

    from flintc.kernels import moe as K

    t0 = time.time()
    lines = ["", (f"## Config sweep (PDL {'on' if args.pdl else 'off'}, budget "
                  f"{args.sweep_seconds:.0f} s, compile included)"), "",
             "| kernel | fmt | N | config | us | GB/s | % copy | best |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    tuned = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    out_of_time = False
    tuned_json = []
    for N in BATCHES:
        for fmt in [f for f in ("nvfp4", "bf16") if f in FORMATS]:
            if out_of_time:
                break
            s = Setup(fmt, N, gen)
            dev = torch.device("cuda")
            for kernel in ("gate_up", "down"):
                rows, red = (F, H) if kernel == "gate_up" else (H, F)
                nb = s.bytes_gate_up() if kernel == "gate_up" else s.bytes_down()
                results = []
                for cfg in K.sweep_configs(kernel, fmt, N, rows, red, N * TOP_K + 1, dev,
                                           family=args.family):
                    if time.time() - t0 > args.sweep_seconds:
                        out_of_time = True
                        break

                    def fn(i, cfg=cfg, kernel=kernel, s=s):
                        j = i % ROT
                        if kernel == "gate_up":
                            return K.moe_topk_gate_up(s.xn[j], s.logits[j], s.bias[j], s.gate,
                                                      s.up, s.sg[j], s.su[j], TOP_K, SCALING,
                                                      use_pdl=args.pdl, config=cfg)
                        return K.moe_down_combine_residual(s.h[j], s.ids[j], s.w[j], s.down,
                                                           s.sd[j], s.x[j], use_pdl=args.pdl,
                                                           config=cfg)

                    try:
                        us = graph_us(fn, 5)
                    except Exception as e:  # noqa: BLE001 (a config that fails to compile)
                        print(f"{kernel} {fmt} N={N} {cfg.short()}: failed: "
                              f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    results.append((us, cfg))
                if not results:
                    continue
                best = min(results, key=lambda r: r[0])
                for us, cfg in results:
                    gbs = nb / us / 1e3
                    row = (f"| {kernel} | {fmt} | {N} | {cfg.short()} | {us:.1f} | {gbs:.0f} | "
                           f"{100 * gbs / copy_bw:.0f}% | {'**best**' if cfg is best[1] else ''} |")
                    lines.append(row)
                    print(row, flush=True)
                tuned.append(f"TUNED[({kernel!r}, {fmt!r}, {N})] = {best[1]!r}")
                tuned_json.append({"key": [kernel, fmt, N], "config": dataclasses.asdict(best[1]),
                                   "us": best[0], "first_us": results[0][0]})
            del s
            torch.cuda.empty_cache()
    if args.tuned_json:
        with open(args.tuned_json, "w") as f:
            json.dump({"entries": tuned_json}, f, indent=1)
    if out_of_time:
        lines.append(f"(sweep stopped at the {args.sweep_seconds:.0f} s budget)")
    lines += ["", "Paste into flintc/kernels/moe.py (after `TUNED = {}`):", "", "```python"]
    lines += tuned + ["```"]
    print("\n".join(lines[-len(tuned) - 5:]), flush=True)
    return lines


def _cmp(name: str, out: torch.Tensor, ref: torch.Tensor) -> str:
    o, r = out.float(), ref.float()
    share = (out != ref).float().mean().item()
    diff = (o - r).abs().max().item()
    finite = bool(torch.isfinite(o).all())
    return f"{name}: {share:.3%} differ, max diff {diff:.3g}, finite {finite}"


def run_check(args) -> list[str]:
    """Full-shape comparison against the reference ops (same inputs for both)."""
    from flintc.kernels import moe as K

    lines = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for fmt in [f for f in ("bf16", "nvfp4") if f in FORMATS]:
        for N in BATCHES:
            s = Setup(fmt, N, gen)
            ok = True
            for i in range(4):
                xn, lg = K.norm_router(s.x[i], s.norm[i], s.router[i], EPS, use_pdl=args.pdl)
                rxn, rlg = torch.ops.flintc.norm_router(s.x[i], s.norm[i], s.router[i], EPS)
                h, w, ids = K.moe_topk_gate_up(s.xn[i], s.logits[i], s.bias[i], s.gate, s.up,
                                               s.sg[i], s.su[i], TOP_K, SCALING, use_pdl=args.pdl)
                out = K.moe_down_combine_residual(s.h[i], s.ids[i], s.w[i], s.down, s.sd[i],
                                                  s.x[i], use_pdl=args.pdl)
                rout = torch.ops.flintc.moe_down_combine_residual(s.h[i], s.ids[i], s.w[i],
                                                                  s.down, s.sd[i], s.x[i])
                ids_ok = torch.equal(ids, s.ids[i])
                ok &= ids_ok
                wrel = ((w - s.w[i]).abs() / s.w[i].abs()).max().item()
                ldiff = (lg - rlg).abs().max().item() / rlg.abs().max().item()
                line = (f"{fmt} N={N} set {i}: ids equal {ids_ok}; weights max rel diff {wrel:.3g}; "
                        f"logits max diff / max |logit| {ldiff:.3g}; "
                        + "; ".join([_cmp("normed x", xn, rxn), _cmp("h", h, s.h[i]),
                                     _cmp("down+combine+residual", out, rout)]))
                lines.append(line)
                print(line, flush=True)
            torch.cuda.empty_cache()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table (or check report) to this file")
    parser.add_argument("--pdl", action="store_true", help="launch the kernels with PDL")
    parser.add_argument("--check", action="store_true", help="compare against the reference "
                        "at full shapes instead of timing")
    parser.add_argument("--reps", type=int, default=10, help="graph replays per timing")
    parser.add_argument("--no-sweep", action="store_true", help="skip the config sweep")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile "
                        "column (compiling the plain-torch expressions takes a few s a row)")
    parser.add_argument("--no-floor", action="store_true", help="skip the read-floor rows "
                        "(benchmarks/read_floor.py: a kernel that only reads the op's weights)")
    parser.add_argument("--sweep-seconds", type=float, default=60.0,
                        help="time budget of the config sweep in s (compile included; >= 0, "
                             "0 stops it at once, unlike bench_gemv.py's 0 = no limit)")
    parser.add_argument("--family", default="all", choices=("all", "classic", "one-step", "flat", "swap", "maxnreg", "stage"),
                        help="sweep candidates (flintc.kernels.moe.sweep_configs)")
    parser.add_argument("--tuned-json", help="write the sweep winners as a FLINTC_MOE_TUNED file")
    parser.add_argument("--formats", default="bf16,nvfp4",
                        help="comma-separated weight formats (default bf16,nvfp4)")
    parser.add_argument("--batches", default="1,2,4,8",
                        help="comma-separated decode batch sizes N (default 1,2,4,8)")
    args = parser.parse_args()
    from common import choice_list, int_list, write_out

    # bad arguments are reported (exit 2) before the GPU check
    BATCHES[:] = int_list(parser, "--batches", args.batches, 1, 8)
    FORMATS[:] = choice_list(parser, "--formats", args.formats, ("bf16", "nvfp4"))
    if not args.sweep_seconds >= 0:  # NaN too
        parser.error(f"--sweep-seconds: expected >= 0; got {args.sweep_seconds:g}")
    if args.reps < 1:
        parser.error(f"--reps: expected >= 1; got {args.reps}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA GPU")
    import flintc.ops  # noqa: F401  (registers torch.ops.flintc)

    if args.check:
        lines = run_check(args)
    else:
        lines = run_bench(args)
        if not args.no_sweep:
            lines += run_sweep(args, copy_bandwidth_gbs())
    write_out(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
