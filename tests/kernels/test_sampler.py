"""Tests of `flintc.kernels.sampler` (one-launch top-k / top-p sampling).

CPU (Triton's interpreter, small vocabularies cut into many chunks of CPU_CHUNK logits):
- `draw_model`, a plain-torch statement of the kernel's rule (distinct values in
  descending order until their counts reach k, fp64 weights c exp(v - v0), top-p on the
  mass of the larger values, Gumbel-max over the kept values with each value's largest
  uniform), equals `flintc.sampling.sampling_probs` as a distribution: the same kept
  tokens, each with the probability the definition gives;
- the kernel draws exactly `draw_model`'s token on the same uniforms (`uniforms=`), over
  ties (inside, at and beyond the k-th value), -inf logits, bf16 logits, temperatures,
  top-p, greedy rows and mixed batches;
- with its own Philox uniforms: a row's token depends only on its seed and draw offset
  (not on the batch), and the draws of one distribution over 256 seeds follow it
  (chi-square, fixed seeds);
- bad arguments raise ValueError naming them.
GPU (`-m gpu`): the full vocabulary (151,552) at batch 1 and 8 against `draw_model`.
"""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from flintc.kernels import gemv as G
from flintc.kernels import sampler as S
from flintc.sampling import SamplingParams, sampling_probs

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = "cuda" if ON_GPU else "cpu"


def kept_values(x: torch.Tensor, k: int, top_p: float):
    """The kernel's rule up to the draw, for one row x fp32 [V]: the distinct finite
    values in descending order until their counts reach k (list), their counts (list),
    fp64 weights e_j = c_j exp(v_j - v_0), and which of them top-p keeps (the mass of the
    larger values below top_p times the total)."""
    values = torch.unique(x[x > float("-inf")], sorted=True).flip(0)  # distinct, descending
    kept_v, counts, cum = [], [], 0
    for v in values.tolist():
        if cum >= k:
            break
        c = int((x == v).sum())
        kept_v.append(v)
        counts.append(c)
        cum += c
    v = torch.tensor(kept_v, dtype=torch.float64)
    e = torch.tensor(counts, dtype=torch.float64) * torch.exp(v - v[0])
    keep = (torch.cumsum(e, 0) - e) < top_p * e.sum()
    return kept_v, counts, e, keep


def draw_model(x: torch.Tensor, u: torch.Tensor, k: int, top_p: float, greedy: bool = False) -> int:
    """The kernel's rule for one row: x fp32 [V] (logits over the temperature), u fp32 [V]."""
    if greedy:
        return int(torch.argmax(x))
    kept_v, _, _, keep = kept_values(x, k, top_p)
    best, tok = -math.inf, 0
    for j, val in enumerate(kept_v):
        if not keep[j]:
            continue
        ids = (x == val).nonzero()[:, 0]
        uu = u[ids]
        top = uu.max()
        t = int(ids[(uu == top).nonzero()[0, 0]])
        score = (val - kept_v[0]) - math.log(-math.log(float(top))) if top > 0 else -math.inf
        if score > best:
            best, tok = score, t
    return tok


def model_probs(x: torch.Tensor, k: int, top_p: float) -> torch.Tensor:
    """The probability `draw_model` gives each token (Gumbel-max: value j with weight
    e_j among the kept, each of its c_j tokens equally)."""
    kept_v, counts, e, keep = kept_values(x, k, top_p)
    p = torch.zeros(x.shape[0], dtype=torch.float64)
    z = e[keep].sum()
    for j, val in enumerate(kept_v):
        if keep[j]:
            p[x == val] = e[j] / z / counts[j]
    return p


def logits_with_ties(V: int, gen: torch.Generator) -> torch.Tensor:
    """Random logits rounded to few values (many ties), one -inf."""
    x = (torch.randn(V, generator=gen) * 2).round(decimals=1)
    x[V // 3] = float("-inf")
    return x


@pytest.mark.parametrize("k,top_p", [(1, 0.95), (5, 0.95), (20, 0.95), (20, 0.3), (7, 1.0), (40, 0.8)])
def test_model_is_sampling_probs(k, top_p):
    """The kernel's rule draws from `sampling_probs`'s distribution (the definition)."""
    gen = torch.Generator().manual_seed(k)
    for _ in range(5):
        x = logits_with_ties(300, gen)
        want = sampling_probs(x[None], SamplingParams(temperature=1.0, top_k=k, top_p=top_p))[0].double()
        got = model_probs(x, k, top_p)
        assert torch.equal(got > 0, want > 0), "kept sets differ"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def _params(rows):
    """rows: (seed, offset, top_k, temperature, top_p) per row -> params on DEV."""
    return S.pack_params(*[list(c) for c in zip(*rows)]).to(DEV)


CASES = [
    # (V, rows of (top_k, temperature, top_p), logits dtype)
    pytest.param(300, [(20, 1.0, 0.95)], torch.float32, id="B1-defaults"),
    pytest.param(301, [(20, 1.0, 0.95), (5, 0.7, 0.5), (1, 1.3, 1.0)], torch.float32, id="mixed-settings"),
    pytest.param(257, [(20, 0.0, 0.95), (20, 1.0, 0.95)], torch.float32, id="greedy-and-sampled"),
    pytest.param(200, [(33, 1.0, 0.9), (64, 0.9, 1.0)], torch.float32, id="k-33-and-64"),
    pytest.param(300, [(20, 1.0, 0.95), (8, 2.0, 0.6)], torch.bfloat16, id="bf16"),
]


@pytest.mark.parametrize("V,rows,dtype", CASES)
def test_kernel_draws_the_models_token(V, rows, dtype):
    gen = torch.Generator().manual_seed(V + len(rows))
    B = len(rows)
    x = torch.stack([logits_with_ties(V, gen) for _ in range(B)]).to(dtype)
    x[0, 3:9] = x[0].max()  # ties at the top
    for trial in range(3):
        u = torch.rand(B, V, generator=gen)
        u[0, 5] = u[0, 4]  # equal uniforms within a tie: the lower id wins
        params = _params([(b, trial, k, t, p) for b, (k, t, p) in enumerate(rows)])
        got = S.launch_sample(x.to(DEV), params, max(k for k, _, _ in rows), uniforms=u.to(DEV))
        for b, (k, t, p) in enumerate(rows):
            xb = x[b].float()
            xs = xb if t < S.GREEDY_TEMPERATURE else xb / t
            assert int(got[b]) == draw_model(xs, u[b], k, p, greedy=t < S.GREEDY_TEMPERATURE), (trial, b)
    assert all(bool((c == 0).all()) for c in G._COUNTERS.values()), "arrival counters not reset"


def test_greedy_ties_take_the_lower_id():
    x = torch.zeros(2, 200)
    x[0, [17, 150, 199]] = 5.0
    x[1, 0] = float("-inf")
    params = _params([(0, 0, 1, 0.0, 1.0), (0, 0, 1, 0.0, 1.0)])
    assert S.launch_sample(x.to(DEV), params, 1).tolist() == [17, 1]


def test_philox_draws_depend_on_seed_and_offset_only():
    gen = torch.Generator().manual_seed(3)
    x = torch.stack([logits_with_ties(300, gen) for _ in range(3)]).to(DEV)
    rows = [(11, 4, 20, 1.0, 0.95), (12, 0, 5, 0.8, 0.9), (2**62 + 5, 2**40, 20, 1.0, 1.0)]
    batch = S.launch_sample(x, _params(rows), 20)
    for b, row in enumerate(rows):
        alone = S.launch_sample(x[b:b + 1].contiguous(), _params([row]), row[2])
        assert int(alone[0]) == int(batch[b]), b
    # the same seed over offsets 0..15: not one token every time (the stream advances)
    xs = x[:1].expand(16, -1).contiguous()
    toks = S.launch_sample(xs, _params([(11, o, 20, 1.0, 1.0) for o in range(16)]), 20)
    assert len(set(toks.tolist())) > 1


def test_philox_draws_follow_the_distribution():
    """256 seeds drawing from one small distribution (V = 16, top-k 6 with a tie at the
    6th value, top-p 0.9): chi-square against `model_probs` (fixed seeds, so the
    statistic is deterministic; its 1e-4 critical value at the degrees of freedom)."""
    V, k, top_p, n = 16, 6, 0.9, 256
    x = torch.tensor([3.0, 2.5, 2.5, 2.0, 1.0, 0.5, 0.5, 0.2, -1, -2, -3, -4, -5, -6, -7, -8])
    p = model_probs(x, k, top_p)
    toks = S.launch_sample(x[None].expand(n, -1).contiguous().to(DEV),
                           _params([(1000 + s, 0, k, 1.0, top_p) for s in range(n)]), k)
    counts = torch.bincount(toks.cpu(), minlength=V).double()
    assert counts[p == 0].sum() == 0, "a token outside the kept set was drawn"
    live = p > 0
    exp = n * p[live]
    chi2 = float(((counts[live] - exp) ** 2 / exp).sum())
    assert chi2 < 25.7, f"chi-square {chi2:.1f} over {int(live.sum()) - 1} degrees of freedom"  # 1e-4 at 5 dof


@pytest.mark.parametrize("name,call", [
    ("logits", lambda x, p: S.launch_sample(x.double(), p, 20)),
    ("logits", lambda x, p: S.launch_sample(x[0], p, 20)),
    ("params", lambda x, p: S.launch_sample(x, p[:4].contiguous(), 20)),
    ("params", lambda x, p: S.launch_sample(x, p.int(), 20)),
    ("max_top_k", lambda x, p: S.launch_sample(x, p, 0)),
    ("max_top_k", lambda x, p: S.launch_sample(x, p, S.MAX_TOP_K + 1)),
    ("max_top_k", lambda x, p: S.launch_sample(x, p, 300)),
    ("uniforms", lambda x, p: S.launch_sample(x, p, 20, uniforms=torch.rand(2, 5).to(x.device))),
])
def test_bad_arguments(name, call):
    x = torch.randn(2, 300).to(DEV)
    p = _params([(0, 0, 20, 1.0, 0.9), (1, 0, 20, 1.0, 0.9)])
    with pytest.raises(ValueError, match=name):
        call(x, p)


def test_pack_params_and_supports():
    p = S.pack_params([7, 2**63 + 3], [1, 2], [20, 1], [0.5, 1.0], [0.95, 1.0])
    assert p.dtype == torch.int64 and p.shape == (5, 2)
    assert p[0].tolist() == [7, 3]  # seeds taken mod 2^63
    assert p[3].to(torch.int32).view(torch.float32).tolist() == [0.5, 1.0]
    assert S.supports([1, 20, 64], 1000) and not S.supports([0], 1000) and not S.supports([65], 1000)
    assert not S.supports([20], 20)
    with pytest.raises(ValueError, match="one seed"):
        S.pack_params([1], [1, 2], [1], [1.0], [1.0])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA (and TRITON_INTERPRET unset or 0)")
@pytest.mark.parametrize("B", [1, 8])
def test_full_vocabulary_gpu(B):
    """V = 151,552 (37 chunks of GPU_CHUNK), the default settings and a greedy row,
    against `draw_model` on the same uniforms. The CPU twin:
    `test_kernel_draws_the_models_token`."""
    V = 151552
    gen = torch.Generator().manual_seed(B)
    x = torch.randn(B, V, generator=gen) * 3
    x[0, 1000:1010] = x[0].max()
    u = torch.rand(B, V, generator=gen)
    rows = [(b, 0, 20, 0.0 if b == 1 else 1.0, 0.95) for b in range(B)]
    got = S.launch_sample(x.cuda(), _params(rows), 20, uniforms=u.cuda()).cpu()
    for b in range(B):
        assert int(got[b]) == draw_model(x[b], u[b], 20, 0.95, greedy=b == 1), b
    toks = S.launch_sample(x.cuda(), _params(rows), 20)  # Philox: a valid token per row
    assert ((toks >= 0) & (toks < V)).all()


def test_sample_takes_the_kernel_when_asked(monkeypatch):
    """`flintc.sampling.sample` with FLINTC_SAMPLER=triton: one launch for a mixed batch
    (greedy, defaults, other settings), the greedy row its argmax, every sampled token in
    its kept set, and a seeded row's tokens the same alone or in a batch, step after
    step; a batch the kernel does not take (top_k 0: the whole vocabulary) goes the torch
    way; a bad FLINTC_SAMPLER is an error naming it."""
    from flintc import sampling
    from flintc.kernels.tuning import TuningEnvError, check_environment

    calls = []
    real = S.launch_sample
    monkeypatch.setattr(S, "launch_sample", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    monkeypatch.setenv("FLINTC_SAMPLER", "triton")
    gen = torch.Generator().manual_seed(5)
    V = 300
    x = torch.stack([logits_with_ties(V, gen) for _ in range(3)]).to(DEV)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=7),
              SamplingParams(seed=8, top_k=5, top_p=0.5, temperature=0.8)]

    def gens():
        return [None if p.is_greedy else p.make_generator(DEV) for p in params]

    g_batch, g_alone = gens(), gens()
    for step in range(3):
        toks = sampling.sample(x, params, g_batch)
        assert calls[-1] == 20 and int(toks[0]) == int(torch.argmax(x[0]))
        for b in (1, 2):
            probs = sampling_probs(x[b:b + 1].float(), params[b])[0]
            assert probs[int(toks[b])] > 0, (step, b)
            alone = sampling.sample(x[b:b + 1], [params[b]], [g_alone[b]])
            assert int(alone[0]) == int(toks[b]), (step, b)
    n = len(calls)
    sampling.sample(x[:1], [SamplingParams(top_k=0, seed=1)], [SamplingParams(seed=1).make_generator(DEV)])
    assert len(calls) == n, "top_k 0 must take the torch path"
    monkeypatch.setenv("FLINTC_SAMPLER", "cuda")
    with pytest.raises(TuningEnvError, match="FLINTC_SAMPLER must be torch or triton"):
        sampling.sample(x, params, gens())
    with pytest.raises(TuningEnvError, match="FLINTC_SAMPLER"):
        check_environment()
    monkeypatch.delenv("FLINTC_SAMPLER")
    assert sampling.sampler_backend() == sampling.DEFAULT_SAMPLER


def test_sample_seeded_row_does_not_depend_on_the_batch_with_triton(monkeypatch):
    """With FLINTC_SAMPLER=triton a seeded row draws the same tokens, and leaves its
    generator in the same state, whatever the other rows are: also next to a row the
    kernel does not take (top_k 0, or above MAX_TOP_K), which must not send the seeded
    row down the torch path (`flintc.sampling` promises that a seeded request's tokens
    do not depend on the rest of the batch)."""
    from flintc import sampling

    monkeypatch.setenv("FLINTC_SAMPLER", "triton")
    gen = torch.Generator().manual_seed(9)
    V = 300
    steps = [torch.stack([logits_with_ties(V, gen) for _ in range(3)]).to(DEV) for _ in range(3)]
    mine = SamplingParams(seed=11, top_k=20)

    def run(others):
        ps = [mine] + others
        gens = [None if p.is_greedy else p.make_generator(DEV) for p in ps]
        toks = [int(sampling.sample(x[:len(ps)], ps, gens)[0]) for x in steps]
        return toks, gens[0].get_state()

    alone, state = run([])
    for others in ([SamplingParams(seed=5, top_k=5)], [SamplingParams(seed=6, top_k=0, top_p=0.9)],
                   [SamplingParams(temperature=0), SamplingParams(seed=7, top_k=S.MAX_TOP_K + 1)]):
        toks, st = run(others)
        assert toks == alone, others
        assert torch.equal(st, state), others


def test_top_p_is_compared_at_full_precision():
    """top_p reaches the kernel as the Python float (fp64), as `sampling_probs` and
    `_top_k_scores` compare it: here the mass above the second value is 0.94999999787,
    between fp32(0.95) = 0.949999988 and 0.95, so the second token stays (an fp32 top_p
    dropped it), and with the larger uniform it is drawn."""
    from flintc.sampling import _top_k_scores

    V = 100
    x = torch.full((V,), -30.0)
    x[10], x[20] = 0.0, -2.944438934326172  # 1 / (1 + exp(x[20])) = 0.94999999787
    p = SamplingParams(temperature=1.0, top_k=5, top_p=0.95)
    assert (sampling_probs(x[None], p)[0] > 0).nonzero().flatten().tolist() == [10, 20]
    cand, scores, _ = _top_k_scores(x[None], 5, 0.95)
    assert sorted(cand[0][scores[0, :5] > float("-inf")].tolist()) == [10, 20]
    assert p.top_p == 0.95 and S.pack_params([0], [0], [5], [1.0], [0.95])[4].view(torch.float64).item() == 0.95
    u = torch.full((1, V), 0.5)
    u[0, 10], u[0, 20] = 0.001, 0.999
    got = S.launch_sample(x[None].to(DEV), _params([(0, 0, 5, 1.0, 0.95)]), 5, uniforms=u.to(DEV))
    assert int(got[0]) == draw_model(x, u[0], 5, 0.95) == 20


def test_top_k_above_max_top_k_is_clamped_to_the_records():
    """A direct caller passing max_top_k below a row's top_k: the kernel samples that row
    with top-k KMAX (the records it has), never past them: every draw among the 4 largest."""
    x = torch.arange(300, dtype=torch.float32)[None].expand(64, -1).contiguous() * 0.01
    toks = S.launch_sample(x.to(DEV), _params([(s, 0, 20, 1.0, 1.0) for s in range(64)]), 4)
    assert bool((toks.cpu() >= 296).all()), toks.tolist()


def test_greedy_row_takes_an_inf_logit_in_a_mixed_batch():
    """A greedy row next to a sampled one (so the kernel runs it) whose logits hold +inf:
    the lowest +inf token, as torch.argmax; the sampled row is unaffected."""
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(9))
    x[0, [30, 120]] = float("inf")
    params = _params([(0, 0, 1, 0.0, 1.0), (3, 0, 20, 1.0, 0.95)])
    toks = S.launch_sample(x.to(DEV), params, 20)
    assert int(toks[0]) == 30 and 0 <= int(toks[1]) < 200


def test_adjusted_rows_take_the_kernel_and_min_p_rows_do_not(monkeypatch):
    """With FLINTC_SAMPLER=triton: a row with penalties / logit_bias / min_tokens still
    takes the kernel, drawing from its adjusted logits (the same token as a plain row
    given `adjust_logits`' output, same seed); a min_p row goes the torch way (the kernel
    has no min_p) and the seeded plain row beside them draws as it does alone."""
    from flintc import sampling

    calls = []
    real = S.launch_sample
    monkeypatch.setattr(S, "launch_sample", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setenv("FLINTC_SAMPLER", "triton")
    gen = torch.Generator().manual_seed(12)
    V = 300
    x = torch.stack([logits_with_ties(V, gen) for _ in range(3)]).to(DEV)
    plain = SamplingParams(seed=1)
    pen = SamplingParams(seed=2, presence_penalty=2.0, repetition_penalty=1.5, logit_bias={3: 5.0}, min_tokens=2)
    minp = SamplingParams(seed=3, min_p=0.3)
    hist = [None, sampling.TokenHistory([1, 2, 3], [int(torch.argmax(x[1]))] * 2, {4}), None]
    ps = [plain, pen, minp]
    toks = sampling.sample(x, ps, [p.make_generator(DEV) for p in ps], history=hist)
    assert calls == [2]  # plain and pen in one launch; min_p on the torch path
    adjusted = sampling.adjust_logits(x, ps, hist)
    again = sampling.sample(adjusted[1:2], [SamplingParams(seed=2)], [pen.make_generator(DEV)])
    assert int(toks[1]) == int(again[0])
    alone = sampling.sample(x[:1], [plain], [plain.make_generator(DEV)])
    assert int(toks[0]) == int(alone[0])
    assert sampling_probs(x[2:3].float(), minp)[0, int(toks[2])] > 0


def test_masked_rows_take_the_kernel_and_stay_in_the_mask(monkeypatch):
    """With FLINTC_SAMPLER=triton: rows with allowed_token_ids (fewer tokens than top_k,
    so the k-th value is -inf) and bad words take the kernel, on the masked logits, and
    draw only tokens the masks leave, over many seeds."""
    from flintc import sampling

    calls = []
    real = S.launch_sample
    monkeypatch.setattr(S, "launch_sample", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setenv("FLINTC_SAMPLER", "triton")
    V = 300
    x = logits_with_ties(V, torch.Generator().manual_seed(13))[None].repeat(2, 1)
    x[:, :40] += 20  # the likeliest tokens are all masked
    allowed = [50, 51, 52, 250]
    x[:, allowed] = 0.0  # ties: all kept
    out = [51]
    seen = [set(), set()]
    for seed in range(24):
        ps = [SamplingParams(seed=seed, allowed_token_ids=allowed, bad_words_token_ids=[[250]]),
              SamplingParams(seed=seed, top_k=5, bad_words_token_ids=[[51, 3]] + [[t] for t in range(40)])]
        hist = [sampling.TokenHistory([1], out), sampling.TokenHistory([1], out)]
        toks = sampling.sample(x.to(DEV), ps, [p.make_generator(DEV) for p in ps], history=hist)
        seen[0].add(int(toks[0]))
        seen[1].add(int(toks[1]))
    assert calls == [2] * 24
    assert seen[0] <= {50, 51, 52} and len(seen[0]) >= 2, seen
    assert not seen[1] & (set(range(40)) | {3}), seen


def test_structured_output_rows_take_the_kernel_and_stay_in_the_grammar(monkeypatch, tiny_bf16_dir):
    """With FLINTC_SAMPLER=triton: a row with structured_outputs (a choice) takes the
    kernel, on the grammar's masked logits, and draws only the tokens the grammar allows,
    over seeds, beside a plain row."""
    from flintc import sampling
    from flintc.checkpoint.tokenizer import load_tokenizer
    from flintc.structured import GrammarMatcher

    tok = load_tokenizer(tiny_bf16_dir)
    calls = []
    real = S.launch_sample
    monkeypatch.setattr(S, "launch_sample", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setenv("FLINTC_SAMPLER", "triton")
    spec = sampling.StructuredOutputsParams(choice=["yes", "no", "maybe"])
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3)).to(DEV)
    allowed = None
    for seed in range(4):
        g = GrammarMatcher(spec, tok, {tok.eos_token_id})
        if allowed is None:
            allowed = set(torch.nonzero(g.allowed(512, "cpu")).flatten().tolist())
        ps = [SamplingParams(seed=seed, structured_outputs=spec), SamplingParams(seed=seed)]
        hist = [sampling.TokenHistory([1], [], {tok.eos_token_id}, grammar=g), None]
        toks = sampling.sample(x, ps, [p.make_generator(DEV) for p in ps], history=hist)
        assert int(toks[0]) in allowed
    assert calls == [2] * 4
    assert {tok.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no", "m", "ma", "may", "mayb", "maybe"}
