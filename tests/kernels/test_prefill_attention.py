"""Tests of `flintc.kernels.prefill_attention` against the plain-torch reference
`torch.ops.flintc.prefill_attention_kv`, and of that reference against
`flintc.model.ops.attention_with_sink` over the keys and masks the model builds.

CPU: Triton interpreter twins at tiny shapes (Hq=8, Hkv=2, D=32; a ring of W=9 and a
full cache of 48 rows): p0 = 0, chunks that start mid-ring and wrap it, T > W, T not a
multiple of the query tile (4 tokens x 4 heads) or the key block (16), B = 1 and 2,
a sink that takes no mass and one that takes most. Outputs are poisoned (NaN) before
the kernel; the caches must equal the reference's bit for bit (rows the chunk does
not write untouched). GPU (`-m gpu`): the full model's shapes (Hq=32, Hkv=4, D=128,
W=513), chunks of 512 and 2048 at offsets up to 100000, with and without PDL.
Tolerance: every output element within one bf16 ulp of the reference (fp32 sums in
another order, Triton's exp; on the GPU p.v with p split into bf16 parts).
"""

import os

# The interpreter must be chosen before triton is imported, and only without a GPU: set
# unconditionally, it leaked into every GPU test collected after this module (the CUDA
# kernels' dispatch reads it at each call; tests/conftest.py now refuses such a leak).
if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import flintc.ops  # noqa: E402,F401  (registers torch.ops.flintc.*)
from flintc.kernels import prefill_attention as kernels  # noqa: E402
from flintc.model import ops  # noqa: E402
from flintc.ops.attention import write_kv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Floor of the one-ulp bound: an output much smaller than the values it averages
# (cancellation over hundreds of keys) carries fp32 reordering error of their size
# (measured 3e-5 at 640 keys, values ~ N(0, 1)), not of its own.
ATOL = 2.0 ** -14


def make_inputs(B, T, Hq, Hkv, D, S, p0s, device="cpu", gen=None, num_slots=None):
    """Random bf16 q, k, v and caches (finite everywhere), shuffled slots, positions
    p0..p0+T-1 per sequence, sinks with one that takes no mass and one that takes most."""
    num_slots = num_slots or B + 1
    bf16 = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(bf16).to(device)

    q, k, v = rnd(B, T, Hq, D), rnd(B, T, Hkv, D), rnd(B, T, Hkv, D)
    k_cache, v_cache = rnd(num_slots, S, Hkv, D), rnd(num_slots, S, Hkv, D)
    slots = torch.randperm(num_slots, generator=gen)[:B].to(device)
    positions = (torch.tensor(p0s)[:, None] + torch.arange(T)[None]).to(device)
    sinks = torch.randn(Hq, generator=gen) * 2
    sinks[0], sinks[-1] = -1e4, 8.0
    return q, k, v, k_cache, v_cache, slots, positions, sinks.to(device)


def ulp_report(out, ref, atol=0.0):
    """(worst difference in ulps of the reference value, share of differing elements,
    largest absolute difference); NaN anywhere fails."""
    a, r = out.float(), ref.float()
    assert not torch.isnan(a).any(), "NaN in the kernel output (an element left unwritten?)"
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(1e-30))) - 7).clamp_min(atol)
    diff = (a - r).abs()
    return (diff / ulp).max().item(), (diff > 0).float().mean().item(), diff.max().item()


def run_both(args, window, use_pdl=False):
    """The kernel (output poisoned first) and the reference, each on its own cache copies.
    Returns ((o, k_cache, v_cache) kernel, (o, k_cache, v_cache) reference)."""
    q, k, v, kc, vc, slots, positions, sinks = args
    kc_k, vc_k, kc_r, vc_r = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    real_empty = torch.empty
    try:  # poison the launcher's allocation: every element must be written
        torch.empty = lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan"))
        o = kernels.prefill_attention_kv(q, k, v, kc_k, vc_k, slots, positions, sinks, window,
                                         use_pdl=use_pdl)
    finally:
        torch.empty = real_empty
    o_ref = torch.ops.flintc.prefill_attention_kv(q, k, v, kc_r, vc_r, slots, positions, sinks, window)
    return (o, kc_k, vc_k), (o_ref, kc_r, vc_r)


def check(args, window, use_pdl=False, atol=0.0):
    (o, kc, vc), (o_ref, kc_r, vc_r) = run_both(args, window, use_pdl)
    assert o.shape == o_ref.shape and o.dtype == torch.bfloat16
    worst, share, biggest = ulp_report(o, o_ref, atol)
    print(f"\nwindow={window} o: {share:.3%} of elements differ, max {biggest:.3g} ({worst:.2f} ulp)")
    assert worst <= 1.0, f"{worst:.2f} ulp max; {share:.2%} of elements differ, max abs {biggest:.3g}"
    assert torch.equal(kc, kc_r) and torch.equal(vc, vc_r), "KV caches differ from the reference"
    untouched = torch.ones(kc.shape[0], dtype=torch.bool, device=kc.device)
    untouched[args[5]] = False
    assert torch.equal(kc[untouched], args[3][untouched]), "a slot outside `slots` was written"


CPU_CASES = [
    # (window, S, T, p0 per sequence)
    (9, 9, 5, [0]),             # p0 = 0: empty ring
    (9, 9, 7, [3, 20]),         # mid-ring, not yet wrapped / wrapped
    (9, 9, 21, [13]),           # T > W: only the last 9 tokens stay; T % 4 != 0
    (9, 9, 3, [40, 0]),         # short chunk deep in a wrapped ring; B=2 with p0 = 0
    (0, 48, 5, [0]),            # full cache, p0 = 0
    (0, 48, 11, [13, 30]),      # cached keys span blocks; T % 4 != 0
    (0, 48, 23, [25]),          # the chunk ends at the last cache row
]


@pytest.mark.parametrize("window,S,T,p0s", CPU_CASES)
def test_prefill_attention_matches_reference(window, S, T, p0s):
    """The tiny cases, in the interpreter on a CPU machine and compiled on a GPU one (the
    kernel module is JIT-compiled there, so CPU tensors cannot reach it), with the GPU
    cases' ATOL floor there (p.v in split bf16 parts)."""
    gen = torch.Generator().manual_seed(1000 * T + sum(p0s) + window)
    dev = "cpu" if INTERPRET else "cuda"
    check(make_inputs(len(p0s), T, 8, 2, 32, S, p0s, device=dev, gen=gen), window,
          atol=0.0 if INTERPRET else ATOL)


@pytest.mark.parametrize("window,S,T,p0s", [(9, 9, 30, [17, 3]), (0, 700, 40, [600]),
                                            (0, 700, 300, [0]), (5, 5, 12, [2])])
def test_reference_op_matches_attention_with_sink(window, S, T, p0s):
    """The op's blockwise reference (key blocks of 256: several at p0 = 600) against
    `attention_with_sink` over the keys the model gathers and the mask it builds:
    sliding layers [old ring, new keys] with ring positions p0-1-((p0-1-j) mod W),
    full layers the cache after the write."""
    B = len(p0s)
    gen = torch.Generator().manual_seed(T + S)
    q, k, v, kc, vc, slots, positions, sinks = make_inputs(B, T, 8, 2, 32, S, p0s, gen=gen)
    kc_op, vc_op = kc.clone(), vc.clone()
    o = torch.ops.flintc.prefill_attention_kv(q, k, v, kc_op, vc_op, slots, positions, sinks, window)
    qpos = positions[:, :, None]  # [B, T, 1]
    if window:
        p0 = positions[:, :1]
        ring_pos = p0 - 1 - torch.remainder(p0 - 1 - torch.arange(window)[None], window)  # [B, W]
        keys, values = torch.cat([kc[slots], k], 1), torch.cat([vc[slots], v], 1)
        kpos = torch.cat([ring_pos, positions], 1)[:, None]  # [B, 1, W+T]
        visible = (kpos >= 0) & (kpos <= qpos) & (qpos - kpos < window)
        write_kv(kc, vc, k, v, slots, positions, window)
    else:
        write_kv(kc, vc, k, v, slots, positions, 0)
        keys, values = kc[slots], vc[slots]
        visible = torch.arange(S)[None, None] <= qpos
    ref = ops.attention_with_sink(q, keys, values, visible, sinks, torch.float32)
    worst, share, biggest = ulp_report(o, ref, atol=ATOL)
    print(f"\nop vs attention_with_sink: {share:.3%} differ, max {biggest:.3g} ({worst:.2f} ulp)")
    assert worst <= 1.0
    assert torch.equal(kc_op, kc) and torch.equal(vc_op, vc)
    wrong = ops.attention_with_sink(q, keys, values, visible, sinks + 0.7, torch.float32)
    assert ulp_report(o, wrong, atol=ATOL)[0] > 1.0, "the comparison cannot see a wrong sink"


def _good_args():
    gen = torch.Generator().manual_seed(0)
    args = make_inputs(2, 4, 8, 2, 32, 16, [0, 3], gen=gen)
    names = ("q", "k", "v", "k_cache", "v_cache", "slots", "positions", "sinks")
    return dict(zip(names, args), window=0)


def _set(key, fn):
    """A bad-input case: args[key] = fn(args)."""
    return lambda a: a.__setitem__(key, fn(a))


@pytest.mark.parametrize("name,bad", [
    ("q", _set("q", lambda a: a["q"].float())),
    ("q", _set("q", lambda a: a["q"].transpose(1, 2))),
    ("k", _set("k", lambda a: a["k"][:, :2].contiguous())),
    ("v", _set("v", lambda a: a["v"].half())),
    ("k_cache", _set("k_cache", lambda a: a["k_cache"][..., :16].contiguous())),
    ("k_cache", _set("k_cache", lambda a: a["k_cache"].transpose(1, 2))),
    ("k_cache", _set("window", lambda a: 9)),  # a ring of 16 rows is not a window of 9
    ("v_cache", _set("v_cache", lambda a: a["v_cache"][:, :8].contiguous())),
    ("slots", _set("slots", lambda a: a["slots"].float())),
    ("slots", _set("slots", lambda a: a["slots"][:1].contiguous())),
    ("positions", _set("positions", lambda a: a["positions"].int())),
    ("positions", _set("positions", lambda a: a["positions"][:, :2].contiguous())),
    ("sinks", _set("sinks", lambda a: a["sinks"][:4].contiguous())),
    ("sinks", _set("sinks", lambda a: a["sinks"].double())),
    ("window", _set("window", lambda a: -1)),
])
def test_rejects_bad_input(name, bad):
    args = _good_args()
    bad(args)
    with pytest.raises(ValueError, match=name):
        kernels.prefill_attention_kv(**args)


def test_kernel_registry():
    assert kernels.KERNELS == {"prefill_attention_kv": kernels.prefill_attention_kv}


GPU_CASES = [
    # (window, S, T, p0 per sequence): the full model's shapes.
    (0, 131072, 2048, [100000]),
    (0, 16384, 512, [0, 8192]),
    (0, 16384, 1000, [5000]),          # T not a multiple of the 16-token tile
    (0, 262144, 512, [261632]),        # the chunk ends at the last row of a full context
    (513, 513, 512, [0, 100000]),
    (513, 513, 2048, [8192]),          # T > W: only the last 513 tokens stay
    (513, 513, 100, [513, 700]),       # starts exactly one ring later / mid-ring
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA "
                    "(and TRITON_INTERPRET=0 in the environment)")
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("window,S,T,p0s", GPU_CASES)
def test_prefill_attention_gpu(window, S, T, p0s, use_pdl):
    gen = torch.Generator().manual_seed(S + T)
    args = make_inputs(len(p0s), T, 32, 4, 128, S, p0s, device="cuda", gen=gen,
                       num_slots=len(p0s) + 1)
    check(args, window, use_pdl=use_pdl, atol=ATOL)
