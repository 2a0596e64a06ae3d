"""The launch gap between dependent kernels in a CUDA graph, with programmatic
dependent launch (PDL) off and on. Needs a CUDA GPU of compute capability >= 9.0 for
the PDL rows (earlier GPUs: PDL rows are skipped).

Chains, each captured once in a CUDA graph and timed by replaying it
(`common.time_graph`, device events, median):
- `tiny`: 343 dependent tiny Triton kernels (343 = 7 kernels x 49 layers, the decode
  schedule's count). Kernel i reads the BLOCK floats kernel i-1 wrote (after
  `gdc_wait` when PDL is on), adds 1 and writes them to the other buffer; it calls
  `gdc_launch_dependents` either first thing ("early") or after its store ("late").
  One program per kernel, and one per SM. After the replays the buffer must hold the
  start value + 343 x replays: a check that PDL kept the chain's order.
- `attention`: 49 dependent pairs of the real `decode_attention` + `attention_combine`
  (B=1, full shapes), the combine's output [1, 1, Hq*D] feeding the next pair's q, over
  a ring of 513 rows (sliding layers) and a full cache holding 4096 tokens.

Reported: microseconds per kernel (replay time / kernels in the chain) with PDL off and
on, and the difference. Issue 5 target: the tiny chain below 1 us per kernel with PDL on
(a tiny kernel's own run time is included, so the gap itself is smaller still).

    python benchmarks/bench_pdl.py [--out pdl.md]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, time_graph, write_out

CHAIN = 343
PAIRS = 49
BLOCK = 256


@triton.jit
def step_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                EARLY: tl.constexpr):
    # dst[pid, :] = src[pid, :] + 1; src was written by the previous kernel of the chain.
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if USE_PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()  # a scheduling hint only
        tl.extra.cuda.gdc_wait()  # before the first read of what the previous kernel wrote
    x = tl.load(src_ptr + offs)
    tl.store(dst_ptr + offs, x + 1.0)
    if USE_PDL and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()


def tiny_chain(programs: int, pdl: bool, early: bool):
    """(seconds per kernel, chain result correct?)."""
    bufs = [torch.zeros(programs * BLOCK, device="cuda") for _ in range(2)]
    extra = {"launch_pdl": True} if pdl else {}

    def chain():
        for i in range(CHAIN):
            step_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], BLOCK=BLOCK, USE_PDL=pdl,
                                     EARLY=early, num_warps=4, **extra)

    warmup, iters = 2, 20
    t = time_graph(chain, warmup, iters, calls_per_replay=1)
    # The chain ran max(1, warmup) times eagerly (time_graph's warm-up; the capture
    # runs nothing) and warmup + iters times as replays: replay the same steps on the host.
    vals = [0.0, 0.0]
    for _ in range(max(1, warmup) + warmup + iters):
        for i in range(CHAIN):
            vals[(i + 1) % 2] = vals[i % 2] + 1.0
    ok = all(bool((b == v).all()) for b, v in zip(bufs, vals))
    return t / CHAIN, ok


def attention_chain(pdl: bool, window: int):
    """Seconds per kernel of PAIRS dependent attention + combine pairs (B = 1)."""
    from flintc.kernels import decode_attention as da

    Hq, Hkv, D = 32, 4, 128
    S = 513 if window else 4096
    q0 = torch.randn(1, 1, Hq, D, device="cuda").to(torch.bfloat16)
    kc = torch.randn(1, S, Hkv, D, device="cuda").to(torch.bfloat16)
    vc = torch.randn(1, S, Hkv, D, device="cuda").to(torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.int32, device="cuda")
    pos = torch.full((1, 1), 5000 if window else S - 1, dtype=torch.int64, device="cuda")
    sinks = torch.randn(Hq, device="cuda")
    n = da.choose_num_splits(S, 1, torch.cuda.get_device_properties(0).multi_processor_count,
                             window=window)

    def chain():
        q = q0
        for _ in range(PAIRS):
            o, lse = da.decode_attention(q, kc, vc, slots, pos, window, n, use_pdl=pdl)
            q = da.attention_combine(o, lse, sinks, use_pdl=pdl).view(1, 1, Hq, D)

    return time_graph(chain, 2, 20, calls_per_replay=1) / (2 * PAIRS), n


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the Markdown table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl: needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    pdl_ok = props.major >= 9
    sms = props.multi_processor_count
    rows = []
    for programs in (1, sms):
        for early in (True, False):
            off, ok_off = tiny_chain(programs, False, early)
            if pdl_ok:
                on, ok_on = tiny_chain(programs, True, early)
            else:
                on, ok_on = float("nan"), True
            name = f"tiny x{CHAIN}, {programs} program(s), trigger {'early' if early else 'late'}"
            rows.append([name, f"{off * 1e6:.3f}", f"{on * 1e6:.3f}", f"{(off - on) * 1e6:.3f}",
                         "yes" if ok_off and ok_on else "NO: WRONG RESULT"])
            print(rows[-1], flush=True)
    for window, label in ((513, "ring 513 rows"), (0, "full, 4096 tokens")):
        try:
            off, n = attention_chain(False, window)
            on = attention_chain(True, window)[0] if pdl_ok else float("nan")
            rows.append([f"attention+combine x{PAIRS}, B=1, {label}, {n} splits",
                         f"{off * 1e6:.3f}", f"{on * 1e6:.3f}", f"{(off - on) * 1e6:.3f}", "-"])
        except Exception as e:  # noqa: BLE001  (report and go on)
            rows.append([f"attention+combine, {label}", f"{type(e).__name__}: {e}"[:80],
                         "-", "-", "-"])
        print(rows[-1], flush=True)
    head = (f"Device: {props.name}; torch {torch.__version__}, triton {triton.__version__}; "
            f"CUDA-graph replay, median of 20; per-kernel time = replay time / kernels")
    table = markdown_table(["chain", "PDL off us/kernel", "PDL on us/kernel", "saved us",
                            "chain result right"], rows)
    text = head + "\n\n" + table
    print(text)
    write_out(args.out, text)
    return text


if __name__ == "__main__":
    main()
