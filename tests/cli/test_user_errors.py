"""Papercuts of a new-user review: each a one-line error (exit 2, no traceback) that names
the file or option at fault and says what to do, before any work.

- A build whose checkpoint was moved or deleted after `flintc compile`: the error names
  the build's build.json (where the path comes from) and the path, and says to pass the
  checkpoint as MODEL or to recompile.
- `--config bogus`: the error lists the presets, and says when a config.json path is
  accepted too.
- An empty output path (`--out ""`, `--json ""`, ...) is refused naming the option; it
  used to mean the current folder. So is an empty input path (MODEL "", `--build ""`,
  `--tokenizer ""`, `--hf-config-path ""`, `--from-json ""`).
- `flintc serve MODEL --build BUILD` and `flintc run MODEL --build BUILD` look for the
  tokenizer beside MODEL first, then where the build's build.json says it was; when
  none is found the error names every place looked in.
- A build compiled with dummy weights: `flintc serve --build` takes --load-format dummy,
  as `flintc run --build` does, and both say so up front.
- `flintc bench` values outside their domain (`--max-model-len 0`, `--time-budget -1`,
  a `--breakdown` point not measured) are refused, not taken as the default or skipped.
- A $FLINTC_CACHE_DIR (where the default model is made) that cannot be written: the
  error names the variable and its value.
- The full model on a CPU without the memory for its weights (a check against the
  available memory, monkeypatched here: no test makes the full model's weights).

Most tests compile no build: the build there is a build.json written by hand, which is
all a build's loader reads before the weights. The tokenizer and dummy-weight tests
compile two small builds of the tiny model once (a few seconds each, no checks)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from flintc.cli import main
from harness import assert_one_line_error, run_cli


# ---- a build whose checkpoint is gone ------------------------------------------------------


def _fake_build(folder: Path, weight_source: str) -> Path:
    """A BUILD folder holding only build.json, as `flintc compile` writes it for the tiny
    config on the CPU (torch backend), its weights recorded as `weight_source`."""
    from flintc.config import FlintConfig
    from flintc.runtime.build import BUILD_VERSION, config_fingerprint

    config = FlintConfig.preset("tiny")
    folder.mkdir()
    (folder / "build.json").write_text(json.dumps({
        "build_version": BUILD_VERSION, "config": config.to_dict(), "config_sha256": config_fingerprint(config),
        "weight_format": "bf16", "weight_source": weight_source, "tokenizer_dir": weight_source,
        "weight_sha256": "0" * 64, "max_batch": 1, "max_model_len": 32, "prefill_chunk": 8,
        "backend": "torch", "device": "cpu", "functions": {},
    }))
    return folder


@pytest.mark.parametrize("command", ["run", "serve"])
def test_build_with_a_moved_checkpoint_names_build_json(capsys, tmp_path, command):
    """`flintc run --build` said only "<path>: no such checkpoint file or folder", `flintc
    serve --build` "no tokenizer found beside the model": neither said that the path came
    from the build's build.json, nor what to do."""
    moved = tmp_path / "ckpt-moved-away"
    build = _fake_build(tmp_path / "build", str(moved))
    args = (["run", "--build", build, "--prompt-ids", "1,2", "--max-tokens", 1] if command == "run"
            else ["serve", "--build", build, "--port", 0])
    # "at once" is timed in this process's CPU time, not wall time: under load (2 cores,
    # other processes busy) wall time is not the command's (6.5 s for `dump --config bogus`)
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, build / "build.json", f"records the checkpoint {moved}", "no longer exists",
                          "pass the checkpoint as MODEL", "recompile with flintc compile")
    assert out == "" and time.process_time() - t0 < 5


@pytest.mark.parametrize("command", ["run", "serve"])
def test_build_whose_checkpoint_lost_its_weights_says_so(capsys, tmp_path, tiny_bf16_dir, command):
    """The BF16 checkpoint a build records lost its safetensors files (config.json left):
    `flintc run --build B --prompt Hi` and `flintc serve --build B` said "no tokenizer
    found ... pass --tokenizer DIR", and only with --tokenizer the real error. Now the real
    error first, naming build.json."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_bf16_dir / "config.json", ckpt / "config.json")
    build = _fake_build(tmp_path / "build", str(ckpt))
    args = (["run", "--build", build, "--prompt", "Hi", "--max-tokens", 1] if command == "run"
            else ["serve", "--build", build, "--port", 0])
    code, out, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, f"{ckpt}: neither a BF16 checkpoint folder", build / "build.json",
                          "pass the checkpoint as MODEL", "recompile with flintc compile")
    assert "tokenizer" not in err and out == ""


def test_logit_bias_outside_the_build_vocabulary_fails_before_loading(capsys, tmp_path):
    """Regression: `flintc run --build B --logit-bias 600=1` (a vocabulary of 512) loaded
    the weights before refusing the id, naming no flag. The build's build.json gives
    vocab_size: the id is refused before anything loads (the checkpoint recorded here
    does not even exist), naming --logit-bias, the id, the range and build.json."""
    build = _fake_build(tmp_path / "build", str(tmp_path / "no-such-ckpt"))
    code, out, err = run_cli(capsys, "run", "--build", build, "--prompt-ids", "1,2", "--max-tokens", 1,
                             "--logit-bias", "600=1")
    assert_one_line_error(code, err, "--logit-bias 600=1: token id 600 is outside the vocabulary [0, 512) "
                          f"of {build / 'build.json'}")
    assert out == ""


def test_build_with_a_broken_checkpoint_names_build_json(capsys, tmp_path, tiny_bf16_dir):
    """The recorded checkpoint folder is still there but its weights are gone: the
    loader's error is kept, and build.json named; a MODEL given explicitly is loaded
    instead of the recorded one (here: other weights, so the fingerprint differs)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_bf16_dir, ckpt)
    for f in ckpt.glob("*.safetensors*"):
        f.unlink()
    build = _fake_build(tmp_path / "build", str(ckpt))
    code, _, err = run_cli(capsys, "run", "--build", build, "--prompt-ids", "1,2", "--max-tokens", 1)
    assert_one_line_error(code, err, ckpt, f"the checkpoint {build / 'build.json'} records",
                          "pass the checkpoint as MODEL")
    code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--build", build, "--prompt-ids", "1,2", "--max-tokens", 1)
    assert_one_line_error(code, err, f"the weights in {tiny_bf16_dir} are not the ones {build} was compiled with")
    assert "build.json" not in err


def test_recorded_weight_source(tiny_bf16_dir):
    from flintc.errors import CheckpointError, InputError
    from flintc.runtime.compiled import recorded_weight_source

    assert recorded_weight_source("b", {"weight_source": "dummy:bf16"}) == "dummy:bf16"
    there = str(tiny_bf16_dir)
    assert recorded_weight_source("b", {"weight_source": there}) == there
    here = str(Path(__file__).resolve().parent)  # a folder, but no checkpoint
    with pytest.raises(CheckpointError, match=r"neither a BF16 checkpoint folder .*b/build.json records.*recompile"):
        recorded_weight_source("b", {"weight_source": here})
    with pytest.raises(InputError, match=r"b/build.json records no weight_source .*recompile"):
        recorded_weight_source("b", {})


# ---- --config bogus ------------------------------------------------------------------------

_PATH_OK = ["expected a preset (full, tiny) or the path of a config.json file or of a folder holding one"]
_PRESET_ONLY = ["unknown config preset; the presets are full, tiny", "as MODEL with --load-format dummy"]


@pytest.mark.parametrize("args, needles", [
    (["make-checkpoint", "--config", "bogus", "--out", "{tmp}/c"],
     ["--config 'bogus' is neither a config preset nor an existing file or folder", *_PATH_OK]),
    (["make-checkpoint", "--config", "", "--out", "{tmp}/c"], ["--config '' is empty", *_PATH_OK]),
    (["verify", "--config", "bogus", "--step", "decode"], ["--config 'bogus'", *_PATH_OK]),
    (["dump", "--config", "bogus", "--out", "{tmp}/d"], ["--config 'bogus'", *_PATH_OK]),
    (["compile", "--load-format", "dummy", "--config", "bogus", "--out", "{tmp}/b"], ["--config 'bogus'", *_PRESET_ONLY]),
    (["run", "--load-format", "dummy", "--config", "bogus", "--prompt-ids", "1"], ["--config 'bogus'", *_PRESET_ONLY]),
    (["compile", "--load-format", "dummy", "--config", "tiny/", "--out", "{tmp}/b"], ["--config 'tiny/'", *_PRESET_ONLY]),
    (["bench", "--device", "cpu", "--config", "bogus", "--out", "{tmp}/o"],
     ["--config bogus: unknown config preset 'bogus': the presets are full, tiny"]),
])
def test_unknown_config_lists_the_presets(capsys, tmp_path, args, needles):
    """`--config bogus` said "bogus: config file not found" (make-checkpoint, verify, dump)
    or "unknown config preset 'bogus' (expected one of ['full', 'tiny'])" without the
    option (compile, run)."""
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in args])
    assert_one_line_error(code, err, *needles)
    assert out == "" and list(tmp_path.iterdir()) == [] and time.process_time() - t0 < 5


def test_config_accepts_a_preset_a_file_or_a_folder(tmp_path, tiny_bf16_dir):
    from flintc.config import FlintConfig

    tiny = FlintConfig.preset("tiny")
    assert FlintConfig.from_preset_or_path("tiny") == tiny
    assert FlintConfig.from_preset_or_path(str(tiny_bf16_dir)) == tiny
    assert FlintConfig.from_preset_or_path(str(Path(tiny_bf16_dir) / "config.json")) == tiny


# ---- empty output paths --------------------------------------------------------------------


@pytest.mark.parametrize("args, flag", [
    (["compile", "{ckpt}", "--out", ""], "--out"),
    (["compile", "--load-format", "dummy", "--config", "tiny", "--out", ""], "--out"),
    (["make-checkpoint", "--out", ""], "--out"),
    (["dump", "--out", ""], "--out"),
    (["verify", "--step", "decode", "--json", ""], "--json"),
    (["run", "{ckpt}", "--prompt-ids", "1", "--max-tokens", "1", "--logits-out", ""], "--logits-out"),
    (["bench", "--device", "cpu", "--config", "tiny", "--out", ""], "--out"),
    (["bench", "--from-json", "{tmp}/bench.json", "--out", ""], "--out"),
    (["bench", "--device", "cpu", "--config", "tiny", "--out", "{tmp}/o", "--builds", ""], "--builds"),
])
def test_empty_output_path_is_refused(capsys, tmp_path, monkeypatch, tiny_bf16_dir, args, flag):
    """An empty output path is not the current folder: refused at once naming the option
    (`--out ""` made compile say ". exists and is not a flintc build", make-checkpoint
    write into the current folder when empty, `verify --json ""` run and write no JSON,
    bench write into the current folder); nothing is written."""
    monkeypatch.chdir(tmp_path)
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path, ckpt=tiny_bf16_dir) for a in args])
    assert_one_line_error(code, err, f"{flag} must not be empty")
    assert out == "" and list(tmp_path.iterdir()) == [] and time.process_time() - t0 < 5


@pytest.mark.parametrize("args, flag", [
    (["verify", "--step", "decode", "--json", "new/"], "--json"),
    (["run", "{ckpt}", "--prompt-ids", "1", "--max-tokens", "1", "--logits-out", "new/"], "--logits-out"),
])
def test_output_file_ending_in_a_slash_is_refused(capsys, tmp_path, monkeypatch, tiny_bf16_dir, args, flag):
    """`--json new/` and `--logits-out new/` wrote a file named `new` (Path drops the
    slash); a name ending in a slash is a folder's: refused at once, nothing written."""
    monkeypatch.chdir(tmp_path)
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *[a.format(ckpt=tiny_bf16_dir) for a in args])
    assert_one_line_error(code, err, f"{flag} new/: ends in a slash (a folder), expected a file name")
    assert out == "" and list(tmp_path.iterdir()) == [] and time.process_time() - t0 < 5


@pytest.mark.parametrize("args, flag", [
    (["verify", "--step", "decode", "--json", "missing/deeper/r.json"], "--json"),
    (["run", "{ckpt}", "--prompt-ids", "1", "--max-tokens", "1", "--logits-out", "missing/deeper/r.json"],
     "--logits-out"),
])
def test_output_file_in_a_missing_folder_is_refused(capsys, tmp_path, monkeypatch, tiny_bf16_dir, args, flag):
    """An output file's folder is not created: `verify --json /nonexistent/x.json` made
    /nonexistent (and ran every pass), whereas `run --logits-out` refused it. Both say
    the folder does not exist, at once; nothing is written."""
    monkeypatch.chdir(tmp_path)
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *[a.format(ckpt=tiny_bf16_dir) for a in args])
    assert_one_line_error(code, err, f"{flag} missing/deeper/r.json: folder missing/deeper does not exist")
    assert out == "" and list(tmp_path.iterdir()) == [] and time.process_time() - t0 < 5


@pytest.mark.parametrize("args", [
    ["dump", "--step", "decode", "--out", "."],
    ["compile", "--load-format", "dummy", "--config", "tiny", "--out", "."],
    ["compile", "--load-format", "dummy", "--config", "tiny", "--out", "sub/.."],
    ["make-checkpoint", "--out", "."],
    ["make-checkpoint", "--out", "/"],
])
def test_output_folder_needs_a_name(capsys, tmp_path, monkeypatch, args):
    """A folder written beside its path and renamed into place cannot be `.`, `..` or `/`
    (`dump --out .` in an empty folder ended in a ValueError traceback after the dump,
    `make-checkpoint --out .` in "cannot move the new checkpoint into place (Device or
    resource busy)" after writing it)."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, f"--out {args[-1]}: expected a path ending in the name of the folder")
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["compile", "dump"])
@pytest.mark.parametrize("parent, needle", [("file", "{parent} is not a folder"),
                                            ("missing", "the parent folder {parent} does not exist")])
def test_output_folder_that_cannot_be_created(capsys, tmp_path, command, parent, needle):
    """`--out P/x` under a plain file, or under a folder that does not exist: one line
    naming --out, the path and the parent, exit 2, before any work; nothing written."""
    (tmp_path / "file").write_text("x")
    out = tmp_path / parent / "x"
    args = ["--load-format", "dummy", "--config", "tiny"] if command == "compile" else []
    t0 = time.process_time()
    code, stdout, err = run_cli(capsys, command, *args, "--out", out)
    assert_one_line_error(code, err, f"--out {out}: ", needle.format(parent=tmp_path / parent))
    assert stdout == "" and [p.name for p in tmp_path.iterdir()] == ["file"] and time.process_time() - t0 < 5


# ---- empty input paths ---------------------------------------------------------------------


@pytest.mark.parametrize("args, flag", [
    (["run", "", "--prompt-ids", "1"], "MODEL"),
    (["run", "--build", "", "--prompt-ids", "1"], "--build"),
    (["run", "{ckpt}", "--tokenizer", "", "--prompt", "hi"], "--tokenizer"),
    (["run", "{ckpt}", "--hf-config-path", "", "--prompt-ids", "1"], "--hf-config-path"),
    (["compile", "", "--out", "{tmp}/b"], "MODEL"),
    (["compile", "{ckpt}", "--tokenizer", "", "--out", "{tmp}/b"], "--tokenizer"),
    (["compile", "{ckpt}", "--hf-config-path", "", "--out", "{tmp}/b"], "--hf-config-path"),
    (["serve", "", "--port", "0"], "MODEL"),
    (["serve", "--build", "", "--port", "0"], "--build"),
    (["serve", "{ckpt}", "--tokenizer", "", "--port", "0"], "--tokenizer"),
    (["serve", "{ckpt}", "--hf-config-path", "", "--port", "0"], "--hf-config-path"),
    (["serve", "{ckpt}", "--chat-template", "", "--port", "0"], "--chat-template"),
    (["bench", "--from-json", "", "--out", "{tmp}/o"], "--from-json"),
    (["bench", "--from-json", "{tmp}/bench.json", "--from-json", "", "--out", "{tmp}/o"], "--from-json"),
    (["bench", "", "--device", "cpu", "--config", "tiny", "--out", "{tmp}/o"], "MODEL"),
    (["bench", "--device", "cpu", "--config", "tiny", "--hf-config-path", "", "--out", "{tmp}/o"],
     "--hf-config-path"),
    (["dump", "", "--out", "{tmp}/d"], "MODEL"),
    (["verify", "--hf-config-path", "", "--step", "decode"], "--hf-config-path"),
])
def test_empty_input_path_is_refused(capsys, tmp_path, monkeypatch, tiny_bf16_dir, args, flag):
    """An empty input path is not the current folder, nor "none given": refused at once
    naming the option (MODEL "" loaded the current folder, `run --build ""` ran the
    default model on the reference backend, `run --tokenizer ""` was ignored, `serve ""`
    served the current folder, `bench --from-json ""` said ".: Is a directory")."""
    monkeypatch.chdir(tmp_path)
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path, ckpt=tiny_bf16_dir) for a in args])
    assert_one_line_error(code, err, f"{flag} must not be empty: expected the path of ")
    assert out == "" and list(tmp_path.iterdir()) == [] and time.process_time() - t0 < 5


def test_check_input_paths():
    import argparse

    from flintc.cli.compile_build import check_input_paths
    from flintc.errors import InputError

    check_input_paths(argparse.Namespace(model=None, build="b", from_json=["a.json"], out=""))  # --out: not input
    check_input_paths(argparse.Namespace())
    with pytest.raises(InputError, match="^--from-json must not be empty"):
        check_input_paths(argparse.Namespace(from_json=["a.json", ""]))


# ---- bench values outside their domain -----------------------------------------------------

_BENCH_QUICK = ["bench", "--device", "cpu", "--config", "tiny", "--formats", "bf16", "--contexts", "64,128",
                "--batches", "1,2", "--prefill", "16", "--baselines", "none", "--no-plots"]


@pytest.mark.parametrize("args, needle", [
    (["--max-model-len", "0"], "--max-model-len must be >= 2 (a prompt token and one generated), got 0"),
    (["--max-model-len", "-2"], "--max-model-len must be >= 2 (a prompt token and one generated), got -2"),
    (["--time-budget", "-1"], "--time-budget must be a positive number of seconds, got -1"),
    (["--time-budget", "0"], "--time-budget must be a positive number of seconds, got 0"),
    (["--time-budget", "nan"], "--time-budget must be a positive number of seconds, got nan"),
    (["--time-budget", "10"], "--time-budget must be more than 15 s (the time kept for writing the outputs), "
                              "got 10"),
    (["--step-timeout", "-5"], "--step-timeout must be a positive number of seconds, got -5"),
    (["--breakdown", "9x9"], "--breakdown 9x9: not a decode point this run measures; expected BATCHxCONTEXT with "
                             "BATCH in --batches (1,2) and CONTEXT in --contexts (64,128)"),
    (["--breakdown", "1x64,2x100"], "--breakdown 2x100: not a decode point this run measures"),
    (["--breakdown", "1x64", "--no-flintc"], "--breakdown applies only when flintc is measured"),
])
def test_bench_refuses_values_outside_their_domain(capsys, tmp_path, args, needle):
    """`flintc bench --max-model-len 0` compiled for the largest context, `--time-budget
    -1` skipped every point (as did a budget within the 15 s kept for writing the outputs,
    "the time budget (10 s) is spent" after 1 s) and `--step-timeout -5` (or 0) meant no
    limit, all exiting 0;
    `--breakdown 9x9` (no such decode point measured) was never taken, silently. Now each
    is one line naming the option, before anything is measured or written."""
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *_BENCH_QUICK, *args, "--out", tmp_path / "o")
    assert_one_line_error(code, err, needle)
    assert out == "" and list(tmp_path.iterdir()) == [] and time.process_time() - t0 < 5


def test_bench_refuses_a_file_as_out(capsys, tmp_path):
    """`flintc bench --out FILE`, FILE an existing regular file: one line naming --out,
    before anything is measured."""
    (tmp_path / "f").write_text("mine")
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *_BENCH_QUICK, "--out", tmp_path / "f")
    assert_one_line_error(code, err, f"--out {tmp_path / 'f'}: exists and is a file, expected a folder")
    assert (tmp_path / "f").read_text() == "mine" and time.process_time() - t0 < 5


def test_compile_refuses_a_bucket_given_twice(capsys, tmp_path, tiny_bf16_dir):
    """`--buckets 1,1` was taken as 1, silently: refused, naming what was typed, in one
    line (it was argparse's usage block, then the message)."""
    code, out, err = run_cli(capsys, "compile", tiny_bf16_dir, "--out", tmp_path / "b", "--max-batch", 1,
                             "--buckets", "1,1")
    assert_one_line_error(code, err, "--buckets '1,1': 1 given twice; expected comma-separated decode batch sizes")
    assert out == "" and list(tmp_path.iterdir()) == []


def test_bench_options_check_the_same_values(tmp_path):
    """The Python API (`BenchOptions.resolved`) refuses them too; the default breakdown
    points and points among those measured are accepted."""
    from flintc.bench.core import BenchOptions
    from flintc.errors import InputError

    base = dict(out=tmp_path, device="cpu", config="tiny", contexts=[64, 128], batches=[1, 2], prefill=[16])
    opts = BenchOptions(**base, breakdown=[(2, 128)], time_budget=15.5, max_model_len=128).resolved()
    assert opts.breakdown == [(2, 128)]
    # resizable caches (the default) serve points beyond a build's max model len
    assert BenchOptions(**base, max_model_len=64).resolved().max_model_len == 64
    for bad, match in (({"max_model_len": 0}, "--max-model-len"),
                       ({"max_model_len": 1}, "--max-model-len must be >= 2"),
                       ({"max_model_len": 64, "size_caches": False},
                        "--max-model-len 64 is shorter than the longest point measured \\(--contexts 128\\)"),
                       ({"time_budget": -1.0}, "--time-budget"),
                       ({"time_budget": 15.0}, "--time-budget must be more than 15 s"),
                       ({"step_timeout": 0.0}, "--step-timeout"), ({"breakdown": [(1, 256)]}, "--breakdown 1x256")):
        with pytest.raises(InputError, match=f"^{match}"):
            BenchOptions(**base, **bad).resolved()


# ---- FLINTC_CACHE_DIR ----------------------------------------------------------------------


@pytest.mark.parametrize("command", [["run", "--prompt-ids", "1", "--max-tokens", "1"], ["serve", "--port", "0"],
                                     ["compile", "--out", "{tmp}/b"]])
@pytest.mark.parametrize("cache, blocker", [("file", "file"), ("file/sub", "file"),
                                            ("cache", "cache/default-tiny-nvfp4-s0")])
def test_cache_dir_errors_name_the_variable(capsys, tmp_path, monkeypatch, command, cache, blocker):
    """The default model is made in $FLINTC_CACHE_DIR: when that is a file, under one, or
    a file holds the default's name there, the error said only "<path>: File exists" (or
    "Not a directory"), not which variable chose the path."""
    (tmp_path / "cache").mkdir()
    cache, blocker = tmp_path / cache, tmp_path / blocker
    for f in (tmp_path / "file", tmp_path / "cache" / "default-tiny-nvfp4-s0"):
        f.write_text("x")
    monkeypatch.setenv("FLINTC_CACHE_DIR", str(cache))
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in command])
    assert_one_line_error(code, err, f"FLINTC_CACHE_DIR={cache}: cannot write the default model there ({blocker} "
                          "is a file, not a folder); set FLINTC_CACHE_DIR to a writable folder, or pass MODEL")
    assert out == "" and not (tmp_path / "b").exists()


def test_unwritable_cache_dir_names_the_variable(capsys, tmp_path, monkeypatch):
    """An unwritable $FLINTC_CACHE_DIR (simulated: the tests may run as root), and an
    unusable default cache folder when FLINTC_CACHE_DIR is unset, which says so."""
    import tempfile

    cache = tmp_path / "cache"
    monkeypatch.setenv("FLINTC_CACHE_DIR", str(cache))

    def denied(prefix=None, dir=None, **kw):
        raise PermissionError(13, "Permission denied", str(dir))

    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkdtemp", denied)
        code, out, err = run_cli(capsys, "run", "--prompt-ids", "1", "--max-tokens", "1")
    assert_one_line_error(code, err, f"FLINTC_CACHE_DIR={cache}: cannot write the default model there ({cache}: "
                          "Permission denied)")
    monkeypatch.delenv("FLINTC_CACHE_DIR")
    (tmp_path / "xdg").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    code, out, err = run_cli(capsys, "run", "--prompt-ids", "1", "--max-tokens", "1")
    assert_one_line_error(code, err, f"the cache folder {tmp_path / 'xdg' / 'flintc'} ($XDG_CACHE_HOME/flintc; "
                          "FLINTC_CACHE_DIR is not set): cannot write the default model there", "set FLINTC_CACHE_DIR")


# ---- a model too large for the CPU's memory -------------------------------------------------


@pytest.fixture
def small_memory(monkeypatch):
    """8 GiB of available memory; and dummy weights of a config over 2e9 parameters fail
    the test at once: a check that does not fire never allocates the full model."""
    import flintc.checkpoint.dummy as dummy
    import flintc.runtime.device as device

    monkeypatch.setattr(device, "available_memory_bytes", lambda: 8 * 2**30)
    real = dummy.dummy_weights

    def guarded(config, fmt="bf16", device="cpu", *args, **kwargs):
        assert config.num_parameters()["total"] < 2e9 or str(device) == "meta", \
            "the memory check did not fire: the full model's weights were about to be made"
        return real(config, fmt, device, *args, **kwargs)

    monkeypatch.setattr(dummy, "dummy_weights", guarded)


_NO_ROOM = "GiB of memory is available on this machine: a CPU run of it would be killed for lack of memory"


_FULL_DUMMY = ["--config", "full", "--load-format", "dummy"]


@pytest.mark.parametrize("args, fmt_gib", [
    (["run", *_FULL_DUMMY, "--device", "cpu", "--prompt-ids", "1"], "bf16 weights take about 73.9 GiB (a run about "
                                                                     "81.3 GiB)"),
    (["run", *_FULL_DUMMY, "--format", "nvfp4", "--prompt-ids", "1"], "nvfp4 weights take about 21.7 GiB"),
    (["compile", *_FULL_DUMMY, "--device", "cpu", "--out", "{tmp}/b"], "bf16 weights take about 73.9 GiB"),
    (["bench", "--device", "cpu", "--out", "{tmp}/o"], "bf16 weights take about 73.9 GiB"),
    (["bench", "--device", "cpu", "--config", "full", "--formats", "nvfp4", "--out", "{tmp}/o"],
     "nvfp4 weights take about 21.7 GiB"),
])
def test_full_model_on_a_cpu_without_the_memory(capsys, tmp_path, small_memory, args, fmt_gib):
    """`flintc run/compile --config full --load-format dummy --device cpu` (and bench on
    the CPU, whose default config is full) started making 74 GiB of weights and got
    killed for lack of memory, without a word. Now the weights' size is checked against
    the available memory first (here 8 GiB, monkeypatched): one line naming the config,
    both sizes, what to do; nothing written."""
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in args])
    assert_one_line_error(code, err, f"the full config: its {fmt_gib}", f"but only 8.0 {_NO_ROOM}",
                          "use a smaller config (--config tiny) or a CUDA GPU (--device cuda)")
    assert out == "" and list(tmp_path.iterdir()) == [] and time.process_time() - t0 < 5


def test_memory_check_passes_the_tiny_model(capsys, tmp_path, small_memory, monkeypatch, tiny_bf16_dir):
    """The tiny config runs with 8 GiB; a checkpoint too large for what is available is
    refused naming its config.json."""
    import flintc.runtime.device as device

    code, out, err = run_cli(capsys, "run", "--config", "tiny", "--load-format", "dummy", "--device", "cpu",
                             "--prompt-ids", "1", "--max-tokens", 1)
    assert code == 0, err
    monkeypatch.setattr(device, "available_memory_bytes", lambda: 2**20)
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1", "--max-tokens", 1)
    assert_one_line_error(code, err, f"the config {Path(tiny_bf16_dir) / 'config.json'}: its bf16 weights take",
                          f"but only 0.0 {_NO_ROOM}")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_checkpoint_of_another_config_is_named_before_the_memory_check(capsys, tmp_path, small_memory, monkeypatch,
                                                                       tiny_bf16_dir, tiny_nvfp4_gguf, fmt):
    """`flintc run lone/model-nvfp4.gguf --hf-config-path FULL` (a tiny GGUF file, the
    full config.json) was refused for memory ("its nvfp4 weights take about 21.7 GiB"),
    as if the file held the full model: the file's headers are checked against the
    config first, so the mismatch is what is named. A checkpoint that matches its
    config is still refused for memory, before any weight is read."""
    import flintc.runtime.device as device
    from flintc.config import FlintConfig

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text(json.dumps(FlintConfig.preset("full").to_dict()))
    model = Path(tiny_bf16_dir if fmt == "bf16" else tiny_nvfp4_gguf)
    first = ("model.layers.0.self_attn.sinks: expected [32] F32, found [8] F32" if fmt == "bf16" else
             "token_embd.weight: expected ne [2048, 151552], found [128, 512]")
    t0 = time.process_time()
    code, out, err = run_cli(capsys, "run", model, "--hf-config-path", tmp_path / "full", "--prompt-ids", "1",
                             "--max-tokens", 1)
    assert_one_line_error(code, err, f"flintc: error: {model}", first, "more)")
    assert "GiB" not in err and out == "" and time.process_time() - t0 < 5
    monkeypatch.setattr(device, "available_memory_bytes", lambda: 2**20)
    code, out, err = run_cli(capsys, "run", model, "--prompt-ids", "1", "--max-tokens", 1)
    config_json = (model if fmt == "bf16" else model.parent) / "config.json"
    assert_one_line_error(code, err, f"the config {config_json}: its {fmt} weights take", f"but only 0.0 {_NO_ROOM}")


def test_check_weights_fit(monkeypatch):
    from flintc.config import FlintConfig
    from flintc.errors import InputError
    from flintc.runtime import device

    full, tiny = FlintConfig.preset("full"), FlintConfig.preset("tiny")
    assert device.available_memory_bytes() > 0
    monkeypatch.setattr(device, "available_memory_bytes", lambda: 22 * 2**30)
    device.check_weights_fit(tiny, "bf16", "cpu")
    for where in ("cuda", "cuda:1", "meta"):  # only the CPU is checked
        device.check_weights_fit(full, "bf16", where)
    with pytest.raises(InputError, match=r"^the full config: its nvfp4 weights take about 21.7 GiB \(a run about "
                                         r"23.8 GiB\), but only 22.0 GiB"):
        device.check_weights_fit(full, "nvfp4", "cpu")  # the weights fit, with the rest of a run they do not
    monkeypatch.setattr(device, "available_memory_bytes", lambda: 24 * 2**30)
    device.check_weights_fit(full, "nvfp4", "cpu")
    monkeypatch.setattr(device, "available_memory_bytes", lambda: None)  # unknown: not checked
    device.check_weights_fit(full, "bf16", "cpu")


# ---- the tokenizer of a build --------------------------------------------------------------


def _compile(out: Path, *source) -> Path:
    """A small BUILD of the tiny model (decode bucket 1, 32 positions, no checks: a few
    seconds on a CPU)."""
    assert main(["compile", *map(str, source), "--out", str(out), "--max-batch", "1", "--max-model-len", "32",
                 "--no-check", "--no-dump", "--device", "cpu", "--backend", "torch"]) == 0
    return out


@pytest.fixture(scope="module")
def moved_build(tmp_path_factory, tiny_bf16_dir):
    """(checkpoint, BUILD): BUILD compiled from a copy of the tiny checkpoint, which was
    then moved to `checkpoint` (build.json still records its old path)."""
    root = tmp_path_factory.mktemp("moved")
    shutil.copytree(tiny_bf16_dir, root / "ckpt")
    build = _compile(root / "build", root / "ckpt")
    (root / "ckpt").rename(root / "moved")
    return root / "moved", build


@pytest.fixture(scope="module")
def dummy_build(tmp_path_factory):
    """A BUILD compiled with dummy weights of the tiny preset (no tokenizer recorded)."""
    return _compile(tmp_path_factory.mktemp("dummy") / "build", "--load-format", "dummy", "--config", "tiny")


@pytest.fixture
def served(monkeypatch):
    """`flintc serve` runs up to uvicorn, which is not started (the socket is closed);
    -> the folders load_tokenizer was called with (by serve or run)."""
    import flintc.checkpoint.tokenizer as tokenizer_module
    import flintc.serve.server as server

    loaded = []
    real = tokenizer_module.load_tokenizer
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda p: loaded.append(Path(p)) or real(p))
    monkeypatch.setattr(server, "serve", lambda app, sock, log_level="info": sock.close())
    return loaded


def _without_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint `src` (same weights) without its tokenizer files."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tokenizer*"))
    return dst


def test_serve_build_looks_for_the_tokenizer_beside_model(capsys, served, moved_build):
    """`flintc serve MODEL --build BUILD` said "no tokenizer found beside the model"
    although MODEL's folder held the tokenizer: only BUILD and the tokenizer folder
    build.json records (moved away with the checkpoint) were looked in."""
    model, build = moved_build
    code, out, err = run_cli(capsys, "serve", model, "--build", build, "--port", 0)
    assert code == 0 and f"flintc serve: '{build}' on http://127.0.0.1:" in err, err
    assert served == [model]


def test_run_build_uses_the_tokenizer_of_model_or_none(capsys, served, tmp_path, moved_build):
    """`flintc run MODEL --build BUILD`: the tokenizer is looked for beside MODEL, then
    where build.json says. MODEL without a tokenizer and the recorded one moved away:
    --prompt-ids ran into "<recorded path>: tokenizer folder not found"; now they run
    without a tokenizer, and --prompt (which needs one) names every place looked in."""
    model, build = moved_build
    code, out, err = run_cli(capsys, "run", model, "--build", build, "--prompt", "hi", "--max-tokens", 1)
    assert code == 0 and served == [model], err
    bare = _without_tokenizer(model, tmp_path / "bare")
    code, out, err = run_cli(capsys, "run", bare, "--build", build, "--prompt-ids", "1,2", "--max-tokens", 1)
    assert code == 0 and served == [model], err
    recorded = json.loads((build / "build.json").read_text())["tokenizer_dir"]
    for command in (["run", bare, "--build", build, "--prompt", "hi"], ["serve", bare, "--build", build, "--port", 0]):
        t0 = time.process_time()
        code, out, err = run_cli(capsys, *command)
        assert_one_line_error(code, err, f"no tokenizer found: no tokenizer.json in {bare} (MODEL), {build} (--build), "
                              f"{recorded} (the tokenizer folder {build / 'build.json'} records)",
                              "pass --tokenizer DIR")
        assert time.process_time() - t0 < 5  # before the weights load


def test_tokenizer_lookup_order(tmp_path):
    """MODEL first, then BUILD, then the tokenizer folder build.json records, then the
    folder of the checkpoint it records; --tokenizer and --hf-config-path before all."""
    import argparse

    from flintc.serve.server import tokenizer_dir

    def folder(name, tokenizer=True):
        (tmp_path / name).mkdir()
        if tokenizer:
            (tmp_path / name / "tokenizer.json").write_text("{}")
        return tmp_path / name

    ckpt, tok, model, bare, hf = folder("ckpt"), folder("tok"), folder("model"), folder("bare", False), folder("hf")
    build = _fake_build(tmp_path / "build", str(ckpt))
    manifest = json.loads((build / "build.json").read_text())
    (build / "build.json").write_text(json.dumps({**manifest, "tokenizer_dir": str(tok)}))

    def ns(**kw):
        return argparse.Namespace(**{"tokenizer": None, "hf_config_path": None, "model": None, "build": build, **kw})

    assert tokenizer_dir(ns(model=model)) == model
    assert tokenizer_dir(ns(model=bare)) == tok
    assert tokenizer_dir(ns()) == tok
    assert tokenizer_dir(ns(model=model, hf_config_path=hf)) == hf
    assert tokenizer_dir(ns(model=model, tokenizer=ckpt)) == ckpt
    (tok / "tokenizer.json").unlink()
    assert tokenizer_dir(ns(model=bare)) == ckpt  # beside the recorded checkpoint
    (ckpt / "tokenizer.json").unlink()
    assert tokenizer_dir(ns(model=bare), required=False) is None
    (build / "tokenizer.json").write_text("{}")
    assert tokenizer_dir(ns(model=bare)) == build


def test_compile_records_the_tokenizer_given(capsys, tmp_path, monkeypatch, tiny_bf16_dir):
    """`flintc compile MODEL --tokenizer DIR` ignored DIR: build.json recorded MODEL's
    tokenizer folder (none here), so `run/serve --build` found none. A DIR without
    tokenizer.json is refused before the compile."""
    import flintc.runtime.build

    seen = []

    def fake_compile(ckpt, out, opts, **kw):
        seen.append(ckpt.tokenizer_dir)
        return {"functions": {}, "compile_seconds": 0.0, "checked": False}

    monkeypatch.setattr(flintc.runtime.build, "compile_model", fake_compile)
    bare = _without_tokenizer(tiny_bf16_dir, tmp_path / "bare")
    code, _, err = run_cli(capsys, "compile", bare, "--tokenizer", tiny_bf16_dir, "--out", tmp_path / "b")
    assert code == 0 and seen == [Path(tiny_bf16_dir)], err
    code, _, err = run_cli(capsys, "compile", tiny_bf16_dir, "--tokenizer", bare, "--out", tmp_path / "b")
    assert_one_line_error(code, err, f"--tokenizer {bare}: no tokenizer.json there")
    assert len(seen) == 1


# ---- a build of dummy weights --------------------------------------------------------------


def test_serve_takes_load_format_dummy_like_run(capsys, served, dummy_build, tiny_bf16_dir):
    """`flintc serve --build B` of a build compiled with --load-format dummy said "no
    tokenizer found", and with --tokenizer "pass --load-format dummy (and the same
    --format)", options serve did not have. Now serve takes --load-format dummy, as
    `flintc run --build B --load-format dummy` does, and both say so before any work."""
    for command in (["serve", "--build", dummy_build, "--tokenizer", tiny_bf16_dir, "--port", 0],
                    ["run", "--build", dummy_build, "--prompt-ids", "1"]):
        t0 = time.process_time()
        code, out, err = run_cli(capsys, *command)
        assert_one_line_error(code, err, f"{dummy_build} was compiled with dummy (random) weights ("
                              f"{dummy_build / 'build.json'} records weight_source dummy:bf16); "
                              "pass --load-format dummy")
        assert out == "" and time.process_time() - t0 < 5
    code, out, err = run_cli(capsys, "serve", "--build", dummy_build, "--load-format", "dummy", "--tokenizer",
                             tiny_bf16_dir, "--port", 0)
    assert code == 0 and f"flintc serve: '{dummy_build}' on http://127.0.0.1:" in err, err
    code, out, err = run_cli(capsys, "run", "--build", dummy_build, "--load-format", "dummy", "--prompt-ids", "1",
                             "--max-tokens", 1)
    assert code == 0, err


@pytest.mark.parametrize("command", ["run", "serve"])
def test_load_format_dummy_must_match_the_build(capsys, command, dummy_build, moved_build, tiny_bf16_dir):
    """Weights that can never match the build's fingerprint are refused up front, saying
    why: dummy weights for a build of a checkpoint's, a checkpoint for a build of dummy
    weights (both said "the weights in ... are not the ones ... (fingerprint differs)"
    after loading them); serve takes --load-format dummy only with --build."""
    model, build = moved_build
    tail = ["--prompt-ids", "1"] if command == "run" else ["--port", "0"]
    cases = [
        ([command, "--build", build, "--load-format", "dummy", *tail],
         [f"--load-format dummy: {build} was compiled with the weights of ", "drop --load-format dummy"]),
        ([command, tiny_bf16_dir, "--build", dummy_build, *tail],
         [f"{dummy_build} was compiled with dummy (random) weights", f"not with the weights of MODEL {tiny_bf16_dir}",
          "drop MODEL and pass --load-format dummy"]),
    ]
    if command == "serve":
        cases.append((["serve", "--load-format", "dummy", "--port", "0"],
                      ["--load-format dummy applies only with --build", "flintc compile --load-format dummy"]))
    for args, needles in cases:
        t0 = time.process_time()
        code, out, err = run_cli(capsys, *args)
        assert_one_line_error(code, err, *needles)
        assert out == "" and time.process_time() - t0 < 5


# ---- a tokenizer of another model -----------------------------------------------------------


def _tokenizer_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint `src` whose tokenizer.json is `edit`ed (a dict, in place)."""
    shutil.copytree(src, dst)
    data = json.loads((dst / "tokenizer.json").read_text("utf-8"))
    edit(data)
    (dst / "tokenizer.json").write_text(json.dumps(data), "utf-8")
    return dst


def _shift_ids(data: dict) -> None:
    """Every id of tokenizer.json + 1000: as many tokens (512), ids from 1000."""
    data["model"]["vocab"] = {k: v + 1000 for k, v in data["model"]["vocab"].items()}
    for t in data["added_tokens"]:
        t["id"] += 1000


@pytest.mark.parametrize("command", ["run", "serve"])
def test_tokenizer_with_ids_beyond_the_vocabulary(capsys, served, tmp_path, tiny_bf16_dir, command):
    """A tokenizer.json whose ids run past config.json's vocab_size (as many tokens as the
    model's, so the count check passed it): `flintc run --prompt hi` blamed the prompt
    ("prompt: token id 1071 is outside the vocabulary [0, 512)"), `flintc serve` started.
    Both refuse it as the tokenizer is paired with the model, naming the tokenizer file
    and config.json's vocab_size."""
    bad = _tokenizer_copy(tiny_bf16_dir, tmp_path / "bad", _shift_ids)
    args = ["run", bad, "--prompt", "hi", "--max-tokens", 1] if command == "run" else ["serve", bad, "--port", 0]
    code, out, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, f"{bad / 'tokenizer.json'}: token ids up to 1",
                          f", but {bad / 'config.json'} has vocab_size 512: expected every id below it")
    assert out == "" and "outside the vocabulary" not in err


def test_build_tokenizer_with_ids_beyond_the_vocabulary(capsys, served, tmp_path, dummy_build, tiny_bf16_dir):
    """The same through a build (`run --build`, `serve --build`, `flintc.load`): the
    model's vocab_size is named from the build's build.json."""
    from flintc.api import load
    from flintc.errors import CheckpointError

    bad = _tokenizer_copy(tiny_bf16_dir, tmp_path / "bad", _shift_ids)
    needles = (f"{bad / 'tokenizer.json'}: token ids up to 1", f", but {dummy_build / 'build.json'} has vocab_size 512")
    for tail in (["run", "--prompt", "hi", "--max-tokens", 1], ["serve", "--port", 0]):
        code, out, err = run_cli(capsys, tail[0], "--build", dummy_build, "--load-format", "dummy",
                                 "--tokenizer", bad, *tail[1:])
        assert_one_line_error(code, err, *needles)
        assert out == ""
    with pytest.raises(CheckpointError) as exc:
        load(dummy_build, load_format="dummy", tokenizer=bad)
    assert all(n in str(exc.value) for n in needles), exc.value


def test_compile_api_refuses_a_tokenizer_with_ids_beyond_the_vocabulary(monkeypatch, tmp_path, tiny_bf16_dir):
    """`flintc.compile` skipped the check: it compiled, and `generate("hi")` then failed
    with "prompt: token id 1071 is outside the vocabulary [0, 512)". Now refused before
    the compile (nothing is written), naming the tokenizer file and config.json, for the
    checkpoint's tokenizer and for one given as `tokenizer=`."""
    import flintc.runtime.build
    from flintc.api import compile as compile_model
    from flintc.errors import CheckpointError

    def never(*a, **k):
        raise AssertionError("compiled with a tokenizer that does not fit the model")

    monkeypatch.setattr(flintc.runtime.build, "compile_model", never)
    bad = _tokenizer_copy(tiny_bf16_dir, tmp_path / "bad", _shift_ids)
    for model, kw in ((bad, {}), (tiny_bf16_dir, {"tokenizer": bad})):
        out = tmp_path / f"build-{len(kw)}"
        with pytest.raises(CheckpointError) as exc:
            compile_model(model, out, device="cpu", backend="torch", check=False, dump=False, **kw)
        assert str(exc.value).startswith(f"{bad / 'tokenizer.json'}: token ids up to 1"), exc.value
        assert f", but {model / 'config.json'} has vocab_size 512: expected every id below it" in str(exc.value)
        assert not out.exists()


def test_compile_cli_refuses_a_tokenizer_with_ids_beyond_the_vocabulary(capsys, monkeypatch, tmp_path,
                                                                        tiny_bf16_dir):
    """`flintc compile` (the command) wrote the build, and `flintc run --build` refused it
    afterwards: refused before the compile, as flintc.compile, for the checkpoint's
    tokenizer and a --tokenizer."""
    import flintc.runtime.build

    def never(*a, **k):
        raise AssertionError("compiled with a tokenizer that does not fit the model")

    monkeypatch.setattr(flintc.runtime.build, "compile_model", never)
    bad = _tokenizer_copy(tiny_bf16_dir, tmp_path / "bad", _shift_ids)
    for model, extra in ((bad, ()), (tiny_bf16_dir, ("--tokenizer", bad))):
        out = tmp_path / f"build-{len(extra)}"
        code, _, err = run_cli(capsys, "compile", model, "--out", out, "--no-check", "--no-dump", *extra)
        assert_one_line_error(code, err, f"{bad / 'tokenizer.json'}: token ids up to 1",
                              f", but {model / 'config.json'} has vocab_size 512: expected every id below it")
        assert not out.exists()


def test_serve_checks_the_tokenizer_before_loading_the_weights(capsys, served, monkeypatch, tmp_path,
                                                                tiny_bf16_dir):
    """`flintc serve` paired the tokenizer with the model once the weights had loaded:
    now from config.json, before any weight is read."""
    import flintc.checkpoint.safetensors_io

    def never(*a, **k):
        raise AssertionError("weights loaded before the tokenizer was checked")

    monkeypatch.setattr(flintc.checkpoint.safetensors_io, "load_bf16", never)
    bad = _tokenizer_copy(tiny_bf16_dir, tmp_path / "bad", _shift_ids)
    code, out, err = run_cli(capsys, "serve", bad, "--port", 0)
    assert_one_line_error(code, err, f"{bad / 'tokenizer.json'}: token ids up to 1",
                          f", but {bad / 'config.json'} has vocab_size 512: expected every id below it")


def test_serve_takes_a_tokenizer_smaller_than_the_model(capsys, served, tmp_path, tiny_bf16_dir):
    """A 512-token --tokenizer with a checkpoint of 1024 embedding rows (a padded
    vocabulary, as vLLM serves): `flintc serve` said "the tokenizer has 512 tokens, the
    model 1024", while `flintc.load` took it; one rule now (`check_fits_model`)."""
    import dataclasses

    from flintc.checkpoint.writer import make_checkpoint
    from flintc.config import FlintConfig

    model = make_checkpoint(dataclasses.replace(FlintConfig.preset("tiny"), vocab_size=1024), "bf16",
                            tmp_path / "padded")
    code, out, err = run_cli(capsys, "serve", model, "--tokenizer", tiny_bf16_dir, "--port", 0)
    assert code == 0 and "flintc serve: " in err, err
    assert served == [tiny_bf16_dir]


@pytest.mark.parametrize("command", ["run", "serve"])
def test_tokenizer_without_its_eos_token_names_the_file(capsys, served, tmp_path, tiny_bf16_dir, command):
    """tokenizer.json with an empty `added_tokens` said "tokenizer has no token for
    eos_token '<|endoftext|>'", naming no file: now the tokenizer file, and
    tokenizer_config.json, where the eos_token comes from."""
    bad = _tokenizer_copy(tiny_bf16_dir, tmp_path / "bad", lambda data: data.update(added_tokens=[]))
    args = ["run", bad, "--prompt", "hi"] if command == "run" else ["serve", bad, "--port", 0]
    t0 = time.process_time()
    code, out, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, f"{bad / 'tokenizer.json'}: no token for eos_token '<|endoftext|>' (the "
                          f"eos_token of {bad / 'tokenizer_config.json'})")
    assert out == "" and time.process_time() - t0 < 5


# ---- verify / dump: --config and --format shape random weights only --------------------------


@pytest.mark.parametrize("command", ["verify", "dump"])
@pytest.mark.parametrize("flag, value", [("--format", "nvfp4"), ("--config", "full"),
                                         ("--format", "bf16")])
def test_graph_commands_refuse_random_weight_flags_with_a_model(capsys, tmp_path, tiny_bf16_dir,
                                                                command, flag, value):
    """With a MODEL, `--config` and `--format` used to be ignored silently (the checkpoint's
    files decide both); now they are refused naming the flag, as `flintc compile` does,
    even when the value matches the checkpoint's."""
    extra = ["--out", str(tmp_path / "dump")] if command == "dump" else []
    code, _, err = run_cli(capsys, command, str(tiny_bf16_dir), flag, value, *extra)
    assert_one_line_error(code, err, f"{flag} {value} applies only without MODEL", "config.json")
    assert not (tmp_path / "dump").exists()


@pytest.mark.parametrize("command", ["verify", "dump"])
def test_graph_commands_refuse_hf_config_path_without_a_model(capsys, tmp_path, command):
    """Without MODEL, `--hf-config-path` was ignored silently: the tiny preset's random
    weights were checked, not the config given. Refused naming the flag, pointing at
    --config."""
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "config.json").write_text("{}")
    extra = ["--out", str(tmp_path / "dump")] if command == "dump" else []
    code, _, err = run_cli(capsys, command, "--hf-config-path", cfg, *extra)
    assert_one_line_error(code, err, f"--hf-config-path {cfg} applies only with a MODEL", "from --config")
    assert not (tmp_path / "dump").exists()


# ---- config values no backend can run ---------------------------------------------------


def _edited_checkpoint(src: Path, dst: Path, **changes) -> Path:
    """A copy of the checkpoint folder `src` with config.json's `changes`."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


@pytest.mark.parametrize("command", [
    ["run", "{m}", "--prompt-ids", "1,2,3", "--max-tokens", "1", "--max-model-len", "64"],
    ["serve", "{m}", "--port", "0", "--max-model-len", "64"],
    ["compile", "{m}", "--out", "{tmp}/b", "--no-check", "--max-model-len", "64"],
    ["verify", "--config", "{m}/config.json", "--step", "decode"],
    ["dump", "--config", "{m}/config.json", "--out", "{tmp}/d"],
    ["bench", "{m}", "--device", "cpu", "--out", "{tmp}/o", "--max-model-len", "64"],
    ["make-checkpoint", "--config", "{m}/config.json", "--out", "{tmp}/c"],
])
@pytest.mark.parametrize("changes, needle", [
    ({"max_position_embeddings": 2**62}, "field 'max_position_embeddings' is 4611686018427387904, more than "
                                         "flintc supports: at most 16777216"),
    ({"sliding_window": 2**62}, "field 'sliding_window' is 4611686018427387904, more than max_position_embeddings "
                                "(4096)"),
])
def test_config_values_no_backend_can_run(capsys, tmp_path, tiny_bf16_dir, command, changes, needle):
    """max_position_embeddings 2**62 was a traceback in the reference model's RoPE tables
    ("Storage size calculation overflowed") on `flintc run` and `serve` even with
    --max-model-len 64; sliding_window 10**9 a 128 GB allocation's traceback on `run`,
    `compile`, `verify`. Every command refuses such a config.json in one line naming the
    file and the field, before any work."""
    model = _edited_checkpoint(tiny_bf16_dir, tmp_path / "m", **changes)
    code, out, err = run_cli(capsys, *[a.format(m=model, tmp=tmp_path) for a in command])
    assert_one_line_error(code, err, f"{model / 'config.json'}: {needle}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_make_checkpoint_refuses_a_vocab_the_tokenizer_cannot_have(capsys, tmp_path, monkeypatch):
    """vocab_size 2**31 in --config's config.json: `flintc make-checkpoint` aborted with
    exit 134 (a Rust panic allocating 72 TB in the BPE trainer) and left its temporary
    folder. Now one line naming the field and the bound, and nothing written (a tokenizer
    built here fails the test instead of allocating)."""
    import flintc.checkpoint.tokenizer as tokenizer
    from flintc.config import PRESETS

    monkeypatch.setattr(tokenizer, "build_tokenizer", lambda n: pytest.fail(f"a tokenizer of {n} tokens"))
    (tmp_path / "v.json").write_text(json.dumps({**PRESETS["tiny"], "vocab_size": 2**31}))
    code, out, err = run_cli(capsys, "make-checkpoint", "--config", tmp_path / "v.json", "--out", tmp_path / "vout")
    assert_one_line_error(code, err, "field 'vocab_size' is 2147483648", "at most 1048576 (2**20")
    assert out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["v.json"]


def test_api_argument_errors_have_a_public_name():
    """The Python API's argument errors are `flintc.api.ApiInputError` (public, documented: an
    InputError and a ValueError), not a private `_ApiInputError` a traceback showed."""
    import flintc.api as api
    from flintc.errors import InputError

    assert issubclass(api.ApiInputError, InputError) and issubclass(api.ApiInputError, ValueError)
    assert "ApiInputError" in api.__doc__ and api.ApiInputError.__doc__
    for bad in ([1.5], [[1, 2]], object()):
        with pytest.raises(InputError) as exc:
            api._token_ids(bad, "generate: prompt")
        assert type(exc.value).__name__ == "ApiInputError" and not type(exc.value).__name__.startswith("_")
