"""`flintc dump`: compile a step and write its pass-by-pass dumps (readable code, DOT /
SVG per layer, ONNX, index.md, report.json) into --out.

The dumps are written into a temporary folder beside --out and renamed into place at
the end, so an interrupted dump (Ctrl-C, SIGTERM, an error) leaves nothing behind, or,
when the signal came during that final swap, the complete dumps (said on stderr). An
existing --out is replaced only when it is empty or a previous dump output."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from flintc.cli.graphs import (add_model_args, build_targets, check_pass_flags, format_table, pass_options,
                               target_subfolder)
from flintc.errors import InputError


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
    files, or other files and is no earlier dump.
    Raises InputError naming the path."""
    from flintc.cli.compile_build import check_output_folder
    from flintc.fileio import checkpoint_or_build_problem, follow_out_link, foreign_files
    from flintc.graph.dump import is_dump_output

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
        raise InputError(f"--out {out}: holds {', '.join(foreign[:3])} (a checkpoint or a build); "
                         "refusing to write dumps into it, choose another --out")
    if any(out.iterdir()) and not is_dump_output(out):
        raise InputError(f"--out {out}: not empty and not the output of an earlier flintc dump "
                         "(no report.json and index.md); choose another --out")


def run_dump(args: argparse.Namespace) -> int:
    from flintc.fileio import final_output_error, move_into_place, temp_dir_beside
    from flintc.passes.pipeline import compile_step

    out = Path(args.out)
    check_dump_out(args.out)
    disabled = check_pass_flags(args, (args.step,))[args.step]  # before the model is built
    targets = build_targets(args)
    tmp = temp_dir_beside(out)
    try:
        tables = []
        for i, target in enumerate(targets):
            sub = target_subfolder(i, len(targets))
            batch, tokens = (args.batch, None) if args.step == "decode" else (1, args.tokens)
            _, report = compile_step(target.model, args.step, batch=batch, tokens=tokens,
                                     cache_len=args.cache_len, disabled=disabled,
                                     check_model=target.check_model, seed=args.seed,
                                     dump_dir=tmp / sub if sub else tmp,
                                     options=pass_options(args))
            tables.append((target.note, out / sub if sub else out, format_table(report)))
        move_into_place(tmp, out, log=lambda msg: print(msg, file=sys.stderr))  # an interrupt in it: said
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        renamed = final_output_error(exc, tmp, out)  # a full disk names --out, not the hidden folder
        if renamed is not None:
            raise renamed from exc
        raise
    for note, where, table in tables:
        print(f"== {args.step} -- {note} -> {where}")
        print(table)
    return 0
