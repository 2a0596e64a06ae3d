"""Write a complete test checkpoint: config.json, tokenizer and random weights.

:func:`make_checkpoint` builds the whole checkpoint in a temporary folder beside
`out_dir` and renames it into place, so `out_dir` either does not exist or holds a
complete checkpoint. BF16 checkpoints are Hugging Face folders
(:mod:`flintc.checkpoint.safetensors_io`); NVFP4 ones are `model-nvfp4.gguf`
(:mod:`flintc.checkpoint.gguf_io`) with the config.json and tokenizer that a GGUF
file takes its config from beside it. Weights come from
:func:`flintc.checkpoint.init.random_weights`, which draws on the CPU: configs
above :data:`MAX_RANDOM_PARAMS` parameters (the full model's 40B would be 80 GB)
get config.json and the tokenizer only, to be loaded with `load_format="dummy"`.
The tokenizer is made for any vocab_size up to
:data:`~flintc.checkpoint.tokenizer.MAX_VOCAB_SIZE` (2**20); a larger one is refused
before anything is written.

The temporary folder is `.{name}.{pid}.XXXXXXXX`, as `flintc compile`'s
(:func:`flintc.fileio.temp_dir_beside`): a run killed there (SIGKILL, out of memory)
leaves it behind, and the next `make_checkpoint` of the same `out_dir` removes those
of processes that are gone (:func:`flintc.fileio.remove_stale_temp_dirs`, which also
knows the `.{name}.tmp-{pid}-{hex}` folders of earlier flintc versions).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from flintc.config import FlintConfig
from flintc.errors import CheckpointError, ConfigError
from flintc.fileio import naming_final_output, remove_stale_temp_dirs, set_public_mode

log = logging.getLogger(__name__)

MAX_RANDOM_PARAMS = 2_000_000_000  # above this, write config.json and tokenizer only
NVFP4_FILE = "model-nvfp4.gguf"
FORMATS = ("bf16", "nvfp4")


def make_checkpoint(
    config: FlintConfig | str,
    fmt: str,
    out_dir: str | os.PathLike,
    seed: int = 0,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a random checkpoint of `config` to `out_dir`, atomically.

    Args:
        config: a FlintConfig, a preset name ("tiny", "full") or a config.json path.
        fmt: "bf16" (safetensors folder) or "nvfp4" (GGUF file).
        out_dir: must not exist, or be an empty folder.
        seed: seed of :func:`random_weights`.
        max_shard_bytes: shard a BF16 checkpoint (ignored for NVFP4: one GGUF file).

    Returns:
        What to pass to :func:`flintc.checkpoint.loader.load_checkpoint`: `out_dir`
        for BF16, `out_dir/model-nvfp4.gguf` for NVFP4; `out_dir` when the config was
        too large for weights to be written.

    Raises:
        CheckpointError: `out_dir` exists and is a file or a folder that is not empty
            (nothing is written; the message says which), or the final rename fails.
        ConfigError: an unknown preset or a bad config.json, or a vocab_size below the
            tokenizer's :data:`~flintc.checkpoint.tokenizer.MIN_VOCAB_SIZE` or above its
            :data:`~flintc.checkpoint.tokenizer.MAX_VOCAB_SIZE` (nothing is written).
        ValueError: unknown `fmt`.
    """
    from flintc.checkpoint.tokenizer import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, NUM_BYTE_SYMBOLS, SPECIAL_TOKENS

    config = _resolve_config(config)
    if config.vocab_size < MIN_VOCAB_SIZE:  # build_tokenizer's ValueError, before any file is written
        raise ConfigError(f"{config.source}: field 'vocab_size' is {config.vocab_size}, too small for the "
                          f"tokenizer a checkpoint gets: expected at least {MIN_VOCAB_SIZE} "
                          f"({NUM_BYTE_SYMBOLS} byte symbols + {len(SPECIAL_TOKENS)} special tokens)")
    if config.vocab_size > MAX_VOCAB_SIZE:  # build_tokenizer's ValueError; 2**31 aborted the BPE trainer
        raise ConfigError(f"{config.source}: field 'vocab_size' is {config.vocab_size}, too large for the "
                          f"tokenizer a checkpoint gets: expected at most {MAX_VOCAB_SIZE} (2**20; every id "
                          f"past the trained ones is a reserved special token)")
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format must be one of {FORMATS}, found {fmt!r}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, found {max_shard_bytes}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():  # "is not empty" said of an empty file
        raise CheckpointError(f"{out_dir}: already exists and is a file, not a folder; refusing to write")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointError(f"{out_dir}: already exists and is not empty; refusing to write")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(out_dir)  # those of killed runs
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{os.getpid()}.", dir=out_dir.parent))
    try:
        with naming_final_output(tmp, out_dir):  # a full disk names --out, not the hidden folder
            wrote_weights = _write_contents(config, fmt, tmp, seed, max_shard_bytes, out_dir)
        try:
            set_public_mode(tmp)  # mkdir'd files may be owner-only
            os.replace(tmp, out_dir)  # replaces an empty folder on POSIX
        except OSError as exc:
            raise CheckpointError(f"{out_dir}: cannot move the new checkpoint into place "
                                  f"({exc.strerror})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fmt == "nvfp4" and wrote_weights:
        return out_dir / NVFP4_FILE
    return out_dir


def _resolve_config(config: FlintConfig | str) -> FlintConfig:
    if isinstance(config, FlintConfig):
        return config
    if Path(config).exists():
        return FlintConfig.from_file(config)
    return FlintConfig.preset(config)


def _write_contents(
    config: FlintConfig, fmt: str, folder: Path, seed: int, max_shard_bytes, out_dir: Path
) -> bool:
    """Fill `folder`; return whether weights were written."""
    from flintc.checkpoint.gguf_io import save_gguf
    from flintc.checkpoint.init import random_weights
    from flintc.checkpoint.safetensors_io import save_bf16
    from flintc.checkpoint.tokenizer import write_tokenizer

    config.save(folder / "config.json")
    write_tokenizer(folder, config.vocab_size, model_max_length=config.max_position_embeddings)
    num_params = config.num_parameters()["total"]
    if num_params > MAX_RANDOM_PARAMS:
        log.warning(
            "%s: %.2fe9 parameters are too many to make random weights for (%.0f GB of bf16 in "
            "memory%s): writing config.json and the tokenizer only (load it with load_format='dummy')",
            out_dir, num_params / 1e9, num_params * 2 / 1e9,
            "" if fmt == "bf16" else f", {num_params * 0.5625 / 1e9:.0f} GB as NVFP4",
        )
        return False
    weights = random_weights(config, seed)
    if fmt == "bf16":
        save_bf16(config, weights, folder, max_shard_bytes)
    else:
        save_gguf(config, weights, folder / NVFP4_FILE)
    return True
