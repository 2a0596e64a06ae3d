"""The compiled runtime at full size on a GPU against the reference model, with the
experts each side selects (FLINT_SPEC section 3: router flips are judged separately).

For each weight format: make the full 40B model's dummy weights on the GPU (same seed
for both backends), `compile_model` it (decode bucket 1 and the prefill chunk) or take a
prebuilt build (--builds), load the build, and run a prompt of --prompt-len tokens plus
--steps greedy decode steps on both the compiled runtime and the eager reference model
(`ReferenceRunner`, the same weight tensors). Both are fed the reference's tokens
(teacher forcing), so every step compares the same computation.

For the comparison the compiled runtime runs its generated step functions eagerly (a
CUDA-graph replay runs no Python, so nothing could be observed in it), with the routing
ops of its kernel tables wrapped: `moe_topk_gate_up` (decode) and `moe_route` (prefill)
return the expert ids the kernel selected. The decode kernel's ids are also checked
against the reference top-k (`flintc.model.ops.select_topk`) of the router logits the
runtime itself produced (`topk_vs_own_logits`). The reference's `route_topk` is wrapped
too, and records each token's top-k margin (K-th minus (K+1)-th routing key): a flip at
a small margin is a near-tie. After each eager decode step the CUDA graph is replayed on
the same inputs and its logits compared with the eager ones (`graph_vs_eager`: the same
kernels, so 0 unless a kernel is not deterministic), so what is shown eagerly holds for
the replay.

Per step (the prefill's last token, then each decode step):
- max |compiled - reference| of the logits and whether it is within atol + rtol * |ref|
  (atol 0.06, rtol 0.02; the prefill 0.09), and the greedy tokens where the reference's
  top two logits are further apart than the tolerance ("decided");
- flipped (token, MoE layer) choices: the sets of selected experts differ (for the
  prefill step: over every prompt token, whose K/V the last token reads);
- verdict: `ok` within the tolerance (and the same greedy token where decided); `flip`
  outside it, but an expert choice of that sequence differed at or before this step (a
  near-tie resolved the other way moves the residual stream, and every later step reads
  it through the KV cache); `FAIL` outside it with identical expert choices so far.
  Column `here`: flipped choices of the compared token itself (decode: all of them;
  prefill: the last prompt token's). A `flip` with `here` 0 is explained only by an
  earlier flip; note that one flip anywhere in a long prompt marks every later step of
  that sequence, so at full depth read `worst abs before any flip` and the first flip's
  step and margin too.

A build passes when it has no FAIL and flips stay rare (at most 10% of the token-layer
choices, as tests/runtime/test_compiled.py requires). Then (on a GPU) it times the
compiled decode step (CUDA-graph replay, device events, median) and counts the kernels in
the captured CUDA graph. Writes a Markdown table to --out; exits 1 when a build fails.

    python3 scripts/gpu_runtime.py --formats nvfp4,bf16 --out $OUT/runtime.md
    python3 scripts/gpu_runtime.py --device cpu --config tiny --backend torch --formats bf16 \\
        --prompt-len 40 --steps 16 --max-model-len 128      # the same checks on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ATOL, RTOL = 0.06, 0.02
PREFILL_ATOL = 0.09  # fuse_prefill_attention's stated tolerance
MAX_FLIP_SHARE = 0.1  # flipped token-layer choices, as tests/runtime/test_compiled.py
# The compiled runtime's routing ops -> index of the selected expert ids in their outputs
# (decode: moe_topk_gate_up -> (h, weights, ids); prefill: moe_route -> (weights, ids)).
ROUTING_OPS = {"moe_topk_gate_up": 2, "moe_route": 1}


# ------------------------------------------------------------------------ expert logging
class ExpertRecorder:
    """Records the top-k expert ids each side selects, one entry per MoE layer call.

    Compiled runtime: the routing ops (`ROUTING_OPS`) of every kernel table of `runner`
    are wrapped (works only while the step functions run eagerly, not in a CUDA-graph
    replay). Reference: `flintc.model.ops.route_topk` is wrapped (the torch backend's
    `moe_route` calls it too; only calls while `side == "ref"` count).

    Use as a context manager (installs, then restores the originals); set `side` to
    "ours" or "ref" around the calls to record; `take()` collects and clears.
    """

    def __init__(self, runner):
        self.runner = runner
        self.side: str | None = None
        self._calls: dict[str, list[dict]] = {"ours": [], "ref": []}
        self._undo: list = []

    def __enter__(self):  # -> self
        import flintc.model.ops as model_ops

        real = model_ops.route_topk

        def route_topk(x, router, bias, top_k, scaling, cdt):
            w, ids = real(x, router, bias, top_k, scaling, cdt)
            if self.side == "ref":
                self._calls["ref"].append({"ids": ids.sort(dim=-1).values,
                                           "margin": _topk_margin(x, router, bias, top_k, cdt)})
            return w, ids

        model_ops.route_topk = route_topk
        self._undo.append(lambda: setattr(model_ops, "route_topk", real))
        tables = {id(t): t for t in self.runner._tables.values()}.values()
        for table in tables:
            for op, index in ROUTING_OPS.items():
                fn = getattr(table, op)  # resolves (and caches) the implementation

                def wrapped(*a, _fn=fn, _op=op, _i=index, **k):
                    out = _fn(*a, **k)
                    if self.side == "ours":
                        self._calls["ours"].append(self._ours(_op, out[_i], a, k))
                    return out

                table._cache[op] = wrapped
                self._undo.append(lambda t=table, o=op, f=fn: t._cache.__setitem__(o, f))
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()
        self.side = None

    @staticmethod
    def _ours(op: str, ids: torch.Tensor, a: tuple, k: dict) -> dict:
        entry = {"ids": ids.sort(dim=-1).values, "own": None}
        if op == "moe_topk_gate_up":  # the kernel routes internally: redo it on its own logits
            from flintc.model.ops import select_topk

            def arg(i, name):
                return a[i] if len(a) > i else k[name]

            own = select_topk(arg(1, "logits"), arg(2, "bias"), arg(7, "top_k"), arg(8, "scaling"))[1]
            entry["own"] = own.sort(dim=-1).values
        return entry

    @contextlib.contextmanager
    def recording(self, side: str):
        self.side = side
        try:
            yield
        finally:
            self.side = None

    def take(self, side: str, layers: int, rows: list[int]) -> dict:
        """The calls of `side` since the last take: forward calls (chunks) in order, each
        calling the routing op once per MoE layer; `rows[c]` real rows of call c (padding
        rows after them are dropped). -> {"ids": int64 [layers, tokens, K] sorted per token,
        "margin": fp32 [layers, tokens] (reference) or None, "own": bool [layers, tokens]
        (ours: the kernel's ids differ from the reference top-k of its own logits) or None}.
        Raises RuntimeError when the calls do not match (a routing op this script does not
        know, or a step that did not run eagerly)."""
        calls, self._calls[side] = self._calls[side], []
        if len(calls) != layers * len(rows):
            raise RuntimeError(
                f"{side}: recorded {len(calls)} routing calls, expected {layers} MoE layers x "
                f"{len(rows)} forward calls; the routing ops this script wraps are {sorted(ROUTING_OPS)} "
                "(compiled runtime) and flintc.model.ops.route_topk (reference), and the compiled "
                "step must run eagerly (no CUDA graph)")
        out = {}
        for key in ("ids", "margin", "own"):
            if any(c.get(key) is None for c in calls):
                out[key] = None
                continue
            per_layer = [torch.cat([calls[c * layers + layer][key][:n].cpu() for c, n in enumerate(rows)])
                         for layer in range(layers)]
            out[key] = torch.stack(per_layer)
        if out["own"] is not None:
            out["own"] = (out["own"] != out["ids"]).any(dim=-1)
        return out


def _topk_margin(x, router, bias, top_k: int, cdt) -> torch.Tensor:
    """Per token: the K-th largest routing key (sigmoid score + bias) minus the (K+1)-th
    (the reference's expression, FLINT_SPEC 2 MoE steps 1-3). inf when E == K."""
    logits = x.to(cdt) @ router.to(cdt).T
    keys = torch.sigmoid(logits) + bias.to(logits.dtype)
    if keys.shape[-1] <= top_k:
        return torch.full(keys.shape[:1], math.inf)
    top = keys.topk(top_k + 1, dim=-1).values
    return (top[:, top_k - 1] - top[:, top_k]).float()


def _chunks(n: int, size: int) -> list[int]:
    """Real rows of each forward call when n tokens run in calls of `size`."""
    return [min(size, n - s) for s in range(0, n, size)]


def _runner_chunks(runner, n: int) -> list[int]:
    """Real rows of each forward call of the compiled runner's prefill of n tokens (a
    build with a chunk longer than the sliding window ends in tail chunks)."""
    if hasattr(runner, "prefill_pieces"):
        return [live for _, live, _ in runner.prefill_pieces(n)]
    return _chunks(n, runner.prefill_chunk)


# -------------------------------------------------------------------------- comparison
def judge(a: torch.Tensor, b: torch.Tensor, atol: float, flipped: bool) -> dict:
    """One step of one sequence: compiled logits `a` against the reference's `b` [V].
    `flipped`: an expert choice of this sequence differed at or before this step."""
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    within = bool((diff <= atol + RTOL * b.abs()).all())
    top2 = b.topk(2).values
    decided = bool((top2[0] - top2[1]) > 2 * (ATOL + RTOL * top2[0].abs()))
    token_equal = int(a.argmax()) == int(b.argmax())
    good = within and (token_equal or not decided)
    verdict = "ok" if good else ("flip" if flipped else "FAIL")
    return {"max_abs": float(diff.max()), "within": within, "decided": decided, "token_equal": token_equal,
            "verdict": verdict}


@contextlib.contextmanager
def comparing(runner, graph_check: bool | None = None):
    """Eager compiled steps with expert logging for the duration. graph_check (default:
    the runner uses CUDA graphs) captures the decode graphs first, before the routing ops
    are wrapped. Yields (recorder, graph_check)."""
    graphs = runner.use_cuda_graphs
    graph_check = graphs if graph_check is None else (graph_check and graphs)
    if graph_check:
        runner.capture_all()
    runner.use_cuda_graphs = False
    try:
        with ExpertRecorder(runner) as rec:
            yield rec, graph_check
    finally:
        runner.use_cuda_graphs = graphs


def _moe_layers(config) -> int:
    return sum(1 for i in range(config.num_hidden_layers) if config.is_moe_layer(i))


def _row_record(step: int, kind: str, row: int, position: int, a, b, atol: float, same: torch.Tensor,
                margin, own, first_flip: list) -> dict:
    """same: bool [layers, tokens] for this row's choices of this step (the last token's
    logits are the ones compared)."""
    flips = int((~same).sum())
    if flips and first_flip[row] is None:
        first_flip[row] = step
    r = {"step": step, "kind": kind, "row": row, "position": position}
    r.update(judge(a, b, atol, first_flip[row] is not None))
    r.update({"flips": flips, "choices": same.numel(), "flips_here": int((~same[:, -1]).sum()),
              "first_flip": first_flip[row],
              "flip_margin": float(margin[~same].max()) if flips and margin is not None else None,
              "topk_vs_own_logits": int(own.sum()) if own is not None else None})
    return r


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def compare_prefill(runner, ref, rec, row: int, prompt: list[int], first_flip: list) -> tuple[dict, torch.Tensor]:
    """Prefill `prompt` into slot `row` on both sides. -> (record of the last token's
    logits, the reference's logits [V])."""
    L = _moe_layers(runner.config)
    _sync(runner.device)
    t0 = time.perf_counter()
    with rec.recording("ours"):
        a = runner.prefill(row, prompt)
    _sync(runner.device)
    seconds = time.perf_counter() - t0
    ours = rec.take("ours", L, _runner_chunks(runner, len(prompt)))
    with rec.recording("ref"):
        b = ref.prefill(row, prompt)
    theirs = rec.take("ref", L, _chunks(len(prompt), ref.prefill_chunk))
    same = (ours["ids"] == theirs["ids"]).all(dim=-1)  # [layers, tokens]
    r = _row_record(0, "prefill", row, len(prompt) - 1, a, b, PREFILL_ATOL, same, theirs["margin"],
                    ours["own"], first_flip)
    r["seconds"] = seconds
    return r, b


def compare_decode(runner, ref, rec, graph_check: bool, slots: list[int], tokens: list[int],
                   positions: list[int], steps: int, first_flip: list, step0: int = 1) -> list[dict]:
    """`steps` decode steps of the sequences in `slots` (same slots on both sides) from
    `tokens` at `positions`, both fed the reference's greedy tokens. -> one record per
    step and sequence. first_flip[j]: the step of sequence j's first flip (updated)."""
    L = _moe_layers(runner.config)
    n = len(slots)
    out = []
    toks, pos = list(tokens), list(positions)
    for i in range(steps):
        with rec.recording("ours"):
            a = runner.decode(slots, toks, pos)
        ours = rec.take("ours", L, [n])
        graph_diff = None
        if graph_check:  # the same step replayed from the CUDA graph (rewrites the same K/V)
            runner.use_cuda_graphs = True
            try:
                graph_diff = float((runner.decode(slots, toks, pos) - a).abs().max())
            finally:
                runner.use_cuda_graphs = False
        with rec.recording("ref"):
            b = ref.decode(slots, toks, pos)
        theirs = rec.take("ref", L, [n])
        same = (ours["ids"] == theirs["ids"]).all(dim=-1)  # [layers, n]
        for j in range(n):
            r = _row_record(step0 + i, "decode", j, pos[j], a[j], b[j], ATOL, same[:, j:j + 1],
                            None if theirs["margin"] is None else theirs["margin"][:, j:j + 1],
                            None if ours["own"] is None else ours["own"][:, j:j + 1], first_flip)
            r["graph_vs_eager"] = graph_diff
            out.append(r)
        toks = b.argmax(dim=-1).tolist()
        pos = [p + 1 for p in pos]
    return out


def compare_run(runner, ref, prompts: list[list[int]], steps: int, graph_check: bool | None = None) -> list[dict]:
    """Teacher-forced comparison of `runner` (a CompiledRunner) with `ref` (a
    ReferenceRunner over the same weights): prefill prompt j into slot j on both, then
    `steps` decode steps of all prompts together. -> records (dicts) per step and
    sequence: step (0: the prefill's last token), kind, row, position, max_abs, within,
    decided, token_equal, flips (flipped token-layer choices of this step), choices,
    first_flip, verdict ("ok" / "flip" / "FAIL"), flip_margin, topk_vs_own_logits,
    graph_vs_eager; see the module doc. Runs the compiled steps eagerly."""
    first_flip: list = [None] * len(prompts)
    records, last = [], []
    with comparing(runner, graph_check) as (rec, check):
        for j, ids in enumerate(prompts):
            r, b = compare_prefill(runner, ref, rec, j, ids, first_flip)
            records.append(r)
            last.append(int(b.argmax()))
        records += compare_decode(runner, ref, rec, check, list(range(len(prompts))), last,
                                  [len(p) for p in prompts], steps, first_flip)
    return records


def compare_decode_run(runner, ref, slots: list[int], tokens: list[int], positions: list[int], steps: int,
                       graph_check: bool | None = None) -> list[dict]:
    """Like `compare_run` without the prefill: both sides' caches already hold the same
    state (e.g. the reference got a copy of the runtime's). Steps count from 1."""
    first_flip: list = [None] * len(slots)
    with comparing(runner, graph_check) as (rec, check):
        return compare_decode(runner, ref, rec, check, slots, tokens, positions, steps, first_flip)


def summarize(records: list[dict]) -> dict:
    """Totals over the records of one run; `passed`: no FAIL and flipped token-layer
    choices <= MAX_FLIP_SHARE of all."""
    flips = sum(r["flips"] for r in records)
    choices = sum(r["choices"] for r in records)
    clean = [r for r in records if r["first_flip"] is None]
    decided = [r for r in records if r["decided"]]
    own = [r["topk_vs_own_logits"] for r in records if r["topk_vs_own_logits"] is not None]
    graph = [r["graph_vs_eager"] for r in records if r.get("graph_vs_eager") is not None]
    firsts = [r["step"] for r in records if r["flips"] and r["first_flip"] == r["step"]]
    first_margins = [r["flip_margin"] for r in records
                     if r["flips"] and r["first_flip"] == r["step"] and r["flip_margin"] is not None]
    s = {"steps": len(records), "within": sum(r["within"] for r in records),
         "ok": sum(r["verdict"] == "ok" for r in records), "flip": sum(r["verdict"] == "flip" for r in records),
         "flip_here": sum(r["verdict"] == "flip" and r["flips_here"] > 0 for r in records),
         "fail": sum(r["verdict"] == "FAIL" for r in records),
         "flipped_choices": flips, "choices": choices, "flip_share": flips / max(choices, 1),
         "first_flip": min(firsts) if firsts else None,
         "first_flip_margin": max(first_margins) if first_margins else None,
         "worst_abs": max(r["max_abs"] for r in records),
         "worst_abs_no_flip": max((r["max_abs"] for r in clean), default=None),
         "decided": len(decided), "tokens_equal": sum(r["token_equal"] for r in decided),
         "topk_vs_own_logits": sum(own) if own else None,
         "graph_vs_eager": max(graph) if graph else None}
    s["passed"] = s["fail"] == 0 and s["flip_share"] <= MAX_FLIP_SHARE
    return s


def _fmt(v, spec=".4g") -> str:
    return "-" if v is None else format(v, spec)


def format_steps(records: list[dict]) -> str:
    """One line per step and sequence."""
    lines = [(f"{'step':>4} {'kind':<7} {'row':>3} {'pos':>6} {'max_abs':>9} {'within':>6} {'flips':>11} "
             f"{'here':>4} {'first_flip':>10} {'margin':>9} {'own_topk':>8} {'graph':>8}  verdict")]
    for r in records:
        lines.append(f"{r['step']:>4} {r['kind']:<7} {r['row']:>3} {r['position']:>6} {r['max_abs']:>9.4f} "
                     f"{'yes' if r['within'] else 'NO':>6} {str(r['flips']) + '/' + str(r['choices']):>11} "
                     f"{r['flips_here']:>4} {_fmt(r['first_flip'], 'd'):>10} {_fmt(r['flip_margin'], '.2e'):>9} "
                     f"{_fmt(r['topk_vs_own_logits'], 'd'):>8} {_fmt(r.get('graph_vs_eager'), '.2g'):>8}  "
                     f"{r['verdict']}")
    return "\n".join(lines)


def format_summary(name: str, s: dict) -> str:
    """The one-line summary of a run."""
    return (f"{name}: {s['within']}/{s['steps']} steps within tol, {s['flip']} flip ({s['flip_here']} with a "
            f"flip of the compared token itself), {s['fail']} FAIL (unexplained); flipped token-layer choices "
            f"{s['flipped_choices']}/{s['choices']} ({100 * s['flip_share']:.2f}%, limit "
            f"{100 * MAX_FLIP_SHARE:.0f}%), first flip at step "
            f"{_fmt(s['first_flip'], 'd')} (margin {_fmt(s['first_flip_margin'], '.2e')}); worst abs "
            f"{s['worst_abs']:.4g}, {_fmt(s['worst_abs_no_flip'])} before any flip; tokens equal where "
            f"decided {s['tokens_equal']}/{s['decided']} -> {'PASS' if s['passed'] else 'FAIL'}")


# -------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="nvfp4,bf16")
    ap.add_argument("--config", default="full", help="a preset (full, tiny) or a folder with config.json")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (no timing, no CUDA graphs)")
    ap.add_argument("--ref-chunk", type=int, default=64, help="reference prefill chunk (memory)")
    ap.add_argument("--long-context", type=int, default=0,
                    help="also prefill this many tokens (e.g. 100000) and compare decode steps after it")
    ap.add_argument("--long-steps", type=int, default=8)
    ap.add_argument("--kernels", default=None,
                    help="override the build's kernel backend at load time: torch (reference ops) "
                         "or triton; to tell kernel bugs from the model's own rounding sensitivity")
    ap.add_argument("--builds", default=None,
                    help="folder with prebuilt full-<fmt>-b1 builds (cross-compiled: flintc compile "
                         "--config full --load-format dummy --format FMT --device cuda --no-check "
                         "--max-batch 1 --out DIR/full-FMT-b1); default: compile here")
    ap.add_argument("--build-prefix", default="full", help="builds are <builds>/<prefix>-<fmt>-b1")
    ap.add_argument("--no-graph-check", action="store_true",
                    help="do not replay the CUDA graph after each eager decode step")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from flintc.checkpoint.loader import load_checkpoint
    from flintc.model.reference import FlintModel
    from flintc.runtime.build import BuildOptions, compile_model
    from flintc.runtime.compiled import load_build
    from flintc.runtime.runner import ReferenceRunner

    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    results = []
    for fmt in args.formats.split(","):
        _empty_cache(dev)
        t0 = time.perf_counter()
        if Path(args.config).exists():  # a folder with config.json (e.g. full widths, fewer layers)
            ckpt = load_checkpoint(args.config, load_format="dummy", fmt=fmt, device=dev, progress=False)
        else:
            ckpt = load_checkpoint(None, load_format="dummy", config=args.config, fmt=fmt, device=dev,
                                   progress=False)
        _sync(dev)
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        if args.builds:
            build = Path(args.builds) / f"{args.build_prefix}-{fmt}-b1"
            t_compile = float("nan")  # cross-compiled on another machine
        else:
            build = Path(tempfile.mkdtemp()) / f"build-{fmt}"
            compile_model(ckpt, build, BuildOptions(max_batch=1, max_model_len=args.max_model_len,
                                                    backend=args.backend, device=args.device, check=False,
                                                    dump=False), progress=False, log=print)
            t_compile = time.perf_counter() - t0
        runner = load_build(build, ckpt=ckpt, device=args.device, progress=False)
        if args.kernels:
            from flintc.runtime.kernels import KernelTable

            runner._tables = {st: KernelTable(args.kernels, st) for st in ("decode", "prefill")}
        ref = ReferenceRunner(FlintModel(ckpt.config, ckpt.weights, max_positions=runner.cache_rows),
                              max_batch=1, max_model_len=min(args.max_model_len, runner.max_model_len),
                              prefill_chunk=args.ref_chunk)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, ckpt.config.vocab_size, (args.prompt_len,), generator=g).tolist()

        records = compare_run(runner, ref, [prompt], args.steps, graph_check=not args.no_graph_check)
        s = summarize(records)
        name = f"{fmt} ({build.name}, kernels {args.kernels or 'build'})"
        print(f"\n{name}: teacher-forced steps, compiled (eager, experts logged) vs reference")
        print(format_steps(records))
        print("SUMMARY " + format_summary(name, s), flush=True)
        print(json.dumps({"format": fmt, "kernels": args.kernels or "build", "summary": s}), flush=True)

        ms = e2e = kernels = None
        if gpu:
            ms = _time_decode(runner)
            e2e = _time_e2e(runner, args.prompt_len + args.steps)
            print(json.dumps({"format": fmt, "decode_ms_1k": ms, "e2e_ms_1k": e2e}), flush=True)
            try:
                kernels = runner.graph_kernel_count(1)
            except Exception as exc:  # noqa: BLE001 - a diagnostic
                kernels = f"failed: {exc}"[:80]
            print(json.dumps({"format": fmt, "graph_kernels": kernels}), flush=True)
        long = {}
        if args.long_context:
            long = _long_context(runner, ckpt, args)
            if gpu:
                long["decode_ms"] = _time_decode(runner)  # the static inputs now sit at the long context
                long["e2e_ms"] = _time_e2e(runner, args.long_context + args.long_steps)
        r = {"format": fmt, "build": str(build), "kernels": args.kernels or "build", "load_s": round(t_load, 1),
             "compile_s": round(t_compile, 1), "prefill_s": round(records[0]["seconds"], 2),
             "prompt_len": args.prompt_len, "summary": s, "records": records, "decode_ms": ms, "e2e_ms": e2e,
             "graph_kernels": kernels, "kernels_per_forward_plan": runner.kernels_per_forward.get("decode_b1"),
             "implementations": runner.plan["decode_b1"]["implementations"], "long": long}
        results.append(r)
        del runner, ref, ckpt
        _empty_cache(dev)

    text = _markdown(results, args, dev)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ok = all(r["summary"]["passed"] and (not r["long"] or r["long"]["summary"]["passed"]) for r in results)
    return 0 if ok else 1


def _markdown(results: list[dict], args, dev) -> str:
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    lines = [(f"Device: {device}; torch {torch.__version__}; backend {args.backend}; config {args.config}; "
             f"max_model_len {args.max_model_len}; tolerance atol {ATOL} (prefill {PREFILL_ATOL}) rtol {RTOL}; "
             f"flips allowed in <= {100 * MAX_FLIP_SHARE:.0f}% of the token-layer choices"), "",
             ("Verdicts per step: ok = within tolerance; flip = outside it after an expert choice of the "
             "sequence differed (at or before the step); FAIL = outside it with the same experts chosen."), "",
             (f"| format | kernels | compile s | prefill s (1 x {args.prompt_len} tok) | steps within tol | flip "
             "(at the compared token) | FAIL | flipped token-layer choices | first flip (step, margin) | worst abs diff | worst abs before "
             "any flip | tokens equal where decided | top-k vs own logits | graph vs eager | decode ms (b1, graph "
             "replay) | end to end ms/token | kernels in CUDA graph | kernels (plan) | result |"),
             "|" + "---|" * 19]
    for r in results:
        s = r["summary"]
        lines.append(
            f"| {r['format']} | {r['kernels']} | {r['compile_s']} | {r['prefill_s']} | {s['within']}/{s['steps']} | "
            f"{s['flip']} ({s['flip_here']}) | {s['fail']} | {s['flipped_choices']}/{s['choices']} "
            f"({100 * s['flip_share']:.2f}%) | "
            f"{_fmt(s['first_flip'], 'd')}, {_fmt(s['first_flip_margin'], '.2e')} | {s['worst_abs']:.4g} | "
            f"{_fmt(s['worst_abs_no_flip'])} | {s['tokens_equal']}/{s['decided']} | {_fmt(s['topk_vs_own_logits'], 'd')} | "
            f"{_fmt(s['graph_vs_eager'], '.2g')} | {_fmt(r['decode_ms'], '.3f')} | {_fmt(r['e2e_ms'], '.3f')} | "
            f"{_fmt(r['graph_kernels'], '')} | {r['kernels_per_forward_plan']} | {'pass' if s['passed'] else 'FAIL'} |")
    if args.long_context:
        lines += ["", (f"Long context: compiled prefill of {args.long_context} tokens, then {args.long_steps} "
                  "decode steps from the same cache state on both (the reference gets a copy of the "
                  "compiled runtime's KV cache):"), "",
                  ("| format | prefill s | prefill tok/s | steps within tol | flip | FAIL | flipped choices | "
                  "worst abs diff | worst abs before any flip | tokens equal where decided "
                  "| decode ms at this context (graph replay) | end to end ms/token | result |"),
                  "|" + "---|" * 13]
        for r in results:
            lg, s = r["long"], r["long"]["summary"]
            lines.append(f"| {r['format']} | {lg['prefill_s']:.2f} | {lg['tok_per_s']:.0f} | {s['within']}/{s['steps']} "
                         f"| {s['flip']} | {s['fail']} | {s['flipped_choices']}/{s['choices']} | {s['worst_abs']:.4g} "
                         f"| {_fmt(s['worst_abs_no_flip'])} | {s['tokens_equal']}/{s['decided']} | "
                         f"{_fmt(lg.get('decode_ms'), '.3f')} | {_fmt(lg.get('e2e_ms'), '.3f')} | "
                         f"{'pass' if s['passed'] else 'FAIL'} |")
    for r in results:
        for title, recs in (("", r["records"]), (" (long context)", r["long"].get("records", []))):
            off = [x for x in recs if x["verdict"] != "ok"]
            if not off:
                continue
            lines += ["", f"{r['format']}{title}: steps outside the tolerance", "",
                      ("| step | position | max abs | flipped choices at this step | of the compared token | first flip at step "
                      "| largest reference top-k margin of this step's flips | verdict |"), "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {x['step']} | {x['position']} | {x['max_abs']:.4g} | {x['flips']}/{x['choices']} | "
                      f"{x['flips_here']} | {_fmt(x['first_flip'], 'd')} | {_fmt(x['flip_margin'], '.2e')} | {x['verdict']} |" for x in off]
    lines.append("")
    for r in results:
        lines.append(f"{r['format']} kernel implementations: " + ", ".join(
            f"{k}: {v.split('.')[-1] if not v.startswith('reference') else 'REFERENCE'}"
            for k, v in r["implementations"].items()))
    return "\n".join(lines)


def _empty_cache(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _long_context(runner, ckpt, args) -> dict:
    """Prefill --long-context tokens with the compiled runtime (chunked), then decode
    --long-steps tokens on it and on the reference model from a copy of its KV cache,
    experts logged as in `compare_run`."""
    from flintc.model.reference import FlintModel
    from flintc.runtime.runner import ReferenceRunner

    n = args.long_context
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, ckpt.config.vocab_size, (n,), generator=g).tolist()
    _sync(runner.device)
    t0 = time.perf_counter()
    logits = runner.prefill(0, prompt)
    _sync(runner.device)
    dt = time.perf_counter() - t0
    _attention_op_check(runner, n)
    ref = ReferenceRunner(FlintModel(ckpt.config, ckpt.weights, max_positions=runner.cache_rows),
                          max_batch=1, max_model_len=n + args.long_steps + 1, prefill_chunk=64)
    for mine, theirs in zip(runner.kv, ref.kv):
        rows = theirs.shape[1]
        theirs[0].copy_(mine[0, :rows])
    tok = int(logits.argmax())
    records = compare_decode_run(runner, ref, [0], [tok], [n], args.long_steps,
                                 graph_check=not args.no_graph_check)
    s = summarize(records)
    print(f"\n{ckpt.fmt} long context ({n} tokens): decode steps from a copy of the compiled cache")
    print(format_steps(records))
    print("SUMMARY " + format_summary(f"{ckpt.fmt} long context", s), flush=True)
    out = {"prefill_s": dt, "tok_per_s": n / dt, "summary": s, "records": records}
    del ref
    _empty_cache(runner.device)
    print(json.dumps({"long_context": {k: v for k, v in out.items() if k != "records"}}), flush=True)
    return out


def _attention_op_check(runner, n: int) -> None:
    """The decode-attention kernels against their reference ops on the runtime's own
    caches after the long prefill (a full and a sliding layer, position n)."""
    import flintc.ops  # noqa: F401

    c = runner.config
    K = runner._tables["decode"]
    for i in (c.layer_types.index("full_attention"), c.layer_types.index("sliding_attention")):
        kc, vc = runner.kv[2 * i], runner.kv[2 * i + 1]
        window = 0 if c.layer_types[i] == "full_attention" else c.sliding_window
        q = torch.randn(1, 1, c.num_attention_heads, c.head_dim, device=kc.device).to(torch.bfloat16)
        sinks = torch.randn(c.num_attention_heads, device=kc.device)
        slots = torch.tensor([0], device=kc.device)
        for p in (n - 1, min(n - 1, 4000), min(n - 1, 600)):
            pos = torch.tensor([[p]], device=kc.device)
            splits = 32 if window == 0 else 3
            o1, l1 = K.decode_attention(q, kc, vc, slots, pos, window, splits)
            a1 = K.attention_combine(o1, l1, sinks)
            o2, l2 = torch.ops.flintc.decode_attention(q, kc, vc, slots, pos, window, splits)
            a2 = torch.ops.flintc.attention_combine(o2, l2, sinks)
            print(json.dumps({"attention_check": {"layer": i, "window": window, "position": p,
                                                  "max_abs": float((a1.float() - a2.float()).abs().max()),
                                                  "lse_max_abs": float((l1 - l2).abs().nan_to_num(0).max()),
                                                  "impl": K.implementation("decode_attention")}}), flush=True)


def _time_e2e(runner, pos: int, iters: int = 30) -> float:
    """ms per token of the whole loop at batch 1: copy the token in, replay, greedy
    sampling on the device, the token back to the host (what generation does)."""
    from flintc.sampling import SamplingParams, sample

    params = [SamplingParams(temperature=0)]
    tok = 1
    for _ in range(3):
        tok = int(sample(runner.decode([0], [tok], [pos]), params, [None])[0])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(iters):
        tok = int(sample(runner.decode([0], [tok], [pos]), params, [None])[0])
    return 1000 * (time.perf_counter() - t0) / iters


def _time_decode(runner, iters: int = 50, repeats: int = 7) -> float:
    """Median ms per decode step at batch 1: replays of the captured CUDA graph."""
    graph = runner.decode_graph(1)[0]
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
