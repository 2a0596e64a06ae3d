"""`flintc serve` as a command: a real subprocess on a free loopback port, and its
one-line errors (exit code 2)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from flintc.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_serve_subprocess(tiny_nvfp4_gguf):
    cmd = [sys.executable, "-m", "flintc", "serve", str(tiny_nvfp4_gguf), "--port", "0", "--api-key", "k1",
           "--max-model-len", "64", "--max-batch", "2", "--served-model-name", "tiny", "--reasoning-parser",
           "glm47", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # SIGINT back to its default in the child: a shell's background job (`cmd &` without job
    # control) inherits SIGINT ignored, and then uvicorn's re-raise after its graceful
    # shutdown would be ignored too (exit 0 instead of Ctrl-C's 130)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        port, lines = None, []
        end = time.monotonic() + 300  # it took 50 s, start to end, with the CPU loaded 3-fold
        while port is None and time.monotonic() < end:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1 \(max batch 2, max model len 64\)", line)
            port = int(m.group(1)) if m else None
        assert port is not None, "".join(lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k1", max_retries=3)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k2", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError, match="maximum context length of 64"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x " * 80}],
                                           max_tokens=3)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        rest = proc.stderr.read()
        proc.stderr.close()
    # uvicorn re-raises SIGINT after its graceful shutdown: flintc's usual 130, no traceback
    assert rc == 130 and "Traceback" not in rest, rest


def test_build_that_is_not_a_build(tiny_bf16_dir, tmp_path, capsys):
    """`--build` naming a folder without build.json: one line, exit code 2 (serving a real
    build is tested in tests/runtime/test_compiled.py::test_serve_a_build)."""
    rc = main(["serve", "--build", str(tmp_path), "--tokenizer", str(tiny_bf16_dir), "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "is not a flintc build" in err and err.count("\n") == 1


@pytest.mark.parametrize("template, needle", [
    (5, "chat_template must be a string (a Jinja template) or a list of {\"name\", \"template\"} objects, got int"),
    ([{"name": "default"}], "chat_template[0] must be an object with string \"name\" and \"template\""),
    ([{"name": "tool_use", "template": "x"}], "several chat templates (tool_use) and none named 'default'"),
    ("{% for m in messages %}{{ m.content }", "the chat_template does not compile: unexpected '}' (template line 1)"),
    ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}",
     "the chat_template does not compile: No filter named 'nosuchfilter'. (template line 1)"),
])
def test_malformed_chat_template_stops_serve(tiny_bf16_dir, tmp_path, capsys, template, needle):
    """A malformed chat template stops `flintc serve` at startup, one line naming
    tokenizer_config.json, exit code 2; it was found by every chat request instead (a
    500, or a 400 for an unknown filter)."""
    import json
    import shutil

    ck = shutil.copytree(tiny_bf16_dir, tmp_path / "ck")
    config = json.loads((ck / "tokenizer_config.json").read_text())
    (ck / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    rc = main(["serve", str(ck), "--port", "0", "--max-model-len", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "tokenizer_config.json: " + needle in err, err


def test_chat_template_flag(tiny_bf16_dir, tmp_path, capsys):
    """--chat-template takes a file or the template itself, as vLLM's; a path that does
    not exist, or a template that does not compile, is one line naming the flag."""
    from flintc.cli.serve import chat_template_arg

    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}", encoding="utf-8")
    assert chat_template_arg(str(f)) == ("{{ messages[0].content }}", str(f))
    assert chat_template_arg("{% for m in messages %}{{ m.content }}{% endfor %}")[1] == "--chat-template"
    for value, needle in ((str(tmp_path / "nope.jinja"), "no such file, and not a Jinja template either"),
                          ("{{ messages[0].content }", "--chat-template: the chat_template does not compile")):
        rc = main(["serve", str(tiny_bf16_dir), "--port", "0", "--max-model-len", "64", "--chat-template", value])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and needle in err, err


def test_busy_port_and_bad_flags(tiny_bf16_dir, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        rc = main(["serve", str(tiny_bf16_dir), "--port", str(port)])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot listen on 127.0.0.1:{port}" in err
    assert main(["serve", str(tiny_bf16_dir), "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    assert main(["serve", str(tiny_bf16_dir), "--max-batch", "0"]) == 2
    assert main(["serve", str(tiny_bf16_dir), "--tokenizer", str(tiny_bf16_dir / "nope")]) == 2
    capsys.readouterr()
    # an empty --api-key would accept `Authorization: Bearer ` with no key; empty names too
    # an empty --host listened on every interface (0.0.0.0), silently
    for flag, needle in (("--api-key", "--api-key must not be empty"),
                         ("--served-model-name", "--served-model-name must not be empty"),
                         ("--host", "--host must not be empty: expected the address to listen on")):
        for empty in ("", " "):
            assert main(["serve", str(tiny_bf16_dir), flag, empty, "--port", "0"]) == 2
            err = capsys.readouterr().err
            assert needle in err and "Traceback" not in err, err
    # a key no HTTP header can carry as given (non-ASCII: the server read the header's UTF-8
    # bytes as Latin-1; spaces around it: stripped from the header) was accepted, and then
    # every request was a 401 telling the client to send what it sent
    for key in ("sëcret", " k1", "k1 ", "k\x01"):
        assert main(["serve", str(tiny_bf16_dir), "--api-key", key, "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert "--api-key must be printable ASCII" in err and err.count("\n") == 1, err


def test_ipv6_host_is_bracketed_in_the_url(tiny_bf16_dir, capsys, monkeypatch):
    """`--host ::1`: the stderr line gives a URL a client can use, http://[::1]:PORT/v1
    (it said http://::1:PORT/v1), and a busy port names [::1]:PORT."""
    import flintc.serve.server

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    monkeypatch.setattr(flintc.serve.server, "serve", lambda app, sock, log_level="info": sock.close())
    assert main(["serve", str(tiny_bf16_dir), "--host", "::1", "--port", "0", "--max-model-len", "64"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"on http://\[::1\]:\d+/v1 ", err), err
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["serve", str(tiny_bf16_dir), "--host", "::1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on [::1]:{port}" in err, err


def test_max_request_bytes_flag(tiny_bf16_dir, capsys, monkeypatch):
    """--max-request-bytes (default 32 MiB, 0: no cap) reaches the app's options; a
    negative value is one line, exit code 2, before anything loads."""
    import flintc.serve.app
    from flintc.errors import InputError

    seen = []

    def create_app(engine, tokenizer, options):
        seen.append(options.max_request_bytes)
        raise InputError("stop before serving")

    monkeypatch.setattr(flintc.serve.app, "create_app", create_app)
    for flags in ([], ["--max-request-bytes", "0"], ["--max-request-bytes", "1000"]):
        assert main(["serve", str(tiny_bf16_dir), "--port", "0", "--max-model-len", "64", *flags]) == 2
    assert seen == [32 * 2**20, 0, 1000]
    capsys.readouterr()
    assert main(["serve", str(tiny_bf16_dir), "--port", "0", "--max-request-bytes", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == "flintc: error: --max-request-bytes must be 0 (no cap) or more, got -1\n", err
    assert seen == [32 * 2**20, 0, 1000]


def test_return_tokens_as_token_ids_flag(tiny_bf16_dir, monkeypatch):
    """--return-tokens-as-token-ids (vLLM's) reaches the app's options; off by default."""
    import flintc.serve.app
    from flintc.errors import InputError

    seen = []

    def create_app(engine, tokenizer, options):
        seen.append(options.return_tokens_as_token_ids)
        raise InputError("stop before serving")

    monkeypatch.setattr(flintc.serve.app, "create_app", create_app)
    for flags in ([], ["--return-tokens-as-token-ids"]):
        assert main(["serve", str(tiny_bf16_dir), "--port", "0", "--max-model-len", "64", *flags]) == 2
    assert seen == [False, True]


def test_prefix_caching_flags(tiny_bf16_dir, monkeypatch):
    """--enable-prefix-caching / --no-enable-prefix-caching reach the engine (off by
    default) and --enable-prompt-tokens-details the app's options."""
    import flintc.serve.app
    from flintc.errors import InputError

    seen = []

    def create_app(engine, tokenizer, options):
        seen.append((engine.enable_prefix_caching, options.enable_prompt_tokens_details))
        raise InputError("stop before serving")

    monkeypatch.setattr(flintc.serve.app, "create_app", create_app)
    for flags in ([], ["--enable-prefix-caching"], ["--enable-prefix-caching", "--no-enable-prefix-caching"],
                  ["--enable-prompt-tokens-details"]):
        assert main(["serve", str(tiny_bf16_dir), "--port", "0", "--max-model-len", "64", *flags]) == 2
    assert seen == [(False, False), (True, False), (False, False), (False, True)]


def test_scheduling_policy_flag(tiny_bf16_dir, capsys, monkeypatch):
    """--scheduling-policy (vLLM's: fcfs, the default, or priority) reaches the engine; any
    other value is argparse's one-line error, exit code 2."""
    import flintc.serve.app
    from flintc.errors import InputError

    seen = []

    def create_app(engine, tokenizer, options):
        seen.append(engine.scheduling_policy)
        raise InputError("stop before serving")

    monkeypatch.setattr(flintc.serve.app, "create_app", create_app)
    for flags in ([], ["--scheduling-policy", "priority"], ["--scheduling-policy", "fcfs"]):
        assert main(["serve", str(tiny_bf16_dir), "--port", "0", "--max-model-len", "64", *flags]) == 2
    assert seen == ["fcfs", "priority", "fcfs"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tiny_bf16_dir), "--scheduling-policy", "sjf"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--scheduling-policy: invalid choice: 'sjf'" in err and "Traceback" not in err, err
    assert seen == ["fcfs", "priority", "fcfs"]


def test_make_runner_build_limits_use_the_shared_function(monkeypatch):
    """`flintc serve --build`: --max-model-len / --max-batch are checked against build.json
    before the weights load (compiled.check_build_limits) and applied through
    compiled.limit_build, as for `flintc run --build` (a stand-in build: no weights)."""
    import argparse
    from types import SimpleNamespace

    from flintc.errors import InputError
    from flintc.runtime import compiled
    from flintc.serve.server import make_runner

    calls, loads = [], []
    real = compiled.limit_build
    monkeypatch.setattr(compiled, "read_manifest", lambda build: {"max_batch": 4, "max_model_len": 64})
    monkeypatch.setattr(compiled, "load_build",
                        lambda *a, **kw: loads.append(a) or SimpleNamespace(max_batch=4, max_model_len=64))
    monkeypatch.setattr(compiled, "limit_build", lambda *a, **kw: calls.append(a) or real(*a, **kw))

    def ns(**kw):
        return argparse.Namespace(**{"build": "b", "model": None, "hf_config_path": None, "device": None,
                                     "max_batch": None, "max_model_len": None, **kw})

    runner = make_runner(ns())
    assert (runner.max_batch, runner.max_model_len) == (4, 64)
    runner = make_runner(ns(max_batch=2, max_model_len=32))
    assert (runner.max_batch, runner.max_model_len) == (2, 32)
    assert len(calls) == len(loads) == 2
    with pytest.raises(InputError, match="--max-model-len 65: b was compiled for 64 positions"):
        make_runner(ns(max_model_len=65))
    with pytest.raises(InputError, match="--max-batch 8: b was compiled for at most 4 sequences"):
        make_runner(ns(max_batch=8))
    with pytest.raises(InputError, match="--max-batch must be at least 1, got 0"):
        make_runner(ns(max_batch=0))
    assert len(calls) == len(loads) == 2  # refused before the weights load


def test_reference_runner_limits_are_checked(tiny_bf16_dir, monkeypatch):
    """Without --build: --max-model-len above max_position_embeddings was cut to it
    silently, and KV caches beyond the memory (--max-batch 100000) were a bare "can't
    allocate memory" RuntimeError. Both are one line naming the flags (the memory is
    monkeypatched: no test allocates that much)."""
    import argparse

    import flintc.runtime.device as device
    from flintc.errors import InputError
    from flintc.serve.server import _check_caches_fit, make_runner

    def ns(**kw):
        return argparse.Namespace(**{"build": None, "model": str(tiny_bf16_dir), "hf_config_path": None,
                                     "device": None, "max_batch": None, "max_model_len": None, **kw})

    with pytest.raises(InputError, match=r"^--max-model-len 4097: more than the model's max_position_embeddings "
                                         r"\(4096\)"):
        make_runner(ns(max_model_len=4097))
    runner = make_runner(ns(max_batch=4, max_model_len=64))
    assert (runner.max_batch, runner.max_model_len) == (4, 64)
    # tiny: 2 full layers x 64 rows + 2 sliding x 9, 2 KV heads x 32 x bf16, K and V: 37,376 bytes a slot
    monkeypatch.setattr(device, "available_memory_bytes", lambda: 4 * 37376)
    _check_caches_fit(runner.config, 4, 64, "cpu")
    _check_caches_fit(runner.config, 5, 64, "meta")  # not a CPU: not checked
    with pytest.raises(InputError, match=r"^--max-batch 5 x --max-model-len 64: the KV caches would take 0\.0 GiB, "
                                         r"but only 0\.0 GiB of memory is available; give a smaller --max-batch"):
        _check_caches_fit(runner.config, 5, 64, "cpu")


def test_reference_runner_sizes_rope_by_max_model_len(tiny_bf16_dir):
    """The reference backend made RoPE tables of max_position_embeddings rows whatever
    --max-model-len said (2**22 positions: 1 GB for a 64-token server); they have the
    rows the server can use, as vLLM sizes by max_model_len, and the same values."""
    import argparse

    import torch

    from flintc.model import ops
    from flintc.serve.server import make_runner

    def ns(**kw):
        return argparse.Namespace(**{"build": None, "model": str(tiny_bf16_dir), "hf_config_path": None,
                                     "device": None, "max_batch": 2, "max_model_len": None, **kw})

    runner = make_runner(ns(max_model_len=64))
    assert runner.model.rope_cos.shape[0] == runner.model.max_positions == runner.max_model_len == 64
    cos, sin = ops.rope_tables(10000.0, 32, 4096, torch.float32)
    assert torch.equal(runner.model.rope_cos, cos[:64]) and torch.equal(runner.model.rope_sin, sin[:64])
    assert make_runner(ns()).model.rope_cos.shape[0] == 4096  # no flag: max_position_embeddings


def test_kv_cache_refusal_advice_fits_the_sliding_rings(monkeypatch):
    """`flintc serve` of a config whose rings dominate (sliding_window = max_position_embeddings)
    said "give a smaller --max-batch or --max-model-len" with the same GiB at --max-model-len
    64 as at 4096: a ring has sliding_window rows at any length. The advice then names
    the rings and --max-batch only; the sizes are unchanged."""
    import flintc.runtime.device as device
    from flintc.config import FlintConfig
    from flintc.errors import InputError
    from flintc.serve.server import _check_caches_fit

    cfg = FlintConfig.preset("tiny").replace(sliding_window=4096)
    per_row = 2 * 2 * 32 * 2  # K and V, 2 KV heads x 32, bf16: one slot
    monkeypatch.setattr(device, "available_memory_bytes", lambda: 8 * 4096 * per_row)
    with pytest.raises(InputError, match=r"^--max-batch 8 x --max-model-len 64: the KV caches would take "
                                         r"0\.[0-9] GiB, .*; the 2 sliding layers' rings \(4096 rows each, "
                                         r"sliding_window, at any --max-model-len\) take 0\.[0-9] GiB of it: give "
                                         r"a smaller --max-batch$"):
        _check_caches_fit(cfg, 8, 64, "cpu")
    _check_caches_fit(cfg, 3, 64, "cpu")
    tiny = FlintConfig.preset("tiny")  # 9-row rings: a shorter --max-model-len helps
    with pytest.raises(InputError, match=r"give a smaller --max-batch or --max-model-len$"):
        _check_caches_fit(tiny, 8, 4096, "cpu")


@pytest.mark.parametrize("kinds, window", [
    (None, None),  # the tiny preset: sliding and full layers, W 9
    (("full_attention",) * 4, None),  # no ring
    (("sliding_attention",) * 4, None),  # rings only: the same bytes at any --max-model-len
    (None, 64),  # a ring longer than some of the lengths below
])
def test_kv_cache_check_sizes_what_new_kv_cache_allocates(monkeypatch, kinds, window):
    """`_check_caches_fit` sized the caches by hand from the config, beside
    `FlintModel.new_kv_cache`'s own shapes: both read `kv_cache_shapes` now. The bytes
    it checks are the nbytes of what new_kv_cache allocates (the boundary: that much
    memory passes, a byte less is refused), and so are `kv_cache_bytes`' and the
    build plan's (`_kv_layout`, what the compiled runner allocates)."""
    import flintc.runtime.device as device
    from flintc.checkpoint.init import random_weights
    from flintc.config import FlintConfig
    from flintc.errors import InputError
    from flintc.model.reference import FlintModel, kv_cache_bytes, kv_cache_shapes
    from flintc.runtime.build import BuildOptions, _kv_layout
    from flintc.serve.server import _check_caches_fit

    cfg = FlintConfig.preset("tiny")
    if kinds is not None:
        cfg = cfg.replace(layer_types=kinds)
    if window is not None:
        cfg = cfg.replace(sliding_window=window)
    model = FlintModel(cfg, random_weights(cfg))
    for max_batch, max_len in ((1, 1), (1, 8), (3, 17), (4, 64), (2, 100)):
        kv = model.new_kv_cache(max_batch, max_len)
        allocated = sum(t.nbytes for t in kv)
        assert [tuple(t.shape) for t in kv] == kv_cache_shapes(cfg, max_batch, max_len)
        assert kv_cache_bytes(cfg, max_batch, max_len) == allocated
        rings = sum(t.nbytes for i, t in enumerate(kv) if cfg.is_sliding_layer(i // 2))
        assert kv_cache_bytes(cfg, max_batch, max_len, sliding_only=True) == rings
        monkeypatch.setattr(device, "available_memory_bytes", lambda: allocated)
        _check_caches_fit(cfg, max_batch, max_len, "cpu")
        monkeypatch.setattr(device, "available_memory_bytes", lambda: allocated - 1)
        with pytest.raises(InputError, match=rf"^--max-batch {max_batch} x --max-model-len {max_len}: "):
            _check_caches_fit(cfg, max_batch, max_len, "cpu")
        opts = BuildOptions(max_batch=max_batch, max_model_len=max_len, prefill_chunk=4)
        plan = _kv_layout(cfg, opts)  # the compiled runner: new_kv_cache(max_batch, cache_rows)
        kv = model.new_kv_cache(max_batch, opts.cache_rows)
        assert plan["bytes"] == sum(t.nbytes for t in kv) == kv_cache_bytes(cfg, max_batch, opts.cache_rows)
        assert [s for layer in plan["layers"] for s in (layer["shape_k"], layer["shape_v"])] == \
            [list(t.shape) for t in kv]
        assert [layer["bytes"] for layer in plan["layers"]] == \
            [kv[2 * i].nbytes + kv[2 * i + 1].nbytes for i in range(cfg.num_hidden_layers)]
