"""The embedded default model at every entry point that loads it: `flintc compile`,
`flintc serve` and `flintc.compile` without MODEL (`load_checkpoint_or_default`), and
a build of the default run by `flintc run --build`, `flintc serve --build` and
`flintc.load` (`load_build`). A cached default that was damaged since (truncated) is
written again once, with a one-line notice, and the command succeeds; so is one that
is gone (the cache cleared) under a build that records it. `flintc run` without MODEL
is tested in test_run.py (test_damaged_default_model_is_written_again)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from harness import run_cli

DEFAULT = "default-tiny-nvfp4-s0"
DAMAGED = re.compile(r"flintc: the cached default model is damaged \(.*model-nvfp4\.gguf: changed since it was "
                     r"written \(its sha256 differs from the one recorded\)\); writing it again")
RUN = ("--prompt-ids", "1,2,3", "--max-tokens", 3, "--temperature", 0, "--ignore-eos", "--output", "json")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """FLINTC_CACHE_DIR for this module, and a build of the default model compiled into it
    by `flintc compile` without MODEL; with the tokens `flintc run --build` gives while the
    default is intact: (cache folder, build, output line)."""
    root = tmp_path_factory.mktemp("default")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLINTC_CACHE_DIR", str(root / "cache"))
        from flintc.cli import main

        build = root / "build"
        assert main(["compile", "--out", str(build), "--max-batch", "1", "--max-model-len", "16", "--backend",
                     "torch", "--no-check", "--no-dump"]) == 0
        yield root / "cache", build


def _gguf(cache_dir):
    return cache_dir / DEFAULT / "model-nvfp4.gguf"


def _damage(cache_dir) -> int:
    """Truncate the cached default's GGUF file to half its size; -> its size before."""
    gguf = _gguf(cache_dir)
    size = gguf.stat().st_size
    with open(gguf, "r+b") as f:
        f.truncate(size // 2)
    return size


def _assert_written_again(cache_dir, err: str, size: int, notice=DAMAGED) -> list[str]:
    """stderr's first line is the notice, and no other line is one; the default is whole
    again, nothing else is left in the cache. -> stderr's other lines."""
    lines = err.splitlines()
    assert lines and notice.fullmatch(lines[0]), err
    assert not any("cached default" in line or "error" in line for line in lines[1:]), err
    assert "Traceback" not in err
    assert _gguf(cache_dir).stat().st_size == size
    assert sorted(p.name for p in cache_dir.iterdir()) == [DEFAULT]
    return lines[1:]


def _json_line(out: str) -> dict:
    lines = out.splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_run_build_writes_a_damaged_default_again(cache, capsys):
    """`flintc run --build BUILD` of a build of the default failed when the cached default
    had been damaged since the compile ("truncated or corrupt GGUF file ... pass the
    checkpoint as MODEL ... or recompile"): it is written again and gives the same tokens."""
    cache_dir, build = cache
    code, first, err = run_cli(capsys, "run", "--build", build, *RUN)
    assert code == 0 and "cached default" not in err, err
    size = _damage(cache_dir)
    code, again, err = run_cli(capsys, "run", "--build", build, *RUN)
    assert code == 0, err
    rest = _assert_written_again(cache_dir, err, size)
    assert len(rest) == 1 and rest[0].startswith("prompt tokens: 3, generated tokens: 3, "), err
    assert _json_line(again) == _json_line(first)


def test_run_build_writes_a_deleted_default_again(cache, capsys):
    """The cache cleared since the compile: the build's default is written again before
    the tokenizer is looked for beside it (--prompt text), not refused as moved."""
    cache_dir, build = cache
    size = _gguf(cache_dir).stat().st_size
    shutil.rmtree(cache_dir / DEFAULT)
    code, out, err = run_cli(capsys, "run", "--build", build, "--prompt", "hi", "--max-tokens", 2, "--output", "json")
    assert code == 0, err
    gone = re.compile(rf"flintc: the cached default model {re.escape(str(cache_dir / DEFAULT))}, which "
                      rf"{re.escape(str(build / 'build.json'))} records, is gone; writing it again")
    _assert_written_again(cache_dir, err, size, gone)
    assert len(_json_line(out)["output_ids"]) == 2


@pytest.mark.parametrize("build", [False, True], ids=["model", "build"])
def test_serve_writes_a_damaged_default_again(cache, capsys, monkeypatch, build):
    """`flintc serve` without MODEL, and `flintc serve --build` of the default's build:
    the damaged default is written again and the server starts (uvicorn stubbed out)."""
    import flintc.serve.server

    cache_dir, build_dir = cache
    started = []

    def serve(app, sock, log_level="info"):
        started.append(sock.getsockname()[1])
        sock.close()

    monkeypatch.setattr(flintc.serve.server, "serve", serve)
    size = _damage(cache_dir)
    code, out, err = run_cli(capsys, "serve", "--port", 0, "--max-model-len", 16,
                             *(["--build", build_dir] if build else []))
    assert code == 0 and out == "" and len(started) == 1, err
    rest = _assert_written_again(cache_dir, err, size)
    name = build_dir if build else "flint-tiny-default"
    assert rest == [f"flintc serve: '{name}' on http://127.0.0.1:{started[0]}/v1 (max batch {1 if build else 8}, "
                    "max model len 16)"], err


def test_compile_writes_a_damaged_default_again(cache, capsys, tmp_path):
    """`flintc compile` without MODEL."""
    cache_dir, _ = cache
    size = _damage(cache_dir)
    code, out, err = run_cli(capsys, "compile", "--out", tmp_path / "b", "--max-batch", 1, "--max-model-len", 16,
                             "--backend", "torch", "--no-check", "--no-dump")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'b'}: decode_b1 "), (out, err)
    _assert_written_again(cache_dir, err, size)


def test_python_api_writes_a_damaged_default_again(cache, capsys, tmp_path):
    """`flintc.compile()` without a model, and `flintc.load(BUILD)` of the default's build."""
    import flintc

    cache_dir, build = cache
    size = _damage(cache_dir)
    model = flintc.load(build)
    _assert_written_again(cache_dir, capsys.readouterr().err, size)
    assert len(model.generate([1, 2, 3], max_tokens=2, ignore_eos=True).output_ids[0]) == 2
    _damage(cache_dir)
    model = flintc.compile(out=tmp_path / "b", max_batch=1, max_model_len=16, backend="torch", check=False,
                           dump=False)
    _assert_written_again(cache_dir, capsys.readouterr().err, size)
    assert len(model.generate([1, 2, 3], max_tokens=2, ignore_eos=True).output_ids[0]) == 2


def test_is_cached_default(cache, tmp_path):
    """Only the default in the cache folder FLINTC_CACHE_DIR names now is written again."""
    from flintc.checkpoint.default import is_cached_default

    cache_dir, _ = cache
    assert is_cached_default(_gguf(cache_dir))
    assert not is_cached_default(tmp_path / DEFAULT / "model-nvfp4.gguf")
    assert not is_cached_default(cache_dir / DEFAULT / "other.gguf")


def _flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_config(path):
    config = json.loads(path.read_text())
    config["rms_norm_eps"] = 0.5
    path.write_text(json.dumps(config))


# (file, how it is damaged, what the notice names)
DAMAGES = {
    "config-garbage": ("config.json", lambda p: p.write_text("garbage {"), "config.json: changed since"),
    "config-edited": ("config.json", _edit_config, "config.json: changed since"),
    "tokenizer-deleted": ("tokenizer.json", lambda p: p.unlink(), "tokenizer.json: missing"),
    "tokenizer-invalid": ("tokenizer.json", lambda p: p.write_text("{}"), "tokenizer.json: changed since"),
    "gguf-byte-flip": ("model-nvfp4.gguf", _flip_byte, "model-nvfp4.gguf: changed since"),
    "manifest-deleted": ("flintc-files.json", lambda p: p.unlink(), "flintc-files.json: missing"),
}


def _snapshot(cache_dir) -> dict:
    folder = cache_dir / DEFAULT
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def _assert_rewritten(cache_dir, err, before, names) -> list[str]:
    lines = err.splitlines()
    assert lines and lines[0].startswith("flintc: the cached default model is damaged (") and names in lines[0], err
    assert lines[0].endswith("; writing it again"), err
    assert not any("cached default" in line or "error" in line for line in lines[1:]), err
    assert "Traceback" not in err
    assert _snapshot(cache_dir) == before
    assert sorted(p.name for p in cache_dir.iterdir()) == [DEFAULT]
    return lines[1:]


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_run_build_writes_a_default_damaged_anywhere_again(cache, capsys, damage):
    """Any file of the cached default damaged (config.json garbage or edited, tokenizer.json
    deleted or invalid, a byte flipped inside the GGUF the build fingerprint does not see,
    the manifest gone): `flintc run --build` (with --prompt text, so the tokenizer is
    needed) wrote nothing again ("config.json: not a readable JSON file", "pass
    --tokenizer DIR", "recompile"); it is written again once, with the notice."""
    cache_dir, build = cache
    code, first, err = run_cli(capsys, "run", "--build", build, *RUN)
    assert code == 0 and "cached default" not in err, err
    before = _snapshot(cache_dir)
    name, how, names = DAMAGES[damage]
    how(cache_dir / DEFAULT / name)
    code, again, err = run_cli(capsys, "run", "--build", build, *RUN)
    assert code == 0, err
    _assert_rewritten(cache_dir, err, before, names)
    assert _json_line(again) == _json_line(first)
    how(cache_dir / DEFAULT / name)
    code, out, err = run_cli(capsys, "run", "--build", build, "--prompt", "Hi", "--max-tokens", 2, "--output", "json")
    assert code == 0, err
    _assert_rewritten(cache_dir, err, before, names)


@pytest.mark.parametrize("damage", ["config-garbage", "config-edited", "tokenizer-deleted", "tokenizer-invalid"])
def test_run_and_load_write_a_default_damaged_anywhere_again(cache, capsys, damage):
    """`flintc run` without MODEL (--prompt text and --prompt-ids) and `flintc.load(BUILD)`."""
    import flintc

    cache_dir, build = cache
    run_cli(capsys, "run", "--prompt-ids", "1", "--max-tokens", 1)
    before = _snapshot(cache_dir)
    name, how, names = DAMAGES[damage]
    for args in (("--prompt", "Hi"), ("--prompt-ids", "1")):
        how(cache_dir / DEFAULT / name)
        code, out, err = run_cli(capsys, "run", *args, "--max-tokens", 2, "--output", "json")
        assert code == 0, err
        _assert_rewritten(cache_dir, err, before, names)
    how(cache_dir / DEFAULT / name)
    model = flintc.load(build)
    _assert_rewritten(cache_dir, capsys.readouterr().err, before, names)
    assert len(model.generate([1, 2, 3], max_tokens=2, ignore_eos=True).output_ids[0]) == 2


def test_a_good_default_written_meanwhile_is_kept(cache, capsys, monkeypatch):
    """Processes racing: one that found the default damaged, wrote a new copy and finds a
    good one in place (another process's, written meanwhile) keeps that one and discards
    its own; a copy still damaged just then is replaced."""
    from flintc.checkpoint import default

    cache_dir, _ = cache
    folder = cache_dir / DEFAULT
    assert default.check_default_folder(folder) is None
    inode = folder.stat().st_ino
    default._write_default(folder)
    assert folder.stat().st_ino == inode and default.check_default_folder(folder) is None
    (folder / "config.json").write_text("garbage")
    default._write_default(folder)
    assert folder.stat().st_ino != inode and default.check_default_folder(folder) is None
    assert sorted(p.name for p in cache_dir.iterdir()) == [DEFAULT]


def test_discarding_a_damaged_default_is_not_cut_by_ctrl_c(tmp_path, monkeypatch):
    """Ctrl-C while a damaged cached default is removed left a `.flintc-default-bad-*`
    folder in the cache: it is raised only once the folder is gone."""
    import os
    import shutil
    import signal

    import flintc.checkpoint.default as default

    folder = tmp_path / default.DEFAULT_NAME
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "f").write_text("x")
    real = shutil.rmtree

    def interrupted(path, *a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        real(path, *a, **k)

    monkeypatch.setattr(default.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        default._discard(folder)
    assert list(tmp_path.iterdir()) == []
