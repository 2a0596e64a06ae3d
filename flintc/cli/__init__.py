"""The `flintc` command line: one sub-command per module in this package.

`main()` builds the argparse parser from each sub-command's `add_parser`, runs the
chosen one, and turns every user-facing error (:class:`~flintc.errors.FlintcError`,
or an OSError on a file the user named) into one line on stderr and exit code 2,
without a traceback (a FlintcError's notes, `add_note`, follow it, one line each:
`flintc dump` says where it kept the dumps up to a failed pass check); an empty input
path (MODEL "", --build "", ...) is refused first (`compile_build.check_input_paths`). SIGTERM is turned into :class:`Terminated` (a
KeyboardInterrupt), so the clean-up that runs on Ctrl-C (temporary BUILD, dump and checkpoint folders)
runs on `kill` too; the exit code is then 143. Every sub-command's parser uses
:class:`HelpFormatter`, so its --help says each default once.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys

from flintc.errors import EXIT_USER_ERROR, FlintcError, Terminated


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The `--help` of every sub-command: an option's default is said once. It is
    appended as "(default: X)" unless the help text already tells it (says "default"),
    or there is nothing to tell (None, an empty list, a flag's True/False)."""

    _TELLS_DEFAULT = re.compile(r"\bdefault\b")

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                or default == [] or default == "" or self._TELLS_DEFAULT.search(text)):
            return text
        return super()._get_help_string(action)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, except that an option's whole value may be `--` (`--stop=--`,
    `--prompt=--`): Python's argparse before 3.12.7 / 3.13.1 removes that `--` as if it
    ended the options, so the value became an empty list (`--prompt=--` was an
    AttributeError traceback, `--stop=--` "expected strings, got []"). The sub-commands'
    parsers are of this class too (add_subparsers makes them of the parent's type)."""

    def _get_values(self, action, arg_strings):
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            return self._get_value(action, "--")  # the option's type still checks it
        return super()._get_values(action, arg_strings)


def build_parser() -> argparse.ArgumentParser:
    from flintc.cli import bench, compile_build, dump, make_checkpoint, run, serve, verify

    parser = _ArgumentParser(
        prog="flintc",
        description="Compiler and runtime for the Flint MoE language model.",
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="print flintc's version and exit (as the server's /version)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (run, compile_build, make_checkpoint, verify, dump, serve, bench):
        module.add_parser(sub)
    return parser


class _VersionAction(argparse.Action):
    """`--version`: the version is read (importlib.metadata, ~30 ms) only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import flintc

        print(f"flintc {flintc.__version__}")  # stdout, as argparse's own version action
        parser.exit()


def _raise_terminated(signum, frame):
    raise Terminated()


def _install_sigterm_handler():
    """Make SIGTERM raise Terminated in the main thread; -> the previous handler, or None
    when no handler could be installed (not the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except (ValueError, OSError):  # not the main thread of the main interpreter
        return None


def _install_unraisable_hook():
    """`flintc.errors.install_signal_redelivery`: a SIGTERM / SIGINT whose exception Python
    dropped is sent again; returns the previous `sys.unraisablehook`."""
    from flintc.errors import install_signal_redelivery

    return install_signal_redelivery()


def main(argv: list[str] | None = None) -> int:
    from flintc.cli.args import join_int_list_values

    try:
        parser = build_parser()
        # `--prompt-ids -1,2` reaches flintc run's check of the ids (argparse would take -1,2 for an option)
        args = parser.parse_args(join_int_list_values(sys.argv[1:] if argv is None else list(argv)))
    except KeyboardInterrupt:  # a Ctrl-C while the sub-commands' modules import (the first ~0.1 s)
        print("flintc: interrupted", file=sys.stderr)
        if argv is None:
            _default_sigint_for_exit()
        return 130
    except BrokenPipeError:  # `flintc --version | grep -q 0.1`: the reader left (a traceback, exit 1)
        return _broken_pipe()
    for stream in (sys.stdout, sys.stderr):  # text the terminal's encoding lacks: escaped, not a traceback
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):  # not a TextIOWrapper
            pass
    previous = _install_sigterm_handler()
    unraisable = _install_unraisable_hook()
    show = _install_warning_format()
    try:
        return _run(args)
    finally:
        if argv is None:  # the process's entry (the console script, python -m flintc)
            _default_sigint_for_exit()
        import warnings

        warnings.showwarning = show
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sys.unraisablehook = unraisable


def _default_sigint_for_exit() -> None:
    """Give SIGINT its default action once the command is done, for the interpreter's exit:
    a Ctrl-C then raised KeyboardInterrupt inside an atexit callback (torch's weakref
    finalizers, filelock's lock release), which Python reports as "Exception ignored in
    atexit callback ... KeyboardInterrupt" before it exits 0. Now the process ends as
    interrupted (status 130, no message), as it already did a moment later, once Python's
    finalization had put the default action back. Only for `main()` run as the process's
    entry (no argv): a caller that runs `main(argv)` in its own process keeps its
    Ctrl-C. Only where SIGINT still has Python's own handler: a process started with
    SIGINT ignored (`cmd &` in a non-interactive shell, a supervisor) keeps ignoring it,
    as Python's finalization would (it was killed by a Ctrl-C during its exit)."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
    except (ValueError, OSError):  # not the main thread of the main interpreter
        pass


def _install_warning_format():
    """Print flintc's own warnings (`flintc.errors.FlintcWarning`) as one line,
    `flintc: warning: ...`, without Python's file:line prefix; others as Python does.
    Returns the previous `warnings.showwarning`."""
    import warnings

    from flintc.errors import FlintcWarning

    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, FlintcWarning):
            print(f"flintc: warning: {message}", file=sys.stderr if file is None else file)
        else:
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    return previous


def _broken_pipe() -> int:
    """Stop quietly after the reader of stdout left (BrokenPipeError): 141, 128 + SIGPIPE,
    as `yes | head`."""
    try:  # Python flushes stdout again at exit: point it at /dev/null (Python docs, "Note on SIGPIPE")
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor
        pass
    return 128 + signal.SIGPIPE


def _run(args) -> int:
    from flintc.cli.args import check_option_values
    from flintc.cli.compile_build import check_input_paths

    try:
        check_input_paths(args)  # an empty MODEL, --build, --tokenizer, ...: before any work
        check_option_values(args)  # --seed's range, an empty --device, --buckets 1,1: one line
        return int(args.func(args) or 0)
    except Terminated:
        print("flintc: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except FlintcError as exc:
        print(f"flintc: error: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):  # what the command did about it (`flintc dump`'s partial dumps)
            print(f"flintc: {note}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # `flintc run ... | head`: the reader left; stop quietly, as `yes | head`
        return _broken_pipe()
    except OSError as exc:  # a path the user named: unwritable, missing folder, disk full
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        print(f"flintc: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("flintc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
