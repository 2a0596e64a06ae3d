"""The Python API's stop strings, stop_token_ids and include_stop_str_in_output
(`SamplingParams`, `generate_with_runner` with a tokenizer) give what `flintc serve`
gives for the same prompt, seed and stop: the same text, token ids, finish reason and
stop reason (vLLM's stop_reason: the stop string or the stop token id that ended the
sequence, a stop_token_ids one or the generation config's <|user|> / <|observation|>,
None for end-of-text and "length"; one match and one stop-token rule,
`flintc.stop_strings`, behind both)."""

from __future__ import annotations

import pytest

from flintc.sampling import SamplingParams

MAX_LEN = 256  # the tiny_server fixture's max_model_len
SAMPLING = dict(temperature=0.9, top_p=0.95, top_k=40)


def python_side(model, tok, ids, **kw):
    """generate_with_runner on a cache of the server's length (harness.reference_at_cache_length's
    reason), with the tokenizer: the result (texts, output_ids, finish_reasons)."""
    from flintc.runtime.generate import generate_with_runner
    from flintc.runtime.runner import ReferenceRunner

    runner = ReferenceRunner(model, max_batch=1, max_model_len=MAX_LEN)
    return generate_with_runner(runner, [ids], SamplingParams(**SAMPLING, **kw), eos_token_id=tok.eos_token_id,
                                tokenizer=tok)


def server_side(tiny_server, ids, stream=False, **kw):
    """/v1/completions with the prompt's ids: (text, token ids, finish reason, stop
    reason); streamed, the text pieces joined, the stop reason the finishing chunk's
    (every other chunk's null)."""
    body = {"model": "flint-tiny", "prompt": ids, "return_token_ids": True, "skip_special_tokens": False,
            "stream": stream, **SAMPLING, **kw}
    status, got = tiny_server.post("/v1/completions", body)
    assert status == 200, got
    if not stream:
        c = got["choices"][0]
        return c["text"], c["token_ids"], c["finish_reason"], c["stop_reason"]
    chunks = [c for e in got for c in e.get("choices", ())]
    last = [c for c in chunks if c.get("finish_reason")]
    assert len(last) == 1 and last[0] is chunks[-1], chunks
    assert all(c["stop_reason"] is None for c in chunks[:-1]), chunks
    return ("".join(c.get("text", "") for c in chunks), [t for c in chunks for t in c.get("token_ids") or ()],
            last[0]["finish_reason"], last[0]["stop_reason"])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stop_strings_agree_with_the_server(tiny_server, tiny_serving, seed):
    model, tok = tiny_serving
    ids = tok.encode(f"Story {seed}: once upon a time")
    free = python_side(model, tok, ids, seed=seed, max_tokens=30, ignore_eos=True)
    text, out = free.texts[0], free.output_ids[0]
    assert server_side(tiny_server, ids, seed=seed, max_tokens=30, ignore_eos=True) == (text, out, "length", None)
    pieces = [tok.decode(out[:i]) for i in range(len(out) + 1)]
    mid = len(pieces[len(out) // 2])  # a stop string that spans the middle token's start
    cases = [dict(stop=[text[mid - 1:mid + 2]]), dict(stop=[text[5:7], text[mid:mid + 3]]),
             dict(stop=[text[:2]]), dict(stop=[text[:2], text[mid - 2:mid]], min_tokens=4),
             dict(stop_token_ids=[out[len(out) // 2]])]
    stopped = 0
    for case in cases:
        for include in (False, True):
            kw = dict(seed=seed, max_tokens=30, ignore_eos=True, include_stop_str_in_output=include, **case)
            mine = python_side(model, tok, ids, **kw)
            want = (mine.texts[0], mine.output_ids[0], mine.finish_reasons[0], mine.stop_reasons[0])
            stopped += want[2] == "stop"
            # what ended it: one of the case's stop strings or its stop token id
            assert (want[3] is None) == (want[2] == "length")
            assert want[3] is None or want[3] in case.get("stop", case.get("stop_token_ids")), (case, want)
            for stream in (False, True):
                assert server_side(tiny_server, ids, stream=stream, **kw) == want, (case, include, stream)
    # (min_tokens masks the end-of-text token, which changes a seeded draw: that case's
    # output may hold neither stop string)
    assert stopped >= 8


def test_engine_takes_the_stop_fields_of_its_params(tiny_server, tiny_serving):
    """A GenRequest whose SamplingParams carry stop / stop_token_ids /
    include_stop_str_in_output (a Python user of `Engine`; the server gives its request's
    own in the GenRequest) ends as `generate_with_runner` ends it."""
    import queue

    from flintc.serve.engine import GenRequest

    model, tok = tiny_serving
    ids = tok.encode("Story 9: once upon a time")
    free = python_side(model, tok, ids, seed=9, max_tokens=30, ignore_eos=True).texts[0]
    for kw in (dict(stop=[free[8:10]]), dict(stop=free[8:10], include_stop_str_in_output=True),
               dict(stop_token_ids=[python_side(model, tok, ids, seed=9, max_tokens=30).output_ids[0][6]])):
        mine = python_side(model, tok, ids, seed=9, max_tokens=30, ignore_eos=True, **kw)
        got: queue.Queue = queue.Queue()
        params = SamplingParams(**SAMPLING, seed=9, max_tokens=30, ignore_eos=True, **kw)
        tiny_server.engine.submit(GenRequest(list(ids), params, got.put,
                                             stop_token_ids=frozenset({tok.eos_token_id})))
        outs = [got.get(timeout=60)]
        while not outs[-1].finished:
            outs.append(got.get(timeout=60))
        assert ("".join(o.text for o in outs), [t for o in outs for t in o.token_ids], outs[-1].finish_reason,
                outs[-1].stop_reason) == (mine.texts[0], mine.output_ids[0], "stop", mine.stop_reasons[0]), kw
        assert mine.stop_reasons[0] is not None and all(o.stop_reason is None for o in outs[:-1]), kw


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_reasons_of_end_of_text_agree(tiny_server, tiny_serving, ignore_eos):
    """End-of-text (allowed alone, so drawn at once): None, also when stop_token_ids lists
    it (vLLM's end-of-text check comes first), unless ignore_eos, where only
    stop_token_ids stops it, with the id; server and Python API alike."""
    model, tok = tiny_serving
    ids = tok.encode("Story 7: once upon a time")
    eos = tok.eos_token_id
    for extra in ({}, dict(stop_token_ids=[eos])):
        if ignore_eos and not extra:
            continue  # nothing stops it but max_tokens
        kw = dict(seed=7, max_tokens=5, ignore_eos=ignore_eos, allowed_token_ids=[eos], **extra)
        mine = python_side(model, tok, ids, **kw)
        want = (mine.texts[0], mine.output_ids[0], mine.finish_reasons[0], mine.stop_reasons[0])
        assert want[1:] == ([eos], "stop", eos if ignore_eos else None), (kw, want)
        for stream in (False, True):
            assert server_side(tiny_server, ids, stream=stream, **kw) == want, (kw, stream)


@pytest.mark.parametrize("name", ["<|user|>", "<|observation|>"])
def test_generation_config_stop_tokens_agree(tiny_server, tiny_serving, name):
    """The generation config's end ids other than end-of-text (<|user|>, <|observation|>)
    end a completion and a Python API sequence alike (vLLM's
    `update_from_generation_config`, for every request): the id as stop_reason; with
    ignore_eos no stop ("length"; the tokens are text) unless stop_token_ids names it."""
    model, tok = tiny_serving
    ids = tok.encode("Story 8: once upon a time")
    t = tok.special_token_ids[name]
    for extra, end in ((dict(), ([t], "stop", t)), (dict(ignore_eos=True), ([t] * 3, "length", None)),
                       (dict(ignore_eos=True, stop_token_ids=[t]), ([t], "stop", t)),
                       (dict(include_stop_str_in_output=True), ([t], "stop", t))):
        kw = dict(seed=8, max_tokens=3, allowed_token_ids=[t], **extra)
        mine = python_side(model, tok, ids, **kw)
        want = (mine.texts[0], mine.output_ids[0], mine.finish_reasons[0], mine.stop_reasons[0])
        assert want[1:] == end and want[0] == ("" if end[1] == "stop" and "include_stop_str_in_output" not in extra
                                               else name * len(end[0])), (kw, want)
        for stream in (False, True):
            assert server_side(tiny_server, ids, stream=stream, **kw) == want, (kw, stream)


def test_max_tokens_none_agrees_with_the_server(tiny_server, tiny_serving):
    """SamplingParams(max_tokens=None) runs to the end of the context, as the server's
    "max_tokens": null: the same tokens and finish reason "length", max_model_len minus
    the prompt's length of them."""
    model, tok = tiny_serving
    ids = tok.encode("Story 5: once upon a time")
    kw = dict(seed=5, ignore_eos=True)
    mine = python_side(model, tok, ids, max_tokens=None, **kw)
    assert len(mine.output_ids[0]) == MAX_LEN - len(ids) and mine.finish_reasons == ["length"]
    for stream in (False, True):
        assert server_side(tiny_server, ids, stream=stream, max_tokens=None, **kw) == \
            (mine.texts[0], mine.output_ids[0], "length", None), stream


def test_stop_strings_inside_special_tokens_agree(tiny_server, tiny_serving):
    """A stop string inside a special token's string ("user" in <|user|>) matches neither in
    the server's default (skip_special_tokens: the text matched has no special tokens) nor
    in the Python API (which matches on the text without them too; its text keeps them):
    the same token ids, finish reason "length" and stop reason None (the Python API
    stopped at the first token, text '<|', stop_reason 'user')."""
    model, tok = tiny_serving
    ids = tok.encode("The quick brown fox")
    user = tok.special_token_ids["<|user|>"]
    for stop in (["user"], ["<|"]):
        kw = dict(seed=3, max_tokens=3, allowed_token_ids=[user], ignore_eos=True, stop=stop)
        mine = python_side(model, tok, ids, **kw)
        assert (mine.texts[0], mine.output_ids[0], mine.finish_reasons[0], mine.stop_reasons[0]) == \
            ("<|user|>" * 3, [user] * 3, "length", None), (stop, mine)
        for stream in (False, True):
            body = {"model": "flint-tiny", "prompt": ids, "return_token_ids": True, "stream": stream,
                    **SAMPLING, **kw}
            status, got = tiny_server.post("/v1/completions", body)
            assert status == 200, got
            chunks = [got["choices"][0]] if not stream else [c for e in got for c in e.get("choices", ())]
            assert ("".join(c.get("text", "") for c in chunks), [t for c in chunks for t in c.get("token_ids") or ()],
                    chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("", [user] * 3, "length", None), \
                (stop, stream, got)
