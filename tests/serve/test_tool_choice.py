"""tool_choice "required" and a named function in /v1/chat/completions (a real uvicorn
server, the tiny BF16 reference model, whose unconstrained text is random): the reply
is constrained to the tool's parameters schema (named) or vLLM's array of
{"name", "parameters"} objects (required) and comes back as OpenAI tool_calls, without
--enable-auto-tool-choice; streamed deltas reassemble to the unstreamed reply; n > 1;
the thinking block stays free with --reasoning-parser; a reply cut by max_tokens is
no 500; the 400s naming tool_choice (or the field combined with it)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

MODEL = "flint-tiny"
MODE = {"type": "object", "additionalProperties": False, "required": ["mode"],
        "properties": {"mode": {"enum": ["on", "off"]}}}
LEVEL = {"type": "object", "additionalProperties": False, "required": ["level"],
         "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS = [
    {"type": "function", "function": {"name": "set_mode", "description": "Switch", "parameters": MODE}},
    {"type": "function", "function": {"name": "set_level", "parameters": LEVEL}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: {} only
]
SCHEMAS = {"set_mode": MODE, "set_level": LEVEL, "ping": {"type": "object", "additionalProperties": False}}
NAMED = {"type": "function", "function": {"name": "set_mode"}}
# the random model goes on adding calls to the array: a bias towards '}' and ']' (token
# ids of the tiny tokenizer; the grammar allows them only where the JSON may close)
CLOSE = {"logit_bias": {"92": 6, "60": 10}}


def chat(content="Call a tool.", **kw):
    # no whitespace between JSON tokens (vLLM's guided_whitespace_pattern): the random
    # model would fill max_tokens with it
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 40, "seed": 3,
            "tools": TOOLS, "guided_whitespace_pattern": "", **kw}


@pytest.fixture(scope="module")
def server(tiny_serving, serve_kit):
    """The tiny model with default options (no --enable-auto-tool-choice): the template's
    tool section needs more than 256 tokens of context."""
    from flintc.serve.app import ServeOptions

    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL), max_batch=2, max_model_len=1024)
    yield run
    serve_kit.stop_server(run)


@pytest.fixture(scope="module")
def reasoning_server(tiny_serving, serve_kit):
    from flintc.serve.app import ServeOptions

    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL, reasoning_parser="glm47"),
                                 max_batch=2, max_model_len=1024)
    yield run
    serve_kit.stop_server(run)


def check_call(call, name=None):
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-"), call
    fn = call["function"]
    assert fn["name"] in SCHEMAS and (name is None or fn["name"] == name), call
    jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


def streamed(chunks):
    """Per choice: (content, reasoning, [(id, name, arguments)], finish_reason) from stream chunks."""
    out = {}
    for c in chunks:
        for ch in c["choices"]:
            content, reasoning, calls, finish = out.setdefault(ch["index"], ["", "", {}, None])
            d = ch["delta"]
            out[ch["index"]][0] += d.get("content") or ""
            out[ch["index"]][1] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                if tc["index"] not in calls:  # the first delta of a call: its id, type and name
                    assert tc["type"] == "function" and tc["id"] and tc["function"]["name"], tc
                    calls[tc["index"]] = [tc["id"], tc["function"]["name"], ""]
                else:
                    assert "id" not in tc and "name" not in tc["function"], tc
                calls[tc["index"]][2] += tc["function"]["arguments"]
            out[ch["index"]][3] = ch["finish_reason"] or finish
    return {i: (c, r, [tuple(calls[k]) for k in sorted(calls)], f) for i, (c, r, calls, f) in out.items()}


@pytest.mark.parametrize("seed", [1, 2])
def test_named_function(server, seed):
    """The reply is one call of the named function, its arguments valid for its schema,
    content null, finish_reason "stop" (not "tool_calls", as vLLM and OpenAI)."""
    status, body = server.post("/v1/chat/completions", chat(tool_choice=NAMED, seed=seed))
    assert status == 200, body
    choice = body["choices"][0]
    msg = choice["message"]
    assert msg["content"] is None and len(msg["tool_calls"]) == 1, msg
    check_call(msg["tool_calls"][0], "set_mode")
    assert choice["finish_reason"] == "stop", choice


def test_named_function_integer_and_no_parameters(server):
    for name, want in (("set_level", None), ("ping", "{}")):
        status, body = server.post("/v1/chat/completions", chat(
            tool_choice={"type": "function", "function": {"name": name}}))
        assert status == 200, body
        call = body["choices"][0]["message"]["tool_calls"][0]
        check_call(call, name)
        assert want is None or call["function"]["arguments"] == want, call
        if name == "set_level":
            assert type(json.loads(call["function"]["arguments"])["level"]) is int


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required(server, seed):
    """Each item of the generated array is one call of a tool, valid for its schema;
    content null; finish_reason "tool_calls"."""
    status, body = server.post("/v1/chat/completions", chat(tool_choice="required", seed=seed, max_tokens=60, **CLOSE))
    assert status == 200, body
    choice = body["choices"][0]
    msg = choice["message"]
    assert msg["content"] is None and msg["tool_calls"], choice
    for call in msg["tool_calls"]:
        check_call(call)
    assert len({c["id"] for c in msg["tool_calls"]}) == len(msg["tool_calls"])
    assert choice["finish_reason"] == "tool_calls", choice


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streaming_reassembles_to_the_unstreamed_reply(server, tool_choice):
    """Greedy, n = 2: each choice's deltas give the same calls (name, arguments) and
    finish_reason as the unstreamed request; a call's id, type and name come once, in
    its first delta (index 0 for the named function)."""
    body = chat(tool_choice=tool_choice, temperature=0, n=2, max_tokens=60, **CLOSE)
    status, whole = server.post("/v1/chat/completions", body)
    assert status == 200, whole
    status, chunks = server.post("/v1/chat/completions", {**body, "stream": True})
    assert status == 200, chunks
    got = streamed(chunks)
    assert sorted(got) == [0, 1]
    for i, choice in enumerate(whole["choices"]):
        content, _, calls, finish = got[i]
        assert content == "" and finish == choice["finish_reason"], (got[i], choice)
        assert [(n, a) for _, n, a in calls] == [(c["function"]["name"], c["function"]["arguments"])
                                                  for c in choice["message"]["tool_calls"]], (calls, choice)
        for _, name, args in calls:
            check_call({"id": "chatcmpl-tool-x", "type": "function", "function": {"name": name, "arguments": args}})


def test_named_streams_the_arguments_as_they_come(server):
    """The named call's arguments arrive in several deltas (not held to the end)."""
    status, chunks = server.post("/v1/chat/completions", chat(tool_choice=NAMED, stream=True, temperature=0))
    assert status == 200, chunks
    pieces = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []]
    assert len(pieces) > 2 and all(tc["index"] == 0 for tc in pieces), pieces
    _, _, calls, finish = streamed(chunks)[0]
    assert len(calls) == 1 and finish == "stop"
    check_call({"id": calls[0][0], "type": "function", "function": {"name": calls[0][1], "arguments": calls[0][2]}})


def test_n_choices_each_get_their_calls(server):
    status, body = server.post("/v1/chat/completions", chat(tool_choice="required", n=3, max_tokens=60, **CLOSE))
    assert status == 200, body
    assert len(body["choices"]) == 3
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], choice
        for call in choice["message"]["tool_calls"]:
            check_call(call)


@pytest.mark.parametrize("stream", [False, True])
def test_cut_by_max_tokens(server, stream):
    """A reply cut before its JSON ends: named, the partial text as arguments; required,
    the raw text as content and no call (nothing completed before the cut);
    finish_reason "length", never a 500."""
    for tool_choice in (NAMED, "required"):
        status, body = server.post("/v1/chat/completions", chat(tool_choice=tool_choice, max_tokens=3,
                                                                temperature=0, stream=stream))
        assert status == 200, body
        if stream:
            content, _, calls, finish = streamed(body)[0]
        else:
            choice = body["choices"][0]
            content, finish = choice["message"]["content"], choice["finish_reason"]
            calls = [(c["id"], c["function"]["name"], c["function"]["arguments"])
                     for c in choice["message"]["tool_calls"] or []]
        assert finish == "length", body
        if tool_choice == NAMED:
            assert content in (None, "") and len(calls) == 1 and calls[0][1] == "set_mode", body
            assert calls[0][2].startswith("{") and not calls[0][2].endswith("}"), calls
        else:
            assert calls == [] and content.startswith("[") and content, body


def fed(f, pieces):
    """Feed `pieces` to a `ForcedToolCalls`. -> per call index, (id, name, arguments) from
    its deltas, checking that a call's id, type and name come once, in its first delta."""
    calls = {}
    for piece in pieces:
        for tc in f.feed(piece):
            if tc["index"] not in calls:
                assert tc["index"] == len(calls) and tc["type"] == "function" and tc["id"], tc
                calls[tc["index"]] = [tc["id"], tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
            calls[tc["index"]][2] += tc["function"]["arguments"]
    return [tuple(calls[k]) for k in sorted(calls)]


def split_at(text, cuts):
    cuts = sorted(set(k % (len(text) + 1) for k in cuts))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(calls=st.lists(st.tuples(st.text(min_size=1, max_size=8), JSON_VALUES, st.booleans()), min_size=1,
                      max_size=3),
       ensure_ascii=st.booleans(), indent=st.sampled_from([None, 0, 2]),
       separators=st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]),
       cuts=st.lists(st.integers(min_value=0, max_value=10**6), max_size=40))
def test_required_streams_pieces_that_add_up_to_the_unstreamed_calls(calls, ensure_ascii, indent, separators,
                                                                        cuts):
    """`ForcedToolCalls` ("required") on any array of calls, however written (whitespace,
    escapes, "parameters" before "name") and split anywhere: each call's deltas add up
    to the unstreamed call (id, name, arguments), the same as for the text fed whole, the
    arguments json.dumps(ARGS, ensure_ascii=False) (vLLM's unstreamed arguments)."""
    from flintc.serve.tool_choice import REQUIRED, ForcedToolCalls

    items = [{"parameters": args, "name": name} if params_first else {"name": name, "parameters": args}
             for name, args, params_first in calls]
    text = json.dumps(items, ensure_ascii=ensure_ascii, indent=indent, separators=separators)
    f = ForcedToolCalls(REQUIRED)
    got = fed(f, split_at(text, cuts))
    assert f.finish() == "" and f.complete
    assert got == [(c.id, c.name, c.arguments) for c in f.calls]
    whole = ForcedToolCalls(REQUIRED)
    fed(whole, [text])
    want = [(name, json.dumps(args, ensure_ascii=False)) for name, args, _ in calls]
    assert [(n, a) for _, n, a in got] == [(c.name, c.arguments) for c in whole.calls] == want


def test_required_streams_a_call_before_it_closes():
    """Fed a character at a time, a call is sent once its name is whole and its
    parameters have begun, then its arguments piece by piece: a string's characters as
    they come, a number once it ends (1 could become 12); a cut array keeps the calls
    completed before the cut (a streamed call cut short is in no message) and gives its
    raw text as content."""
    from flintc.serve.tool_choice import REQUIRED, ForcedToolCalls

    text = '[ {"name": "a", "parameters": {"s": "}]{\\"\\ud83d\\ude00", "l": [12, {"x": 2.50}]}}, {"name": "b", "parameters": {}}]'
    f = ForcedToolCalls(REQUIRED)
    entries = [(k, e) for k, ch in enumerate(text) for e in f.feed(ch)]
    assert entries[0] == (text.index("{", 3), {"index": 0, "id": f.calls[0].id, "type": "function",
                                               "function": {"name": "a", "arguments": "{"}})
    pieces = [e["function"]["arguments"] for _, e in entries if e["index"] == 0]
    assert pieces[:10] == ["{", '"', "s", '"', ": ", '"', "}", "]", "{", '\\"'] and "😀" in pieces
    assert "12, " in pieces and "2.5}" in pieces  # (with the character that ends them)
    assert "".join(pieces) == f.calls[0].arguments == '{"s": "}]{\\"😀", "l": [12, {"x": 2.5}]}'
    assert f.finish() == "" and [c.name for c in f.calls] == ["a", "b"]
    f = ForcedToolCalls(REQUIRED)
    cut = text[:text.index('{"name": "b"') + 29]  # ... "parameters": {
    got = fed(f, [cut[:40], cut[40:]])
    assert [(n, a) for _, n, a in got] == [("a", f.calls[0].arguments), ("b", "{")]
    assert f.finish() == cut and not f.complete and len(f.calls) == 1


def test_required_arguments_escape_a_lone_surrogate():
    """A \\uD83D with no low half: json.dumps would write the lone surrogate raw, which
    UTF-8 cannot encode (a 500); it stays a \\u escape. Text that is no array of calls
    makes no call and no error."""
    from flintc.serve.tool_choice import REQUIRED, ForcedToolCalls

    f = ForcedToolCalls(REQUIRED)
    fed(f, ['[{"name":"a","parameters":["\\ud83d", "\\ud83dx\\udc00"]}]'])
    assert f.calls[0].arguments == '["\\ud83d", "\\ud83dx\\udc00"]'
    f.calls[0].arguments.encode()
    for junk in ("]]}}", '{"name": "a", "parameters": {}}', '[1, "x", [{"name": 2, "parameters": 1}]]', "[{:,}]"):
        f = ForcedToolCalls(REQUIRED)
        assert fed(f, [junk]) == [] and f.finish() == junk



def test_required_nested_past_the_recursion_limit():
    """Arguments nested deeper than Python's JSON decoder goes (a client's logit_bias on
    "[" with an array parameter made them): the reply is read as any other, no
    RecursionError (a 500); cut before the array closes, its raw text is the content."""
    from flintc.serve.tool_choice import REQUIRED, ForcedToolCalls

    deep = "[" * 5000 + "]" * 5000
    text = '[{"name":"a","parameters":{"x":' + deep + '}},{"name":"b","parameters":{}}]'
    f = ForcedToolCalls(REQUIRED)
    got = fed(f, [text[:3000], text[3000:]])
    assert [(n, a) for _, n, a in got] == [("a", '{"x": ' + deep + "}"), ("b", "{}")]
    assert f.finish() == "" and f.complete
    f = ForcedToolCalls(REQUIRED)
    fed(f, [text[:7000]])
    assert f.finish() == text[:7000] and not f.complete

THINK_SCRIPTS = {
    "think_named": '<think>Switch it on.</think>{"mode":"on"}',
    "think_required": ('<think>Two calls.</think>[{"name":"set_mode","parameters":{"mode":"off"}},'
                       '{"name":"ping","parameters":{}}]'),
}


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_block_stays_free(reasoning_server, serve_kit, stream):
    """--reasoning-parser: scripted replies (the engine's test hook) open with a thinking
    block the grammar leaves free; it is reported as reasoning_content, and the JSON after
    it is the calls (two for "required", finish_reason "tool_calls"). Without the
    reasoning parser the grammar refuses '<think>' (see test_structured_outputs)."""
    serve_kit.SCRIPTS.update(THINK_SCRIPTS)
    want = {"think_named": ("Switch it on.", [("set_mode", {"mode": "on"})], "stop"),
            "think_required": ("Two calls.", [("set_mode", {"mode": "off"}), ("ping", {})], "tool_calls")}
    for script, tool_choice in (("think_named", NAMED), ("think_required", "required")):
        status, body = reasoning_server.post("/v1/chat/completions", chat(
            f"#script:{script}", tool_choice=tool_choice, max_tokens=120, stream=stream))
        assert status == 200, body
        if stream:
            content, reasoning, calls, finish = streamed(body)[0]
            calls = [(n, json.loads(a)) for _, n, a in calls]
        else:
            choice = body["choices"][0]
            msg, finish = choice["message"], choice["finish_reason"]
            content, reasoning = msg["content"], msg["reasoning_content"]
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
        assert content in (None, "") and (reasoning, calls, finish) == want[script], body


THREE_CALLS = ('[{"name":"set_mode","parameters":{"mode":"on"}},{"name":"set_level","parameters":{"level":7}},'
               '{"name":"ping","parameters":{}}]')


def reply(body, stream):
    """(content, [(id, name, arguments)], finish_reason) of choice 0, streamed or not."""
    if stream:
        content, _, calls, finish = streamed(body)[0]
        return content or None, calls, finish
    choice = body["choices"][0]
    return (choice["message"]["content"], [(c["id"], c["function"]["name"], c["function"]["arguments"])
                                           for c in choice["message"]["tool_calls"] or []], choice["finish_reason"])


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_streams_calls_by_token_and_parallel_tool_calls(server, serve_kit, parallel):
    """A scripted reply of three calls, streamed a token at a time: each call's name
    comes first, its arguments in several deltas, and they add up to the unstreamed
    calls (json.dumps's arguments). parallel_tool_calls false keeps the first call only,
    streamed or not (vLLM's maybe_filter_parallel_tool_calls: the grammar still allows
    more; finish_reason "tool_calls"); null or true, all three."""
    serve_kit.SCRIPTS["three_calls"] = THREE_CALLS
    want = [("set_mode", '{"mode": "on"}'), ("set_level", '{"level": 7}'), ("ping", "{}")]
    want = want[:1] if parallel is False else want
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    for stream in (False, True):
        status, body = server.post("/v1/chat/completions", chat("#script:three_calls", tool_choice="required",
                                                                max_tokens=120, stream=stream, **extra))
        assert status == 200, body
        content, calls, finish = reply(body, stream)
        assert content is None and [(n, a) for _, n, a in calls] == want and finish == "tool_calls", body
        if stream:
            deltas = [tc for c in body for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []]
            assert {tc["index"] for tc in deltas} == set(range(len(want))), deltas
            assert len([tc for tc in deltas if tc["index"] == 0]) > 2, deltas
    # a named function: its one call, whatever parallel_tool_calls says
    status, body = server.post("/v1/chat/completions", chat(tool_choice=NAMED, temperature=0, **extra))
    assert status == 200 and len(body["choices"][0]["message"]["tool_calls"]) == 1, body


@pytest.mark.parametrize("patch, param, needle", [
    ({"tool_choice": "auto", "tools": None}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tool_choice": NAMED, "tools": None}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "Tool 'nope' has not been passed in `tools`."),
    ({"tool_choice": {"type": "custom", "function": {"name": "set_mode"}}}, "tool_choice", "Invalid `type`"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "Invalid value for `function`"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice", "Expected field `name`"),
    ({"tool_choice": {"type": "function", "function": {"name": ""}}}, "tool_choice", "Invalid `name`"),
    ({"tool_choice": "sometimes"}, "tool_choice", "Invalid value for `tool_choice`"),
    ({"tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls", "bool"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "You can only either use constraints for structured outputs or tools, not both"),
    ({"tool_choice": NAMED, "guided_regex": "a+"}, "guided_regex", "not both"),
    ({"tool_choice": NAMED, "structured_outputs": {"choice": ["a"]}}, "structured_outputs", "not both"),
    ({"tool_choice": NAMED, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not supported"),
    ({"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"X": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"X": {"type": "string"}}}}}]},
     "tools", "Tool definition 'X' has multiple schemas"),
    ({"tool_choice": NAMED, "tools": [{"type": "function", "function": {
        "name": "set_mode", "parameters": {"type": "object", "required": 3}}}]},
     "tools[0].function.parameters", "the JSON schema is refused"),
])
def test_errors_are_400s_naming_the_field(server, patch, param, needle):
    status, got = server.post("/v1/chat/completions", chat(**patch))
    assert status == 400 and got["error"]["param"] == param, got
    assert needle in got["error"]["message"], got


def _drop_tools(body: dict, tools) -> None:
    """`chat()`'s body without tools: the field "absent", or None; and without its
    guided_whitespace_pattern."""
    del body["guided_whitespace_pattern"]
    if tools == "absent":
        del body["tools"]
    else:
        body["tools"] = None


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_without_tools_is_a_400(server, tool_choice, stream):
    """vLLM's check_tool_usage (its test_chat_completion_request_with_tool_choice_but_no_tools),
    as OpenAI: "auto", "required" or a named function with ``tools`` absent or null is a
    400 naming tool_choice, streamed or not. "auto" was taken before (a plain reply)."""
    for tools in ("absent", None):
        body = chat(tool_choice=tool_choice, max_tokens=4, stream=stream)
        _drop_tools(body, tools)
        status, got = server.post("/v1/chat/completions", body)
        assert status == 400, got
        assert got["error"] == {"message": "When using `tool_choice`, `tools` must be set.",
                                "type": "invalid_request_error", "param": "tool_choice", "code": None}, got


@pytest.mark.parametrize("tool_choice", ["none", None])
def test_tool_choice_none_or_null_without_tools_is_taken(server, tool_choice):
    """tool_choice "none" (or null) needs no tools, as in vLLM: a plain reply."""
    for tools in ("absent", None):
        body = chat(tool_choice=tool_choice, max_tokens=4)
        _drop_tools(body, tools)
        status, got = server.post("/v1/chat/completions", body)
        assert status == 200 and got["choices"][0]["message"]["tool_calls"] is None, got


def test_resolve_tool_choice_without_tools():
    """`resolve_tool_choice` alone: "none" and null pass without tools; "auto", "required"
    and a named function are the 400; "auto" with an empty list stays "auto" (vLLM checks
    only for absent or null tools)."""
    from flintc.serve.protocol import APIError
    from flintc.serve.tool_choice import resolve_tool_choice

    assert resolve_tool_choice("none", None) == ("none", None, None)
    assert resolve_tool_choice(None, None) == ("none", None, None)
    assert resolve_tool_choice("auto", []) == ("auto", None, [])
    assert resolve_tool_choice("auto", TOOLS) == ("auto", None, TOOLS)
    for choice in ("auto", "required", NAMED):
        with pytest.raises(APIError) as e:
            resolve_tool_choice(choice, None)
        assert (e.value.status, e.value.param, e.value.message) == (
            400, "tool_choice", "When using `tool_choice`, `tools` must be set.")


def test_defs_are_gathered_and_references_resolve(server):
    """vLLM's schema for "required" moves each tool's $defs to the top: a parameter
    given by "$ref": "#/$defs/Mode" still constrains the call; the request's tools are
    used as given (the named function keeps its own $defs)."""
    ref = {"type": "object", "additionalProperties": False, "required": ["mode"],
           "properties": {"mode": {"$ref": "#/$defs/Mode"}}, "$defs": {"Mode": {"enum": ["up", "down"]}}}
    tools = [{"type": "function", "function": {"name": "move", "parameters": ref}},
             {"type": "function", "function": {"name": "stay", "parameters": {
                 "type": "object", "additionalProperties": False, "required": ["mode"],
                 "properties": {"mode": {"$ref": "#/$defs/Mode"}}, "$defs": {"Mode": {"enum": ["up", "down"]}}}}}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "move"}}):
        status, body = server.post("/v1/chat/completions", chat(tools=tools, tool_choice=tool_choice,
                                                                max_tokens=60, **CLOSE))
        assert status == 200, body
        calls = body["choices"][0]["message"]["tool_calls"]
        assert calls, body
        for call in calls:
            assert json.loads(call["function"]["arguments"])["mode"] in ("up", "down"), call


def test_required_with_empty_tools_is_none_and_auto_unchanged(server):
    """tool_choice "required" with "tools": [] reads as "none" (vLLM, OpenAI): a plain
    reply; "auto" with tools still needs --enable-auto-tool-choice, and an explicit
    "auto" with "tools": [] too (vLLM checks the flags whatever the tools; it was taken as
    no tools); "tools": [] without a tool_choice is a plain reply."""
    body = chat(tool_choice="required", tools=[], max_tokens=4)
    del body["guided_whitespace_pattern"]  # (a 400 without a constraint)
    status, body = server.post("/v1/chat/completions", body)
    assert status == 200 and body["choices"][0]["message"]["tool_calls"] is None, body
    status, body = server.post("/v1/chat/completions", chat(tool_choice="auto", max_tokens=4))
    assert status == 400 and "--enable-auto-tool-choice" in body["error"]["message"], body
    for extra, want in (({"tool_choice": "auto"}, 400), ({}, 200)):
        body = chat(tools=[], max_tokens=4, **extra)
        del body["guided_whitespace_pattern"]
        status, body = server.post("/v1/chat/completions", body)
        if want == 400:
            assert status == 400 and "--enable-auto-tool-choice" in body["error"]["message"], body
        else:
            assert status == 200 and body["choices"][0]["message"]["tool_calls"] is None, body


def test_required_rebases_document_relative_refs(server):
    """A tool's "$ref": "#/properties/a" (zod-to-json-schema's reuse) or "#" (a recursive
    root) points into that tool's parameters once they sit inside "required"'s array
    schema, not into the array's schema (a 400 "Pointer '/properties/a' does not exist",
    or "#" letting the model write the whole array again); "#/$defs/..." ones still
    reach the hoisted $defs, and "$ref" inside const/enum data stays as given."""
    from flintc.serve.tool_choice import REQUIRED, tool_choice_schema

    item = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
            "additionalProperties": False}
    zod = {"type": "object", "properties": {"a": item, "b": {"$ref": "#/properties/a"},
                                            "c": {"$ref": "#/$defs/C"}, "d": {"const": {"$ref": "#"}},
                                            "default": {"$ref": "#/properties/a"}},
           "required": ["a", "b"], "additionalProperties": False,
           "$defs": {"C": {"anyOf": [{"type": "null"}, {"$ref": "#/properties/a"}]}}}
    rec = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
           "required": ["next"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "z", "parameters": zod}},
             {"type": "function", "function": {"name": "r", "parameters": rec}}]
    schema = tool_choice_schema(REQUIRED, None, tools)
    good = [{"name": "z", "parameters": {"a": {"x": 1}, "b": {"x": 2}, "c": {"x": 3}, "d": {"$ref": "#"},
                                         "default": {"x": 4}}},
            {"name": "r", "parameters": {"next": {"next": None}}}]
    jsonschema.validate(good, schema)
    for bad in ([{"name": "z", "parameters": {"a": {"x": 1}, "b": "x"}}],
                [{"name": "z", "parameters": {"a": {"x": 1}, "b": {"x": 2}, "c": {"y": 1}}}],
                [{"name": "z", "parameters": {"a": {"x": 1}, "b": {"x": 2}, "default": 5}}],
                [{"name": "r", "parameters": {"next": [{"name": "r", "parameters": {"next": None}}]}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tools[0]["function"]["parameters"] == zod and "$defs" in zod  # the request's tools unchanged
    # a schema with an $id is a resource of its own: its "#..." references stay relative to it
    own = {**rec, "$id": "https://example.com/rec.json"}
    schema = tool_choice_schema(REQUIRED, None, [{"type": "function", "function": {"name": "r", "parameters": own}}])
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == own
    own = {**zod, "$id": "https://example.com/zod.json"}  # its $defs too
    tools = [{"type": "function", "function": {"name": "z", "parameters": own}}]
    assert tool_choice_schema(REQUIRED, None, tools)["items"]["anyOf"][0]["properties"]["parameters"] == own
    status, body = server.post("/v1/chat/completions", chat(tools=tools, tool_choice="required", max_tokens=60,
                                                            **CLOSE))
    assert status == 200, body
    status, body = server.post("/v1/chat/completions", chat(tools=tools[:1], tool_choice="required",
                                                            max_tokens=60, **CLOSE))
    assert status == 200, body
    for call in body["choices"][0]["message"]["tool_calls"] or []:
        jsonschema.validate(json.loads(call["function"]["arguments"]), zod)


def test_named_picks_the_last_tool_of_that_name(server):
    """Two tools of one name: a named tool_choice follows the last one's parameters (vLLM
    reads the tools into a dict by name), and names it in a refused schema's error."""
    from flintc.serve.tool_choice import NAMED as NAMED_MODE, tool_choice_schema

    first = {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"], "additionalProperties": False}
    last = {"type": "object", "properties": {"b": {"const": 2}}, "required": ["b"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "x", "parameters": p}} for p in (first, last)]
    assert tool_choice_schema(NAMED_MODE, "x", tools) == last
    named = {"type": "function", "function": {"name": "x"}}
    status, body = server.post("/v1/chat/completions", chat(tools=tools, tool_choice=named))
    assert status == 200, body
    assert json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"b": 2}, body
    tools[1]["function"]["parameters"] = {"type": "object", "required": 3}
    status, body = server.post("/v1/chat/completions", chat(tools=tools, tool_choice=named))
    assert status == 400 and body["error"]["param"] == "tools[1].function.parameters", body


def test_required_arguments_stay_json_for_numbers_beyond_a_float(server, serve_kit):
    """A number the schema allows but a float cannot hold (1e999: inf once parsed) keeps
    its text in the call's arguments, not json.dumps's "Infinity" (no JSON); the rest of
    the arguments is still re-written (json.dumps, vLLM's)."""
    serve_kit.SCRIPTS["huge_number"] = ('[{"name":"num","parameters":{"x":1e999,"y":[-1E400,"}"]}},'
                                        '{"name":"num","parameters":{"x":2.5,"y":[]}}]')
    params = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
              "properties": {"x": {"type": "number"}, "y": {"type": "array"}}}
    tools = [{"type": "function", "function": {"name": "num", "parameters": params}}]
    for stream in (False, True):
        status, body = server.post("/v1/chat/completions", chat("#script:huge_number", tools=tools,
                                                                tool_choice="required", stream=stream,
                                                                max_tokens=120))
        assert status == 200, body
        if stream:
            _, _, calls, finish = streamed(body)[0]
            args = [a for _, _, a in calls]
        else:
            finish = body["choices"][0]["finish_reason"]
            args = [c["function"]["arguments"] for c in body["choices"][0]["message"]["tool_calls"] or []]
        assert finish == "tool_calls" and args == ['{"x": 1e999, "y": [-1E400, "}"]}', '{"x": 2.5, "y": []}'], body
        for a in args:
            json.loads(a, parse_constant=lambda c: pytest.fail(f"{c} in {a}"))


def test_parameters_without_type_are_an_object(server):
    """Parameters with properties but no "type" (JSON Schema: any value; the tiny model
    wrote the arguments `true`) constrain the reply to an object, as xgrammar (vLLM's
    default backend) reads them; a schema with anyOf and no type stays as given."""
    from flintc.serve.tool_choice import NAMED as NAMED_MODE, REQUIRED, tool_choice_schema

    params = {"properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "x", "parameters": params}}]
    assert tool_choice_schema(NAMED_MODE, "x", tools) == {"type": "object", **params}
    assert tool_choice_schema(REQUIRED, None, tools)["items"]["anyOf"][0]["properties"]["parameters"] == \
        {"type": "object", **params}
    assert "type" not in params  # the request's tools unchanged
    either = {"anyOf": [{"type": "string"}, {"type": "object"}], "properties": {}}
    assert tool_choice_schema(NAMED_MODE, "y", [{"type": "function", "function": {"name": "y",
                                                                               "parameters": either}}]) == either
    for tool_choice in ("required", {"type": "function", "function": {"name": "x"}}):
        status, body = server.post("/v1/chat/completions", chat(tools=tools, tool_choice=tool_choice, max_tokens=60,
                                                                **CLOSE))
        assert status == 200, body
        for call in body["choices"][0]["message"]["tool_calls"] or []:
            assert isinstance(json.loads(call["function"]["arguments"]), dict), call
