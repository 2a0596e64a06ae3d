"""A build compiled with `fold_attention_combine` (`flintc compile
--fold-attention-combine`): the generated decode step calls decode_attention_combine (one
kernel per layer less), the manifest records the option, and one decode step through the
Triton kernels (interpreter on the CPU) agrees with the same build's reference ops."""

from __future__ import annotations

import json
import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from flintc.checkpoint.loader import load_checkpoint
from flintc.runtime.compiled import CompiledRunner, load_build, read_manifest
from harness import cpu_interpreter_only


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    from flintc.runtime.build import BuildOptions, compile_model

    out = tmp_path_factory.mktemp("fold") / "b"
    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt="nvfp4", progress=False)
    compile_model(ckpt, out, BuildOptions(max_batch=2, decode_buckets=(2,), max_model_len=40,
                                          backend="triton", device="cpu", check=False, dump=False,
                                          fold_attention_combine=True),
                  progress=False, log=lambda m: None)
    return out, ckpt


def test_generated_decode_calls_the_folded_kernel(build):
    path, ckpt = build
    src = (path / "runtime.py").read_text()
    decode = src[src.index("def decode_b2"):]
    decode = decode[:decode.index("\ndef ", 1)] if "\ndef " in decode[1:] else decode
    layers = ckpt.config.num_hidden_layers
    assert decode.count("K.decode_attention_combine(") == layers
    assert "K.attention_combine(" not in decode and "K.decode_attention(" not in decode
    manifest = json.loads((path / "build.json").read_text())
    assert manifest["fold_attention_combine"] is True
    moe = sum(ckpt.config.is_moe_layer(i) for i in range(layers))
    # + embedding, final norm, LM head (split_lm_head_norm, the default)
    assert manifest["functions"]["decode_b2"]["kernels"] == 6 * moe + 5 * (layers - moe) + 3


@cpu_interpreter_only("scripts/gpu_attn_fold.sh (the fused kernel's GPU tests, the fold4d 4-layer check)")
def test_decode_step_matches_the_reference_ops(build):
    """Same caches (random), a batch of 2 at positions 30 (full cache rows 0..30; the
    W = 9 ring wrapped) and 4: the Triton kernels' logits within the pipelines'
    tolerance of the reference ops' (atol 0.06, rtol 0.02, as tests/runtime)."""
    path, ckpt = build
    triton_runner = load_build(path, ckpt=ckpt, progress=False)
    torch_runner = CompiledRunner(path, dict(read_manifest(path), backend="torch"), ckpt,
                                  torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    for t_tr, t_ref in zip(triton_runner.kv, torch_runner.kv):
        t_tr.copy_(torch.randn(t_tr.shape, generator=g).to(t_tr.dtype))
        t_ref.copy_(t_tr)
    ids = torch.tensor([[17], [400]])
    pos = torch.tensor([[30], [4]])
    slots = torch.tensor([1, 0])
    got = triton_runner.forward("decode_b2", ids, pos, slots)
    want = torch_runner.forward("decode_b2", ids, pos, slots)
    assert bool(torch.isfinite(got).all())
    assert torch.allclose(got, want, atol=0.06, rtol=0.02), (got - want).abs().max()
    for a, b in zip(triton_runner.kv, torch_runner.kv):  # the QKV kernel's cache writes
        assert torch.allclose(a.float(), b.float(), atol=0.06, rtol=0.02)
