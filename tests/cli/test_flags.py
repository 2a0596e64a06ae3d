"""Every flag is honoured or refused with one line naming it (exit 2), never silently
ignored; bad values are refused before any work; interrupted commands leave nothing
behind. All on the tiny checkpoints, none compiles a build (see
tests/runtime/test_compiled.py for the --build cases)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from flintc.cli import main
from flintc.cli.serve import SERVING_STACK
from harness import assert_one_line_error, run_cli

REPO = Path(__file__).resolve().parents[2]


# ---- flintc run: the reference backend -------------------------------------------------


def test_reference_backend_honours_max_model_len(capsys, tiny_bf16_dir):
    args = ["run", tiny_bf16_dir, "--prompt-ids", "1,2,3", "--max-tokens", 8, "--temperature", 0,
            "--ignore-eos", "--output", "json"]
    code, full, err = run_cli(capsys, *args)
    assert code == 0, err
    code, short, err = run_cli(capsys, *args, "--max-model-len", 5)
    assert code == 0, err
    full, short = json.loads(full), json.loads(short)
    # max_model_len counts the prompt and the generated tokens (vLLM's meaning): 3 + 2
    assert short["finish_reason"] == "length"  # as for max_tokens (vLLM's convention)
    assert short["output_ids"] == full["output_ids"][:2]
    for ids in ("1,2,3,4,5,6", "1,2,3,4"):  # the prompt must leave room for one token
        code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", ids, "--max-model-len", 4)
        assert_one_line_error(code, err, f"{len(ids.split(','))} tokens", "maximum of 3",
                              "counts the prompt")


def test_reference_backend_runs_more_prompts_than_max_batch_in_batches(capsys, monkeypatch, tiny_bf16_dir):
    """--max-batch 2 with five prompts was "5 prompts, but --max-batch is 2"; they now run
    in consecutive batches of two (vLLM's LLM.generate takes any number), no decode
    step holding more than two sequences, each prompt's tokens those of one batch of
    all five, in command-line order (--prompt-ids and --prompt mixed)."""
    from flintc.runtime.runner import ReferenceRunner

    base = ["run", tiny_bf16_dir, "--max-tokens", 3, "--temperature", 0, "--ignore-eos", "--output", "json",
            "--prompt-ids", "1,2", "--prompt", "Hello", "--prompt-ids", "4,5,6", "--prompt-ids", "7",
            "--prompt", "Bonjour"]
    code, out, err = run_cli(capsys, *base)
    assert code == 0, err
    want = [json.loads(line) for line in out.splitlines()]
    sizes = []
    real = ReferenceRunner.decode

    def decode(self, slots, *a, **k):
        sizes.append(len(slots))
        return real(self, slots, *a, **k)

    monkeypatch.setattr(ReferenceRunner, "decode", decode)
    code, out, err = run_cli(capsys, *base, "--max-batch", 2)
    assert code == 0, err
    got = [json.loads(line) for line in out.splitlines()]
    assert got == want and [g["index"] for g in got] == list(range(5))
    assert got[0]["prompt_ids"] == [1, 2] and got[3]["prompt_ids"] == [7]
    assert sizes and max(sizes) == 2


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_run_refuses_max_model_len_beyond_the_model(capsys, monkeypatch, tiny_bf16_dir, backend):
    """--max-model-len above max_position_embeddings (4096 for tiny) was cut to it silently on
    the reference backend; refused as `flintc compile` and `flintc serve` refuse it, by
    every backend (--build: `test_run_build_limits_use_the_shared_function`), before
    anything compiles."""
    import flintc.runtime.build

    def never(*a, **k):
        raise AssertionError("compiled before --max-model-len was checked")

    monkeypatch.setattr(flintc.runtime.build, "compile_model", never)
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--backend", backend, "--prompt-ids", "1,2",
                             "--max-tokens", 2, "--max-model-len", 4097)
    assert_one_line_error(code, err, "--max-model-len 4097", "max_position_embeddings (4096)")
    assert out == ""


@pytest.mark.parametrize("args, needles", [
    (["--max-model-len", "0"], ["--max-model-len", "got 0"]),
    (["--max-model-len", "-3"], ["--max-model-len", "got -3"]),
    (["--max-batch", "0"], ["--max-batch", "got 0"]),
    (["--prefill-chunk", "0"], ["--prefill-chunk", "got 0"]),
    (["--config", "tiny"], ["--config tiny", "--load-format dummy"]),
    (["--format", "nvfp4"], ["--format nvfp4", "--load-format dummy"]),
    (["--no-check"], ["--no-check", "compiled backend"]),
    (["--no-dump"], ["--no-dump", "compiled backend"]),
    (["--buckets", "1"], ["--buckets", "compiled backend"]),
    (["--split-lm-head-norm"], ["--split-lm-head-norm", "compiled backend"]),
    (["--backend", "torch", "--mode", "float64"], ["--mode float64", "reference backend"]),
    (["--hf-config-path", "/nonexistent/cfg"], ["--hf-config-path /nonexistent/cfg", "no such file"]),
    (["--tokenizer", "/nonexistent/tok"], ["--tokenizer /nonexistent/tok", "no such file"]),
    (["--top-p", "2"], ["--top-p", "top_p"]),
])
def test_run_refuses_flags_it_would_ignore(capsys, tiny_bf16_dir, args, needles):
    base = ["run", tiny_bf16_dir, "--max-tokens", 2, "--prompt-ids", "1,2"]
    code, out, err = run_cli(capsys, *base, *args)
    assert_one_line_error(code, err, *needles)
    assert out == ""


def test_dummy_flags_are_honoured_with_load_format_dummy(capsys):
    code, out, err = run_cli(capsys, "run", "--load-format", "dummy", "--config", "tiny", "--format", "nvfp4",
                             "--prompt-ids", "1,2", "--max-tokens", 2, "--output", "json", "--ignore-eos")
    assert code == 0, err
    assert len(json.loads(out)["output_ids"]) == 2
    code, _, err = run_cli(capsys, "run", "--load-format", "dummy", "--prompt-ids", "1")
    assert_one_line_error(code, err, "--load-format dummy", "--config")


# ---- flintc run: where a temporary BUILD's dumps go -------------------------------------


def _record_dump_dirs(monkeypatch):
    """Replace the pass pipeline by a stand-in that records the dump folder it gets and
    stops the command (no compile). -> the list it appends to."""
    import flintc.passes.pipeline as pipeline
    from flintc.errors import InputError

    seen = []

    def recorder(model, step, dump_dir=None, **kw):
        seen.append(dump_dir)
        raise InputError("stop after the first compile_step")

    monkeypatch.setattr(pipeline, "compile_step", recorder)
    return seen


@pytest.mark.parametrize("env, flags, dumps", [
    (True, [], True),              # FLINTC_DUMP_DIR: the dumps outlive the temporary BUILD
    (True, ["--no-dump"], False),  # --no-dump: none, whatever the environment says
    (False, [], False),            # no FLINTC_DUMP_DIR: none (they would go with the BUILD)
])
def test_run_temporary_build_dumps_follow_flintc_dump_dir(capsys, tmp_path, monkeypatch, tiny_bf16_dir,
                                                          env, flags, dumps):
    """`flintc run --backend torch`: the dump folder each function's compile_step gets."""
    seen = _record_dump_dirs(monkeypatch)
    if env:
        monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path / "dd"))
    else:
        monkeypatch.delenv("FLINTC_DUMP_DIR", raising=False)
    code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--backend", "torch", "--max-batch", 1, "--no-check",
                           "--prompt-ids", "1,2", "--max-tokens", 1, *flags)
    assert_one_line_error(code, err, "stop after the first compile_step")
    assert seen == [tmp_path / "dd" / "decode_b1" if dumps else False]


def test_compile_no_dump_ignores_flintc_dump_dir(capsys, tmp_path, monkeypatch, tiny_bf16_dir):
    seen = _record_dump_dirs(monkeypatch)
    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path / "dd"))
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", tmp_path / "b", "--max-batch", 1,
                           "--no-check", "--no-dump")
    assert_one_line_error(code, err, "stop after the first compile_step")
    assert seen == [False]


def test_compile_step_dump_dir_false_ignores_flintc_dump_dir(monkeypatch, tmp_path):
    from harness import tiny_model

    from flintc.passes.pipeline import compile_step

    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path / "dd"))
    compile_step(tiny_model(), "prefill", batch=1, tokens=8, cache_len=16, disabled=["fuse_moe"], dump_dir=False)
    assert not (tmp_path / "dd").exists()


@pytest.mark.parametrize("command", [
    ["run", "{ckpt}", "--backend", "torch", "--max-batch", "1", "--no-check", "--prompt-ids", "1,2",
     "--max-tokens", "1"],
    ["verify", "--step", "decode"],
])
@pytest.mark.parametrize("value, blocker", [("file", "file"), ("file/sub", "file")])
def test_unwritable_flintc_dump_dir_names_the_variable(capsys, tmp_path, monkeypatch, tiny_bf16_dir, command,
                                                       value, blocker):
    """$FLINTC_DUMP_DIR that is a file (or under one) said "<dir>/decode_b1: Not a
    directory", naming no variable, after a temporary BUILD's capture (`run`) or the
    first step's passes (`verify`). Now one line naming the variable, before any work."""
    import flintc.passes.pipeline as pipeline

    def never(*a, **k):
        raise AssertionError("compile_step ran before $FLINTC_DUMP_DIR was checked")

    monkeypatch.setattr(pipeline, "compile_step", never)
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path / value))
    code, out, err = run_cli(capsys, *[a.format(ckpt=tiny_bf16_dir) for a in command])
    assert_one_line_error(code, err, f"FLINTC_DUMP_DIR={tmp_path / value}: cannot write the dumps there "
                          f"({tmp_path / blocker} is a file, not a folder); set FLINTC_DUMP_DIR to a writable "
                          "folder, or unset it for no dumps")
    assert out == ""


@pytest.mark.parametrize("command", [
    ["run", "{ckpt}", "--backend", "torch", "--max-batch", "1", "--no-check", "--prompt-ids", "1,2",
     "--max-tokens", "1"],
    ["verify", "--step", "decode"],
])
@pytest.mark.parametrize("value", ["build", "build/dumps", "build/dumps/new/sub", "ckpt"])
def test_flintc_dump_dir_inside_a_build_or_checkpoint_is_refused(capsys, tmp_path, monkeypatch, tiny_bf16_dir,
                                                                command, value):
    """Regression: $FLINTC_DUMP_DIR pointing at a BUILD of `flintc compile` (or into it)
    was taken: a temporary BUILD's or verify's dumps went into the build folder, mixed
    with its files or replacing its own BUILD/dumps/<function>/ with another compile's,
    and the next `flintc compile` into it deleted them. So it was for a checkpoint folder
    (FLINTC_DUMP_DIR=ckpt wrote ckpt/decode_b1/), which `flintc dump --out` refuses. Now
    one line naming the variable and the BUILD or checkpoint, before any work, the same
    check as `flintc dump --out`'s (`flintc.fileio.checkpoint_or_build_problem`). A BUILD
    is refused at any depth (`flintc compile` replaces it whole), a checkpoint folder only
    itself (a new subfolder of one is taken: test_dumps_in_a_new_subfolder_of_a_checkpoint_are_taken)."""
    import flintc.passes.pipeline as pipeline

    def never(*a, **k):
        raise AssertionError("compile_step ran before $FLINTC_DUMP_DIR was checked")

    monkeypatch.setattr(pipeline, "compile_step", never)
    (tmp_path / "build" / "dumps").mkdir(parents=True)
    (tmp_path / "build" / "build.json").write_text("{}")
    (tmp_path / "ckpt").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "ckpt" / name).write_text("{}")
    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path / value))
    code, out, err = run_cli(capsys, *[a.format(ckpt=tiny_bf16_dir) for a in command])
    top = value.split("/")[0]
    what = ("the flintc BUILD {} (it holds build.json)" if top == "build" else
            "the checkpoint folder {} (it holds config.json, model.safetensors)").format((tmp_path / top).resolve())
    assert_one_line_error(code, err, f"FLINTC_DUMP_DIR={tmp_path / value}: {'is' if value == top else 'inside'} "
                          f"{what}", "set FLINTC_DUMP_DIR to a folder outside any BUILD and other than a checkpoint "
                          "folder (a new subfolder of one is fine), or unset it for no dumps")
    assert out == "" and sorted(p.name for p in (tmp_path / "build").iterdir()) == ["build.json", "dumps"]
    assert not any((tmp_path / "build" / "dumps").iterdir())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("out, message", [
    ("build/dumps/decode_b1", "inside the flintc BUILD {tmp}/build (it holds build.json)"),
    ("build", "is the flintc BUILD {tmp}/build (it holds build.json)"),
    ("ckpt", "is the checkpoint folder {tmp}/ckpt (it holds config.json, model-nvfp4.gguf, tokenizer.json)"),
    ("ckpt/build/dumps", "inside the flintc BUILD {tmp}/ckpt/build (it holds build.json)"),
])
def test_dump_out_inside_a_build_or_checkpoint_is_refused(capsys, tmp_path, out, message):
    """Regression: `flintc dump --out BUILD/dumps/decode_b1` (an earlier dump, in a BUILD)
    exited 0 and replaced the build's own dumps with unrelated ones; `--out BUILD` was
    refused, only for build.json at its top. Now any --out inside a BUILD, at any depth,
    or that is a checkpoint folder, is refused as $FLINTC_DUMP_DIR is, before any work,
    writing nothing (a new subfolder of a checkpoint is taken:
    test_dumps_in_a_new_subfolder_of_a_checkpoint_are_taken)."""
    dumps = tmp_path / "build" / "dumps" / "decode_b1"
    dumps.mkdir(parents=True)
    (tmp_path / "build" / "build.json").write_text("{}")
    for name in ("index.md", "report.json"):
        (dumps / name).write_text("{}")  # an earlier dump: `flintc dump` replaces one
    (tmp_path / "ckpt").mkdir()
    for name in ("config.json", "model-nvfp4.gguf", "tokenizer.json"):
        (tmp_path / "ckpt" / name).write_text("{}")
    (tmp_path / "ckpt" / "build").mkdir()
    (tmp_path / "ckpt" / "build" / "build.json").write_text("{}")  # a BUILD inside a checkpoint
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    code, stdout, err = run_cli(capsys, "dump", "--out", tmp_path / out, "--batch", 1)
    assert_one_line_error(code, err, f"--out {tmp_path / out}: {message.format(tmp=tmp_path.resolve())}",
                          "refusing to write dumps there, choose an --out outside any BUILD and other than a "
                          "checkpoint folder (a new subfolder of one is fine)")
    assert stdout == ""
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_a_lone_config_json_above_is_no_checkpoint(tmp_path):
    """A folder holding only config.json (or only a .gguf), as a home or project folder
    may, is no checkpoint: dumps below it, or in it, are taken. A checkpoint folder is
    refused only itself (dumps in a new subfolder of one mix with none of its files), a
    BUILD at any depth above (`flintc compile` replaces it whole)."""
    from flintc.fileio import checkpoint_or_build_problem

    for folder, name in (("proj", "config.json"), ("downloads", "stray.gguf"), ("tok", "tokenizer.json")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text("{}")
        assert checkpoint_or_build_problem(tmp_path / folder / "dumps") is None
    (tmp_path / "ckpt" / "build").mkdir(parents=True)
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    assert checkpoint_or_build_problem(tmp_path / "proj") is None
    assert checkpoint_or_build_problem(tmp_path / "ckpt").startswith(
        f"is the checkpoint folder {(tmp_path / 'ckpt').resolve()} (it holds config.json, tokenizer.json)")
    for below in ("a/b", "build", "build/dumps"):
        assert checkpoint_or_build_problem(tmp_path / "ckpt" / below) is None, below
    (tmp_path / "ckpt" / "build" / "build.json").write_text("{}")
    assert checkpoint_or_build_problem(tmp_path / "ckpt" / "build" / "dumps").startswith(
        f"inside the flintc BUILD {(tmp_path / 'ckpt' / 'build').resolve()} (it holds build.json)")
    assert checkpoint_or_build_problem(tmp_path / "ckpt" / "build").startswith(
        f"is the flintc BUILD {(tmp_path / 'ckpt' / 'build').resolve()} (it holds build.json)")


class _Reached(Exception):
    """Raised by a stand-in compile_step: the command got past its output checks."""


@pytest.mark.parametrize("how", ["dump --out", "FLINTC_DUMP_DIR"])
def test_dumps_in_a_new_subfolder_of_a_checkpoint_are_taken(capsys, monkeypatch, tmp_path, how):
    """Regression: `cd ws && flintc dump --out dumps`, ws holding config.json and a
    .gguf (the layout flintc expects of a model folder, and a common project root), was
    refused "inside the checkpoint folder ws", and so was FLINTC_DUMP_DIR=ws/sub for
    `flintc verify`: every folder up to / was checked for a checkpoint. A new subfolder
    cannot mix with a checkpoint's files: only the checkpoint folder itself is refused
    (only a BUILD, which `flintc compile` replaces whole, at any depth)."""
    import flintc.passes.pipeline as pipeline

    ws = tmp_path / "ws"
    ws.mkdir()
    for name in ("config.json", "model.gguf"):
        (ws / name).write_text("")  # names only: the check reads no file
    seen = []

    def reached(*a, dump_dir=None, **k):
        seen.append(Path(dump_dir))
        raise _Reached

    monkeypatch.setattr(pipeline, "compile_step", reached)
    monkeypatch.chdir(ws)
    if how == "dump --out":
        with pytest.raises(_Reached):
            run_cli(capsys, "dump", "--out", "dumps", "--batch", 1)
        assert seen and seen[0].resolve().parent == ws.resolve()  # its temporary folder beside ws/dumps
    else:
        monkeypatch.setenv("FLINTC_DUMP_DIR", str(ws / "sub"))
        with pytest.raises(_Reached):
            run_cli(capsys, "verify", "--step", "decode")
        assert seen and seen[0].parent == ws / "sub"
    assert "error" not in capsys.readouterr().err


def test_compile_step_checks_flintc_dump_dir(monkeypatch, tmp_path):
    """The Python API refuses it too (before the capture), unless dump_dir=False."""
    from harness import tiny_model

    from flintc.errors import InputError
    from flintc.passes.pipeline import compile_step

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path / "file"))
    with pytest.raises(InputError, match="^FLINTC_DUMP_DIR="):
        compile_step(tiny_model(), "prefill", batch=1, tokens=8, cache_len=16, disabled=["fuse_moe"])


# ---- --build limits: one function for run and serve ------------------------------------


def test_limit_build_limits_or_refuses():
    """flintc.runtime.compiled.limit_build: up to the build's value limits the runner,
    above it (or below 1) is refused naming the flag, the build and its value."""
    from flintc.errors import InputError
    from flintc.runtime.compiled import limit_build

    runner = SimpleNamespace(max_batch=4, max_model_len=64)
    limit_build(runner, "b")
    assert (runner.max_batch, runner.max_model_len) == (4, 64)
    limit_build(runner, "b", max_model_len=32, max_batch=2)
    assert (runner.max_batch, runner.max_model_len) == (2, 32)
    runner = SimpleNamespace(max_batch=4, max_model_len=64)
    for kw, needles in (({"max_model_len": 65}, ["--max-model-len 65: b was compiled for 64 positions",
                                                 "recompile with --max-model-len 65"]),
                        ({"max_batch": 8}, ["--max-batch 8: b was compiled for at most 4 sequences",
                                            "recompile with --max-batch 8"]),
                        # beyond what any build takes: no hint to recompile (compile refuses it)
                        ({"max_batch": 16}, ["--max-batch 16: b was compiled for at most 4 sequences, and no "
                                             "build takes more than 8 (the decode schedule's GEMVs); use "
                                             "--max-batch 4 or less, or drop the flag"]),
                        ({"max_batch": 0}, ["--max-batch must be at least 1, got 0"])):
        with pytest.raises(InputError) as exc:
            limit_build(runner, "b", **kw)
        assert all(n in str(exc.value) for n in needles), str(exc.value)
        assert "recompile" not in str(exc.value) or kw.get("max_batch", 0) <= 8, str(exc.value)
    assert (runner.max_batch, runner.max_model_len) == (4, 64)
    from flintc.runtime.compiled import check_build_limits

    manifest = {"max_model_len": 64, "max_batch": 4, "config": {"max_position_embeddings": 4096}}
    with pytest.raises(InputError, match=r"^--max-model-len 5000: b was compiled for 64 positions, and no build "
                                         r"takes more than 4096, the positions the model serves "
                                         r"\(max_position_embeddings\); use --max-model-len 64 or less, or drop "
                                         r"the flag$"):
        check_build_limits("b", manifest, max_model_len=5000)


@pytest.mark.parametrize("flags, needles", [
    (["--max-batch", "8"], ["--max-batch 8", "compiled for at most 4 sequences"]),
    (["--max-model-len", "65"], ["--max-model-len 65", "compiled for 64 positions"]),
])
def test_run_build_limits_use_the_shared_function(capsys, monkeypatch, tiny_bf16_dir, flags, needles):
    """`flintc run --build` checks its limits against build.json with
    compiled.check_build_limits before the weights load (a stand-in build: no compile,
    no weights loaded; the checkpoint it records is the tiny one)."""
    from flintc.runtime import compiled

    loads = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(compiled, "read_manifest", lambda build: {"device": "cpu", "weight_format": "bf16",
                                                                  "weight_source": str(tiny_bf16_dir),
                                                                  "max_batch": 4, "max_model_len": 64})
    monkeypatch.setattr(compiled, "load_build",
                        lambda *a, **kw: loads.append(a) or SimpleNamespace(max_batch=4, max_model_len=64))
    code, out, err = run_cli(capsys, "run", "--build", "fake-build", "--prompt-ids", "1,2", *flags)
    assert_one_line_error(code, err, *needles, "fake-build")
    assert out == "" and loads == []


# ---- flintc compile: bad values are refused before any work ----------------------------


@pytest.mark.parametrize("args, needles", [
    (["--max-model-len", "0"], ["--max-model-len", "got 0"]),
    (["--max-model-len", "-1"], ["--max-model-len", "got -1"]),
    (["--prefill-chunk", "0"], ["--prefill-chunk", "got 0"]),
    (["--max-batch", "9"], ["--max-batch", "got 9"]),
    (["--format", "nvfp4"], ["--format nvfp4", "--load-format dummy"]),
])
def test_compile_refuses_bad_values_at_once(capsys, tmp_path, tiny_bf16_dir, args, needles):
    # this process's CPU time, not wall time: see tests/cli/test_user_errors.py
    t0 = time.process_time()
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", tmp_path / "b", *args)
    assert_one_line_error(code, err, *needles)
    assert time.process_time() - t0 < 5 and list(tmp_path.iterdir()) == []


def test_compile_checks_the_output_parent_first(capsys, tmp_path, tiny_bf16_dir):
    t0 = time.process_time()
    out = tmp_path / "missing" / "parent" / "b"
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", out)
    assert_one_line_error(code, err, f"--out {out}", "does not exist")
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", tmp_path / "file" / "b")
    assert_one_line_error(code, err, "is not a folder")
    assert time.process_time() - t0 < 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


_FAST_COMPILE = ("--backend", "torch", "--no-check", "--no-dump", "--max-batch", 1, "--max-model-len", 32)


def test_compile_into_a_link_replaces_its_target(capsys, tmp_path, tiny_bf16_dir):
    """`--out LINK`, LINK a symbolic link to a build: the build it points to is replaced
    and the link kept (it used to be replaced by a real folder, leaving a hidden
    `.LINK.old-PID -> target` link behind and the old build untouched)."""
    real = tmp_path / "builds" / "v1"
    real.parent.mkdir()
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", real, *_FAST_COMPILE)
    assert code == 0, err
    (real / "report.md").write_text("old build")
    link = tmp_path / "current"
    link.symlink_to(real)
    code, out, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", link, *_FAST_COMPILE)
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert (real / "build.json").is_file() and (real / "report.md").read_text() != "old build"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["builds", "current"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["v1"]


def test_compile_split_lm_head_norm_reaches_the_build(capsys, tmp_path, tiny_bf16_dir):
    """`flintc compile` splits the LM head's norm by default (`--split-lm-head-norm`, which
    says so again) and `--no-split-lm-head-norm` fuses it: build.json records the option,
    and the split decode function runs the final norm, then the plain LM head: one kernel
    more than the fused build's."""
    manifests = {}
    for name, flags in (("default", []), ("split", ["--split-lm-head-norm"]),
                        ("fused", ["--no-split-lm-head-norm"])):
        out = tmp_path / name
        code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", out, *_FAST_COMPILE, *flags)
        assert code == 0, err
        manifests[name] = json.loads((out / "build.json").read_text())
    assert [manifests[k]["split_lm_head_norm"] for k in ("default", "split", "fused")] == [True, True, False]
    kernels = {k: m["functions"]["decode_b1"]["kernels"] for k, m in manifests.items()}
    assert kernels["default"] == kernels["split"] == kernels["fused"] + 1
    fused = (tmp_path / "fused" / "runtime.py").read_text()
    assert "K.norm_lm_head(" in fused[fused.index("def decode_b1"):]
    src = (tmp_path / "default" / "runtime.py").read_text()
    decode = src[src.index("def decode_b1"):]
    decode = decode[:decode.index("\ndef ", 1)] if "\ndef " in decode[1:] else decode
    assert "K.norm_lm_head(" not in decode and decode.index("K.rms_norm(") < decode.index("K.lm_head(")


def test_compile_into_an_empty_folder(capsys, tmp_path, tiny_bf16_dir):
    """An existing empty --out folder is taken as a fresh one (as make-checkpoint does);
    a folder holding other files is still refused."""
    out = tmp_path / "b"
    out.mkdir()
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", out, *_FAST_COMPILE)
    assert code == 0, err
    assert (out / "build.json").is_file()
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", other, *_FAST_COMPILE)
    assert_one_line_error(code, err, "exists and is not a flintc build")
    assert [p.name for p in other.iterdir()] == ["keep.txt"]


def _compile_never_reads(monkeypatch):
    """Make `flintc compile` fail loudly if it gets as far as reading the checkpoint."""
    import flintc.cli.compile_build

    def never(*a, **k):
        raise AssertionError("read the checkpoint before refusing --out")

    monkeypatch.setattr(flintc.cli.compile_build, "load_model_checkpoint", never)


def _listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def build_with_its_checkpoint(capsys, tmp_path, tiny_bf16_dir):
    """A build `b` holding a copy of its checkpoint (b/myckpt) and the user's b/NOTES.txt."""
    out = tmp_path / "b"
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", out, *_FAST_COMPILE)
    assert code == 0, err
    shutil.copytree(tiny_bf16_dir, out / "myckpt")
    (out / "NOTES.txt").write_text("notes")
    return out


@pytest.mark.parametrize("case", ["model", "model via a link", "out via a link", "tokenizer",
                                  "hf-config-path", "model is out"])
def test_compile_refuses_an_out_that_holds_its_inputs(capsys, tmp_path, monkeypatch, build_with_its_checkpoint,
                                                      tiny_bf16_dir, case):
    """Recompiling into a build that holds the checkpoint being compiled (b/myckpt)
    replaced the folder whole: the checkpoint and the user's files were deleted, exit 0,
    and the new build.json pointed at the deleted weights. MODEL, --tokenizer or
    --hf-config-path at or inside --out (symbolic links resolved, on either side) is
    refused: one line naming it and --out, exit 2, before the checkpoint is read;
    nothing is touched."""
    out = build_with_its_checkpoint
    before = _listing(out)
    _compile_never_reads(monkeypatch)
    ckpt, flag, given_out, extra = out / "myckpt", "MODEL", out, []
    if case == "model via a link":
        ckpt = tmp_path / "ckpt-link"
        ckpt.symlink_to(out / "myckpt")
    elif case == "out via a link":
        given_out = tmp_path / "current"
        given_out.symlink_to(out)
        ckpt = given_out / "myckpt"
    elif case in ("tokenizer", "hf-config-path"):
        flag, extra = f"--{case}", [f"--{case}", out / "myckpt"]
        ckpt = tiny_bf16_dir
    elif case == "model is out":
        ckpt = out
    args = ["compile", ckpt, "--out", given_out, *extra, *_FAST_COMPILE]
    code, stdout, err = run_cli(capsys, *args)
    given = ckpt if flag == "MODEL" else out / "myckpt"
    where = "is" if case == "model is out" else "lies inside"
    assert_one_line_error(code, err, f"{flag} {given}: {where} --out {given_out}, which the compile replaces whole")
    assert stdout == "" and _listing(out) == before


def test_compile_refuses_a_build_holding_other_files(capsys, tmp_path, monkeypatch, build_with_its_checkpoint,
                                                     tiny_bf16_dir):
    """An earlier build also holding files a compile does not write (notes, a copied
    checkpoint, a folder of the user's) was replaced whole, deleting them: refused,
    naming the first few entries (a folder with a slash), before the checkpoint is read.
    What a build holds (dumps/, __pycache__/ of an imported runtime.py) is replaced."""
    out = build_with_its_checkpoint
    _compile_never_reads(monkeypatch)
    for extra, listed in (((), "NOTES.txt, myckpt/, which"),
                          (("a.txt", "b.txt"), "NOTES.txt, a.txt, b.txt (and 1 more), which")):
        for name in extra:
            (out / name).write_text("x")
        before = _listing(out)
        code, stdout, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", out, *_FAST_COMPILE)
        assert_one_line_error(code, err, f"{out} is a flintc build but also holds {listed} a compile does not write")
        assert stdout == "" and _listing(out) == before
    for name in ("NOTES.txt", "a.txt", "b.txt"):
        (out / name).unlink()
    shutil.rmtree(out / "myckpt")
    # inside dumps/ and __pycache__/ too (a new-user test: replaced without a word)
    for place, listed in (("dumps/NOTES.md", "dumps/NOTES.md"), ("dumps/decode_b1/mine.txt", "dumps/decode_b1/mine.txt"),
                          ("__pycache__/mine.txt", "__pycache__/mine.txt")):
        (out / place).parent.mkdir(parents=True, exist_ok=True)
        (out / place).write_text("keep")
        before = _listing(out)
        code, stdout, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", out, *_FAST_COMPILE)
        assert_one_line_error(code, err, f"{out} is a flintc build but also holds {listed}, which")
        assert _listing(out) == before
        (out / place).unlink()
    monkeypatch.undo()
    (out / "__pycache__").mkdir(exist_ok=True)
    (out / "__pycache__" / "runtime.cpython-311.pyc").write_bytes(b"x")
    (out / "dumps" / "decode_b1").mkdir(parents=True, exist_ok=True)
    (out / "dumps" / "decode_b1" / "index.md").write_text("old")
    (out / "dumps" / "decode_b1" / "03-fuse_moe.layer2-moe.svg").write_text("old")
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", out, *_FAST_COMPILE)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["build.json", "plan.json", "report.json", "report.md",
                                                       "runtime.py"]


def test_build_options_zero_is_not_unset():
    from flintc.config import FlintConfig
    from flintc.errors import InputError
    from flintc.runtime.build import BuildOptions

    tiny = FlintConfig.preset("tiny")
    assert BuildOptions().resolve(tiny).max_model_len == tiny.max_position_embeddings
    with pytest.raises(InputError, match="got 0"):
        BuildOptions(max_model_len=0).resolve(tiny)


def test_prefill_chunk_defaults_and_tail():
    """--prefill-chunk: on CUDA 4096 by default (fewer passes over the experts' weights),
    less when no prompt can fill it; elsewhere 2^k <= min(W, 512); a chunk longer than W
    gets a tail function of 2^k <= min(W, 512) tokens and one of every power of two in
    between, and may not be longer than max_model_len (it could never run); 1..16384
    allowed."""
    from flintc.config import FlintConfig
    from flintc.errors import InputError
    from flintc.runtime.build import CUDA_PREFILL_CHUNK, BuildOptions

    full, tiny = FlintConfig.preset("full"), FlintConfig.preset("tiny")  # W = 513, 9

    def resolved(config, **kw):
        o = BuildOptions(**kw).resolve(config)
        return o.prefill_chunk, o.prefill_tail_chunk(config)

    def sizes(config, **kw):
        return BuildOptions(**kw).resolve(config).prefill_sizes(config)

    assert CUDA_PREFILL_CHUNK == 4096
    assert resolved(full, device="cuda") == (4096, 512)
    assert sizes(full, device="cuda") == [4096, 2048, 1024, 512]  # every power of two down to the tail
    assert sizes(full, prefill_chunk=3000) == [3000, 2048, 1024, 512]
    assert sizes(full) == [512] and sizes(full, prefill_chunk=513) == [513]
    assert sizes(tiny, prefill_chunk=32) == [32, 16, 8] and sizes(tiny, prefill_chunk=10) == [10, 8]
    assert resolved(full, device="cuda", max_model_len=3000) == (2048, 512)
    assert resolved(full, device="cuda", max_model_len=1500) == (1024, 512)  # a prompt fills it
    assert resolved(full, device="cuda", max_model_len=1000) == (512, 512)
    assert resolved(full, device="cuda", max_model_len=100) == (512, 512)  # never below the CPU default
    assert resolved(full) == (512, 512)
    assert resolved(full, prefill_chunk=513) == (513, 513)  # up to W: no tail
    assert resolved(full, prefill_chunk=4096) == (4096, 512)
    assert resolved(tiny) == (8, 8) and resolved(tiny, device="cuda", max_model_len=64) == (64, 8)
    assert resolved(tiny, prefill_chunk=9) == (9, 9) and resolved(tiny, prefill_chunk=10) == (10, 8)
    for bad in (0, 16385):
        with pytest.raises(InputError, match=f"--prefill-chunk must be in 1..16384, got {bad}"):
            BuildOptions(prefill_chunk=bad).resolve(full)
    # longer than W and than any prompt: the chunk's function could never run
    with pytest.raises(InputError, match=r"--prefill-chunk 65 is longer than the sliding window \(9\) and "
                                         r"than --max-model-len \(64\)"):
        BuildOptions(prefill_chunk=65, max_model_len=64).resolve(tiny)
    assert resolved(tiny, prefill_chunk=64, max_model_len=64) == (64, 8)
    assert resolved(tiny, prefill_chunk=8, max_model_len=4) == (8, 8)  # <= W: padded, as before


def test_sigterm_during_compile_leaves_no_temporary_folder(tmp_path, tiny_bf16_dir):
    """SIGTERM runs the same clean-up as Ctrl-C: exit 143, no `.b.xxxx` folder left."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "flintc", "compile", str(tiny_bf16_dir), "--out",
                             str(tmp_path / "b"), "--no-dump"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".b.") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "flintc: terminated" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_after_the_command_ends_the_process_quietly(tmp_path):
    """A Ctrl-C once the command is done, during the interpreter's exit (here: an atexit
    callback that sends it; torch's weakref finalizers and filelock's lock release run
    there): the process ends as interrupted (SIGINT's default action), with no
    "Exception ignored in atexit callback ... KeyboardInterrupt" (the command had exited
    0 with that message). `main(argv)` in a caller's process keeps its SIGINT handler."""
    code = ("import atexit, os, signal, sys; from flintc.cli import main; code = main(); "
            "atexit.register(os.kill, os.getpid(), signal.SIGINT); sys.exit(code)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code, "dump", "--out", tmp_path / "file" / "x"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGINT, proc.stderr
    assert proc.stderr == f"flintc: error: --out {tmp_path}/file/x: the parent folder {tmp_path}/file does not exist\n"
    handler = signal.getsignal(signal.SIGINT)
    assert main(["dump", "--out", str(tmp_path / "file" / "x")]) == 2
    assert signal.getsignal(signal.SIGINT) is handler


def test_ignored_sigint_stays_ignored_after_the_command(tmp_path):
    """A process started with SIGINT ignored (`flintc compile ... &` in a non-interactive
    shell, a supervisor) keeps ignoring it once the command is done: a SIGINT during the
    interpreter's exit (here from an atexit callback) neither kills it nor is reported,
    and it exits with the command's status (the default action put back by main() had
    killed it)."""
    code = ("import atexit, os, signal, sys; from flintc.cli import main; code = main(); "
            "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN; "
            "atexit.register(os.kill, os.getpid(), signal.SIGINT); sys.exit(code)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code, "dump", "--out", tmp_path / "file" / "x"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"flintc: error: --out {tmp_path}/file/x: the parent folder {tmp_path}/file does not exist\n"


def test_sigkill_leftovers_are_removed_by_the_next_compile(tmp_path, tiny_bf16_dir):
    """SIGKILL skips every clean-up: a killed compile leaves its `.b.<pid>.xxxxxxxx`
    folder. The next compile into the same --out removes the folders of processes that
    no longer run (also `.b.old-<pid>`), and leaves a live process's and other names'."""
    from flintc.fileio import remove_stale_temp_dirs, temp_dir_beside

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "flintc", "compile", str(tiny_bf16_dir), "--out",
                             str(tmp_path / "b"), "--no-dump", "--no-check"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(f".b.{proc.pid}.") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    killed = [p for p in tmp_path.iterdir() if p.name.startswith(f".b.{proc.pid}.")]
    assert len(killed) == 1 and killed[0].is_dir()
    (tmp_path / f".b.old-{proc.pid}").mkdir()  # move_into_place's, killed between its renames
    live = tmp_path / f".b.{os.getppid()}.abcd_123"  # a running process's (pytest's parent)
    other = tmp_path / f".c.{proc.pid}.abcd_123"  # another --out's
    live.mkdir(), other.mkdir()
    mine = temp_dir_beside(tmp_path / "b")
    assert mine.name.startswith(f".b.{os.getpid()}.")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, mine.name])
    assert remove_stale_temp_dirs(tmp_path / "b") == []  # its own process's is not stale


def _signal_on_rename_of(monkeypatch, path, signum):
    """Path.rename sends `signum` to this process right after renaming `path` (the first
    of move_into_place's renames: the old folder aside)."""
    rename = Path.rename

    def renamed(self, target):
        result = rename(self, target)
        if Path(self) == Path(path):
            os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(Path, "rename", renamed)


@pytest.fixture
def sigterm_raises():
    """SIGTERM raises Terminated, as under the CLI (pytest leaves it at its default)."""
    from flintc.cli import _raise_terminated

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_move_into_place_says_nothing_written_when_the_swap_fails(tmp_path, monkeypatch):
    """A failed second rename puts the old folder back and raises its error, under a
    SIGINT that came meanwhile: `log` is not told the new folder was written."""
    from flintc.fileio import move_into_place

    out, tmp = tmp_path / "b", tmp_path / ".b.new"
    for folder, text in ((out, "old"), (tmp, "new")):
        folder.mkdir()
        (folder / "build.json").write_text(text)
    rename = Path.rename

    def failing(self, target):
        if Path(self) == tmp:
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError(28, "No space left on device")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    said = []
    with pytest.raises(KeyboardInterrupt) as exc:
        move_into_place(tmp, out, log=said.append)
    assert isinstance(exc.value.__context__, OSError) and said == []
    assert (out / "build.json").read_text() == "old"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("where", ["between the renames", "removing the old folder"])
def test_move_into_place_is_all_or_nothing_under_signals(tmp_path, monkeypatch, sigterm_raises, signum, where):
    """SIGINT or SIGTERM during move_into_place's swap is deferred to its end: raised
    only once `out` is the complete new folder and no `.out.old-PID` remains (it used
    to leave the old build aside and none at `out`, or a half-removed `.old-` folder)."""
    import shutil

    from flintc.errors import Terminated
    from flintc.fileio import move_into_place

    out, tmp = tmp_path / "b", tmp_path / ".b.new"
    for folder, text in ((out, "old"), (tmp, "new")):
        (folder / "sub").mkdir(parents=True)
        for i in range(20):
            (folder / "sub" / f"{i}.txt").write_text(text)
        (folder / "build.json").write_text(text)
    if where == "between the renames":
        _signal_on_rename_of(monkeypatch, out, signum)
    else:
        rmtree = shutil.rmtree

        def interrupted_rmtree(path, *a, **kw):
            os.kill(os.getpid(), signum)
            return rmtree(path, *a, **kw)

        monkeypatch.setattr(shutil, "rmtree", interrupted_rmtree)
    said = []
    with pytest.raises(KeyboardInterrupt if signum == signal.SIGINT else Terminated):
        move_into_place(tmp, out, log=said.append)
    assert said == [f"wrote {out} (complete) before the interrupt"]
    assert [p.name for p in tmp_path.iterdir()] == ["b"]
    assert (out / "build.json").read_text() == "new"
    assert sorted(p.read_text() for p in (out / "sub").iterdir()) == ["new"] * 20
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_signals_deferred_delivers_every_signal_and_restores_every_handler(sigterm_raises):
    """Both SIGINT and SIGTERM in the block: both are delivered after it, SIGTERM's
    Terminated last (over KeyboardInterrupt), and both handlers are back; the asyncio
    wake-up fd sees each signal once, not twice. A review found the SIGTERM dropped and
    a handler left replaced when a signal came while the handlers were swapped."""
    import socket

    from flintc.errors import Terminated
    from flintc.fileio import _chain, signals_deferred

    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    with pytest.raises(Terminated) as exc:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
    assert isinstance(exc.value.__context__, KeyboardInterrupt)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers

    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    seen = []
    previous_int = signal.signal(signal.SIGINT, lambda num, frame: seen.append(num))
    previous_fd = signal.set_wakeup_fd(writer.fileno())
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
        assert seen == [signal.SIGINT]
        assert reader.recv(16) == bytes([signal.SIGINT])  # once
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_int)
        reader.close()
        writer.close()

    ran = []

    def boom():
        ran.append("boom")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a step that raises does not stop the later ones
        _chain([boom, lambda: ran.append("next"), lambda: ran.append("last")])
    assert ran == ["boom", "next", "last"]


def test_compile_interrupted_during_the_swap_keeps_the_new_build(capsys, tmp_path, monkeypatch, tiny_bf16_dir):
    """Ctrl-C while `flintc compile --out B` moves the new build over an earlier one:
    exit 130, B is the complete new build and no hidden folder is left. compile's
    clean-up used to delete the new build (still in its temporary folder) with the old
    one renamed aside, which the next compile removed: no build at all."""
    out = tmp_path / "b"
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", out, *_FAST_COMPILE)
    assert code == 0, err
    (out / "report.md").write_text("old build")
    _signal_on_rename_of(monkeypatch, out, signal.SIGINT)
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", out, *_FAST_COMPILE)
    assert code == 130, err
    assert [p.name for p in tmp_path.iterdir()] == ["b"]
    assert (out / "build.json").is_file() and (out / "runtime.py").is_file()
    assert (out / "report.md").read_text() != "old build"
    assert f"wrote {out} (complete) before the interrupt" in err and "flintc: interrupted" in err


def _quick_dump(model, step, dump_dir=None, **kw):
    """Stands in for `compile_step` in the dump tests: writes two dump files."""
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    (Path(dump_dir) / "index.md").write_text("# dump\n")
    (Path(dump_dir) / "report.json").write_text(json.dumps({"step": step, "stages": ["captured"]}))
    return None, SimpleNamespace(stages=[])


def test_dump_interrupted_during_the_swap_says_the_dump_was_written(capsys, tmp_path, monkeypatch):
    """Ctrl-C while `flintc dump --out D` moves the new dump over an earlier one: exit 130,
    D is the complete new dump, and stderr says so, as compile does (`move_into_place`'s
    log); it used to say only "interrupted"."""
    import flintc.passes.pipeline as pipeline

    monkeypatch.setattr(pipeline, "compile_step", _quick_dump)
    out = tmp_path / "dumps"
    out.mkdir()
    for name in ("index.md", "report.json", "99-stale.py"):
        (out / name).write_text("{}")
    _signal_on_rename_of(monkeypatch, out, signal.SIGINT)
    code, stdout, err = run_cli(capsys, "dump", "--out", out, "--batch", "1")
    assert code == 130, err
    assert [p.name for p in tmp_path.iterdir()] == ["dumps"]
    assert not (out / "99-stale.py").exists() and (out / "index.md").read_text() == "# dump\n"
    assert f"wrote {out} (complete) before the interrupt" in err and "flintc: interrupted" in err


# ---- --help: each default said once -----------------------------------------------------

# A help text that tells an option's default: "(default: X)", "(default 10; cpu 1)",
# "...; default: 8". Not "default)": the value of a choice named default.
_TELLS_DEFAULT = re.compile(r"\bdefault\b(?!\))")


def _subcommands():
    from flintc.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_help_says_each_default_once():
    """Every sub-command's --help: an option with a default worth telling names it
    exactly once (hand-written or appended), one without (None, a flag's False) never
    gets "(default: None)"."""
    from flintc.cli import HelpFormatter

    commands = _subcommands()
    assert {"run", "compile", "serve", "bench", "dump", "verify", "make-checkpoint"} <= set(commands)
    for name, parser in commands.items():
        assert parser.formatter_class is HelpFormatter, name
        for action in parser._actions:
            if not action.help or argparse.SUPPRESS in (action.help, action.default):
                continue
            text = parser._get_formatter()._expand_help(action)
            where = f"flintc {name} {'/'.join(action.option_strings) or action.dest}: {text!r}"
            told = len(_TELLS_DEFAULT.findall(text))
            default = action.default
            if default is None or isinstance(default, bool) or default == []:
                assert told <= 1 and "(default: " + str(default) not in text, where
            else:
                assert told == 1, where


@pytest.mark.parametrize("command", ["run", "compile", "serve", "bench", "dump", "verify", "make-checkpoint"])
def test_help_output_has_no_doubled_default(capsys, command):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert not re.search(r"\(default[^()]*\)\s*\(default", text), text
    for noise in ("(default: None)", "(default: False)", "(default: [])"):
        assert noise not in text
    if command == "run":
        assert text.count("(default: random)") == 1 and "(default: 16)" in text


def test_compile_help_says_an_existing_build_is_replaced(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the BUILD folder to write: new, empty, or an earlier build, which is replaced whole" in text
    assert "refused when it also holds files a compile does not write, or holds MODEL, --tokenizer" in text


# ---- verify / dump / make-checkpoint / serve ----------------------------------------------


@pytest.mark.parametrize("args, needles", [
    (["--tokens", "0"], ["--tokens", "got 0"]),
    (["--tokens", "-3"], ["--tokens", "got -3"]),
    (["--cache-len", "0"], ["--cache-len", "got 0"]),
    (["--cache-len", "-5"], ["--cache-len", "got -5"]),
    (["--tokens", "16", "--cache-len", "4"], ["--tokens 16", "--cache-len 4"]),
    (["--attention-splits", "0"], ["--attention-splits", "got 0"]),
])
def test_verify_refuses_bad_sizes(capsys, args, needles):
    code, _, err = run_cli(capsys, "verify", *args)
    assert_one_line_error(code, err, *needles)


def test_capture_zero_tokens_is_not_the_default():
    from harness import tiny_model

    from flintc.graph.trace import capture

    with pytest.raises(ValueError, match="tokens=0"):
        capture(tiny_model(), "prefill", tokens=0, cache_len=16)
    with pytest.raises(ValueError, match="cache_len"):
        capture(tiny_model(), "decode", cache_len=0)


@pytest.mark.parametrize("args, needles", [
    (["--max-shard-bytes", "0"], ["--max-shard-bytes", "got 0"]),
    (["--max-shard-bytes", "-1"], ["--max-shard-bytes", "got -1"]),
    (["--format", "nvfp4", "--max-shard-bytes", "1000"], ["--max-shard-bytes", "--format bf16"]),
    (["--config", "full", "--max-shard-bytes", "1000"], ["--max-shard-bytes", "--config full", "nothing to shard"]),
])
def test_make_checkpoint_bad_shard_size(capsys, tmp_path, args, needles):
    code, _, err = run_cli(capsys, "make-checkpoint", "--out", tmp_path / "c", *args)
    assert_one_line_error(code, err, *needles)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, needles", [
    (["--port", "70000"], ["--port", "70000", "0..65535"]),
    (["--port", "-1"], ["--port", "-1"]),
    (["/nonexistent/model"], ["MODEL /nonexistent/model", "no such"]),
    (["--hf-config-path", "/nonexistent/cfg"], ["--hf-config-path /nonexistent/cfg"]),
    (["--build", "/nonexistent/build"], ["--build /nonexistent/build"]),
])
def test_serve_bad_arguments(capsys, args, needles):
    code, _, err = run_cli(capsys, "serve", *args)
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize("missing", SERVING_STACK)
def test_serve_without_its_serving_stack_is_one_line(capsys, monkeypatch, tiny_bf16_dir, missing):
    """An install without FastAPI / uvicorn / prometheus_client (pip --no-deps, a
    hand-assembled GPU environment): the argument checks still come first (a bad --port
    is named as such), then one line naming the module and the pip command, not
    ModuleNotFoundError's traceback from inside flintc.serve.app."""
    import importlib.util

    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    # the first one that does not import is named: `missing`, or one before it that this
    # machine lacks (a bare GPU machine has no FastAPI)
    named = next(m for m in SERVING_STACK if m == missing or importlib.util.find_spec(m) is None)
    code, _, err = run_cli(capsys, "serve", "--port", "70000")
    assert_one_line_error(code, err, "--port", "70000")
    code, _, err = run_cli(capsys, "serve", tiny_bf16_dir, "--port", "0")
    assert_one_line_error(code, err, f"flintc serve needs {named}", "pip install fastapi uvicorn prometheus_client")


def test_load_checkpoint_names_a_missing_hf_config_path(tiny_nvfp4_gguf):
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.errors import CheckpointError

    with pytest.raises(CheckpointError, match="--hf-config-path.*/nonexistent/cfg: no such"):
        load_checkpoint(tiny_nvfp4_gguf, hf_config_path="/nonexistent/cfg", progress=False)


def test_dump_refuses_a_checkpoint_folder(capsys, tiny_bf16_dir, tmp_path):
    before = sorted(p.name for p in tiny_bf16_dir.iterdir())
    code, _, err = run_cli(capsys, "dump", "--out", tiny_bf16_dir)
    assert_one_line_error(code, err, f"--out {tiny_bf16_dir}", "config.json")
    assert sorted(p.name for p in tiny_bf16_dir.iterdir()) == before
    (tmp_path / "mine.txt").write_text("keep")
    code, _, err = run_cli(capsys, "dump", "--out", tmp_path)
    assert_one_line_error(code, err, "not empty")
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


def test_interrupted_dump_leaves_nothing_and_a_dump_replaces_an_earlier_one(capsys, tmp_path, monkeypatch):
    """The dump is written beside --out and renamed at the end: an interrupt mid-way
    leaves no folder, an earlier dump output is replaced whole."""
    import flintc.passes.pipeline as pipeline

    def interrupted(*a, dump_dir=None, **kw):
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        (Path(dump_dir) / "00-captured.py").write_text("# half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "compile_step", interrupted)
    out = tmp_path / "dumps"
    assert main(["dump", "--out", str(out), "--batch", "1"]) == 130
    assert list(tmp_path.iterdir()) == []

    out.mkdir()
    for name in ("index.md", "report.json", "99-stale.py"):
        (out / name).write_text("{}")
    monkeypatch.setattr(pipeline, "compile_step", _quick_dump)
    code, stdout, err = run_cli(capsys, "dump", "--out", out, "--batch", "1")
    assert code == 0, err
    assert not (out / "99-stale.py").exists() and json.loads((out / "report.json").read_text())["stages"]
    assert f"-> {out}" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dumps"]


def test_output_paths_are_checked_before_any_work(capsys, tmp_path, monkeypatch, tiny_bf16_dir):
    """make-checkpoint --out, verify --json and run --logits-out under a plain file, or in
    a folder where no file can be created (the write probe of `flintc.fileio`, which also
    sees what permission bits do not tell root), are refused at once with one line naming
    the flag; nothing is written."""
    import flintc.fileio as fileio

    (tmp_path / "file").write_text("x")
    t0 = time.process_time()
    for args, flag in ((["make-checkpoint", "--config", "tiny", "--out", tmp_path / "file" / "c"],
                        "--out"),
                       (["verify", "--json", tmp_path / "file" / "r.json", "--step", "decode"],
                        "--json")):
        code, _, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, flag, "is not a folder")
    real = fileio.cannot_write_in
    monkeypatch.setattr(fileio, "cannot_write_in", lambda folder: "Read-only file system")
    for args, flag in ((["make-checkpoint", "--config", "tiny", "--out", tmp_path / "c"], "--out"),
                       (["verify", "--json", tmp_path / "r.json", "--step", "decode"], "--json"),
                       (["compile", tiny_bf16_dir, "--out", tmp_path / "b"], "--out"),
                       (["run", tiny_bf16_dir, "--prompt-ids", "1,2", "--max-tokens", "1",
                         "--logits-out", tmp_path / "l.npy"], "--logits-out")):
        code, _, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, flag, "cannot write in the", "Read-only file system")
    assert time.process_time() - t0 < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    monkeypatch.setattr(fileio, "cannot_write_in", real)
    assert real(tmp_path) is None and real(tmp_path / "missing") is not None


def test_a_folder_that_takes_no_new_files_is_said_so(capsys, tmp_path, monkeypatch):
    """`verify --json /proc/version` said "cannot write in the folder /proc (No such file or
    directory)", as if /proc were missing: a file system that takes no new files (/proc)
    answers ENOENT about the file being created. Now said in words, naming the flag and
    the file; /proc itself where it is there, and a folder whose probe fails so."""
    import errno
    import tempfile

    if Path("/proc/version").is_file():
        code, out, err = run_cli(capsys, "verify", "--json", "/proc/version", "--step", "decode")
        assert_one_line_error(code, err, "--json /proc/version: cannot write in the folder /proc (its file system "
                              "takes no new files: creating one there fails with 'No such file or directory')")
        assert out == ""

    def no_new_files(*args, dir=None, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", f"{dir}/.flintc-probe-x")

    monkeypatch.setattr(tempfile, "mkstemp", no_new_files)
    code, out, err = run_cli(capsys, "verify", "--json", tmp_path / "r.json", "--step", "decode")
    assert_one_line_error(code, err, f"--json {tmp_path / 'r.json'}: cannot write in the folder {tmp_path} (its "
                          "file system takes no new files: creating one there fails with 'No such file or directory')")
    assert out == "" and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    import flintc.fileio as fileio

    assert fileio.cannot_write_in(tmp_path / "missing") == "No such file or directory"  # a missing folder: as is


def test_compile_checks_the_kernel_environment_first(capsys, tmp_path, monkeypatch, tiny_bf16_dir):
    """A malformed kernel variable is refused by `flintc compile` (the build's runtime would
    refuse it at load), before any compile work, naming the variable."""
    for var, bad in (("FLINTC_PDL_TRIGGER", "sometimes"),
                     ("FLINTC_MMA_NORM_GATE_UP_LAUNCH", "nvfp4:1=4,1,2")):
        monkeypatch.setenv(var, bad)
        code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", tmp_path / "b",
                               "--backend", "triton")
        assert_one_line_error(code, err, var)
        monkeypatch.delenv(var)
    assert list(tmp_path.iterdir()) == []


def test_sigterm_dropped_in_a_callback_is_delivered_again():
    """SIGTERM's `Terminated` raised where Python drops exceptions (here a __del__; in the
    CI run of session 26, importlib's module-lock callback, after which `flintc compile`
    ran on and exited 0) reaches `sys.unraisablehook`, which `main` sets to raise the
    signal again: the command still stops with Terminated. Another unraisable exception
    goes to the previous hook."""
    from flintc import cli

    previous = signal.getsignal(signal.SIGTERM)
    cli._install_sigterm_handler()
    hook = cli._install_unraisable_hook()
    seen = []
    try:
        class Dropped:
            def __del__(self):
                raise cli.Terminated()

        with pytest.raises(cli.Terminated):
            obj = Dropped()
            del obj  # the exception is dropped here, the signal sent again
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # its handler raises in this loop
                time.sleep(0.01)
        sys.unraisablehook, inner = (lambda u: seen.append(u.exc_type)), sys.unraisablehook
        cli._install_unraisable_hook()

        class Other:
            def __del__(self):
                raise RuntimeError("not a termination")

        obj = Other()
        del obj
        assert seen == [RuntimeError]
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        sys.unraisablehook = hook


def test_ctrl_c_dropped_in_a_callback_is_delivered_again():
    """Ctrl-C's KeyboardInterrupt raised in a weakref callback (torch's
    WeakIdKeyDictionary, while `flintc dump` printed its tables) is dropped by Python
    ("Exception ignored in ..." and the command exited 0): `main`'s unraisable hook sends
    SIGINT again, so the command stops as interrupted."""
    from flintc import cli

    hook = cli._install_unraisable_hook()
    try:
        class Dropped:
            def __del__(self):
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt) as exc:
            obj = Dropped()
            del obj  # the exception is dropped here, the signal sent again
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # its handler raises in this loop
                time.sleep(0.01)
        assert not isinstance(exc.value, cli.Terminated)
    finally:
        sys.unraisablehook = hook


@pytest.mark.parametrize("command", ["compile", "run"])
def test_triton_backend_without_triton_is_one_line(capsys, tmp_path, monkeypatch, tiny_bf16_dir, command):
    """`--backend triton` on a machine without Triton (an optional extra) is a user error
    that says what to install, before any compile, not an import traceback."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "triton" else real(name, *a, **k))
    args = ["--out", tmp_path / "b"] if command == "compile" else ["--prompt-ids", "1", "--no-dump"]
    code, _, err = run_cli(capsys, command, tiny_bf16_dir, "--backend", "triton", *args)
    assert_one_line_error(code, err, "triton backend needs Triton", "pip install triton")
    assert list(tmp_path.iterdir()) == []
