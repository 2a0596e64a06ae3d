"""flintc: a compiler and runtime for Flint (see README.md).

`flintc.compile(...)` compiles a checkpoint into a BUILD folder and returns a
`flintc.api.CompiledModel` with `generate(...)` and `forward(...)`; `flintc.load(BUILD)`
loads an earlier build. Everything else lives in the subpackages (`flintc.model`,
`flintc.passes`, `flintc.runtime`, ...). `flintc.__version__` is the installed
package's version ("unknown" when flintc runs from a source tree not installed).
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


def __getattr__(name: str):
    if name == "__version__":  # read when asked: importlib.metadata is not free at import
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("flintc")
        except PackageNotFoundError:
            return "unknown"
    raise AttributeError(f"module 'flintc' has no attribute {name!r}")


__all__ = ["compile", "load"]
