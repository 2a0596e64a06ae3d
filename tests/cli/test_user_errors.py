"""Papercuts of a new-user review: each a one-line error (exit 2, no traceback) that names
the file or option at fault and says what to do, before any work.

- A build whose checkpoint was moved or deleted after `flintc compile`: the error names
  the build's build.json (where the path comes from) and the path, and says to pass the
  checkpoint as MODEL or to recompile.
- `--config bogus`: the error lists the presets, and says when a config.json path is
  accepted too.
- An empty output path (`--out ""`, `--json ""`, ...) is refused naming the option; it
  used to mean the current folder.

None compiles a build: the build here is a build.json written by hand, which is all a
build's loader reads before the weights."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from flintc.cli import main


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    assert err.startswith("flintc: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert str(n) in err, (n, err)


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
    t0 = time.perf_counter()
    code, out, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, build / "build.json", f"records the checkpoint {moved}", "no longer exists",
                          "pass the checkpoint as MODEL", "recompile with flintc compile")
    assert out == "" and time.perf_counter() - t0 < 5


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


def test_recorded_weight_source():
    from flintc.errors import InputError
    from flintc.runtime.compiled import recorded_weight_source

    assert recorded_weight_source("b", {"weight_source": "dummy:bf16"}) == "dummy:bf16"
    here = str(Path(__file__).resolve().parent)
    assert recorded_weight_source("b", {"weight_source": here}) == here
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
    t0 = time.perf_counter()
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in args])
    assert_one_line_error(code, err, *needles)
    assert out == "" and list(tmp_path.iterdir()) == [] and time.perf_counter() - t0 < 5


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
    t0 = time.perf_counter()
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path, ckpt=tiny_bf16_dir) for a in args])
    assert_one_line_error(code, err, f"{flag} must not be empty")
    assert out == "" and list(tmp_path.iterdir()) == [] and time.perf_counter() - t0 < 5


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
