"""A build compiled with `split_lm_head_norm` (`flintc compile --split-lm-head-norm`): the
generated decode step calls the final norm's kernel (`rms_norm`, with PDL) and then the plain
`lm_head` instead of `norm_lm_head` (one kernel more per forward), the manifest records the
option, and one decode step through the Triton kernels (interpreter on the CPU) gives logits
bit-identical to the default build's."""

from __future__ import annotations

import json
import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from flintc.checkpoint.loader import load_checkpoint
from flintc.runtime.compiled import load_build
from harness import cpu_interpreter_only


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The tiny NVFP4 model compiled twice for decode batch 2, with the option off (the fused
    norm_lm_head, "default" before session 47) and on (now the default)."""
    from flintc.runtime.build import BuildOptions, compile_model

    root = tmp_path_factory.mktemp("lmsplit")
    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt="nvfp4", progress=False)
    for name, split in (("default", False), ("split", True)):
        compile_model(ckpt, root / name, BuildOptions(max_batch=2, decode_buckets=(2,), max_model_len=40,
                                                      backend="triton", device="cpu", check=False, dump=False,
                                                      split_lm_head_norm=split),
                      progress=False, log=lambda m: None)
    return root / "default", root / "split", ckpt


def _decode_src(path) -> str:
    src = (path / "runtime.py").read_text()
    decode = src[src.index("def decode_b2"):]
    return decode[:decode.index("\ndef ", 1)] if "\ndef " in decode[1:] else decode


def test_generated_decode_calls_the_norm_then_the_plain_lm_head(builds):
    default, split, _ = builds
    decode = _decode_src(split)
    assert decode.count("K.rms_norm(") == 1 and decode.count("K.lm_head(") == 1
    assert "K.norm_lm_head(" not in decode
    assert decode.index("K.rms_norm(") < decode.index("K.lm_head(")
    norm_line = next(line for line in decode.splitlines() if "K.rms_norm(" in line)
    assert "use_pdl=True" in norm_line  # chained by mark_pdl like every decode kernel
    assert _decode_src(default).count("K.norm_lm_head(") == 1
    m_split = json.loads((split / "build.json").read_text())
    m_default = json.loads((default / "build.json").read_text())
    assert m_split["split_lm_head_norm"] is True and m_default["split_lm_head_norm"] is False
    assert m_split["functions"]["decode_b2"]["kernels"] == m_default["functions"]["decode_b2"]["kernels"] + 1
    # the prefill schedule is the same either way (its LM head never had the norm folded in)
    assert m_split["functions"]["prefill_t8"] == m_default["functions"]["prefill_t8"]
    report = (split / "report.md").read_text()
    assert "`rms_norm`: flintc.kernels.fused_gemv.rms_norm" in report  # the Triton kernel, not the reference


@cpu_interpreter_only("scripts/gpu_runtime.py --build-prefix split4d (the split builds of scripts/gpu_builds.sh)")
def test_decode_logits_bit_identical_to_the_default_build(builds):
    """Same caches (random), a batch of 2 at positions 30 (full cache rows 0..30; the
    W = 9 ring wrapped) and 4: the split build's logits are the default build's, bit for bit
    (the interpreter sums the norm's squares in the same order in both kernels)."""
    default, split, ckpt = builds
    runners = [load_build(path, ckpt=ckpt, progress=False) for path in (default, split)]
    g = torch.Generator().manual_seed(3)
    for a, b in zip(runners[0].kv, runners[1].kv):
        a.copy_(torch.randn(a.shape, generator=g).to(a.dtype))
        b.copy_(a)
    ids = torch.tensor([[17], [400]])
    pos = torch.tensor([[30], [4]])
    slots = torch.tensor([1, 0])
    want, got = (r.forward("decode_b2", ids, pos, slots) for r in runners)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, want), (got - want).abs().max()
