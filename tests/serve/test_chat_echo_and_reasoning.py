"""vLLM's chat request fields ``include_reasoning`` and ``echo``, as its serving_chat.py
answers them.

``include_reasoning: false`` with a reasoning parser: the reasoning is left out of the
message and of every delta (a step that adds only reasoning sends no chunk), and so are
the logprobs and token_ids, which spell it out; a structured-outputs constraint holds
from the first token (vLLM passes ``reasoning_ended=True`` to its engine). Without a
reasoning parser the field changes nothing.

``echo: true``: the last message's content comes before each choice's reply when its role
is the reply's ("assistant" with add_generation_prompt, else the last message's own
role); streamed, as one chunk after the role chunk. The model's output is scripted
(conftest.py's ``#script:NAME``)."""

from __future__ import annotations

import pytest

from flintc.serve.app import ServeOptions
from flintc.serve.engine import EngineObserver

MODEL = "flint-tiny"
THINK = "The user wants a number."  # conftest.SCRIPTS["think"]'s reasoning and content
ANSWER = "The answer is 4."
STOP = "Hello world. Goodbye world."  # conftest.SCRIPTS["stop"]


class Gates(EngineObserver):
    """Records whether each prefilled request's structured outputs wait for the end of
    its reasoning (``GenRequest.reasoning_gate``)."""

    def __init__(self):
        self.gates = []

    def prefilled(self, req):
        self.gates.append(req.reasoning_gate)


@pytest.fixture(scope="module")
def reasoning_server(tiny_serving, serve_kit):
    """--reasoning-parser glm47, --tool-call-parser glm47 with auto tool choice."""
    model, tok = tiny_serving
    gates = Gates()
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL, reasoning_parser="glm47", tool_call_parser="glm47",
                                                          enable_auto_tool_choice=True),
                                 max_batch=2, max_model_len=512, observers=[gates])
    run.gates = gates
    yield run
    serve_kit.stop_server(run)


@pytest.fixture(scope="module")
def plain_server(tiny_serving, serve_kit):
    """No reasoning or tool parser."""
    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL), max_batch=2, max_model_len=512)
    yield run
    serve_kit.stop_server(run)


def chat(content, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def post(run, body):
    status, got = run.post("/v1/chat/completions", body)
    assert status == 200, got
    return got


def joined(chunks, field, index=0):
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks
                   if c["choices"] and c["choices"][0]["index"] == index)


# ---- include_reasoning -------------------------------------------------------------------


def test_include_reasoning_false_leaves_the_reasoning_out(reasoning_server, tiny_serving):
    _, tok = tiny_serving
    kw = dict(max_tokens=40, logprobs=True, top_logprobs=2, return_token_ids=True)
    full = post(reasoning_server, chat("#script:think", **kw))
    m = full["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == (THINK, ANSWER)
    assert full["choices"][0]["logprobs"] is not None and full["choices"][0]["token_ids"]

    got = post(reasoning_server, chat("#script:think", include_reasoning=False, **kw))
    c = got["choices"][0]
    assert (c["message"]["content"], c["message"]["reasoning_content"], c["finish_reason"]) == (ANSWER, None, "stop")
    # vLLM: no logprobs nor token_ids, which would spell the reasoning out
    assert c["logprobs"] is None and c["token_ids"] is None
    assert got["prompt_token_ids"] == full["prompt_token_ids"]
    assert got["usage"] == full["usage"]  # every generated token still counts
    # a reply cut off inside its thinking block: no content, no reasoning
    got = post(reasoning_server, chat("#script:think_long", max_tokens=5, include_reasoning=False))
    m = got["choices"][0]["message"]
    assert (m["content"], m["reasoning_content"], got["usage"]["completion_tokens"]) == (None, None, 5)


def test_include_reasoning_false_streamed(reasoning_server):
    kw = dict(max_tokens=40, stream=True, logprobs=True, return_token_ids=True, n=2,
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    full = post(reasoning_server, chat("#script:think", **kw))
    assert (joined(full, "reasoning_content"), joined(full, "content")) == (THINK, ANSWER)
    chunks = post(reasoning_server, chat("#script:think", include_reasoning=False, **kw))
    # vLLM: a role chunk per choice first
    assert [c["choices"] for c in chunks[:2]] == [[{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}] for i in range(2)]
    body = [c for c in chunks[2:] if c["choices"]]
    for i in range(2):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == i]
        assert joined(body, "content", i) == ANSWER
        # vLLM: no chunk for a step that adds only reasoning (or nothing); logprobs and
        # token_ids on none
        assert all("reasoning_content" not in ch["delta"] for ch in mine), mine
        assert all(ch["delta"].get("content") or ch["finish_reason"] for ch in mine), mine
        assert all(ch["logprobs"] is None and ch["token_ids"] is None for ch in mine), mine
        assert mine[-1]["finish_reason"] == "stop"
    assert len(body) < len([c for c in full if c["choices"]]) - 2
    assert chunks[-1]["usage"] == full[-1]["usage"] and chunks[-1]["choices"] == []


def test_include_reasoning_false_keeps_tool_calls(reasoning_server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    for stream in (False, True):
        got = post(reasoning_server, chat("#script:think_tool", max_tokens=60, tools=tools, include_reasoning=False,
                                          stream=stream))
        if stream:
            calls = [tc for c in got if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
            assert calls[0]["function"]["name"] == "get_weather"
            assert all("reasoning_content" not in c["choices"][0]["delta"] for c in got if c["choices"])
            assert [c["choices"][0]["finish_reason"] for c in got if c["choices"]][-1] == "tool_calls"
        else:
            c = got["choices"][0]
            assert c["message"]["reasoning_content"] is None and c["finish_reason"] == "tool_calls"
            assert c["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_include_reasoning_false_constrains_from_the_first_token(reasoning_server):
    """vLLM's reasoning_ended=True: the structured output's grammar is not held back for a
    thinking block, so the reply is the constrained content from its first token."""
    gates = reasoning_server.gates
    body = chat("Yes or no?", max_tokens=20, seed=1, structured_outputs={"choice": ["yes", "no"]})
    gates.gates.clear()
    post(reasoning_server, body)
    got = post(reasoning_server, {**body, "include_reasoning": False})
    assert gates.gates[0] is not None and gates.gates[1] is None, gates.gates
    c = got["choices"][0]
    assert c["message"]["content"] in ("yes", "no") and c["message"]["reasoning_content"] is None, c
    assert c["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_keeps_the_constrained_reply_of_a_prompt_ending_in_think(reasoning_server, stream):
    """A prompt that ends inside "<think>" (here continue_final_message): with
    include_reasoning false the grammar holds from the first token, so the reply is the
    constrained content, not reasoning left out (it was: content null, no tool calls)."""
    messages = [{"role": "user", "content": "Yes or no?"}, {"role": "assistant", "content": "<think>"}]
    base = {"model": MODEL, "messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "seed": 1, "include_reasoning": False, "stream": stream}
    got = post(reasoning_server, {**base, "max_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}})
    content = joined(got, "content") if stream else got["choices"][0]["message"]["content"]
    assert content in ("yes", "no"), got
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}}]
    got = post(reasoning_server, {**base, "max_tokens": 40, "tools": tools,
                                  "tool_choice": {"type": "function", "function": {"name": "f"}}})
    if stream:
        calls = [tc for c in got if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    else:
        calls = got["choices"][0]["message"]["tool_calls"] or []
    assert calls and calls[0]["function"]["name"] == "f", got


def test_include_reasoning_without_a_reasoning_parser_changes_nothing(plain_server):
    kw = dict(max_tokens=40, logprobs=True, return_token_ids=True)
    full = post(plain_server, chat("#script:think", **kw))
    got = post(plain_server, chat("#script:think", include_reasoning=False, **kw))
    assert got["choices"] == full["choices"]
    assert got["choices"][0]["message"]["content"] == THINK + ANSWER  # the tags left out (skip_special_tokens)
    status, got = plain_server.post("/v1/chat/completions", chat("x", include_reasoning=None))
    assert status == 400 and got["error"]["param"] == "include_reasoning", got


# ---- echo --------------------------------------------------------------------------------


CONTINUE = [{"role": "user", "content": "#script:stop"}, {"role": "assistant", "content": "Well, hi"}]


@pytest.mark.parametrize("messages, flags, echoed", [
    # add_generation_prompt false: the reply's role is the last message's, always echoed
    (CONTINUE, {"add_generation_prompt": False, "continue_final_message": True}, "Well, hi"),
    ([{"role": "user", "content": "#script:stop"}], {"add_generation_prompt": False}, "#script:stop"),
    # add_generation_prompt (the default): the reply is the assistant's; only an assistant
    # message is echoed
    (CONTINUE, {}, "Well, hi"),
    ([{"role": "user", "content": "#script:stop"}], {}, ""),
    ([{"role": "system", "content": "#script:stop"},
      {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], {}, "a\nb"),
])
def test_echo_as_vllm(plain_server, messages, flags, echoed):
    body = {"model": MODEL, "messages": messages, "max_tokens": 40, "n": 2, **flags}
    # vLLM's get_chat_request_role: the last message's role without add_generation_prompt
    role = "assistant" if flags.get("add_generation_prompt", True) else messages[-1]["role"]
    plain = post(plain_server, body)
    got = post(plain_server, {**body, "echo": True})
    for i in range(2):
        assert plain["choices"][i]["message"]["content"] == STOP
        assert got["choices"][i]["message"]["content"] == echoed + STOP
        assert plain["choices"][i]["message"]["role"] == got["choices"][i]["message"]["role"] == role
    assert got["usage"] == plain["usage"]  # the echoed text is not counted
    chunks = post(plain_server, {**body, "echo": True, "stream": True, "return_token_ids": True,
                                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    # vLLM: a role chunk per choice, each with the prompt's ids and the usage so far
    assert [[(ch["index"], ch["delta"]) for ch in c["choices"]] for c in chunks[:2]] == [
        [(i, {"role": role, "content": ""})] for i in range(2)]
    assert chunks[0]["prompt_token_ids"] and chunks[1]["prompt_token_ids"] == chunks[0]["prompt_token_ids"]
    assert chunks[0]["usage"]["completion_tokens"] == chunks[1]["usage"]["completion_tokens"] == 0
    if echoed:  # then a chunk per choice holding its echo, before any generated text
        assert [[(ch["index"], ch["delta"]) for ch in c["choices"]] for c in chunks[2:4]] == [
            [(i, {"content": echoed})] for i in range(2)]
        assert chunks[2]["usage"]["completion_tokens"] == chunks[3]["usage"]["completion_tokens"] == 0
    else:
        # no echo chunk: the generated text follows the role chunks
        assert chunks[2]["choices"][0]["delta"]["content"] and "role" not in chunks[2]["choices"][0]["delta"]
    for i in range(2):
        text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"] if ch["index"] == i)
        assert text == echoed + STOP


def test_echo_makes_an_empty_content_a_string(reasoning_server):
    """vLLM writes content = echoed + (content or ""): a reply with no content (all
    reasoning) and nothing to echo has content "" instead of null."""
    body = chat("#script:think_long", max_tokens=5)
    assert post(reasoning_server, body)["choices"][0]["message"]["content"] is None
    got = post(reasoning_server, {**body, "echo": True})
    assert got["choices"][0]["message"]["content"] == ""
    assert got["choices"][0]["message"]["reasoning_content"]


def test_echo_with_reasoning_and_include_reasoning_false(reasoning_server):
    """The echo goes before the content, the reasoning stays apart (and with
    include_reasoning false, out)."""
    msgs = [{"role": "user", "content": "#script:think"}, {"role": "assistant", "content": "So: "}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 40, "echo": True}
    m = post(reasoning_server, body)["choices"][0]["message"]
    assert (m["content"], m["reasoning_content"]) == ("So: " + ANSWER, THINK)
    m = post(reasoning_server, {**body, "include_reasoning": False})["choices"][0]["message"]
    assert (m["content"], m["reasoning_content"]) == ("So: " + ANSWER, None)
    chunks = post(reasoning_server, {**body, "include_reasoning": False, "stream": True})
    assert joined(chunks, "content") == "So: " + ANSWER and not joined(chunks, "reasoning_content")
    status, got = reasoning_server.post("/v1/chat/completions", {**body, "echo": "yes"})
    assert status == 400 and got["error"]["param"] == "echo", got
