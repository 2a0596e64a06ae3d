"""The batched sampler (`flintc.sampling.sample`) against the definition
(`sampling_probs`, FLINT_SPEC section 6), on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flintc.errors import InputError
from flintc.sampling import SamplingParams, _top_k_scores, sample, sampling_probs

V = 257

def implied_probs(x: torch.Tensor, k: int, top_p: float) -> torch.Tensor:
    """The distribution `_top_k_scores` draws from, spread over the vocabulary: fp64 [R, V]."""
    cand, scores, tied = _top_k_scores(x, k, top_p)
    w = torch.softmax(scores, dim=-1)  # [R, k + 1]
    probs = torch.zeros(x.shape, dtype=torch.float64).scatter(-1, cand, w[:, :k])
    return probs + tied * (w[:, k:] / tied.sum(-1, keepdim=True))


def near_the_cut(x: torch.Tensor, params: SamplingParams, eps: float = 1e-6) -> bool:
    """Whether some kept token's mass of strictly larger logits lies within eps of top_p
    (there fp rounding may decide either way)."""
    kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
    p = torch.softmax(x.masked_fill(x < kth, float("-inf")).double(), dim=-1)
    larger = ((x[:, None, :] > x[:, :, None]) * p[:, None, :]).sum(-1)  # [R, V]
    return bool(((larger - params.top_p).abs() < eps).any())


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), vocab=st.integers(2, 200),
       k=st.integers(1, 199), top_p=st.sampled_from([0.01, 0.25, 0.5, 0.75, 0.95, 0.999, 1.0]),
       logits=st.sampled_from(["normal", "rounded", "bf16", "flat", "halves"]))
def test_top_k_draw_follows_the_definition(seed, rows, vocab, k, top_p, logits):
    """`sample`'s top-k path (the k candidates plus the k-th logit's ties as one group; no
    softmax, sort or cumsum over the vocabulary) draws from exactly `sampling_probs`'s
    distribution, whatever ties the logits have: at the k-th logit (all kept, inside and
    outside torch.topk's k), among the candidates, or everywhere (flat)."""
    k = min(k, vocab - 1) if vocab > 1 else 1
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    if logits == "rounded":
        x = torch.round(x)
    elif logits == "bf16":
        x = x.to(torch.bfloat16).float()
    elif logits == "flat":
        x = torch.zeros(rows, vocab)
    elif logits == "halves":  # every value twice, at ids far apart
        x[:, vocab // 2: vocab // 2 * 2] = x[:, : vocab // 2]
    p = SamplingParams(top_k=k, top_p=top_p)
    assume(vocab > 1 and not near_the_cut(x, p))
    want = sampling_probs(x, p).double()
    got = implied_probs(x, k, top_p)
    assert torch.equal(want > 0, got > 0), f"kept {(got > 0).sum(-1).tolist()} vs {(want > 0).sum(-1).tolist()}"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_ties_are_kept_or_dropped_together():
    """Tokens 7 and 9 lead (logit 3), 16 tokens tie at logit 2, the rest far below, top-k 4:
    top-k keeps all 18 (torch.topk returned only 2 of the 16). The mass above the ties is
    2e / (2e + 16) = 0.2536: top-p 0.2 drops all 16 ties, top-p 0.3 keeps all 16, in the
    definition and in the draw's distribution."""
    vocab = 64
    tied = [3, 5, 8, 13, 21, 22, 30, 33, 34, 40, 41, 50, 55, 60, 61, 63]
    x = torch.full((1, vocab), -30.0)
    x[0, tied] = 2.0
    x[0, [7, 9]] = 3.0
    for top_p, kept in ((0.2, [7, 9]), (0.3, sorted(tied + [7, 9]))):
        want = sampling_probs(x, SamplingParams(top_k=4, top_p=top_p))
        got = implied_probs(x, 4, top_p)
        assert (want[0] > 0).nonzero().flatten().tolist() == kept
        torch.testing.assert_close(got, want.double(), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(want[0, tied], torch.full((16,), 1 / (2 * math.e + 16)))


def test_top_p_decides_on_fp64_masses():
    """Token 20's larger-logit mass, 1 / (1 + e^x20 + 98 e^-30) = 0.95000002 in fp64, reaches
    top_p = 0.95 by less than an fp32 ulp of the probabilities: the definition drops it, as
    the top-k path (and the sampler kernel) do; with fp32 softmax masses it stayed."""
    x = torch.full((1, 100), -30.0)
    x[0, 10], x[0, 20] = 0.0, -2.94443941116333
    p = SamplingParams(top_k=5, top_p=0.95)
    larger = 1 / (1 + math.exp(x[0, 20].item()) + 98 * math.exp(-30.0))
    assert 0.95 <= larger < 0.95 + 1e-7
    assert (sampling_probs(x, p)[0] > 0).nonzero().flatten().tolist() == [10]
    assert (implied_probs(x, 5, 0.95)[0] > 0).nonzero().flatten().tolist() == [10]
    full = sampling_probs(x, SamplingParams(top_k=0, top_p=0.95))  # the sort path alone
    assert (full[0] > 0).nonzero().flatten().tolist() == [10]


def test_draws_match_the_distribution():
    """4,000 rows of the same logits (ties at the k-th logit, inside and outside the k),
    each drawn with its own seeded generator: every token's count lies within 5 standard
    deviations of 4,000 p, and no token of probability 0 is drawn."""
    n, vocab = 4000, 12
    base = torch.tensor([2.0, 0.5, 1.0, 1.0, -3.0, 1.0, 2.0, 0.0, 1.0, -1.0, 1.0, 0.5])
    p = SamplingParams(top_k=4, top_p=0.9, seed=0)  # keeps 0, 6 (logit 2) and the five 1.0s
    want = sampling_probs(base[None], p)[0].double()
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    toks = sample(base.expand(n, vocab).contiguous(), [p] * n, gens)
    counts = torch.bincount(toks, minlength=vocab).double()
    assert set(toks.tolist()) == set((want > 0).nonzero().flatten().tolist())
    sd = (n * want * (1 - want)).sqrt()
    assert bool(((counts - n * want).abs() <= 5 * sd + 1e-9).all()), (counts.tolist(), (n * want).tolist())


def test_top_p_without_top_k_draws_from_the_whole_vocabulary():
    """top_k 0: the draw takes `sampling_probs` over all V (a sort for top-p)."""
    n, vocab = 2000, 6
    base = torch.tensor([1.0, 1.0, 0.0, -5.0, 1.0, 0.0])
    p = SamplingParams(top_k=0, top_p=0.7)  # the three 1.0s: mass above them 0 -> all kept; 0.0s: 0.85
    want = sampling_probs(base[None], p)[0]
    assert (want > 0).nonzero().flatten().tolist() == [0, 1, 4]
    toks = sample(base.expand(n, vocab).contiguous(), [p] * n,
                  [torch.Generator().manual_seed(i) for i in range(n)])
    counts = torch.bincount(toks, minlength=vocab)
    assert counts[[2, 3, 5]].sum() == 0 and bool((counts[[0, 1, 4]] > 550).all()), counts.tolist()


def test_top_k_above_the_fast_path_takes_the_definition(monkeypatch):
    """top_k above MAX_FAST_TOP_K (whose O(k^2) path would be too slow) draws from
    `sampling_probs` over the vocabulary: only kept tokens, and the fast path is not run."""
    from flintc import sampling as S

    monkeypatch.setattr(S, "_top_k_scores", lambda *a: pytest.fail("took the O(k^2) path"))
    n, vocab, k = 300, 600, S.MAX_FAST_TOP_K + 44
    x = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)) * 4
    p = SamplingParams(top_k=k, top_p=0.8)
    want = sampling_probs(x, p)[0]
    toks = sample(x.expand(n, vocab).contiguous(), [p] * n, [torch.Generator().manual_seed(i) for i in range(n)])
    assert bool((want[toks] > 0).all()) and 0 < int((want > 0).sum()) < k


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


def test_seeded_rows_do_not_depend_on_the_batch_over_steps():
    """Over several steps with one generator per request (as the runtime keeps them), a
    seeded row draws the same tokens alone and next to rows with other settings (another
    top-k, the sort path, greedy): its generator advances alike in every batch."""
    g = torch.Generator().manual_seed(2)
    steps = [torch.randn(3, V, generator=g) * 2 for _ in range(6)]
    mine = SamplingParams(seed=11, top_k=20)

    def run(others):
        ps = [mine] + others
        gens = [p.make_generator("cpu") if not p.is_greedy else None for p in ps]
        return [sample(x[:len(ps)], ps, gens)[0].item() for x in steps]

    alone = run([])
    for others in ([SamplingParams(seed=5, top_k=50)], [SamplingParams(top_k=0, top_p=0.9)],
                   [SamplingParams(temperature=0), SamplingParams(seed=6, top_k=200, top_p=0.5)]):
        assert run(others) == alone, others


def test_tiny_temperature_is_greedy_and_nan_does_not_crash():
    """A temperature below 1e-5 samples greedily (logits / t would overflow); a row with a
    NaN logit gets some token of its row on both paths, and the other rows are drawn as
    usual (no out-of-bounds gather)."""
    x = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    for k in (0, 2):
        p = SamplingParams(temperature=1e-40, top_k=k)
        assert p.is_greedy and sample(x, [p], [None]).tolist() == [1]
    x = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    x[1, 3] = float("nan")
    for k in (0, 5, 300):
        p = SamplingParams(top_k=k, top_p=0.9)
        tok = sample(x, [p, p], [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
        assert tok.shape == (2,) and all(0 <= t < 50 for t in tok.tolist())
        assert sampling_probs(x[:1], p)[0, tok[0]] > 0


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


@pytest.mark.parametrize("field, value, needle", [
    ("ignore_eos", "false", "'ignore_eos' must be True or False, got 'false'"),  # truthy: it was on
    ("ignore_eos", 1, "'ignore_eos' must be True or False, got 1"),
    ("temperature", True, "'temperature' must be a finite number >= 0, got True"),
    ("top_p", True, "'top_p' must be in (0, 1], got True"),
])
def test_bools_and_numbers_are_not_confused(field, value, needle):
    """A bool is not a number here (as min_p and max_tokens already refused), and
    ignore_eos takes only a bool: the string "false" turned it on."""
    with pytest.raises(InputError) as exc:
        SamplingParams(**{field: value})
    assert needle in str(exc.value)
    import numpy as np

    assert SamplingParams(ignore_eos=np.True_).ignore_eos is True


def test_token_id_lists_may_be_integer_tensors():
    """allowed_token_ids=torch.tensor([5, 6]) is the ids 5 and 6 (it was refused as "token
    id tensor(5) is not an integer"); a float tensor's items are still refused."""
    assert SamplingParams(allowed_token_ids=torch.tensor([6, 5, 6])).allowed_token_ids == (5, 6)
    import numpy as np

    ids = torch.tensor([7, 3])
    assert SamplingParams(logit_bias={ids[0]: 1.0, np.int64(3): -2}).logit_bias == ((3, -2.0), (7, 1.0))
    with pytest.raises(InputError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=torch.tensor([5.0]))
