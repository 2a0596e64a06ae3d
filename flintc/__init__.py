"""flintc: a compiler and runtime for Flint (see README.md).

`flintc.compile(...)` compiles a checkpoint into a BUILD folder and returns a
`flintc.api.CompiledModel` with `generate(...)` and `forward(...)`; `flintc.load(BUILD)`
loads an earlier build. `flintc.SamplingParams` and `flintc.StructuredOutputsParams` are
`flintc.sampling`'s (what `generate` takes, as `from vllm import SamplingParams`).
Everything else lives in the subpackages (`flintc.model`,
`flintc.passes`, `flintc.runtime`, ...). `flintc.__version__` is the version in the
pyproject.toml of the source tree this package was imported from (an editable install,
or a tree on PYTHONPATH as the GPU scripts run it: the code that runs, even where
another flintc is installed), else the installed package's version, else "unknown".
"""

from __future__ import annotations

__all__ = ["compile", "load", "SamplingParams", "StructuredOutputsParams"]
_FROM_SAMPLING = ("SamplingParams", "StructuredOutputsParams")


def __getattr__(name: str):
    """PEP 562: `flintc.compile` and `flintc.load` are `flintc.api`'s own functions, with
    their signatures and docstrings (`help(flintc)`, `help(flintc.compile)`), and
    `flintc.SamplingParams` / `flintc.StructuredOutputsParams` `flintc.sampling`'s own
    classes, imported at first use, so that `import flintc` alone does not import torch;
    `__version__` is read when asked (importlib.metadata is not free at import)."""
    if name in _FROM_SAMPLING:
        from flintc import sampling

        return getattr(sampling, name)
    if name in __all__:
        from flintc import api

        return getattr(api, name)
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        tree = _source_tree_version()
        if tree != "unknown":
            return tree
        try:
            return version("flintc")
        except PackageNotFoundError:
            return tree
    raise AttributeError(f"module 'flintc' has no attribute {name!r}")


def _source_tree_version() -> str:
    """[project] version of the pyproject.toml beside this package when it names flintc."""
    from pathlib import Path

    try:
        import tomllib

        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            project = tomllib.load(f).get("project", {})
        if project.get("name") == "flintc" and isinstance(project.get("version"), str):
            return project["version"]
    except (ImportError, OSError, ValueError):
        pass
    return "unknown"


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})
