"""FLINT_SPEC sections 2-3, one semantic at a time, on the reference model."""

from __future__ import annotations

import math

import pytest
import torch

from flintc.checkpoint.init import random_weights
from flintc.config import FlintConfig
from flintc.model import ops
from flintc.model.reference import FlintModel
from flintc.quant.nvfp4 import quantize

TINY = FlintConfig.preset("tiny")


def one_layer(kind: str) -> FlintConfig:
    return TINY.replace(num_hidden_layers=1, layer_types=(kind,), first_k_dense_replace=1)


def run_prefill(model: FlintModel, ids: torch.Tensor, start: int = 0, cache_len: int = 64):
    B, T = ids.shape
    positions = (start + torch.arange(T))[None].expand(B, T)
    kv = model.new_kv_cache(B, cache_len)
    return model(ids, positions, torch.arange(B), kv), kv


def run_decode(model: FlintModel, ids: torch.Tensor, cache_len: int = 64):
    B, T = ids.shape
    kv = model.new_kv_cache(B, cache_len)
    out = [model(ids[:, t:t + 1], torch.full((B, 1), t), torch.arange(B), kv) for t in range(T)]
    return torch.cat(out, dim=1), kv


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_sliding_window_edge(step):
    """A key W-1 positions back is seen; one W back is not (prefill and ring-buffer decode)."""
    cfg = one_layer("sliding_attention")
    W = cfg.sliding_window
    model = FlintModel(cfg, random_weights(cfg, seed=1), mode="float64")
    T = 2 * W + 3
    p = T - 1
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    runner = run_prefill if step == "prefill" else run_decode
    base = runner(model, ids)[0][0, p]
    outside, inside = ids.clone(), ids.clone()
    outside[0, p - W] = (ids[0, p - W] + 1) % cfg.vocab_size
    inside[0, p - (W - 1)] = (ids[0, p - (W - 1)] + 1) % cfg.vocab_size
    assert torch.equal(runner(model, outside)[0][0, p], base)
    assert not torch.allclose(runner(model, inside)[0][0, p], base)


def test_very_negative_sink_is_plain_softmax():
    g = torch.Generator().manual_seed(0)
    B, T, S, Hq, Hkv, D = 2, 3, 7, 8, 2, 16
    q = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    visible = torch.ones(B, T, S, dtype=torch.bool)
    out = ops.attention_with_sink(q, k, v, visible, torch.full((Hq,), -1e4), torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(4, 1), v.transpose(1, 2).repeat_interleave(4, 1)
    ).transpose(1, 2).reshape(B, T, Hq * D)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_sink_takes_mass_and_adds_no_value():
    """p_ij = exp(s_ij - m) / (exp(sink - m) + sum_j exp(s_ij - m)), written out per head."""
    g = torch.Generator().manual_seed(1)
    B, T, S, Hq, Hkv, D = 1, 2, 5, 8, 2, 8
    q = torch.randn(B, T, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(Hq, generator=g) * 3
    visible = torch.rand(B, T, S, generator=g) > 0.3
    out = ops.attention_with_sink(q, k, v, visible, sinks, torch.float64).view(B, T, Hq, D)
    for h in range(Hq):
        kv_head = h // (Hq // Hkv)  # GQA: 4 query heads per KV head
        for t in range(T):
            s = (k[0, :, kv_head] @ q[0, t, h]) / math.sqrt(D)  # [S]
            s = s[visible[0, t]]
            m = max(float(sinks[h]), float(s.max()) if len(s) else -math.inf)
            denom = math.exp(float(sinks[h]) - m) + torch.exp(s - m).sum()
            p = torch.exp(s - m) / denom
            expect = p @ v[0, visible[0, t], kv_head]
            torch.testing.assert_close(out[0, t, h], expect, rtol=1e-12, atol=1e-12)


def test_gqa_eight_query_heads_over_two_kv_heads():
    """Query head h reads KV head h // 4: changing KV head 1 changes only heads 4..7."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 8, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 5, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 5, 2, 16, generator=g, dtype=torch.float64)
    vis = torch.ones(1, 1, 5, dtype=torch.bool)
    sinks = torch.zeros(8)
    base = ops.attention_with_sink(q, k, v, vis, sinks, torch.float64).view(8, 16)
    v2 = v.clone()
    v2[:, :, 1] += 1.0
    moved = ops.attention_with_sink(q, k, v2, vis, sinks, torch.float64).view(8, 16)
    changed = (moved != base).any(dim=-1)
    assert changed.tolist() == [False] * 4 + [True] * 4


def test_rope_rotate_half_layout():
    D = 8
    cos, sin = ops.rope_tables(10000.0, D, 16, torch.float64)
    x = torch.randn(1, 1, 1, D, dtype=torch.float64)
    pos = 5
    out = ops.apply_rope(x, cos[pos][None, None], sin[pos][None, None], torch.float64)[0, 0, 0]
    for d in range(D // 2):
        ang = pos * 10000.0 ** (-2 * d / D)
        assert out[d].item() == pytest.approx(x[0, 0, 0, d] * math.cos(ang) - x[0, 0, 0, d + D // 2] * math.sin(ang))
        assert out[d + D // 2].item() == pytest.approx(
            x[0, 0, 0, d + D // 2] * math.cos(ang) + x[0, 0, 0, d] * math.sin(ang))


def _cached_k(model, ids, start):
    _, kv = run_prefill(model, ids, start=start, cache_len=64)
    return kv[0]


def test_norm_then_rope_on_sliding_layers_only():
    """Sliding layers cache rope(rmsnorm(k)); full layers cache rmsnorm(k) with no rotation."""
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    for kind in ("sliding_attention", "full_attention"):
        cfg = one_layer(kind)
        w = random_weights(cfg, seed=3)
        model = FlintModel(cfg, w)
        pre = "model.layers.0."
        x = ops.rms_norm(w["model.embed_tokens.weight"][ids[0]], w[pre + "input_layernorm.weight"],
                         cfg.rms_norm_eps, torch.float32)
        k = ops.linear(x, w[pre + "self_attn.k_proj.weight"], torch.float32).view(1, 5, 2, cfg.head_dim)
        k = ops.rms_norm(k, w[pre + "self_attn.k_norm.weight"], cfg.rms_norm_eps, torch.float32)
        cache = _cached_k(model, ids, start=0)[0]  # [rows, Hkv, D]
        if kind == "sliding_attention":
            pos = torch.arange(5)
            k = ops.apply_rope(k, model.rope_cos[pos][None], model.rope_sin[pos][None], torch.float32)
        assert torch.equal(cache[:5], k[0])


def test_correction_bias_selects_but_never_weights():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 16, generator=g, dtype=torch.float64)
    router = torch.randn(8, 16, generator=g, dtype=torch.float64)
    bias = torch.zeros(8, dtype=torch.float64)
    bias[2] = 100.0  # forces expert 2 into every selection
    w, sel = ops.route_topk(x, router, bias, 3, 2.5, torch.float64)
    assert (sel == 2).any(dim=1).all()
    scores = torch.sigmoid(x @ router.T)
    expect = scores.gather(1, sel)
    torch.testing.assert_close(w, expect / expect.sum(1, keepdim=True) * 2.5)


def test_topk_ties_go_to_lower_expert_index():
    x = torch.randn(4, 16, dtype=torch.float64)
    router = torch.zeros(8, 16, dtype=torch.float64)  # every score is sigmoid(0)
    bias = torch.tensor([0, 0, 0, 1, 0, 0, 0, 0], dtype=torch.float64)
    _, sel = ops.route_topk(x, router, bias, 3, 1.0, torch.float64)
    assert sel.tolist() == [[3, 0, 1]] * 4


def _spy_routing(monkeypatch):
    seen = []
    real = ops.route_topk

    def spy(*args, **kwargs):
        w, sel = real(*args, **kwargs)
        seen.append(sel.sort(dim=-1).values)
        return w, sel

    monkeypatch.setattr(ops, "route_topk", spy)
    return seen


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_prefill_matches_incremental_decode(monkeypatch, fmt):
    """40 tokens (4+ sliding windows): float64 mode agrees to 1e-9; bf16 mode agrees
    within a stated bound on every token whose expert selection agrees (FLINT_SPEC 3)."""
    w = random_weights(TINY, seed=6)
    if fmt == "nvfp4":
        w = {k: quantize(v) if v.dim() >= 2 and "proj" in k else v for k, v in w.items()}
    ids = torch.randint(0, TINY.vocab_size, (2, 40), generator=torch.Generator().manual_seed(6))
    m64 = FlintModel(TINY, w, mode="float64")
    a, kva = run_prefill(m64, ids)
    b, kvb = run_decode(m64, ids)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    for x, y in zip(kva, kvb):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)

    seen = _spy_routing(monkeypatch)
    m16 = FlintModel(TINY, w, mode="bf16")
    a = run_prefill(m16, ids)[0]
    n_moe = TINY.num_hidden_layers - TINY.first_k_dense_replace
    sel_prefill = torch.stack(seen[:n_moe]).view(n_moe, 2, 40, -1)
    seen.clear()
    b = run_decode(m16, ids)[0]
    sel_decode = torch.stack([torch.stack(seen[i::n_moe]) for i in range(n_moe)])  # [L, T, B, K]
    agree = (sel_prefill == sel_decode.transpose(1, 2)).all(-1).all(0)  # [B, T]
    assert agree.float().mean() > 0.9
    diff = (a - b).abs().amax(-1)  # [B, T]
    scale = a.abs().amax()
    # bf16 rounding of reordered fp32 sums flips an ulp here and there; 3% of the
    # logit range bounds what that does through 4 layers (measured: ~1%).
    assert diff[agree].max() < 0.03 * scale


def test_bf16_mode_against_float64_oracle():
    w = random_weights(TINY, seed=7)
    ids = torch.randint(0, TINY.vocab_size, (1, 24), generator=torch.Generator().manual_seed(7))
    ref = run_prefill(FlintModel(TINY, w, mode="float64"), ids)[0]
    out = run_prefill(FlintModel(TINY, w, mode="bf16"), ids)[0]
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    print(f"bf16 vs float64 relative error: {rel:.4f}")
    assert out.dtype == torch.float32 and ref.dtype == torch.float64
    assert 0 < rel < 0.1


@pytest.mark.parametrize("model_cls", ["FlintModel", "FastFlintModel"])
def test_decode_reads_only_selected_experts(model_cls):
    """A decode step's FLOPs grow with E only through the router (E x H), not the experts:
    the reference model, and the fast baseline of `flintc bench --baselines fast`."""
    from torch.utils.flop_counter import FlopCounterMode

    from flintc.bench.fast_model import FastFlintModel

    cls = {"FlintModel": FlintModel, "FastFlintModel": FastFlintModel}[model_cls]

    def decode_flops(num_experts):
        cfg = TINY.replace(n_routed_experts=num_experts)
        model = cls(cfg, random_weights(cfg, seed=8))
        kv = model.new_kv_cache(1, 16)
        with FlopCounterMode(display=False) as counter:
            model(torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([0]), kv)
        return counter.get_total_flops()

    n_moe = TINY.num_hidden_layers - TINY.first_k_dense_replace
    extra = decode_flops(64) - decode_flops(16)
    assert extra == n_moe * 2 * (64 - 16) * TINY.hidden_size


def test_hidden_state_rms_stays_healthy():
    """Random init keeps every layer's hidden state finite and non-degenerate (tiny, and
    a full-width config with a few layers)."""
    full_few = FlintConfig.preset("full").replace(num_hidden_layers=4, n_routed_experts=16, vocab_size=1024)
    for cfg in (TINY, full_few):
        model = FlintModel(cfg, random_weights(cfg, seed=9), max_positions=64)
        rms = []
        for layer in model.layers:
            layer.register_forward_hook(lambda mod, args, out: rms.append(out.float().pow(2).mean().sqrt()))
        ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(9))
        logits = run_prefill(model, ids, cache_len=16)[0]
        assert torch.isfinite(logits).all() and logits.std() > 0.1
        for r in rms:
            assert 0.3 < r < 30, rms
