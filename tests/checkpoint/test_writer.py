"""make_checkpoint + load_checkpoint end to end, random_weights, and atomic writing."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import flintc.checkpoint.init as init
from flintc.checkpoint.init import random_weights
from flintc.checkpoint.loader import load_checkpoint
from flintc.checkpoint.writer import make_checkpoint
from flintc.config import FlintConfig
from flintc.errors import CheckpointError, ConfigError
from flintc.model.weights import check_weights, weight_specs
from flintc.quant.nvfp4 import NVFP4Tensor

TINY = FlintConfig.preset("tiny")


def has_tokenizer_module() -> bool:
    try:
        import flintc.checkpoint.tokenizer  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def test_random_weights_are_deterministic_and_follow_the_rules():
    a, b = random_weights(TINY, seed=4), random_weights(TINY, seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], random_weights(TINY, seed=5)["lm_head.weight"])
    check_weights(TINY, a)
    for spec in weight_specs(TINY):
        w = a[spec.name]
        assert w.dtype == (torch.float32 if spec.kind == "fp32" else torch.bfloat16)
        if "norm" in spec.name:
            assert torch.equal(w, w.bfloat16().float())  # bf16-exact
    assert abs(a["model.embed_tokens.weight"].float().std().item() - 1) < 0.05
    q = a["model.layers.0.self_attn.o_proj.weight"].float()
    assert abs(q.std().item() * math.sqrt(TINY.q_size) - 1) < 0.05
    bias = a["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() < 0.3


@pytest.mark.parametrize("shard", [None, 100_000])
def test_bf16_checkpoint_loads_back_exactly(tmp_path, shard):
    out = tmp_path / "ckpt"
    path = make_checkpoint("tiny", "bf16", out, seed=3, max_shard_bytes=shard)
    assert path == out
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.config == TINY and ckpt.fmt == "bf16" and ckpt.source == str(out)
    want = random_weights(TINY, seed=3)
    assert ckpt.weights.keys() == want.keys()
    assert all(torch.equal(ckpt.weights[k], want[k]) for k in want)
    if has_tokenizer_module():
        assert ckpt.tokenizer_dir == out and (out / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt"]  # no temp folder left


def test_nvfp4_checkpoint(tmp_path):
    out = tmp_path / "nv"
    path = make_checkpoint(TINY, "nvfp4", out, seed=1)
    assert path == out / "model-nvfp4.gguf" and (out / "config.json").is_file()
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.fmt == "nvfp4" and ckpt.config == TINY
    check_weights(TINY, ckpt.weights)
    assert isinstance(ckpt.weights["model.layers.2.mlp.experts.up_proj.weight"], NVFP4Tensor)
    if has_tokenizer_module():
        assert ckpt.tokenizer_dir == out
    # the folder works too, and a config from elsewhere
    assert load_checkpoint(out, progress=False).fmt == "nvfp4"
    moved = tmp_path / "elsewhere.gguf"
    path.rename(moved)
    with pytest.raises(CheckpointError, match="hf_config_path"):
        load_checkpoint(moved, progress=False)
    assert load_checkpoint(moved, hf_config_path=out, progress=False).config == TINY


def test_full_config_writes_config_and_tokenizer_only(tmp_path, caplog):
    out = tmp_path / "full"
    with caplog.at_level(logging.WARNING, logger="flintc.checkpoint.writer"):
        path = make_checkpoint("full", "nvfp4", out)
    assert path == out
    assert "config.json and the tokenizer only" in caplog.text
    assert not list(out.glob("*.gguf")) and not list(out.glob("*.safetensors"))
    ckpt = load_checkpoint(out, load_format="dummy", device="meta", fmt="nvfp4", progress=False)
    assert ckpt.config == FlintConfig.preset("full")
    check_weights(ckpt.config, ckpt.weights)


def test_refuses_a_non_empty_folder(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        make_checkpoint("tiny", "bf16", out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_an_empty_folder_is_fine(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert make_checkpoint("tiny", "bf16", out) == out
    assert (out / "model.safetensors").is_file()


def test_a_vocab_too_small_for_the_tokenizer_is_a_config_error(tmp_path):
    """A config.json with vocab_size below the tokenizer's 269 tokens: a ValueError from
    deep in the tokenizer builder was raised (a traceback from flintc make-checkpoint);
    now a ConfigError naming the file and the field, before anything is written."""
    config_file = tmp_path / "config.json"
    TINY.replace(vocab_size=7).save(config_file)
    with pytest.raises(ConfigError, match=rf"^{config_file}: field 'vocab_size' is 7, .*at least 269"):
        make_checkpoint(str(config_file), "bf16", tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


@pytest.mark.parametrize("vocab_size", [2**20 + 1, 2**31, 2**40])
def test_a_vocab_too_large_for_the_tokenizer_is_a_config_error(tmp_path, monkeypatch, vocab_size):
    """vocab_size 2**31 / 2**40 aborted `flintc make-checkpoint` (exit 134: the BPE trainer
    failed to allocate 72 TB) and left its temporary folder; 2,000,000 took 4 GB. Above
    the tokenizer's MAX_VOCAB_SIZE (2**20) it is a ConfigError naming the file, the field
    and the bound, before anything is written (building a tokenizer here fails the test
    instead of allocating)."""
    import flintc.checkpoint.tokenizer as tokenizer

    def no_build(vocab_size):
        raise AssertionError(f"a tokenizer of {vocab_size} tokens was built")

    monkeypatch.setattr(tokenizer, "build_tokenizer", no_build)
    config_file = tmp_path / "config.json"
    TINY.replace(vocab_size=vocab_size).save(config_file)
    with pytest.raises(ConfigError, match=rf"^{config_file}: field 'vocab_size' is {vocab_size}, too large for "
                                          r"the tokenizer a checkpoint gets: expected at most 1048576 \(2\*\*20"):
        make_checkpoint(str(config_file), "bf16", tmp_path / "ckpt")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_leftovers_of_killed_runs_are_removed(tmp_path):
    """A make-checkpoint killed mid-write (SIGKILL, the out-of-memory killer, the BPE
    trainer's abort) left `.ckpt.tmp-PID-XXXXXXXX` beside --out, and later runs never
    removed it, as `flintc compile` removes its own (`fileio.remove_stale_temp_dirs`).
    The next make_checkpoint of the same --out removes those of processes that are gone
    (the old and the current name form); a live process's folder and other names stay."""
    import os

    dead = _dead_pid()
    leftovers = [tmp_path / f".ckpt.tmp-{dead}-0123abcd", tmp_path / f".ckpt.{dead}.k3x_9a0b"]
    kept = [tmp_path / f".ckpt.tmp-{os.getppid()}-0123abcd", tmp_path / f".other.tmp-{dead}-0123abcd"]
    for folder in leftovers + kept:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    make_checkpoint("tiny", "bf16", tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", *(p.name for p in kept)])


def test_a_failure_leaves_nothing_half_written(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(init, "random_weights", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        make_checkpoint("tiny", "bf16", tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_loader_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "absent")
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="neither"):
        load_checkpoint(junk)
    with pytest.raises(CheckpointError, match="neither"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="no config found"):
        load_checkpoint(tmp_path)


def test_loader_names_a_build_or_several_gguf_files(tmp_path):
    """A BUILD given as MODEL, or a folder of two .gguf files: both were "neither a BF16
    checkpoint folder ... nor a GGUF file"; now the error says what the folder is."""
    build = tmp_path / "build"
    build.mkdir()
    (build / "build.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"nor a GGUF file \(it is a flintc BUILD: run it with --build"):
        load_checkpoint(build)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("b.gguf", "a.gguf"):
        (two / name).write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"two: holds 2 GGUF files \(a.gguf, b.gguf\), expected one; pass"):
        load_checkpoint(two)
