"""vLLM's sampling controls in `flintc.sampling` (presence / frequency / repetition
penalties, min_p, min_tokens, logit_bias), on the CPU: the adjusted logits against a
plain per-token restatement of vLLM's `apply_penalties` and logits processors, the
distribution with min_p against its definition, greedy outputs of the tiny model, and
the batch independence of rows without these options."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flintc.errors import InputError
from flintc.sampling import (SamplingParams, TokenHistory, adjust_logits, apply_penalties, sample,
                             sampling_probs)

# ---- the logits adjustments against vLLM's formula -----------------------------------------


def vllm_reference(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams,
                   stops: set[int]) -> np.ndarray:
    """One row as vLLM's sampler leaves it before temperature, token by token in fp32:
    min_tokens (stop ids to -inf while the output is shorter), logit_bias (added), then
    apply_penalties: repetition for tokens of prompt or output (x > 0: x / r, else x * r),
    minus frequency * count in the output, minus presence if in the output."""
    x = logits.astype(np.float32).copy()
    f32 = np.float32
    if len(output) < p.min_tokens:
        for t in stops:
            x[t] = -np.inf
    for t, b in p.logit_bias or ():
        x[t] = f32(x[t] + f32(b))
    for v in range(x.shape[0]):
        count = output.count(v)
        if v in prompt or count:
            x[v] = x[v] / f32(p.repetition_penalty) if x[v] > 0 else x[v] * f32(p.repetition_penalty)
        x[v] = x[v] - f32(p.frequency_penalty) * f32(count)
        x[v] = x[v] - f32(p.presence_penalty) * f32(count > 0)
    return x


penalty = st.sampled_from([0.0, -2.0, 2.0, 0.5, -0.7, 1.3])
rep_penalty = st.sampled_from([1.0, 0.5, 1.2, 2.0, 0.01, 7.5])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), vocab=st.integers(2, 64),
       data=st.data())
def test_adjusted_logits_are_vllms(seed, rows, vocab, data):
    """`adjust_logits` over a batch (rows with and without options, zero logits and
    repeated tokens included) equals the per-token statement of vLLM's formula, bit for
    bit; rows without options come back unchanged."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    x[:, ::5] = 0.0  # zero logits: multiplied by the repetition penalty, as vLLM
    ids = st.integers(0, vocab - 1)
    params, hists, stops = [], [], []
    for _ in range(rows):
        prompt = data.draw(st.lists(ids, min_size=1, max_size=12))
        output = data.draw(st.lists(ids, max_size=12))
        stop = set(data.draw(st.lists(ids, max_size=3)))
        bias = data.draw(st.dictionaries(ids, st.floats(-100, 100, allow_nan=False), max_size=4))
        params.append(SamplingParams(
            temperature=data.draw(st.sampled_from([0.0, 1.0, 0.7])),
            presence_penalty=data.draw(penalty), frequency_penalty=data.draw(penalty),
            repetition_penalty=data.draw(rep_penalty), logit_bias=bias,
            min_tokens=data.draw(st.integers(0, 16))))
        hists.append(TokenHistory(prompt, output, stop))
        stops.append(stop)
    got = adjust_logits(x, params, hists)
    assert got is not x and got.dtype == torch.float32
    for b, (p, h) in enumerate(zip(params, hists)):
        want = vllm_reference(x[b].numpy(), h.prompt_ids, h.output_ids, p, stops[b])
        np.testing.assert_array_equal(got[b].numpy(), want, err_msg=f"row {b}: {p}")
        if not p.adjusts_logits:
            assert torch.equal(got[b], x[b])


def test_apply_penalties_batched_and_counts_kept_up_to_date():
    """apply_penalties on rows with different penalties; a TokenHistory's counts follow the
    tokens appended to its output list between calls (one at a time and several at once)."""
    x = torch.tensor([[2.0, -2.0, 0.0, 1.0], [2.0, -2.0, 0.0, 1.0]])
    got = apply_penalties(x, torch.tensor([[True, True, False, False], [False] * 4]),
                          torch.tensor([[0.0, 0.0, 0.0, 3.0], [1.0, 0.0, 0.0, 0.0]]),
                          torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.0]), torch.tensor([2.0, 4.0]))
    assert got.tolist() == [[1.0, -4.0, 0.0, 1.0 / 2 - 0.75 - 0.5], [2.0 / 4 - 1.0, -2.0, 0.0, 1.0]]
    out: list[int] = []
    h = TokenHistory([1], out)
    assert h.output_counts(5, "cpu").tolist() == [0] * 5
    out.append(3)
    assert h.output_counts(5, "cpu").tolist() == [0, 0, 0, 1, 0]
    out.extend([3, 4, 0, 0, 0, 2])
    assert h.output_counts(5, "cpu").tolist() == [3, 0, 1, 2, 1]
    assert h.prompt_mask(5, "cpu").tolist() == [False, True, False, False, False]


def test_presence_penalty_stops_greedy_repeats():
    """Greedy over logits that always favour the same tokens (0.05 apart): without a
    penalty the same token every step; with presence_penalty 2 (more than the spread of
    the first 40) never a token twice; frequency_penalty likewise; a negative presence
    penalty keeps repeating."""
    V = 64
    logits = (-0.05 * torch.arange(V, dtype=torch.float32))[None]

    def run(**kw):
        p = SamplingParams(temperature=0, max_tokens=30, **kw)
        out: list[int] = []
        h = TokenHistory([V - 1], out)
        for _ in range(30):
            out.append(int(sample(logits, [p], [None], history=[h])[0]))
        return out

    assert run() == [0] * 30
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 1.0,
                                                                        "frequency_penalty": 1.5}):
        toks = run(**kw)
        assert len(set(toks)) == 30, kw
    assert run(presence_penalty=-2.0) == [0] * 30
    # repetition penalty: the prompt's token counts too (positive logits divided)
    pos = torch.tensor([[3.0, 2.9, 1.0]])
    p = SamplingParams(temperature=0, repetition_penalty=1.1)
    assert int(sample(pos, [p], [None], history=[TokenHistory([0], [])])[0]) == 1
    assert int(sample(pos, [p], [None], history=[TokenHistory([2], [])])[0]) == 0


def test_logit_bias_and_min_tokens_in_sample():
    x = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    greedy = [SamplingParams(temperature=0, logit_bias={17: 100}), SamplingParams(temperature=0)]
    toks = sample(x, greedy, [None, None])  # logit_bias needs no history
    assert toks.tolist() == [17, int(x[1].argmax())]
    ban = SamplingParams(temperature=0, logit_bias={int(x[0].argmax()): -100})
    assert int(sample(x[:1], [ban], [None])[0]) == int(x[0].topk(2).indices[1])
    # min_tokens masks the stop ids until that many tokens are out, then not
    eos = int(x[0].argmax())
    p = SamplingParams(temperature=0, min_tokens=2)
    out: list[int] = []
    h = TokenHistory([1, 2], out, {eos})
    for want_eos in (False, False, True):
        tok = int(sample(x[:1], [p], [None], history=[h])[0])
        assert (tok == eos) == want_eos
        out.append(tok)
    assert torch.equal(x, torch.randn(2, 50, generator=torch.Generator().manual_seed(1)))  # not written


def test_rows_needing_history_without_it_are_an_error():
    x = torch.zeros(1, 8)
    for kw in ({"presence_penalty": 1.0}, {"repetition_penalty": 1.5}, {"min_tokens": 1}):
        with pytest.raises(ValueError, match="TokenHistory"):
            sample(x, [SamplingParams(temperature=0, **kw)], [None])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sample(x, [SamplingParams(temperature=0, logit_bias={8: 1.0})], [None])
    with pytest.raises(ValueError, match="history"):
        sample(x, [SamplingParams(temperature=0)], [None], history=[None, None])


# ---- min_p ----------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 120), min_p=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
       k=st.sampled_from([0, 1, 5, 20]), top_p=st.sampled_from([0.5, 0.95, 1.0]),
       temperature=st.sampled_from([0.5, 1.0, 2.0]), rounded=st.booleans())
def test_min_p_is_vllms_and_keeps_ties_together(seed, vocab, min_p, k, top_p, temperature, rounded):
    """sampling_probs with min_p: vLLM's rule (drop a token whose probability after
    temperature is below min_p times the largest), then top-k and top-p on what is left;
    equal logits kept or dropped together; and `sample` draws only kept tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, vocab, generator=g) * 3
    if rounded:
        x = torch.round(x)
    p = SamplingParams(temperature=temperature, top_k=k, top_p=top_p, min_p=min_p, seed=seed)
    probs = sampling_probs(x, p)[0]
    xt = (x / temperature)[0]
    pr = torch.softmax(xt.double(), -1)
    ratio = pr / pr.max()
    if (ratio - min_p).abs().min() > 1e-9:  # not at the edge of the cut
        kept_by_min_p = pr >= min_p * pr.max()
        want = sampling_probs(xt.masked_fill(~kept_by_min_p, float("-inf"))[None],
                              SamplingParams(temperature=1.0, top_k=k, top_p=top_p))[0]
        torch.testing.assert_close(probs, want)
    for v in torch.unique(x):  # ties: all kept or all dropped
        kept = probs[x[0] == v] > 0
        assert kept.all() or not kept.any()
    assert probs[int(x.argmax())] > 0
    gen = p.make_generator("cpu")
    for _ in range(5):
        assert probs[int(sample(x, [p], [gen])[0])] > 0


def test_min_p_one_keeps_only_the_top_tokens():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.9, -1.0]])
    p = SamplingParams(min_p=1.0, top_k=0, top_p=1.0)
    assert sampling_probs(x, p)[0].tolist() == [0.0, 0.5, 0.5, 0.0, 0.0]
    gen = torch.Generator().manual_seed(3)
    assert {int(sample(x, [p], [gen])[0]) for _ in range(20)} == {1, 2}


# ---- batches: rows without options are unaffected ------------------------------------------


def test_plain_rows_do_not_depend_on_penalised_rows():
    """Seeded plain rows draw the same tokens over steps alone and beside rows with
    penalties, logit_bias, min_tokens and min_p (and leave their generators alike)."""
    V = 300
    g = torch.Generator().manual_seed(4)
    steps = [torch.randn(5, V, generator=g) * 2 for _ in range(6)]
    plain = [SamplingParams(seed=1), SamplingParams(seed=2, top_k=0, top_p=0.9), SamplingParams(temperature=0)]
    others = [SamplingParams(seed=3, presence_penalty=1.5, repetition_penalty=1.3, logit_bias={5: 3}),
              SamplingParams(seed=4, min_p=0.2, min_tokens=3, frequency_penalty=-1)]

    every = plain + others  # each params its own row of logits, wherever it sits in the batch

    def run(ps):
        gens = [None if p.is_greedy else p.make_generator("cpu") for p in ps]
        outs = [[] for _ in ps]
        hists = [TokenHistory([1, 2, 3], outs[i], {0}) for i in range(len(ps))]
        for x in steps:
            rows = torch.stack([x[every.index(p)] for p in ps])
            toks = sample(rows, ps, gens, history=hists).tolist()
            for o, t in zip(outs, toks):
                o.append(t)
        return outs, [None if gn is None else gn.get_state() for gn in gens]

    alone, states = run(plain)
    for mix in ([others[0]] + plain, plain[:1] + others + plain[1:]):
        outs, st = run(mix)
        for i, p in enumerate(plain):
            j = mix.index(p)
            assert outs[j] == alone[i], (i, j)
            assert (st[j] is None) == (states[i] is None) and (st[j] is None or torch.equal(st[j], states[i]))


# ---- validation --------------------------------------------------------------------------


@pytest.mark.parametrize("kw,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # more than max_tokens (16)
    ({"logit_bias": {3: 101}}, "logit_bias"),
    ({"logit_bias": {3: math.nan}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"3": 1}}, "logit_bias"),
    ({"logit_bias": 5}, "logit_bias"),
])
def test_validation_names_the_field(kw, field):
    with pytest.raises(InputError, match=f"'{field}'"):
        SamplingParams(**kw)


def test_defaults_are_off_and_logit_bias_is_normalised():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens,
            p.logit_bias) == (0.0, 0.0, 1.0, 0.0, 0, None)
    assert not p.adjusts_logits and not SamplingParams(min_p=0.5).adjusts_logits
    assert SamplingParams(logit_bias={}).logit_bias is None
    q = SamplingParams(logit_bias={9: 1, 2: -5.5})
    assert q.logit_bias == ((2, -5.5), (9, 1.0)) and q.adjusts_logits
    assert hash(q) == hash(SamplingParams(logit_bias=[(2, -5.5), (9, 1)]))


# ---- generation on the tiny model ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_bf16_dir):
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.model.reference import FlintModel

    ckpt = load_checkpoint(tiny_bf16_dir, progress=False)
    return FlintModel(ckpt.config, ckpt.weights)


def test_generate_with_penalties_bias_and_min_tokens(tiny_model):
    """The reference generate (generate_with_runner): greedy with presence_penalty 2 has
    no generated token twice where plain greedy repeats; logit_bias +100 makes greedy
    pick that token every step; min_tokens 5 with EOS made the likeliest token gives 5
    tokens and then EOS, where without it EOS comes first; a logit_bias id outside the
    vocabulary is an InputError."""
    from flintc.model.generate import generate

    prompt = [1, 2, 3]
    plain = generate(tiny_model, [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert len(set(plain.output_ids[0])) < 16  # the tiny model repeats itself
    pen = generate(tiny_model, [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                        presence_penalty=2.0))
    assert len(set(pen.output_ids[0])) == 16, pen.output_ids[0]
    first = next(i for i, t in enumerate(plain.output_ids[0]) if t in plain.output_ids[0][:i])
    assert pen.output_ids[0][:first] == plain.output_ids[0][:first]
    biased = generate(tiny_model, [prompt], SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100}))
    assert biased.output_ids[0] == [42] * 5
    eos = 7
    forced = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100})
    r = generate(tiny_model, [prompt], forced, eos_token_id=eos)
    assert r.output_ids[0] == [eos] and r.finish_reasons[0] == "stop"
    r = generate(tiny_model, [prompt, prompt],
                 [SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100}, min_tokens=5),
                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)], eos_token_id=eos)
    assert len(r.output_ids[0]) == 6 and eos not in r.output_ids[0][:5] and r.output_ids[0][5] == eos
    assert r.finish_reasons[0] == "stop"
    assert r.output_ids[1] == plain.output_ids[0][:8]  # the plain row beside it is unchanged
    with pytest.raises(InputError, match="'logit_bias'.*512"):
        generate(tiny_model, [prompt], SamplingParams(temperature=0, logit_bias={512: 1}))


def test_numpy_scalars_are_taken_as_python_numbers():
    """np.float32(1.2) or np.int64(5) were refused ("must be a number ..., got
    np.float32(1.2)"): NumPy scalars stand for the numbers they hold; a float where an
    integer is expected is still refused."""
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), max_tokens=np.int32(8),
                       seed=np.uint64(3), presence_penalty=np.float64(0.5), repetition_penalty=np.float32(1.2),
                       min_p=np.float16(0.25), min_tokens=np.int8(2))
    assert (p.temperature, p.top_k, p.max_tokens, p.seed, p.min_tokens) == (0.5, 5, 8, 3, 2)
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.presence_penalty) is float
    assert p.repetition_penalty == pytest.approx(1.2) and p.min_p == 0.25
    with pytest.raises(InputError, match="'top_k' must be an integer"):
        SamplingParams(top_k=np.float32(2.0))
    with pytest.raises(InputError, match="'presence_penalty' must be a number in \\[-2, 2\\]"):
        SamplingParams(presence_penalty=np.float32(3))
