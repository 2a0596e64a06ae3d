"""vLLM's token masks in `flintc.sampling` (`allowed_token_ids`, `bad_words`), on the CPU:
`adjust_logits` against a plain restatement of vLLM v1's `apply_allowed_token_ids` /
`apply_bad_words` (output tokens only), the order with min_tokens / logit_bias /
penalties, draws (greedy and sampled) that never leave the mask, the word -> ids
conversion (vLLM's `update_from_tokenizer`, with and without a leading space),
validation, and generation on the tiny model (the reference runner, and
`CompiledModel.generate` with a tokenizer)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flintc.errors import InputError
from flintc.sampling import (SamplingParams, TokenHistory, adjust_logits, bad_word_bans,
                             bad_words_to_token_ids, sample)
from harness import checkpoint_model_and_tokenizer


def vllm_masks(logits: np.ndarray, p: SamplingParams, output: list[int]) -> np.ndarray:
    """One row as vLLM v1's sampler leaves it after its two masks: every token outside
    allowed_token_ids -inf; then for each bad word (ids), its last id -inf when the
    output's last len - 1 tokens are its first len - 1 (always for one token)."""
    x = logits.astype(np.float32).copy()
    if p.allowed_token_ids is not None:
        keep = np.zeros(x.shape[0], dtype=bool)
        keep[list(p.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for ids in p.bad_words_token_ids or ():
        if len(ids) > len(output) + 1:
            continue
        prefix = len(ids) - 1
        if list(output[len(output) - prefix:] if prefix else []) == list(ids[:prefix]):
            x[ids[-1]] = -np.inf
    return x


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), vocab=st.integers(2, 40), data=st.data())
def test_masks_are_vllms(seed, rows, vocab, data):
    """`adjust_logits` with allowed_token_ids and bad words (over outputs that often end
    with a word's prefix) equals vLLM's masks bit for bit; rows without them come back
    unchanged, and the prompt never completes a bad word."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    ids = st.integers(0, vocab - 1)
    params, hists = [], []
    for _ in range(rows):
        words = data.draw(st.lists(st.lists(ids, min_size=1, max_size=3), max_size=4))
        output = data.draw(st.lists(ids, max_size=6))
        if words and data.draw(st.booleans()):  # end the output with a word's prefix
            output = output + words[0][:-1]
        allowed = data.draw(st.none() | st.lists(ids, min_size=1, max_size=vocab))
        params.append(SamplingParams(temperature=data.draw(st.sampled_from([0.0, 1.0])),
                                     allowed_token_ids=allowed, bad_words_token_ids=words))
        # the prompt ends with every word's prefix: it must not count
        hists.append(TokenHistory([t for w in words for t in w[:-1]] or [0], output))
    got = adjust_logits(x, params, hists)
    for b, (p, h) in enumerate(zip(params, hists)):
        np.testing.assert_array_equal(got[b].numpy(), vllm_masks(x[b].numpy(), p, h.output_ids),
                                      err_msg=f"row {b}: {p}, output {h.output_ids}")
        if not p.adjusts_logits:
            assert torch.equal(got[b], x[b])


def test_bad_word_prefix_rule():
    """A word of several tokens bans its last token only right after its other tokens
    (in the output); a one-token word always; the prompt does not count (vLLM v1)."""
    words = ((5,), (1, 2, 3), (2, 7))
    assert bad_word_bans(words, []) == [5]
    assert bad_word_bans(words, [1]) == [5]
    assert bad_word_bans(words, [1, 2]) == [5, 3, 7]
    assert bad_word_bans(words, [9, 1, 2]) == [5, 3, 7]
    assert bad_word_bans(words, [2]) == [5, 7]
    assert bad_word_bans(words, [1, 2, 9]) == [5]
    x = torch.zeros(1, 10)
    p = SamplingParams(temperature=0, bad_words_token_ids=[[1, 2, 3]])
    got = adjust_logits(x, [p], [TokenHistory([1, 2], [])])  # the prompt ends with 1, 2
    assert torch.equal(got, x)
    got = adjust_logits(x, [p], [TokenHistory([4], [1, 2])])
    assert got[0, 3] == float("-inf") and torch.isfinite(got[0, [0, 1, 2, 4, 5]]).all()


def test_greedy_never_picks_a_banned_token():
    """Greedy over logits that always favour token 0, then 1, 2, ...: a one-token bad
    word moves every step to the next token; the word (0, 1) lets 0 come, then bans 1
    after it; allowed_token_ids picks the best allowed token every step."""
    V = 16
    logits = (-0.5 * torch.arange(V, dtype=torch.float32))[None]

    def run(steps=6, **kw):
        p = SamplingParams(temperature=0, max_tokens=steps, **kw)
        out: list[int] = []
        h = TokenHistory([3], out)
        for _ in range(steps):
            out.append(int(sample(logits, [p], [None], history=[h])[0]))
        return out

    assert run() == [0] * 6
    assert run(bad_words_token_ids=[[0]]) == [1] * 6
    assert run(bad_words_token_ids=[[0], [1]]) == [2] * 6
    assert run(bad_words_token_ids=[[0, 0]]) == [0, 1, 0, 1, 0, 1]
    assert run(allowed_token_ids=[9, 4, 12]) == [4] * 6
    assert run(allowed_token_ids=[9, 4, 12], bad_words_token_ids=[[4]]) == [9] * 6
    assert run(allowed_token_ids=[9, 4, 12], bad_words_token_ids=[[4, 4]]) == [4, 9] * 3


@pytest.mark.parametrize("kw", [{"top_k": 20}, {"top_k": 0, "top_p": 1.0}, {"top_k": 3, "top_p": 0.5},
                                {"top_k": 400}, {"min_p": 0.1}])
def test_sampled_draws_stay_in_the_allowed_set(kw):
    """Sampled rows (the top-k path with fewer allowed tokens than k, the full-vocabulary
    path, min_p) draw only allowed, non-banned tokens, whatever the logits favour."""
    V = 300
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(5)) * 2
    x[0, :50] += 10  # the likeliest tokens are all disallowed
    allowed = [60, 61, 62, 200]
    x[0, allowed] = 1.0  # ties: kept or dropped together by top-k, top-p and min_p
    p = SamplingParams(seed=7, allowed_token_ids=allowed, bad_words_token_ids=[[61]], **kw)
    gen = p.make_generator("cpu")
    h = TokenHistory([1], [])
    seen = {int(sample(x, [p], [gen], history=[h])[0]) for _ in range(60)}
    assert seen <= {60, 62, 200} and len(seen) >= 2, seen


def test_masks_come_before_min_tokens_logit_bias_and_penalties():
    """vLLM v1's order: a logit_bias (even +100) cannot bring back a masked token; an
    allowed token keeps its bias and penalties; min_tokens still masks stop ids inside
    the allowed set."""
    x = torch.zeros(1, 8)
    p = SamplingParams(temperature=0, allowed_token_ids=[2, 3, 4], logit_bias={0: 100, 3: 5},
                       bad_words_token_ids=[[4]], presence_penalty=1.0, min_tokens=1)
    got = adjust_logits(x, [p], [TokenHistory([1], [], {2})])
    want = [float("-inf"), float("-inf"), float("-inf"), 5.0, float("-inf"), float("-inf"), float("-inf"),
            float("-inf")]
    assert got[0].tolist() == want
    got = adjust_logits(x, [p], [TokenHistory([1], [3], {2})])  # one token out: 2 allowed again; 3 penalised
    assert got[0].tolist()[2:4] == [0.0, 4.0]


def test_rows_without_masks_keep_their_path(monkeypatch):
    """Params without the new fields do not adjust the logits (no copy, no history);
    the fields normalise to hashable tuples (allowed ids sorted, without repeats) and
    empty bad_words to None."""
    p = SamplingParams()
    assert (p.allowed_token_ids, p.bad_words, p.bad_words_token_ids) == (None, None, None)
    assert not p.adjusts_logits
    q = SamplingParams(allowed_token_ids=[np.int64(9), 2, 9], bad_words=["a", "b"],
                       bad_words_token_ids=[[1, 2], (3,)])
    assert q.allowed_token_ids == (2, 9) and q.bad_words == ("a", "b")
    assert q.bad_words_token_ids == ((1, 2), (3,)) and q.adjusts_logits
    assert hash(q) == hash(SamplingParams(allowed_token_ids=(2, 9), bad_words=("a", "b"),
                                          bad_words_token_ids=((1, 2), (3,))))
    assert SamplingParams(bad_words=[]).bad_words is None and not SamplingParams(bad_words=[]).adjusts_logits
    assert SamplingParams(allowed_token_ids=[1]).adjusts_logits and SamplingParams(bad_words=["x"]).adjusts_logits
    import flintc.sampling as S
    monkeypatch.setattr(S, "adjust_logits", lambda *a: pytest.fail("adjust_logits called"))
    sample(torch.zeros(1, 4), [p], [None])


@pytest.mark.parametrize("kw,match", [
    ({"allowed_token_ids": []}, "'allowed_token_ids' must not be empty"),
    ({"allowed_token_ids": [-1]}, "'allowed_token_ids': token id -1"),
    ({"allowed_token_ids": [True]}, "'allowed_token_ids': token id True"),
    ({"allowed_token_ids": [1.0]}, "'allowed_token_ids': token id 1.0"),
    ({"allowed_token_ids": "12"}, "'allowed_token_ids' must be a list"),
    ({"allowed_token_ids": 3}, "'allowed_token_ids' must be a list"),
    # iterable types with no items (a TypeError from torch / NumPy before)
    ({"allowed_token_ids": torch.tensor(3)}, "'allowed_token_ids' must be a list of token ids, got Tensor"),
    ({"allowed_token_ids": np.array(3)}, "'allowed_token_ids' must be a list of token ids, got ndarray"),
    ({"bad_words_token_ids": [torch.tensor(3)]}, "'bad_words_token_ids' must be a list of token ids"),
    ({"bad_words": "word"}, "'bad_words' must be a list of strings"),
    ({"bad_words": [3]}, "'bad_words': expected strings"),
    ({"bad_words_token_ids": [[]]}, "'bad_words_token_ids': each entry"),
    ({"bad_words_token_ids": [[1, -2]]}, "'bad_words_token_ids': each entry"),
    ({"bad_words_token_ids": [5]}, "'bad_words_token_ids' must be a list"),
])
def test_validation_names_the_field(kw, match):
    with pytest.raises(InputError, match=match):
        SamplingParams(**kw)


def test_sample_errors():
    """Ids outside the vocabulary, bad words not made into ids, and bad words of several
    tokens without a history are ValueErrors naming the cause."""
    x = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="allowed_token_ids: token id 8 is outside"):
        sample(x, [SamplingParams(temperature=0, allowed_token_ids=[1, 8])], [None])
    with pytest.raises(ValueError, match="bad_words: token id 9 is outside"):
        sample(x, [SamplingParams(temperature=0, bad_words_token_ids=[[9]])], [None], history=[TokenHistory([1])])
    with pytest.raises(ValueError, match="with_tokenizer"):
        sample(x, [SamplingParams(temperature=0, bad_words=["x"])], [None], history=[TokenHistory([1])])
    with pytest.raises(ValueError, match="TokenHistory"):
        sample(x, [SamplingParams(temperature=0, bad_words_token_ids=[[1, 2]])], [None])
    # allowed ids and one-token words need no history
    assert int(sample(x, [SamplingParams(temperature=0, allowed_token_ids=[5], bad_words_token_ids=[[1]])],
                      [None])[0]) == 5


# ---- words -> token ids -----------------------------------------------------------------------


class FakeTokenizer:
    """encode() from a table (add_special_tokens must be False), vocab_size 100."""

    vocab_size = 100
    table = {"foo": [10], " foo": [20], "bar baz": [1, 2], " bar baz": [3, 4, 5], "x": [7], " x": [7, 8],
             "same": [30, 31], " same": [30, 32], "y": [8], " y": [], "big": [100], " big": [100]}

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return list(self.table[text])


def test_bad_words_to_token_ids_is_vllms():
    """Each word (leading whitespace stripped) as it is, and after a space when that
    gives another first token and the same length; a word of no tokens is refused, an
    empty spaced form skipped; ids outside the vocabulary are refused."""
    tok = FakeTokenizer()
    assert bad_words_to_token_ids(["foo"], tok) == ((10,), (20,))
    assert bad_words_to_token_ids(["  foo"], tok) == ((10,), (20,))
    assert bad_words_to_token_ids(["bar baz"], tok) == ((1, 2),)  # the spaced form is longer
    assert bad_words_to_token_ids(["same"], tok) == ((30, 31),)  # the same first token
    assert bad_words_to_token_ids(["y", "x"], tok) == ((8,), (7,))
    assert bad_words_to_token_ids([], tok) is None
    with pytest.raises(InputError, match="'bad_words': '  ' makes no tokens"):
        bad_words_to_token_ids(["  "], types.SimpleNamespace(vocab_size=9, encode=lambda t, **k: []))
    with pytest.raises(InputError, match="'bad_words': token ids \\[100\\] are outside"):
        bad_words_to_token_ids(["big"], tok)
    p = SamplingParams(bad_words=["foo", "bar baz"])
    q = p.with_tokenizer(tok)
    assert q.bad_words_token_ids == ((10,), (20,), (1, 2)) and q.bad_words == p.bad_words
    assert q.with_tokenizer(tok) is q and SamplingParams().with_tokenizer(tok) == SamplingParams()


# ---- generation on the tiny model ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_bf16_dir):
    return checkpoint_model_and_tokenizer(tiny_bf16_dir)


def test_generate_with_masks(tiny):
    """The reference generate (generate_with_runner): allowed_token_ids keeps every
    token in the set (greedy and sampled); banning plain greedy's first token changes
    it and never lets it out; bad words given as text need a tokenizer (InputError);
    ids outside the vocabulary are InputErrors naming the field."""
    from flintc.model.generate import generate

    model, _ = tiny
    prompt = [1, 2, 3]
    plain = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    first = plain.output_ids[0][0]
    allowed = [40, 41, 300, 7]
    r = generate(model, [prompt, prompt], [SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed),
                                           SamplingParams(seed=3, max_tokens=8, allowed_token_ids=allowed)])
    assert all(t in allowed for out in r.output_ids for t in out), r.output_ids
    banned = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      bad_words_token_ids=[[first]]))
    assert first not in banned.output_ids[0] and banned.output_ids[0][0] != first
    with pytest.raises(InputError, match="'bad_words'.*tokenizer"):
        generate(model, [prompt], SamplingParams(temperature=0, bad_words=["the"]))
    with pytest.raises(InputError, match="'allowed_token_ids'.*512"):
        generate(model, [prompt], SamplingParams(temperature=0, allowed_token_ids=[1, 512]))
    with pytest.raises(InputError, match="'bad_words_token_ids'.*600"):
        generate(model, [prompt], SamplingParams(temperature=0, bad_words_token_ids=[[600]]))


def test_generate_refuses_allowed_tokens_the_other_masks_exclude(tiny):
    """allowed_token_ids whose every token min_tokens (the stop token held back) or
    bad_words exclude leave every logit -inf: the sampler then drew a token outside the
    set (token 0 greedily, another sampled) and generate returned it. It is an
    InputError naming allowed_token_ids (and the prompt, of several) and the mask."""
    from flintc.model.generate import generate

    model, tok = tiny
    eos = tok.eos_token_id
    for kw in ({"temperature": 0}, {"seed": 3}):
        with pytest.raises(InputError, match=rf"^sampling field 'allowed_token_ids': .*\({eos}\).*output token 0: "
                                             r"min_tokens"):
            generate(model, [[1, 2, 3]], SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[eos], **kw),
                     eos_token_id=eos)
    with pytest.raises(InputError, match=r"'allowed_token_ids' of prompt 1: .*\(5\).*bad_words"):
        generate(model, [[1, 2, 3], [4]], [SamplingParams(temperature=0, max_tokens=3),
                                           SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[5],
                                                          bad_words_token_ids=[[5]])], eos_token_id=eos)
    # the stop token allowed beside another: min_tokens holds it back, then it may end the output
    r = generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6, min_tokens=2,
                                                    allowed_token_ids=[eos, 40]), eos_token_id=eos)
    assert set(r.output_ids[0]) <= {eos, 40} and r.output_ids[0][:2] == [40, 40], r.output_ids


def test_compiled_model_generate_converts_bad_words(tiny):
    """`CompiledModel.generate` (here over the reference runner) makes bad words into
    ids with its tokenizer: the text of plain greedy's first tokens, as a bad word,
    keeps that token sequence out of the output."""
    from flintc.api import CompiledModel
    from flintc.runtime.runner import ReferenceRunner

    model, tok = tiny
    runner = ReferenceRunner(model, max_batch=2, max_model_len=64)
    runner.build, runner.manifest = None, {}
    m = CompiledModel(runner, tok)
    plain = m.generate([[1, 2, 3]], temperature=0, max_tokens=6, ignore_eos=True)
    word_ids = plain.output_ids[0][:2]
    word = tok.decode(word_ids)
    ids = bad_words_to_token_ids([word], tok)
    assert tuple(word_ids) in ids or tuple(tok.encode(word.lstrip())) in ids
    r = m.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=[word]))
    out = r.output_ids[0]
    for w in ids:
        assert not any(tuple(out[i:i + len(w)]) == w for i in range(len(out))), (w, out)
    assert out != plain.output_ids[0]
    r2 = m.generate([[1, 2, 3]], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 bad_words=[word])])
    assert r2.output_ids == r.output_ids


def test_with_max_tokens_copies_one_field():
    """`with_max_tokens` (a /v1/completions request whose prompts get different
    max_tokens) changes max_tokens alone, shares the walked lists, and refuses a smaller
    value (min_tokens was checked against the params' own)."""
    p = SamplingParams(max_tokens=4, min_tokens=3, allowed_token_ids=[5, 1, 5], seed=7)
    q = p.with_max_tokens(9)
    assert q.max_tokens == 9 and p.max_tokens == 4
    assert q == dataclasses.replace(p, max_tokens=9)
    assert q.allowed_token_ids is p.allowed_token_ids
    assert p.with_max_tokens(4) == p
    with pytest.raises(ValueError, match="below"):
        p.with_max_tokens(3)
