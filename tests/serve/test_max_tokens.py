"""`max_tokens` absent, null or a number, as vLLM reads them (a real uvicorn server on a
loopback port, the tiny BF16 reference model, a 64-token context so that "the rest of
the context" runs to its end).

vLLM's CompletionRequest declares ``max_tokens: Optional[int] = 16``: absent is 16, an
explicit null is None, and its serving layer then gives each prompt
``max_model_len - len(prompt)`` (`get_max_tokens`). flintc gave 16 for both. Chat with
``max_tokens`` and ``max_completion_tokens`` both absent or null: the rest of the
context, as before. Sampling is limited to two plain tokens so that no stop token ends
a choice early."""

from __future__ import annotations

import pytest

from flintc.serve.app import ServeOptions

MODEL = "flint-tiny"
MAX_LEN = 64
PLAIN = [40, 41]  # allowed_token_ids: no end-of-text or chat stop token can be drawn
SHORT, LONG = [5, 77, 300], [5, 77, 300, 12, 9, 8, 7, 6, 5, 4]


@pytest.fixture(scope="module")
def small(tiny_serving, serve_kit):
    """The tiny model served with --max-model-len 64, 4 slots."""
    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL), max_batch=4, max_model_len=MAX_LEN)
    yield run
    serve_kit.stop_server(run)


def completion(prompt, **kw):
    return {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True, "allowed_token_ids": PLAIN,
            "return_token_ids": True, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True,
            "allowed_token_ids": PLAIN, "return_token_ids": True, **kw}


def test_completions_absent_null_and_a_number(small):
    """Absent: 16; null: the rest of the context; a number: that many."""
    for extra, want in (({}, 16), ({"max_tokens": None}, MAX_LEN - len(SHORT)), ({"max_tokens": 5}, 5)):
        status, body = small.post("/v1/completions", completion(SHORT, **extra))
        assert status == 200, (extra, body)
        (c,) = body["choices"]
        assert len(c["token_ids"]) == want and c["finish_reason"] == "length", (extra, c)
        assert body["usage"] == {"prompt_tokens": len(SHORT), "completion_tokens": want,
                                 "total_tokens": len(SHORT) + want}, (extra, body)


def test_completions_null_gives_each_prompt_its_own_rest(small):
    """Two prompts of different lengths, n 2, null: each prompt's choices run to the end
    of its own context (not the first prompt's count, nor the shortest's), finish
    "length", and the usage counts them; the engine's params carry each prompt's."""
    seen = []
    real = small.engine.submit

    def spy(req):
        seen.append((len(req.prompt_ids), req.params.max_tokens))
        return real(req)

    small.engine.submit = spy
    try:
        status, body = small.post("/v1/completions", completion([SHORT, LONG], n=2, max_tokens=None))
    finally:
        del small.engine.submit
    assert status == 200, body
    rest = [MAX_LEN - len(SHORT)] * 2 + [MAX_LEN - len(LONG)] * 2
    assert sorted(seen) == sorted(zip([len(SHORT)] * 2 + [len(LONG)] * 2, rest)), seen
    assert [len(c["token_ids"]) for c in body["choices"]] == rest, body
    assert [c["prompt_token_ids"] for c in body["choices"]] == [SHORT, SHORT, LONG, LONG]
    assert all(c["finish_reason"] == "length" and len(c["prompt_token_ids"]) + len(c["token_ids"]) == MAX_LEN
               for c in body["choices"]), body
    p = len(SHORT) + len(LONG)  # each prompt once, whatever n (vLLM's)
    assert body["usage"] == {"prompt_tokens": p, "completion_tokens": sum(rest), "total_tokens": p + sum(rest)}


def test_completions_null_streamed_and_echoed(small, tiny_serving):
    """Streamed, null gives the same counts (each choice's chunks and the final usage);
    with echo, the text starts with the prompt's and the choice still generates the
    rest of its context (only max_tokens 0 with echo is the prompt alone)."""
    _, tok = tiny_serving
    status, events = small.post("/v1/completions", completion([SHORT, LONG], max_tokens=None, stream=True,
                                                              stream_options={"include_usage": True}))
    assert status == 200, events
    ids = {0: [], 1: []}
    reasons = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        ids[c["index"]] += c["token_ids"]
        if c["finish_reason"] is not None:
            reasons[c["index"]] = c["finish_reason"]
    rest = [MAX_LEN - len(SHORT), MAX_LEN - len(LONG)]
    assert [len(ids[0]), len(ids[1])] == rest and reasons == {0: "length", 1: "length"}, (ids, reasons)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == sum(rest), events[-1]
    text = "Hello there"
    status, body = small.post("/v1/completions", completion(text, max_tokens=None, echo=True))
    assert status == 200, body
    (c,) = body["choices"]
    n_prompt = len(tok.encode(text))
    assert c["text"].startswith(text) and len(c["token_ids"]) == MAX_LEN - n_prompt, c
    assert c["finish_reason"] == "length" and body["usage"]["completion_tokens"] == MAX_LEN - n_prompt, body
    status, body = small.post("/v1/completions", completion(text, max_tokens=0, echo=True))
    assert status == 200 and body["choices"][0]["text"] == text, body


def test_completions_null_with_a_full_context_is_refused(small):
    """null with a prompt that fills the context (no room for one token): a 400 naming
    "prompt" (context_length_exceeded), as chat's check names "messages"; one such
    prompt among others refuses the request. A number that does not fit names
    "max_tokens", as before; absent (16) too."""
    full = [5] * MAX_LEN
    for prompt in (full, [SHORT, full]):
        status, body = small.post("/v1/completions", completion(prompt, max_tokens=None))
        assert status == 400, body
        err = body["error"]
        assert err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
        assert f"the prompt has {MAX_LEN} tokens, which leaves no room to generate" in err["message"], err
    status, body = small.post("/v1/completions", completion([5] * (MAX_LEN + 1), max_tokens=None))
    assert status == 400 and body["error"]["param"] == "prompt", body
    for extra in ({}, {"max_tokens": 2}):
        status, body = small.post("/v1/completions", completion([5] * (MAX_LEN - 1), **extra))
        assert status == 400 and body["error"]["param"] == "max_tokens", (extra, body)
    status, body = small.post("/v1/completions", completion([5] * (MAX_LEN - 1), max_tokens=None))
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 1, body


def test_completions_null_min_tokens_checked_against_each_prompt(small):
    """min_tokens must fit every prompt's max_tokens: with null, the longest prompt's
    rest of the context is the bound (vLLM builds one SamplingParams per prompt)."""
    long_rest = MAX_LEN - len(LONG)
    status, body = small.post("/v1/completions", completion([SHORT, LONG], max_tokens=None, min_tokens=long_rest))
    assert status == 200, body
    status, body = small.post("/v1/completions", completion([SHORT, LONG], max_tokens=None,
                                                            min_tokens=long_rest + 1))
    assert status == 400 and body["error"]["param"] == "min_tokens", body
    # limited by the context room, not by a max_tokens the client sent (null): the Python
    # API's wording (`min_tokens_over_context`)
    assert body["error"]["message"] == (f"sampling field 'min_tokens' ({long_rest + 1}) must be at most max_tokens, "
                                        f"which is null: the rest of the context, {long_rest} tokens after the "
                                        f"prompt's {len(LONG)} (maximum model length {MAX_LEN})"), body
    # a number sent: limited by it, as before
    status, body = small.post("/v1/completions", completion([SHORT], max_tokens=2, min_tokens=3))
    assert status == 400 and "'min_tokens' (3) must be at most max_tokens (2)" in body["error"]["message"], body


def test_chat_null_min_tokens_over_the_context_room(small):
    """Chat with max_tokens null (or absent): a min_tokens over the rest of the context is a
    400 that says the context limits it (the client sent no max_tokens to be over)."""
    for extra in ({"max_tokens": None}, {}):
        status, body = small.post("/v1/chat/completions", chat(min_tokens=MAX_LEN, **extra))
        err = body["error"]
        assert status == 400 and err["param"] == "min_tokens", body
        assert "must be at most max_tokens, which is null: the rest of the context" in err["message"], body
        assert f"(maximum model length {MAX_LEN})" in err["message"], body


def test_null_builds_each_choice_once_not_once_per_prompt(small, monkeypatch):
    """Prompts of different max_tokens share the choices' checked params (copies with
    their own max_tokens): allowed_token_ids is made unique once per choice, not once
    per prompt and choice."""
    from flintc import sampling

    calls = []
    real = sampling._normalise_allowed
    monkeypatch.setattr(sampling, "_normalise_allowed", lambda ids: calls.append(ids) or real(ids))
    status, body = small.post("/v1/completions", completion([SHORT, LONG, [9] * 20], n=2, max_tokens=None))
    assert status == 200, body
    assert len([c for c in calls if c]) == 2, calls
    assert [len(c["token_ids"]) for c in body["choices"]] == [MAX_LEN - n for n in (3, 3, 10, 10, 20, 20)]


@pytest.mark.parametrize("fields", [{}, {"max_tokens": None}, {"max_completion_tokens": None},
                                    {"max_tokens": None, "max_completion_tokens": None}],
                         ids=["absent", "max_tokens-null", "max_completion_tokens-null", "both-null"])
def test_chat_absent_or_null_is_the_rest_of_the_context(small, fields):
    """Chat with max_tokens and max_completion_tokens absent or null: the rest of the
    context (vLLM's), finish "length"."""
    status, body = small.post("/v1/chat/completions", chat(**fields))
    assert status == 200, body
    (c,) = body["choices"]
    n_prompt = len(body["prompt_token_ids"])
    assert len(c["token_ids"]) == MAX_LEN - n_prompt and c["finish_reason"] == "length", (n_prompt, c)
    assert body["usage"]["completion_tokens"] == MAX_LEN - n_prompt, body


def test_chat_numbers(small):
    """A number in either field counts (max_completion_tokens first); a chat over the
    context with both null is a 400 naming "messages"."""
    for fields, want in (({"max_tokens": 3}, 3), ({"max_completion_tokens": 4}, 4),
                         ({"max_tokens": None, "max_completion_tokens": 2}, 2),
                         ({"max_tokens": 5, "max_completion_tokens": None}, 5)):
        status, body = small.post("/v1/chat/completions", chat(**fields))
        assert status == 200 and len(body["choices"][0]["token_ids"]) == want, (fields, body)
    status, body = small.post("/v1/chat/completions", {**chat(max_tokens=None),
                                                       "messages": [{"role": "user", "content": "word " * MAX_LEN}]})
    assert status == 400 and body["error"]["param"] == "messages", body
    assert body["error"]["code"] == "context_length_exceeded", body


def test_engine_submit_takes_params_with_max_tokens_none(small):
    """A Python user of `Engine` may submit SamplingParams(max_tokens=None): the rest of
    the prompt's context, as the server's null; min_tokens over it is an InputError."""
    import queue

    from flintc.errors import InputError
    from flintc.sampling import SamplingParams
    from flintc.serve.engine import GenRequest

    got: queue.Queue = queue.Queue()
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, allowed_token_ids=PLAIN)
    small.engine.submit(GenRequest(list(SHORT), params, got.put))
    outs = [got.get(timeout=60)]
    while not outs[-1].finished:
        outs.append(got.get(timeout=60))
    assert sum(len(o.token_ids) for o in outs) == MAX_LEN - len(SHORT) and outs[-1].finish_reason == "length"
    with pytest.raises(InputError, match="'min_tokens'"):
        small.engine.submit(GenRequest(list(LONG), SamplingParams(max_tokens=None, min_tokens=MAX_LEN), got.put))
