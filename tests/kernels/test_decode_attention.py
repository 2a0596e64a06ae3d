"""Tests of `flintc.kernels.decode_attention` against the plain-torch references in
`flintc.ops.attention` (`torch.ops.flintc.decode_attention` / `attention_combine`).

CPU: Triton interpreter twins at tiny shapes (Hq=8, Hkv=2, D=32; full cache S=48 and a
ring of W=9), including empty chunks and a very negative sink. GPU (`-m gpu`): full
shapes (Hq=32, Hkv=4, D=128), contexts up to 262144, ring W=513, with and without PDL.
Tolerance: the kernels reduce in fp32 in another order (online softmax, tf32/tf32x3
dots on GPU), so o_part/lse are close, not equal; the bf16 output is within one bf16 ulp.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import flintc.ops  # noqa: E402,F401  (registers torch.ops.flintc.*)
from flintc.kernels import decode_attention as kernels  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def make_inputs(B, Hq, Hkv, D, S, positions, device="cpu", num_slots=None, gen=None):
    """Random bf16 q and caches (finite everywhere), shuffled slots, int64 positions."""
    num_slots = num_slots or B + 2
    q = torch.randn(B, 1, Hq, D, generator=gen).to(torch.bfloat16).to(device)
    k_cache = torch.randn(num_slots, S, Hkv, D, generator=gen).to(torch.bfloat16).to(device)
    v_cache = torch.randn(num_slots, S, Hkv, D, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.randperm(num_slots, generator=gen)[:B].to(device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device).view(B, 1)
    return q, k_cache, v_cache, slots, pos


def assert_partials_close(o, lse, o_ref, lse_ref, rtol=1e-5, atol=1e-5):
    """-inf exactly where the reference has -inf; finite values close; no NaN."""
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "NaN in the kernel output"
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty), "empty chunks (lse = -inf) differ"
    torch.testing.assert_close(lse[~empty], lse_ref[~empty], rtol=rtol, atol=atol)
    torch.testing.assert_close(o, o_ref, rtol=rtol, atol=atol)
    assert (o[empty] == 0).all(), "an empty chunk must give o = 0"


def assert_within_one_bf16_ulp(out, ref, atol=0.0):
    """Each bf16 element at most one ulp (of the reference value) away, or `atol`:
    an output much smaller than the values it averages (cancellation over 100K+ keys)
    carries fp32 reordering error of their size, not of its own."""
    a, r = out.float(), ref.float()
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(1e-30))) - 7).clamp_min(atol)
    diff = (a - r).abs()
    share = (diff > 0).float().mean().item()
    worst = (diff / ulp).max().item()
    assert not torch.isnan(a).any(), "NaN in the combined output"
    assert (diff <= ulp).all(), f"{worst:.2f} ulp max; {share:.2%} of elements differ"


def run_both(q, k_cache, v_cache, slots, pos, window, num_splits, sinks, use_pdl=False):
    """Kernel and reference partials and outputs (kernel outputs poisoned first)."""
    real_empty = torch.empty
    try:  # poison the launchers' allocations: every element must be written
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        o, lse = kernels.decode_attention(q, k_cache, v_cache, slots, pos, window, num_splits,
                                          use_pdl=use_pdl)
        out = kernels.attention_combine(o, lse, sinks, use_pdl=use_pdl)
        out_from_ref = kernels.attention_combine(*torch.ops.flintc.decode_attention(
            q, k_cache, v_cache, slots, pos, window, num_splits), sinks)
    finally:
        torch.empty = real_empty
    o_ref, lse_ref = torch.ops.flintc.decode_attention(q, k_cache, v_cache, slots, pos,
                                                       window, num_splits)
    out_ref = torch.ops.flintc.attention_combine(o_ref, lse_ref, sinks)
    return (o, lse, out, out_from_ref), (o_ref, lse_ref, out_ref)


CPU_CASES = [
    # (window, S, positions per batch size)
    (0, 48, {1: [0], 3: [0, 5, 47]}),
    (0, 48, {1: [47], 3: [30, 12, 1]}),
    (9, 9, {1: [0], 3: [0, 4, 8]}),     # not yet wrapped: rows past p never written
    (9, 9, {1: [31], 3: [31, 9, 100]}),  # wrapped (> 3W)
]


@pytest.mark.parametrize("num_splits", [1, 3, 5])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("window,S,positions", CPU_CASES)
def test_decode_attention_matches_reference(window, S, positions, B, num_splits):
    Hq, Hkv, D = 8, 2, 32
    q, kc, vc, slots, pos = make_inputs(B, Hq, Hkv, D, S, positions[B])
    sinks = torch.randn(Hq) * 2
    sinks[0] = -1e4  # a sink that takes no mass
    (o, lse, out, out_from_ref), (o_ref, lse_ref, out_ref) = run_both(
        q, kc, vc, slots, pos, window, num_splits, sinks)
    assert_partials_close(o, lse, o_ref, lse_ref)
    assert_within_one_bf16_ulp(out, out_ref)
    assert_within_one_bf16_ulp(out_from_ref, out_ref)


def test_empty_chunks_give_zero_and_neg_inf():
    """Position 0 in a full cache of 48 rows cut in 5: only chunk 0 has a key."""
    q, kc, vc, slots, pos = make_inputs(1, 8, 2, 32, 48, [0])
    o, lse = kernels.decode_attention(q, kc, vc, slots, pos, 0, 5)
    assert torch.isfinite(lse[:, :, 0]).all()
    assert torch.isneginf(lse[:, :, 1:]).all() and (o[:, :, 1:] == 0).all()


def test_combine_only_sink_mass():
    """All splits empty: the sink takes all the mass and the output is zero."""
    o = torch.zeros(2, 8, 3, 32)
    lse = torch.full((2, 8, 3), float("-inf"))
    out = kernels.attention_combine(o, lse, torch.randn(8))
    assert out.dtype == torch.bfloat16 and (out == 0).all()


def _good_args():
    q, kc, vc, slots, pos = make_inputs(2, 8, 2, 32, 16, [3, 7])
    return dict(q=q, k_cache=kc, v_cache=vc, slots=slots, positions=pos, window=0, num_splits=2)


@pytest.mark.parametrize("name,bad", [
    ("q", lambda a: a["q"].float()),
    ("q", lambda a: a["q"].transpose(2, 3)),
    ("q", lambda a: a["q"].expand(2, 2, 8, 32).contiguous()),
    ("k_cache", lambda a: a["k_cache"][..., :16].contiguous()),
    ("v_cache", lambda a: a["v_cache"].half()),
    ("v_cache", lambda a: a["v_cache"][:, :8].contiguous()),
    ("slots", lambda a: a["slots"].float()),
    ("positions", lambda a: a["positions"].view(-1)),
    ("positions", lambda a: a["positions"].int()),
    ("window", lambda a: -1),
    ("num_splits", lambda a: 0),
])
def test_decode_attention_rejects_bad_input(name, bad):
    args = _good_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=name):
        kernels.decode_attention(**args)


@pytest.mark.parametrize("name,bad", [
    ("o_part", lambda o, l, s: (o.to(torch.bfloat16), l, s)),
    ("lse", lambda o, l, s: (o, l[:, :, :1].contiguous(), s)),
    ("sinks", lambda o, l, s: (o, l, s[:4].contiguous())),
    ("sinks", lambda o, l, s: (o, l, s.double())),
])
def test_attention_combine_rejects_bad_input(name, bad):
    o, lse, sinks = torch.zeros(1, 8, 3, 32), torch.zeros(1, 8, 3), torch.zeros(8)
    with pytest.raises(ValueError, match=name):
        kernels.attention_combine(*bad(o, lse, sinks))


GPU_CASES = [
    # (window, S, num_splits, positions: B of them). The reference expands V to
    # [B, Hq, S, D] fp32 (4 GiB per 2**15 rows at B=8), hence B=1 at the longest context.
    (0, 262144, 128, [262143]),
    (0, 262144, 64, [262100]),
    (0, 65536, 64, [65535, 65000, 40000, 32768, 1024, 100, 0, 65530]),
    (0, 8192, 96, [8191, 8000, 5000, 4097, 100, 17, 0, 8190]),
    (0, 8192, 96, [5]),
    (513, 513, 8, [100000, 512, 513, 0, 300, 1026, 1539, 7]),
    (513, 513, 3, [2000]),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA "
                    "(and TRITON_INTERPRET=0 in the environment)")
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("window,S,num_splits,positions", GPU_CASES)
def test_decode_attention_gpu(window, S, num_splits, positions, use_pdl):
    B = len(positions)
    gen = torch.Generator().manual_seed(S + B)
    Hq, Hkv, D = 32, 4, 128
    q, kc, vc, slots, pos = make_inputs(B, Hq, Hkv, D, S, positions, device="cuda",
                                        num_slots=B, gen=gen)
    sinks = (torch.randn(Hq, generator=gen) * 2).cuda()
    sinks[1] = -1e4
    (o, lse, out, out_from_ref), (o_ref, lse_ref, out_ref) = run_both(
        q, kc, vc, slots, pos, window, num_splits, sinks, use_pdl=use_pdl)
    assert_partials_close(o, lse, o_ref, lse_ref, rtol=2e-5, atol=2e-5)
    assert_within_one_bf16_ulp(out, out_ref, atol=1e-5)
    assert_within_one_bf16_ulp(out_from_ref, out_ref, atol=1e-5)
