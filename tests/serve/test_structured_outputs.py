"""Structured outputs over HTTP (a real uvicorn server, the tiny BF16 reference model,
whose unconstrained text is random): OpenAI's response_format (json_object,
json_schema), vLLM's structured_outputs object and its older guided_* fields, in chat
and completions, streamed and not, n > 1, each output matching its constraint with
finish_reason "stop"; the 400s naming the field (a bad schema / regex / grammar with
llguidance's message, two kinds, a backend other than llguidance's); a grammar that
refuses a forced token fails that request alone (the engine keeps serving)."""

from __future__ import annotations

import json
import math
import re

import pytest

MODEL = "flint-tiny"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def completion(**kw):
    return {"model": MODEL, "prompt": "Answer:", "max_tokens": 24, "seed": 3, **kw}


def chat(content="Answer in JSON.", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 40, "seed": 3, **kw}


def texts(body, key="text"):
    return [c[key] if key == "text" else c["message"]["content"] for c in body["choices"]]


@pytest.mark.parametrize("field", [{"guided_choice": ["yes", "no"]},
                                   {"structured_outputs": {"choice": ["yes", "no"]}}])
def test_completion_choice(tiny_server, field):
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        status, body = tiny_server.post("/v1/completions", completion(**field, **kw))
        assert status == 200, body
        assert body["choices"][0]["text"] in ("yes", "no") and body["choices"][0]["finish_reason"] == "stop", body


def test_completion_regex_n_and_the_mask_matters(tiny_server):
    """n = 3 seeded choices of a regex all match; the same request without it does not."""
    req = completion(n=3, guided_regex="[0-9]{3}-[ab]{2}", return_token_ids=True)
    status, body = tiny_server.post("/v1/completions", req)
    assert status == 200, body
    assert all(re.fullmatch(r"[0-9]{3}-[ab]{2}", t) for t in texts(body)), texts(body)
    assert [c["finish_reason"] for c in body["choices"]] == ["stop"] * 3
    del req["guided_regex"]
    status, free = tiny_server.post("/v1/completions", {**req, "max_tokens": 6})
    assert status == 200 and not any(re.fullmatch(r"[0-9]{3}-[ab]{2}", t) for t in texts(free)), texts(free)


def test_chat_json_schema(tiny_server):
    """response_format json_schema: the content parses and has the schema's keys and
    types; whitespace off by the schema's own llguidance options (x-guidance) or by
    structured_outputs' disable_any_whitespace beside response_format (vLLM merges them)."""
    rf = {"type": "json_schema", "json_schema": {"name": "r", "strict": True,
                                                 "schema": {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}}}
    plain_rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    for extra in ({"response_format": rf},
                  {"response_format": plain_rf, "structured_outputs": {"disable_any_whitespace": True}}):
        status, body = tiny_server.post("/v1/chat/completions", chat(**extra))
        assert status == 200, body
        obj = json.loads(texts(body, "content")[0])
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and type(obj["n"]) is int, obj
        assert body["choices"][0]["finish_reason"] == "stop"


def test_json_object_in_chat_and_completions(tiny_server, tiny_serving):
    """response_format json_object (a logit_bias towards '"' and '}' so the random model
    closes its strings): a JSON object, in both routes."""
    _, tok = tiny_serving
    bias = {str(tok.encode('"')[0]): 8, str(tok.encode("}")[0]): 8}
    so = {"structured_outputs": {"disable_any_whitespace": True}}
    for path, body in (("/v1/completions", completion(response_format={"type": "json_object"}, **so)),
                       ("/v1/chat/completions", chat(response_format={"type": "json_object"}, **so))):
        status, got = tiny_server.post(path, {**body, "logit_bias": bias, "max_tokens": 32})
        assert status == 200, got
        assert isinstance(json.loads(texts(got, "text" if "prompt" in body else "content")[0]), dict), got
        assert got["choices"][0]["finish_reason"] == "stop"
    status, got = tiny_server.post("/v1/completions", completion(response_format={"type": "text"}, max_tokens=2))
    assert status == 200, got


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_with_a_constraint(tiny_server, path):
    body = (completion if path == "/v1/completions" else chat)(
        stream=True, n=2, structured_outputs={"grammar": 'start: "id-" NUM\nNUM: /[0-9]{2,4}/'})
    status, chunks = tiny_server.post(path, body)
    assert status == 200, chunks
    got, finish = ["", ""], [None, None]
    for c in chunks:
        for ch in c["choices"]:
            got[ch["index"]] += ch["text"] if path == "/v1/completions" else ch["delta"].get("content") or ""
            finish[ch["index"]] = ch["finish_reason"] or finish[ch["index"]]
    assert all(re.fullmatch(r"id-[0-9]{2,4}", t) for t in got) and finish == ["stop", "stop"], (got, finish)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("patch, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format", "type must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "'response_format.json_schema.schema' must be a JSON schema"),
    ({"response_format": {"type": "xml"}}, "response_format",
     "must be \"text\", \"json_object\", \"json_schema\" or \"structural_tag\""),
    ({"guided_regex": "[a"}, "guided_regex", "'guided_regex': at 1(8): invalid regex"),
    ({"guided_json": {"type": "object", "required": 3}}, "guided_json", "'guided_json':"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs",
     "'structured_outputs.grammar': at 1(8): unknown name"),
    ({"guided_choice": []}, "guided_choice", "must not be empty"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "You can only use one kind of guided decoding"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "You can only use one kind of guided decoding"),
    ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "is not supported by flintc serve"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs",
     "Unrecognized request argument supplied: structured_outputs.bogus"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "'structured_outputs.structural_tag': missing 'structures'"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "needs a constraint"),
    # a bad option is named, not the constraint beside it (it said 'structured_outputs.regex':
    # structured_outputs field 'disable_any_whitespace': ..., or param "response_format")
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}}, "structured_outputs",
     "'structured_outputs.disable_any_whitespace': expected true or false, got 'yes'"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_additional_properties": 1}},
     "structured_outputs", "'structured_outputs.disable_additional_properties': expected true or false, got 1"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": 5}, "guided_whitespace_pattern",
     "'guided_whitespace_pattern': expected a string, got int"),
])
def test_errors_are_400s_naming_the_field(tiny_server, path, patch, param, needle):
    body = (completion if path == "/v1/completions" else chat)(**patch)
    status, got = tiny_server.post(path, body)
    assert status == 400 and got["error"]["param"] == param, got
    assert needle in got["error"]["message"], got


def test_backends_taken_and_whitespace_pattern(tiny_server):
    for backend in ("auto", "guidance", "llguidance", None):
        status, body = tiny_server.post("/v1/completions", completion(guided_choice=["yes", "no"],
                                                                      guided_decoding_backend=backend))
        assert status == 200 and texts(body)[0] in ("yes", "no"), body
    status, body = tiny_server.post("/v1/completions", completion(
        guided_json=SCHEMA, guided_whitespace_pattern="", max_tokens=30))
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop", body
    assert set(json.loads(texts(body)[0])) == {"ok", "n"} and " " not in texts(body)[0], body


def test_a_refused_token_fails_that_request_alone(tiny_server):
    """The forced tokens of the engine's test hook ('#script:stop': 'Hello world...')
    against a choice: the grammar refuses them, the request fails with a 500 naming
    structured outputs, and the server answers the next request."""
    status, got = tiny_server.post("/v1/chat/completions", chat("#script:stop", guided_choice=["yes", "no"]))
    assert status == 500 and "structured outputs: the grammar refused generated token" in got["error"]["message"], got
    status, body = tiny_server.post("/v1/chat/completions", chat(guided_choice=["yes", "no"]))
    assert status == 200 and texts(body, "content")[0] in ("yes", "no"), body


def test_engine_batch_mixes_constrained_and_plain_requests(tiny_server, tiny_serving):
    """The engine (`Engine.submit`, one decode batch of two): a constrained request
    (ignore_eos: its grammar still ends it, with "stop") beside a plain one of the same
    seed, which stays unconstrained (it runs to max_tokens, its text no digits only);
    the constrained one's logprobs are those of the logits the grammar's mask leaves, as
    vLLM's (it masks the logits before its sampler computes even the raw logprobs): its
    top alternatives are digits, and each step's allowed tokens sum to probability 1."""
    import threading

    from flintc.sampling import SamplingParams
    from flintc.serve.engine import GenRequest

    _, tok = tiny_serving
    engine = tiny_server.engine

    def submit(params, **kw):
        outs, done = [], threading.Event()
        req = GenRequest(tok.encode("Answer:"), params, lambda o: (outs.append(o), o.finished and done.set()),
                         stop_token_ids=frozenset({tok.eos_token_id}), **kw)
        engine.submit(req)
        return outs, done

    plain = SamplingParams(seed=9, max_tokens=10, ignore_eos=True)
    so = SamplingParams(seed=9, max_tokens=10, ignore_eos=True, structured_outputs={"regex": "[0-9]{5}"})
    (c_outs, c_done), (p_outs, p_done) = submit(so, logprobs=3), submit(plain)
    assert c_done.wait(60) and p_done.wait(60)
    assert p_outs[-1].finish_reason == "length" and len([t for o in p_outs for t in o.token_ids]) == 10
    assert not re.fullmatch(r"[0-9]*", "".join(o.text for o in p_outs))
    text = "".join(o.text for o in c_outs)
    assert re.fullmatch(r"[0-9]{5}", text) and c_outs[-1].finish_reason == "stop", (text, c_outs[-1])
    lps = [lp for o in c_outs for lp in o.logprobs]
    assert len(lps) == len([t for o in c_outs for t in o.token_ids])
    assert all(tok.decode([i]).isdigit() for lp in lps for i, v in lp.top if v > float("-inf")), lps
    assert all(lp.logprob > float("-inf") for lp in lps)


def test_chat_logprobs_of_a_choice_are_the_masked_distribution(tiny_server, tiny_serving):
    """guided_choice with top_logprobs (the usual way to read a classifier's confidence):
    as in vLLM, whose grammar bitmask is applied to the logits before its sampler
    computes logprobs, the alternatives are the tokens the grammar allows (a masked one
    shows as -9999.0, vLLM's floor) and the logprobs are renormalized over them: the
    first step's allowed tokens ('y', 'ye', 'yes', 'n', 'no' where the vocabulary has
    them) hold all the probability. flintc gave the unmasked distribution."""
    _, tok = tiny_serving
    status, body = tiny_server.post("/v1/chat/completions", chat(guided_choice=["yes", "no"], logprobs=True,
                                                                 top_logprobs=20, temperature=0))
    assert status == 200, body
    steps = body["choices"][0]["logprobs"]["content"]
    assert steps and body["choices"][0]["message"]["content"] in ("yes", "no"), body
    first = steps[0]["top_logprobs"]
    finite = [a for a in first if a["logprob"] > -9999.0]
    assert finite and all(any(w.startswith(a["token"]) for w in ("yes", "no")) for a in finite), first
    assert abs(sum(math.exp(a["logprob"]) for a in finite) - 1.0) < 1e-4, first
    assert len(first) == 20 and first[-1]["logprob"] == -9999.0  # (the tiny vocabulary has fewer than 20)


@pytest.fixture(scope="module")
def reasoning_server(tiny_serving, serve_kit):
    """The tiny model served with --reasoning-parser glm47 (its own module-scoped server)."""
    from flintc.serve.app import ServeOptions

    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions("flint-tiny", reasoning_parser="glm47"),
                                 max_batch=2, max_model_len=256)
    yield run
    serve_kit.stop_server(run)


def test_a_thinking_reply_is_constrained_after_its_thinking_block(reasoning_server, tiny_server):
    """With --reasoning-parser the grammar holds after the reply's thinking block (vLLM
    enables a request's grammar once its reasoning parser sees the reasoning end): the
    scripted reply '<think>Pick one of the two.</think>yes' against the choice
    ["yes", "no"] is the reasoning and the content "yes", finish "stop"; without the
    parser the same reply fails (the grammar refuses '<think>'). With thinking disabled
    in the prompt (enable_thinking false: it ends with '<think></think>') the grammar
    holds from the first token, and a sampled reply is one of the choices."""
    body = chat("#script:think_yes", guided_choice=["yes", "no"])
    status, got = reasoning_server.post("/v1/chat/completions", body)
    assert status == 200, got
    msg = got["choices"][0]["message"]
    assert msg["content"] == "yes" and msg["reasoning_content"] == "Pick one of the two.", msg
    assert got["choices"][0]["finish_reason"] == "stop"
    status, got = tiny_server.post("/v1/chat/completions", body)
    assert status == 500 and "the grammar refused generated token" in got["error"]["message"], got
    for seed in (1, 2, 3):
        status, got = reasoning_server.post("/v1/chat/completions", chat(
            guided_choice=["yes", "no"], seed=seed, chat_template_kwargs={"enable_thinking": False}))
        assert status == 200 and got["choices"][0]["message"]["content"] in ("yes", "no"), got
        assert got["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_constraint_that_cannot_be_followed_is_a_400(tiny_server, tiny_serving, path, stream):
    """allowed_token_ids that leave none of the tokens a choice needs (every logit -inf:
    the sampler draws a token the grammar refuses), and a regex past llguidance's limits
    (a{1000000}: its lexer refuses the first 'a' the mask allowed), are the request's
    doing: a 400 naming the constraint's field (an invalid_request_error event in a
    stream), not a 500; the server answers the next request."""
    _, tok = tiny_serving
    bad = [dict(guided_choice=["yes", "no"], allowed_token_ids=[tok.encode("!")[0]]),
           dict(structured_outputs={"regex": "a{1000000}"}, max_tokens=4)]
    for patch in bad:
        err = tiny_server.client_error(path, (completion if path == "/v1/completions" else chat)(stream=stream,
                                                                                               **patch))
        assert err["type"] == "invalid_request_error" and err["param"] == next(iter(patch)), err
        assert "structured outputs: the grammar refused generated token" in err["message"], err
    assert "allowed_token_ids" in tiny_server.post(path, (completion if path == "/v1/completions" else chat)(
        **bad[0]))[1]["error"]["message"]
    status, body = tiny_server.post("/v1/chat/completions", chat(guided_choice=["yes", "no"]))
    assert status == 200 and texts(body, "content")[0] in ("yes", "no"), body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_ignore_eos_stop_token_that_ends_the_grammar_is_not_in_the_text(tiny_server, tiny_serving, path):
    """With ignore_eos the grammar still ends at an end-of-text drawn where it accepts
    (here forced by a logit_bias after one digit of [0-9]+); that token is a stop token:
    its text is not the output's with skip_special_tokens off ('7<|endoftext|>' with
    finish_reason "stop" before), unless include_stop_str_in_output."""
    _, tok = tiny_serving
    eos = tok.eos_token_id
    make = completion if path == "/v1/completions" else chat
    key = "text" if path == "/v1/completions" else "content"
    base = dict(guided_regex="[0-9]+", ignore_eos=True, skip_special_tokens=False, logit_bias={str(eos): 100})
    status, body = tiny_server.post(path, make(**base))
    assert status == 200, body
    assert re.fullmatch(r"[0-9]", texts(body, key)[0]) and body["choices"][0]["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] == 2, body
    status, body = tiny_server.post(path, make(**base, include_stop_str_in_output=True))
    assert status == 200 and re.fullmatch(r"[0-9]<\|endoftext\|>", texts(body, key)[0]), body
    status, chunks = tiny_server.post(path, make(**base, stream=True))
    got = "".join(ch["text"] if key == "text" else ch["delta"].get("content") or ""
                  for c in chunks for ch in c["choices"])
    assert status == 200 and re.fullmatch(r"[0-9]", got), chunks
