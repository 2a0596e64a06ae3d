"""`flintc dump`: compile a step and write its pass-by-pass dumps (readable code, DOT /
SVG per layer, ONNX, index.md, report.json) into --out.

The dumps are written into a temporary folder beside --out and renamed into place at
the end, so an interrupted dump (Ctrl-C, SIGTERM, an unexpected error) leaves nothing
behind, or, when the signal came during that final swap, the complete dumps (said on
stderr). A pass that fails its checks (a missed numeric expectation, an illegal graph,
its own verify: `check_failures`) is what the dumps are for: the dumps of the passes
that ran, the failed pass's output graph last, are moved into --out, their index.md and
report.json naming the failed pass and why, and the command prints the per-pass table of
the passes that ran (the failed one last, FAILED in its `ok` column) as it does on
success, then exits 2 with its error line and one more saying where the dumps are. An
existing --out is replaced only when it is empty or a previous dump output, a partial
one included."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from flintc.cli.graphs import (add_model_args, build_targets, check_failures, check_pass_flags, check_target_options,
                               format_table, options_note, pass_options, target_subfolder)
from flintc.errors import InputError, listing


def add_parser(sub) -> None:
    from flintc.cli import HelpFormatter

    p = sub.add_parser("dump", help="write pass-by-pass graph dumps", description=__doc__.split("\n\n")[0],
                       formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--out", required=True,
                   help="output folder (new, empty, or the output of an earlier flintc dump, which is replaced; "
                   "not in a BUILD, nor a checkpoint folder itself)")
    p.add_argument("--step", choices=("decode", "prefill"), default="decode", help="the pipeline to dump")
    p.set_defaults(func=run_dump)


def check_dump_out(out: str | Path) -> None:
    """Refuse an --out the dump would clobber, or an empty one (as given: `Path("")` is
    the current folder): one that is, or is inside at any depth, a BUILD, or that is a
    checkpoint folder (`flintc.fileio.checkpoint_or_build_problem`, as `$FLINTC_DUMP_DIR`;
    a new subfolder of a checkpoint is taken), or that holds a checkpoint's or a build's
    files, or other files and is no earlier dump, or is an earlier dump that also holds
    files no dump writes (`flintc.graph.dump.foreign_dump_files`).
    Raises InputError naming the path."""
    from flintc.cli.compile_build import check_output_folder
    from flintc.fileio import checkpoint_or_build_problem, follow_out_link, foreign_files, would_delete
    from flintc.graph.dump import foreign_dump_files, is_dump_output

    check_output_folder(out, "--out")
    problem = checkpoint_or_build_problem(follow_out_link(out))  # a link: its target is replaced
    if problem:
        raise InputError(f"--out {out}: {problem}; refusing to write dumps there, choose an --out outside any "
                         "BUILD and other than a checkpoint folder (a new subfolder of one is fine)")
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a folder")
    foreign = foreign_files(out)  # a lone config.json or .gguf, no checkpoint: still not to be replaced
    if foreign:
        raise InputError(f"--out {out}: holds {listing(foreign, 3)} (a checkpoint or a build); "
                         "refusing to write dumps into it, choose another --out")
    if any(out.iterdir()) and not is_dump_output(out):
        raise InputError(f"--out {out}: not empty and not the output of an earlier flintc dump "
                         "(no report.json and index.md); choose another --out")
    foreign = foreign_dump_files(out)  # a user's file beside an earlier dump: replaced whole, it would go
    if foreign:
        raise InputError(f"--out {out}: an earlier flintc dump that also holds {would_delete(foreign, 'dump')}")


def run_dump(args: argparse.Namespace) -> int:
    from flintc.fileio import final_output_error, move_into_place, temp_dir_beside
    from flintc.passes.pipeline import compile_step

    out = Path(args.out)
    check_dump_out(args.out)
    disabled = check_pass_flags(args, (args.step,))[args.step]  # before the model is built
    targets = build_targets(args)
    check_target_options(args, targets, (args.step,))
    options = pass_options(args, args.step)
    tmp = temp_dir_beside(out)
    tables = []
    try:
        try:
            for i, target in enumerate(targets):
                sub = target_subfolder(i, len(targets))
                batch, tokens = (args.batch, None) if args.step == "decode" else (1, args.tokens)
                _, report = compile_step(target.model, args.step, batch=batch, tokens=tokens,
                                         cache_len=args.cache_len, disabled=disabled,
                                         check_model=target.check_model, seed=args.seed,
                                         dump_dir=tmp / sub if sub else tmp,
                                         options=options)
                tables.append((target.note, out / sub if sub else out, format_table(report)))
        except check_failures() as exc:
            kept = _publish_partial(exc, tmp, out, args.step, [t.note for t in targets], failed=len(tables))
            report = getattr(exc, "report", None)  # none when the captured graph failed its legality check
            if report is not None and report.stages:
                sub = target_subfolder(len(tables), len(targets))
                tables.append((targets[len(tables)].note, out / sub if sub else out, format_table(report)))
            _print_tables(args.step, options, tables, kept)
            raise
        move_into_place(tmp, out, log=lambda msg: print(msg, file=sys.stderr))  # an interrupt in it: said
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it became a partial --out
        renamed = final_output_error(exc, tmp, out)  # a full disk names --out, not the hidden folder
        if renamed is not None:
            raise renamed from exc
        raise
    _print_tables(args.step, options, tables)
    return 0


def _print_tables(step: str, options: dict, tables: list[tuple[str, Path, str]], kept: bool = True) -> None:
    """Print on stdout each target's header (`step`, the pass `options` given, its note
    and, when its dumps were `kept`, the folder they are in) and per-pass table, `tables` holding (note, folder,
    table) in order; then flush, so that the table comes before an error line printed on
    stderr after it."""
    for note, where, table in tables:
        given = options_note(options)
        print(f"== {step}{f' ({given})' if given else ''} -- {note}" + (f" -> {where}" if kept else ""))
        print(table)
    print(end="", flush=True)  # not sys.stdout.flush(): None with stdout closed (`>&-`), which print skips


def _publish_partial(exc: BaseException, tmp: Path, out: Path, step: str, notes: list[str],
                     failed: int) -> bool:
    """Move the dumps written before the check failure `exc` (target `failed` of `notes`)
    from `tmp` into `out` and add a note to `exc` saying so. Every pipeline's own index.md
    and report.json already name its failed pass and why (`flintc.graph.dump`); with two
    targets (counts/, numerics/), index.md and report.json at the top say which one failed,
    so that the folder is an earlier dump (`is_dump_output`) however far it got. Nothing
    is published when no pipeline got to write its index (a capture that failed its
    legality check), nor when the move fails with an OSError (a full disk): `exc` is what
    to tell, and the note says the dumps were lost. An interrupt goes on up (`out`, when
    the signal came during the swap, is the partial dumps, said on stderr). Returns whether
    the dumps were moved into `out`."""
    from flintc.fileio import move_into_place, write_texts_atomic
    from flintc.graph.dump import is_dump_output

    subs = [target_subfolder(i, len(notes)) for i in range(len(notes))]
    if not any(is_dump_output(tmp / sub) for sub in subs):
        return False
    where = f"{out}/index.md"
    try:
        if len(notes) > 1:
            index, report = _partial_summary(exc, tmp, step, subs, notes, failed)
            write_texts_atomic({tmp / "index.md": index, tmp / "report.json": report})
        move_into_place(tmp, out, log=lambda msg: print(
            f"wrote {out} (the dumps up to the failed check) before the interrupt", file=sys.stderr))
    except OSError as os_exc:
        from flintc.fileio import final_output_error

        os_exc = final_output_error(os_exc, tmp, out) or os_exc  # names --out, not the hidden folder
        exc.add_note(f"the dumps up to the failed check could not be kept ({os_exc}); none written")
        return False
    exc.add_note(f"the dumps of the passes that ran, the failed one last, are in {out} (see {where})")
    return True


def _partial_summary(exc, tmp: Path, step: str, subs: list[str], notes: list[str],
                     failed: int) -> tuple[str, str]:
    """index.md and report.json at the top of a partial dump of several targets: which
    target failed and why (its report.json's `failed`, or `exc` when it wrote none), and
    a link to each target's own index."""
    import json

    from flintc.graph.dump import is_dump_output

    reason = str(exc)
    failed_report = tmp / subs[failed] / "report.json"
    if failed_report.is_file():
        stage = json.loads(failed_report.read_text()).get("failed")
        if stage:
            reason = f"pass {stage['index']} '{stage['name']}': {stage['reason']}"
    lines = [f"# flintc dump: {step} step, FAILED", "",
             f"Target `{subs[failed]}` ({notes[failed]}) stopped at a failed check: {reason}", ""]
    for i, sub in enumerate(subs):
        state = "complete" if i < failed else "up to the failed pass" if i == failed else "not run"
        link = f"[{sub}/index.md]({sub}/index.md)" if is_dump_output(tmp / sub) else f"{sub}/ (no dumps)"
        lines.append(f"- {link}: {notes[i]}, {state}")
    lines += ["", "Overall: **FAILED**."]
    report = {"step": step, "passed": False, "failed": {"target": subs[failed], "reason": reason},
              "targets": {sub: f"{sub}/report.json" for sub in subs if is_dump_output(tmp / sub)}}
    return "\n".join(lines) + "\n", json.dumps(report, indent=2) + "\n"
