"""One entry point for every checkpoint kind: :func:`load_checkpoint`.

A checkpoint is a BF16 Hugging Face folder (`config.json` + safetensors, see
:mod:`flintc.checkpoint.safetensors_io`), an NVFP4 `.gguf` file whose config and
tokenizer live in a BF16-style folder (`hf_config_path`, by default the file's own
folder; see :mod:`flintc.checkpoint.gguf_io`), or `load_format="dummy"`: random
weights made on the device from a config alone (:mod:`flintc.checkpoint.dummy`).
All of them give the canonical weight dict of
:func:`flintc.model.weights.weight_specs`. Each format module is imported only when
it is used, so that a dummy load needs neither `gguf` nor `safetensors`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flintc.config import FlintConfig
from flintc.errors import CheckpointError, InputError
from flintc.model.weights import WeightDict
from flintc.runtime.device import check_weights_fit

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class LoadedCheckpoint:
    """Weights and what came with them.

    Attributes:
        config: the model shape (from config.json or given).
        weights: canonical name -> tensor or NVFP4Tensor.
        fmt: "bf16" or "nvfp4" (how the `linear` weights are held).
        source: the file or folder read, or "dummy:<fmt>".
        tokenizer_dir: the folder holding tokenizer.json, None when there is none.
    """

    config: FlintConfig
    weights: WeightDict
    fmt: str
    source: str
    tokenizer_dir: Path | None


def load_checkpoint(
    path: str | os.PathLike | None,
    hf_config_path: str | os.PathLike | None = None,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    config: FlintConfig | None = None,
    fmt: str = "bf16",
    progress: bool = True,
    check_config: Callable[[FlintConfig], None] | None = None,
) -> LoadedCheckpoint:
    """Load the checkpoint at `path` onto `device`.

    Args:
        path: a BF16 folder (with config.json) or a `.gguf` file; for
            `load_format="dummy"` any folder or config.json giving the config, or
            None when `config` or `hf_config_path` is given.
        hf_config_path: folder (or config.json) with the config and tokenizer of a
            GGUF file; default the GGUF file's folder. For folders it overrides the
            folder's own config.json.
        load_format: "auto" (by what `path` is), "safetensors", "gguf" or "dummy".
        config: use this config (a FlintConfig, or a preset name: "tiny", "full")
            instead of reading one.
        fmt: for dummy weights only: "bf16" or "nvfp4".
        check_config: called with the config once it is known, before any weight is
            read or made: a caller's checks against it (`flintc run` refuses a
            --logit-bias id outside vocab_size there); what it raises propagates.

    Raises:
        CheckpointError: `path` does not exist, is neither kind of checkpoint, has no
            config, or its weights are bad (see the format modules).
        ConfigError: config.json fails validation.
        InputError: an unknown `load_format` (`check_load_format`); on a CPU, the weights
            need more memory than is available (`flintc.runtime.device.check_weights_fit`:
            the full config, most often).
    """
    check_load_format(load_format)
    if isinstance(config, str):  # a preset name ("tiny", "full"), as --config gives it
        config = FlintConfig.preset(config)
    path = Path(path) if path is not None else None
    if hf_config_path is not None and not Path(hf_config_path).exists():
        raise CheckpointError(f"--hf-config-path (hf_config_path=) {hf_config_path}: no such file or folder")
    hf_dir = _config_dir(Path(hf_config_path)) if hf_config_path is not None else None
    if load_format == "dummy":
        return _load_dummy(path, hf_dir, hf_config_path, device, config, fmt, check_config)
    if path is None:
        raise CheckpointError("no checkpoint path given (only --load-format dummy, load_format='dummy' in "
                              "Python, needs none)")
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file or folder")
    kind = load_format if load_format != "auto" else _detect(path)
    if kind == "gguf":
        gguf_path = path if path.is_file() else _single_gguf(path)
        return _load_gguf(gguf_path, hf_dir or gguf_path.parent, hf_config_path, device, config,
                          progress, check_config)
    from flintc.checkpoint.safetensors_io import load_bf16

    config = config or _read_config(hf_config_path or path, path)
    if check_config is not None:
        check_config(config)
    # the memory check once the headers match the config: a folder of another config is
    # named for that, not refused for the memory the config's weights would take
    weights = load_bf16(path, config, device, progress, before_read=lambda: check_weights_fit(config, "bf16", device))
    tok = _tokenizer_dir(path, hf_dir)
    return LoadedCheckpoint(config, weights, "bf16", str(path), tok)


def checkpoint_weight_format(path: str | os.PathLike) -> str:
    """The weight format `load_checkpoint(path)` loads, without reading any weight:
    "nvfp4" for a GGUF file (or a folder holding one), "bf16" for a safetensors folder.

    Raises:
        CheckpointError: `path` is neither kind of checkpoint (`_detect`).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file or folder")
    return "nvfp4" if _detect(path) == "gguf" else "bf16"


def check_load_format(load_format) -> None:
    """Raises InputError naming load_format and the accepted values (`LOAD_FORMATS`)
    unless it is one of them: a plain ValueError before (a traceback)."""
    if load_format not in LOAD_FORMATS:
        raise InputError(f"load_format must be one of {', '.join(map(repr, LOAD_FORMATS))}, got {load_format!r}")


def _detect(path: Path) -> str:
    """The format of `path`: "safetensors" or "gguf". Raises CheckpointError for neither
    (saying so when `path` is a flintc BUILD), or a folder of several .gguf files."""
    from flintc.checkpoint.safetensors_io import INDEX_FILE, SINGLE_FILE

    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF" or path.suffix == ".gguf":
                return "gguf"
        raise CheckpointError(
            f"{path}: neither a BF16 checkpoint folder nor a GGUF file "
            "(pass the folder holding config.json and the safetensors files)"
        )
    if (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file():
        return "safetensors"
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf"
    if ggufs:
        raise CheckpointError(f"{path}: holds {len(ggufs)} GGUF files ({', '.join(ggufs)}), expected one; pass "
                              "the .gguf file to load as MODEL")
    build = " (it is a flintc BUILD: run it with --build, flintc.load in Python)" if (path / "build.json").is_file() \
        else ""
    raise CheckpointError(
        f"{path}: neither a BF16 checkpoint folder (no {SINGLE_FILE} or {INDEX_FILE}) "
        f"nor a GGUF file{build}"
    )


def _single_gguf(folder: Path) -> Path:
    found = sorted(folder.glob("*.gguf"))
    if len(found) != 1:
        raise CheckpointError(f"{folder}: expected one .gguf file, found {len(found)}")
    return found[0]


def _load_gguf(path, config_dir, hf_config_path, device, config, progress, check_config) -> LoadedCheckpoint:
    from flintc.checkpoint.gguf_io import load_gguf

    if config is None:
        hint = " (a GGUF file takes its config from the BF16 folder: pass --hf-config-path, hf_config_path= in Python)"
        config = _read_config(hf_config_path or config_dir, path, hint)
    if check_config is not None:
        check_config(config)
    # as load_bf16: the memory check once the header matches the config (a tiny GGUF file
    # with the full config.json was refused for the full model's memory)
    weights = load_gguf(path, config, device, progress, before_read=lambda: check_weights_fit(config, "nvfp4", device))
    return LoadedCheckpoint(config, weights, "nvfp4", str(path), _tokenizer_dir(config_dir, None))


def _load_dummy(path, hf_dir, hf_config_path, device, config, fmt, check_config) -> LoadedCheckpoint:
    from flintc.checkpoint.dummy import dummy_weights

    if config is None:
        where = hf_config_path or path
        if where is None:
            raise CheckpointError("--load-format dummy (load_format='dummy') needs a config: --config tiny|full, "
                              "a MODEL folder or config.json, or --hf-config-path (config=, path, "
                              "hf_config_path= in Python)")
        config = _read_config(where, Path(where))
    folder = hf_dir or (_config_dir(path) if path is not None and path.exists() else None)
    if check_config is not None:
        check_config(config)
    check_weights_fit(config, fmt, device)
    weights = dummy_weights(config, fmt, device)
    tok = _tokenizer_dir(folder, None) if folder is not None else None
    return LoadedCheckpoint(config, weights, fmt, f"dummy:{fmt}", tok)


def _config_dir(path: Path) -> Path:
    """The folder of a config path (the path itself when it is a folder)."""
    return path if path.is_dir() else path.parent


def _read_config(where: str | os.PathLike, checkpoint: Path, hint: str = "") -> FlintConfig:
    """The config from `where`: a folder holding config.json, a .json file, or any
    other file (a weights file) with config.json beside it."""
    where = Path(where)
    if where.is_dir():
        config_file = where / "config.json"
    elif where.suffix == ".json":
        config_file = where
    else:
        config_file = where.parent / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{checkpoint}: no config found (looked for {config_file}){hint}")
    return FlintConfig.from_file(config_file)


def _tokenizer_dir(first: Path, second: Path | None) -> Path | None:
    for folder in (first, second):
        if folder is not None and (folder / TOKENIZER_FILE).is_file():
            return folder
    return None
