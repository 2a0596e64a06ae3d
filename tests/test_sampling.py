"""The batched sampler (`flintc.sampling.sample`) against the per-row definition
(`sampling_probs`, FLINT_SPEC section 6), on the CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flintc.sampling import SamplingParams, sample, sampling_probs, sampling_probs_rows

V = 257

params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.05, 0.7, 1.0, 2.5]),
    top_p=st.sampled_from([1.0, 0.999, 0.95, 0.5, 0.01]),
    top_k=st.sampled_from([-1, 0, 1, 2, 20, V - 1, V, V + 5]),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.one_of(params_st, st.just(SamplingParams(temperature=0))), min_size=1,
                     max_size=8), seed=st.integers(0, 2**31 - 1), ties=st.booleans())
def test_grouped_probs_match_the_per_row_definition(rows, seed, ties):
    """`sampling_probs_rows` (rows with equal settings batched) keeps, for every non-greedy
    row, exactly the tokens `sampling_probs` keeps for that row alone (top-k ties with the
    k-th logit kept, stable top-p), with the same probabilities up to fp32 summation
    order; greedy rows are left out."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows), V, generator=g) * 4
    if ties:  # many equal logits: the top-k threshold and the top-p order meet ties
        logits = torch.round(logits)
    got = sampling_probs_rows(logits, rows)
    assert sorted(got) == [b for b, p in enumerate(rows) if not p.is_greedy]
    for j, probs in got.items():
        want = sampling_probs(logits[j], rows[j])
        assert probs.shape == (V,) and probs.dtype == torch.float32
        assert torch.equal(want > 0, probs > 0), f"row {j} {rows[j]}: kept set differs"
        torch.testing.assert_close(probs, want, atol=1e-7, rtol=1e-5)


def test_greedy_rows_take_the_argmax_ties_to_the_lower_id():
    logits = torch.zeros(3, V)
    logits[0, 7] = logits[0, 9] = 5.0  # tie: token 7
    logits[1, V - 1] = 1.0
    logits[2, 3] = 2.0
    greedy = SamplingParams(temperature=0)
    out = sample(logits, [greedy, greedy, SamplingParams(temperature=1e-3, top_k=1)],
                 [None, None, torch.Generator().manual_seed(0)])
    assert out.tolist() == [7, V - 1, 3]
    assert out.dtype == torch.long


def test_seeded_rows_do_not_depend_on_the_batch():
    """A seeded row draws the same token alone and among other rows (its own generator),
    and two runs with the same seeds draw the same tokens."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    ps = [SamplingParams(seed=11), SamplingParams(temperature=0), SamplingParams(seed=12, top_k=0),
          SamplingParams(seed=13, top_p=1.0, top_k=3)]

    def gens():
        return [p.make_generator("cpu") for p in ps]

    together = sample(logits, ps, gens()).tolist()
    assert sample(logits, ps, gens()).tolist() == together
    for b, p in enumerate(ps):
        alone = sample(logits[b:b + 1], [p], [p.make_generator("cpu")]).tolist()
        assert alone == [together[b]], f"row {b}"


def test_draws_only_kept_tokens():
    """Over many draws, a row samples only tokens of its top-k / top-p set, and every token
    of a flat top-k set shows up."""
    logits = torch.zeros(2, V)
    logits[0, :4] = 10.0  # top-k 4 of a flat head
    logits[1, 100] = 30.0  # top-p keeps one token
    ps = [SamplingParams(top_k=4, top_p=1.0), SamplingParams(top_k=0, top_p=0.5)]
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)]
    seen = [set(), set()]
    for _ in range(200):
        a, b = sample(logits, ps, gens).tolist()
        seen[0].add(a)
        seen[1].add(b)
    assert seen == [{0, 1, 2, 3}, {100}]


@pytest.mark.parametrize("shape,n", [((V,), 1), ((2, V), 1), ((2, V), 3)])
def test_bad_input_is_a_clear_error(shape, n):
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(shape), [SamplingParams()] * n, [None] * n)
