"""Errors that flintc reports to its users.

Every error a user can cause with bad input (a malformed config, a checkpoint with
a missing or mis-shaped tensor, an out-of-range sampling value) is raised as a
:class:`FlintcError` or one of its subclasses. The message is one line that names
the file, tensor or field and what was expected; the CLI prints it without a
traceback and exits with :data:`EXIT_USER_ERROR`.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


def json_type(value) -> str:
    """The JSON name of a parsed JSON value's type, for messages about files and requests
    (`null`, `boolean`, `number`, `string`, `array`, `object`; Python's names, NoneType or
    dict, mean nothing to someone who wrote JSON). Other values: their Python type's name."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    names = {str: "string", list: "array", tuple: "array", dict: "object"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


def listing(items, limit: int, sep: str = ", ", more: str = " (and {} more)") -> str:
    """The first `limit` of `items` (each `str()`-ed), joined with `sep`, then `more` with
    how many were left off in place of its `{}` when any were: the one way a message
    lists a few of many ("a, b, c (and 2 more)"). Takes any sequence (or iterable) and a
    `limit` of 0 or more; returns "" for no items. Raises ValueError for a negative `limit`."""
    if limit < 0:
        raise ValueError(f"limit must be 0 or more, got {limit}")
    items = list(items)
    shown = sep.join(str(i) for i in items[:limit])
    return shown + (more.format(len(items) - limit) if len(items) > limit else "")


def describe_type(x) -> str:
    """The type of a wrong argument for a message: its Python type's name, or for a list or
    tuple, "a list of int, str" (its items' types)."""
    if isinstance(x, (list, tuple)):
        kinds = sorted({type(t).__name__ for t in x})
        return f"a {type(x).__name__} of {', '.join(kinds) or 'nothing'}"
    return type(x).__name__


def check_bool(value, name: str) -> bool:
    """`value` (argument `name`) as a bool: True or False, or a NumPy bool (as the Python
    bool it stands for, `flintc.sampling.bool_or_self`). Raises InputError naming the
    argument for anything else ("no" is truthy: check="no" ran the checks). The one check
    of a True / False argument: `flintc.compile`'s check, dump, progress and schedule
    options, `flintc.load`'s progress, `compile_step`'s bool pass options."""
    from flintc.sampling import bool_or_self  # sampling imports this module

    value = bool_or_self(value)
    if not isinstance(value, bool):
        raise InputError(f"{name}: expected True or False, got {describe_type(value)} {value!r}")
    return value


class FlintcError(Exception):
    """A user-facing error: one line naming the file, tensor or field at fault."""


class ConfigError(FlintcError):
    """config.json is missing, unreadable, or fails validation."""


class CheckpointError(FlintcError):
    """A checkpoint file is missing, truncated, of the wrong format, or holds
    missing, unexpected, mis-shaped or mis-typed tensors."""


class InputError(FlintcError):
    """A prompt, token id or sampling value is out of range."""


class FlintcWarning(UserWarning):
    """Something a user should know that does not stop the command; the CLI prints it
    as one line, `flintc: warning: ...`."""


class StaleBuildWarning(FlintcWarning):
    """A BUILD was compiled by other compiler code (passes, ops, graph capture, model or
    code generator) than the flintc loading it: its schedule is still valid but may
    lack fusions or kernel arguments added since; recompile to get them."""


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process gets SIGTERM while flintc has its
    handler installed (the `flintc` command line, and `flintc.compile`), so that the
    clean-up that runs on Ctrl-C (temporary BUILD folders) runs on `kill` too."""


def install_signal_redelivery():
    """Deliver SIGTERM or SIGINT again when its `Terminated` or KeyboardInterrupt was
    dropped: a signal handler's exception raised while Python runs a weakref callback
    (torch's WeakIdKeyDictionary, for a Ctrl-C as `flintc dump` printed its tables), a
    __del__ or importlib's module-lock callback cannot propagate, and Python reports it
    through `sys.unraisablehook` ("Exception ignored in ...") and goes on, so a command
    (or `flintc.compile`) would run to completion. The hook sends the signal again, 50 ms
    later from another thread, whose handler then raises at the next ordinary bytecode of
    the main thread. Other unraisable exceptions go to the previous hook, which is
    returned (put it back as `sys.unraisablehook` to undo)."""
    import os
    import signal
    import sys
    import threading

    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):  # Terminated is one too
            signum = signal.SIGTERM if isinstance(unraisable.exc_value, Terminated) else signal.SIGINT
            # From another thread, 50 ms on: raised here, the handler would run inside
            # this hook, whose exceptions are dropped too; the main thread handles the
            # new signal once the hook has returned.
            timer = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            timer.daemon = True
            timer.start()
            return
        previous(unraisable)

    sys.unraisablehook = hook
    return previous
