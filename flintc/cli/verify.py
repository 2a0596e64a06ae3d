"""`flintc verify`: run the decode and prefill pipelines with every check on and print
the per-pass table; exit 0 only if every pass met its declared expectation. A pass that
fails its checks (a missed numeric expectation, an illegal graph, its own verify) ends
its pipeline: the table of the passes that ran, the failed one last, FAILED in its `ok`
column, and the error are printed, --json records the report, the other steps are still
checked, and the command exits 1."""

from __future__ import annotations

import argparse

from flintc.cli.graphs import (add_model_args, build_targets, check_failures, check_pass_flags, check_target_options,
                               format_table, options_note, pass_options, target_count, target_subfolder)


def add_parser(sub) -> None:
    from flintc.cli import HelpFormatter

    p = sub.add_parser("verify", help="check every pass numerically and print the per-pass table",
                       description=__doc__, formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--step", choices=("decode", "prefill", "both"), default="both",
                   help="the pipelines to check")
    p.add_argument("--json", dest="json_out", default=None, help="also write the reports as JSON to this file (its folder must exist)")
    p.set_defaults(func=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from flintc.passes.pipeline import compile_step

    if args.json_out is not None:  # refused now, not after every pass has run (an empty one too)
        from flintc.cli.compile_build import check_output_file
        from flintc.config import PRESETS

        config_path = None if args.config in PRESETS else args.config
        check_output_file(args.json_out, "--json", [("MODEL", args.model), ("--config", config_path),
                                                    ("--hf-config-path", args.hf_config_path)])
    from flintc.passes.pipeline import env_dump_dir

    steps = ("decode", "prefill") if args.step == "both" else (args.step,)
    disabled = check_pass_flags(args, steps)  # before the first header
    # $FLINTC_DUMP_DIR: each step's subfolder (and, for the two targets of --config full,
    # its counts/ and numerics/, as `flintc dump` names them: one would clear the other's
    # dumps) refused before the models are built and the first pass
    n = target_count(args)
    dump_dirs = {(i, step): env_dump_dir(step, *_shape(args, step), target=target_subfolder(i, n))
                 for i in range(n) for step in steps}
    targets = build_targets(args)
    check_target_options(args, targets, steps)
    ok, reports = True, []
    for i, target in enumerate(targets):
        for step in steps:
            batch, tokens = _shape(args, step)
            options = pass_options(args, step)
            shape = f"B={batch}" + ("" if tokens is None else f", T={tokens}")
            print(f"\n== {step} ({', '.join(filter(None, (shape, options_note(options))))}) -- {target.note}")
            try:
                _, report = compile_step(target.model, step, batch=batch, tokens=tokens,
                                         cache_len=args.cache_len, disabled=disabled[step],
                                         check_model=target.check_model, seed=args.seed,
                                         options=options,
                                         dump_dir=dump_dirs[i, step] or False)
            except check_failures() as exc:  # a missed expectation, an illegal graph, a failed verify
                # as `flintc dump`: the table of the passes that ran, the failed one last,
                # then the next step (a captured graph that failed its legality check has none)
                report = exc.report
                if report is not None:
                    print(format_table(report))
                print(f"FAILED: {exc}")
                ok = False
                reports.append(_report_dict(report, options) if report is not None else
                               {"step": step, "batch": batch, "tokens": tokens, "options": options,
                                "checked": False, "passed": False, "skipped": [], "stages": [],
                                "error": str(exc)})
                continue
            print(format_table(report))
            reports.append(_report_dict(report, options))
            ok &= report.passed
    if args.json_out is not None:
        from flintc.fileio import write_json_atomic

        write_json_atomic(args.json_out, {"passed": ok, "reports": reports})
    print("\nall passes met their expectations" if ok else "\nsome pass missed its expectation")
    return 0 if ok else 1


def _shape(args, step: str) -> tuple[int, int | None]:
    """(batch, tokens) of `step`: decode at --batch, prefill of one sequence of --tokens."""
    return (args.batch, None) if step == "decode" else (1, args.tokens)


def _report_dict(report, options: dict) -> dict:
    """--json's entry of one step: `PipelineReport.as_dict()` with the pass options it ran
    with after `tokens` (`options`, as report.json of `flintc dump` records them)."""
    data = report.as_dict()
    keys = list(data)
    at = keys.index("tokens") + 1
    return {**{k: data[k] for k in keys[:at]}, "options": dict(options), **{k: data[k] for k in keys[at:]}}
