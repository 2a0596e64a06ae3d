"""The embedded default model: the tiny NVFP4 checkpoint, generated once into a cache.

`flintc run` with no MODEL uses it. It lives in `$FLINTC_CACHE_DIR` (default
`$XDG_CACHE_HOME/flintc`, else `~/.cache/flintc`) under `default-tiny-nvfp4-s0/`.
It is written to a temporary folder and renamed into place, so a crash or two
processes racing never leave a half-written default behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_NAME = "default-tiny-nvfp4-s0"
GGUF_NAME = "model-nvfp4.gguf"


def cache_dir() -> Path:
    env = os.environ.get("FLINTC_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flintc"


def default_checkpoint() -> Path:
    """Path of the default tiny NVFP4 GGUF file, generating it on first use."""
    from flintc.checkpoint.writer import make_checkpoint

    final = cache_dir() / DEFAULT_NAME
    if (final / GGUF_NAME).is_file():
        return final / GGUF_NAME
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=final.parent))
    try:
        made = make_checkpoint("tiny", "nvfp4", tmp / "ckpt", seed=0)
        try:
            os.rename(made.parent, final)
        except OSError:  # another process won the race, or a stale folder is in the way
            if not (final / GGUF_NAME).is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(made.parent, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / GGUF_NAME
