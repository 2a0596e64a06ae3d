"""flintc: a compiler and runtime for Flint (see README.md).

`flintc.compile(...)` compiles a checkpoint into a BUILD folder and returns a
`flintc.api.CompiledModel` with `generate(...)` and `forward(...)`; `flintc.load(BUILD)`
loads an earlier build. Everything else lives in the subpackages (`flintc.model`,
`flintc.passes`, `flintc.runtime`, ...). `flintc.__version__` is the installed
package's version ("unknown" when flintc runs from a source tree not installed).
"""

from __future__ import annotations

__all__ = ["compile", "load"]


def __getattr__(name: str):
    """PEP 562: `flintc.compile` and `flintc.load` are `flintc.api`'s own functions, with
    their signatures and docstrings (`help(flintc)`, `help(flintc.compile)`), imported at
    first use, so that `import flintc` alone does not import torch; `__version__` is read
    when asked (importlib.metadata is not free at import)."""
    if name in __all__:
        from flintc import api

        return getattr(api, name)
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("flintc")
        except PackageNotFoundError:
            return "unknown"
    raise AttributeError(f"module 'flintc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})
