"""Stop strings and special tokens in /v1/chat/completions (a real uvicorn server, the tiny
BF16 reference model).

vLLM matches stop strings on the text it outputs (its detokenizer's `check_stop_strings`,
over text decoded with the request's `skip_special_tokens`): with skip_special_tokens true
(the default) no special token's string (`<think>`, `</think>`, ...) takes part in a match,
though flintc's chat keeps them in the engine's text for its reasoning and tool-call parsers
(`GenRequest.stop_without_specials`, `flintc.stop_strings.VisibleText`); with
skip_special_tokens false (or tool parsing, whose parsers turn it off) they are in the
output and match.
"""

from __future__ import annotations

import pytest

from flintc.stop_strings import VisibleText, stop_string_cut

MODEL = "flint-tiny"
THINK, ANSWER = "The user wants a number.", "The answer is 4."  # conftest.SCRIPTS["think"]


def chat(content="#script:think", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 60, **kw}


@pytest.fixture(scope="module")
def reasoning_server(tiny_serving, serve_kit):
    """--reasoning-parser glm47, --tool-call-parser glm47 with auto tool choice (the repro's)."""
    from flintc.serve.app import ServeOptions

    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL, reasoning_parser="glm47", tool_call_parser="glm47",
                                                          enable_auto_tool_choice=True),
                                 max_batch=3, max_model_len=512)
    yield run
    serve_kit.stop_server(run)


def results(server, body) -> list[tuple]:
    """Each choice's (reasoning, content, finish_reason, stop_reason), checked to agree
    between the unstreamed answer and the streamed one (its deltas joined)."""
    status, got = server.post("/v1/chat/completions", body)
    assert status == 200, got
    plain = [(c["message"].get("reasoning_content") or "", c["message"]["content"] or "",
              c["finish_reason"], c["stop_reason"]) for c in sorted(got["choices"], key=lambda c: c["index"])]
    status, events = server.post("/v1/chat/completions", {**body, "stream": True})
    assert status == 200, events
    streamed = [["", "", None, None] for _ in plain]
    for e in events:
        for ch in e.get("choices", ()):
            s, d = streamed[ch["index"]], ch.get("delta") or {}
            s[0] += d.get("reasoning_content") or ""
            s[1] += d.get("content") or ""
            if ch["finish_reason"] is not None:
                s[2], s[3] = ch["finish_reason"], ch.get("stop_reason")
    assert [tuple(s) for s in streamed] == plain
    return plain


def test_visible_text_maps_cuts_and_holds():
    """`VisibleText`: the text less the special strings, matched as `stop_string_cut`, the
    cut and the stream's hold-back mapped onto the whole text."""
    specials = {1: "<think>", 2: "</think>"}
    pieces = [(1, "<think>"), (5, "ab"), (2, "</think>"), (6, "cd")]
    vis, whole = VisibleText(specials), ""
    for tok, new in pieces:
        whole += new
        assert vis.push(tok, new) == (0 if tok in specials else len(new))
    assert (whole, vis.text) == ("<think>ab</think>cd", "abcd")
    # a cut before "bc" keeps "<think>a"; "k>" and "<think>" are no visible text
    assert stop_string_cut(vis.text, ("k>", "<think>"), 2, False) is None
    v = VisibleText(specials)
    for tok, new in pieces:
        v.push(tok, new)
    assert v.cut(("bc",), 2, False) == ("bc", len("<think>a"))
    v = VisibleText(specials)
    for tok, new in pieces:
        v.push(tok, new)
    assert v.cut(("bc",), 2, True) == ("bc", len("<think>ab</think>c"))
    # a stop ending before a special: the cut after it leaves the special out, the cut before
    # it keeps the specials before the stop
    v = VisibleText(specials)
    for tok, new in pieces[:3]:
        v.push(tok, new)
    assert v.cut(("b",), 2, True) == ("b", len("<think>ab"))
    v = VisibleText(specials)
    for tok, new in [(1, "<think>"), (2, "</think>"), (5, "ab")]:
        v.push(tok, new)
    assert v.cut(("ab",), 2, False) == ("ab", len("<think></think>"))
    # the hold-back: the last (longest stop - 1) visible characters, the specials before them sent
    v = VisibleText(specials)
    for tok, new in pieces:
        v.push(tok, new)
    assert v.emit_upto(("xyz",)) == len("<think>ab</think>")
    assert v.emit_upto(("xyzw",)) == len("<think>a")
    assert v.emit_upto(("x",)) == len(whole)
    assert v.emit_upto(("xyz",), include=True) == len(whole)
    # a special token's text after a dangling partial character: the U+FFFD is visible
    v = VisibleText(specials)
    assert v.push(2, "\ufffd</think>") == 1 and v.text == "\ufffd"


def test_special_strings_do_not_match_by_default(reasoning_server):
    """skip_special_tokens (the default): "k>" and "<think>" never match (the reply is as
    without stops); a stop string across "</think>" matches on the text without it."""
    plain = results(reasoning_server, chat())
    assert plain == [(THINK, ANSWER, "stop", None)]
    for stop in (["k>"], ["<think>"], ["</think>"], ["<think>The"]):
        assert results(reasoning_server, chat(stop=stop)) == plain, stop
    # ".The" spans "</think>" in the engine's text: it matches on the visible text, which cuts
    # before its "." (vLLM's output text "The user wants a number.The answer is 4.")
    assert results(reasoning_server, chat(stop=[".The"])) == [(THINK[:-1], "", "stop", ".The")]
    # with include_stop_str_in_output: the cut after "The" keeps "</think>" in between
    assert results(reasoning_server, chat(stop=[".The"], include_stop_str_in_output=True)) \
        == [(THINK, "The", "stop", ".The")]


def test_plain_stop_strings_cut_as_before(reasoning_server):
    """A stop string in the visible text cuts exactly where it did (the special tokens before
    it kept: the reasoning parser still reads "<think>" / "</think>")."""
    assert results(reasoning_server, chat(stop=["number"])) == [("The user wants a ", "", "stop", "number")]
    assert results(reasoning_server, chat(stop=["answer"])) == [(THINK, "The ", "stop", "answer")]
    assert results(reasoning_server, chat(stop=["answer"], include_stop_str_in_output=True)) \
        == [(THINK, "The answer", "stop", "answer")]
    # the stop's start right after "</think>": the cut keeps it (the content empty, not reasoning)
    assert results(reasoning_server, chat(stop=["The answer"])) == [(THINK, "", "stop", "The answer")]
    # a long stop string: the stream's hold-back is of visible characters
    assert results(reasoning_server, chat(stop=["answer is 4.", "x" * 40])) \
        == [(THINK, "The ", "stop", "answer is 4.")]


def test_special_strings_match_without_skip_special_tokens(reasoning_server):
    """skip_special_tokens false: the special strings are in the output and match, as vLLM's."""
    kw = {"skip_special_tokens": False}
    assert results(reasoning_server, chat(stop=["k>"], **kw)) == [("", "<thin", "stop", "k>")]
    assert results(reasoning_server, chat(stop=["<think>"], **kw)) == [("", "", "stop", "<think>")]
    assert results(reasoning_server, chat(stop=[".The"], **kw)) == [(THINK, ANSWER, "stop", None)]
    assert results(reasoning_server, chat(stop=[".</think>T"], **kw)) == [(THINK[:-1], "", "stop", ".</think>T")]
    # tool parsing keeps the special tokens in the output (vLLM's tool parsers turn
    # skip_special_tokens off): they match
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    status, got = reasoning_server.post("/v1/chat/completions", chat(stop=["k>"], tools=tools))
    assert status == 200 and got["choices"][0]["stop_reason"] == "k>", got


def test_sampled_repro(reasoning_server, tiny_serving):
    """The break test's request: sampled choices biased towards "<think>" / "</think>" stop
    at "k>" never (the replies equal those without the stop); with skip_special_tokens false
    a choice that makes either special string ends at its "k>", its text cut before it."""
    _, tok = tiny_serving
    ids = tok.special_token_ids
    bias = {str(ids["<think>"]): 3, str(ids["</think>"]): 3}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 14, "seed": 5, "n": 3,
            "logit_bias": bias}
    free = results(reasoning_server, body)
    assert results(reasoning_server, {**body, "stop": ["k>"]}) == free
    assert results(reasoning_server, {**body, "stop": ["<think>", "</think>"]}) == free
    kept = results(reasoning_server, {**body, "skip_special_tokens": False, "stop": ["k>"]})
    assert any(r[3] == "k>" for r in kept), kept
    for reasoning, content, finish, stop_reason in kept:
        if stop_reason == "k>":
            assert (reasoning + content).endswith(("<thin", "</thin")) and finish == "stop"


def test_completions_unchanged(reasoning_server, tiny_serving):
    """/v1/completions decodes with skip_special_tokens: its text has no special strings to match."""
    _, tok = tiny_serving
    ids = tok.special_token_ids
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 14, "seed": 5, "n": 3,
            "logit_bias": {str(ids["<think>"]): 3, str(ids["</think>"]): 3}}
    status, free = reasoning_server.post("/v1/completions", body)
    assert status == 200, free
    status, got = reasoning_server.post("/v1/completions", {**body, "stop": ["k>"]})
    assert status == 200 and [c["text"] for c in got["choices"]] == [c["text"] for c in free["choices"]], got
