"""`flintc bench`: one command that measures, in a single run on the device, the copy
bandwidth and bf16 matmul rate (the ceilings), flintc's decode step (forward only and
end to end, at each context and batch) and prefill (at each length) for each weight
format, the same steps of the baselines on the same weights (the eager reference model,
torch.compile max-autotune of it, and, asked for, of the fast plain-PyTorch model of
flintc.bench.fast_model), kernels per forward from the captured CUDA graph,
each figure as a share of its roofline, and where one decode step's time goes kernel by
kernel. Writes bench.json, bench.md and PNG plots into --out and prints the table.
`--from-json` re-renders (and merges) earlier runs without measuring."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from glob import escape as glob_escape
from pathlib import Path

from flintc.errors import InputError, json_type, listing


def _items(text: str, flag: str, expected: str) -> list[str]:
    """The stripped items of the comma-separated list `text` given for `flag`, the parser
    every list option of bench shares. Raises InputError naming `flag`: no item at all,
    or an empty one (`1,,2`, `1,`, `,`); `expected` says what the items should be, with
    an example ("comma-separated positive integers, e.g. 1,2,4")."""
    if not text.strip():
        raise InputError(f"{flag}: expected at least one value: {expected}")
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise InputError(f"{flag} {text!r}: empty item; expected {expected}")
    return items


def _once(values: list, text: str, flag: str, show=str) -> list:
    """`values` (parsed from `text`, given for `flag`) when each is there once. Raises
    InputError naming `flag` and the repeated values: they were measured twice."""
    twice = list(dict.fromkeys(v for i, v in enumerate(values) if v in values[:i]))  # each repeated value once
    if twice:
        raise InputError(f"{flag} {text!r}: {', '.join(map(show, twice))} given twice; give each value once")
    return values


def _ints(text: str, flag: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] for `flag`; `_` separators and 1e5 are accepted. Raises
    InputError naming `flag` and the bad item: an empty one (`1,,2`), one that is not a
    whole number, one below 1, or one given twice (`_once`)."""
    vals = []
    for item in _items(text, flag, "comma-separated positive integers, e.g. 1,2,4"):
        x = item.replace("_", "")
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
    return _once(vals, text, flag)


def _points(text: str | None, what: str) -> list[tuple[int, int]] | None:
    """'1x1024,8x8192' -> [(1, 1024), (8, 8192)] (batch x context); None (the default
    points) for None, the flag left out. Raises InputError naming the flag `what`: no
    item at all ('' used to mean the default points, silently), an empty item, or one
    that is not two positive integers joined by x."""
    if text is None:
        return None
    pts = []
    for piece in _items(text, what, "comma-separated BATCHxCONTEXT items, e.g. 1x1024,8x8192"):
        try:
            b, c = (int(x) for x in piece.lower().split("x"))
        except ValueError:
            b = c = 0
        if b < 1 or c < 1:
            raise InputError(f"{what}: expected BATCHxCONTEXT items of positive integers like 1x1024, "
                             f"got {piece!r}")
        pts.append((b, c))
    return _once(pts, text, what, lambda p: f"{p[0]}x{p[1]}")


def _none_or(text: str, flag: str, expected: str, parse) -> list:
    """[] for 'none' (spaces around allowed), else `parse(text)`: the lists that may be
    empty on purpose (--prefill, --baselines). Raises InputError naming `flag` for ''
    (it used to mean none, silently); `expected` says what else the flag takes."""
    if not text.strip():
        raise InputError(f"{flag}: expected at least one value, or none: {expected}")
    return [] if text.strip() == "none" else parse(text)


def _names(text: str, flag: str, choices: tuple[str, ...]) -> list[str]:
    """'bf16,nvfp4' -> ['bf16', 'nvfp4'] for `flag`. Raises InputError naming `flag`: an
    empty item, a name not in `choices`, or one given twice (`_once`)."""
    names = _items(text, flag, f"comma-separated names out of {', '.join(choices)}")
    for name in names:
        if name not in choices:
            raise InputError(f"{flag}: unknown value {name!r} (expected {', '.join(choices)})")
    return _once(names, text, flag)


def _load_report(path: str) -> dict:
    """A bench.json given to --from-json. Raises InputError naming the file when it is
    not JSON or not a bench report (an object with a "meta" object, and lists of
    records where a report has them), e.g. a build.json, or when a record lacks a field
    the report reads or holds one of another kind (`flintc.bench.report.check_records`:
    the message names the record, e.g. decode[0], the field and what was expected)."""
    from flintc.bench.report import LIST_KEYS, RecordError, check_records

    try:
        data = json.loads(Path(path).read_bytes())  # UTF-8, -16 or -32, as json detects
    except OSError as e:  # missing, a folder, unreadable: the flag named, as its other errors
        raise InputError(f"--from-json {path}: cannot read it ({e.strerror or e}); expected a bench.json "
                         "written by flintc bench") from None
    except json.JSONDecodeError as e:
        raise InputError(f"--from-json {path}: not valid JSON: {e}") from None
    except UnicodeDecodeError as e:  # e.g. a .npy from --logits-out
        raise InputError(f"--from-json {path}: not valid JSON: not UTF-8 text (byte {e.start}: "
                         f"0x{e.object[e.start]:02x}); expected a bench.json written by flintc bench") from None
    except (RecursionError, ValueError) as e:  # arrays nested past the recursion limit; an
        # integer of more than sys.get_int_max_str_digits() digits
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
        raise InputError(f"--from-json {path}: not valid JSON for flintc bench ({what}); expected a "
                         "bench.json written by flintc bench") from None
    what = "a bench.json written by flintc bench (a JSON object with \"meta\" and \"ceilings\" objects)"
    if not isinstance(data, dict):
        raise InputError(f"--from-json {path}: expected {what}; got a JSON {json_type(data)}")
    for key in ("meta", "ceilings"):
        if not isinstance(data.get(key), dict):
            raise InputError(f"--from-json {path}: expected {what}; it has no {key!r} object"
                             + (" (it is a build's build.json)" if "build_version" in data else ""))
    for key in (*LIST_KEYS, "notes", "failures"):
        value = data.get(key, [])
        item = (lambda r: isinstance(r, str)) if key == "notes" else (lambda r: isinstance(r, dict))
        if not isinstance(value, list) or not all(map(item, value)):
            raise InputError(f"--from-json {path}: expected {what}; its {key!r} is not a list of "
                             f"{'strings' if key == 'notes' else 'records (objects)'}")
    try:
        check_records(data)
    except RecordError as e:
        raise InputError(f"--from-json {path}: {e}; not a bench.json as flintc bench writes it (was it "
                         "edited?)") from None
    return data


class _Given(argparse.Action):
    """action="store" that also records its option in `measure_flags` whenever it is
    typed (any spelling: --formats=x, an abbreviation, its default value): the options
    that only a measurement reads, which `run_bench_cli` refuses with --from-json (they
    were ignored silently there, --formats bogus included). Public argparse API only
    (argparse.Action), not argparse's private _StoreAction classes."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.measure_flags = (*getattr(namespace, "measure_flags", ()), self.option_strings[0])
        setattr(namespace, self.dest, values)


class _GivenTrue(_Given):
    """action="store_true" that records its option as `_Given`."""

    def __init__(self, option_strings, dest, default=False, required=False, help=None):
        super().__init__(option_strings, dest, nargs=0, const=True, default=default, required=required,
                         help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, self.const, option_string)


# read by --from-json too; every other option of bench is a measurement's (`_Given`)
FROM_JSON_OPTIONS = ("--from-json", "--out", "--no-plots", "-h")


def add_parser(sub) -> None:
    from flintc.cli import HelpFormatter
    from flintc.cli.args import device_name

    p = sub.add_parser("bench", help="benchmark flintc against its roofline and baselines",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="BF16 checkpoint folder or NVFP4 .gguf. With --load-format dummy (the default) only "
                        "its config is used and the weights are random (a notice says so); --load-format auto "
                        "measures its own weights. Default: random weights of --config")
    p.add_argument("--load-format", action=_Given, choices=("auto", "dummy"), default="dummy",
                   help="dummy: random weights made on the device (timings do not depend on weight values); "
                        "auto: MODEL's own weights")
    p.add_argument("--config", action=_Given, default="full",
                   help="with dummy weights and no MODEL: preset tiny or full")
    p.add_argument("--hf-config-path", action=_Given, default=None, help="config folder for a .gguf MODEL")
    p.add_argument("--formats", action=_Given, default="bf16,nvfp4", help="weight formats to measure (comma-separated)")
    p.add_argument("--contexts", action=_Given, default=None,
                   help="decode context lengths (tokens in the sequence, the new one included); at most the "
                        "model's max_position_embeddings (default: 1024,8192,32768,100000,262144, those of them "
                        "the model serves, or its max_position_embeddings when it serves none)")
    p.add_argument("--batches", action=_Given, default="1,2,4,8", help="decode batch sizes (sequences per step)")
    p.add_argument("--prefill", action=_Given, default=None,
                   help="prefill lengths (tokens), or none; at most the model's "
                   "max_position_embeddings (default: 1024,8192, those of them the model serves)")
    p.add_argument("--baselines", action=_Given, default="eager,compile",
                   help="eager, compile (torch.compile max-autotune of the reference model) and/or fast "
                        "(torch.compile max-autotune of the fast bf16 model, flintc.bench.fast_model), or none")
    p.add_argument("--baseline-points", action=_Given, default=None,
                   help="BATCHxCONTEXT points for the baselines (default: eager at batch 1 at every context "
                        "and at every batch at the first context; compile and fast at 1x1024, 1x100000, 8x1024)")
    p.add_argument("--breakdown", action=_Given, default=None,
                   help="BATCHxCONTEXT points for the per-kernel breakdown, among the decode points measured "
                        "(BATCH in --batches, CONTEXT in --contexts) (default 1x100000,8x8192 where measured)")
    p.add_argument("--builds", action=_Given, default=None,
                   help="folder holding builds (any subfolder with build.json for these weights); a missing "
                        "one is compiled there (default: OUT/builds)")
    p.add_argument("--build-glob", action=_Given, default=None,
                   help="comma-separated shell patterns: only builds in --builds whose folder name matches "
                        "one are used (e.g. 'full-nvfp4*,full-bf16*'; default: every build for these weights). "
                        "A missing build is compiled only when its name, CONFIG-FORMAT (e.g. full-bf16), matches "
                        "a pattern; patterns that match no build there of --formats (its weight format) and no such name are "
                        "an error")
    p.add_argument("--no-compile", action=_GivenTrue,
                   help="never compile a missing build (report it instead): compiling the full model takes minutes")
    p.add_argument("--backend", action=_Given, choices=("triton", "torch"), default=None,
                   help="only use (and compile) builds of this backend (default: triton on cuda, torch on cpu)")
    p.add_argument("--build-caches", action=_GivenTrue,
                   help="allocate each build's KV caches as compiled (max batch slots x max model len "
                        "positions); by default a build whose functions do not depend on the cache length gets "
                        "caches sized to the longest context it serves here (as long as they fit in the free "
                        "device memory), so it can also serve contexts beyond its max model len")
    p.add_argument("--max-model-len", action=_Given, type=int, default=None,
                   help="max model length of a build compiled here: at least 2, at most the model's "
                        "max_position_embeddings, and with --build-caches at least the longest --contexts / "
                        "--prefill point (without it, a build's resizable caches are sized to the points it "
                        "serves, longer ones included; a length too short for resizable caches is refused) "
                        "(default: the longest point, at least 2)")
    p.add_argument("--device", action=_Given, type=device_name, default="cuda", help="cuda or cpu")
    p.add_argument("--warmup", action=_Given, type=int, default=None, help="warm-up runs per point (default 10; cpu 1)")
    p.add_argument("--iters", action=_Given, type=int, default=None,
                   help="timed graph replays per point (default 100; cpu 2)")
    p.add_argument("--e2e-iters", action=_Given, type=int, default=None,
                   help="timed end-to-end steps (default 50; cpu 2)")
    p.add_argument("--prefill-iters", action=_Given, type=int, default=None,
                   help="timed prefills per length (default 5; cpu 1)")
    p.add_argument("--rotations", action=_Given, type=int, default=None,
                   help="input sets rotated between runs (token ids, slots) (default 8; cpu 2)")
    p.add_argument("--sampling", action=_Given, choices=("default", "greedy"), default="default",
                   help="end-to-end sampling: Flint's defaults (temperature 1, top-k 20, top-p 0.95) or greedy")
    p.add_argument("--time-budget", action=_Given, type=float, default=None,
                   help="seconds for the whole run (> 15: the last 15 s are kept for writing the outputs): "
                        "later points are skipped (with a note) when it is spent (default: no limit)")
    p.add_argument("--step-timeout", action=_Given, type=float, default=None,
                   help="seconds (> 0) one measurement may take before it is abandoned (with a note) "
                        "(default: no limit)")
    p.add_argument("--no-flintc", action=_GivenTrue, help="measure only the ceilings and the baselines")
    p.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    p.add_argument("--from-json", action="append", default=None, metavar="BENCH_JSON",
                   help="do not measure: merge these bench.json files (repeatable) and write the report; "
                        "only --out and --no-plots go with it (an option of a measurement is refused)")
    p.add_argument("--out", required=True, help="folder for bench.json, bench.md and the plots")
    p.set_defaults(func=run_bench_cli, measure_flags=())


def _check_builds_folder(args: argparse.Namespace) -> None:
    """--builds must be a folder, or one bench can make when it compiles a missing build
    (not --no-compile): checked before anything is measured (a file given failed after
    the ceilings, as "<path>: File exists"). Raises InputError naming --builds."""
    from flintc.fileio import cannot_write_in

    builds = Path(args.builds)
    if builds.exists() and not builds.is_dir():
        raise InputError(f"--builds {args.builds}: exists and is a file, expected a folder (of builds)")
    if (builds / "build.json").is_file():  # a build given for the folder of builds: its own build
        # was never used, and the one compiled went inside it (BUILD/tiny-bf16)
        parent = builds.resolve().parent
        raise InputError(f"--builds {args.builds}: is a build (it holds build.json), expected the folder holding "
                         f"builds; pass --builds {shlex.quote(str(parent))} --build-glob "
                         f"{shlex.quote(glob_escape(builds.resolve().name))} to use it")
    if builds.exists() or args.no_compile or args.no_flintc:
        return  # read only, or not at all
    anc = builds.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise InputError(f"--builds {args.builds}: {anc} is a file, not a folder: cannot make the folder to compile "
                         "missing builds into")
    why = cannot_write_in(anc)
    if why:
        raise InputError(f"--builds {args.builds}: cannot make the folder to compile missing builds into ({anc}: "
                         f"{why}); pass --no-compile to use only the builds there are")


def _check_not_inside_a_build(path: str, flag: str) -> None:
    """Refuse `path` (--out, --builds) inside a BUILD at any depth (a folder above it holds
    build.json: `flintc.fileio.enclosing_build`): the next `flintc compile` into that BUILD
    replaces it whole, and the report and builds written there went with it. Raises
    InputError naming `flag`."""
    from flintc.fileio import enclosing_build

    folder = enclosing_build(path, itself=False)
    if folder is not None:
        raise InputError(f"{flag} {path}: inside the flintc BUILD {folder} (it holds build.json), which the "
                         f"next flintc compile into it replaces whole; choose a {flag} outside any BUILD")


def run_bench_cli(args: argparse.Namespace) -> int:
    """Exit code: 0, or 1 when a measurement failed (one line each on stderr, as they
    happen; bench.json's `failures` keeps their tracebacks) or flintc was to be measured
    and no point of it was (`flintc_unmeasured`: one line naming the builds that could
    not be used and why, or what was skipped). Bad options raise
    InputError before anything is written: an empty --out or --builds, an --out that
    cannot be written (`check_output_parents`)."""
    from flintc.cli.compile_build import check_not_empty, check_output_parents

    if args.from_json:  # a saved run is rendered: an option of a measurement would do nothing
        given = (["MODEL"] if args.model is not None else []) + list(getattr(args, "measure_flags", ()))
        if given:
            flag = given[0]
            raise InputError(f"{flag} {'(' + args.model + ') ' if flag == 'MODEL' else ''}applies to a "
                             "measurement, and --from-json measures nothing (it renders and merges saved "
                             f"bench.json files); drop {flag}, or --from-json to measure")
    check_output_parents(args.out, "--out")
    _check_not_inside_a_build(args.out, "--out")
    if Path(args.out).exists() and not Path(args.out).is_dir():  # it failed after the measurements
        raise InputError(f"--out {args.out}: exists and is a file, expected a folder (for bench.json, bench.md "
                         "and the plots)")
    if Path(args.out).is_dir():
        from flintc.fileio import foreign_files

        foreign = foreign_files(Path(args.out))
        if foreign:
            raise InputError(f"--out {args.out}: holds {listing(foreign, 3)} (a checkpoint or a build); "
                             "refusing to write bench.json, bench.md and the plots into it, choose "
                             "another --out")
    if args.builds is not None:
        check_not_empty(args.builds, "--builds", "a folder path (or leave --builds out for OUT/builds)")
        _check_not_inside_a_build(args.builds, "--builds")
        _check_builds_folder(args)
    out = Path(args.out)
    if args.from_json:
        from flintc.bench.report import merge_results, write_outputs

        runs = [_load_report(f) for f in args.from_json]
        write_outputs(merge_results(runs, sources=args.from_json), out, plots=not args.no_plots)
        return 0
    from flintc.bench.core import BenchOptions, run_bench

    baselines = _none_or(args.baselines, "--baselines", "comma-separated names out of eager, compile, fast",
                         lambda t: _names(t, "--baselines", ("eager", "compile", "fast")))
    points = _points(args.baseline_points, "--baseline-points")
    if not baselines and points:  # they would be ignored without a word
        raise InputError(f"--baseline-points {args.baseline_points}: sets the baselines' points, and "
                         "--baselines is none; drop --baseline-points, or name the baselines to measure")
    opts = BenchOptions(
        out=out, model=args.model, load_format=args.load_format,
        config=args.config if args.model is None else None, hf_config_path=args.hf_config_path,
        formats=_names(args.formats, "--formats", ("bf16", "nvfp4")),
        contexts=None if args.contexts is None else _ints(args.contexts, "--contexts"),
        batches=_ints(args.batches, "--batches"),
        prefill=None if args.prefill is None else _none_or(
            args.prefill, "--prefill", "comma-separated positive integers, e.g. 1024,8192",
            lambda t: _ints(t, "--prefill")),
        baselines=baselines, baseline_points=points,
        breakdown=_points(args.breakdown, "--breakdown"),
        builds=Path(args.builds) if args.builds else None,
        build_globs=None if args.build_glob is None else _items(
            args.build_glob, "--build-glob", "comma-separated shell patterns, e.g. 'full-nvfp4*,full-bf16*'"),
        backend=args.backend, device=args.device,
        warmup=args.warmup, iters=args.iters, e2e_iters=args.e2e_iters, prefill_iters=args.prefill_iters,
        rotations=args.rotations, time_budget=args.time_budget, step_timeout=args.step_timeout,
        run_flintc=not args.no_flintc, compile_missing=not args.no_compile, max_model_len=args.max_model_len,
        sampling=args.sampling, plots=not args.no_plots, size_caches=not args.build_caches,
        command="flintc " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"]
        else "flintc bench (python API)",
    )
    from flintc.runtime.compiled import check_environment
    from flintc.runtime.device import prepare_device

    # every option and FLINTC_* variable checked (InputError) before the notice and any output;
    # the exit status below reads these (resolving again after the run would check the
    # machine's state anew, its free memory say, and could turn a measured run into exit 2)
    resolved = opts.resolved()
    prepare_device(args.device)  # the Triton interpreter for cpu, before triton is imported
    check_environment(args.backend)
    if args.load_format == "dummy":
        print("flintc bench: note: " + (
            f"random (dummy) weights with {args.model}'s config, not its own weights (--load-format dummy, "
            "the default); pass --load-format auto to measure them" if args.model is not None else
            f"random (dummy) weights of the {args.config} config (no MODEL given)"), file=sys.stderr)
    results = run_bench(opts)
    from flintc.bench.core import flintc_unmeasured

    why = flintc_unmeasured(resolved, results)
    failures = results.get("failures", [])
    failed = (f"{len(failures)} measurement{'s' if len(failures) > 1 else ''} failed (see the notes above and "
              f"in {out / 'bench.md'}; their tracebacks are in {out / 'bench.json'})") if failures else ""
    if why:  # the report is written, but what was asked for was not measured
        print(f"flintc: error: no flintc point was measured: {why}"
              + (f"; {failed}" if failed else f" (report: {out / 'bench.md'})"), file=sys.stderr)
        return 1
    if failures:
        print(f"flintc: error: {failed}", file=sys.stderr)
        return 1
    return 0
