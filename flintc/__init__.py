"""flintc: a compiler and runtime for Flint (see README.md).

`flintc.compile(...)` compiles a checkpoint into a BUILD folder and returns a
`flintc.api.CompiledModel` with `generate(...)` and `forward(...)`; `flintc.load(BUILD)`
loads an earlier build. Everything else lives in the subpackages (`flintc.model`,
`flintc.passes`, `flintc.runtime`, ...).
"""

from __future__ import annotations


def compile(*args, **kwargs):  # noqa: A001 - the public name, like torch.compile
    """See `flintc.api.compile`."""
    from flintc.api import compile as _compile

    return _compile(*args, **kwargs)


def load(*args, **kwargs):
    """See `flintc.api.load`."""
    from flintc.api import load as _load

    return _load(*args, **kwargs)


__all__ = ["compile", "load"]
