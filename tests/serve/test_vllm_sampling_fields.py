"""vLLM's `allowed_token_ids`, `bad_words` and `return_tokens_as_token_ids` over HTTP
(a real uvicorn server on a loopback port, the tiny BF16 reference model): the tokens
against the reference `generate()` with the same SamplingParams, vLLM's 400s naming the
field, and the logprobs' "token_id:{id}" strings in chat and completions, streamed and
not. (They were refused as unsupported before.)"""

from __future__ import annotations

import pytest

from flintc.sampling import SamplingParams, bad_words_to_token_ids
from flintc.serve.app import ServeOptions
from harness import reference_at_cache_length

MODEL = "flint-tiny"
PROMPT = [5, 77, 300, 12]


def completion(**kw):
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **kw}


def reference(server, model, **kw):
    """The reference model's tokens with `server`'s cache length (its max_model_len:
    `harness.reference_at_cache_length`)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, **kw)
    return reference_at_cache_length(model, PROMPT, params, server.engine.runner.max_model_len).output_ids[0]


def test_allowed_token_ids(tiny_server, tiny_serving):
    """Completions and chat draw only allowed tokens (greedy and seeded), the tokens the
    reference generate gives with the same allowed_token_ids."""
    model, _ = tiny_serving
    allowed = [40, 41, 300, 7]
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}):
        status, body = tiny_server.post("/v1/completions", completion(allowed_token_ids=allowed, **kw))
        assert status == 200, body
        got = body["choices"][0]["token_ids"]
        assert got == reference(tiny_server, model, allowed_token_ids=allowed, **kw) and set(got) <= set(allowed), kw
    status, body = tiny_server.post("/v1/chat/completions", chat(allowed_token_ids=[43, 44]))
    assert status == 200 and set(body["choices"][0]["token_ids"]) <= {43, 44}, body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("value,needle", [
    ([], "'allowed_token_ids' must not be empty"),
    ([3, 512], "'allowed_token_ids' contains out-of-vocab token id 512"),
    ([-1], "'allowed_token_ids' contains out-of-vocab token id -1"),
])
def test_allowed_token_ids_errors(tiny_server, path, value, needle):
    body = (completion if path == "/v1/completions" else chat)(allowed_token_ids=value)
    status, got = tiny_server.post(path, body)
    assert status == 400 and got["error"]["param"] == "allowed_token_ids", got
    assert needle in got["error"]["message"], got


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_allowed_token_ids_the_other_masks_exclude_are_a_400(tiny_server, tiny_serving, path, stream):
    """allowed_token_ids whose every token min_tokens (the end-of-text token held back)
    or bad_words exclude: every logit is -inf, and the sampler drew a token outside the
    set (token 0 greedily, another sampled), answered with a 200. It is the request's
    400 naming allowed_token_ids (an invalid_request_error event in a stream); the
    server answers the next request."""
    _, tok = tiny_serving
    eos = tok.eos_token_id
    make = completion if path == "/v1/completions" else chat
    for patch in (dict(allowed_token_ids=[eos], min_tokens=2, ignore_eos=False),
                  dict(allowed_token_ids=[eos], min_tokens=2, ignore_eos=False, temperature=1.0, seed=1),
                  dict(allowed_token_ids=[43], bad_words=[tok.decode([43])])):
        err = tiny_server.client_error(path, make(stream=stream, **patch))
        assert err["type"] == "invalid_request_error" and err["param"] == "allowed_token_ids", err
        assert "none of the allowed tokens" in err["message"], err
        assert ("min_tokens" if "min_tokens" in patch else "bad_words") in err["message"], err
    status, body = tiny_server.post(path, make(allowed_token_ids=[43, 44]))
    assert status == 200 and set(body["choices"][0]["token_ids"]) <= {43, 44}, body


def test_bad_words(tiny_server, tiny_serving):
    """A bad word made of the text of plain greedy's first two tokens: the server's
    tokens are the reference generate's with the word's ids (vLLM's tokenization) and
    never hold them; in chat, a one-token word's both forms are banned beside
    allowed_token_ids."""
    model, tok = tiny_serving
    status, body = tiny_server.post("/v1/completions", completion())
    plain = body["choices"][0]["token_ids"]
    word = tok.decode(plain[:2])
    ids = bad_words_to_token_ids([word], tok)
    status, body = tiny_server.post("/v1/completions", completion(bad_words=[word]))
    assert status == 200, body
    got = body["choices"][0]["token_ids"]
    assert got == reference(tiny_server, model, temperature=0, bad_words_token_ids=ids) and got != plain
    for w in ids:
        assert not any(tuple(got[i:i + len(w)]) == w for i in range(len(got))), (w, got)
    # "x" is one token, and another after a space: both banned, so only 50 is left
    assert bad_words_to_token_ids(["x"], tok) == ((87,), (363,))
    status, body = tiny_server.post("/v1/chat/completions", chat(allowed_token_ids=[87, 363, 50], bad_words=["x"],
                                                             n=2, temperature=1.0, seed=1))
    assert status == 200 and [c["token_ids"] for c in body["choices"]] == [[50] * 4] * 2, body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("value,needle", [
    ([""], "makes no tokens"),
    (["   "], "makes no tokens"),
])
def test_bad_words_errors(tiny_server, path, value, needle):
    body = (completion if path == "/v1/completions" else chat)(bad_words=value)
    status, got = tiny_server.post(path, body)
    assert status == 400 and got["error"]["param"] == "bad_words" and needle in got["error"]["message"], got
    status, got = tiny_server.post(path, {**body, "bad_words": "word"})  # a string, not a list: pydantic's 400
    assert status == 400 and got["error"]["param"] == "bad_words", got


def test_huge_lists_are_not_walked_per_choice_on_the_event_loop(tiny_server, monkeypatch):
    """A repeated allowed_token_ids list is made unique once (each choice's
    SamplingParams gets at most the vocabulary, not the 20,000 ids sent: 2M ids with
    n 16 held the event loop 24 s), and with bad_words the choices' SamplingParams are
    built on a worker thread, as their ids (200,000 words: ~1 s a choice there); the
    tokens stay in the set, and a bad id anywhere is still named."""
    import asyncio

    from flintc import sampling

    seen = []  # (ids given, whether an event loop runs in this thread)
    real_allowed, real_bad = sampling._normalise_allowed, sampling._normalise_bad_ids

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    monkeypatch.setattr(sampling, "_normalise_allowed", lambda ids: seen.append(("allowed", ids and len(ids), on_loop()))
                        or real_allowed(ids))
    monkeypatch.setattr(sampling, "_normalise_bad_ids", lambda ids: seen.append(("bad", ids is not None, on_loop()))
                        or real_bad(ids))
    status, body = tiny_server.post("/v1/completions", completion(allowed_token_ids=[41, 40] * 10_000, n=3,
                                                              temperature=1.0, seed=2))
    assert status == 200 and all(set(c["token_ids"]) <= {40, 41} for c in body["choices"]), body
    assert [s for s in seen if s[:1] == ("allowed",) and s[1]] == [("allowed", 2, True)] * 3, seen
    seen.clear()
    status, body = tiny_server.post("/v1/chat/completions", chat(bad_words=["x"], n=2))
    assert status == 200, body
    assert [s for s in seen if s[:2] == ("bad", True)] == [("bad", True, False)] * 2, seen
    status, got = tiny_server.post("/v1/completions", completion(allowed_token_ids=[5] * 1000 + [512, -1]))
    assert status == 400 and "out-of-vocab token id 512" in got["error"]["message"], got


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_completions(tiny_server, tiny_serving, stream):
    """Completions logprobs: tokens and top_logprobs keys are "token_id:{id}" (vLLM's
    format), the values as without the flag; text_offset advances by those strings, as
    vLLM's; the text itself is unchanged. Off (false or absent): the token texts."""
    _, tok = tiny_serving
    base = completion(logprobs=2, stream=stream)
    status, plain = tiny_server.post("/v1/completions", base)
    status, got = tiny_server.post("/v1/completions", {**base, "return_tokens_as_token_ids": True})
    assert status == 200, got
    if stream:
        def merge(events):
            lps = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
            return {"tokens": [t for lp in lps for t in lp["tokens"]],
                    "token_logprobs": [v for lp in lps for v in lp["token_logprobs"]],
                    "top_logprobs": [d for lp in lps for d in lp["top_logprobs"]],
                    "token_ids": [t for e in events if e["choices"] for t in e["choices"][0].get("token_ids") or []]}
        lp, lp0 = merge(got), merge(plain)
        ids = lp["token_ids"]
    else:
        lp, lp0 = got["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
        ids = got["choices"][0]["token_ids"]
        assert got["choices"][0]["text"] == plain["choices"][0]["text"]
        assert lp["text_offset"] == [sum(len(f"token_id:{t}") for t in ids[:i]) for i in range(len(ids))]
    assert len(ids) == 6 and lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert lp0["tokens"] == [tok.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
    assert lp["token_logprobs"] == lp0["token_logprobs"]
    for t, top, top0 in zip(ids, lp["top_logprobs"], lp0["top_logprobs"]):
        assert next(iter(top)) == f"token_id:{t}" and 2 <= len(top) <= 3  # the sampled token first
        assert all(k.startswith("token_id:") and 0 <= int(k[9:]) < tok.vocab_size for k in top)
        # (token texts may collide as keys; ids do not)
        assert set(top0.values()) <= set(top.values())
    status, off = tiny_server.post("/v1/completions", {**base, "return_tokens_as_token_ids": False})
    assert (merge(off) if stream else off["choices"][0]["logprobs"])["tokens"] == lp0["tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_chat(tiny_server, tiny_serving, stream):
    """Chat logprobs: content[i].token and every top_logprobs token are "token_id:{id}";
    as in vLLM, the chosen token's bytes stay its text's and a top entry's are the
    string's. prompt_logprobs keep their decoded_token text (as vLLM's)."""
    _, tok = tiny_serving
    body = chat(logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, stream=stream,
                skip_special_tokens=False)
    if not stream:
        body["prompt_logprobs"] = 1
    status, got = tiny_server.post("/v1/chat/completions", body)
    assert status == 200, got
    if stream:
        content = [e for ev in got for c in ev["choices"] if c["logprobs"] for e in c["logprobs"]["content"]]
        ids = [t for ev in got for c in ev["choices"] for t in c.get("token_ids") or []]
    else:
        content = got["choices"][0]["logprobs"]["content"]
        ids = got["choices"][0]["token_ids"]
        plp = got["prompt_logprobs"]
        assert plp[0] is None and all(not e["decoded_token"].startswith("token_id:")
                                      for p in plp[1:] for e in p.values())
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids] and len(ids) == 4
    for e, t in zip(content, ids):
        assert e["bytes"] == list(tok.token_bytes(t))
        assert len(e["top_logprobs"]) == 2
        for top in e["top_logprobs"]:
            assert top["token"].startswith("token_id:") and top["bytes"] == list(top["token"].encode())
    assert content[0]["top_logprobs"][0]["token"] == content[0]["token"]  # greedy: the top token


def test_the_fields_are_no_longer_refused(tiny_server):
    """All three at once are accepted (they were 400 'unsupported_parameter')."""
    status, got = tiny_server.post("/v1/completions", completion(
        allowed_token_ids=[40, 41], bad_words=["zz"], return_tokens_as_token_ids=True, logprobs=0))
    assert status == 200, got
    assert all(t.startswith("token_id:") for t in got["choices"][0]["logprobs"]["tokens"])


def test_engine_submit_makes_bad_words_into_ids(tiny_server, tiny_serving):
    """`Engine.submit` (vLLM's input processor) makes a GenRequest's bad words into ids
    with the engine's tokenizer, for callers of the engine other than the server; a word
    of no tokens is an InputError there."""
    import queue

    from flintc.errors import InputError
    from flintc.serve.engine import GenRequest

    model, tok = tiny_serving
    got: queue.Queue = queue.Queue()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=["x", "the"])
    req = GenRequest(prompt_ids=PROMPT, params=params, emit=got.put)
    tiny_server.engine.submit(req)
    assert req.params.bad_words_token_ids == bad_words_to_token_ids(["x", "the"], tok)
    ids = []
    while True:
        out = got.get(timeout=120)
        ids += out.token_ids
        if out.finished:
            break
    want = reference(tiny_server, model, temperature=0, bad_words_token_ids=req.params.bad_words_token_ids)
    assert out.error is None and ids == want
    with pytest.raises(InputError, match="'bad_words'"):
        tiny_server.engine.submit(GenRequest(prompt_ids=PROMPT, params=SamplingParams(bad_words=[" "]), emit=got.put))


def test_server_flag_makes_token_ids_the_default(tiny_serving, serve_kit):
    """`--return-tokens-as-token-ids` (ServeOptions.return_tokens_as_token_ids): a request
    that leaves the field out gets "token_id:{id}" tokens; one that sets it false gets text
    (vLLM: the request's value, else the server's)."""
    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL, return_tokens_as_token_ids=True),
                                 max_batch=1, max_model_len=64)
    try:
        status, got = run.post("/v1/completions", completion(logprobs=0))
        assert status == 200, got
        ids = got["choices"][0]["token_ids"]
        assert got["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
        status, got = run.post("/v1/chat/completions", chat(logprobs=True, return_tokens_as_token_ids=False))
        assert status == 200, got
        content = got["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == [tok.decode([t]) for t in got["choices"][0]["token_ids"]]
    finally:
        serve_kit.stop_server(run)
