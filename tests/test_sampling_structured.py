"""Structured outputs (vLLM's `StructuredOutputsParams`, on llguidance:
`flintc.sampling.StructuredOutputsParams`, `flintc.structured`) on the CPU: the spec's
validation (one kind, types, llguidance's messages for a bad schema / regex / grammar),
the per-sequence matcher's mask (the stop tokens only where the grammar accepts), and
generation on the tiny random model (the reference `generate` and
`CompiledModel.generate`): its outputs are random text, so an output that matches the
regex / choice / schema is a real check, and the same seed without the constraint gives
one that does not (the mask is what makes it conform)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flintc.errors import InputError
from flintc.sampling import SamplingParams, StructuredOutputsParams, TokenHistory, adjust_logits, sample
from harness import checkpoint_model_and_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def tiny(tiny_bf16_dir):
    return checkpoint_model_and_tokenizer(tiny_bf16_dir)


# ---- the spec ---------------------------------------------------------------------------------


def test_spec_kinds_and_normalisation():
    s = StructuredOutputsParams(json=SCHEMA)
    assert s.kind == "json" and json.loads(s.json) == SCHEMA and list(json.loads(s.json)) == list(SCHEMA)
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)) == s  # text or dict: the same spec
    assert StructuredOutputsParams(choice=["yes", "no"]).choice == ("yes", "no")
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(regex="[ab]{3}").kind == "regex"
    assert StructuredOutputsParams(grammar='start: "x" /[0-9]/').kind == "grammar"
    p = SamplingParams(structured_outputs={"regex": "a+", "disable_any_whitespace": True})
    assert p.structured_outputs == StructuredOutputsParams(regex="a+", disable_any_whitespace=True)
    assert p.adjusts_logits and hash(p) == hash(SamplingParams(structured_outputs=p.structured_outputs))
    assert p.with_max_tokens(40).structured_outputs is p.structured_outputs


@pytest.mark.parametrize("kw, match", [
    ({}, "give one of json, regex, choice, grammar, json_object"),
    ({"json_object": False}, "give one of"),
    ({"regex": "a", "choice": ["a"]}, "only use one kind of structured outputs constraint.*regex, choice"),
    ({"json": {"type": "object"}, "json_object": True}, "only use one kind"),
    ({"regex": "[a"}, "field 'regex':.*unclosed character class"),
    ({"json": {"type": 5}}, "field 'json':.*type must be a string"),
    ({"json": "{not json"}, "field 'json': not valid JSON"),
    ({"json": "[1]"}, "field 'json': a JSON schema must be an object"),
    ({"json": 5}, "field 'json': expected a JSON schema"),
    ({"grammar": "start: foo"}, "field 'grammar':.*unknown name"),
    ({"choice": []}, "field 'choice': must not be empty"),
    ({"choice": "yes"}, "field 'choice': expected a list of strings"),
    ({"choice": ["a", 1]}, "field 'choice': expected strings, got 1"),
    ({"regex": 3}, "field 'regex': expected a string"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "field 'disable_any_whitespace': expected true or false"),
    ({"json": "false"}, "field 'json': the schema false accepts no value"),
])
def test_spec_errors_name_the_field(kw, match):
    with pytest.raises(InputError, match="(?s)" + match):
        StructuredOutputsParams(**kw)


def test_sampling_params_errors_name_structured_outputs():
    with pytest.raises(InputError, match="sampling field 'structured_outputs'.*field 'regex'"):
        SamplingParams(structured_outputs={"regex": "[a"})
    with pytest.raises(InputError, match="sampling field 'structured_outputs'.*'bogus' is not supported"):
        SamplingParams(structured_outputs={"bogus": "{}"})
    with pytest.raises(InputError, match="sampling field 'structured_outputs' must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")


# ---- the matcher and the mask -----------------------------------------------------------------


def test_mask_allows_grammar_prefixes_and_stops_only_when_accepting(tiny):
    from flintc.structured import GrammarMatcher

    _, tok = tiny
    stops = {tok.eos_token_id, tok.special_token_ids["<|user|>"]}
    g = GrammarMatcher(StructuredOutputsParams(regex="a+b?"), tok, stops)
    V = 512
    allowed = torch.nonzero(g.allowed(V, "cpu")).flatten().tolist()
    assert allowed and all(re.fullmatch(r"a+b?", tok.decode([t])) for t in allowed), allowed
    assert not stops & set(allowed)  # nothing yet: not accepting
    a = tok.encode("a")
    assert len(a) == 1 and a[0] in allowed
    out = [a[0]]
    g.advance(out)
    allowed = set(torch.nonzero(g.allowed(V, "cpu")).flatten().tolist())
    assert stops <= allowed and not g.finished  # "a" matches; more may follow
    assert all(t in stops or re.fullmatch(r"a*b?", tok.decode([t])) for t in allowed)
    out.append(tok.encode("b")[0])
    g.advance(out)
    assert g.finished and set(torch.nonzero(g.allowed(V, "cpu")).flatten().tolist()) == stops
    # a stop token drawn where the grammar accepts ends it
    g2 = GrammarMatcher(StructuredOutputsParams(regex="a+b?"), tok, stops)
    g2.advance([a[0], tok.eos_token_id])
    assert g2.finished and g2.ended


def test_matcher_refusing_a_token_raises(tiny):
    from flintc.structured import GrammarMatcher, StructuredOutputError

    _, tok = tiny
    g = GrammarMatcher(StructuredOutputsParams(choice=["yes", "no"]), tok, {tok.eos_token_id})
    with pytest.raises(StructuredOutputError, match="refused generated token"):
        g.advance(tok.encode("maybe"))


def test_adjust_logits_masks_and_needs_the_grammar(tiny):
    from flintc.structured import GrammarMatcher

    _, tok = tiny
    spec = StructuredOutputsParams(choice=["yes", "no"])
    p = SamplingParams(temperature=0, structured_outputs=spec)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(0))
    h = TokenHistory([1], [], {tok.eos_token_id}, grammar=GrammarMatcher(spec, tok, {tok.eos_token_id}))
    got = adjust_logits(x, [p], [h])
    kept = torch.isfinite(got[0]).nonzero().flatten().tolist()
    assert {tok.decode([t]) for t in kept} <= {"y", "ye", "yes", "n", "no"} and kept
    assert torch.equal(got[0, kept], x[0, kept])  # the kept logits as they were; x untouched
    with pytest.raises(ValueError, match="row 0 has structured_outputs.*grammar"):
        sample(x, [p], [None], history=[TokenHistory([1], [])])
    with pytest.raises(ValueError, match="row 0 has structured_outputs"):
        sample(x, [p], [None])


# ---- generation on the tiny model ------------------------------------------------------------


def _gen(tiny, prompts, params, **kw):
    from flintc.model.generate import generate

    model, tok = tiny
    ids = [tok.encode(p) for p in prompts]
    r = generate(model, ids, params, eos_token_id=tok.eos_token_id, tokenizer=tok, **kw)
    return r, [tok.decode(r.text_ids(i)) for i in range(len(ids))]


@pytest.mark.parametrize("so, pattern", [
    ({"regex": "[ab]{3}"}, r"[ab]{3}"),
    ({"choice": ["yes", "no"]}, r"yes|no"),
    ({"grammar": 'start: "x" NUM\nNUM: /[0-9]{2}/'}, r"x[0-9]{2}"),
])
def test_generate_conforms_greedy_and_seeded(tiny, so, pattern):
    """Greedy and three seeds, in one batch: each output matches exactly and stops with
    "stop" (the grammar complete, its last token the output's last); the same seeds
    without the constraint give text that does not match."""
    seeds = [None, 1, 2, 3]
    params = [SamplingParams(temperature=0 if s is None else 1.0, seed=s, max_tokens=12, structured_outputs=so)
              for s in seeds]
    r, texts = _gen(tiny, ["Answer:"] * 4, params)
    assert r.finish_reasons == ["stop"] * 4, (r.finish_reasons, texts)
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert r.stopped_by_token == [False] * 4
    _, free = _gen(tiny, ["Answer:"] * 4, [SamplingParams(temperature=0 if s is None else 1.0, seed=s, max_tokens=12)
                                          for s in seeds])
    assert not any(re.fullmatch(pattern, t) for t in free), free  # the mask makes them conform


def test_generate_json_schema_and_json_object(tiny):
    """A JSON schema (no whitespace: the random model would write it forever) over
    four seeds: each output parses and has the required keys with their types. Any JSON
    object, with a logit_bias towards '"' and '}' (else the random model writes one
    endless string): each parses to a dict; the same params without the constraint give
    no JSON."""
    _, tok = tiny
    seeds = list(range(4))
    ps = [SamplingParams(seed=s, max_tokens=30, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
          for s in seeds]
    r, texts = _gen(tiny, ["Reply in JSON:"] * 4, ps)
    assert r.finish_reasons == ["stop"] * 4, texts
    for t in texts:
        obj = json.loads(t)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and type(obj["n"]) is int \
            and 0 <= obj["n"] <= 99, t
    bias = {tok.encode('"')[0]: 8.0, tok.encode("}")[0]: 8.0}
    so = {"json_object": True, "disable_any_whitespace": True}
    r, texts = _gen(tiny, ["Reply in JSON:"] * 4, [SamplingParams(seed=s, max_tokens=32, logit_bias=bias,
                                                                  structured_outputs=so) for s in seeds])
    assert r.finish_reasons == ["stop"] * 4, texts
    assert all(isinstance(json.loads(t), dict) for t in texts), texts
    _, free = _gen(tiny, ["Reply in JSON:"] * 4, [SamplingParams(seed=s, max_tokens=32, logit_bias=bias)
                                                  for s in seeds])
    for t in free:
        with pytest.raises(ValueError):
            json.loads(t)


def test_generate_stop_token_ends_an_accepting_grammar(tiny):
    """regex '(ab)+': the grammar accepts after each 'ab' and never completes on its
    own, so a sequence ends only by the end-of-text token, allowed there (dropped from
    the text), or by max_tokens; the step logits are the model's own (the mask works on
    a copy)."""
    so = {"regex": "(ab)+"}
    ps = [SamplingParams(seed=s, max_tokens=20, structured_outputs=so) for s in range(6)]
    r, texts = _gen(tiny, ["x"] * 6, ps, keep_step_logits=True)
    for t, f, by_token in zip(texts, r.finish_reasons, r.stopped_by_token):
        assert f in ("stop", "length") and re.fullmatch(r"(ab)+" if f == "stop" else r"(ab)*a?", t), (t, f)
        assert by_token == (f == "stop")  # (ab)+ never completes on its own
    assert all(torch.isfinite(s).all() for s in r.step_logits)


def test_generate_needs_the_tokenizer_and_compiled_model_passes_it(tiny):
    from flintc.api import CompiledModel
    from flintc.model.generate import generate
    from flintc.runtime.runner import ReferenceRunner

    model, tok = tiny
    p = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]})
    with pytest.raises(InputError, match="'structured_outputs'.*need the model's tokenizer"):
        generate(model, [[1, 2, 3]], p)
    runner = ReferenceRunner(model, max_batch=2, max_model_len=64)
    runner.build, runner.manifest = None, {}
    m = CompiledModel(runner, tok)
    r = m.generate(["Answer:", "Answer:"], [p, SamplingParams(seed=5, max_tokens=8,
                                                              structured_outputs={"regex": "[0-9]{4}"})])
    assert r.finish_reasons == ["stop", "stop"] and r.texts[0] in ("yes", "no") \
        and re.fullmatch(r"[0-9]{4}", r.texts[1]), r.texts


# ---- review fixes -----------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{"allowed_token_ids": [5, 6]}, {"bad_words_token_ids": None}])
def test_masks_leaving_no_grammar_token_say_so(tiny, extra):
    """allowed_token_ids (or bad words) that exclude every token the grammar allows next
    leave the row all -inf: the sampler draws an unspecified token, which the grammar
    refuses. The error says why (no token was left to draw, and which masks can do
    that), not only llguidance's parser message about an arbitrary token."""
    from flintc.structured import StructuredOutputError

    _, tok = tiny
    if "bad_words_token_ids" in extra:  # every token 'yes' / 'no' can start with
        extra = {"bad_words_token_ids": [[t] for t in range(512) if tok.decode([t]) and
                                          ("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])))]}
    p = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]}, **extra)
    with pytest.raises(StructuredOutputError, match="(?s)refused generated token.*no token the grammar allows "
                                                     "next was left.*allowed_token_ids.*bad_words"):
        _gen(tiny, ["Answer:"], [p])


@pytest.mark.parametrize("text, needle", [
    ("<|user|>", r"special token '<\|user\|>', id (\d+), .*write the token itself, <\[\1\]>"),
    ("<|endoftext|>", r"end-of-text token '<\|endoftext\|>' \(id \d+\) in the output: it ends the output"),
])
def test_a_special_tokens_text_in_the_grammar_says_so(tiny, text, needle):
    """A choice (or regex, ...) that spells out a special token's text: llguidance's mask
    offers only that token (the end-of-text token: nothing, as it ends the output), then
    refuses it. The error said no token was left "by allowed_token_ids, bad_words,
    min_tokens ... or NaN logits", none of which the request had; it names the token."""
    from flintc.structured import StructuredOutputError

    p = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": [text]})
    with pytest.raises(StructuredOutputError, match=needle) as info:
        _gen(tiny, ["Answer:"], [p])
    assert "allowed_token_ids" not in str(info.value)
    # a Lark grammar that names the (non end-of-text) token itself is followed
    if text == "<|user|>":
        _, tok = tiny
        tid = tok.encode(text)[0]
        p = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"grammar": f'start: "a" <[{tid}]>'})
        r, _ = _gen(tiny, ["Answer:"], [p])
        assert r.finish_reasons == ["stop"] and r.output_ids[0][-1] == tid, r


@pytest.mark.parametrize("kw", [{"json": "deep"}, {"json": "deep-dict"}])
def test_a_too_deeply_nested_schema_is_an_input_error(kw):
    """A schema nested deeper than Python's JSON encoder recurses (5000 arrays) was a
    RecursionError out of StructuredOutputsParams (a 500 in the server), not the
    InputError naming the field that a schema nested 500 deep gets (llguidance's
    limit)."""
    s = {"type": "integer"}
    for _ in range(5000):
        s = {"type": "array", "items": s}
    value = s if kw["json"] == "deep-dict" else None
    if value is None:  # the JSON text, built without recursion
        value = '{"type": "array", "items": ' * 5000 + '{"type": "integer"}' + "}" * 5000
    with pytest.raises(InputError, match="field 'json': .*nested"):
        StructuredOutputsParams(json=value)


def test_reasoning_gate_holds_the_grammar_back_until_the_thinking_ends(tiny):
    """`ReasoningGate`: "start" allows the grammar's first tokens and '<think>'; after
    '<think>' nothing is masked (allowed() is None) and no token is fed, until
    '</think>', after which the grammar holds (its first mask again) and completes;
    "reasoning" waits for '</think>' from the first token; "content" is no gate. A first
    token other than '<think>' under "start" is the grammar's."""
    from flintc.structured import GrammarMatcher, ReasoningGate

    _, tok = tiny
    start, end = tok.special_token_ids["<think>"], tok.special_token_ids["</think>"]
    spec = StructuredOutputsParams(choice=["yes", "no"])
    V = tok.vocab_size
    plain = GrammarMatcher(spec, tok, [tok.eos_token_id])
    first = plain.allowed(V, "cpu")
    assert not first[start] and first.any()

    g = GrammarMatcher(spec, tok, [tok.eos_token_id], reasoning=ReasoningGate("start", start, end))
    mask = g.allowed(V, "cpu")
    assert mask[start] and torch.equal(mask.clone().index_fill_(0, torch.tensor([start]), False), first)
    out = [start] + tok.encode("some thoughts, yes or no")
    g.advance(out)
    assert g.allowed(V, "cpu") is None and not g.finished
    out.append(end)
    g.advance(out)
    assert torch.equal(g.allowed(V, "cpu"), first) and not g.finished
    out += tok.encode("yes")
    g.advance(out)
    assert g.finished

    g = GrammarMatcher(spec, tok, [tok.eos_token_id], reasoning=ReasoningGate("reasoning", start, end))
    assert g.allowed(V, "cpu") is None
    g.advance(tok.encode("no") + [end])
    assert torch.equal(g.allowed(V, "cpu"), first)

    g = GrammarMatcher(spec, tok, [tok.eos_token_id], reasoning=ReasoningGate("start", start, end))
    g.advance(tok.encode("no"))  # no thinking block: the grammar from the first token
    assert g.finished
    g = GrammarMatcher(spec, tok, [tok.eos_token_id], reasoning=ReasoningGate("content", start, end))
    assert torch.equal(g.allowed(V, "cpu"), first)
    with pytest.raises(ValueError, match="ReasoningGate.state"):
        ReasoningGate("thinking", start, end)


def test_boolean_schema_true_is_any_json_value(tiny):
    """JSON Schema's boolean schema `true` (as JSON text: vLLM's guided_json "true")
    accepts any JSON value, as the empty schema {} does (llguidance refused it, with
    "Expecting object schema to apply options"); `false` is a 400-style InputError."""
    assert StructuredOutputsParams(json="true").kind == "json"
    ps = [SamplingParams(seed=s, max_tokens=40, structured_outputs={"json": "true", "disable_any_whitespace": True})
          for s in range(4)]
    r, texts = _gen(tiny, ["Reply in JSON:"] * 4, ps)
    for t, why in zip(texts, r.finish_reasons):
        if why == "stop":
            json.loads(t)
    assert "stop" in r.finish_reasons, (texts, r.finish_reasons)
