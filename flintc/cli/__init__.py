"""The `flintc` command line: one sub-command per module in this package.

`main()` builds the argparse parser from each sub-command's `add_parser`, runs the
chosen one, and turns every user-facing error (:class:`~flintc.errors.FlintcError`,
or an OSError on a file the user named) into one line on stderr and exit code 2,
without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from flintc.errors import EXIT_USER_ERROR, FlintcError


def build_parser() -> argparse.ArgumentParser:
    from flintc.cli import bench, compile_build, dump, make_checkpoint, run, serve, verify

    parser = argparse.ArgumentParser(
        prog="flintc",
        description="Compiler and runtime for the Flint MoE language model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (run, compile_build, make_checkpoint, verify, dump, serve, bench):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FlintcError as exc:
        print(f"flintc: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:  # a path the user named: unwritable, missing folder, disk full
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        print(f"flintc: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("flintc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
