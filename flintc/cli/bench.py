"""`flintc bench`: one command that measures, in a single run on the device, the copy
bandwidth and bf16 matmul rate (the ceilings), flintc's decode step (forward only and
end to end, at each context and batch) and prefill (at each length) for each weight
format, the same steps of the baselines on the same weights (the eager reference model,
and torch.compile max-autotune of it), kernels per forward from the captured CUDA graph,
each figure as a share of its roofline, and where one decode step's time goes kernel by
kernel. Writes bench.json, bench.md and PNG plots into --out and prints the table.
`--from-json` re-renders (and merges) earlier runs without measuring."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from flintc.errors import InputError


def _ints(text: str, flag: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] for `flag`; `_` separators and 1e5 are accepted. Raises
    InputError naming `flag` and the bad item: an empty one (`1,,2`), one that is not a
    whole number, or one below 1."""
    if not text.strip():
        raise InputError(f"{flag}: expected at least one value, e.g. 1,2,4")
    vals = []
    for item in text.split(","):
        x = item.strip().replace("_", "")
        if not x:
            raise InputError(f"{flag} {text!r}: empty item; expected comma-separated positive integers, "
                             "e.g. 1,2,4")
        try:
            v = int(x) if "e" not in x.lower() else float(x)
        except ValueError:
            v = None
        if v is None or (isinstance(v, float) and not (math.isfinite(v) and v.is_integer())):
            raise InputError(f"{flag} {text!r}: {item.strip()!r} is not an integer; expected comma-separated "
                             "positive integers, e.g. 1,2,4")
        if v < 1:
            raise InputError(f"{flag} {text!r}: {item.strip()} is not a positive integer; each must be >= 1")
        vals.append(int(v))
    return vals


def _points(text: str | None, what: str) -> list[tuple[int, int]] | None:
    """'1x1024,8x8192' -> [(1, 1024), (8, 8192)] (batch x context)."""
    if not text:
        return None
    pts = []
    for piece in text.split(","):
        try:
            b, c = piece.lower().split("x")
            pts.append((int(b), int(c)))
        except ValueError:
            raise InputError(f"{what}: expected BATCHxCONTEXT items like 1x1024, got {piece!r}") from None
    return pts


def add_parser(sub) -> None:
    from flintc.cli import HelpFormatter

    p = sub.add_parser("bench", help="benchmark flintc against its roofline and baselines",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="BF16 checkpoint folder or NVFP4 .gguf (default: dummy weights of --config)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="dummy",
                   help="dummy: random weights made on the device")
    p.add_argument("--config", default="full", help="with dummy weights and no MODEL: preset tiny or full")
    p.add_argument("--hf-config-path", default=None, help="config folder for a .gguf MODEL")
    p.add_argument("--formats", default="bf16,nvfp4", help="weight formats to measure (comma-separated)")
    p.add_argument("--contexts", default="1024,8192,32768,100000,262144",
                   help="decode context lengths (tokens in the sequence, the new one included)")
    p.add_argument("--batches", default="1,2,4,8", help="decode batch sizes (sequences per step)")
    p.add_argument("--prefill", default="1024,8192", help="prefill lengths (tokens)")
    p.add_argument("--baselines", default="eager,compile",
                   help="eager and/or compile (torch.compile max-autotune), or none")
    p.add_argument("--baseline-points", default=None,
                   help="BATCHxCONTEXT points for the baselines (default: eager at batch 1 at every context "
                        "and at every batch at the first context; compile at 1x1024, 1x100000, 8x1024)")
    p.add_argument("--breakdown", default=None,
                   help="BATCHxCONTEXT points for the per-kernel breakdown (default 1x100000,8x8192 where measured)")
    p.add_argument("--builds", default=None,
                   help="folder holding builds (any subfolder with build.json for these weights); a missing "
                        "one is compiled there (default: OUT/builds)")
    p.add_argument("--no-compile", action="store_true",
                   help="never compile a missing build (report it instead): compiling the full model takes minutes")
    p.add_argument("--backend", choices=("triton", "torch"), default=None,
                   help="only use (and compile) builds of this backend (default: triton on cuda, torch on cpu)")
    p.add_argument("--build-caches", action="store_true",
                   help="allocate each build's KV caches as compiled (max batch slots x max model len "
                        "positions); by default a build whose functions do not depend on the cache length gets "
                        "caches sized to the longest context it serves here (as long as they fit in the free "
                        "device memory), so it can also serve contexts beyond its max model len")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="max model length of a build compiled here (default: the largest context)")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per point (default 10; cpu 1)")
    p.add_argument("--iters", type=int, default=None, help="timed graph replays per point (default 100; cpu 2)")
    p.add_argument("--e2e-iters", type=int, default=None, help="timed end-to-end steps (default 50; cpu 2)")
    p.add_argument("--prefill-iters", type=int, default=None, help="timed prefills per length (default 5; cpu 1)")
    p.add_argument("--rotations", type=int, default=None,
                   help="input sets rotated between runs (token ids, slots) (default 8; cpu 2)")
    p.add_argument("--sampling", choices=("default", "greedy"), default="default",
                   help="end-to-end sampling: Flint's defaults (temperature 1, top-k 20, top-p 0.95) or greedy")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run: later points are skipped (with a note) when it is spent")
    p.add_argument("--step-timeout", type=float, default=None,
                   help="seconds one measurement may take before it is abandoned (with a note)")
    p.add_argument("--no-flintc", action="store_true", help="measure only the ceilings and the baselines")
    p.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    p.add_argument("--from-json", action="append", default=None, metavar="BENCH_JSON",
                   help="do not measure: merge these bench.json files (repeatable) and write the report")
    p.add_argument("--out", required=True, help="folder for bench.json, bench.md and the plots")
    p.set_defaults(func=run_bench_cli)


def run_bench_cli(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.from_json:
        from flintc.bench.report import merge_results, write_outputs

        runs = []
        for f in args.from_json:
            try:
                runs.append(json.loads(Path(f).read_text()))
            except json.JSONDecodeError as e:
                raise InputError(f"--from-json {f}: not valid JSON: {e}") from None
        write_outputs(merge_results(runs), out, plots=not args.no_plots)
        return 0
    from flintc.cli.compile_build import prepare_device

    prepare_device(args.device)  # the Triton interpreter for cpu, before triton is imported
    from flintc.bench.core import BenchOptions, run_bench

    baselines = [] if args.baselines.strip() in ("", "none") else [b.strip() for b in args.baselines.split(",")]
    opts = BenchOptions(
        out=out, model=args.model, load_format=args.load_format,
        config=args.config if args.model is None else None, hf_config_path=args.hf_config_path,
        formats=[f.strip() for f in args.formats.split(",") if f.strip()],
        contexts=_ints(args.contexts, "--contexts"), batches=_ints(args.batches, "--batches"),
        prefill=[] if args.prefill.strip() in ("", "none") else _ints(args.prefill, "--prefill"),
        baselines=baselines, baseline_points=_points(args.baseline_points, "--baseline-points"),
        breakdown=_points(args.breakdown, "--breakdown"),
        builds=Path(args.builds) if args.builds else None, backend=args.backend, device=args.device,
        warmup=args.warmup, iters=args.iters, e2e_iters=args.e2e_iters, prefill_iters=args.prefill_iters,
        rotations=args.rotations, time_budget=args.time_budget, step_timeout=args.step_timeout,
        run_flintc=not args.no_flintc, compile_missing=not args.no_compile, max_model_len=args.max_model_len,
        sampling=args.sampling, plots=not args.no_plots, size_caches=not args.build_caches,
        command="flintc " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"]
        else "flintc bench (python API)",
    )
    run_bench(opts)
    return 0
