"""vLLM's structural tag over HTTP (a real uvicorn server, the tiny BF16 reference
model): ``response_format`` ``{"type": "structural_tag", "structures", "triggers"}``
(vLLM's `StructuralTagResponseFormat`), ``structured_outputs.structural_tag`` (its JSON
text, vLLM's field) and the older top-level ``structural_tag``, in chat and completions,
streamed and not; the output is free text whose structures (driven by a logit_bias on
the one-token trigger '@', or by the engine's scripted tokens) are each a begin, JSON the
schema accepts and an end; a scripted reply that breaks a structure fails; the 400s name
the field."""

from __future__ import annotations

import json
import re

import pytest

MODEL = "flint-tiny"
ADD = {"type": "object", "required": ["n"], "additionalProperties": False,
       "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
NEG = {"type": "object", "required": ["ok"], "additionalProperties": False, "properties": {"ok": {"type": "boolean"}}}
STRUCTURES = [{"begin": "@add(", "schema": ADD, "end": ")"}, {"begin": "@neg(", "schema": NEG, "end": ")"}]
TAG = {"type": "structural_tag", "structures": STRUCTURES, "triggers": ["@"]}
STRUCTURE = re.compile(r"@(add|neg)\((.*?)\)", re.S)


def body(path, content="Call a tool:", **kw):
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": content, "max_tokens": 40, "seed": 3, **kw}
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 40, "seed": 3, **kw}


def text_of(path, got) -> str:
    c = got["choices"][0]
    return c["text"] if path == "/v1/completions" else c["message"]["content"]


def check_structures(text) -> int:
    """Each complete structure of `text` is valid, the rest free text then at most one
    structure cut by max_tokens; the number of complete ones."""
    n = 0
    for m in STRUCTURE.finditer(text):
        obj = json.loads(m.group(2))
        assert (set(obj) == {"n"} and type(obj["n"]) is int and 0 <= obj["n"] <= 9 if m.group(1) == "add"
                else set(obj) == {"ok"} and type(obj["ok"]) is bool), text
        n += 1
    _, sep, tail = STRUCTURE.sub("", text).partition("@")
    assert not sep or (("add(".startswith(tail) or "neg(".startswith(tail) or tail.startswith(("add(", "neg(")))
                       and ")" not in tail), text
    return n


def constraint(how):
    if how == "response_format":
        return {"response_format": TAG}
    if how == "structured_outputs":
        return {"structured_outputs": {"structural_tag": json.dumps(TAG), "disable_any_whitespace": True}}
    return {"structural_tag": json.dumps({"structures": STRUCTURES, "triggers": ["@"]})}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("how", ["response_format", "structured_outputs", "structural_tag"])
def test_biased_into_the_trigger_every_structure_is_valid(tiny_server, tiny_serving, path, how):
    """A logit_bias on '@' makes the random model write the trigger again and again:
    every structure is whole and schema-valid (JSON with flexible whitespace unless
    disable_any_whitespace); the same request without the constraint writes '@' and no
    structure."""
    _, tok = tiny_serving
    bias = {str(tok.encode("@")[0]): 6}
    req = body(path, **constraint(how), logit_bias=bias, ignore_eos=True)
    status, got = tiny_server.post(path, req)
    assert status == 200, got
    text = text_of(path, got)
    assert check_structures(text) >= 1 and got["choices"][0]["finish_reason"] == "length", text
    status, free = tiny_server.post(path, body(path, logit_bias=bias, ignore_eos=True))
    assert status == 200 and "@" in text_of(path, free) and not STRUCTURE.search(text_of(path, free)), free


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_n2(tiny_server, tiny_serving, path):
    _, tok = tiny_serving
    req = body(path, **constraint("response_format"), logit_bias={str(tok.encode("@")[0]): 6}, stream=True, n=2)
    status, chunks = tiny_server.post(path, req)
    assert status == 200, chunks
    got = ["", ""]
    for c in chunks:
        for ch in c["choices"]:
            got[ch["index"]] += ch["text"] if path == "/v1/completions" else ch["delta"].get("content") or ""
    assert all(check_structures(t) >= 1 for t in got), got


def test_scripted_replies_follow_or_break_the_tag(tiny_server):
    """The engine's scripted tokens (fed to the grammar as sampled ones): a reply of
    free text and two valid structures is answered whole, finish "stop" (the end-of-text
    token after it, where the grammar accepts); one whose JSON breaks the schema
    ('"n": 12' past its maximum) fails with the grammar's refusal (a 500, as any
    scripted token the grammar refuses: tests/serve/test_structured_outputs.py); free text with no
    trigger ('#script:stop') passes as it is."""
    status, got = tiny_server.post("/v1/chat/completions", body("/v1/chat/completions", "#script:stag",
                                                                response_format=TAG))
    assert status == 200, got
    assert text_of("/v1/chat/completions", got) == 'Let me add. @add({"n": 3}) and @neg({"ok": true}) done.', got
    assert got["choices"][0]["finish_reason"] == "stop"
    status, got = tiny_server.post("/v1/chat/completions", body("/v1/chat/completions", "#script:stag_bad",
                                                                response_format=TAG))
    assert status == 500 and "the grammar refused generated token" in got["error"]["message"], got
    status, got = tiny_server.post("/v1/chat/completions", body("/v1/chat/completions", "#script:stop",
                                                                structured_outputs={"structural_tag": TAG}))
    assert status == 200 and text_of("/v1/chat/completions", got) == "Hello world. Goodbye world.", got


def bad_tag(**kw):
    return {"type": "structural_tag", "structures": STRUCTURES, "triggers": ["@"], **kw}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("patch, param, needle", [
    ({"response_format": bad_tag(triggers=["#"])}, "response_format",
     "'response_format': structures[0].begin \"@add(\" starts with none of the triggers [\"#\"]"),
    ({"response_format": bad_tag(structures=[])}, "response_format", "no structures"),
    ({"response_format": {"type": "structural_tag", "triggers": ["@"]}}, "response_format", "missing 'structures'"),
    ({"response_format": bad_tag(extra=1)}, "response_format",
     "Unrecognized request argument supplied: response_format.extra"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}}, "response_format",
     "xgrammar's"),
    ({"response_format": bad_tag(structures=[{"begin": "@a", "schema": {"type": 5}, "end": ""}])},
     "response_format", "'response_format': structures[0].schema: type must be a string"),
    ({"response_format": bad_tag(structures=[{"begin": "<fn>", "schema": {}, "end": ""}], triggers=["<fn>"])},
     "response_format", "unknown special token: \"<fn>\""),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs",
     "'structured_outputs.structural_tag': not valid JSON"),
    ({"structured_outputs": {"structural_tag": json.dumps(bad_tag(structures=[
        {"begin": "<tool_call>", "schema": {}, "end": "</tool_call>"}], triggers=["<tool_call>"]))}},
     "structured_outputs", "holds the special token '</tool_call>'"),
    ({"structural_tag": "[]"}, "structural_tag", "'structural_tag': expected an object"),
    ({"structural_tag": json.dumps(TAG), "guided_regex": "a"}, "structural_tag",
     "You can only use one kind of guided decoding"),
    ({"response_format": TAG, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "You can only use one kind of guided decoding"),
])
def test_errors_are_400s_naming_the_field(tiny_server, path, patch, param, needle):
    status, got = tiny_server.post(path, body(path, **patch))
    assert status == 400 and got["error"]["param"] == param, got
    assert needle in got["error"]["message"], got
