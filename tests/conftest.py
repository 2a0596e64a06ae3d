"""Shared fixtures: tiny checkpoints written once per test session."""

from __future__ import annotations

import pytest

from flintc.checkpoint.writer import make_checkpoint


@pytest.fixture(scope="session")
def tiny_bf16_dir(tmp_path_factory):
    """A tiny BF16 checkpoint folder (seed 0)."""
    return make_checkpoint("tiny", "bf16", tmp_path_factory.mktemp("ckpt") / "bf16", seed=0)


@pytest.fixture(scope="session")
def tiny_nvfp4_gguf(tmp_path_factory):
    """A tiny NVFP4 GGUF file (seed 0), config.json and tokenizer beside it."""
    return make_checkpoint("tiny", "nvfp4", tmp_path_factory.mktemp("ckpt") / "nvfp4", seed=0)
