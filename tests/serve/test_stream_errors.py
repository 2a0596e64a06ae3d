"""Errors in the middle of a stream (the 200 and the first chunks sent): as vLLM's
stream generators (`chat_completion_stream_generator`, `completion_stream_generator`:
``except Exception`` -> one ``data: {"error": ...}`` event, then ``data: [DONE]``), the
stream ends with one error event, then [DONE]; the exception is logged; the server
keeps serving and its gauges go back to 0. It was a connection cut with neither. A
client that hangs up gets nothing and nothing is logged."""

from __future__ import annotations

import http.client
import json
import logging
import time

import pytest

import flintc.serve.app as app_module
from harness import wait_until

MODEL = "flint-tiny"
PATHS = ("/v1/chat/completions", "/v1/completions")


def _body(path: str, **kw) -> dict:
    base = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "stream": True, **kw}
    if path == "/v1/completions":
        return {"prompt": "Go on.", **base}
    return {"messages": [{"role": "user", "content": "Go on."}], **base}


def _events(text: str) -> list[str]:
    """The payloads of a stream's data events, [DONE] included."""
    out = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in out), text
    return [e[6:] for e in out]


def _gauges(server) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = server.request("GET", "/metrics")
    assert status == 200, text
    got = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                got[s.name] = s.value
    return got["vllm:num_requests_running"], got["vllm:num_requests_waiting"]


def _fail_on_call(monkeypatch, owner, name: str, call: int, exc: Exception) -> dict:
    """Replace ``owner.name`` with a wrapper that raises ``exc`` on its ``call``-th call."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def _still_serves(server, path):
    """A later request, streamed and not, is answered in full; the gauges are back to 0."""
    status, text = server.request("POST", path, _body(path))
    assert status == 200 and _events(text)[-1] == "[DONE]", text
    assert not any("error" in json.loads(e) for e in _events(text)[:-1]), text
    status, text = server.request("POST", path, _body(path, stream=False))
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 8, text
    assert wait_until(lambda: _gauges(server) == (0, 0)), _gauges(server)


@pytest.mark.parametrize("path", PATHS)
def test_an_exception_mid_stream_is_an_error_event_then_done(tiny_server, path, monkeypatch, caplog):
    """Chat: its choice's parsers (`_ChatChoice.feed`) raise on the second output;
    completions: its logprobs' writer (`_completion_logprobs`) does. The chunks sent before
    stay, then one error event (the unstreamed 500's body: ``server_error``, "internal
    error: TYPE: MESSAGE"), then [DONE]."""
    if path == "/v1/chat/completions":
        calls = _fail_on_call(monkeypatch, app_module._ChatChoice, "feed", 2, RuntimeError("parser exploded"))
        body = _body(path)
    else:
        calls = _fail_on_call(monkeypatch, app_module, "_completion_logprobs", 2, RuntimeError("parser exploded"))
        body = _body(path, logprobs=1)
    with caplog.at_level(logging.ERROR, logger="flintc.serve.app"):
        status, text = tiny_server.request("POST", path, body)
    assert status == 200 and calls["n"] >= 2, text
    events = _events(text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1] == {"error": {"message": "internal error: RuntimeError: parser exploded",
                                    "type": "server_error", "param": None, "code": None}}, chunks[-1]
    assert all("error" not in c for c in chunks[:-1])
    assert len(chunks) >= 2 and chunks[0]["choices"], chunks  # a chunk went out before the error
    logged = [r for r in caplog.records if r.name == "flintc.serve.app"]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR and logged[0].exc_info, logged
    assert "parser exploded" in str(logged[0].exc_info[1]) and path in logged[0].getMessage()
    monkeypatch.undo()
    _still_serves(tiny_server, path)


@pytest.mark.parametrize("path", PATHS)
def test_an_api_error_mid_stream_keeps_its_body(tiny_server, path, monkeypatch):
    """An APIError raised while streaming is sent with its own body (type, param, code), as
    the route's exception handler answers it unstreamed."""
    from flintc.serve.protocol import APIError

    err = APIError(400, "no such thing", param="messages", code="bad_thing")
    if path == "/v1/chat/completions":
        _fail_on_call(monkeypatch, app_module._ChatChoice, "feed", 1, err)
        body = _body(path)
    else:
        _fail_on_call(monkeypatch, app_module, "_completion_logprobs", 1, err)
        body = _body(path, logprobs=1)
    status, text = tiny_server.request("POST", path, body)
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]", text
    assert json.loads(events[-2]) == {"error": {"message": "no such thing", "type": "invalid_request_error",
                                                "param": "messages", "code": "bad_thing"}}
    monkeypatch.undo()
    _still_serves(tiny_server, path)


@pytest.mark.parametrize("path", PATHS)
def test_a_runner_failure_mid_stream_is_an_error_event_then_done(tiny_server, path, monkeypatch):
    """The engine fails the request (its runner raised on a decode step: Output.error):
    one ``server_error`` event "generation failed: ..." after the chunks sent, then
    [DONE] (as before this change); the next request is served."""
    _fail_on_call(monkeypatch, tiny_server.engine.runner, "decode", 3, RuntimeError("boom"))
    status, text = tiny_server.request("POST", path, _body(path))
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1, text
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1] == {"error": {"message": "generation failed: RuntimeError: boom", "type": "server_error",
                                    "param": None, "code": None}}, chunks[-1]
    assert len(chunks) >= 2 and all("error" not in c for c in chunks[:-1]), chunks
    monkeypatch.undo()
    _still_serves(tiny_server, path)


@pytest.mark.parametrize("path", PATHS)
def test_a_client_that_hangs_up_mid_stream_gets_no_error(tiny_server, path, monkeypatch, caplog):
    """A client gone mid-stream stops the stream quietly: nothing is logged, its request is
    aborted (the gauges go back to 0), the server serves the next one."""
    decode = tiny_server.engine.runner.decode

    def held(*args, **kwargs):
        time.sleep(0.02)
        return decode(*args, **kwargs)

    monkeypatch.setattr(tiny_server.engine.runner, "decode", held)
    with caplog.at_level(logging.DEBUG, logger="flintc.serve.app"):
        conn = http.client.HTTPConnection("127.0.0.1", tiny_server.port, timeout=60)
        conn.request("POST", path, body=json.dumps(_body(path, max_tokens=200)),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.read(7) == b"data: {"  # a first chunk, then hang up
        conn.sock.shutdown(2)
        conn.close()
        assert wait_until(lambda: _gauges(tiny_server) == (0, 0)), _gauges(tiny_server)
    assert not [r for r in caplog.records if r.name == "flintc.serve.app"], caplog.records
    monkeypatch.undo()
    _still_serves(tiny_server, path)
