"""Errors that flintc reports to its users.

Every error a user can cause with bad input (a malformed config, a checkpoint with
a missing or mis-shaped tensor, an out-of-range sampling value) is raised as a
:class:`FlintcError` or one of its subclasses. The message is one line that names
the file, tensor or field and what was expected; the CLI prints it without a
traceback and exits with :data:`EXIT_USER_ERROR`.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


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
