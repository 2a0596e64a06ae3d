"""`flintc serve` end to end: real uvicorn servers on loopback ports, talked to with the
official `openai` client (and raw HTTP where the client hides the wire: SSE framing,
malformed JSON, disconnects). Generated tokens are checked against the reference
`generate()` run on each prompt alone; tool calls and reasoning use the engine's
`forced_tokens` test hook (see conftest.py)."""

from __future__ import annotations

import http.client
import json
import logging
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flintc.checkpoint.tokenizer import SPECIAL_TOKENS, FlintTokenizer
from flintc.errors import CheckpointError
from flintc.sampling import SamplingParams
from flintc.serve.app import ServeOptions
from flintc.serve.reasoning import split_reasoning
from harness import reference_at_cache_length, wait_until

SCRIPTS: dict = {}  # filled from conftest.SCRIPTS by the server fixture

MODEL = "flint-tiny"
KEY = "sk-test-key"
SERVER_MAX_LEN = 1024  # the `server` fixture's max_model_len (its cache rows per slot)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]


@pytest.fixture(scope="module")
def server(tiny_serving, serve_kit):
    model, tok = tiny_serving
    SCRIPTS.update(serve_kit.SCRIPTS)
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL, api_key=KEY, enable_auto_tool_choice=True,
                                                tool_call_parser="glm47", reasoning_parser="glm47"),
                                 max_model_len=SERVER_MAX_LEN)
    yield run
    serve_kit.stop_server(run)


@pytest.fixture(scope="module")
def plain_server(tiny_serving, serve_kit):
    """No tool parser or reasoning parser, --exclude-tools-when-tool-choice-none, no key."""
    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL, exclude_tools_when_tool_choice_none=True),
                       max_batch=2, max_model_len=1024)
    yield run
    serve_kit.stop_server(run)


@pytest.fixture(scope="module")
def capped_server(tiny_serving, serve_kit):
    """--max-request-bytes 2048, no key."""
    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL, max_request_bytes=2048), max_batch=1,
                                 max_model_len=256)
    yield run
    serve_kit.stop_server(run)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def reference(model, prompt_ids, **kw):
    """Tokens and per-step logits of the reference model on this prompt alone, with the
    `server` fixture's cache length (`harness.reference_at_cache_length`)."""
    res = reference_at_cache_length(model, prompt_ids, SamplingParams(**kw), SERVER_MAX_LEN, keep_step_logits=True)
    return res.output_ids[0], res.step_logits


def raw(server, method, path, body=None, headers=None, timeout=120):
    """One HTTP request without the openai client (`Running.request`: with the server's
    API key). -> (status, parsed JSON or text)."""
    status, text = server.request(method, path, body, headers, timeout)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def chat(messages_text, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": messages_text}], **kw}


def stream_chat(client, **kw):
    """Stream a chat completion. -> (reasoning, content, tool calls by index, chunks)."""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    reasoning, content, calls = [], [], {}
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            reasoning.append(getattr(d, "reasoning_content", None) or "")
            content.append(d.content or "")
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
    return "".join(reasoning), "".join(content), calls, chunks


# ---- basics ----------------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = raw(server, "GET", "/health", headers={"Authorization": ""})
    assert (status, body) == (200, {"status": "ok"})


def test_plain_chat_matches_reference(server, client, tiny_serving):
    model, tok = tiny_serving
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a city."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, seed=7,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids = tok.apply_chat_template(messages, tokenize=True)
    want, _ = reference(model, prompt_ids, max_tokens=6, seed=7, ignore_eos=True)
    assert r.prompt_token_ids == prompt_ids
    assert r.choices[0].token_ids == want
    reasoning, content = split_reasoning(tok.decode(want))
    assert r.choices[0].message.content == content
    assert getattr(r.choices[0].message, "reasoning_content", None) == reasoning
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 6)
    assert r.object == "chat.completion" and r.model == MODEL


def test_streaming_chat_equals_non_streaming(server, client):
    kw = chat("Tell me a story.", model=MODEL, max_tokens=8, seed=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    reasoning, content, _, chunks = stream_chat(client, stream_options={"include_usage": True}, **kw)
    m = whole.choices[0].message
    assert (getattr(m, "reasoning_content", None) or "", m.content or "") == (reasoning, content)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # SSE framing on the wire: data lines, ending with [DONE]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    wire = {k: v for k, v in kw.items() if k != "extra_body"}
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**wire, "ignore_eos": True, "stream": True}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == content


# ---- reasoning and tools (scripted model output) ------------------------------------------


def test_reasoning_split(client, tiny_serving):
    _, tok = tiny_serving
    r = client.chat.completions.create(**chat("#script:think", model=MODEL, max_tokens=40))
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == (
        "The user wants a number.", "The answer is 4.", "stop")
    reasoning, content, _, _ = stream_chat(client, **chat("#script:think", model=MODEL, max_tokens=40))
    assert (reasoning, content) == ("The user wants a number.", "The answer is 4.")
    # cut off inside the thinking block: every generated token's text is kept as reasoning
    ids = tok.encode(SCRIPTS["think_long"])
    r = client.chat.completions.create(**chat("#script:think_long", model=MODEL, max_tokens=5))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].message.reasoning_content == tok.decode(ids[1:5])
    assert r.choices[0].message.content is None
    reasoning, content, _, _ = stream_chat(client, **chat("#script:think_long", model=MODEL, max_tokens=5))
    assert (reasoning, content) == (tok.decode(ids[1:5]), "")
    # thinking disabled by the template: the reply is all content; the tags (special tokens)
    # are left out by default (skip_special_tokens, as vLLM), kept with it false
    r = client.chat.completions.create(**chat("#script:think", model=MODEL, max_tokens=40,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert r.choices[0].message.content == "The user wants a number.The answer is 4."
    r = client.chat.completions.create(**chat("#script:think", model=MODEL, max_tokens=40, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}, "skip_special_tokens": False}))
    assert r.choices[0].message.content == SCRIPTS["think"]


def test_tool_calls(client):
    r = client.chat.completions.create(**chat("#script:tool", model=MODEL, max_tokens=80, tools=TOOLS))
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
    assert len({t.id for t in c.message.tool_calls}) == 2
    _, content, calls, chunks = stream_chat(client, **chat("#script:tool", model=MODEL, max_tokens=80, tools=TOOLS))
    assert content == "Let me check."
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == got
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # reasoning before a call
    r = client.chat.completions.create(**chat("#script:think_tool", model=MODEL, max_tokens=80, tools=TOOLS))
    m = r.choices[0].message
    assert m.reasoning_content == "Weather needs a tool." and m.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    # a malformed call is plain content, not a failure
    r = client.chat.completions.create(**chat("#script:bad_tool", model=MODEL, max_tokens=80, tools=TOOLS))
    assert r.choices[0].message.content == SCRIPTS["bad_tool"] and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_tool_calls_parallel_false_keeps_the_first(client):
    """parallel_tool_calls false: of the two parsed calls the message keeps the first, and
    a stream sends only the deltas of index 0 (vLLM's maybe_filter_parallel_tool_calls);
    finish_reason stays "tool_calls"."""
    kw = chat("#script:tool", model=MODEL, max_tokens=80, tools=TOOLS, parallel_tool_calls=False)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    _, content, calls, chunks = stream_chat(client, **kw)
    assert content == "Let me check." and list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_tool_history_rendered(client, tiny_serving):
    """An assistant turn with OpenAI tool_calls (arguments as a JSON string) and a tool result."""
    _, tok = tiny_serving
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\", \"days\": 2}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1,
                                       extra_body={"return_token_ids": True})
    text = tok.decode(r.prompt_token_ids)
    assert ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>") in text
    assert "<|observation|>\n<tool_response>sunny</tool_response><|assistant|>\n" in text


def test_tool_choice_none_with_and_without_exclude(server, plain_server, client, tiny_serving):
    _, tok = tiny_serving
    kw = chat("#script:tool", model=MODEL, max_tokens=80, tools=TOOLS, tool_choice="none",
              extra_body={"return_token_ids": True})
    r = client.chat.completions.create(**kw)
    prompt = tok.decode(r.prompt_token_ids)
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt
    assert r.choices[0].message.tool_calls is None  # not parsed with tool_choice none
    # the tags are special tokens: left out by default (vLLM's skip_special_tokens), kept without it
    assert r.choices[0].message.content == tok.decode(tok.encode(SCRIPTS["tool"]), skip_special_tokens=True)
    raw_kw = {**kw, "extra_body": {**kw["extra_body"], "skip_special_tokens": False}}
    assert client.chat.completions.create(**raw_kw).choices[0].message.content == SCRIPTS["tool"]
    plain = openai.OpenAI(base_url=plain_server.base_url, api_key="unused", max_retries=0, timeout=120)
    r = plain.chat.completions.create(**kw)
    prompt = tok.decode(r.prompt_token_ids)
    assert "# Tools" not in prompt and "get_weather" not in prompt
    assert prompt == tok.apply_chat_template([{"role": "user", "content": "#script:tool"}])
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        plain.chat.completions.create(**{**kw, "tool_choice": "auto"})


# ---- sampling options ------------------------------------------------------------------


def test_stop_strings(client):
    r = client.chat.completions.create(**chat("#script:stop", model=MODEL, max_tokens=40, stop=["Goodbye"]))
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hello world. ", "stop")
    _, content, _, _ = stream_chat(client, **chat("#script:stop", model=MODEL, max_tokens=40, stop="d. G"))
    assert content == "Hello worl"
    # any number of stop strings, as vLLM (a fifth was a 400: OpenAI's limit of 4)
    many = [f"zz{i}" for i in range(40)] + ["Goodbye"]
    r = client.chat.completions.create(**chat("#script:stop", model=MODEL, max_tokens=40, stop=many))
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hello world. ", "stop")
    # a long stop string holds back its length - 1 characters while streaming (vLLM's
    # stop buffer), then sends them when the sequence ends without it
    long_stop = "x" * 200
    _, content, _, chunks = stream_chat(client, **chat("#script:stop", model=MODEL, max_tokens=40, stop=long_stop))
    plain = client.chat.completions.create(**chat("#script:stop", model=MODEL, max_tokens=40))
    assert content == plain.choices[0].message.content


def test_penalties_min_p_and_logit_bias_match_reference(server, client, tiny_serving):
    """vLLM's sampling fields (presence / frequency / repetition penalties, min_p,
    logit_bias) give the reference generate's tokens with the same SamplingParams, greedy
    and seeded, on completions and chat; logit_bias +100 makes greedy pick the token;
    a bias beyond 100 is clamped (as vLLM)."""
    model, tok = tiny_serving
    prompt = [5, 77, 300, 12]
    fields = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.05)
    for kw in (dict(temperature=0), dict(temperature=0.8, seed=3)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **kw,
                                      presence_penalty=fields["presence_penalty"],
                                      frequency_penalty=fields["frequency_penalty"],
                                      extra_body={"ignore_eos": True, "return_token_ids": True,
                                                  "repetition_penalty": fields["repetition_penalty"],
                                                  "min_p": fields["min_p"]})
        want, _ = reference(model, prompt, max_tokens=8, ignore_eos=True, **kw, **fields)
        plain, _ = reference(model, prompt, max_tokens=8, ignore_eos=True, **kw)
        assert r.choices[0].token_ids == want and want != plain, kw
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  logit_bias={"42": 100}, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [42] * 4
    status, body = raw(server, "POST", "/v1/chat/completions",
                       chat("Hi", model=MODEL, max_tokens=3, temperature=0, logit_bias={"43": 1e6},
                            return_token_ids=True))
    assert status == 200 and body["choices"][0]["token_ids"] == [43] * 3


def test_min_tokens_masks_stop_tokens_and_defers_stop_strings(client, tiny_serving):
    """min_tokens (vLLM's): with EOS made the likeliest token, a request ends at once
    without min_tokens and after exactly min_tokens tokens plus the EOS with it (chat and
    completions); a stop string inside the first min_tokens tokens is not looked for."""
    model, tok = tiny_serving
    eos = {str(tok.eos_token_id): 100}
    r = client.chat.completions.create(**chat("Hi", model=MODEL, max_tokens=20, logit_bias=eos))
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(**chat("Hi", model=MODEL, max_tokens=20, logit_bias=eos,
                                              extra_body={"min_tokens": 5, "return_token_ids": True}))
    ids = r.choices[0].token_ids
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop", ids
    assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:5]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, logit_bias=eos, seed=2,
                                  extra_body={"min_tokens": 7})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "stop"
    script = tok.encode(SCRIPTS["stop"])
    n = next(i for i in range(1, len(script) + 1) if "world" in tok.decode(script[:i]))
    r = client.chat.completions.create(**chat("#script:stop", model=MODEL, max_tokens=40, stop=["world"]))
    assert r.choices[0].message.content == "Hello "
    r = client.chat.completions.create(**chat("#script:stop", model=MODEL, max_tokens=40, stop=["world"],
                                              extra_body={"min_tokens": n}))
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hello world. Goodbye ", "stop")


def test_logprobs_match_reference(client, tiny_serving):
    model, tok = tiny_serving
    messages = [{"role": "user", "content": "Count."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    want, step_logits = reference(model, tok.apply_chat_template(messages, tokenize=True),
                                  max_tokens=4, temperature=0, ignore_eos=True)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 4
    for k, (e, tid) in enumerate(zip(entries, want)):
        lsm = torch.log_softmax(step_logits[k][0], -1)
        assert e.token == tok.token_bytes(tid).decode("utf-8", "replace")
        assert abs(e.logprob - float(lsm[tid])) < 1e-5
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert len(e.top_logprobs) == 3 and abs(e.top_logprobs[0].logprob - float(lsm.max())) < 1e-5
        assert e.top_logprobs[0].token == e.token  # greedy picks the top token


def test_completions_n_seed_logprobs(client, tiny_serving):
    model, tok = tiny_serving
    prompt = [5, 77, 300, 12]
    r = client.completions.create(model=MODEL, prompt=prompt, n=2, seed=11, max_tokens=5, logprobs=2,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert len(r.choices) == 2 and r.usage.completion_tokens == 10
    for j, c in enumerate(r.choices):
        want, _ = reference(model, prompt, max_tokens=5, seed=11 + j, ignore_eos=True)
        assert c.token_ids == want and c.text == tok.decode(want)
        assert len(c.logprobs.tokens) == 5 and all(len(t) <= 3 for t in c.logprobs.top_logprobs)
    # streaming completions with a text prompt
    parts = list(client.completions.create(model=MODEL, prompt="The model", max_tokens=4, seed=1, stream=True,
                                           extra_body={"ignore_eos": True}))
    whole = client.completions.create(model=MODEL, prompt="The model", max_tokens=4, seed=1,
                                      extra_body={"ignore_eos": True})
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"


def test_completions_echo_as_vllm(client, tiny_serving):
    """`echo` on /v1/completions (a 400 before): each choice's text starts with its prompt,
    and with `logprobs` its logprobs with the prompt's (the first token's null), as vLLM;
    `max_tokens` 0 gives the prompt alone (lm-eval's loglikelihood requests:
    echo, max_tokens 0, logprobs 1, temperature 0). Streamed, the first chunk holds the
    prompt."""
    model, tok = tiny_serving
    prompt = [5, 77, 300, 12]
    plp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 1}).choices[0].prompt_logprobs
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == tok.decode(prompt) and r.usage.prompt_tokens == 4
    lp = c.logprobs
    assert lp.tokens == [tok.token_bytes(t).decode("utf-8", "replace") for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for k in range(1, 4):
        want = plp[k][str(prompt[k])]["logprob"]
        assert abs(lp.token_logprobs[k] - want) < 1e-5
        assert lp.top_logprobs[k][lp.tokens[k]] == lp.token_logprobs[k] and 1 <= len(lp.top_logprobs[k]) <= 2
    # with generation: the prompt, then the generated tokens (as without echo)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=3, seed=3, logprobs=2, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    both = client.completions.create(echo=True, n=2, **kw).choices
    assert both[0].text == tok.decode(prompt) + plain.text
    assert both[0].logprobs.tokens == lp.tokens + plain.logprobs.tokens
    assert both[0].logprobs.token_logprobs[4:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    assert both[1].text.startswith(tok.decode(prompt)) and len(both[1].logprobs.tokens) == 7
    # a text prompt is echoed as sent; streamed, the first chunk starts with it
    r = client.completions.create(model=MODEL, prompt=["The model", "A b"], max_tokens=2, seed=1, echo=True,
                                  extra_body={"ignore_eos": True})
    assert [c.text[:len(p)] for c, p in zip(r.choices, ["The model", "A b"])] == ["The model", "A b"]
    parts = list(client.completions.create(model=MODEL, prompt="The model", max_tokens=2, seed=1, echo=True,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert parts[0].choices[0].text.startswith("The model")
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text


def test_negative_seeds_as_vllm_takes_them(client, tiny_serving):
    """vLLM takes any 64-bit seed (it was a 400 here): -1 means no seed, as in vLLM (three
    requests do not all draw alike), another negative one is taken modulo 2**63 (-2 with
    n = 2: choices seeded 2**63 - 2 and 2**63 - 1; -2**63: 0)."""
    model, _ = tiny_serving
    prompt = [5, 77, 300, 12]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(seed=-2, n=2, **kw)
    want = [reference(model, prompt, max_tokens=5, seed=s, ignore_eos=True)[0] for s in (2**63 - 2, 2**63 - 1)]
    assert [c.token_ids for c in r.choices] == want
    assert client.completions.create(seed=-2**63, **kw).choices[0].token_ids == \
        reference(model, prompt, max_tokens=5, seed=0, ignore_eos=True)[0]
    kw.update(max_tokens=16, extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 0})
    drawn = {tuple(client.completions.create(seed=-1, **kw).choices[0].token_ids) for _ in range(3)}
    assert len(drawn) > 1, "seed -1 drew the same 16 tokens three times: seeded, not random"


# ---- batching, queueing, disconnects -----------------------------------------------------


def test_concurrent_requests_batched_and_not_mixed(server, client, tiny_serving, monkeypatch):
    model, _ = tiny_serving
    engine = server.engine
    decode = engine.runner.decode
    arrived = []  # [whether all 10 came before the first decode step]

    def gated_decode(*args, **kwargs):
        # the first decode step waits until all 10 requests are in the engine (running or
        # queued): on a loaded machine the client threads could otherwise send them one
        # after another, each done (6 steps, a few ms) before the next came, a batch of 1
        if not arrived:
            arrived.append(wait_until(lambda: engine.num_running + engine.num_waiting == len(jobs), timeout=60))
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "decode", gated_decode)
    g = torch.Generator().manual_seed(1234)
    jobs = []
    for i in range(10):  # 10 requests, 4 slots: some wait in the queue
        prompt = torch.randint(0, 499, (3 + 2 * i,), generator=g).tolist()
        kw = {"temperature": 0} if i % 2 else {"seed": 100 + i}
        jobs.append((prompt, kw))
    server.engine.stats.clear()

    def one(job):
        prompt, kw = job
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                         extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    for (prompt, kw), r in zip(jobs, results):
        want, _ = reference(model, prompt, max_tokens=6, ignore_eos=True, **kw)
        assert r.choices[0].prompt_token_ids == prompt
        assert r.choices[0].token_ids == want
    stats = server.engine.stats
    assert arrived == [True] and 2 <= stats["max_decode_batch"] <= 4, (arrived, dict(stats))
    assert stats["finished"] == 10 and stats["prefills"] == 10, dict(stats)


def _hold_decode(monkeypatch, runner, seconds=0.05):
    """Hold each of ``runner``'s decode steps ``seconds``: the tiny model runs 1,000 steps
    in about a second, so a request of 200-1,000 tokens can end inside a window the test
    thread, descheduled on a loaded machine, misses (it must see the request running,
    waiting, or hang up on it first); held 50 ms, 200 steps last 10 s."""
    decode = runner.decode

    def held_decode(*args, **kwargs):
        time.sleep(seconds)
        return decode(*args, **kwargs)

    monkeypatch.setattr(runner, "decode", held_decode)


def test_disconnect_frees_slot(server, client, monkeypatch):
    engine = server.engine
    _hold_decode(monkeypatch, engine.runner)  # 200 steps: 10 s to see it running, hang up, see it aborted
    engine.stats.clear()
    body = json.dumps(chat("Go on.", model=MODEL, max_tokens=200, stream=True, ignore_eos=True))
    # streamed: read a few events, then hang up
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    for _ in range(4):
        assert resp.readline().startswith(b"data: ")
        assert resp.readline() == b"\n"
    assert engine.num_running == 1, dict(engine.stats)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert wait_until(lambda: engine.num_running == 0), "the slot was not freed"
    assert engine.stats["aborted"] == 1 and engine.stats["decode_tokens"] < 150, dict(engine.stats)
    # not streamed: hang up while it generates
    sock = socket.create_connection(("127.0.0.1", server.port))
    data = body.replace('"stream": true', '"stream": false').encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    assert wait_until(lambda: engine.num_running == 1), dict(engine.stats)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    assert wait_until(lambda: engine.num_running == 0), "the slot was not freed"
    assert engine.stats["aborted"] == 2, dict(engine.stats)
    monkeypatch.undo()
    # and the server keeps serving
    r = client.chat.completions.create(**chat("Hi", model=MODEL, max_tokens=2))
    assert r.choices[0].finish_reason in ("length", "stop")


# ---- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("patch,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"stop": ["a", ""]}, "stop"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.5}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 3}, "min_tokens"),  # more than max_tokens (2)
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),  # the tiny vocabulary is 512
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
    ({"temperature": "hot"}, "temperature"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    # a 500 (TypeError: 'int' object is not iterable / AttributeError: no attribute 'get') before
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": 5}, {"role": "user", "content": "x"}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": "f()"}, {"role": "user", "content": "x"}]},
     "messages[0].tool_calls"),
    # a falsy non-list ({}, "", 0, false) was checked after content, so the 400 named content
    *(({"messages": [{"role": "assistant", "tool_calls": bad}, {"role": "user", "content": "x"}]},
       "messages[0].tool_calls") for bad in ({}, "", 0, False)),
    # arguments nested past Python's recursion limit: a 500 (RecursionError) before
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "f", "arguments": '{"a": ' + "[" * 5000 + "]" * 5000 + "}"}}]}, {"role": "user", "content": "x"}]},
     "messages[0].tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
])
def test_bad_request_values(server, patch, param):
    status, body = raw(server, "POST", "/v1/chat/completions", {**chat("hi", model=MODEL, max_tokens=2), **patch})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["message"]


@pytest.mark.parametrize("content_type, ok", [
    ("text/plain", False),  # needs no CORS preflight: any web page could post it to localhost
    ("application/x-www-form-urlencoded", False),  # curl -d's default
    ("multipart/form-data; boundary=x", False),
    ("application/json; charset=utf-8", True),
    ("application/vnd.api+json", True),
    (None, True),  # no Content-Type: parsed as JSON, as FastAPI does
])
def test_only_json_bodies_are_parsed(server, content_type, ok):
    """A body declared as anything but JSON is a 400 naming the type (FastAPI's, and so
    vLLM's, rule since CVE-2021-32677); before, `text/plain` got a completion."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    headers = {"Authorization": f"Bearer {KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
                 headers=headers)
    resp = conn.getresponse()
    body = json.loads(resp.read().decode())
    conn.close()
    if ok:
        assert resp.status == 200 and body["choices"][0]["text"] is not None, body
    else:
        assert resp.status == 400 and body["error"]["code"] == "invalid_content_type", body
        assert repr(content_type) in body["error"]["message"]


def test_error_cases(server, client):
    status, body = raw(server, "POST", "/v1/chat/completions", b'{"model": "flint-tiny", "messages": [')
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        client.chat.completions.create(**chat("hi", model="gpt-9", max_tokens=2))
    assert e.value.status_code == 404
    with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
        client.chat.completions.create(**chat("word " * 1100, model=MODEL, max_tokens=2))
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.completions.create(model=MODEL, prompt=[1] * 1000, max_tokens=100)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, 100000], max_tokens=1)
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(**chat("hi", model=MODEL, max_tokens=2))
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, body = raw(server, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["message"]
    # still serving
    r = client.chat.completions.create(**chat("Hi", model=MODEL, max_tokens=2))
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", rb'{"model": "flint-tiny", "prompt": "\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", rb'{"model": "flint-tiny", "prompt": "a\udc00b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", rb'{"model": "flint-tiny", "prompt": ["ok", "\ud800abc"]}', "prompt[1]"),
    ("/v1/chat/completions", rb'{"model": "flint-tiny", "messages": [{"role": "user", "content": "\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", rb'{"model": "flint-tiny", "messages": [], "\udc00": 1}', "\\udc00"),
    ("/v1/chat/completions", b'{"model": "flint-tiny", "messages": [', None),
    # nested past Python's recursion limit: json.loads raised RecursionError, a 500 with a
    # traceback in the server's log
    pytest.param("/v1/completions", b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}", None,
                 id="completions-nested-5000"),
    pytest.param("/tokenize", b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}", None,
                 id="tokenize-nested-5000"),
])
def test_malformed_json_has_code_invalid_json(server, path, body, param):
    """A lone-surrogate escape (which json.loads takes, pydantic not) was a 400 "invalid
    value for 'body'" with code null, then "malformed JSON: unexpected end of hex escape";
    any malformed body is code invalid_json, and a lone surrogate is named as one, with
    the field that holds it."""
    status, got = raw(server, "POST", path, body)
    assert status == 400, got
    err = got["error"]
    assert err["code"] == "invalid_json" and err["param"] == param, err
    assert err["message"].startswith("malformed JSON in the request body: "), err
    if param is not None:
        assert "lone UTF-16 surrogate" in err["message"] and f"'{param}'" in err["message"], err
        assert "hex escape" not in err["message"], err


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32-be"])
def test_json_body_with_a_bom_or_in_utf16_utf32_is_read(server, encoding):
    """A body with a UTF-8 byte-order mark, or in UTF-16 / UTF-32 (RFC 8259 8.1: a reader
    may take them), was a 400 "malformed JSON ... expected value at line 1 column 1":
    json.loads takes them (vLLM's FastAPI reads bodies so) and pydantic, reading UTF-8
    only, did not. Non-ASCII text survives the re-encoding."""
    body = {"model": MODEL, "prompt": "h\u00e9llo \U0001f600", "max_tokens": 2, "temperature": 0,
            "return_token_ids": True}
    status, want = raw(server, "POST", "/v1/completions", json.dumps(body, ensure_ascii=False).encode())
    assert status == 200, want
    status, got = raw(server, "POST", "/v1/completions", json.dumps(body, ensure_ascii=False).encode(encoding))
    assert status == 200, got
    assert got["choices"][0]["prompt_token_ids"] == want["choices"][0]["prompt_token_ids"]
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


def test_request_body_over_max_request_bytes_is_a_413(capped_server):
    """Request bodies were read and parsed whatever their size (a 5M-token-id body held the
    event loop for 3-4 s). One over --max-request-bytes is a 413 in the OpenAI error
    format: by its Content-Length before the body is read (here one never sent), or once
    a chunked body grows past the cap. The server keeps serving."""
    small = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1}
    big = json.dumps({**small, "prompt": [1] * 1000}).encode()  # about 3 KB

    def check(status, body, size=None):
        assert status == 413, body
        err = body["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large", err
        assert err["param"] is None and set(err) == {"message", "type", "param", "code"}, err
        assert err["message"].startswith("the request body is over the limit of 2048 bytes (--max-request-bytes)"), err
        if size is not None:
            assert f"Content-Length {size}" in err["message"], err

    assert raw(capped_server, "POST", "/v1/completions", small)[0] == 200
    for path in ("/v1/completions", "/v1/chat/completions"):
        check(*raw(capped_server, "POST", path, big), size=len(big))
    # a Content-Length over the cap is answered without waiting for the body
    conn = http.client.HTTPConnection("127.0.0.1", capped_server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(10**9))
    conn.endheaders(b"{")
    resp = conn.getresponse()
    check(resp.status, json.loads(resp.read()), size=10**9)
    conn.close()
    # chunked: no Content-Length, the cap is met while reading
    for pieces in ([big[i:i + 500] for i in range(0, len(big), 500)], [big]):
        conn = http.client.HTTPConnection("127.0.0.1", capped_server.port, timeout=30)
        conn.request("POST", "/v1/completions", body=iter(pieces), headers={"Content-Type": "application/json"},
                     encode_chunked=True)
        resp = conn.getresponse()
        check(resp.status, json.loads(resp.read()))
        conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", capped_server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=iter([json.dumps(small).encode()]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    assert conn.getresponse().status == 200
    conn.close()
    assert raw(capped_server, "GET", "/health") == (200, {"status": "ok"})


def test_over_length_error_names_the_prompt_field(server):
    """The context-length error names the field holding the prompt: "prompt" for
    /v1/completions, "messages" for /v1/chat/completions."""
    status, body = raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": [1] * 1100, "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert body["error"]["param"] == "prompt"
    status, body = raw(server, "POST", "/v1/chat/completions", chat("word " * 1100, max_tokens=2))
    assert status == 400 and body["error"]["param"] == "messages", body
    status, body = raw(server, "POST", "/v1/chat/completions", chat("hi", max_completion_tokens=5000))
    assert status == 400 and body["error"]["param"] == "max_completion_tokens", body


def test_max_completion_tokens_wins_over_max_tokens(server):
    """Both given (and different): max_completion_tokens counts, as vLLM's
    `max_completion_tokens or max_tokens`; it was a 400 ("disagree")."""
    status, body = raw(server, "POST", "/v1/chat/completions",
                       chat("hi", max_tokens=2, max_completion_tokens=3, ignore_eos=True))
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body


# ---- vLLM's other endpoints: /version, /v1/models/{model}, /tokenize, /detokenize, /metrics -----


def test_version_and_model_by_id(server, client):
    import flintc

    assert flintc.__version__
    assert raw(server, "GET", "/version", headers={"Authorization": ""}) == (200, {"version": flintc.__version__})
    status, card = raw(server, "GET", f"/v1/models/{MODEL}")
    assert status == 200, card
    listed = raw(server, "GET", "/v1/models")[1]["data"][0]
    assert {**card, "created": 0} == {**listed, "created": 0}
    assert card["id"] == MODEL and card["max_model_len"] == 1024
    assert client.models.retrieve(MODEL).id == MODEL
    for other in ("gpt-9", "org/flint-tiny"):  # a model id may hold a slash
        status, body = raw(server, "GET", f"/v1/models/{other}")
        assert status == 404, body
        assert body["error"] == {"message": f"the model '{other}' does not exist; this server serves '{MODEL}'",
                                 "type": "not_found_error", "param": "model", "code": "model_not_found"}
    status, body = raw(server, "GET", f"/v1/models/{MODEL}", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body


def test_tokenize_equals_what_chat_and_completions_feed_the_model(server, tiny_serving):
    _, tok = tiny_serving
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Name a city."}]
    as_template = [{"role": "system", "content": "Be brief."}, messages[1]]  # developer renders as system

    def tokenize(**body):
        status, got = raw(server, "POST", "/tokenize", {"model": MODEL, **body})
        assert status == 200, got
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 1024, got
        return got

    got = tokenize(messages=messages)
    want = tok.encode(tok.apply_chat_template(as_template, add_generation_prompt=True))
    assert got == {"count": len(want), "max_model_len": 1024, "tokens": want}
    status, r = raw(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                                              "return_token_ids": True})
    assert status == 200 and r["prompt_token_ids"] == want, r
    assert tokenize(messages=messages, add_generation_prompt=False)["tokens"] == \
        tok.encode(tok.apply_chat_template(as_template, add_generation_prompt=False)) != want
    assert tokenize(messages=messages, chat_template_kwargs={"enable_thinking": False})["tokens"] == \
        tok.encode(tok.apply_chat_template(as_template, enable_thinking=False)) != want
    assert tokenize(messages=messages, tools=TOOLS)["tokens"] == \
        tok.encode(tok.apply_chat_template(as_template, tools=TOOLS)) != want
    text = "Hello <|user|> wörld"
    got = tokenize(prompt=text, return_token_strs=True)
    assert got["tokens"] == tok.encode(text) == tokenize(prompt=text, add_special_tokens=False)["tokens"]
    assert got["token_strs"] == [tok._tok.id_to_token(i) for i in got["tokens"]] and "<|user|>" in got["token_strs"]
    status, r = raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1,
                                                         "return_token_ids": True})
    assert status == 200 and r["choices"][0]["prompt_token_ids"] == got["tokens"], r
    assert raw(server, "POST", "/detokenize", {"model": MODEL, "tokens": got["tokens"]}) == (200, {"prompt": text})
    assert raw(server, "POST", "/detokenize", {"tokens": []}) == (200, {"prompt": ""})
    assert tokenize(prompt="") == {"count": 0, "max_model_len": 1024, "tokens": []}


@pytest.mark.parametrize("path, body, status, param, needle", [
    ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens", "token id 100000 is outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "token id -1 is outside the vocabulary"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "invalid value for 'tokens'"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]", "invalid value for 'tokens[0]'"),  # was 'tokens.0'
    ("/detokenize", {"tokens": [True]}, 400, "tokens[0]", "invalid value for 'tokens[0]'"),
    ("/detokenize", {}, 400, "tokens", "invalid value for 'tokens'"),
    ("/detokenize", {"tokens": [1], "model": "gpt-9"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "invalid value for 'prompt'"),
    ("/tokenize", {}, 400, "prompt", "invalid value for 'prompt'"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", "invalid value"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, 400, "bogus", "Unrecognized request argument supplied: bogus"),
    ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model", "does not exist"),
    ("/tokenize", {"messages": "hi"}, 400, "messages", "invalid value for 'messages'"),
    ("/tokenize", {"messages": []}, 400, "messages", "'messages' must hold at least one message"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "wizard"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs", "may not set ['tools']"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools[0]", "tools[0] must be"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message", "cannot both be true"),
])
def test_tokenize_detokenize_errors(server, path, body, status, param, needle):
    got_status, got = raw(server, "POST", path, body)
    assert got_status == status, got
    err = got["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error"), err
    assert needle in err["message"], err


def test_tokenize_detokenize_need_the_key(server):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        status, got = raw(server, "POST", path, body, headers={"Authorization": ""})
        assert status == 401 and got["error"]["code"] == "invalid_api_key", got
    status, got = raw(server, "POST", "/tokenize", b'{"prompt": ')
    assert status == 400 and got["error"]["code"] == "invalid_json", got


def test_tokenize_add_special_tokens_as_vllm(tiny_serving, serve_kit):
    """With a tokenizer whose post-processor adds a token (a BOS), /tokenize adds it to
    a prompt by default and to a chat only with add_special_tokens (vLLM's defaults);
    a tokenizer with no chat template answers messages with the chat 400."""
    from tokenizers import Tokenizer, processors

    model, tok = tiny_serving
    inner = Tokenizer.from_str(tok._tok.to_str())
    bos = tok.eos_token_id
    inner.post_processor = processors.TemplateProcessing(single=f"{tok.eos_token} $A",
                                                         special_tokens=[(tok.eos_token, bos)])
    with_bos = FlintTokenizer(inner, {k: v for k, v in tok.config.items() if k != "chat_template"})
    with_bos._template_sources = {"default": (tok.config["chat_template"], "test")}
    run = serve_kit.start_server(model, with_bos, ServeOptions(MODEL), max_batch=1)
    try:
        plain = tok.encode("Hello there")
        assert raw(run, "POST", "/tokenize", {"prompt": "Hello there"})[1]["tokens"] == [bos, *plain]
        assert raw(run, "POST", "/tokenize", {"prompt": "Hello there", "add_special_tokens": False})[1]["tokens"] \
            == plain
        messages = [{"role": "user", "content": "Hi"}]
        chat_ids = tok.encode(tok.apply_chat_template(messages))
        assert raw(run, "POST", "/tokenize", {"messages": messages})[1]["tokens"] == chat_ids
        assert raw(run, "POST", "/tokenize", {"messages": messages, "add_special_tokens": True})[1]["tokens"] \
            == [bos, *chat_ids]
        # what the completion routes feed the model: the same defaults (vLLM's; completions
        # added no BOS before)
        for extra, want in (({}, [bos, *plain]), ({"add_special_tokens": False}, plain)):
            status, got = raw(run, "POST", "/v1/completions", {"prompt": "Hello there", "max_tokens": 1,
                                                               "return_token_ids": True, **extra})
            assert status == 200 and got["choices"][0]["prompt_token_ids"] == want, got
        for extra, want in (({}, chat_ids), ({"add_special_tokens": True}, [bos, *chat_ids])):
            status, got = raw(run, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                                    "return_token_ids": True, **extra})
            assert status == 200 and got["prompt_token_ids"] == want, got
    finally:
        serve_kit.stop_server(run)
    run = serve_kit.start_server(model, with_template(tok, drop=True), ServeOptions(MODEL), max_batch=1)
    try:
        status, body = raw(run, "POST", "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
        assert status == 400 and body["error"]["message"].startswith("this model has no chat template"), body
        assert raw(run, "POST", "/tokenize", {"prompt": "Hi"})[1]["tokens"] == tok.encode("Hi")
    finally:
        serve_kit.stop_server(run)


def scrape(server) -> dict:
    """GET /metrics (no key), parsed. -> {(sample name, finished_reason or le): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain; version=0.0.4"), text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL and labels.pop("engine") == "0", sample
            key = (sample.name, labels.pop("finished_reason", None) or labels.pop("le", None))
            assert not labels and key not in out, sample
            out[key] = sample.value
    return out


def test_metrics_count_what_the_engine_did(server, plain_server):
    before, other_before = scrape(server), scrape(plain_server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
                 "vllm:request_inference_time_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum",
                 "vllm:request_params_max_tokens_sum"):
        assert (name, None) in before, name
    assert before[("vllm:time_to_first_token_seconds_bucket", "2560.0")] >= 0
    assert before[("vllm:request_prompt_tokens_bucket", "1000.0")] >= 0  # 1-2-5 buckets up to max_model_len
    status, r = raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7, 8, 9, 10, 11],
                                                         "max_tokens": 5, "ignore_eos": True})
    assert status == 200 and r["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}, r
    status, c = raw(server, "POST", "/v1/chat/completions", chat("Hi", max_tokens=3))
    assert status == 200, c
    after = scrape(server)

    def delta(name, label=None):
        return after[(name, label)] - before.get((name, label), 0)

    assert delta("vllm:prompt_tokens_total") == 7 + c["usage"]["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == 5 + c["usage"]["completion_tokens"]
    assert delta("vllm:request_success_total", "length") + delta("vllm:request_success_total", "stop") == 2
    assert delta("vllm:request_success_total", c["choices"][0]["finish_reason"]) >= 1
    assert delta("vllm:request_success_total", "abort") == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    gaps = 4 + c["usage"]["completion_tokens"] - 1
    assert delta("vllm:inter_token_latency_seconds_count") == delta("vllm:time_per_output_token_seconds_count") \
        == gaps
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "request_inference_time"):
        assert delta(f"vllm:{name}_seconds_count") == 2, name
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    assert delta("vllm:request_prompt_tokens_sum") == 7 + c["usage"]["prompt_tokens"]
    assert delta("vllm:request_generation_tokens_sum") == 5 + c["usage"]["completion_tokens"]
    n_chat = c["usage"]["prompt_tokens"]
    assert delta("vllm:request_prompt_tokens_bucket", "5.0") == (n_chat <= 5)
    assert delta("vllm:request_prompt_tokens_bucket", "10.0") == 1 + (n_chat <= 10)  # 7 <= 10
    assert after[("vllm:num_requests_running", None)] == after[("vllm:num_requests_waiting", None)] == 0
    # each server has its own registry: the other one saw nothing
    assert scrape(plain_server)[("vllm:generation_tokens_total", None)] == \
        other_before[("vllm:generation_tokens_total", None)]


def test_metrics_observe_every_finished_request_as_vllm(server):
    """A request of one token is in vllm:request_time_per_output_token_seconds too (0, as
    vLLM observes it), so every per-request histogram has the same count."""
    before = scrape(server)
    status, r = raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert status == 200 and r["usage"]["completion_tokens"] == 1, r
    after = scrape(server)

    def delta(name, label=None):
        return after[(name, label)] - before.get((name, label), 0)

    for name in ("e2e_request_latency_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds", "request_generation_tokens"):
        assert delta(f"vllm:{name}_count") == 1, name
    assert delta("vllm:request_time_per_output_token_seconds_sum") == 0
    assert delta("vllm:request_time_per_output_token_seconds_bucket", "0.01") == 1


def _peek(conn) -> str:
    """What the server has sent on ``conn`` and the test has not read (up to 120 bytes;
    "" when nothing): a failing test's message shows a refused request's status."""
    import select

    if conn.sock is None or not select.select([conn.sock], [], [], 0)[0]:
        return ""
    return conn.sock.recv(120, socket.MSG_PEEK).decode(errors="replace")


def test_a_request_is_counted_before_it_leaves_the_gauges(tiny_serving, monkeypatch):
    """The engine's observers (the metrics' counters) see a request finish while
    num_running / num_waiting still count it: a request run to its length, one aborted
    running and one aborted waiting. A finished or aborted running request left the slots
    first, so a scrape once the gauges read (0, 0) could miss its count: after
    test_aborted_request_with_prompt_logprobs_is_dropped_quietly (its last busy stream
    aborted), test_metrics_gauges_follow_the_queue's first scrape could miss that abort,
    and its own three aborts then read as 4."""
    from flintc.runtime.runner import ReferenceRunner
    from flintc.serve.engine import Engine, EngineObserver, GenRequest

    model, tok = tiny_serving
    engine = Engine(ReferenceRunner(model, max_batch=1, max_model_len=256), tok)
    seen = []

    class Watch(EngineObserver):
        def finished(self, req, reason, error):
            seen.append((reason, engine.num_running, engine.num_waiting))

    engine.observers.append(Watch())
    _hold_decode(monkeypatch, engine.runner)  # 200 tokens: 10 s to see the long one running
    engine.start()
    outs = {name: queue.Queue() for name in ("short", "long", "queued")}

    def submit(name, max_tokens):
        req = GenRequest(prompt_ids=[5, 6, 7], params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                     ignore_eos=True), emit=outs[name].put)
        engine.submit(req)
        return req

    def last(name):
        while not (out := outs[name].get(timeout=120)).finished:
            pass
        return out.finish_reason

    try:
        submit("short", 2)
        assert last("short") == "length"
        long, queued = submit("long", 200), submit("queued", 2)
        assert wait_until(lambda: (engine.num_running, engine.num_waiting) == (1, 1)), dict(engine.stats)
        engine.abort(queued)
        assert last("queued") == "abort"
        engine.abort(long)
        assert last("long") == "abort"
    finally:
        engine.shutdown()
    assert seen == [("length", 1, 0), ("abort", 1, 1), ("abort", 1, 0)], seen


def test_metrics_gauges_follow_the_queue(plain_server, monkeypatch):
    """plain_server has 2 slots: of three long streams, two run and one waits; hung up,
    all three are aborted and the gauges go back to 0. The streams are sent one at a
    time, each once the one before it is counted, and each decode step is held 50 ms, so
    that a stream lasts about 50 s after its admission: the tiny model runs 1,000 steps
    in about a second, a window a loaded machine's scrapes could miss (CI did, once, and
    with 20 ms steps and the three streams sent at once saw (1, 0) for 20 s, once)."""
    def gauges():
        m = scrape(plain_server)
        return m[("vllm:num_requests_running", None)], m[("vllm:num_requests_waiting", None)]

    assert wait_until(lambda: gauges() == (0, 0)), gauges()  # nothing left from an earlier test
    _hold_decode(monkeypatch, plain_server.engine.runner)
    before = scrape(plain_server)
    conns = []
    try:
        for want in ((1, 0), (2, 0), (2, 1)):
            conn = http.client.HTTPConnection("127.0.0.1", plain_server.port, timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"model": MODEL, "prompt": "Go on.", "max_tokens": 1000, "ignore_eos": True, "stream": True}),
                headers={"Content-Type": "application/json"})
            conns.append(conn)
            assert wait_until(lambda: gauges() == want, timeout=30), \
                (want, gauges(), dict(plain_server.engine.stats), [_peek(c) for c in conns])
        resp = conns[0].getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
    finally:
        for conn in conns:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
    assert wait_until(lambda: gauges() == (0, 0)), gauges()
    after = scrape(plain_server)

    def aborts():
        return scrape(plain_server)[("vllm:request_success_total", "abort")] - \
            before[("vllm:request_success_total", "abort")]

    # exactly 3: `before` has every request of an earlier test, the engine counting a
    # request before the gauges let it go (test_a_request_is_counted_before_it_leaves_the_gauges)
    assert wait_until(lambda: aborts() == 3), (aborts(), dict(plain_server.engine.stats))
    assert after[("vllm:request_success_total", "length")] == before[("vllm:request_success_total", "length")]
    assert after[("vllm:e2e_request_latency_seconds_count", None)] == \
        before[("vllm:e2e_request_latency_seconds_count", None)]  # latencies: finished requests only


# ---- the chat template -------------------------------------------------------------------


def with_template(tok, template=None, drop=False) -> FlintTokenizer:
    """`tok` with another chat_template in its config (left out when `drop`)."""
    config = {k: v for k, v in tok.config.items() if k != "chat_template"}
    if not drop:
        config["chat_template"] = template
    return FlintTokenizer(tok._tok, config)


@pytest.mark.parametrize("template, message", [
    (5, 'tokenizer_config.json: chat_template must be a string (a Jinja template) or a list of {"name", '
        '"template"} objects, got int'),
    (["{{ x }}"], 'tokenizer_config.json: chat_template[0] must be an object with string "name" and "template", '
                  'got "{{ x }}"'),
    ("{% for m in messages %}{{ m.content }}", "tokenizer_config.json: the chat_template does not compile: "
     "Unexpected end of template. Jinja was looking for the following tags: 'endfor' or 'else'. The innermost "
     "block that needs to be closed is 'for'. (template line 1)"),
    ("hi\n{{ messages[0].content | nosuchfilter }}", "tokenizer_config.json: the chat_template does not compile: "
     "No filter named 'nosuchfilter'. (template line 2)"),
    ("{{ messages is nosuchtest }}", "tokenizer_config.json: the chat_template does not compile: "
     "No test named 'nosuchtest'. (template line 1)"),
])
def test_malformed_chat_template_is_refused_up_front(tiny_serving, template, message):
    """A malformed template was found only by each chat request (a 500 "no
    chat_template string", or a 400 blaming the client for an unknown filter); now
    create_app refuses it with one line (`flintc serve` exits 2: test_cli.py)."""
    from flintc.serve.app import create_app

    _, tok = tiny_serving
    bad = with_template(tok, template)
    with pytest.raises(CheckpointError) as e:
        bad.check_chat_template()
    assert str(e.value) == message
    with pytest.raises(CheckpointError, match="^tokenizer_config.json: "):
        create_app(None, bad, ServeOptions(MODEL))  # raises before it looks at the engine
    assert tok.check_chat_template() is True
    assert with_template(tok, drop=True).check_chat_template() is False
    assert with_template(tok, None).check_chat_template() is False  # "chat_template": null


def test_no_chat_template_serves_completions(tiny_serving, serve_kit):
    """Without a chat template, /v1/completions serves and chat is a clear 400 (it was a
    500 "internal error: CheckpointError ...")."""
    model, tok = tiny_serving
    run = serve_kit.start_server(model, with_template(tok, drop=True), ServeOptions(MODEL), max_batch=1)
    try:
        status, body = raw(run, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                                             "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        status, body = raw(run, "POST", "/v1/chat/completions", chat("Hello", max_tokens=2))
        assert status == 400, body
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("this model has no chat template"), body
        assert raw(run, "GET", "/health") == (200, {"status": "ok"})
    finally:
        serve_kit.stop_server(run)


def test_template_errors_for_given_messages_are_400s(tiny_serving, serve_kit):
    """A template that compiles but fails on these messages (raise_exception, a filter
    only looked up when rendered, an empty rendering) is the request's 400, and the
    server keeps serving."""
    model, tok = tiny_serving
    template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turns') }}"
                "{% elif m.content == 'filter' %}{{ m.content | nosuchfilter }}"
                "{% elif m.content == 'add' %}{{ m.content + 1 }}"
                "{% elif 'tool_calls' in m %}{{ m.tool_calls | length }}"
                "{% else %}{{ m.content }}{% endif %}{% endfor %}")
    run = serve_kit.start_server(model, with_template(tok, template), ServeOptions(MODEL), max_batch=1)
    try:
        # a null field is left out, as if absent: `'tool_calls' in m` is false (a 500 before:
        # len(None) in the template)
        status, body = raw(run, "POST", "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": "Hi", "name": None},
                {"role": "assistant", "content": "yo", "tool_calls": None}, {"role": "user", "content": "x"}]})
        assert status == 200, body
        for messages, needle in (([{"role": "system", "content": "x"}], "no system turns"),
                                 ([{"role": "user", "content": "filter"}], "nosuchfilter"),
                                 # an error of the template's own expression (a 500 before)
                                 ([{"role": "user", "content": "add"}], "the chat template failed on the messages: "
                                  "TypeError"),
                                 ([{"role": "user", "content": ""}], "rendered the messages to an empty prompt")):
            status, body = raw(run, "POST", "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                                      "max_tokens": 1})
            assert status == 400 and needle in body["error"]["message"], body
            assert body["error"]["param"] == "messages"
        status, body = raw(run, "POST", "/v1/chat/completions", chat("Hello", max_tokens=2, ignore_eos=True))
        assert status == 200 and body["usage"]["prompt_tokens"] == len(tok.encode("Hello")), body
    finally:
        serve_kit.stop_server(run)


def test_named_templates_pick_tool_use_for_any_tools_list(tiny_serving, serve_kit):
    """Of named templates, "tool_use" renders a chat whose request has "tools", an empty
    list included (as vLLM hands the list to transformers), and "default" one without;
    the template sees the list as sent (`tools == []`, not None)."""
    model, tok = tiny_serving
    template = [{"name": "default", "template": "{{ messages[0].content }}"},
                {"name": "tool_use",
                 "template": "{{ messages[0].content }} tools{{ tools | length if tools is not none else 'None' }}"}]
    run = serve_kit.start_server(model, with_template(tok, template), ServeOptions(MODEL), max_batch=1)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    try:
        for extra, rendered in (({}, "Hello"), ({"tools": None}, "Hello"), ({"tools": []}, "Hello tools0"),
                                ({"tools": [tool], "tool_choice": "none"}, "Hello tools1")):
            status, body = raw(run, "POST", "/v1/chat/completions", chat("Hello", max_tokens=1, **extra))
            assert status == 200, (extra, body)
            assert body["usage"]["prompt_tokens"] == len(tok.encode(rendered)), (extra, rendered, body)
    finally:
        serve_kit.stop_server(run)


# ---- tokenizing off the event loop -----------------------------------------------------------

MARK = "block-the-tokenizer"


class BlockingTokenizer:
    """Stands in for a FlintTokenizer's ``tokenizers.Tokenizer``: encoding (any encode*
    method) a text holding MARK waits for `release`, having set `entered`."""

    def __init__(self, inner):
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not name.startswith("encode"):
            return attr

        def encode(x, *args, **kw):
            if MARK in str(x):
                self.entered.set()
                assert self.release.wait(180), "never released"
            return attr(x, *args, **kw)

        return encode


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": f"x {MARK}", "max_tokens": 1}),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", f"x {MARK}"], "max_tokens": 1}),
    ("/v1/chat/completions", chat(f"x {MARK}", max_tokens=1)),
])
def test_tokenizing_does_not_block_other_requests(server, tiny_serving, monkeypatch, path, body):
    """Tokenizing ran on the event loop: a 5M-character prompt held /health for 4 s.
    While one request's tokenizing is held up, /health and another request are
    answered; then the held request completes."""
    _, tok = tiny_serving
    blocking = BlockingTokenizer(tok._tok)
    monkeypatch.setattr(tok, "_tok", blocking)
    with ThreadPoolExecutor(1) as pool:
        try:
            held = pool.submit(raw, server, "POST", path, body)
            assert blocking.entered.wait(60), "the request never reached the tokenizer"
            # a blocked event loop answers only once released (after these): the timeouts
            # only bound how long a loaded machine may take to answer
            assert raw(server, "GET", "/health", timeout=60) == (200, {"status": "ok"})
            status, other = raw(server, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": "Hello", "max_tokens": 1}, timeout=60)
            assert status == 200 and other["choices"][0]["finish_reason"] in ("length", "stop"), other
            assert not held.done()
        finally:
            blocking.release.set()
        status, got = held.result(60)
    assert status == 200 and got["usage"]["completion_tokens"] == (2 if isinstance(body.get("prompt"), list)
                                                                   else 1), got


_TEXT = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(SPECIAL_TOKENS + ("<|reserved_3|>", " ", "\n"))),
                 max_size=8).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=_TEXT)
def test_encode_off_the_gil_equals_the_tokenizers(tiny_serving, text):
    """FlintTokenizer.encode (the batch encoder, which releases the GIL) gives exactly
    `tokenizers`' single-text encoder's ids, special-token strings included."""
    _, tok = tiny_serving
    assert tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids


def test_an_input_error_below_the_handlers_is_a_400(server, tiny_serving, monkeypatch):
    """An InputError raised below the request handlers' own checks (here the tokenizer's,
    for text that is not valid Unicode) answers 400 invalid_request_error, not a 500."""
    from flintc.errors import InputError

    _, tok = tiny_serving

    def refuse(text, *args):
        raise InputError("the text to encode is not valid Unicode")

    monkeypatch.setattr(tok, "encode", refuse)
    status, body = raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"] == "the text to encode is not valid Unicode"
    assert raw(server, "GET", "/health") == (200, {"status": "ok"})


# ---- logprobs: the sampled token (OpenAI / vLLM) -----------------------------------------


def _forced_pick(tok):
    """A logit_bias forcing a token that greedy decoding would not pick (its raw logprob,
    the one reported, is before the bias)."""
    return tok.encode(" zebra")[0]


def test_completion_top_logprobs_hold_the_sampled_token(client, tiny_serving):
    """top_logprobs entries missed the sampled token when it was not among the top N; as
    OpenAI and vLLM, each holds it (first), so up to logprobs + 1 items, and with
    logprobs 0 exactly {sampled: logprob} (was {})."""
    _, tok = tiny_serving
    forced = _forced_pick(tok)
    text = tok.token_bytes(forced).decode("utf-8", "replace")
    kw = dict(model=MODEL, prompt="The model", max_tokens=3, temperature=0, logit_bias={str(forced): 100},
              extra_body={"ignore_eos": True})
    for n_top in (0, 1, 2):
        r = client.completions.create(logprobs=n_top, **kw)
        lp = r.choices[0].logprobs
        assert lp.tokens == [text] * 3
        for t, t_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert list(top)[0] == t and top[t] == t_lp
            assert len(top) == n_top + 1, top  # the forced token is never in the raw top N here
            assert all(v >= t_lp for k, v in top.items() if k != t)
        # streamed: the same entries
        parts = list(client.completions.create(logprobs=n_top, stream=True, **kw))
        assert [d for p in parts if p.choices and p.choices[0].logprobs
                for d in p.choices[0].logprobs.top_logprobs] == lp.top_logprobs
    # a greedy pick is the top token: no extra entry
    r = client.completions.create(model=MODEL, prompt="The model", max_tokens=3, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert all(len(top) == 2 and list(top)[0] == t
               for t, top in zip(r.choices[0].logprobs.tokens, r.choices[0].logprobs.top_logprobs))
    # up to vLLM's default --max-logprobs, 20 (OpenAI's API stops at 5; this server did too)
    r = client.completions.create(model=MODEL, prompt="The model", max_tokens=2, temperature=0, logprobs=20,
                                  extra_body={"ignore_eos": True})
    tops = r.choices[0].logprobs.top_logprobs
    assert len(tops) == 2 and all(10 < len(top) <= 20 for top in tops), [len(t) for t in tops]
    with pytest.raises(openai.BadRequestError, match=r"must be in \[0, 20\]"):
        client.completions.create(model=MODEL, prompt="The model", max_tokens=2, logprobs=21)


@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
def test_streamed_completion_logprobs_equal_unstreamed_with_a_held_back_byte(client, echo):
    """A token that is half a UTF-8 character has its text held back (the chunk carries
    ""; the next one carries it, here as U+FFFD since the next token does not complete
    it). Streamed, the next token's text_offset was the held-back one's (the length of
    the text sent so far: [0, 0, 3, ...], with echo [0, 1, 2, 2, ...]) instead of the
    unstreamed [0, 1, 3, ...]; tokens, token_logprobs and the text were already equal."""
    kw = dict(model=MODEL, prompt="Hi", max_tokens=6, temperature=0, logprobs=0, echo=echo,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    parts = [p.choices[0] for p in client.completions.create(stream=True, **kw) if p.choices]
    # the case this test is about: a chunk whose last token's text it does not carry ("" or the prompt)
    held = [p for p in parts if p.logprobs and p.logprobs.tokens and p.text != "".join(p.logprobs.tokens)]
    assert held and held[0].logprobs.tokens[-1] == "\ufffd", [(p.text, p.logprobs and p.logprobs.tokens)
                                                               for p in parts]
    assert held[0].text == ("Hi" if echo else "")
    streamed = {key: [x for p in parts if p.logprobs for x in getattr(p.logprobs, key)]
                for key in ("tokens", "text_offset", "token_logprobs")}
    assert "".join(p.text for p in parts) == whole.text
    assert streamed["tokens"] == whole.logprobs.tokens
    assert streamed["text_offset"] == whole.logprobs.text_offset
    assert streamed["token_logprobs"] == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)
    tokens, offsets = whole.logprobs.tokens, whole.logprobs.text_offset
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert whole.text == "".join(tokens)  # here each token's text is its string in tokens


def test_chat_top_logprobs_are_the_top_n(client, tiny_serving):
    """Chat's top_logprobs is the N most likely tokens (OpenAI; vLLM's list is N long too,
    never N + 1): the chosen token is in content[i].token / logprob, not added to the list."""
    _, tok = tiny_serving
    forced = _forced_pick(tok)
    text = tok.token_bytes(forced).decode("utf-8", "replace")
    kw = chat("Count.", model=MODEL, max_tokens=3, temperature=0, logit_bias={str(forced): 100},
              logprobs=True, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    for n_top in (0, 2):
        r = client.chat.completions.create(top_logprobs=n_top, **kw)
        for e in r.choices[0].logprobs.content:
            assert e.token == text
            assert len(e.top_logprobs) == n_top and text not in [t.token for t in e.top_logprobs]
            assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)


class OnlyOneToken:
    """A runner whose logits rule out (-inf) every token but ``keep``, as a model may: every
    other token's log-probability is -inf."""

    def __init__(self, runner, keep: int):
        self.runner, self.keep = runner, keep
        self.config, self.device = runner.config, runner.device
        self.max_batch, self.max_model_len = runner.max_batch, runner.max_model_len
        self.prefill_chunk = runner.prefill_chunk

    def _mask(self, logits):
        out = torch.full_like(logits, float("-inf"))
        out[..., self.keep] = logits[..., self.keep]
        return out

    def prefill(self, slot, token_ids, start=0, all_logits=False):
        return self._mask(self.runner.prefill(slot, token_ids, start, all_logits))

    def decode(self, slots, token_ids, positions):
        return self._mask(self.runner.decode(slots, token_ids, positions))


def strict_json(text: str):
    """json.loads refusing -Infinity, Infinity and NaN (Python's json takes them; JSON does not)."""
    def refuse(name):
        raise AssertionError(f"{name} in JSON: {text[:200]}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def masked_server(tiny_serving, serve_kit):
    """The tiny model behind `OnlyOneToken` (token 'a' kept): logprobs of -inf everywhere else."""
    model, tok = tiny_serving
    SCRIPTS.update(serve_kit.SCRIPTS)
    keep = tok.encode("a")[0]
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL), max_batch=2, max_model_len=256,
                                 wrap=lambda runner: OnlyOneToken(runner, keep))
    run.keep = keep
    yield run
    serve_kit.stop_server(run)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_minus_infinity_are_minus_9999(masked_server, tiny_serving, stream):
    """A log-probability of -inf is written -9999.0, as vLLM does (max(logprob, -9999.0) in
    serving_chat.py and serving_completion.py), in the sampled token's logprob and in
    top_logprobs, chat and completions, streamed or not. It was -Infinity in a stream
    (invalid JSON) and a 500 without one."""
    _, tok = tiny_serving
    a = tok.token_bytes(masked_server.keep).decode()
    forced = tok.encode(SCRIPTS["stop"])[:3]  # tokens the masked model rules out
    for prompt, want_tokens, want_lp in (("Count.", [a] * 3, 0.0),
                                         ("#script:stop", [tok.decode([t]) for t in forced], -9999.0)):
        status, got = masked_server.post("/v1/chat/completions", chat(
            prompt, model=MODEL, max_tokens=3, logprobs=True, top_logprobs=3, ignore_eos=True, stream=stream),
            loads=strict_json)
        assert status == 200, got
        if stream:
            content = [e for x in got for c in x["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
        else:
            content = got["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == want_tokens
        assert [e["logprob"] for e in content] == [want_lp] * 3
        for e in content:  # 'a' (0.0) first, then two of the ruled-out tokens
            assert [t["logprob"] for t in e["top_logprobs"]] == [0.0, -9999.0, -9999.0]
            assert e["top_logprobs"][0]["token"] == a
        status, got = masked_server.post("/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 3, "logprobs": 2, "ignore_eos": True, "stream": stream},
            loads=strict_json)
        assert status == 200, got
        lps = [x["choices"][0]["logprobs"] for x in (got if stream else [got])]
        tokens = [t for lp in lps for t in lp["tokens"]]
        assert tokens == want_tokens
        assert [v for lp in lps for v in lp["token_logprobs"]] == [want_lp] * 3
        for top in (t for lp in lps for t in lp["top_logprobs"]):
            assert top[a] == 0.0 and sorted(top.values()) == [-9999.0] * (len(top) - 1) + [0.0]


def test_json_logprob_never_infinite_or_nan(tiny_serving):
    """The helpers behind every logprob in a response: -inf -> -9999.0 (vLLM), NaN -> null
    (as pydantic writes a NaN in vLLM's responses); prompt logprobs floor -inf only
    (vLLM's clamp_prompt_logprobs)."""
    from flintc.serve.app import _chat_logprobs, _completion_logprobs, _json_logprob
    from flintc.serve.engine import TokenLogprob

    _, tok = tiny_serving
    inf, nan = float("inf"), float("nan")
    assert [_json_logprob(v) for v in (-inf, -12345.0, -1.5, 0.0, nan, inf)] == [-9999.0, -9999.0, -1.5, 0.0, None, None]
    assert [_json_logprob(v, floor_all=False) for v in (-inf, -12345.0, nan)] == [-9999.0, -12345.0, None]
    lps = [TokenLogprob(5, -inf, [(7, nan), (5, -inf)]), TokenLogprob(6, nan, [])]
    body = {"chat": _chat_logprobs(tok, lps), "completion": _completion_logprobs(tok, lps, 0)}
    strict_json(json.dumps(body))
    assert [e["logprob"] for e in body["chat"]["content"]] == [-9999.0, None]
    assert [t["logprob"] for t in body["chat"]["content"][0]["top_logprobs"]] == [None, -9999.0]
    assert body["completion"]["token_logprobs"] == [-9999.0, None]


# ---- vLLM's sampling / output fields ------------------------------------------------------


def test_skip_special_tokens_completions(client, tiny_serving):
    """skip_special_tokens (vLLM's, default true) leaves special tokens out of the text;
    false keeps them. Streamed text joins to the same."""
    _, tok = tiny_serving
    ids = tok.encode(SCRIPTS["think"])
    for skip, want in ((None, tok.decode(ids, skip_special_tokens=True)), (True, "The user wants a number.The answer is 4."),
                       (False, SCRIPTS["think"])):
        extra = {} if skip is None else {"skip_special_tokens": skip}
        r = client.completions.create(model=MODEL, prompt="#script:think", max_tokens=40, extra_body=extra)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
        parts = list(client.completions.create(model=MODEL, prompt="#script:think", max_tokens=40, stream=True,
                                               extra_body=extra))
        assert "".join(p.choices[0].text for p in parts if p.choices) == want
    # spaces_between_special_tokens is accepted (no effect with this fast tokenizer, as in vLLM)
    r = client.completions.create(model=MODEL, prompt="#script:think", max_tokens=40,
                                  extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False})
    assert r.choices[0].text == SCRIPTS["think"]


def test_stream_sends_a_chunk_per_token_of_empty_text(client, tiny_serving):
    """A completion stream sends one chunk for each step that made a token, even when the
    token adds no text (a special token left out by skip_special_tokens), as vLLM: a run of
    them used to silence the stream until the end (and made
    test_metrics_gauges_follow_the_queue flaky, its first line coming only then)."""
    _, tok = tiny_serving
    special = tok.special_token_ids["</think>"]
    parts = list(client.completions.create(model=MODEL, prompt="Go on.", max_tokens=6, stream=True,
                                           logit_bias={str(special): 100}, temperature=0,
                                           extra_body={"return_token_ids": True}))
    chunks = [p for p in parts if p.choices]
    assert [p.choices[0].text for p in chunks] == [""] * 6
    assert [t for p in chunks for t in p.choices[0].token_ids] == [special] * 6
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_sends_a_chunk_per_token_of_empty_text(client, plain_server, tiny_serving):
    """A chat stream sends one chunk for each step that made a token, as vLLM, even when the
    token adds no text: its delta is {"content": ""} (vLLM's DeltaMessage(content=delta_text)
    with empty text), {"reasoning_content": ""} inside a thinking block. Such steps were
    skipped, so a run of special tokens left out by skip_special_tokens silenced the stream."""
    _, tok = tiny_serving
    special = tok.special_token_ids["</think>"]
    plain = openai.OpenAI(base_url=plain_server.base_url, api_key="unused", max_retries=0, timeout=120)
    parts = list(plain.chat.completions.create(**chat("Go on.", model=MODEL, max_tokens=6, stream=True,
                                                      logit_bias={str(special): 100}, temperature=0,
                                                      extra_body={"return_token_ids": True})))
    chunks = [p for p in parts if p.choices][1:]  # after the role chunk
    assert [p.choices[0].delta.content for p in chunks] == [""] * 6
    assert [p.choices[0].token_ids for p in chunks] == [[special]] * 6
    assert [p.choices[0].finish_reason for p in chunks] == [None] * 5 + ["length"]
    # with the reasoning parser: the <think> step is an empty reasoning delta, </think> and
    # the end-of-text token empty content deltas; one chunk per token, text unchanged
    ids = tok.encode(SCRIPTS["think"])
    parts = list(client.chat.completions.create(**chat("#script:think", model=MODEL, max_tokens=40, stream=True,
                                                       extra_body={"return_token_ids": True})))
    chunks = [p for p in parts if p.choices][1:]
    assert [t for p in chunks for t in p.choices[0].token_ids] == ids + [tok.eos_token_id]
    assert all(len(p.choices[0].token_ids) == 1 for p in chunks)
    deltas = [p.choices[0].delta.model_dump(exclude_none=True) for p in chunks]
    assert deltas[ids.index(tok.special_token_ids["<think>"])] == {"reasoning_content": ""}
    assert deltas[ids.index(special)] == {"content": ""}
    assert deltas[-1] == {"content": ""} and chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants a number."
    assert "".join(d.get("content", "") for d in deltas) == "The answer is 4."


def test_skip_special_tokens_chat_keeps_parsing(client, plain_server, tiny_serving):
    """Chat parses reasoning and tool calls on the text with special tokens, then leaves
    them out of what the client sees; streamed == non-streamed."""
    _, tok = tiny_serving
    kw = chat("#script:think", model=MODEL, max_tokens=40)
    r = client.chat.completions.create(**kw)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (
        "The user wants a number.", "The answer is 4.")
    plain = openai.OpenAI(base_url=plain_server.base_url, api_key="unused", max_retries=0, timeout=120)
    for extra, want in (({}, "The user wants a number.The answer is 4."),
                        ({"skip_special_tokens": False}, SCRIPTS["think"])):
        r = plain.chat.completions.create(**kw, extra_body=extra)
        assert r.choices[0].message.content == want
        _, content, _, _ = stream_chat(plain, **kw, extra_body=extra)
        assert content == want
    # tool parsing on: tags are parsed; a malformed block keeps its tags (vLLM's tool parsers
    # turn skip_special_tokens off)
    r = client.chat.completions.create(**chat("#script:bad_tool", model=MODEL, max_tokens=80, tools=TOOLS,
                                              extra_body={"skip_special_tokens": True}))
    assert r.choices[0].message.content == SCRIPTS["bad_tool"]


def test_special_stripper_split_anywhere(tiny_serving):
    from flintc.serve.app import _special_strings, _SpecialStripper

    _, tok = tiny_serving
    specials = _special_strings(tok)
    text = "a<think>b</think>c<tool_call><|user|>d<|us" + "<notspecial>e<"
    want = "abcd<|us<notspecial>e<"
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1):
            s = _SpecialStripper(specials)
            got = s.feed(text[:cut]) + s.feed(text[cut:cut2]) + s.feed(text[cut2:]) + s.finish()
            assert got == want, (cut, cut2)


def test_stop_token_ids_and_include_stop_str_in_output(client, tiny_serving):
    _, tok = tiny_serving
    ids = tok.encode(SCRIPTS["stop"])
    k = ids.index(ids[3])
    base = dict(model=MODEL, prompt="#script:stop", max_tokens=40)
    r = client.completions.create(**base, extra_body={"stop_token_ids": [ids[3]], "return_token_ids": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (tok.decode(ids[:k]), "stop")
    assert r.choices[0].token_ids == ids[:k + 1]  # the stop token counts, as in vLLM
    # ignore_eos ignores the end-of-text token only, as in vLLM
    r = client.completions.create(**base, extra_body={"stop_token_ids": [ids[3]], "ignore_eos": True})
    assert r.choices[0].text == tok.decode(ids[:k])
    r = client.completions.create(**base, extra_body={"stop_token_ids": [ids[3]], "include_stop_str_in_output": True})
    assert r.choices[0].text == tok.decode(ids[:k + 1])
    # stop strings
    for stream in (False, True):
        for inc, want in ((False, "Hello "), (True, "Hello world")):
            got = client.completions.create(**base, stop=["world"], stream=stream,
                                            extra_body={"include_stop_str_in_output": inc})
            text = "".join(p.choices[0].text for p in got if p.choices) if stream else got.choices[0].text
            assert text == want, (stream, inc)
    r = client.chat.completions.create(**chat("#script:stop", model=MODEL, max_tokens=40, stop=["world"],
                                              extra_body={"include_stop_str_in_output": True}))
    assert r.choices[0].message.content == "Hello world"
    r = client.chat.completions.create(**chat("#script:stop", model=MODEL, max_tokens=40,
                                              extra_body={"stop_token_ids": [ids[3]]}))
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (tok.decode(ids[:k]), "stop")


def test_add_generation_prompt_and_continue_final_message(client, server, tiny_serving):
    _, tok = tiny_serving
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Well, hi"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=2, extra_body={"return_token_ids": True})
    r = client.chat.completions.create(**kw)
    assert tok.decode(r.prompt_token_ids) == tok.apply_chat_template(msgs, add_generation_prompt=True)
    r = client.chat.completions.create(**{**kw, "extra_body": {"return_token_ids": True, "add_generation_prompt": False}})
    assert tok.decode(r.prompt_token_ids) == tok.apply_chat_template(msgs, add_generation_prompt=False)
    r = client.chat.completions.create(**{**kw, "extra_body": {
        "return_token_ids": True, "add_generation_prompt": False, "continue_final_message": True}})
    prompt = tok.decode(r.prompt_token_ids)
    assert prompt.endswith("Well, hi") and tok.apply_chat_template(msgs, add_generation_prompt=False).startswith(prompt)
    status, got = raw(server, "POST", "/tokenize", {"messages": msgs, "add_generation_prompt": False,
                                                   "continue_final_message": True})
    assert status == 200 and got["tokens"] == r.prompt_token_ids
    status, got = raw(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                                               "continue_final_message": True})
    assert status == 400 and got["error"]["param"] == "continue_final_message", got


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("patch, param, needle", [
    ({"prompt_logprobs": 21}, "prompt_logprobs", "must be in [0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "must be in [0, 20]"),
    ({"prompt_logprobs": True}, "prompt_logprobs", "invalid value"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when 'stream' is true"),
    ({"stop_token_ids": "x"}, "stop_token_ids", "invalid value"),
    ({"stop_token_ids": [1, 512]}, "stop_token_ids", "outside the vocabulary"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", "invalid value"),
    ({"spaces_between_special_tokens": 1}, "spaces_between_special_tokens", "invalid value"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output", "invalid value"),
])
def test_vllm_fields_checked(server, path, patch, param, needle):
    body = ({"model": MODEL, "prompt": "hi", "max_tokens": 2} if path == "/v1/completions"
            else chat("hi", model=MODEL, max_tokens=2))
    status, got = raw(server, "POST", path, {**body, **patch})
    assert status == 400, got
    err = got["error"]
    assert err["param"] == param and needle in err["message"] and "Unrecognized" not in err["message"], err


def _model_prompt_logprobs(model, ids):
    """log_softmax of the reference model's logits for every position of `ids` [T, V]."""
    from flintc.runtime.runner import ReferenceRunner

    return torch.log_softmax(ReferenceRunner(model, max_batch=1, max_model_len=64).prefill(0, ids, all_logits=True), -1)


def _check_prompt_logprobs(plp, ids, lsm, k, tok):
    """vLLM's shape: [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...], the
    prompt token first, then the k most likely (ranks 1..k), values of `lsm`."""
    assert len(plp) == len(ids) and plp[0] is None
    for i, entry in enumerate(plp[1:], start=1):
        row = lsm[i - 1]
        keys = list(entry)
        assert keys[0] == str(ids[i]) and len(entry) in (k, k + 1)
        first = entry[keys[0]]
        assert first["logprob"] == pytest.approx(float(row[ids[i]]), abs=1e-5)
        assert first["rank"] == int((row >= row[ids[i]]).sum())
        assert sorted(v["rank"] for v in entry.values() if v["rank"] <= k) == list(range(1, k + 1))
        for key, v in entry.items():
            assert v["decoded_token"] == tok.decode([int(key)])
            assert v["logprob"] == pytest.approx(float(row[int(key)]), abs=1e-5)
        want_top = sorted(row.tolist(), reverse=True)[:k]
        assert sorted((v["logprob"] for v in entry.values() if v["rank"] <= k), reverse=True) == \
            pytest.approx(want_top, abs=1e-5)


def test_prompt_logprobs_completions(server, tiny_serving):
    """vLLM's prompt_logprobs on /v1/completions: on each choice, for each prompt of a
    batch (the choices of one prompt share its list); generation is unchanged."""
    model, tok = tiny_serving
    prompts = [tok.encode("The quick brown fox"), [5, 300, 12, 7, 99, 41]]
    base = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2}
    status, got = raw(server, "POST", "/v1/completions", {**base, "prompt_logprobs": 2})
    assert status == 200, got
    status, plain = raw(server, "POST", "/v1/completions", base)
    assert status == 200 and all("prompt_logprobs" not in c for c in plain["choices"])
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in plain["choices"]]
    for i, c in enumerate(got["choices"]):
        ids = prompts[i // 2]
        _check_prompt_logprobs(c["prompt_logprobs"], ids, _model_prompt_logprobs(model, ids), 2, tok)
        assert c["prompt_logprobs"] == got["choices"][i // 2 * 2]["prompt_logprobs"]
    # 0: the prompt token alone
    status, got = raw(server, "POST", "/v1/completions", {**base, "n": 1, "prompt": prompts[1], "prompt_logprobs": 0})
    plp = got["choices"][0]["prompt_logprobs"]
    assert status == 200 and plp[0] is None and [list(e) for e in plp[1:]] == [[str(t)] for t in prompts[1][1:]]


def test_prompt_logprobs_chat(server, client, tiny_serving):
    """On /v1/chat/completions, prompt_logprobs is on the response (vLLM), over the rendered
    prompt; with stream, 0 is accepted and sends none (as vLLM), more is a 400."""
    model, tok = tiny_serving
    r = client.chat.completions.create(**chat("Hi there", model=MODEL, max_tokens=2, n=2,
                                              extra_body={"prompt_logprobs": 1, "return_token_ids": True}))
    ids = r.prompt_token_ids
    assert len(ids) == r.usage.prompt_tokens
    _check_prompt_logprobs(r.prompt_logprobs, ids, _model_prompt_logprobs(model, ids), 1, tok)
    assert all(getattr(c, "prompt_logprobs", None) is None for c in r.choices)
    status, events = server.post("/v1/chat/completions", chat("Hi there", model=MODEL, max_tokens=2, stream=True,
                                                              prompt_logprobs=0), loads=str)
    assert status == 200 and "prompt_logprobs" not in "".join(events)


def test_prompt_logprobs_of_minus_infinity(masked_server, tiny_serving):
    """A prompt token the logits rule out has logprob -9999.0 (vLLM's clamp_prompt_logprobs)
    and rank V (every token ties at -inf with it)."""
    _, tok = tiny_serving
    ids = tok.encode("Count to ten.")
    status, got = masked_server.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1,
                                                         "prompt_logprobs": 2}, loads=strict_json)
    assert status == 200, got
    plp = got["choices"][0]["prompt_logprobs"]
    a = str(masked_server.keep)
    for i, entry in enumerate(plp[1:], start=1):
        assert entry[str(ids[i])] == {"logprob": -9999.0, "rank": tok.vocab_size, "decoded_token": tok.decode([ids[i]])}
        assert entry[a] == {"logprob": 0.0, "rank": 1, "decoded_token": "a"}
        assert sorted(v["rank"] for k, v in entry.items() if k not in (a, str(ids[i]))) == [2]


def test_vllm_fields_accepted(server):
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", chat("hi", model=MODEL, max_tokens=2))):
        status, got = raw(server, "POST", path, {**body, "skip_special_tokens": True,
                                                 "spaces_between_special_tokens": True, "stop_token_ids": [],
                                                 "include_stop_str_in_output": False, "prompt_logprobs": None})
        assert status == 200, got


# ---- messages ------------------------------------------------------------------------------


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "system"}, {"role": "user", "content": "x"}], "messages[0].content"),
    ([{"role": "developer", "content": None}, {"role": "user", "content": "x"}], "messages[0].content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant"}], "messages[1].content"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c"}], "messages[1].content"),
])
def test_message_content_required(server, messages, param):
    """A user message without content was answered 200; OpenAI and vLLM require it (an
    assistant message may leave it out when it has tool_calls)."""
    for path in ("/v1/chat/completions", "/tokenize"):
        status, got = raw(server, "POST", path, {"model": MODEL, "messages": messages, "max_tokens": 2}
                          if path != "/tokenize" else {"model": MODEL, "messages": messages})
        assert status == 400, got
        assert got["error"]["param"] == param and "required" in got["error"]["message"], got


# ---- aborted requests ----------------------------------------------------------------------


class _Errors(logging.Handler):
    """Collects the ERROR records of uvicorn's logger ("Exception in ASGI application")."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _send_raw(server, path, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _handlers(running) -> set:
    """The server's ASGI handlers in flight: uvicorn's tasks, one a request being answered
    (one leaves the set when the app has returned, or failed and been logged). set()
    copies the set in C, holding the GIL, so the event loop cannot change it meanwhile."""
    return set(running.server.server_state.tasks)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_aborted_request_with_prompt_logprobs_is_dropped_quietly(plain_server, path, monkeypatch):
    """A non-streamed request with prompt_logprobs whose client hangs up while it waits for
    a slot was aborted with no prompt logprobs, and the handler failed building the
    response from them (TypeError: 'NoneType' object is not iterable, logged as
    'Exception in ASGI application')."""
    engine = plain_server.engine
    _hold_decode(monkeypatch, engine.runner)  # the busy streams hold the slots 45 s, not 1 s
    errors = _Errors()
    logging.getLogger("uvicorn.error").addHandler(errors)
    busy = []
    try:
        long = chat("Go on.", model=MODEL, max_tokens=900, ignore_eos=True, stream=True)
        busy = [_send_raw(plain_server, "/v1/chat/completions", long) for _ in range(engine.max_batch)]
        assert wait_until(lambda: engine.num_running == engine.max_batch), dict(engine.stats)
        others = _handlers(plain_server)  # the busy streams' (and any an earlier test left finishing)
        body = ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1}
                if path == "/v1/completions" else chat("hi", model=MODEL, max_tokens=2, prompt_logprobs=1))
        sock = _send_raw(plain_server, path, body)
        assert wait_until(lambda: engine.num_waiting == 1), (engine.num_running, dict(engine.stats))
        handler = _handlers(plain_server) - others
        assert len(handler) == 1, (handler, others)
        aborted = engine.stats["aborted"]
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        assert wait_until(lambda: engine.num_waiting == 0 and engine.stats["aborted"] == aborted + 1), \
            (engine.num_running, engine.num_waiting, dict(engine.stats))
        # the handler builds its response after the abort: wait for it to return (or fail, logged)
        assert wait_until(lambda: all(t.done() for t in handler)), "the aborted request's handler did not return"
    finally:
        for s in busy:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
        logging.getLogger("uvicorn.error").removeHandler(errors)
    assert wait_until(lambda: engine.num_running == 0)
    assert not errors.records, [r.getMessage() for r in errors.records]


# ---- stream_options ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_need_stream(server, path, stream):
    """vLLM refuses stream_options without stream: true ("Stream options can only be
    defined when `stream=True`."); flintc accepted them."""
    body = ({"model": MODEL, "prompt": "hi", "max_tokens": 2} if path == "/v1/completions"
            else chat("hi", model=MODEL, max_tokens=2))
    if stream is not None:
        body["stream"] = stream
    status, got = raw(server, "POST", path, {**body, "stream_options": {"include_usage": True}})
    assert status == 400 and got["error"]["param"] == "stream_options", got
    assert "only be defined when `stream=True`" in got["error"]["message"]
    for empty in (None, {}):  # vLLM's check is on a truthy value
        status, got = raw(server, "POST", path, {**body, "stream_options": empty})
        assert status == 200, got


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(server, path):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk
    carries the usage so far (the chat role chunk 0 completion tokens), then the usage
    chunk; without include_usage it does nothing (as vLLM)."""
    body = ({"model": MODEL, "prompt": "hi", "max_tokens": 5, "ignore_eos": True, "stream": True}
            if path == "/v1/completions" else chat("hi", model=MODEL, max_tokens=5, ignore_eos=True, stream=True))
    status, chunks = server.post(path, {**body, "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True}})
    assert status == 200, chunks
    assert all("usage" in c for c in chunks), chunks
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    done = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert done == sorted(done) and done[-1] == 5 and chunks[-1]["usage"]["completion_tokens"] == 5
    if path == "/v1/chat/completions":
        assert done[0] == 0
    for c in chunks:
        assert c["usage"]["prompt_tokens"] == prompt
        assert c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"]
    status, chunks = server.post(path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert status == 200 and all("usage" not in c for c in chunks), chunks


# ---- vLLM's other request fields -------------------------------------------------------------


VLLM_DEFAULTS = {"truncate_prompt_tokens": None, "priority": 0, "bad_words": [], "length_penalty": 1.0,
                 "use_beam_search": False, "allowed_token_ids": None, "cache_salt": None,
                 "return_tokens_as_token_ids": False, "logits_processors": None, "kv_transfer_params": None,
                 "vllm_xargs": None, "structured_outputs": None, "guided_json": None, "guided_regex": None,
                 "guided_choice": None, "guided_grammar": None, "structural_tag": None,
                 "guided_decoding_backend": None, "guided_whitespace_pattern": None, "request_id": "r-1"}
VLLM_CHAT_DEFAULTS = {"echo": False, "add_special_tokens": False, "include_reasoning": True, "documents": None,
                      "chat_template": None, "mm_processor_kwargs": None, "media_io_kwargs": None, "best_of": 1}
VLLM_COMPLETION_DEFAULTS = {"add_special_tokens": True, "response_format": None, "prompt_embeds": None}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_request_fields_at_their_defaults_are_accepted(server, path):
    """vLLM's request models declare these fields, and clients built for it send them at
    their defaults; flintc answered 'Unrecognized request argument supplied'."""
    if path == "/v1/completions":
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **VLLM_DEFAULTS, **VLLM_COMPLETION_DEFAULTS}
    else:
        body = chat("hi", model=MODEL, max_tokens=2, **VLLM_DEFAULTS, **VLLM_CHAT_DEFAULTS)
    status, got = raw(server, "POST", path, body)
    assert status == 200, got
    status, got = raw(server, "POST", path, {**body, "vllm_xargs": {}, "cache_salt": "salt", "length_penalty": 0.5,
                                             **({"documents": [{"title": "t", "text": "x"}]}
                                                if path != "/v1/completions" else {})})
    assert status == 200, got


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("patch", [
    {"use_beam_search": True}, {"logits_processors": ["m.P"]}, {"vllm_xargs": {"a": 1}},
    {"kv_transfer_params": {"a": 1}}, {"guided_decoding_backend": "xgrammar"},
])
def test_vllm_request_fields_away_from_their_defaults_are_refused(server, path, patch):
    body = ({"model": MODEL, "prompt": "hi", "max_tokens": 2} if path == "/v1/completions"
            else chat("hi", model=MODEL, max_tokens=2))
    status, got = raw(server, "POST", path, {**body, **patch})
    (name,) = patch
    assert status == 400 and got["error"]["param"] == name and got["error"]["code"] == "unsupported_parameter", got
    assert "is not supported by flintc serve" in got["error"]["message"]


@pytest.mark.parametrize("patch", [{"chat_template": "{{ x }}"}, {"mm_processor_kwargs": {"a": 1}}, {"best_of": 2}])
def test_vllm_chat_fields_away_from_their_defaults_are_refused(server, patch):
    status, got = raw(server, "POST", "/v1/chat/completions", {**chat("hi", model=MODEL, max_tokens=2), **patch})
    (name,) = patch
    assert status == 400 and got["error"]["param"] == name and got["error"]["code"] == "unsupported_parameter", got


def test_vllm_completion_fields_away_from_their_defaults_are_refused(server):
    for patch in ({"prompt_embeds": "AAAA"}, {"response_format": {"type": "structural_tag"}}):
        status, got = raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                              **patch})
        (name,) = patch
        assert status == 400 and got["error"]["param"] == name, got


@pytest.mark.parametrize("path, prefix", [("/v1/completions", "cmpl-"), ("/v1/chat/completions", "chatcmpl-")])
def test_request_id_is_the_response_id(server, path, prefix):
    """vLLM's request_id: the response id is the route's prefix + the X-Request-Id header,
    else request_id, else a random id; streamed chunks carry it too."""
    body = ({"model": MODEL, "prompt": "hi", "max_tokens": 2} if path == "/v1/completions"
            else chat("hi", model=MODEL, max_tokens=2))
    assert raw(server, "POST", path, {**body, "request_id": "abc"})[1]["id"] == prefix + "abc"
    assert raw(server, "POST", path, {**body, "request_id": "abc"}, headers={"X-Request-Id": "hdr"})[1]["id"] \
        == prefix + "hdr"
    ids = {raw(server, "POST", path, body)[1]["id"] for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith(prefix) and len(i) > len(prefix) + 8 for i in ids)
    status, chunks = server.post(path, {**body, "request_id": "s1", "stream": True})
    assert status == 200 and {c["id"] for c in chunks} == {prefix + "s1"}


def test_truncate_prompt_tokens(server, tiny_serving):
    """vLLM's truncate_prompt_tokens: the model sees the prompt's last k tokens (-1: the
    last --max-model-len); 0, below -1 or over --max-model-len is a 400."""
    _, tok = tiny_serving
    ids = [(5 * i + 7) % 400 + 1 for i in range(12)]
    base = {"model": MODEL, "max_tokens": 2, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    status, got = raw(server, "POST", "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": 5})
    assert status == 200 and got["choices"][0]["prompt_token_ids"] == ids[-5:], got
    assert got["usage"]["prompt_tokens"] == 5
    status, want = raw(server, "POST", "/v1/completions", {**base, "prompt": ids[-5:]})
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    status, got = raw(server, "POST", "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": -1})
    assert status == 200 and got["choices"][0]["prompt_token_ids"] == ids, got
    status, got = raw(server, "POST", "/v1/chat/completions", {**chat("Hello there, how are you?", **base),
                                                               "truncate_prompt_tokens": 4})
    assert status == 200 and len(got["prompt_token_ids"]) == 4 == got["usage"]["prompt_tokens"], got
    for k in (0, -2, 1025):
        status, got = raw(server, "POST", "/v1/completions", {**base, "prompt": ids, "truncate_prompt_tokens": k})
        assert status == 400 and got["error"]["param"] == "truncate_prompt_tokens", got


# ---- validation messages -------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [[1, "a"], [[1, 2], "a"], [1.5, 2], [True], [[1, "a"]], 5, {"a": 1}])
def test_bad_prompt_type_names_prompt(server, prompt):
    """pydantic's union error named 'prompt.str' ('Input should be a valid string').
    ([1.0, 2] is token ids 1, 2 now, as vLLM takes it: tests/serve/test_int_fields.py.)"""
    status, got = raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert status == 400 and got["error"]["param"] == "prompt", got
    assert got["error"]["message"] == ("'prompt' must be a string, a list of strings, a list of token ids "
                                       "(integers) or a list of such lists")


@pytest.mark.parametrize("stop", ["", ["a", ""]])
def test_empty_stop_string_message(server, stop):
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", chat("hi", model=MODEL, max_tokens=1))):
        status, got = raw(server, "POST", path, {**body, "stop": stop})
        assert status == 400 and got["error"]["param"] == "stop", got
        assert "cannot contain an empty string" in got["error"]["message"], got


def test_text_part_without_text_message(server):
    for part, needle in (({"type": "text"}, "needs 'text'"), ({"type": "text", "text": 5}, "needs 'text'"),
                         ({"type": "image_url", "image_url": {"url": "x"}}, "only text parts")):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
        status, got = raw(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1})
        assert status == 400 and got["error"]["param"] == "messages[0].content", got
        assert got["error"]["message"].startswith("messages[0].content[1]: ") and needle in got["error"]["message"]


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [1]}, "stop"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [5]}, "messages[0]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "user"}]},
     "messages[1].content"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"1": "x"}}, "logit_bias.1"),
])
def test_validation_errors_name_the_field_as_a_json_path(server, path, body, where):
    """pydantic's error locations hold the union member it tried last ('stop.str') and
    list indices as fields ('messages.0'); the error's param and message give the path
    into the request's JSON instead, as the server's own checks write it."""
    status, got = raw(server, "POST", path, body)
    err = got["error"]
    assert status == 400 and err["param"] == where and err["param"] in err["message"], got


@pytest.mark.parametrize("value, where", [([1, "a"], "stop_token_ids[1]"), ([True], "stop_token_ids[0]"),
                                          ("x", "stop_token_ids"), ([[1]], "stop_token_ids[0]")])
def test_stop_token_ids_type_errors_name_the_field(server, value, where):
    status, got = raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                                          "stop_token_ids": value})
    assert status == 400 and got["error"]["param"] == "stop_token_ids", got
    assert got["error"]["message"].startswith(f"invalid value for '{where}': "), got


# ---- shutdown -------------------------------------------------------------------------------


def test_shutdown_answers_in_flight_requests(tiny_serving, serve_kit, monkeypatch):
    """Ctrl-C (uvicorn's should_exit) with requests in flight: they are aborted in the
    engine and answered, a non-streamed one with a JSON 503, a stream with an error event
    and [DONE]; nothing is logged as an error. uvicorn cancelled them after its graceful
    timeout (a CancelledError traceback, a text/plain 500, a stream cut short)."""
    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL), max_batch=2, max_model_len=1024)
    _hold_decode(monkeypatch, run.engine.runner)  # both requests in flight for 50 s, not 1 s
    errors = _Errors()
    logging.getLogger("uvicorn.error").addHandler(errors)
    results = {}
    try:
        long = {"model": MODEL, "prompt": "Go on.", "max_tokens": 1000, "ignore_eos": True}
        conn = http.client.HTTPConnection("127.0.0.1", run.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({**long, "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")

        def plain():
            c = http.client.HTTPConnection("127.0.0.1", run.port, timeout=60)
            body = chat("Go on.", model=MODEL, max_tokens=1000, ignore_eos=True)
            c.request("POST", "/v1/chat/completions", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            results["plain"] = (r.status, r.getheader("content-type"), r.read().decode())

        t = threading.Thread(target=plain)
        t.start()
        assert wait_until(lambda: run.engine.num_running == 2), (run.engine.num_waiting, dict(run.engine.stats))
        run.server.should_exit = True
        rest = resp.read().decode()
        t.join(30)
        run.thread.join(30)
        assert not run.thread.is_alive()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
        if run.thread.is_alive():
            serve_kit.stop_server(run)
    status, ctype, text = results["plain"]
    assert status == 503 and ctype == "application/json", (status, ctype, text)
    err = json.loads(text)["error"]
    assert err["type"] == "server_error" and err["code"] == "server_shutting_down", err
    events = [e for e in rest.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2][6:])["error"]["code"] == "server_shutting_down", events[-3:]
    assert not errors.records, [r.getMessage() for r in errors.records]
