"""Property tests of decode attention's split layout (`flintc.ops.attention.split_layout`)
over random layouts: the Triton kernel (`flintc.kernels.decode_attention`, two launches
and the fused combine) against the plain-torch reference op, and the reference against
a float64 oracle written from FLINT_SPEC 2, attention steps 5-7 (visible keys by
position, softmax over the scores and the sink, the sink in the denominator only).

CPU only (Triton's interpreter, tiny shapes). Hypothesis draws SPLIT_ROWS (1..8 and the
model's 64), N = 1..7 splits (powers of two or not), full caches and rings of W rows
(before and after they wrap; also rings longer than their window, kernel against
reference only: the oracle's positions follow `write_kv`, which never fills rows >= W),
batches mixing long, short and padding rows (negative slot), GQA groups of 1, 2 and 8,
head dims 16, 32 and 64, sinks that take no mass or nearly all of it, large q (peaked
softmax), and the launcher's decomposition knobs (programs per head, smallest run,
BLOCK_S, pieces per split, early reads). The stream-K `plan` is checked in pure Python
over far more layouts.

Every kernel run is poisoned as in test_decode_attention.py: outputs and scratch
NaN-filled, every cache row the sequence may not see NaN. Tolerances (FLINT_SPEC 3):
kernel partials within 1e-5 of the reference's (fp32 reordering), the bf16 outputs
within one bf16 ulp of the reference (plus the reordering error of an output that
cancels: S rows of 2^-24 max|v|); the reference within half a bf16 ulp of the float64
oracle plus that fp32 error (it rounds once, at o). Layouts are derandomized (the
same ones each run), their values fresh (`FLINTC_TEST_SEED` pins them); few (the
interpreter runs each launch's programs one by one); the whole file takes about 35 s
on 2 cores.
"""

from __future__ import annotations

import math
import os
from unittest import mock

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")
from hypothesis import HealthCheck, example, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flintc.ops  # noqa: F401,E402  (registers torch.ops.flintc.*)
import flintc.ops.attention as attention  # noqa: E402
from flintc.kernels import decode_attention as kernels  # noqa: E402

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
    pytest.skip("CPU interpreter property tests (the GPU has test_decode_attention.py's "
                "-m gpu cases)", allow_module_level=True)

# The layouts are derandomized (the same each run); the values in them are fresh each run,
# as in the other kernel tests: FLINTC_TEST_SEED pins them (a failure prints the seed).
RUN_SEED = int(os.environ.get("FLINTC_TEST_SEED", torch.randint(0, 2**31, ()).item()))

SETTINGS = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw):
    """A cache (full, a ring of W rows, or a ring longer than W), SPLIT_ROWS and N (or the
    model's SPLIT_ROWS = 64 with N <= 2 and tens of rows: chunks of several blocks that
    several programs share and merge in-kernel), and per
    sequence a visible-row count R aimed at the layout's edges (1, R < N, multiples of
    SPLIT_ROWS, SPLIT_ROWS x N - 1, + 0, + 1, the whole cache) or anywhere, with the
    position that gives it (rings: also wrapped once or several times)."""
    pieces = draw(st.booleans())  # long chunks that several programs share and merge
    split_rows = 64 if pieces else draw(st.sampled_from([4, 2, 3, 1, 5, 8]))
    N = draw(st.integers(1, 2) if pieces else st.sampled_from([3, 5, 1, 4, 7, 2, 6]))
    kind = draw(st.sampled_from(["ring", "full", "ring-longer-than-window", "full", "ring"]))
    if kind == "full":
        window, S = 0, draw(st.integers(17, 100) if pieces else st.integers(1, 48))
    else:
        window = draw(st.integers(17, 80) if pieces else st.integers(1, 16))
        S = window if kind == "ring" else window + draw(st.integers(1, 12))
    B = draw(st.integers(1, 3))
    # the launcher's knobs; with long chunks, programs enough to share them
    required = ({"programs_per_head": st.integers(2, 10), "min_rows": st.integers(1, 16)}
                if pieces else {})
    optional = {"programs_per_head": st.integers(1, 10), "min_rows": st.integers(1, 40),
                "max_pieces": st.integers(1, 3), "block_s": st.sampled_from([16, 32]),
                "preload": st.just(True)}
    positions = []
    for _ in range(B):
        R = draw(st.sampled_from([S, 1, split_rows * N, split_rows * N + 1, split_rows * N - 1,
                                  max(N - 1, 1), split_rows * draw(st.integers(1, 4))])
                 | st.integers(1, S))
        R = min(max(R, 1), S)
        wraps = draw(st.integers(0, 3)) if window and R == S else 0
        positions.append(R - 1 + wraps * draw(st.integers(1, S)))
    return {
        "split_rows": split_rows, "N": N, "kind": kind, "window": window, "S": S,
        "positions": positions, "pad": [draw(st.integers(0, 4)) == 0 for _ in range(B)],
        "Hkv": draw(st.sampled_from([2, 1])), "G": draw(st.sampled_from([2, 8, 1])),
        "D": draw(st.sampled_from([32, 16, 64])),
        "q_scale": draw(st.sampled_from([1.0, 30.0])),
        "sinks": draw(st.sampled_from(["random", "none", "dominant"])),
        "knobs": draw(st.fixed_dictionaries(required, optional={
            k: v for k, v in optional.items() if k not in required})),
        "seed": draw(st.integers(0, 2**16)),
    }


def make_case(c):
    """q, caches (finite), slots (live rows in slots 0..B-1, padding rows `pad_slot` of
    the free slot B), positions and sinks for a drawn layout."""
    gen = torch.Generator().manual_seed(c["seed"] + RUN_SEED)
    B, Hq, D = len(c["positions"]), c["Hkv"] * c["G"], c["D"]
    q = (torch.randn(B, 1, Hq, D, generator=gen) * c["q_scale"]).to(torch.bfloat16)
    k_cache = torch.randn(B + 1, c["S"], c["Hkv"], D, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(B + 1, c["S"], c["Hkv"], D, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([attention.pad_slot(B) if pad else b for b, pad in enumerate(c["pad"])])
    pos = torch.tensor(c["positions"], dtype=torch.int64).view(B, 1)
    sinks = torch.randn(Hq, generator=gen) * 2
    if c["sinks"] == "none":
        sinks[:] = -1e4  # takes no mass
    elif c["sinks"] == "dominant":
        sinks[0] = 40.0  # takes nearly all of it
    return q, k_cache, v_cache, slots, pos, sinks


def visible_positions(p: int, S: int, window: int) -> dict[int, int]:
    """{cache row: position} of the keys token p sees, replaying `write_kv`: position j in
    row j (full cache) or row j % W (ring); then causal and, in a ring, the window."""
    rows = {}
    for j in range(p + 1):
        r = j % window if window else j
        if r < S:
            rows[r] = j
    return {r: j for r, j in rows.items() if not window or p - j < window}


def oracle(q, k_cache, v_cache, slots, pos, window, sinks):
    """float64 attention with sinks (FLINT_SPEC 2, steps 5-7): with m = max(sink, s_j),
    o = sum_j exp(s_j - m) v_j / (exp(sink - m) + sum_j exp(s_j - m)); padding rows 0."""
    B, _, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        if int(slots[b]) < 0:
            continue
        rows = sorted(visible_positions(int(pos[b, 0]), S, window))
        keys = k_cache[int(slots[b]), rows].double().repeat_interleave(Hq // Hkv, dim=1)
        values = v_cache[int(slots[b]), rows].double().repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b, 0].double(), keys) / math.sqrt(D)  # [Hq, n]
        logits = torch.cat([s, sinks.double()[:, None]], dim=1)
        p = torch.softmax(logits, dim=1)[:, :-1]  # the sink: denominator only
        out[b] = torch.einsum("hn,nhd->hd", p, values)
    return out.reshape(B, 1, Hq * D)


def poison_invisible(cache, slots, pos, window):
    """A copy of `cache` with NaN in every row no live sequence may read (visibility as
    the reference op computes it, `key_positions`; padding rows read nothing)."""
    S = cache.shape[1]
    kpos = attention.key_positions(pos, S, window)  # [B, S]
    p = pos[:, -1:]
    visible = (kpos >= 0) & (kpos <= p)
    if window:
        visible &= (p - kpos) < window
    keep = torch.zeros(cache.shape[:2], dtype=torch.bool)
    live = slots >= 0
    keep[slots[live]] = visible[live]
    return cache.masked_fill(~keep[:, :, None, None], float("nan"))


def poisoned_launch(q, k_cache, v_cache, slots, pos, window, N, **knobs):
    k_bad = poison_invisible(k_cache, slots, pos, window)
    v_bad = poison_invisible(v_cache, slots, pos, window)
    real_empty = torch.empty
    try:  # every element of the outputs and scratch must be written before it is read
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        return kernels.launch_decode_attention(q, k_bad, v_bad, slots, pos, window, N, **knobs)
    finally:
        torch.empty = real_empty


def bf16_ulp(x):
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def describe(a, b):
    diff = (a.double() - b.double()).abs()
    return (f"{(a.double() != b.double()).float().mean().item():.2%} of {a.numel()} elements "
            f"differ, max diff {diff.max().item():.3g}")


def _case(**kw):
    base = {"split_rows": 4, "N": 3, "kind": "full", "window": 0, "S": 40, "positions": [3],
            "pad": [False], "Hkv": 2, "G": 2, "D": 32, "q_scale": 1.0, "sinks": "random",
            "knobs": {}, "seed": 0}
    base["pad"] = [False] * len(kw.get("positions", base["positions"]))
    return {**base, **kw}


@SETTINGS
@given(c=layouts())
# R = SPLIT_ROWS x k < SPLIT_ROWS x N: k chunks of SPLIT_ROWS rows, the rest empty; with a
# padding row and a sequence of R = N x SPLIT_ROWS + 1
@example(c=_case(positions=[3, 7, 12, 0], pad=[False, False, False, True]))
# one 61-row chunk (SPLIT_ROWS 64) in blocks of 16 shared by 4 programs, merged in-kernel,
# and a wrapped ring of 57 rows in 1 chunk shared likewise
@example(c=_case(split_rows=64, N=2, S=64, positions=[60, 17],
                 knobs={"programs_per_head": 6, "min_rows": 4}))
# R = 65 in 2 chunks of 33 rows (3 blocks of 16) and 32 rows (2 blocks): 6 programs of
# one block each, the last one's block past the rows (it reads and stores nothing)
@example(c=_case(split_rows=64, N=2, S=100, positions=[64],
                 knobs={"programs_per_head": 6, "min_rows": 1}))
@example(c=_case(split_rows=64, N=2, kind="ring", window=57, S=57, positions=[200],
                 knobs={"programs_per_head": 5, "min_rows": 4}))
def test_kernel_reference_and_oracle_agree_on_random_layouts(c):
    note(f"values: FLINTC_TEST_SEED={RUN_SEED}")
    q, k_cache, v_cache, slots, pos, sinks = make_case(c)
    window, S, N = c["window"], c["S"], c["N"]
    with mock.patch.object(attention, "SPLIT_ROWS", c["split_rows"]):
        o_ref, lse_ref = torch.ops.flintc.decode_attention(q, k_cache, v_cache, slots, pos,
                                                           window, N)
        o, lse = poisoned_launch(q, k_cache, v_cache, slots, pos, window, N, **c["knobs"])
        fused = poisoned_launch(q, k_cache, v_cache, slots, pos, window, N, sinks=sinks,
                                **c["knobs"])
        for b in range(len(c["positions"])):  # the layout: chunks 0..n-1 hold rows, n..N-1 empty
            R = attention.visible_rows(c["positions"][b], int(slots[b]), S, window)
            chunk, n = attention.split_layout(R, N)
            assert torch.isneginf(lse_ref[b, :, n:]).all(), (b, R, chunk, n)
            if c["kind"] != "ring-longer-than-window":  # there, chunks are masked row by row
                assert not torch.isneginf(lse_ref[b, :, :n]).any(), (b, R, chunk, n)
    assert all(bool((buf == 0).all()) for buf in kernels._COUNTERS.values()), "counters not reset"
    # kernel partials against the reference's: -inf in the same chunks, close elsewhere
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "NaN in the partials"
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty), "empty chunks (lse = -inf) differ"
    torch.testing.assert_close(lse[~empty], lse_ref[~empty], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    assert (o[empty] == 0).all(), "an empty chunk must give o = 0"
    # bf16 outputs: the combine kernel and the fused launch within one ulp of the reference
    ref = torch.ops.flintc.attention_combine(o_ref, lse_ref, sinks)
    out = kernels.attention_combine(o, lse, sinks)
    reorder = S * 2.0**-24 * v_cache.float().abs().max().item()  # an output that cancels
    # the combines read the kernel's partials, the reference's combine its own: their
    # measured difference (within the tolerance above) carries into an output that
    # cancels, where one bf16 ulp is far below it (seed 1486756172: 4.8e-6 at -1.0e-4)
    live = ~empty
    carried = 0.0
    if live.any():
        carried = ((o - o_ref)[live].abs().max()
                   + (lse - lse_ref)[live].abs().max() * o_ref[live].abs().max()).item()
    for name, got in (("combine", out), ("fused combine", fused)):
        assert not torch.isnan(got).any(), f"NaN in the {name} output"
        diff = (got.float() - ref.float()).abs()
        assert (diff <= bf16_ulp(ref.float()).clamp_min(reorder) + carried).all(), \
            f"{name}: {describe(got, ref)} (carried from the partials: {carried:.3g})"
    assert (ref[slots < 0] == 0).all() and (fused[slots < 0] == 0).all(), "padding rows give 0"
    if c["kind"] != "ring-longer-than-window":
        exact = oracle(q, k_cache, v_cache, slots, pos, window, sinks)
        diff = (ref.double() - exact).abs()
        tol = 0.5 * bf16_ulp(exact.float()).double() + reorder
        assert (diff <= tol).all(), f"reference vs float64 oracle: {describe(ref, exact)}"


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(R=st.integers(0, 3000), N=st.integers(1, 40), T=st.integers(1, 80),
       min_rows=st.integers(1, 300), block_s=st.sampled_from([16, 32, 64]),
       max_pieces=st.integers(1, 40), split_rows=st.sampled_from([1, 2, 3, 7, 64, 100]))
def test_split_layout_and_plan_properties(R, N, T, min_rows, block_s, max_pieces, split_rows):
    """`split_layout` is the contract (n' = min(N, ceil(R / SPLIT_ROWS)) chunks wanted of
    C = ceil(R / n') rows, n = ceil(R / C) of them non-empty), and `plan` (the kernel's
    integer arithmetic) cuts exactly those chunks: every visible row in one segment, no
    segment across a chunk, a shared chunk's sharers the programs ta..tb, only a run's first
    and last segments shared (workspace slots 0 and 1, as `_merge_chunk` derives them),
    empty chunks zero-filled once."""
    with mock.patch.object(attention, "SPLIT_ROWS", split_rows):
        chunk, n = attention.split_layout(R, N)
        plan = kernels.plan(R, max(R, 1), N, T, min_rows, block_s, max_pieces)
    if R == 0:
        assert (chunk, n) == (1, 0)
    else:
        wanted = min(N, -(-R // split_rows))
        assert chunk == -(-R // wanted) and n == -(-R // chunk) and (n - 1) * chunk < R <= n * chunk
    bpc = -(-chunk // block_s)
    covered, sharers = [], {}
    for t, segs in enumerate(plan["segments"]):
        u0 = t * plan["nblk"] // plan["t_eff"]
        for i, (c, lo, hi, ta, tb) in enumerate(segs):
            assert c * chunk <= lo < hi <= min((c + 1) * chunk, R) and ta <= t <= tb
            if ta != tb:
                assert i in (0, len(segs) - 1), "a middle segment must cover its chunk alone"
                assert (u0 // bpc != c) == (i > 0), "workspace slot differs from the merge's"
            sharers.setdefault(c, (set(), (ta, tb)))[0].add(t)
            covered.extend(range(lo, hi))
    assert covered == sorted(covered) == list(range(R)), "rows missing, read twice or out of order"
    for c, (ts, (ta, tb)) in sharers.items():
        assert ts == set(range(ta, tb + 1)), (c, ts, ta, tb)
    assert sorted(z for zs in plan["zero_fill"] for z in zs) == list(range(n, N))
    assert plan["t_eff"] <= max(1, n * max_pieces)
