"""The embedded default model: the tiny NVFP4 checkpoint, generated once into a cache.

`flintc run` with no MODEL uses it. It lives in `$FLINTC_CACHE_DIR` (default
`$XDG_CACHE_HOME/flintc`, else `~/.cache/flintc`) under `default-tiny-nvfp4-s0/`; a
cache folder that cannot be written is an InputError naming FLINTC_CACHE_DIR.
It is written to a temporary folder and renamed into place, so a crash or two
processes racing never leave a half-written default behind. One that was damaged
later (truncated, edited) is written again once by `load_default`, with a notice;
so is one a build of it records that is gone (`is_cached_default`,
`flintc.runtime.compiled.recorded_weight_source`). `load_checkpoint_or_default` is how
`flintc run`, `compile`, `serve` and `flintc.compile` load MODEL or, when none is
given, this default.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from flintc.errors import InputError

DEFAULT_NAME = "default-tiny-nvfp4-s0"
GGUF_NAME = "model-nvfp4.gguf"


def cache_dir() -> Path:
    env = os.environ.get("FLINTC_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flintc"


def cache_error(folder: Path, exc: OSError) -> InputError:
    """The error for a cache `folder` that cannot be created or written (`exc`): it names
    FLINTC_CACHE_DIR and its value when the variable chose the folder (else the folder,
    and where its path came from), says why, and what to do."""
    env = os.environ.get("FLINTC_CACHE_DIR")
    if env:
        where = f"FLINTC_CACHE_DIR={env}"
    else:
        base = "$XDG_CACHE_HOME/flintc" if os.environ.get("XDG_CACHE_HOME") else "~/.cache/flintc"
        where = f"the cache folder {folder} ({base}; FLINTC_CACHE_DIR is not set)"
    blocker = next((p for p in (folder / DEFAULT_NAME, folder, *folder.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        why = f"{blocker} is a file, not a folder"
    else:
        why = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
    return InputError(f"{where}: cannot write the default model there ({why}); set FLINTC_CACHE_DIR to a "
                      "writable folder, or pass MODEL")


def default_checkpoint() -> Path:
    """Path of the default tiny NVFP4 GGUF file, generating it on first use.

    Raises:
        InputError: the cache folder (`cache_dir`) cannot be created or written: it is
            a file, under one, or not writable (`cache_error`: the message names
            FLINTC_CACHE_DIR and its value when it is set).
    """
    from flintc.checkpoint.writer import make_checkpoint

    final = cache_dir() / DEFAULT_NAME
    if (final / GGUF_NAME).is_file():
        return final / GGUF_NAME
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=final.parent))
    except OSError as exc:
        raise cache_error(final.parent, exc) from None
    try:
        made = make_checkpoint("tiny", "nvfp4", tmp / "ckpt", seed=0)
        try:
            os.rename(made.parent, final)
        except OSError:  # another process won the race, or a stale folder is in the way
            if not (final / GGUF_NAME).is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(made.parent, final)
    except OSError as exc:  # the disk full, a file named like the default in the way
        raise cache_error(final.parent, exc) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / GGUF_NAME


def is_cached_default(path) -> bool:
    """True when `path` is the cached default model's GGUF file, where
    `default_checkpoint` writes it in the cache folder `cache_dir` names now: what
    build.json records as weight_source for a build of the default model (resolved)."""
    return Path(path).resolve() == (cache_dir() / DEFAULT_NAME / GGUF_NAME).resolve()


def load_checkpoint_or_default(model, **kwargs):
    """`flintc.checkpoint.loader.load_checkpoint(model, **kwargs)`, or with no `model` (and
    `load_format` not "dummy": random weights need no checkpoint) the embedded default,
    a damaged cached copy of which is written again once (`load_default`). The one way
    `flintc run`, `compile` and `serve` and `flintc.compile` load MODEL, and
    `flintc.runtime.compiled.load_build` the default a build was compiled from; raises
    what `load_checkpoint` raises (and `default_checkpoint`'s InputError for a cache
    folder that cannot be written)."""
    from flintc.checkpoint.loader import load_checkpoint

    if model is None and kwargs.get("load_format", "auto") != "dummy":
        return load_default(lambda path: load_checkpoint(path, **kwargs))
    return load_checkpoint(model, **kwargs)


def load_default(load):
    """`load(default_checkpoint())`. When that raises a CheckpointError naming the cached
    default (its file truncated or corrupt), the default is written again (it is
    deterministic from its seed; the damaged folder is renamed aside and removed, the new
    one written as `default_checkpoint` writes it) with a one-line notice on stderr, and
    loaded once more; should that fail too, the error says to delete the folder.
    CheckpointErrors about other files (an --hf-config-path) are raised as they are."""
    from flintc.errors import CheckpointError

    path = default_checkpoint()
    folder = path.parent
    try:
        return load(path)
    except CheckpointError as exc:
        if str(folder) not in str(exc):
            raise
        print(f"flintc: the cached default model does not load ({exc}); writing it again", file=sys.stderr)
    _discard(folder)
    path = default_checkpoint()
    try:
        return load(path)
    except CheckpointError as exc:
        if str(folder) not in str(exc):
            raise
        raise CheckpointError(f"{exc} (the cached default model, written again just now); delete {folder} "
                              "to have flintc write it again") from None


def _discard(folder: Path) -> None:
    """Remove the cached default `folder`: renamed aside first (a reader never sees half
    of it), then removed. One another process already moved is left to it."""
    try:
        aside = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-bad-", dir=folder.parent))
    except OSError as exc:
        raise cache_error(folder.parent, exc) from None
    try:
        os.rename(folder, aside / "ckpt")
    except FileNotFoundError:  # gone already
        pass
    except OSError as exc:
        raise cache_error(folder.parent, exc) from None
    finally:
        shutil.rmtree(aside, ignore_errors=True)
