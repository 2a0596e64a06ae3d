"""`flintc dump`: compile a step and write its pass-by-pass dumps (readable code, DOT /
SVG per layer, ONNX, index.md, report.json) into --out."""

from __future__ import annotations

import argparse

from flintc.cli.graphs import add_model_args, build_targets, format_table


def add_parser(sub) -> None:
    p = sub.add_parser("dump", help="write pass-by-pass graph dumps", description=__doc__)
    add_model_args(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--step", choices=("decode", "prefill"), default="decode")
    p.set_defaults(func=run_dump)


def run_dump(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flintc.passes.pipeline import compile_step

    targets = build_targets(args)
    for i, target in enumerate(targets):
        out = Path(args.out) if len(targets) == 1 else Path(args.out) / ("counts" if i == 0 else "numerics")
        batch, tokens = (args.batch, None) if args.step == "decode" else (1, args.tokens)
        _, report = compile_step(target.model, args.step, batch=batch, tokens=tokens, cache_len=args.cache_len,
                                 disabled=args.disable, check_model=target.check_model, seed=args.seed,
                                 dump_dir=out, options={"attention_splits": args.attention_splits}
                                 if args.attention_splits else None)
        print(f"== {args.step} -- {target.note} -> {out}")
        print(format_table(report))
    return 0
