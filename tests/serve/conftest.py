"""Fixtures for the server tests: the tiny BF16 checkpoint's reference model, served by
real uvicorn servers on loopback ports (started once per test module, in threads of
the test process so tests can look at the engine's counters).

Tool calls and reasoning are driven by the engine's `forced_tokens` test hook (a
Python-only argument of `flintc.serve.engine.Engine`, not reachable over HTTP):
when the rendered prompt contains a marker ``#script:NAME``, the engine emits the
tokens of ``SCRIPTS[NAME]`` instead of sampling (the model still runs prefill and
decode on them), then the end-of-text token.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
from dataclasses import dataclass

import pytest

SCRIPTS = {
    "think": "<think>The user wants a number.</think>The answer is 4.",
    "think_long": "<think>This is a long line of thought that will be cut off</think>done",
    "tool": ("Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
             "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
             "<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>"),
    "think_tool": ("<think>Weather needs a tool.</think><tool_call>get_weather<arg_key>city</arg_key>"
                   "<arg_value>Oslo</arg_value></tool_call>"),
    "bad_tool": "Trying.<tool_call>get_weather<arg_key>city</arg_key></tool_call>",
    "stop": "Hello world. Goodbye world.",
    "think_yes": "<think>Pick one of the two.</think>yes",
    # structural tags (tests/serve/test_structural_tag.py: the trigger '@')
    "stag": 'Let me add. @add({"n": 3}) and @neg({"ok": true}) done.',
    "stag_bad": 'Let me add. @add({"n": 12}) done.',
}


@dataclass
class Running:
    base_url: str
    port: int
    engine: object
    server: object
    thread: threading.Thread
    api_key: str | None = None

    def request(self, method, path, body=None, headers=None, timeout=120) -> tuple[int, str]:
        """One HTTP request without the openai client (`body`: bytes, str or JSON data),
        with the server's API key unless ``headers`` overrides it. -> (status, body text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **auth,
                                                        **(headers or {})})
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        return resp.status, text

    def post(self, path, body, loads=json.loads, headers=None):
        """POST `body` as JSON. -> (status, loads(body text)) or, for a stream answered 200,
        (status, [loads(payload) for each data event but [DONE]]). ``loads=str``: the text."""
        status, text = self.request("POST", path, body, headers)
        if body.get("stream") and status == 200:
            return status, [loads(e[6:]) for e in text.split("\n\n") if e and e != "data: [DONE]"]
        return status, loads(text)

    def client_error(self, path, body) -> dict:
        """POST `body`, which the server must refuse as the request's own error, once it
        generates: the 400's ``error``, or, streamed, the error event's (the stream is a
        200 whose last event holds it)."""
        status, got = self.post(path, body)
        if body.get("stream"):
            assert status == 200, got
            return got[-1]["error"]
        assert status == 400, got
        return got["error"]


@pytest.fixture(scope="session")
def tiny_serving(tiny_bf16_dir):
    """(FlintModel, FlintTokenizer) of the tiny BF16 checkpoint, loaded once."""
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.checkpoint.tokenizer import load_tokenizer
    from flintc.model.reference import FlintModel

    ckpt = load_checkpoint(tiny_bf16_dir, progress=False)
    return FlintModel(ckpt.config, ckpt.weights), load_tokenizer(ckpt.tokenizer_dir)


def scripted(tokenizer):
    """The forced_tokens hook: SCRIPTS[NAME] for a prompt holding '#script:NAME'."""

    def hook(prompt_ids):
        m = re.search(r"#script:(\w+)", tokenizer.decode(prompt_ids))
        return tokenizer.encode(SCRIPTS[m.group(1)]) if m else None

    return hook


def start_server(model, tokenizer, options, max_batch=4, max_model_len=256, wrap=None, **engine_kw) -> Running:
    """A uvicorn server for create_app(...) on 127.0.0.1 (a free port), in a thread.
    ``wrap``: called with the ReferenceRunner, returns the runner the engine uses;
    ``engine_kw``: more arguments of the Engine (``scheduling_policy``, ``observers``)."""
    import uvicorn

    from flintc.runtime.runner import ReferenceRunner
    from flintc.serve.app import create_app
    from flintc.serve.engine import Engine
    from flintc.serve.server import bind, uvicorn_server

    runner = ReferenceRunner(model, max_batch=max_batch, max_model_len=max_model_len)
    if wrap is not None:
        runner = wrap(runner)
    engine = Engine(runner, tokenizer, forced_tokens=scripted(tokenizer), **engine_kw)
    app = create_app(engine, tokenizer, options)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    # keep-alive 300 s, not uvicorn's 5: a module's openai client reuses its pooled
    # connection, and one closed by the server as the client sends on it is a "Connection
    # reset by peer" (max_retries=0): under load a test idle 5 s between requests met it
    server = uvicorn_server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                           timeout_keep_alive=300))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > end or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return Running(f"http://127.0.0.1:{port}/v1", port, engine, server, thread, options.api_key)


def stop_server(running: Running) -> None:
    running.server.should_exit = True
    running.thread.join(10)


@pytest.fixture(scope="module")
def tiny_server(tiny_serving):
    """The tiny model served as "flint-tiny" with default options (no API key), 2 slots of
    256 tokens, for a test module."""
    from flintc.serve.app import ServeOptions

    model, tok = tiny_serving
    run = start_server(model, tok, ServeOptions("flint-tiny"), max_batch=2, max_model_len=256)
    yield run
    stop_server(run)


@pytest.fixture(scope="session")
def serve_kit():
    """The helpers above, for test modules (a conftest cannot be imported by name here:
    tests/conftest.py owns that name)."""
    import types

    return types.SimpleNamespace(SCRIPTS=SCRIPTS, start_server=start_server, stop_server=stop_server)
