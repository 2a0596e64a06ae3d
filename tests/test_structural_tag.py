"""vLLM's structural tag (`StructuredOutputsParams.structural_tag`, on llguidance's
`StructTag` as vLLM's guidance backend builds it: `flintc.structured.parse_structural_tag`)
on the CPU: the spec's shape and errors (naming the field and the structure), the
per-sequence matcher's mask at each state (free text with the stop tokens allowed; after
a trigger only the begin, then JSON the schema accepts, then the end, the stop tokens
refused in between; free text again after the end; a trigger written <...> as a special
token), and generation on the tiny random model, driven into the trigger by a logit_bias:
every structure it writes is complete and schema-valid, which the same seed without the
constraint does not give."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flintc.errors import InputError
from flintc.sampling import SamplingParams, StructuredOutputsParams
from harness import checkpoint_model_and_tokenizer

ADD = {"type": "object", "required": ["n"], "additionalProperties": False,
       "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
NEG = {"type": "object", "required": ["ok"], "additionalProperties": False, "properties": {"ok": {"type": "boolean"}}}
TAG = {"type": "structural_tag",
       "structures": [{"begin": "<fn=add>", "schema": ADD, "end": "</fn>"},
                      {"begin": "<fn=neg>", "schema": NEG, "end": "</fn>"}],
       "triggers": ["<fn"]}


@pytest.fixture(scope="module")
def tiny(tiny_bf16_dir):
    return checkpoint_model_and_tokenizer(tiny_bf16_dir)


# ---- the spec ---------------------------------------------------------------------------------


def test_spec_takes_the_object_or_its_json_text():
    s = StructuredOutputsParams(structural_tag=TAG)
    assert s.kind == "structural_tag" and json.loads(s.structural_tag) == TAG
    assert StructuredOutputsParams(structural_tag=json.dumps(TAG)) == s
    text = json.dumps({k: v for k, v in TAG.items() if k != "type"}, indent=1)  # "type" may be left out
    assert StructuredOutputsParams(structural_tag=text).structural_tag == text  # the text as given
    p = SamplingParams(structured_outputs={"structural_tag": TAG, "disable_any_whitespace": True})
    assert p.structured_outputs.kind == "structural_tag" and p.structured_outputs.disable_any_whitespace
    # the structural tag's grammar is llguidance's StructTag's (vLLM's): free text, a lazy trigger
    from flintc.structured import grammar_text

    g = grammar_text(s)
    assert 'tag_0_trig[lazy]: TAG_TEXT "<fn"' in g and '"=add>" %json' in g and '"</fn>"' in g


def _tag(structures, triggers=("<",)):
    return {"structures": structures, "triggers": list(triggers) if isinstance(triggers, tuple) else triggers}


@pytest.mark.parametrize("value, match", [
    ("{nope", "not valid JSON"),
    ("[1]", "expected an object"),
    (5, "expected the structural tag's JSON text"),
    ({"triggers": ["<"]}, "missing 'structures'"),
    ({"structures": [{"begin": "<a", "schema": {}, "end": ""}]}, "missing 'triggers'"),
    (_tag([]), r"no structures \(vLLM: \"No structural tags found"),
    (_tag([{"begin": "a", "schema": {}, "end": ""}]),
     r"structures\[0\]\.begin \"a\" starts with none of the triggers \[\"<\"\] \(vLLM: \"Trigger a not found"),
    (_tag([{"begin": "<a", "schema": {}, "end": ""}], triggers=[""]), r"triggers\[0\] must be a non-empty"),
    (_tag([{"begin": "<a", "schema": {}, "end": ""}], triggers="<"), "'triggers' must be a list"),
    (_tag([{"begin": "<a", "end": ""}]), r"structures\[0\]\.schema must be a JSON schema .*got nothing"),
    (_tag([{"begin": "<a", "schema": {}}]), r"structures\[0\]\.end must be a string, got nothing"),
    (_tag([{"begin": "<a", "schema": {}, "end": ""}, {"begin": "<b", "schema": {"type": 5}, "end": ""}]),
     r"structures\[1\]\.schema: type must be a string"),
    (_tag([{"begin": "<a", "schema": False, "end": ""}]), r"structures\[0\]\.schema: the schema false"),
    (_tag([{"begin": "<a", "schema": {}, "end": "", "name": "x"}]), r"structures\[0\]: unknown key 'name'"),
    ({"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}, "xgrammar's structural tag"),
    ({**_tag([{"begin": "<a", "schema": {}, "end": ""}]), "type": "json_schema"}, "'type' must be"),
])
def test_spec_errors_name_the_field(value, match):
    with pytest.raises(InputError, match="structured_outputs field 'structural_tag': .*" + match):
        StructuredOutputsParams(structural_tag=value)


def test_one_kind_only_and_sampling_params_name_the_field():
    with pytest.raises(InputError, match="only use one kind .*regex, structural_tag"):
        StructuredOutputsParams(regex="a", structural_tag=TAG)
    with pytest.raises(InputError, match="give one of json, regex, choice, grammar, json_object, structural_tag"):
        StructuredOutputsParams()
    with pytest.raises(InputError, match="sampling field 'structured_outputs'.*field 'structural_tag'"):
        SamplingParams(structured_outputs={"structural_tag": "{}"})


def test_tokenizer_errors_at_compile(tiny):
    """What needs the tokenizer is checked when the grammar is compiled for it (the
    server does so before it answers): a trigger written <...> is a special token
    (llguidance's StructTag, as vLLM's), one the tokenizer lacks is an error with a hint;
    a begin or end that spells out a special token's text is refused (llguidance would
    offer it only as the token, then refuse it as the sequence runs), and so is the
    end-of-text token as a trigger."""
    from flintc.structured import compiled_matcher

    _, tok = tiny
    spec = StructuredOutputsParams(structural_tag=_tag([{"begin": "<fn>", "schema": {}, "end": ""}], ["<fn>"]))
    with pytest.raises(InputError, match="field 'structural_tag': .*unknown special token: \"<fn>\" \\(llguidance's "
                                         "StructTag reads a trigger written <...> as a special token"):
        compiled_matcher(spec, tok)
    spec = StructuredOutputsParams(structural_tag=_tag(
        [{"begin": "<tool_call>", "schema": {}, "end": "</tool_call>"}], ["<tool_call>"]))
    with pytest.raises(InputError, match=r"structures\[0\]\.end '</tool_call>' holds the special token "
                                         r"'</tool_call>' \(id 507\) as text"):
        compiled_matcher(spec, tok)
    # the end-of-text token as a trigger: drawing it ends the output, no structure follows
    # (it was taken, and the output ended at once with "stop")
    spec = StructuredOutputsParams(structural_tag=_tag(
        [{"begin": "<|endoftext|>f", "schema": {}, "end": ""}], ["<|endoftext|>"]))
    with pytest.raises(InputError, match=r"triggers\[0\] '<\|endoftext\|>' is the end-of-text token \(id "
                                         rf"{tok.eos_token_id}\), which ends the output"):
        compiled_matcher(spec, tok)


# ---- the matcher and the mask -----------------------------------------------------------------


def _allowed(g, V):
    return set(torch.nonzero(g.allowed(V, "cpu")).flatten().tolist())


def test_mask_free_text_then_begin_json_end(tiny):
    """Free text: most of the vocabulary, the stop tokens included (the grammar accepts);
    after the trigger '<fn' only tokens of '=add>' / '=neg>'; after '<fn=add>' only the
    schema's JSON ('{' first; no whitespace with disable_any_whitespace), no stop token;
    after the JSON's closing brace only the end's '<' (and its prefixes); after the end
    free text and the stop tokens again."""
    from flintc.structured import GrammarMatcher

    _, tok = tiny
    V = tok.vocab_size
    stops = {tok.eos_token_id, tok.special_token_ids["<|user|>"]}
    spec = StructuredOutputsParams(structural_tag=TAG, disable_any_whitespace=True)
    g = GrammarMatcher(spec, tok, stops)
    free = _allowed(g, V)
    assert stops <= free and len(free) > 400, len(free)
    out = tok.encode("Hello <fn")
    g.advance(out)
    nxt = _allowed(g, V)
    assert nxt and all("=add>".startswith(tok.decode([t])) or "=neg>".startswith(tok.decode([t])) for t in nxt), \
        [tok.decode([t]) for t in nxt]
    out += tok.encode("=add>")
    g.advance(out)
    nxt = _allowed(g, V)
    assert nxt and not stops & nxt and all(tok.decode([t]).startswith("{") for t in nxt), \
        [tok.decode([t]) for t in nxt]
    out += tok.encode('{"n":')
    g.advance(out)
    nxt = _allowed(g, V)
    assert nxt and all(re.fullmatch(r"[0-9]}?", tok.decode([t])) for t in nxt), [tok.decode([t]) for t in nxt]
    out += tok.encode("7}")
    g.advance(out)
    nxt = _allowed(g, V)
    assert nxt and all("</fn>".startswith(tok.decode([t])) for t in nxt), [tok.decode([t]) for t in nxt]
    assert not g.is_accepting()
    out += tok.encode("</fn>")
    g.advance(out)
    assert _allowed(g, V) == free and g.is_accepting() and not g.finished
    out += tok.encode(" then <fn=neg>")
    g.advance(out)
    assert all(tok.decode([t]).startswith("{") for t in _allowed(g, V))


def test_matcher_refuses_what_breaks_a_structure(tiny):
    from flintc.structured import GrammarMatcher, StructuredOutputError

    _, tok = tiny
    spec = StructuredOutputsParams(structural_tag=TAG)
    for text in ("ok <fn=mul>", 'ok <fn=add>{"n": 12}', 'ok <fn=add>{"n": 1}</fx>', 'x <fn=neg>{"ok": 3}'):
        g = GrammarMatcher(spec, tok, {tok.eos_token_id})
        with pytest.raises(StructuredOutputError, match="refused generated token"):
            g.advance(tok.encode(text))
    g = GrammarMatcher(spec, tok, {tok.eos_token_id})
    g.advance(tok.encode('a <fn=add>{\n "n" : 3 }</fn> b <fn=neg>{"ok": true}</fn> fn= < end'))  # flexible whitespace
    assert g.is_accepting()


def test_a_special_token_trigger(tiny):
    """A trigger written <...> is the special token (llguidance's StructTag, as vLLM's):
    in free text the token is allowed and opens the structure (its JSON next), an end ''
    leaves free text right after the JSON."""
    from flintc.structured import GrammarMatcher

    _, tok = tiny
    tc = tok.special_token_ids["<tool_call>"]
    spec = StructuredOutputsParams(structural_tag=_tag(
        [{"begin": "<tool_call>", "schema": NEG, "end": ""}], ["<tool_call>"]), disable_any_whitespace=True)
    g = GrammarMatcher(spec, tok, {tok.eos_token_id})
    V = tok.vocab_size
    free = _allowed(g, V)
    assert tc in free and tok.eos_token_id in free
    out = tok.encode("Let me call.") + [tc]
    g.advance(out)
    assert all(tok.decode([t]).startswith("{") for t in _allowed(g, V))
    out += tok.encode('{"ok":false}')
    g.advance(out)
    assert _allowed(g, V) == free and g.is_accepting()


# ---- generation on the tiny model ------------------------------------------------------------


def _gen(tiny, prompts, params):
    from flintc.model.generate import generate

    model, tok = tiny
    ids = [tok.encode(p) for p in prompts]
    r = generate(model, ids, params, eos_token_id=tok.eos_token_id, tokenizer=tok)
    return r, [tok.decode(r.text_ids(i)) for i in range(len(ids))]


# a one-token trigger, '@', which a logit_bias makes the random model write
AT_TAG = {"type": "structural_tag",
          "structures": [{"begin": "@add(", "schema": ADD, "end": ")"}, {"begin": "@neg(", "schema": NEG, "end": ")"}],
          "triggers": ["@"]}
STRUCTURE = re.compile(r"@(add|neg)\((.*?)\)", re.S)


def test_generate_writes_whole_schema_valid_structures(tiny):
    """A logit_bias on '@' drives the random model into the trigger over and over;
    every structure it writes is a begin of the tag, JSON its schema accepts and the end,
    up to where max_tokens cuts the last; the same seeds without the constraint write
    '@' but no structure."""
    _, tok = tiny
    bias = {tok.encode("@")[0]: 6.0}
    seeds = list(range(3))
    so = {"structural_tag": AT_TAG, "disable_any_whitespace": True}
    ps = [SamplingParams(seed=s, max_tokens=48, logit_bias=bias, structured_outputs=so, ignore_eos=True)
          for s in seeds]
    r, texts = _gen(tiny, ["Call a tool:"] * 3, ps)
    assert r.finish_reasons == ["length"] * 3, texts
    found = 0
    for t in texts:
        assert "@" in t, t
        for m in STRUCTURE.finditer(t):
            obj = json.loads(m.group(2))
            if m.group(1) == "add":
                assert set(obj) == {"n"} and type(obj["n"]) is int and 0 <= obj["n"] <= 9, t
            else:
                assert set(obj) == {"ok"} and type(obj["ok"]) is bool, t
            found += 1
        rest = STRUCTURE.sub("", t)
        # what is left: free text without the trigger, then at most the structure max_tokens cut
        _, sep, tail = rest.partition("@")
        assert not sep or (("add(".startswith(tail) or "neg(".startswith(tail)
                            or tail.startswith(("add(", "neg("))) and ")" not in tail), t
    assert found >= 2, texts
    _, free = _gen(tiny, ["Call a tool:"] * 3, [SamplingParams(seed=s, max_tokens=48, logit_bias=bias,
                                                                ignore_eos=True) for s in seeds])
    assert all("@" in t and not STRUCTURE.search(t) for t in free), free


def test_generate_ends_in_free_text_at_a_stop_token(tiny):
    """Without the bias the random model rarely writes the trigger: the output is free
    text, ended by the end-of-text token (allowed wherever the grammar accepts) or cut
    by max_tokens; whatever it holds of '<fn' is a structure's start."""
    ps = [SamplingParams(seed=s, max_tokens=24, structured_outputs={"structural_tag": TAG}) for s in range(4)]
    r, texts = _gen(tiny, ["Hello"] * 4, ps)
    assert set(r.finish_reasons) <= {"stop", "length"}
    for t in texts:
        for i in [m.start() for m in re.finditer("<fn", t)]:
            assert t[i:].startswith(("<fn=add>", "<fn=neg>")) or len(t) - i < 8, t


def test_a_text_stop_token_the_structure_needs_ends_the_sequence(tiny):
    """stop_token_ids holding '(' (ordinary text) while the structure's begin "@add("
    forces it: as in vLLM the grammar's mask lets it be drawn and it ends the sequence
    (finish "stop", stop_reason its id); it was masked as a stop token where the grammar
    does not accept, which left no token to draw and failed the request."""
    _, tok = tiny
    at, paren = tok.encode("@"), tok.encode("(")
    assert len(at) == 1 and len(paren) == 1
    ps = [SamplingParams(seed=s, max_tokens=24, logit_bias={at[0]: 100}, stop_token_ids=[paren[0]],
                         structured_outputs={"structural_tag": AT_TAG}) for s in range(2)]
    r, texts = _gen(tiny, ["Hello"] * 2, ps)
    assert r.finish_reasons == ["stop"] * 2 and r.stop_reasons == [paren[0]] * 2, (r.finish_reasons, texts)
    assert all(t in ("@add", "@neg") for t in texts), texts


# ---- flintc run ----------------------------------------------------------------------------------


def test_flintc_run_takes_a_structural_tag(capsys, tiny_bf16_dir):
    """--structured-outputs '{"structural_tag": ...}' (the object, or its JSON text)
    reaches SamplingParams: the structures (a --logit-bias on "@", id 31, drives the
    model into the trigger) are valid; a bad tag is one line naming the
    field, exit 2, a trigger the tokenizer lacks as a special token too."""
    from flintc.cli import main

    so = json.dumps({"structural_tag": AT_TAG, "disable_any_whitespace": True})
    code = main(["run", str(tiny_bf16_dir), "--prompt", "Call a tool:", "--max-tokens", "40", "--seed", "1",
                 "--ignore-eos", "--logit-bias", "31=6", "--output", "json", "--structured-outputs", so])
    out, err = capsys.readouterr()
    assert code == 0, err
    text = json.loads(out)["text"]
    assert STRUCTURE.search(text) and all(json.loads(m.group(2)) for m in STRUCTURE.finditer(text)), text
    for bad, needle in (({"structural_tag": json.dumps({"structures": [], "triggers": ["@"]})}, "no structures"),
                        ({"structural_tag": _tag([{"begin": "<x>", "schema": {}, "end": ""}], ["<x>"])},
                         "unknown special token")):
        code = main(["run", str(tiny_bf16_dir), "--prompt", "hi", "--max-tokens", "2",
                     "--structured-outputs", json.dumps(bad)])
        out, err = capsys.readouterr()
        assert code == 2 and err.startswith("flintc: error: ") and err.count("\n") == 1, err
        assert "structured_outputs field 'structural_tag': " in err and needle in err, err
