"""`flintc.bench.fast_model.FastFlintModel` (the network of `flintc bench --baselines
fast`) against the reference `FlintModel` on the CPU, tiny config, both weight formats.

The fast model rounds where bf16 GEMMs round (every GEMM's output, the router logits,
the attention scores and probabilities), not at FLINT_SPEC's points, so it matches the
reference within bf16 tolerances, not bit for bit. Bounds used here, measured on seeds
3-5 (largest seen in brackets):

- with a decisive correction bias (every token selects the same experts, so both models
  route alike): every logit within 3% of the reference logits' largest magnitude
  (1.8%), every KV-cache tensor within 3% of its largest magnitude (1.7%), greedy
  tokens agree on >= 90% of the positions (95-100%);
- with the random router (near-ties among the 16 experts' scores, which bf16 router
  logits flip for 20-30% of the tokens): the same 3% on the tokens whose routing agreed
  at every MoE layer for them and every earlier token of their sequence (1.3%); greedy
  tokens agree on >= 85% of all positions (92-98%).

Each run: 3 sequences in shuffled cache slots starting at positions 0, 5 and 11, a
12-token prefill (longer than the window of 9: it keeps only its last 9 keys in the
ring) then 10 decode steps (positions up to 32: the rings wrap three times), each model
on its own caches of the same layout.
"""

from __future__ import annotations

import os

import pytest
import torch

from flintc.bench.baselines import EagerStep, _StaticDecode, kv_view
from flintc.bench.fast_model import FastFlintModel, experts, linear, nvfp4_to_bf16
from flintc.checkpoint.init import random_weights
from flintc.config import FlintConfig
from flintc.model import ops
from flintc.model.reference import FlintModel
from flintc.quant.nvfp4 import quantize

TINY = FlintConfig.preset("tiny")
TOL = 0.03  # of the reference's largest |value|
STARTS, SLOTS = torch.tensor([0, 5, 11]), torch.tensor([2, 0, 1])
PREFILL, DECODE, CACHE = 12, 10, 40


def _weights(fmt: str, seed: int, decisive: bool):
    w = random_weights(TINY, seed=seed)
    if decisive:  # distinct biases >= 1 apart: top-k by bias alone (sigmoid scores are in (0, 1))
        for k in w:
            if k.endswith("e_score_correction_bias"):
                w[k] = torch.arange(TINY.n_routed_experts, dtype=torch.float32) * 4.0 % 17
    if fmt == "nvfp4":
        w = {k: quantize(v) if v.dim() >= 2 and "proj" in k else v for k, v in w.items()}
    return w


def _run_both(w, seed, monkeypatch):
    """Prefill + decode steps on both models; returns (ref logits, fast logits [B, T, V],
    ref caches, fast caches, routing agreed [B, T])."""
    seen = []
    select = ops.select_topk

    def spy(*a, **k):
        out = select(*a, **k)
        seen.append(out[1])
        return out

    monkeypatch.setattr(ops, "select_topk", spy)  # both models route through ops.select_topk
    ref, fast = FlintModel(TINY, w), FastFlintModel(TINY, w)
    B = len(STARTS)
    ids = torch.randint(0, TINY.vocab_size, (B, PREFILL + DECODE), generator=torch.Generator().manual_seed(seed))
    kr, kf = ref.new_kv_cache(B, CACHE), fast.new_kv_cache(B, CACHE)
    assert [t.shape for t in kr] == [t.shape for t in kf] and all(t.dtype == torch.bfloat16 for t in kf)
    outs, agree = [], []
    for t0, t1 in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, PREFILL + DECODE)]:
        pos = STARTS[:, None] + torch.arange(t0, t1)
        seen.clear()
        a = ref(ids[:, t0:t1], pos, SLOTS, kr)
        sa = list(seen)
        seen.clear()
        b = fast(ids[:, t0:t1], pos, SLOTS, kf)
        assert b.dtype == torch.float32 and b.shape == a.shape == (B, t1 - t0, TINY.vocab_size)
        agree.append(torch.stack([(x == y).all(-1) for x, y in zip(sa, seen, strict=True)]).all(0).view(B, -1))
        outs.append((a, b))
    return (torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1), kr, kf,
            torch.cat(agree, 1))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fast_model_matches_the_reference_when_routing_agrees(fmt, monkeypatch):
    a, b, kr, kf, agree = _run_both(_weights(fmt, 3, decisive=True), 3, monkeypatch)
    assert agree.all()
    err = (a - b).abs().amax() / a.abs().amax()
    assert err < TOL, f"largest logit difference {err:.3g} of the logits' scale"
    for i, (x, y) in enumerate(zip(kr, kf)):
        kerr = (x.float() - y.float()).abs().max() / x.float().abs().max()
        assert kerr < TOL, f"cache {i}: {kerr:.3g}"
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fast_model_with_the_random_router(fmt, monkeypatch):
    a, b, _, _, agree = _run_both(_weights(fmt, 4, decisive=False), 4, monkeypatch)
    ok = agree.cumprod(dim=1).bool()  # a flip changes the later tokens' keys through the caches
    assert ok.any()
    err = (a - b).abs().amax(-1) / a.abs().amax()  # [B, T]
    assert err[ok].max() < TOL
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85


def test_logits_rows_and_hidden_states():
    w = _weights("bf16", 5, decisive=True)
    fast = FastFlintModel(TINY, w)
    ids = torch.randint(0, TINY.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    full = fast(ids, pos, torch.tensor([1, 0]), fast.new_kv_cache(2, 16))
    rows = torch.tensor([4, 9])
    picked, hidden = fast(ids, pos, torch.tensor([1, 0]), fast.new_kv_cache(2, 16), logits_rows=rows)
    assert hidden.dtype == torch.bfloat16 and hidden.shape == (2, 5, TINY.hidden_size)
    torch.testing.assert_close(picked, full.reshape(10, -1)[rows], rtol=0, atol=0)
    torch.testing.assert_close(fast.logits_from_hidden(hidden), full, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fast_model_plugs_into_the_baseline_steps(fmt):
    """EagerStep and _StaticDecode (what CompiledStep compiles) take it in place of
    FlintModel, over kv_view'ed caches, and give the eager model's logits [B, V]."""
    w = _weights(fmt, 3, decisive=True)
    fast = FastFlintModel(TINY, w)
    kv = fast.new_kv_cache(2, 32)
    for t in kv:
        t.normal_(generator=torch.Generator().manual_seed(1))
    kv2 = [t.clone() for t in kv]
    ids, pos, slots = torch.tensor([[3], [7]]), torch.tensor([[20], [20]]), torch.tensor([0, 1])
    got = EagerStep(fast, kv_view(kv, TINY, 21))(ids, pos, slots)
    with torch.inference_mode():
        static = _StaticDecode(fast, kv_view(kv2, TINY, 21))(ids, pos, slots)
        want = fast(ids, pos, slots, kv_view([t.clone() for t in kv2], TINY, 21))[:, 0]
    assert got.shape == (2, TINY.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, static, rtol=0, atol=0)
    torch.testing.assert_close(static, want, rtol=0, atol=0)


def test_nvfp4_ops_apply_the_global_scale_after_the_gemm():
    """`linear` / `experts` on NVFP4: bf16 GEMM of the exact bf16 dequantization, then the
    global scale (scalar, or per expert, or a scalar for a stack)."""
    g = torch.Generator().manual_seed(2)
    w = quantize((torch.randn(4, 16, 64, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [3, 3], [1, 0]])
    parts = [w.codes, w.scales, w.global_scale]
    y = experts(x, ids, parts)
    want = torch.einsum("nkoi,ni->nko", w.dequantize()[ids].double(), x.double())
    assert y.dtype == torch.bfloat16 and y.shape == (3, 2, 16)
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    one = experts(x, ids, [w.codes, w.scales, torch.tensor(0.5)])
    plain = (nvfp4_to_bf16(w.codes, w.scales)[ids] @ x[:, None, :, None])[..., 0]
    torch.testing.assert_close(one, (plain.float() * 0.5).to(torch.bfloat16), rtol=0, atol=0)
    m = quantize((torch.randn(16, 64, generator=g) * 0.05).to(torch.bfloat16))
    got = linear(x, [m.codes, m.scales, m.global_scale])
    torch.testing.assert_close(got.double(), x.double() @ m.dequantize().double().T, rtol=2e-2, atol=1e-3)


def test_grouped_experts_only_where_grouped_mm_needs_no_host_sync(monkeypatch):
    """On CUDA the grouped path is taken on sm_90 / sm_100 only (elsewhere torch's
    grouped_mm copies the offsets to the host, which CUDA-graph capture forbids): the
    same test as the Triton MoE's `_pick_impl` (one shared `grouped_mm_sync_free`)."""
    from flintc.bench import fast_model
    from flintc.kernels import platform

    cuda = torch.device("cuda", 0)
    if platform.grouped_mm_fn() is None:
        assert not fast_model.grouped_experts_apply(cuda)
        return
    for major, want in ((8, False), (9, True), (10, True), (12, False)):
        monkeypatch.setattr(platform, "capability_major", lambda index, m=major: m)
        assert fast_model.grouped_experts_apply(cuda) is want, major
    assert not fast_model.grouped_experts_apply(torch.device("meta"))


def test_forward_queries_no_device_property(monkeypatch):
    """Whether the experts may run grouped is decided at construction (and after
    `.to()`), never in `forward`, so Dynamo traces no CUDA capability query (session
    38's first H100 run of the fast baseline traced one through a functools.cache'd
    helper, with a Dynamo warning; whether it broke the graph was not recorded then)."""
    from flintc.bench import fast_model

    fast = FastFlintModel(TINY, _weights("bf16", 3, decisive=True))
    assert fast.grouped_experts == fast_model.grouped_experts_apply(torch.device("cpu"))
    seen = []
    monkeypatch.setattr(fast_model, "grouped_experts_apply", lambda device: seen.append(device) or False)
    fast = fast.to("cpu")
    assert seen == [torch.device("cpu")] and fast.grouped_experts is False, "refreshed by .to()"

    def refuse(device):
        raise AssertionError("forward queried the device")

    monkeypatch.setattr(fast_model, "grouped_experts_apply", refuse)
    out = fast(torch.tensor([[3]]), torch.tensor([[0]]), torch.tensor([0]), fast.new_kv_cache(1, 8))
    assert out.shape == (1, 1, TINY.vocab_size) and torch.isfinite(out).all()


@pytest.mark.parametrize("xdim", [2, 3])
def test_bf16_experts_grouped_gemm_matches_the_gather(xdim, monkeypatch):
    """bf16 `experts` on the CPU runs one grouped GEMM (`grouped_experts_apply`): the
    same values as the gathered-matrices form (`w[ids] @ x`, forced by turning the
    grouped path off), tokens sharing an expert (each distinct one read once) and an
    expert picked twice by one token included; each output row is one bf16-rounded dot
    product in both forms, so they agree within one bf16 rounding."""
    from flintc.bench import fast_model

    if not fast_model.grouped_experts_apply(torch.device("cpu")):
        pytest.skip("this torch has no grouped_mm (torch.nn.functional.grouped_mm / torch._grouped_mm)")
    monkeypatch.setattr(fast_model, "GROUPED_MIN_ROWS", 12)  # these 4 x 3 rows: grouped
    calls = []
    grouped_fn = fast_model._experts_grouped
    monkeypatch.setattr(fast_model, "_experts_grouped", lambda *a: calls.append(1) or grouped_fn(*a))
    g = torch.Generator().manual_seed(4)
    W = (torch.randn(6, 32, 64, generator=g) * 0.05).to(torch.bfloat16)
    ids = torch.tensor([[5, 0, 2], [2, 2, 4], [0, 5, 1], [3, 3, 3]])
    shape = (4, 64) if xdim == 2 else (4, 3, 64)
    x = torch.randn(*shape, generator=g).to(torch.bfloat16)
    got = experts(x, ids, [W])
    assert calls == [1], "the grouped path ran"
    monkeypatch.setattr(fast_model, "GROUPED_MIN_ROWS", 13)  # one row short: gathered
    below = experts(x, ids, [W])
    monkeypatch.setattr(fast_model, "GROUPED_MIN_ROWS", 12)
    monkeypatch.setattr(fast_model, "grouped_experts_apply", lambda device: False)
    gathered = experts(x, ids, [W])
    assert calls == [1], "below GROUPED_MIN_ROWS and without grouped_mm: gathered"
    torch.testing.assert_close(below, gathered, rtol=0, atol=0)
    xk = x[:, None, :] if xdim == 2 else x
    want = torch.einsum("nkoi,nki->nko", W[ids].double(), xk.expand(4, 3, 64).double())
    assert got.dtype == torch.bfloat16 and got.shape == (4, 3, 32)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(got, gathered, rtol=2 ** -7, atol=1e-6)


def test_the_plain_torch_baseline_needs_no_triton():
    """Triton is an optional extra (the kernels' backend); the plain-PyTorch baselines are
    not: `flintc.bench.fast_model` (and `baselines`, `core`, `benchmarks/torch_baselines.py`)
    import and run a forward of the tiny model with every `triton` import refused. The
    grouped_mm checks they share with the Triton MoE (`grouped_mm_fn`,
    `grouped_mm_sync_free`) live in the torch-only `flintc.kernels.platform`, not in
    `grouped_gemm` (which imports triton)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
sys.meta_path.insert(0, NoTriton())
for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
    del sys.modules[name]
import torch
import flintc.bench.fast_model as fm
import flintc.bench.baselines, flintc.bench.core
sys.path.insert(0, sys.argv[1])
import torch_baselines
from flintc.checkpoint.dummy import dummy_weights
from flintc.config import FlintConfig
from flintc.kernels import platform
assert fm.grouped_mm_fn is platform.grouped_mm_fn and fm.grouped_mm_sync_free is platform.grouped_mm_sync_free
cfg = FlintConfig.preset("tiny")
for fmt in ("bf16", "nvfp4"):
    model = fm.FastFlintModel(cfg, dummy_weights(cfg, fmt, "cpu", seed=3))
    out = model(torch.tensor([[3, 4]]), torch.tensor([[0, 1]]), torch.tensor([0]), model.new_kv_cache(1, 8))
    assert out.shape == (1, 2, cfg.vocab_size) and torch.isfinite(out).all()
bad = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.") or m == "flintc.kernels.grouped_gemm")
assert not bad, bad
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code, str(root / "benchmarks")], capture_output=True, text=True,
                       cwd=root, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
