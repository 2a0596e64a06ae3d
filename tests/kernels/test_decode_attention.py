"""Tests of `flintc.kernels.decode_attention` against the plain-torch references in
`flintc.ops.attention` (`torch.ops.flintc.decode_attention` / `attention_combine`).

CPU: Triton-interpreter twins at tiny shapes (Hq=8, Hkv=2, D=32): full caches with
empty splits, position 0, B up to 8, a cache far longer than the context, splits shared
by several programs that the kernel merges in-kernel (arrival counters; more sharers
than one merge load takes), programs whose runs cross split boundaries (workspace slots
0 and 1), more splits than programs (middle splits stored directly, several empty splits
zero-filled per program), a ring of W=9 rows before and after it wraps, and a ring
longer than its window (row-by-row mask); each of these also with the combine in the
attention launch (`decode_attention_combine`: the last program per KV head merges the
splits with the sinks). The stream-K plan (`kernels.plan`) is checked
on its own over many shapes: every visible row in exactly one segment, no segment
across a split, sharers as the kernel computes them, balanced runs. The same kernel
tests run on the GPU when there is one.
GPU (`-m gpu`): full shapes (Hq=32, Hkv=4, D=128), caches up to 262,144 rows (1K, 8K
and 100K tokens in a 262,144-row cache), rings of W=513, with and without PDL, the
benchmark sweep's other launch configurations, the fused combine on every GPU case, and
replays of a CUDA graph with changing positions (two launches and one).

Every check poisons: the launchers' outputs and scratch are NaN-filled before the
kernel runs, and the kernel sees a copy of the caches in which every row it must not
read (past the position, never written, other slots) is NaN, so a read outside the
visible rows shows up as NaN. Tolerance: the kernels reduce in fp32 in another order
(online softmax, merges of pieces), so o_part / lse are close, not equal (the failure
message gives the share of differing elements and the largest difference); the bf16
output is within one bf16 ulp.
"""

from __future__ import annotations

import itertools
import os

# The interpreter must be chosen before triton is imported (no GPU here).
if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

import flintc.ops  # noqa: F401  (registers torch.ops.flintc.*)
from flintc.kernels import decode_attention as kernels
from flintc.ops.attention import key_positions, split_layout


@pytest.fixture
def small_splits(monkeypatch):
    """The interpreter cases' caches hold tens of rows, which the model's split layout
    (ceil(R / `SPLIT_ROWS`) chunks, SPLIT_ROWS = 64) would keep in one chunk: chunks of at
    most 4 rows here (while the splits last), for the kernel and the reference alike (both read the constant at
    call time), so that these cases have many chunks, empty ones, shared ones and runs
    across them. `test_decode_attention_default_split_rows` covers the default."""
    import flintc.ops.attention as attention

    monkeypatch.setattr(attention, "SPLIT_ROWS", 4)

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = "cuda" if ON_GPU else "cpu"


def make_inputs(B, Hq, Hkv, D, S, positions, device=DEV, num_slots=None, gen=None):
    """Random bf16 q and caches (finite everywhere), shuffled slots, int64 positions,
    drawn on `device` (with `gen`, a generator of that device, when given)."""
    num_slots = num_slots or B + 2

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    q = randn(B, 1, Hq, D)
    k_cache = randn(num_slots, S, Hkv, D)
    v_cache = randn(num_slots, S, Hkv, D)
    slots = torch.randperm(num_slots, generator=gen, device=device)[:B]
    pos = torch.tensor(positions, dtype=torch.int64).view(B, 1).to(device)
    return q, k_cache, v_cache, slots, pos


def poison_invisible(cache, slots, positions, window):
    """A copy of `cache` with NaN in every row that sequence b may not read: rows whose
    key is not visible from positions[b] (the reference's own `key_positions`), and all
    rows of slots no sequence uses."""
    S = cache.shape[1]
    kpos = key_positions(positions, S, window)  # [B, S]
    p = positions[:, -1:]
    visible = (kpos >= 0) & (kpos <= p)
    if window:
        visible &= (p - kpos) < window
    keep = torch.zeros(cache.shape[0], S, dtype=torch.bool, device=cache.device)
    keep[slots.long()] = visible
    return cache.masked_fill(~keep[:, :, None, None], float("nan"))


def describe(a, b):
    """Share of differing elements and the largest difference (finite ones)."""
    diff = (a.float() - b.float()).abs()
    diff = torch.where(torch.isnan(diff), torch.zeros_like(diff), diff)
    return (f"{(a != b).float().mean().item():.2%} of {a.numel()} elements differ, "
            f"max diff {diff.max().item():.3g}")


def assert_partials_close(o, lse, o_ref, lse_ref, rtol=1e-5, atol=1e-5):
    """-inf exactly where the reference has -inf; finite values close; no NaN."""
    assert not torch.isnan(o).any(), f"NaN in o_part: {torch.isnan(o).sum().item()} elements"
    assert not torch.isnan(lse).any(), f"NaN in lse: {torch.isnan(lse).sum().item()} elements"
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty), "empty chunks (lse = -inf) differ"
    torch.testing.assert_close(lse[~empty], lse_ref[~empty], rtol=rtol, atol=atol,
                               msg=lambda m: f"lse: {describe(lse, lse_ref)}\n{m}")
    torch.testing.assert_close(o, o_ref, rtol=rtol, atol=atol,
                               msg=lambda m: f"o_part: {describe(o, o_ref)}\n{m}")
    assert (o[empty] == 0).all(), "an empty chunk must give o = 0"


def assert_within_one_bf16_ulp(out, ref, atol=0.0, min_identical=0.95):
    """Each bf16 element at most one ulp (of the reference value) away, or `atol`:
    an output much smaller than the values it averages (cancellation over 100K+ keys)
    carries fp32 reordering error of their size, not of its own. Off-by-one-ulp only
    where an fp32 value sits on a rounding boundary, so at least `min_identical` of the
    elements must be bit-identical."""
    a, r = out.float(), ref.float()
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp_min(1e-30))) - 7).clamp_min(atol)
    diff = (a - r).abs()
    worst = (diff / ulp).max().item()
    assert not torch.isnan(a).any(), "NaN in the combined output"
    assert (diff <= ulp).all(), f"{worst:.2f} ulp max; {describe(out, ref)}"
    identical = (out == ref).float().mean().item()
    assert identical >= min_identical, f"only {identical:.2%} bit-identical; {describe(out, ref)}"


def counters_are_zero():
    return all(bool((buf == 0).all()) for buf in kernels._COUNTERS.values())


def run_both(q, k_cache, v_cache, slots, pos, window, num_splits, sinks, use_pdl=False,
             **knobs):
    """Kernel outputs (outputs and scratch NaN-poisoned, invisible cache rows NaN) and
    reference outputs (clean caches)."""
    k_bad = poison_invisible(k_cache, slots, pos, window)
    v_bad = poison_invisible(v_cache, slots, pos, window)
    real_empty = torch.empty
    try:  # poison the launchers' allocations: every element must be written
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        o, lse = kernels.launch_decode_attention(q, k_bad, v_bad, slots, pos, window,
                                                 num_splits, use_pdl=use_pdl, **knobs)
        out = kernels.attention_combine(o, lse, sinks, use_pdl=use_pdl)
    finally:
        torch.empty = real_empty
    o_ref, lse_ref = torch.ops.flintc.decode_attention(q, k_cache, v_cache, slots, pos,
                                                       window, num_splits)
    out_ref = torch.ops.flintc.attention_combine(o_ref, lse_ref, sinks)
    return (o, lse, out), (o_ref, lse_ref, out_ref)


def run_fused(q, k_cache, v_cache, slots, pos, window, num_splits, sinks, use_pdl=False,
              **knobs):
    """The combine in the attention launch (`sinks=`, as `decode_attention_combine`):
    its output and partials scratch NaN-poisoned, invisible cache rows NaN; and the
    reference op `torch.ops.flintc.decode_attention_combine` on the clean caches."""
    k_bad = poison_invisible(k_cache, slots, pos, window)
    v_bad = poison_invisible(v_cache, slots, pos, window)
    real_empty = torch.empty
    try:
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        out = kernels.launch_decode_attention(q, k_bad, v_bad, slots, pos, window, num_splits,
                                              use_pdl=use_pdl, sinks=sinks, **knobs)
    finally:
        torch.empty = real_empty
    ref = torch.ops.flintc.decode_attention_combine(q, k_cache, v_cache, slots, pos, sinks,
                                                    window, num_splits)
    return out, ref


CPU_CASES = [
    # (window, S, num_splits, positions (B of them), launcher knobs)
    pytest.param(0, 48, 3, [47], {}, id="full-B1"),
    pytest.param(0, 48, 5, [0, 5, 47], {}, id="full-empty-splits-position-0"),
    pytest.param(0, 40, 4, [39, 0, 17, 8, 31, 1, 24, 39], {}, id="full-B8"),
    pytest.param(0, 48, 1, [47, 20], {"programs_per_head": 6, "min_rows": 4},
                 id="full-one-split-in-pieces"),
    # 41 and 71 visible rows of 96 in 4 splits of 11 and 18 rows, 9 programs: each 18-row
    # split is two blocks (16 + 2 rows) that two programs share.
    pytest.param(0, 96, 4, [40, 70], {"programs_per_head": 9, "min_rows": 4},
                 id="full-long-cache-short-context-pieces"),
    pytest.param(9, 9, 3, [0, 4, 8], {}, id="ring-not-wrapped"),
    pytest.param(9, 9, 2, [31, 100, 9], {"programs_per_head": 4, "min_rows": 2},
                 id="ring-wrapped-pieces"),
    # 113 visible rows in splits of 38 (blocks of 16, 16, 6 rows), runs of 2-3 blocks:
    # program 1 ends split 0 (its slot 0) and starts split 1 (its slot 1).
    pytest.param(0, 120, 3, [112], {"programs_per_head": 4, "min_rows": 16},
                 id="full-runs-cross-splits"),
    # One split shared by 10 programs: three merge loads of CPU_MERGE_P = 4.
    pytest.param(0, 160, 1, [150], {"programs_per_head": 12, "min_rows": 16},
                 id="full-one-split-ten-sharers"),
    # 51 visible rows in 13 of 16 splits (4 rows each), 2 programs: runs of 6-7 whole
    # splits (stored directly, no merge) and 3 empty splits, zero-filled by both.
    pytest.param(0, 64, 16, [50, 3], {"programs_per_head": 2}, id="full-more-splits-than-programs"),
    # 140 visible rows in 8 splits of 18 rows (blocks of 16 + 2 rows), the last split 14
    # rows, one block, then an empty one: runs of whole splits (8 programs), runs of one
    # block (16 programs: the last one's block is the empty one, it reads and stores
    # nothing), runs across splits (12 programs); a second sequence of 51 rows.
    pytest.param(0, 200, 8, [139], {"programs_per_head": 8, "min_rows": 32},
                 id="full-last-split-fewer-blocks"),
    pytest.param(0, 200, 8, [139], {"programs_per_head": 16, "min_rows": 16},
                 id="full-last-split-fewer-blocks-empty-run"),
    pytest.param(0, 200, 8, [139, 50], {"programs_per_head": 12, "min_rows": 16},
                 id="full-last-split-fewer-blocks-shared"),
    # A ring of 40 rows for a window of 9 (rows masked one by one as the reference
    # does), one split shared by 3 programs.
    pytest.param(9, 40, 1, [20, 50], {"programs_per_head": 3, "min_rows": 4},
                 id="ring-longer-than-window"),
    # `ring_launch`'s one program per split with splits of two blocks, the second short
    # (the GPU twin: ring-B8-BLOCK_S-32-2-warps-per-split): a wrapped ring of 57 rows in 3
    # splits of 19 rows, BLOCK_S 16.
    pytest.param(57, 57, 3, [200, 56, 57, 5], {"programs_per_head": 3, "min_rows": 19},
                 id="ring-one-program-per-split-two-blocks"),
]


@pytest.mark.usefixtures("small_splits")
@pytest.mark.parametrize("window,S,num_splits,positions,knobs", CPU_CASES)
def test_decode_attention_matches_reference(window, S, num_splits, positions, knobs):
    Hq, Hkv, D = 8, 2, 32
    B = len(positions)
    q, kc, vc, slots, pos = make_inputs(B, Hq, Hkv, D, S, positions)
    sinks = (torch.randn(Hq) * 2).to(DEV)
    sinks[0] = -1e4  # a sink that takes no mass
    sinks[1] = 8.0  # a sink that takes most of it
    (o, lse, out), (o_ref, lse_ref, out_ref) = run_both(q, kc, vc, slots, pos, window,
                                                        num_splits, sinks, **knobs)
    assert_partials_close(o, lse, o_ref, lse_ref)
    # an output near zero (cancellation in the weighted average of V) carries the fp32
    # reordering error of the values averaged, not of its own size: at most S rows of
    # |v| <= max|v|, 2^-24 relative each (a 4-ulp miss at |out| ~ 1e-6 was seen)
    assert_within_one_bf16_ulp(out, out_ref, atol=S * 2.0**-24 * vc.float().abs().max().item())
    assert counters_are_zero(), "arrival counters not reset after the launch"


@pytest.mark.usefixtures("small_splits")
@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("window,S,num_splits,positions,knobs", CPU_CASES)
def test_fused_combine_matches_reference(window, S, num_splits, positions, knobs, preload):
    """The combine in the attention launch (`decode_attention_combine`): the last busy
    program of each (sequence, KV head) merges the chunks with the sinks. Every CPU case
    (pieces merged in-kernel first, runs across splits, empty splits that are neither
    written nor read, rings), also with the early reads; the output within one bf16 ulp
    of the reference (the composed ops) and of the two-launch path, the counters reset."""
    Hq, Hkv, D = 8, 2, 32
    B = len(positions)
    q, kc, vc, slots, pos = make_inputs(B, Hq, Hkv, D, S, positions)
    sinks = (torch.randn(Hq) * 2).to(DEV)
    sinks[0] = -1e4
    sinks[1] = 8.0
    out, ref = run_fused(q, kc, vc, slots, pos, window, num_splits, sinks, preload=preload,
                         **knobs)
    atol = S * 2.0**-24 * vc.float().abs().max().item()
    assert_within_one_bf16_ulp(out, ref, atol=atol)
    (_, _, two), _ = run_both(q, kc, vc, slots, pos, window, num_splits, sinks, preload=preload,
                              **knobs)
    assert_within_one_bf16_ulp(out, two, atol=atol)
    assert counters_are_zero(), "arrival counters not reset after the launch"


def test_fused_combine_repeatable_and_rejects_bad_sinks():
    """A second launch (counters reused) gives the same bits; sinks of the wrong dtype,
    shape or device raise ValueError naming them."""
    q, kc, vc, slots, pos = make_inputs(2, 8, 2, 32, 64, [63, 20])
    sinks = torch.randn(8).to(DEV)
    knobs = {"programs_per_head": 4, "min_rows": 16}
    a = kernels.launch_decode_attention(q, kc, vc, slots, pos, 0, 1, sinks=sinks, **knobs)
    b = kernels.launch_decode_attention(q, kc, vc, slots, pos, 0, 1, sinks=sinks, **knobs)
    assert torch.equal(a, b) and counters_are_zero()
    for bad in (sinks.double(), sinks[:4].contiguous(), sinks.view(2, 4), sinks.to("meta")):
        with pytest.raises(ValueError, match="sinks"):
            kernels.decode_attention_combine(q, kc, vc, slots, pos, bad, 0, 1)


@pytest.mark.usefixtures("small_splits")
@pytest.mark.parametrize("window,S,num_splits,positions,knobs", CPU_CASES)
def test_preload_matches_reference(window, S, num_splits, positions, knobs):
    """The early reads (`preload=True`: slots, positions and each program's first block
    before the PDL wait, the current token's row again after it) give the same partials,
    also when the early read of the current row is stale (`_poison_current_row`: NaN
    there, which the reload must replace). Rings longer than the window read after the
    wait as before."""
    Hq, Hkv, D = 8, 2, 32
    B = len(positions)
    q, kc, vc, slots, pos = make_inputs(B, Hq, Hkv, D, S, positions)
    sinks = (torch.randn(Hq) * 2).to(DEV)
    for poison in (False, True):
        (o, lse, out), (o_ref, lse_ref, out_ref) = run_both(
            q, kc, vc, slots, pos, window, num_splits, sinks, preload=True,
            _poison_current_row=poison, **knobs)
        assert_partials_close(o, lse, o_ref, lse_ref)
        assert_within_one_bf16_ulp(out, out_ref, atol=S * 2.0**-24 * vc.float().abs().max().item())
        assert counters_are_zero()


def test_preload_env(monkeypatch):
    """FLINTC_DECODE_ATTN_PRELOAD: 0 / 1, unset or empty the default (`PRELOAD`); another
    value is a TuningEnvError naming it, from `tuning.check_environment` too."""
    from flintc.kernels.tuning import TuningEnvError, check_environment

    for value, want in ((None, kernels.PRELOAD), ("", kernels.PRELOAD), ("1", True), (" 0 ", False)):
        if value is None:
            monkeypatch.delenv("FLINTC_DECODE_ATTN_PRELOAD", raising=False)
        else:
            monkeypatch.setenv("FLINTC_DECODE_ATTN_PRELOAD", value)
        assert kernels.preload_enabled() is want
    for bad in ("yes", "2", "true"):
        monkeypatch.setenv("FLINTC_DECODE_ATTN_PRELOAD", bad)
        with pytest.raises(TuningEnvError, match="FLINTC_DECODE_ATTN_PRELOAD must be 0 or 1"):
            kernels.preload_enabled()
        with pytest.raises(TuningEnvError, match="FLINTC_DECODE_ATTN_PRELOAD"):
            check_environment()


@pytest.mark.parametrize("knobs", [{}, {"programs_per_head": 3, "min_rows": 16}])
def test_decode_attention_default_split_rows(knobs):
    """The model's split layout (SPLIT_ROWS = 64): a 300-row cache in 7 splits holds
    sequences of 300, 6, 65 and 131 visible rows, cut into 5 chunks of 60 rows, 1 of 6, 2
    of 33 and 3 of 44 (`split_layout`), the other splits empty; a padding row (negative
    slot) has none. The kernel's partials match the reference's, chunk by chunk."""
    import flintc.ops.attention as attention

    assert attention.SPLIT_ROWS == 64
    Hq, Hkv, D, S, N = 8, 2, 32, 300, 7
    positions = [299, 5, 64, 130, 17]
    q, kc, vc, slots, pos = make_inputs(len(positions), Hq, Hkv, D, S, positions, num_slots=6)
    slots = torch.tensor([3, 0, 2, 1, attention.pad_slot(5)], device=DEV)  # slot 5 free
    assert [split_layout(attention.visible_rows(p, s, S, 0), N)
            for p, s in zip(positions, slots.tolist())] == [(60, 5), (6, 1), (33, 2), (44, 3), (1, 0)]
    sinks = torch.randn(Hq).to(DEV)
    (o, lse, out), (o_ref, lse_ref, out_ref) = run_both(q, kc, vc, slots, pos, 0, N, sinks, **knobs)
    assert_partials_close(o, lse, o_ref, lse_ref)
    assert torch.isneginf(lse_ref[:, :, 5:]).all() and torch.isneginf(lse_ref[-1]).all()
    assert not torch.isneginf(lse_ref[0, :, :5]).any()
    assert_within_one_bf16_ulp(out, out_ref, atol=S * 2.0**-24 * vc.float().abs().max().item())
    assert counters_are_zero()


def test_split_layout():
    """`split_layout(R, N)`: at most N chunks, equal but the last, covering rows 0..R-1,
    of at most SPLIT_ROWS rows while N x SPLIT_ROWS rows suffice, else as few rows as N
    chunks allow; bad arguments raise ValueError naming the function."""
    assert split_layout(0, 32) == (1, 0)
    assert split_layout(1, 32) == (1, 1)
    assert split_layout(1024, 32) == (64, 16)
    assert split_layout(1000, 32) == (63, 16)
    assert split_layout(100_000, 32) == (3125, 32)
    assert split_layout(513, 9) == (57, 9)  # a sliding layer's wrapped ring: as before
    assert split_layout(262144, 32) == (8192, 32)
    assert split_layout(10, 4, split_rows=3) == (3, 4)
    assert split_layout(70, 3) == (35, 2)
    for R in range(0, 700, 7):
        for N in (1, 2, 3, 9, 32):
            chunk, n = split_layout(R, N)
            assert n <= N and (n == 0) == (R == 0)
            assert R == 0 or ((n - 1) * chunk < R <= n * chunk)
            assert chunk <= 64 if R <= 64 * N else chunk == -(-R // N)
    for bad in ((-1, 4), (5, 0), (5, 2, 0)):
        with pytest.raises(ValueError, match="split_layout"):
            split_layout(*bad)


@pytest.mark.usefixtures("small_splits")
def test_pieces_are_merged_and_repeatable():
    """One split of 64 rows shared by 4 programs of one block: every partial merges
    through the workspace; a second launch (counters reused) gives bit-identical
    results."""
    q, kc, vc, slots, pos = make_inputs(1, 8, 2, 32, 64, [61])
    knobs = {"programs_per_head": 12, "min_rows": 4}
    assert kernels.plan(62, 64, 1, 12, 4, kernels.CPU_BLOCK_S)["t_eff"] == 4
    first = kernels.launch_decode_attention(q, kc, vc, slots, pos, 0, 1, **knobs)
    second = kernels.launch_decode_attention(q, kc, vc, slots, pos, 0, 1, **knobs)
    ref = torch.ops.flintc.decode_attention(q, kc, vc, slots, pos, 0, 1)
    assert_partials_close(*first, *ref)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert counters_are_zero()


PLAN_SHAPES = [
    # (rows R, cache rows S, splits N, programs T, min_rows, block_s)
    (1024, 262144, 32, 66, 128, 64), (100_000, 262144, 32, 66, 128, 64),
    (100_000, 262144, 32, 8, 128, 64), (262144, 262144, 32, 16, 128, 64),
    (8192, 262144, 32, 66, 128, 64), (513, 513, 3, 66, 64, 64), (513, 513, 3, 66, 192, 64),
    (1, 262144, 32, 66, 128, 64), (0, 48, 5, 4, 16, 16), (300, 1000, 7, 5, 16, 16),
    (999, 1000, 7, 50, 16, 16), (57, 100, 100, 3, 16, 16), (1000, 1000, 1, 9, 32, 16),
]


@pytest.mark.parametrize("R,S,N,T,min_rows,block_s", PLAN_SHAPES)
def test_plan_covers_each_visible_row_once(R, S, N, T, min_rows, block_s):
    """The stream-K plan: segments partition rows 0..R-1, none crosses a split, runs
    are contiguous and balanced to one block (+ a split's short last block), the
    sharers (ta..tb) of a split are exactly the programs with a segment in it, only a
    run's first and last segments can be shared, empty splits are zero-filled once."""
    plan = kernels.plan(R, S, N, T, min_rows, block_s)
    chunk, nchunks = split_layout(R, N)
    assert nchunks <= N and (nchunks == 0 or (nchunks - 1) * chunk < R <= nchunks * chunk)
    covered = []
    runs = []
    sharers = {}
    for t, segs in enumerate(plan["segments"]):
        assert (t < plan["t_eff"]) or not segs, f"program {t} busy past t_eff"
        for i, (n, lo, hi, ta, tb) in enumerate(segs):
            assert n * chunk <= lo < hi <= min((n + 1) * chunk, R), (t, n, lo, hi)
            if 0 < i < len(segs) - 1:
                assert ta == tb == t, "a middle segment must cover its split alone"
            sharers.setdefault(n, set()).add(t)
            sharers[n] |= {("range", ta, tb)}
            covered.extend(range(lo, hi))
        if segs:
            assert all(a[2] == b[1] for a, b in itertools.pairwise(segs)), "run not contiguous"
            runs.append(sum(-(-(hi - lo) // block_s) for _, lo, hi, _, _ in segs))
    assert sorted(covered) == list(range(R)), "rows missing or read twice"
    for n, who in sharers.items():
        progs = {w for w in who if isinstance(w, int)}
        (_, ta, tb), = {w for w in who if isinstance(w, tuple)}
        assert progs == set(range(ta, tb + 1)), f"split {n}: sharers {progs} vs {ta}..{tb}"
        assert tb - ta + 1 <= kernels.MAX_PIECES_PER_SPLIT + 2
    assert not runs or max(runs) - min(runs) <= 2, f"unbalanced runs (blocks): {runs}"
    assert len(runs) <= T
    zero = sorted(z for zs in plan["zero_fill"] for z in zs)
    assert zero == list(range(nchunks, N)), "empty splits not zero-filled exactly once"


@pytest.mark.parametrize("R,S,T,block_s,want", [
    (1024, 262144, 66, 64, 16), (1024, 1024, 66, 64, 16), (1000, 131072, 66, 64, 16),
    (2100, 262144, 66, 64, 32), (3000, 262144, 66, 64, 32), (2100, 262144, 66, 32, 32),
    (1024, 262144, 8, 64, 8), (513, 262144, 66, 64, 9)])
def test_plan_short_contexts_take_one_program_per_chunk(R, S, T, block_s, want):
    """With the GPU's smallest run (GPU_MIN_ROWS) and chunks shorter than it (the split
    layout of a short context: ceil(R / 64) chunks of at most 64 rows, or N = 32 chunks
    of a few blocks), each busy program takes whole chunks and stores them directly: no
    chunk is shared and merged in-kernel, whatever the cache length S, also when the last
    chunk has fewer blocks than the others (R = 2,100: 31 chunks of 66 rows, 2 blocks,
    and one of 54 rows, 1 block). `want` busy programs (fewer when T is smaller)."""
    plan = kernels.plan(R, S, 32, T, kernels.GPU_MIN_ROWS, block_s)
    assert plan["t_eff"] == want
    segs = [seg for segs in plan["segments"] for seg in segs]
    assert all(ta == tb for _, _, _, ta, tb in segs), "a chunk shared by several programs"
    assert sorted(r for _, lo, hi, _, _ in segs for r in range(lo, hi)) == list(range(R))


def test_kernels_table_and_defaults():
    """The contract's table, and the default launcher equals the reference."""
    assert set(kernels.KERNELS) == {"decode_attention", "attention_combine",
                                    "decode_attention_combine"}
    q, kc, vc, slots, pos = make_inputs(2, 8, 2, 32, 16, [15, 3])
    o, lse = kernels.KERNELS["decode_attention"](q, kc, vc, slots, pos, 0, 2, use_pdl=True)
    assert_partials_close(o, lse, *torch.ops.flintc.decode_attention(q, kc, vc, slots, pos, 0, 2))


def test_combine_matches_reference_with_empty_splits():
    """Random partials with empty splits (lse = -inf, o = 0) and extreme sinks."""
    B, Hq, N, D = 2, 8, 5, 32
    o = torch.randn(B, Hq, N, D)
    lse = torch.randn(B, Hq, N) * 3
    empty = torch.rand(B, Hq, N) < 0.4
    empty[0, 0] = True  # one head with every split empty: only the sink
    lse[empty] = float("-inf")
    o[empty] = 0.0
    sinks = torch.randn(Hq) * 2
    sinks[2], sinks[3] = -1e4, 30.0
    o, lse, sinks = o.to(DEV), lse.to(DEV), sinks.to(DEV)
    real_empty = torch.empty
    try:
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        out = kernels.attention_combine(o, lse, sinks)
    finally:
        torch.empty = real_empty
    ref = torch.ops.flintc.attention_combine(o, lse, sinks)
    # near-zero outputs carry the fp32 reordering error of the N partials they combine
    assert_within_one_bf16_ulp(out, ref, atol=N * 2.0**-24 * o.float().abs().max().item())
    assert (out.view(B, Hq, D)[0, 0] == 0).all(), "only the sink: the output must be 0"


def test_combine_counts_the_sink_once():
    """N equal splits (lse L, o c) and sink s: out = N e^L c / (e^s + N e^L), from the
    formula, not from the reference."""
    B, Hq, N, D = 1, 8, 3, 32
    c = torch.randn(D)
    o = c.expand(B, Hq, N, D).contiguous()
    lse = torch.full((B, Hq, N), 0.5)
    sinks = torch.linspace(-2.0, 3.0, Hq)
    out = kernels.attention_combine(o.to(DEV), lse.to(DEV), sinks.to(DEV)).cpu()
    w = N * torch.exp(torch.tensor(0.5)) / (torch.exp(sinks) + N * torch.exp(torch.tensor(0.5)))
    want = (w[:, None] * c[None, :]).reshape(1, 1, Hq * D).to(torch.bfloat16)
    assert_within_one_bf16_ulp(out, want)


def test_combine_only_sink_mass():
    """All splits empty: the sink takes all the mass and the output is zero, not NaN."""
    o = torch.zeros(2, 8, 3, 32, device=DEV)
    lse = torch.full((2, 8, 3), float("-inf"), device=DEV)
    out = kernels.attention_combine(o, lse, torch.randn(8, device=DEV))
    assert out.dtype == torch.bfloat16 and (out == 0).all()


def test_choose_num_splits():
    assert kernels.default_programs_per_head(1, 4, 132) == 66
    assert kernels.default_programs_per_head(8, 4, 132) == 8
    assert kernels.choose_num_splits(262144, 1) == 32
    assert kernels.choose_num_splits(513, 1, window=513) == 9
    from flintc.passes.fuse_decode_attention import num_splits_for

    assert num_splits_for(513, ring=True) == kernels.choose_num_splits(513, 1, window=513)
    assert kernels.choose_num_splits(1024, 1, num_sms=132) == 4  # 66 programs / 32 pieces
    assert kernels.choose_num_splits(100, 8) == 1
    with pytest.raises(ValueError, match="batch"):
        kernels.choose_num_splits(1024, 0)
    with pytest.raises(ValueError, match="window: expected >= 0"):
        kernels.choose_num_splits(1000, 1, window=-5)


@pytest.mark.parametrize("splits", [3, 9])
@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_ring_programs_take_whole_splits(batch, splits):
    """The GPU launcher's rule for a sliding layer (`ring_min_rows`): in the stream-K plan
    of the full model's wrapped 513-row ring (the kernel's own integer arithmetic, replayed
    by `plan`) every split is read by exactly one program, which stores it directly: no
    partials, no arrival counter, no in-kernel merge (the H200's fast case, 6-9 us per call
    against 12-17 with merges; docs/gpu-runs.md session 13)."""
    W = 513
    T = kernels.default_programs_per_head(batch, 4, 132)
    p = kernels.plan(W, W, splits, T, kernels.ring_min_rows(W, splits), kernels.GPU_BLOCK_S)
    assert p["t_eff"] == min(splits, T)  # batch 8: 8 programs a head, one takes 2 splits
    segs = [seg for per in p["segments"] for seg in per]
    assert sorted(seg[0] for seg in segs) == list(range(splits))  # each split once
    assert all(seg[3] == seg[4] for seg in segs)  # one contributor: stored directly
    assert sum(seg[2] - seg[1] for seg in segs) == W  # every row read once
    # the old rule (64-row runs) shared each of 3 splits among 3 programs
    old = kernels.plan(W, W, 3, T, 64, kernels.GPU_BLOCK_S)
    assert any(seg[3] != seg[4] for per in old["segments"] for seg in per)


def test_ring_launch_table_and_overrides(monkeypatch):
    """`ring_launch`: the `RING_LAUNCH` entry with the largest smallest-batch key <= B,
    FLINTC_DECODE_ATTN_RING_LAUNCH entries replacing or adding keys; malformed entries are
    refused naming the variable (also by the runtime's `check_environment`)."""
    from flintc.kernels.tuning import TuningEnvError, check_environment

    monkeypatch.delenv("FLINTC_DECODE_ATTN_RING_LAUNCH", raising=False)
    monkeypatch.setattr(kernels, "RING_LAUNCH", {1: (64, 4, 3, 0), 4: (32, 2, 2, 1)})
    assert kernels.ring_launch(1) == kernels.ring_launch(3) == (64, 4, 3, False)
    assert kernels.ring_launch(4) == kernels.ring_launch(64) == (32, 2, 2, True)
    monkeypatch.setenv("FLINTC_DECODE_ATTN_RING_LAUNCH", " 2=16,1,1,1 / 8=64,8,2,0 ")
    assert [kernels.ring_launch(b) for b in (1, 2, 4, 8)] == [
        (64, 4, 3, False), (16, 1, 1, True), (32, 2, 2, True), (64, 8, 2, False)]
    monkeypatch.setattr(kernels, "RING_LAUNCH", {4: (32, 2, 2, 1)})
    monkeypatch.delenv("FLINTC_DECODE_ATTN_RING_LAUNCH")
    assert kernels.ring_launch(1) == (kernels.GPU_BLOCK_S, kernels.GPU_NUM_WARPS,
                                      kernels.GPU_NUM_STAGES, False)  # no key <= B
    for bad in ("8=32,2,2", "8=48,2,2,1", "0=32,2,2,1", "8=32,3,2,1", "8=32,2,0,1",
                "8=32,2,2,2", "x=32,2,2,1", "8:32,2,2,1"):
        monkeypatch.setenv("FLINTC_DECODE_ATTN_RING_LAUNCH", bad)
        with pytest.raises(TuningEnvError, match="FLINTC_DECODE_ATTN_RING_LAUNCH.*" + bad[:1]):
            kernels.ring_launch(8)
        with pytest.raises(TuningEnvError, match="FLINTC_DECODE_ATTN_RING_LAUNCH"):
            check_environment()
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        kernels.ring_launch(0)


def test_ring_launch_per_split_plans_one_program_per_split():
    """With one program per split (`ring_launch`'s fourth field) and BLOCK_S 32, the
    model's wrapped ring (W = 513, 9 splits of 57 rows, two blocks each) is read by
    exactly 9 programs per head, each storing its split directly."""
    W, n = 513, 9
    p = kernels.plan(W, W, n, n, kernels.ring_min_rows(W, n), 32)
    assert p["t_eff"] == n
    segs = [seg for per in p["segments"] for seg in per]
    assert sorted(seg[0] for seg in segs) == list(range(n))
    assert all(seg[3] == seg[4] for seg in segs) and sum(s[2] - s[1] for s in segs) == W


def _good_args():
    q, kc, vc, slots, pos = make_inputs(2, 8, 2, 32, 16, [3, 7])
    return {"q": q, "k_cache": kc, "v_cache": vc, "slots": slots, "positions": pos,
            "window": 0, "num_splits": 2}


@pytest.mark.parametrize("name,bad", [
    ("q", lambda a: a["q"].float()),
    ("q", lambda a: a["q"].transpose(2, 3)),
    ("q", lambda a: a["q"].expand(2, 2, 8, 32).contiguous()),
    ("k_cache", lambda a: a["k_cache"][..., :16].contiguous()),
    ("k_cache", lambda a: a["k_cache"].transpose(1, 2)),
    ("v_cache", lambda a: a["v_cache"].half()),
    ("v_cache", lambda a: a["v_cache"][:, :8].contiguous()),
    ("slots", lambda a: a["slots"].float()),
    ("slots", lambda a: a["slots"][:1].contiguous()),
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


@pytest.mark.parametrize("name,value", [("programs_per_head", 0), ("min_rows", 0),
                                        ("max_pieces", 0), ("block_s", 24), ("block_s", 8),
                                        ("num_warps", 0), ("num_stages", 1.5)])
def test_launcher_knobs_rejected(name, value):
    with pytest.raises(ValueError, match=name):
        kernels.launch_decode_attention(**_good_args(), **{name: value})


@pytest.mark.parametrize("name,bad", [
    ("o_part", lambda o, l, s: (o.to(torch.bfloat16), l, s)),
    ("o_part", lambda o, l, s: (o.transpose(1, 2), l, s)),
    ("lse", lambda o, l, s: (o, l[:, :, :1].contiguous(), s)),
    ("sinks", lambda o, l, s: (o, l, s[:4].contiguous())),
    ("sinks", lambda o, l, s: (o, l, s.double())),
])
def test_attention_combine_rejects_bad_input(name, bad):
    o, lse, sinks = torch.zeros(1, 8, 3, 32), torch.zeros(1, 8, 3), torch.zeros(8)
    with pytest.raises(ValueError, match=name):
        kernels.attention_combine(*bad(o, lse, sinks))


def gpu_inputs(S: int, positions: list[int], seed: int, dead_sink: bool = False):
    """The model's shapes (Hq = 32, Hkv = 4, D = 128) on CUDA: `make_inputs` with one slot
    per sequence, then sinks ~ 2 N(0, 1) (sink 1 at -1e4, taking no mass, with
    `dead_sink`), all from one generator seeded with `seed`."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, Hq, Hkv, D = len(positions), 32, 4, 128
    q, kc, vc, slots, pos = make_inputs(B, Hq, Hkv, D, S, positions, num_slots=B, gen=gen)
    sinks = torch.randn(Hq, generator=gen, device="cuda") * 2
    if dead_sink:
        sinks[1] = -1e4
    return q, kc, vc, slots, pos, sinks


GPU_CASES = [
    # (window, S, num_splits, positions: B of them, knobs). The reference expands V to
    # [B, Hq, S, D] fp32 (4 GiB per 2**15 rows at B=8), hence B=1 at the longest caches.
    pytest.param(0, 262144, 32, [100000], {}, id="262K-cache-100K-context"),
    pytest.param(0, 262144, 128, [262143], {}, id="262K-full"),
    pytest.param(0, 262144, 64, [262100], {}, id="262K-64-splits"),
    pytest.param(0, 131072, 32, [100000, 99999], {}, id="B2-100K"),
    pytest.param(0, 65536, 64, [65535, 65000, 40000, 32768, 1024, 100, 0, 65530], {},
                 id="B8-mixed"),
    pytest.param(0, 32768, 4, [32767, 20000, 3000, 1], {}, id="B4-few-splits-many-pieces"),
    pytest.param(0, 8192, 96, [8191, 8000, 5000, 4097, 100, 17, 0, 8190], {}, id="B8-96-splits"),
    pytest.param(0, 8192, 96, [5], {}, id="B1-short"),
    pytest.param(0, 8192, 2, [8191, 700], {"programs_per_head": 40, "min_rows": 16},
                 id="B2-pieces-capped-per-split"),
    pytest.param(513, 513, 8, [100000, 512, 513, 0, 300, 1026, 1539, 7], {}, id="ring-B8"),
    pytest.param(513, 513, 3, [2000], {}, id="ring-B1"),
    pytest.param(513, 513, 2, [600, 100], {"programs_per_head": 16, "min_rows": 16},
                 id="ring-pieces"),
    # The benchmark's short contexts: one split of 8192 rows shared by 8 (1K) and 32
    # (8K: four merge loads) programs.
    pytest.param(0, 262144, 32, [1023], {}, id="262K-cache-1K-context"),
    pytest.param(0, 131072, 16, [8191, 1000], {}, id="8K-context-in-8192-row-splits-B2"),
    # Runs across split boundaries at B=8 (8 programs per head for 13 splits).
    pytest.param(0, 32768, 32, [32767, 30000, 20000, 12345, 4096, 1000, 77, 32700], {},
                 id="B8-runs-cross-splits"),
    # The sweep's other launch configurations.
    pytest.param(0, 131072, 32, [100000], {"block_s": 128, "num_warps": 4, "num_stages": 2},
                 id="BLOCK_S-128"),
    pytest.param(0, 131072, 32, [100000], {"block_s": 32, "num_warps": 4, "num_stages": 4},
                 id="BLOCK_S-32"),
    pytest.param(0, 131072, 32, [100000], {"num_warps": 8, "num_stages": 3,
                                           "programs_per_head": 33},
                 id="8-warps"),
    pytest.param(513, 513, 3, [5000], {"min_rows": 192}, id="ring-one-program-per-split"),
    # The ring launches of the session-25 sweep (`ring_launch` candidates): one program per
    # split of 57 rows in two BLOCK_S = 32 blocks (one masked short), 2 or 1 warps.
    pytest.param(513, 513, 9, [100000, 512, 513, 0, 300, 1026, 1539, 7],
                 {"block_s": 32, "num_warps": 2, "num_stages": 2, "programs_per_head": 9,
                  "min_rows": 57}, id="ring-B8-BLOCK_S-32-2-warps-per-split"),
    pytest.param(513, 513, 9, [2000, 9], {"block_s": 16, "num_warps": 1, "num_stages": 1,
                                          "programs_per_head": 9, "min_rows": 57},
                 id="ring-B2-BLOCK_S-16-1-warp-per-split"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (and TRITON_INTERPRET unset or 0)")
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("window,S,num_splits,positions,knobs", GPU_CASES)
def test_decode_attention_gpu(window, S, num_splits, positions, knobs, use_pdl):
    B = len(positions)
    q, kc, vc, slots, pos, sinks = gpu_inputs(S, positions, S + B, dead_sink=True)
    (o, lse, out), (o_ref, lse_ref, out_ref) = run_both(
        q, kc, vc, slots, pos, window, num_splits, sinks, use_pdl=use_pdl, **knobs)
    assert_partials_close(o, lse, o_ref, lse_ref, rtol=2e-5, atol=2e-5)
    assert_within_one_bf16_ulp(out, out_ref, atol=1e-5)
    assert counters_are_zero()
    del kc, vc, o_ref
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (and TRITON_INTERPRET unset or 0)")
@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("window,S,num_splits,positions,knobs", GPU_CASES)
def test_decode_attention_combine_gpu(window, S, num_splits, positions, knobs, use_pdl):
    """The combine in the attention launch at the model's shapes (every GPU case, with
    and without PDL): within one bf16 ulp of the reference, counters reset. The CPU
    twin: `test_fused_combine_matches_reference`."""
    B = len(positions)
    q, kc, vc, slots, pos, sinks = gpu_inputs(S, positions, S + B + 2, dead_sink=True)
    out, ref = run_fused(q, kc, vc, slots, pos, window, num_splits, sinks, use_pdl=use_pdl,
                         **knobs)
    assert_within_one_bf16_ulp(out, ref, atol=1e-5)
    assert counters_are_zero()
    del kc, vc
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (and TRITON_INTERPRET unset or 0)")
@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("window,S,num_splits,positions", [
    (513, 513, 8, [100000, 512, 513, 0, 300, 1026, 1539, 7]), (513, 513, 9, [2000]),
    (0, 262144, 32, [1023]), (0, 8192, 96, [8191, 8000, 5000, 4097, 100, 17, 0, 8190])])
def test_decode_attention_preload_gpu(window, S, num_splits, positions, poison):
    """The early reads before the PDL wait (`preload=True`, 8 warps) at the model's shapes,
    with PDL: the same partials and output as the reference, also when the early read of
    the current token's row is made stale (`_poison_current_row`). The CPU twin:
    `test_preload_matches_reference`."""
    B = len(positions)
    q, kc, vc, slots, pos, sinks = gpu_inputs(S, positions, S + B + 1)
    (o, lse, out), (o_ref, lse_ref, out_ref) = run_both(
        q, kc, vc, slots, pos, window, num_splits, sinks, use_pdl=True, preload=True,
        _poison_current_row=poison)
    assert_partials_close(o, lse, o_ref, lse_ref, rtol=2e-5, atol=2e-5)
    assert_within_one_bf16_ulp(out, out_ref, atol=1e-5)
    assert counters_are_zero()
    del kc, vc, o_ref
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (and TRITON_INTERPRET unset or 0)")
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("window,S,num_splits", [(0, 65536, 32), (513, 513, 3), (513, 513, 9)])
def test_decode_attention_cuda_graph_replays(window, S, num_splits, fused):
    """Attention + combine (two launches, or one: `fused`) captured once with PDL,
    replayed with new positions written in place: the run-time decomposition follows p
    and the counters stay consistent."""
    B, Hq, Hkv, D = 2, 32, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, kc, vc, slots, pos = make_inputs(B, Hq, Hkv, D, S, [S - 1, 10], num_slots=B, gen=gen)
    sinks = torch.randn(Hq, generator=gen, device="cuda") * 2

    def step():
        if fused:
            return kernels.decode_attention_combine(q, kc, vc, slots, pos, sinks, window,
                                                    num_splits, use_pdl=True)
        o, lse = kernels.decode_attention(q, kc, vc, slots, pos, window, num_splits, use_pdl=True)
        return kernels.attention_combine(o, lse, sinks, use_pdl=True)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for positions in ([S - 1, 10], [0, 5000], [40000, 1], [S // 2, S - 2]):
        pos.copy_(torch.tensor(positions).view(B, 1))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.ops.flintc.attention_combine(
            *torch.ops.flintc.decode_attention(q, kc, vc, slots, pos, window, num_splits), sinks)
        assert_within_one_bf16_ulp(out, ref, atol=1e-5)
        assert counters_are_zero()
