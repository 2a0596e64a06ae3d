"""Integer request fields over HTTP (a real uvicorn server on a loopback port, the tiny
BF16 reference model): a JSON number with a zero fraction (``"n": 2.0``) is taken as
the int it equals, as vLLM's lax pydantic models take it (it was a 400 here), with the
same answer as the int; 2.5, a bool and a string are still 400s naming the field as a
path into the JSON (`flintc.serve.protocol.Int`)."""

from __future__ import annotations

import pytest

MODEL = "flint-tiny"
PROMPT = [5, 77, 300, 12, 9, 41]


def answer(body: dict) -> dict:
    """A response without what differs from one request to the next (id, time)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def floats(v):
    """`v` with every int (in lists too) written as a float: 3 -> 3.0."""
    if isinstance(v, list):
        return [floats(x) for x in v]
    return float(v) if type(v) is int else v


def as_floats(fields: dict) -> dict:
    return {k: floats(v) for k, v in fields.items()}


COMPLETION_INTS = {"n": 2, "max_tokens": 4, "seed": 3, "top_k": 5, "min_tokens": 1, "logprobs": 2,
                   "prompt_logprobs": 1, "stop_token_ids": [7], "allowed_token_ids": [7, 40, 41, 300],
                   "truncate_prompt_tokens": 5, "priority": 0, "best_of": 2}
CHAT_INTS = {"n": 2, "max_completion_tokens": 3, "seed": 4, "top_k": 8, "top_logprobs": 2, "priority": 0,
             "best_of": 1}


def test_integral_floats_are_taken_as_ints(tiny_server):
    """Every integer field of completions and chat as 2.0 gives the answer of 2 (seeded
    sampling, n = 2, logprobs and prompt logprobs, allowed and stop token ids, a
    truncated prompt); prompt token ids and /detokenize's tokens too."""
    base = {"model": MODEL, "prompt": PROMPT, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}
    ints = {**COMPLETION_INTS, "best_of": 1}  # best_of > 1 is unsupported (as an int too)
    status, want = tiny_server.post("/v1/completions", {**base, **ints})
    assert status == 200, want
    assert len(want["choices"]) == 2 and want["choices"][0]["prompt_token_ids"] == PROMPT[-5:]
    status, got = tiny_server.post("/v1/completions", {**base, **as_floats(ints), "prompt": floats(PROMPT)})
    assert status == 200, got
    assert answer(got) == answer(want)
    status, batch = tiny_server.post("/v1/completions", {**base, **ints, "n": 1, "prompt": [PROMPT, [1, 2]]})
    assert status == 200, batch
    status, got = tiny_server.post("/v1/completions", {**base, **ints, "n": 1, "prompt": [floats(PROMPT), [1.0, 2]]})
    assert status == 200 and answer(got) == answer(batch), got

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 1.0,
            "ignore_eos": True, "logprobs": True}
    status, want = tiny_server.post("/v1/chat/completions", {**chat, **CHAT_INTS})
    assert status == 200 and len(want["choices"]) == 2, want
    status, got = tiny_server.post("/v1/chat/completions", {**chat, **as_floats(CHAT_INTS)})
    assert status == 200 and answer(got) == answer(want), got

    assert tiny_server.post("/detokenize", {"tokens": [40.0, 41, 1e2]}) == \
        tiny_server.post("/detokenize", {"tokens": [40, 41, 100]})


@pytest.mark.parametrize("value", [0.0, -0.0])
def test_integral_floats_meet_the_ints_range_checks(tiny_server, value):
    """The range checks see the int: "n": 0.0 is "'n' must be in [1, 16], got 0", as 0."""
    status, body = tiny_server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": value})
    assert status == 400 and body["error"]["param"] == "n", body
    assert body["error"]["message"] == "'n' must be in [1, 16], got 0"
    status, body = tiny_server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": value})
    assert status == 400 and body["error"]["message"] == "'max_tokens' must be at least 1, got 0", body


def base_request(path: str) -> dict:
    return ({"model": MODEL, "prompt": PROMPT, "max_tokens": 1} if path == "/v1/completions" else
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})


def refusals(server, path: str, fields: dict, bad) -> list[tuple[str, str]]:
    """Each of `fields` (its item, for a list) set to `bad` in a request to `path`, which
    must be a 400 naming the field. -> [(the field's path, the error message)]."""
    out = []
    for name, ok in fields.items():
        status, body = server.post(path, {**base_request(path), name: [bad] if isinstance(ok, list) else bad})
        where = f"{name}[0]" if isinstance(ok, list) else name
        assert status == 400, (name, body)
        err = body["error"]
        assert err["param"] in (name, where) and err["type"] == "invalid_request_error", (name, err)
        out.append((where, err["message"]))
    return out


@pytest.mark.parametrize("path, fields", [("/v1/completions", COMPLETION_INTS), ("/v1/chat/completions", CHAT_INTS)])
@pytest.mark.parametrize("bad", [2.5, True, False, "2"])
def test_other_values_of_integer_fields_are_refused(tiny_server, path, fields, bad):
    """2.5, true / false (a bool is not an int in the API) and "2" are 400s naming the
    field (or its item, for a list), every integer field."""
    for where, message in refusals(tiny_server, path, fields, bad):
        assert message.startswith(f"invalid value for '{where}': "), (where, message)


@pytest.mark.parametrize("path, fields", [("/v1/completions", COMPLETION_INTS), ("/v1/chat/completions", CHAT_INTS)])
@pytest.mark.parametrize("big, shown", [(1e308, "1e+308"), (-1e308, "-1e+308"), (2**63, str(2**63)),
                                        (-2**63 - 1, str(-2**63 - 1)), (10**400, "an integer of 401 digits")],
                         ids=["1e308", "-1e308", "2**63", "-2**63-1", "10**400"])
def test_integers_outside_64_bits_are_refused_briefly(tiny_server, path, fields, big, shown):
    """Every integer field takes [-2**63, 2**63) (vLLM's pydantic takes no float past it,
    its 'seed' no int): outside it is a 400 naming the field that says the number briefly.
    "seed": 1e308 was "'seed' must be an integer in [-2**63, 2**63) ..., got " and the
    309 digits of int(1e308), as were the other fields' range checks."""
    for where, message in refusals(tiny_server, path, fields, big):
        assert message == f"invalid value for '{where}': Input should be an integer in [-2**63, 2**63), " \
                          f"got {shown}", (where, message)
    for seed in (2**63 - 1, -2**63):  # the range's ends are taken
        status, body = tiny_server.post(path, {**base_request(path), "seed": seed})
        assert status == 200, body


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": MODEL, "prompt": [1.5, 2]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 1e308]}, "prompt[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [10**400]]}, "prompt[1][0]"),
    ("/detokenize", {"tokens": [-1e308]}, "tokens[0]"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [True]]}, "prompt"),
    ("/detokenize", {"tokens": [2.5]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
])
def test_token_ids_that_are_not_integral_are_refused(tiny_server, path, body, param):
    status, got = tiny_server.post(path, body)
    assert status == 400 and got["error"]["param"] == param, got
    assert len(got["error"]["message"]) < 150, got
