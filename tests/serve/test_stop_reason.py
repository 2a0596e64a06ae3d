"""vLLM's `stop_reason` on the choices of /v1/completions and /v1/chat/completions (a
real uvicorn server, the tiny BF16 reference model).

vLLM's rules (`vllm/v1/core/sched/utils.py` `check_stop`, its detokenizer's
`check_stop_strings`, `SamplingParams.update_from_generation_config`): the stop string
that matched (a str); the id of a `stop_token_ids` token (an int), `<|user|>` /
`<|observation|>` included in chat and completions alike (GLM's generation config lists
them as end ids, which vLLM adds to every request's `stop_token_ids` unless ignore_eos);
None for the tokenizer's end-of-text (even when `stop_token_ids` lists it, unless
ignore_eos), for "length", and for a structured output that completed. Unstreamed: on
every choice. Streamed: completions put it on every chunk's choice, null but on the one
that finishes it (vLLM serializes with exclude_unset=False); chat only on the chunk that
finishes the choice (exclude_unset=True).
"""

from __future__ import annotations

import pytest

MODEL = "flint-tiny"


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, **kw}


def completion(**kw):
    return {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, **kw}


def special(tok, name: str) -> int:
    return tok.special_token_ids[name]


def chat_result(server, body) -> tuple[str, object]:
    """(finish_reason, stop_reason) of the only choice, checked to agree between the
    unstreamed and the streamed answers; the streamed one's stop_reason only on its
    finishing chunk."""
    status, got = server.post("/v1/chat/completions", body)
    assert status == 200, got
    (c,) = got["choices"]
    assert "stop_reason" in c, c
    status, events = server.post("/v1/chat/completions", {**body, "stream": True})
    assert status == 200, events
    choices = [ch for e in events for ch in e.get("choices", ())]
    last = [ch for ch in choices if ch["finish_reason"] is not None]
    assert len(last) == 1 and all("stop_reason" not in ch for ch in choices if ch is not last[0]), choices
    assert (last[0]["finish_reason"], last[0]["stop_reason"]) == (c["finish_reason"], c["stop_reason"])
    return c["finish_reason"], c["stop_reason"]


def completion_result(server, body) -> tuple[str, object]:
    """As `chat_result` for /v1/completions, whose streamed choices all carry stop_reason
    (null but on the finishing chunk)."""
    status, got = server.post("/v1/completions", body)
    assert status == 200, got
    (c,) = got["choices"]
    status, events = server.post("/v1/completions", {**body, "stream": True})
    assert status == 200, events
    choices = [ch for e in events for ch in e.get("choices", ())]
    assert all("stop_reason" in ch for ch in choices), choices
    assert all(ch["stop_reason"] is None for ch in choices[:-1]), choices
    assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == (c["finish_reason"], c["stop_reason"])
    return c["finish_reason"], c["stop_reason"]


def test_chat_stop_tokens(tiny_server, tiny_serving):
    """End-of-text: None; <|user|> and <|observation|> (the generation config's other end
    ids, vLLM's stop_token_ids): their ids; with ignore_eos they do not stop (vLLM leaves
    them out of stop_token_ids then) unless given in stop_token_ids."""
    _, tok = tiny_serving
    eos, user, obs = tok.eos_token_id, special(tok, "<|user|>"), special(tok, "<|observation|>")
    assert chat_result(tiny_server, chat(allowed_token_ids=[eos])) == ("stop", None)
    assert chat_result(tiny_server, chat(allowed_token_ids=[user])) == ("stop", user)
    assert chat_result(tiny_server, chat(allowed_token_ids=[obs])) == ("stop", obs)
    assert chat_result(tiny_server, chat(allowed_token_ids=[user], ignore_eos=True, max_tokens=2)) \
        == ("length", None)
    assert chat_result(tiny_server, chat(allowed_token_ids=[user], ignore_eos=True, stop_token_ids=[user])) \
        == ("stop", user)
    # end-of-text in stop_token_ids: vLLM's end-of-text check comes first (None), unless ignore_eos
    assert chat_result(tiny_server, chat(allowed_token_ids=[eos], stop_token_ids=[eos])) == ("stop", None)
    assert chat_result(tiny_server, chat(allowed_token_ids=[eos], stop_token_ids=[eos], ignore_eos=True)) \
        == ("stop", eos)


def test_chat_stop_string_and_length(tiny_server):
    """A stop string: the string (the first in the request's order that matched); length: None."""
    assert chat_result(tiny_server, chat(messages=[{"role": "user", "content": "#script:stop"}],
                                         stop=["Nope", "Goodbye", "world"])) == ("stop", "world")
    assert chat_result(tiny_server, chat(messages=[{"role": "user", "content": "#script:stop"}],
                                         stop=["Goodbye"])) == ("stop", "Goodbye")
    assert chat_result(tiny_server, chat(messages=[{"role": "user", "content": "#script:stop"}],
                                         max_tokens=2)) == ("length", None)


@pytest.fixture(scope="module")
def tool_server(tiny_serving, serve_kit):
    """The tiny model with the glm47 tool-call parser (auto tool choice)."""
    from flintc.serve.app import ServeOptions

    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL, enable_auto_tool_choice=True,
                                                          tool_call_parser="glm47"),
                                 max_batch=1, max_model_len=1024)
    yield run
    serve_kit.stop_server(run)


def test_chat_tool_calls_keep_the_stop_reason(tool_server, tiny_serving):
    """finish_reason "tool_calls" (the parser found calls): stop_reason is still what ended
    the sequence (vLLM's output.stop_reason), here the forced script's end token: the
    smallest chat stop id (the engine's test hook), the end-of-text: None."""
    _, tok = tiny_serving
    assert tok.eos_token_id < min(special(tok, "<|user|>"), special(tok, "<|observation|>"))
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "get_time")]
    body = chat(messages=[{"role": "user", "content": "#script:tool"}], tools=tools, max_tokens=120)
    assert chat_result(tool_server, body) == ("tool_calls", None)


def test_completion_stop_reasons(tiny_server, tiny_serving):
    """Completions: end-of-text None, a stop_token_ids id the id, a stop string the string,
    length None; a completed structured output None. The generation config's <|user|> and
    <|observation|> end a completion as they end a chat (vLLM's
    `update_from_generation_config` applies to every request): their ids; with ignore_eos
    they do not stop unless given in stop_token_ids."""
    _, tok = tiny_serving
    eos = tok.eos_token_id
    assert completion_result(tiny_server, completion(allowed_token_ids=[eos])) == ("stop", None)
    assert completion_result(tiny_server, completion(allowed_token_ids=[40], stop_token_ids=[40])) == ("stop", 40)
    assert completion_result(tiny_server, completion(allowed_token_ids=[40], max_tokens=3)) == ("length", None)
    user, obs = special(tok, "<|user|>"), special(tok, "<|observation|>")
    assert completion_result(tiny_server, completion(allowed_token_ids=[user], max_tokens=2)) == ("stop", user)
    assert completion_result(tiny_server, completion(allowed_token_ids=[obs], max_tokens=2)) == ("stop", obs)
    assert completion_result(tiny_server, completion(allowed_token_ids=[user], max_tokens=2, ignore_eos=True)) \
        == ("length", None)
    assert completion_result(tiny_server, completion(allowed_token_ids=[user], max_tokens=2, ignore_eos=True,
                                                     stop_token_ids=[user])) == ("stop", user)
    assert completion_result(tiny_server, completion(structured_outputs={"choice": ["yes", "no"]},
                                                     max_tokens=20)) == ("stop", None)


def test_completion_stop_string(tiny_server, tiny_serving):
    """The stop string that matched, on the choice of each of n choices."""
    _, tok = tiny_serving
    status, got = tiny_server.post("/v1/completions", completion(max_tokens=12, ignore_eos=True))
    text = got["choices"][0]["text"]
    stop = text[4:6]
    assert completion_result(tiny_server, completion(max_tokens=12, ignore_eos=True, stop=["\u2603", stop])) \
        == ("stop", stop)
    status, got = tiny_server.post("/v1/completions", completion(max_tokens=12, ignore_eos=True, stop=[stop], n=2,
                                                                 temperature=0.0))
    assert status == 200 and [c["stop_reason"] for c in got["choices"]] == [stop, stop], got
