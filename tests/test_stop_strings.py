"""Stop strings, stop_token_ids and include_stop_str_in_output in the Python API
(`SamplingParams`, `flintc.model.generate.generate`, `generate_with_runner`,
`flintc.compile(...).generate`), with vLLM's semantics, on the tiny BF16 checkpoint.
The server's agreement: tests/serve/test_stop_strings_agree.py; `flintc run --stop`:
tests/cli/test_run.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flintc.errors import InputError
from flintc.sampling import SamplingParams
from flintc.stop_strings import StopStringText, stop_string_cut, stop_string_hold, stop_token_end

MAX = 24


@pytest.fixture(scope="module")
def tiny(tiny_bf16_dir):
    """(FlintModel, FlintTokenizer, a prompt's ids, the greedy output ids of MAX tokens
    with ignore_eos, their texts one by one)."""
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.checkpoint.tokenizer import load_tokenizer
    from flintc.model.generate import generate
    from flintc.model.reference import FlintModel

    ckpt = load_checkpoint(tiny_bf16_dir, progress=False)
    model, tok = FlintModel(ckpt.config, ckpt.weights), load_tokenizer(ckpt.tokenizer_dir)
    ids = tok.encode("Hello world")
    out = generate(model, [ids], SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True),
                   tokenizer=tok).output_ids[0]
    return model, tok, ids, out, [tok.decode([t]) for t in out]


def gen(tiny, prompts=None, **kw):
    from flintc.model.generate import generate

    model, tok, ids, _, _ = tiny
    params = kw.pop("params", None) or SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, **kw)
    return generate(model, prompts or [ids], params, eos_token_id=tok.eos_token_id, tokenizer=tok)


def _boundary(pieces, lo: int = 1) -> int:
    """The first token k >= lo whose text and the previous one's are both non-empty
    printable ASCII: a stop string pieces[k-1][-1] + pieces[k][0] spans the two."""
    ok = [p != "" and p.isascii() and p.isprintable() for p in pieces]
    return next(k for k in range(lo, len(pieces)) if ok[k - 1] and ok[k])


def test_a_stop_string_that_spans_tokens(tiny):
    """The text ends before the stop string (whose characters come from two tokens); the
    output ids end with the token that completed it, as vLLM's token_ids; "stop", and
    stop_reason the string. With include_stop_str_in_output the text ends after it, and
    the completing token's characters past the stop string are in neither."""
    _, tok, _, out, pieces = tiny
    k = _boundary(pieces, lo=2)
    stop = pieces[k - 1][-1] + pieces[k][0]
    before = "".join(pieces[:k - 1]) + pieces[k - 1][:-1]
    assert stop not in before + pieces[k - 1][-1]  # (the first occurrence is the one at k)
    r = gen(tiny, stop=stop)
    assert r.output_ids[0] == out[:k + 1] and r.finish_reasons == ["stop"] and r.stop_reasons == [stop]
    assert r.texts == [before] and r.stopped_by_token == [False]
    r = gen(tiny, stop=[stop], include_stop_str_in_output=True)
    assert r.texts == [before + stop] and r.output_ids[0] == out[:k + 1]
    # several stop strings: the earliest match wins, whatever the list's order
    later = "".join(pieces[k + 2:k + 4])
    r = gen(tiny, stop=[later, stop] if later else [stop])
    assert r.texts == [before] and r.stop_reasons == [stop]


def test_a_stop_string_in_the_first_token_and_min_tokens(tiny):
    """A stop string in the first token's text: one token out, empty text. With
    min_tokens, stop strings are looked for only once more than min_tokens tokens are out
    (vLLM's `len(output_token_ids) > min_tokens`): one that lies wholly in those tokens'
    text does not stop the sequence, a later one does."""
    _, tok, _, out, pieces = tiny
    first = pieces[0]
    assert first
    r = gen(tiny, stop=first)
    assert (r.output_ids[0], r.texts, r.finish_reasons) == (out[:1], [""], ["stop"])
    r = gen(tiny, stop=first, include_stop_str_in_output=True)
    assert r.texts == [first] and r.output_ids[0] == out[:1]
    k = _boundary(pieces, lo=4)
    later = pieces[k - 1][-1] + pieces[k][0]
    text = "".join(pieces)
    assert first not in text[len(first):]  # (it appears in the first token only)
    r = gen(tiny, stop=[first, later], min_tokens=3)
    at = text.index(later, len("".join(pieces[:3])) - len(later) + 1)
    assert r.stop_reasons == [later] and r.texts == [text[:at]] and r.output_ids[0] == out[:k + 1]
    r = gen(tiny, stop=first, min_tokens=3)
    assert r.finish_reasons == ["length"] and r.output_ids[0] == out and r.stop_reasons == [None]


def test_stop_token_ids_end_the_sequence_and_stay_in_the_ids(tiny):
    """stop_token_ids end the sequence even with ignore_eos (vLLM's ignore_eos ignores EOS
    alone); the id stays in output_ids and is the stop_reason; the text leaves its text
    out unless include_stop_str_in_output. min_tokens masks them (they cannot be drawn
    before), as it masks end-of-text."""
    _, tok, _, out, pieces = tiny
    k = 5
    r = gen(tiny, stop_token_ids=[out[k]])
    first = out.index(out[k])
    assert r.output_ids[0] == out[:first + 1] and r.finish_reasons == ["stop"] and r.stop_reasons == [out[k]]
    assert r.texts == [tok.decode(out[:first])] and r.stopped_by_token == [True]
    r = gen(tiny, stop_token_ids=[out[k]], include_stop_str_in_output=True)
    assert r.texts == [tok.decode(out[:first + 1])]
    r = gen(tiny, stop_token_ids=[out[0]], min_tokens=2)
    assert out[0] not in r.output_ids[0][:2]
    # end-of-text stops with stop_reason None (vLLM's); the text leaves it out
    eos = tok.eos_token_id
    r = gen(tiny, params=SamplingParams(temperature=0, max_tokens=6, logit_bias={eos: 100}, min_tokens=2))
    assert r.output_ids[0][2] == eos and r.stop_reasons == [None] and "<|endoftext|>" not in r.texts[0]
    r = gen(tiny, params=SamplingParams(temperature=0, max_tokens=6, logit_bias={eos: 100}, min_tokens=2,
                                        include_stop_str_in_output=True))
    assert r.texts[0].endswith("<|endoftext|>")


def test_each_prompt_has_its_own_stop_strings(tiny):
    """A batch (one SamplingParams per prompt, and more prompts than max_batch run in
    batches): each prompt ends at its own stop string, the others run on; the results
    are the ones each prompt gets alone."""
    from flintc.model.generate import generate

    model, tok, ids, out, pieces = tiny
    prompts = [ids, tok.encode("The quick brown fox"), ids]
    alone = [generate(model, [p], SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True), tokenizer=tok)
             for p in prompts[:2]]
    texts = [a.texts[0] for a in alone]
    stops = [texts[0][5:8], texts[1][3:5], None]
    params = [SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, stop=s) for s in stops]
    for max_batch in (None, 2):
        r = generate(model, prompts, params, tokenizer=tok, max_batch=max_batch)
        assert r.texts[0] == texts[0][:texts[0].index(stops[0])] and r.stop_reasons[:2] == stops[:2]
        assert r.texts[1] == texts[1][:texts[1].index(stops[1])]
        assert r.texts[2] == texts[0] and r.finish_reasons == ["stop", "stop", "length"]
        for i in range(2):
            one = generate(model, [prompts[i]], params[i], tokenizer=tok)
            assert (one.output_ids[0], one.texts[0]) == (r.output_ids[i], r.texts[i])
            assert len(r.output_ids[i]) < MAX


def test_seeded_sampling_with_stop_strings(tiny):
    """Sampled (seeded) tokens up to the stop are the same as without stop strings: they
    only cut the sequence."""
    from flintc.model.generate import generate

    model, tok, ids, _, _ = tiny
    free = generate(model, [ids], SamplingParams(seed=3, max_tokens=MAX, ignore_eos=True), tokenizer=tok)
    text = free.texts[0]
    stop = text[6:8]
    r = generate(model, [ids], SamplingParams(seed=3, max_tokens=MAX, ignore_eos=True, stop=stop), tokenizer=tok)
    assert r.texts[0] == text[:text.index(stop)]
    assert r.output_ids[0] == free.output_ids[0][:len(r.output_ids[0])]


@pytest.mark.parametrize("kw, needle", [
    (dict(stop=""), "sampling field 'stop' cannot contain an empty string (entry 0)"),
    (dict(stop=["a", ""]), "sampling field 'stop' cannot contain an empty string (entry 1)"),
    (dict(stop=["a", 5]), "sampling field 'stop': expected strings, got 5 (entry 1)"),
    (dict(stop=5), "sampling field 'stop' must be a string or a list of strings, got int"),
    (dict(stop=b"x"), "sampling field 'stop' must be a string or a list of strings, got bytes"),
    (dict(stop_token_ids=[1, -2]), "sampling field 'stop_token_ids': token id -2 is not an integer >= 0"),
    (dict(stop_token_ids=[1, True]), "sampling field 'stop_token_ids': token id True is not an integer >= 0"),
    (dict(stop_token_ids=[1.5]), "sampling field 'stop_token_ids': token id 1.5 is not an integer >= 0"),
    (dict(stop_token_ids="12"), "sampling field 'stop_token_ids' must be a list of token ids, got str"),
    (dict(include_stop_str_in_output="yes"), "sampling field 'include_stop_str_in_output' must be True or False"),
])
def test_bad_stop_fields_name_the_field(kw, needle):
    with pytest.raises(InputError) as e:
        SamplingParams(**kw)
    assert needle in str(e.value)


def test_stop_fields_are_normalised():
    import numpy as np

    p = SamplingParams(stop="ab", stop_token_ids=[np.int64(5), 3], include_stop_str_in_output=np.True_)
    assert p.stop == ("ab",) and p.stop_token_ids == (5, 3) and p.include_stop_str_in_output is True
    assert SamplingParams(stop=[], stop_token_ids=()).stop is None
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and hash(SamplingParams(stop=["a"]))
    assert not SamplingParams(stop=["a"], stop_token_ids=[1]).adjusts_logits  # nothing for the sampler


def test_generate_errors(tiny):
    """Stop strings without a tokenizer (they are matched in the text), and a stop token
    id outside the vocabulary, before any prompt runs, naming the field (and prompt)."""
    from flintc.model.generate import generate

    model, tok, ids, _, _ = tiny
    with pytest.raises(InputError, match="sampling field 'stop': stop strings are matched in the output text, "
                                         "which needs the model's tokenizer"):
        generate(model, [ids], SamplingParams(stop="x"))
    with pytest.raises(InputError, match="sampling field 'stop' of prompt 1: stop strings"):
        generate(model, [ids, ids], [SamplingParams(), SamplingParams(stop="x")])
    with pytest.raises(InputError, match=r"sampling field 'stop_token_ids': token id 512 is outside the "
                                         r"vocabulary \[0, 512\)"):
        generate(model, [ids], SamplingParams(stop_token_ids=[3, 512]), tokenizer=tok)
    # token ids alone: stop_token_ids work without a tokenizer (no texts then)
    r = generate(model, [ids], SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[tiny[3][2]]))
    assert r.output_ids[0] == tiny[3][:3] and r.texts is None and r.stop_reasons == [tiny[3][2]]


def test_the_shared_match():
    """`stop_string_cut` / `stop_string_hold` (the serving engine's) as vLLM's
    `check_stop_strings`: the first stop string in the given order that ends in the
    latest token's characters (not the earliest in the text); one that lies whole in
    older text is not matched (it was, after min_tokens, where its tail had been held
    back); a stream holds back the longest stop's length - 1 characters."""
    assert stop_string_cut("abcdef", ("de", "cd"), 6, False) == ("de", 3)  # list order
    assert stop_string_cut("abcdef", ("cd", "cde"), 6, True) == ("cd", 4)
    assert stop_string_cut("abcdef", ("ab",), 4, False) is None  # ends before the new "cdef"
    assert stop_string_cut("abcdef", ("cd",), 3, False) == ("cd", 2)  # ends in the new "def"
    assert stop_string_cut("abcdef", ("cd",), 2, False) is None  # whole in the older "abcd"
    assert stop_string_cut("abcdef", ("ef",), 0, False) is None  # no new characters
    # vLLM's stop_buffer_length: the longest stop's length - 1 (none with include)
    assert stop_string_hold("xxab", ("abc", "b!")) == 2 and stop_string_hold("xxab", ()) == 0
    assert stop_string_hold("x", ("abcd",)) == 1 and stop_string_hold("xxab", ("abc",), include=True) == 0
    assert stop_string_hold("x" * 4000, ("y" * 20000,)) == 4000

    class Detok:
        def push(self, t):
            return t

        def flush(self):
            return ""

    s = StopStringText(Detok(), ("abc",))
    assert [s.push(c, n, 0) for n, c in enumerate(["xa", "b", "cd"], 1)] == [False, False, True]
    assert (s.text, s.matched) == ("x", "abc")
    # a stop string whole in the first min_tokens tokens' text is never matched (vLLM)
    s = StopStringText(Detok(), ("aa",))
    assert [s.push(c, n, 2) for n, c in enumerate(["xa", "a", "b", "aa"], 1)] == [False, False, False, True]
    assert (s.text, s.matched) == ("xaab", "aa")


EOS, GEN, USER, OTHER = 0, 5, 7, 9  # end-of-text, a generation-config end id, the request's own, no stop
STOPS = frozenset({EOS, GEN, USER})


@pytest.mark.parametrize("tok, n_out, min_tokens, ignore_eos, user, grammar_ended, want", [
    # no stop token: never ends
    (OTHER, 3, 0, False, {USER}, False, (False, None)),
    (OTHER, 3, 0, True, {USER}, True, (False, None)),
    # end-of-text: None (check_stop tests eos_token_id first), even when the request lists it
    (EOS, 1, 0, False, {USER}, False, (True, None)),
    (EOS, 1, 0, False, {USER, EOS}, False, (True, None)),
    # ignore_eos: end-of-text goes on, unless the request's own ids list it (then its id)
    (EOS, 1, 0, True, {USER}, False, (False, None)),
    (EOS, 1, 0, True, {USER, EOS}, False, (True, EOS)),
    # a generation-config id: its id; with ignore_eos (update_from_generation_config leaves it out) no stop
    (GEN, 2, 0, False, {USER}, False, (True, GEN)),
    (GEN, 2, 0, True, {USER}, False, (False, None)),
    (GEN, 2, 0, True, {USER, GEN}, False, (True, GEN)),
    # the request's own id: its id, with or without ignore_eos
    (USER, 2, 0, False, {USER}, False, (True, USER)),
    (USER, 2, 0, True, {USER}, False, (True, USER)),
    # min_tokens: no stop token ends it before n_out reaches it (n_out counts this token)
    (EOS, 2, 3, False, {USER}, False, (False, None)),
    (USER, 2, 3, True, {USER}, False, (False, None)),
    (GEN, 3, 3, False, {USER}, False, (True, GEN)),
    (USER, 3, 3, True, {USER}, False, (True, USER)),
    # a stop token that ended the grammar: ends even with ignore_eos and before min_tokens
    (EOS, 1, 0, True, {USER}, True, (True, None)),
    (GEN, 1, 0, True, {USER}, True, (True, None)),
    (GEN, 1, 0, False, {USER}, True, (True, GEN)),
    (EOS, 1, 4, False, {USER}, True, (True, None)),
    (USER, 1, 4, True, {USER}, True, (True, USER)),
])
def test_stop_token_end(tok, n_out, min_tokens, ignore_eos, user, grammar_ended, want):
    """The one stop-token rule of the engine and `generate_with_runner`: vLLM's `check_stop`
    over the stop set `SamplingParams.update_from_generation_config` makes, plus the
    structured-output rule (a stop token that ended the grammar ends the sequence)."""
    assert stop_token_end(tok, n_out=n_out, min_tokens=min_tokens, ignore_eos=ignore_eos, stop_ids=STOPS | user,
                          user_stop_ids=frozenset(user), eos_token_id=EOS, grammar_ended=grammar_ended) == want


def test_stop_token_end_edges():
    """A request's own id missing from stop_ids still stops; no end-of-text id (None): every
    stop token reports its id."""
    kw = dict(n_out=1, min_tokens=0, ignore_eos=False, eos_token_id=EOS)
    assert stop_token_end(USER, stop_ids=frozenset(), user_stop_ids={USER}, **kw) == (True, USER)
    assert stop_token_end(GEN, stop_ids={GEN}, user_stop_ids=(), **kw) == (True, GEN)
    kw["eos_token_id"] = None
    assert stop_token_end(EOS, stop_ids={EOS}, user_stop_ids=(), **kw) == (True, EOS)


def test_generation_config_stop_tokens(tiny):
    """The generation config's <|user|> and <|observation|> (GLM's end ids besides
    <|endoftext|>, `generation_stop_token_ids`) end a sequence in the Python API with
    their id as stop_reason, as vLLM's `update_from_generation_config` adds them to every
    request's stop_token_ids; not with ignore_eos (vLLM leaves them out then) unless
    stop_token_ids names them; masked before min_tokens either way. Without a tokenizer
    none stop (token ids alone: `generation_stop_ids` gives them)."""
    from flintc.checkpoint.tokenizer import generation_stop_token_ids
    from flintc.model.generate import generate

    model, tok, ids, _, _ = tiny
    user, obs = tok.special_token_ids["<|user|>"], tok.special_token_ids["<|observation|>"]
    assert generation_stop_token_ids(tok) == {user, obs}
    for t in (user, obs):
        r = gen(tiny, params=SamplingParams(temperature=0, max_tokens=6, logit_bias={t: 100}, min_tokens=2))
        assert (r.output_ids[0][2:], r.finish_reasons, r.stop_reasons) == ([t], ["stop"], [t]), r
        assert tok.decode([t]) not in r.texts[0] and r.stopped_by_token == [True]
        assert t not in r.output_ids[0][:2]  # masked before min_tokens
        r = gen(tiny, params=SamplingParams(temperature=0, max_tokens=4, logit_bias={t: 100}, min_tokens=2,
                                            include_stop_str_in_output=True))
        assert r.texts[0].endswith(tok.decode([t])) and r.stop_reasons == [t]
        r = gen(tiny, params=SamplingParams(temperature=0, max_tokens=4, logit_bias={t: 100}, ignore_eos=True))
        assert (r.output_ids[0], r.finish_reasons, r.stop_reasons) == ([t] * 4, ["length"], [None])
        assert r.texts == [tok.decode([t]) * 4]  # not a stop: the token is text
        r = gen(tiny, params=SamplingParams(temperature=0, max_tokens=4, logit_bias={t: 100}, ignore_eos=True,
                                            stop_token_ids=[t]))
        assert (r.output_ids[0], r.finish_reasons, r.stop_reasons) == ([t], ["stop"], [t])
    p = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[user])
    assert generate(model, [ids], p).output_ids == [[user] * 3]  # no tokenizer: no generation config
    r = generate(model, [ids], p, generation_stop_ids=[user])
    assert (r.output_ids, r.stop_reasons) == ([[user]], [user])
    r = generate(model, [ids], p, tokenizer=tok, generation_stop_ids=())
    assert r.output_ids == [[user] * 3] and r.finish_reasons == ["length"]
    # a tokenizer and eos_token_id None (no end-of-text id): none of the generation config's
    # end ids either (as the end-of-text token, which then ends nothing), not half of vLLM's
    # stop set
    r = generate(model, [ids], p, tokenizer=tok, eos_token_id=None)
    assert r.output_ids == [[user] * 3] and r.finish_reasons == ["length"]
    r = generate(model, [ids], p, tokenizer=tok, eos_token_id=tok.eos_token_id)
    assert (r.output_ids, r.stop_reasons) == ([[user]], [user])
    with pytest.raises(InputError, match=r"generation_stop_ids: token id 512 is outside the vocabulary"):
        generate(model, [ids], p, generation_stop_ids=[512])


def test_tokenizer_alone_gives_every_model_stop_token(tiny):
    """`generate(..., tokenizer=tok)` without eos_token_id stops at every one of the model's
    stop tokens (`model_stop_token_ids(tok)`: <|endoftext|>, <|user|>, <|observation|>), as
    vLLM takes the end-of-text id from the tokenizer and adds the generation config's end
    ids; the reference `generate` and `generate_with_runner` alike; ignore_eos still runs
    past them all."""
    from flintc.checkpoint.tokenizer import model_stop_token_ids
    from flintc.model.generate import generate
    from flintc.runtime.generate import generate_with_runner
    from flintc.runtime.runner import ReferenceRunner

    model, tok, ids, _, _ = tiny
    stops = model_stop_token_ids(tok)
    assert stops[0] == tok.eos_token_id and len(stops) == 3
    runner = ReferenceRunner(model, max_batch=1, max_model_len=len(ids) + 4)
    for t in stops:
        p = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[t])
        for r in (generate(model, [ids], p, tokenizer=tok), generate_with_runner(runner, [ids], p, tokenizer=tok)):
            assert (r.output_ids, r.finish_reasons, r.texts) == ([[t]], ["stop"], [""]), (t, r)
            assert r.stop_reasons == [None if t == tok.eos_token_id else t]
        r = generate(model, [ids], SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[t],
                                                  ignore_eos=True), tokenizer=tok)
        assert (r.output_ids, r.finish_reasons) == ([[t] * 3], ["length"])
    # eos_token_id alone (token ids, no tokenizer) stops at it only: the generation config's
    # end ids come with the tokenizer or generation_stop_ids
    p = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[stops[2]])
    assert generate(model, [ids], p, eos_token_id=tok.eos_token_id).finish_reasons == ["length"]


def _stub_tokenizer(eos, **special):
    """A tokenizer as `generation_stop_token_ids` reads one: its special tokens' ids by text
    and its end-of-text id."""
    from types import SimpleNamespace

    return SimpleNamespace(eos_token_id=eos, special_token_ids=special)


def test_model_stop_token_ids():
    """vLLM's update_from_generation_config stop set, composed once for serve, run and
    `generate_with_runner`: end-of-text first, then the generation config's end ids less it,
    deduplicated, in increasing order; the tokenizer's end-of-text id by default; the
    tokenizer's generation-config ids only with an end-of-text id; never a None."""
    from flintc.checkpoint.tokenizer import model_stop_token_ids

    glm = {"<|endoftext|>": 5, "<|user|>": 9, "<|observation|>": 7, "<|assistant|>": 8}
    tok = _stub_tokenizer(5, **glm)
    assert model_stop_token_ids(tok) == (5, 7, 9)  # <|assistant|> is no end id
    assert model_stop_token_ids(tok, 5) == model_stop_token_ids(tok, eos_token_id=5) == (5, 7, 9)
    # another end-of-text id: first, and out of the generation ids (not twice)
    assert model_stop_token_ids(tok, 9) == (9, 7)
    # no end-of-text id: none of the tokenizer's generation-config ids either
    assert model_stop_token_ids(tok, None) == ()
    assert model_stop_token_ids(_stub_tokenizer(None, **glm)) == ()
    # no tokenizer: its end-of-text id alone, or nothing
    assert model_stop_token_ids(None) == () and model_stop_token_ids(None, 3) == (3,)
    # a tokenizer without the generation config's end tokens: its end-of-text id alone
    assert model_stop_token_ids(_stub_tokenizer(5, **{"<|endoftext|>": 5})) == (5,)
    assert model_stop_token_ids(_stub_tokenizer(0)) == (0,)  # id 0 is an id, not "none"
    # given generation ids: used as given, without the tokenizer's; deduplicated, sorted, less eos
    assert model_stop_token_ids(tok, 5, [11, 3, 11, 5]) == (5, 3, 11)
    assert model_stop_token_ids(tok, None, [11, 3, 11]) == (3, 11)  # even without end-of-text
    assert model_stop_token_ids(None, None, iter([4, 2])) == (2, 4)  # any iterable
    assert model_stop_token_ids(tok, 5, ()) == (5,)
    assert all(None not in model_stop_token_ids(t, *a) for t in (tok, None) for a in ((), (None,), (None, [1])))


def test_model_stop_token_ids_flint_tokenizer(tiny_bf16_dir):
    """Flint's tokenizer: <|endoftext|>, then <|user|> and <|observation|>
    (`generation_stop_token_ids`), the set `flintc serve` and `flintc run` stop at."""
    from flintc.checkpoint.tokenizer import generation_stop_token_ids, load_tokenizer, model_stop_token_ids

    tok = load_tokenizer(tiny_bf16_dir)
    user, obs = tok.special_token_ids["<|user|>"], tok.special_token_ids["<|observation|>"]
    stops = model_stop_token_ids(tok)
    assert stops == (tok.eos_token_id, *sorted({user, obs}))
    assert frozenset(stops) == frozenset({tok.eos_token_id}) | generation_stop_token_ids(tok)
    assert model_stop_token_ids(tok, tok.eos_token_id, generation_stop_token_ids(tok)) == stops


def test_python_api_compiled_build(tiny_bf16_dir, tmp_path):
    """`flintc.compile(...).generate` takes stop, stop_token_ids and
    include_stop_str_in_output as keywords or in `flintc.SamplingParams`: the output is
    the one without them, cut as vLLM cuts it; without a tokenizer stop strings are
    refused."""
    import flintc

    m = flintc.compile(tiny_bf16_dir, out=tmp_path / "b", check=False, dump=False, backend="torch",
                       max_batch=2, max_model_len=64)
    tok = m.tokenizer
    ids = tok.encode("Hello world")
    free = m.generate([ids], temperature=0, max_tokens=MAX, ignore_eos=True)
    out = free.output_ids[0]
    pieces = [tok.decode([t]) for t in out]
    k = _boundary(pieces, lo=2)
    stop = pieces[k - 1][-1] + pieces[k][0]
    before = free.texts[0][:free.texts[0].index(stop)]
    r = m.generate([ids], temperature=0, max_tokens=MAX, ignore_eos=True, stop=stop)
    assert (r.texts, r.output_ids, r.finish_reasons, r.stop_reasons) == ([before], [out[:k + 1]], ["stop"], [stop])
    r = m.generate([ids, ids], [flintc.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True),
                                flintc.SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[out[3]])])
    assert r.texts[0] == before + stop and r.output_ids[1] == out[:out.index(out[3]) + 1]
    assert r.stop_reasons == [stop, out[3]] and r.texts[1] == tok.decode(r.output_ids[1][:-1])
    # the generation config's <|user|> ends it (its id the stop_reason), unless ignore_eos
    user = tok.special_token_ids["<|user|>"]
    r = m.generate([ids], temperature=0, max_tokens=3, logit_bias={user: 100})
    assert (r.output_ids, r.finish_reasons, r.stop_reasons, r.texts) == ([[user]], ["stop"], [user], [""])
    r = m.generate([ids], temperature=0, max_tokens=3, logit_bias={user: 100}, ignore_eos=True)
    assert (r.output_ids, r.finish_reasons, r.stop_reasons) == ([[user] * 3], ["length"], [None])
    m.tokenizer = None
    with pytest.raises(InputError, match="sampling field 'stop': stop strings"):
        m.generate([ids], stop="x")


def test_top_level_exports_stay_lazy():
    """`from flintc import SamplingParams, StructuredOutputsParams` (as `from vllm import
    SamplingParams`) are flintc.sampling's classes; `import flintc` alone still does not
    import torch."""
    import flintc
    import flintc.sampling

    assert flintc.SamplingParams is flintc.sampling.SamplingParams
    assert flintc.StructuredOutputsParams is flintc.sampling.StructuredOutputsParams
    assert {"SamplingParams", "StructuredOutputsParams"} <= set(dir(flintc))
    code = ("import sys, flintc; assert 'torch' not in sys.modules; from flintc import SamplingParams; "
            "assert 'torch' in sys.modules; assert SamplingParams(stop='x').stop == ('x',)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_stop_strings_never_match_inside_special_tokens(tiny):
    """Stop strings are matched on the text without the special tokens' strings, as
    `flintc serve` matches them by default and vLLM's LLM.generate (skip_special_tokens,
    default true): "user" never matches in "<|user|>" (the output runs to length, stop_reason
    None, as the server's), while a stop string that spans a special token in the visible
    text matches, the text (which keeps the special tokens' strings) cut before it."""
    from flintc.stop_strings import StopStringText

    model, tok, ids, _, _ = tiny
    user = tok.special_token_ids["<|user|>"]
    for stop in (["user"], ["<|"], ["<|user|>"], ["|>"]):
        r = gen(tiny, params=SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[user], ignore_eos=True,
                                            stop=stop))
        assert (r.output_ids, r.finish_reasons, r.stop_reasons) == ([[user] * 3], ["length"], [None]), (stop, r)
        assert r.texts == ["<|user|>" * 3]  # the texts keep them (tokenizer.decode's)
    a, b = tok.encode("ab"), tok.encode("cd")
    t = StopStringText(tok.detokenizer(), ["bc"], specials=tok.special_strings())
    assert not any(t.push(x, n, 0) for n, x in enumerate(a + [user], 1))
    assert t.push(b[0], len(a) + 2, 0) and (t.matched, t.text) == ("bc", "a")
    t = StopStringText(tok.detokenizer(), ["bc"], include=True, specials=tok.special_strings())
    for n, x in enumerate(a + [user] + b, 1):
        if t.push(x, n, 0):
            break
    assert (t.matched, t.text) == ("bc", "ab<|user|>c")
    # without specials (the whole text): the old match, inside the special token
    t = StopStringText(tok.detokenizer(), ["user"])
    assert t.push(user, 1, 0) and t.text == "<|"
