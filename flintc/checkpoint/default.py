"""The embedded default model: the tiny NVFP4 checkpoint, generated once into a cache.

`flintc run` with no MODEL uses it. It lives in `$FLINTC_CACHE_DIR` (default
`$XDG_CACHE_HOME/flintc`, else `~/.cache/flintc`) under `default-tiny-nvfp4-s0/`; a
cache folder that cannot be written is an InputError naming FLINTC_CACHE_DIR.
It is written to a temporary folder and renamed into place, so a crash or two
processes racing never leave a half-written default behind; the sha256 of each of its
files is recorded in the folder's MANIFEST_NAME, written last. Before each use the
whole folder is checked against it (`check_default_folder`: the GGUF, config.json, the
tokenizer files); one that was damaged later (a file truncated, edited, deleted) is
written again once by `default_checkpoint`, with a one-line notice; so is one a build
of it records that is gone (`is_cached_default`,
`flintc.runtime.compiled.recorded_weight_source`). A copy is replaced only when it
still fails the check just then, so a process never removes the good copy another one
has just written. `load_checkpoint_or_default` is how
`flintc run`, `compile`, `serve` and `flintc.compile` load MODEL or, when none is
given, this default.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from flintc.errors import InputError
from flintc.fileio import write_text_atomic

DEFAULT_NAME = "default-tiny-nvfp4-s0"
GGUF_NAME = "model-nvfp4.gguf"
MANIFEST_NAME = "flintc-files.json"  # the sha256 of each file, written last


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(folder: Path) -> None:
    """Record the sha256 of every file in `folder` in its MANIFEST_NAME, written last and
    atomically (a temporary file renamed into place)."""
    files = {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST_NAME}
    write_text_atomic(folder / MANIFEST_NAME, json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")


def check_default_folder(folder: Path) -> str | None:
    """What is wrong with the cached default `folder`: None when every file its manifest
    (MANIFEST_NAME, written last by `default_checkpoint`) records is there with the
    sha256 recorded; else one phrase naming the file (missing, changed since it was
    written, or the manifest itself missing or unreadable). The whole folder is checked
    (the GGUF, config.json, the tokenizer files), every byte: the default is about 1 MB."""
    manifest = folder / MANIFEST_NAME
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict) or GGUF_NAME not in files:
            raise ValueError
    except FileNotFoundError:
        return f"{manifest}: missing"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{manifest}: not a readable manifest"
    for name, digest in files.items():
        path = folder / str(name)
        try:
            if _sha256(path) != digest:
                return f"{path}: changed since it was written (its sha256 differs from the one recorded)"
        except FileNotFoundError:
            return f"{path}: missing"
        except OSError as exc:
            return f"{path}: {exc.strerror or exc}"
    return None


def default_checkpoint() -> Path:
    """Path of the default tiny NVFP4 GGUF file, generating it on first use.

    The cached folder is checked whole before use (`check_default_folder`: every file
    against the sha256 recorded when it was written); one that was damaged since (a file
    truncated, edited, deleted) is written again, with a one-line notice on stderr.

    Raises:
        InputError: the cache folder (`cache_dir`) cannot be created or written: it is
            a file, under one, or not writable (`cache_error`: the message names
            FLINTC_CACHE_DIR and its value when it is set).
    """
    final = cache_dir() / DEFAULT_NAME
    if final.is_dir():
        problem = check_default_folder(final)
        if problem is None:
            return final / GGUF_NAME
        print(f"flintc: the cached default model is damaged ({problem}); writing it again", file=sys.stderr)
    _write_default(final)
    return final / GGUF_NAME


def _write_default(final: Path, replace_good: bool = False) -> None:
    """Write the default into a temporary folder, record its manifest last, and rename it
    to `final`. A folder already at `final` is moved aside (and removed) only when it
    still fails `check_default_folder` just then (or `replace_good`): a copy another
    process has written meanwhile is kept, never deleted under its readers."""
    from flintc.checkpoint.writer import make_checkpoint

    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=final.parent))
    except OSError as exc:
        raise cache_error(final.parent, exc) from None
    try:
        made = make_checkpoint("tiny", "nvfp4", tmp / "ckpt", seed=0)
        _write_manifest(made.parent)
        for _ in range(5):
            try:
                os.rename(made.parent, final)
                return
            except OSError:  # a folder is in the way: another process's copy, or a damaged one
                if not final.exists():
                    continue
                if not final.is_dir():
                    raise
                if not replace_good and check_default_folder(final) is None:
                    return  # another process wrote it meanwhile: keep theirs
                replace_good = False
                _discard(final)
        os.rename(made.parent, final)
    except OSError as exc:  # the disk full, a file named like the default in the way
        raise cache_error(final.parent, exc) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    deterministic from its seed; the new one written as `default_checkpoint` writes it,
    then swapped in for the damaged folder, which is renamed aside and removed) with a
    one-line notice on stderr, and
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
    _write_default(folder, replace_good=True)
    try:
        return load(path)
    except CheckpointError as exc:
        if str(folder) not in str(exc):
            raise
        raise CheckpointError(f"{exc} (the cached default model, written again just now); delete {folder} "
                              "to have flintc write it again") from None


def _discard(folder: Path) -> None:
    """Remove the cached default `folder`: renamed aside first (a reader never sees half
    of it), then removed, with SIGINT / SIGTERM deferred until it is gone
    (`flintc.fileio.signals_deferred`: a Ctrl-C there left a `.flintc-default-bad-*`
    folder in the cache). One another process already moved is left to it."""
    from flintc.fileio import signals_deferred

    with signals_deferred():
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
