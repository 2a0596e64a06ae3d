"""`flintc verify` and `flintc dump` on tiny."""

from __future__ import annotations

import json
import time

import pytest

from flintc.cli import main


def test_verify_prints_table_and_passes(capsys, tiny_nvfp4_gguf, tmp_path):
    code = main(["verify", str(tiny_nvfp4_gguf), "--step", "decode", "--batch", "2",
                 "--json", str(tmp_path / "v.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "group_low_latency" in out and "mark_pdl" in out and "all passes met" in out
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["passed"] and report["reports"][0]["stages"][-1]["kernels_per_layer"] == {"dense": 6, "moe": 7}


_DECODE = ("canonicalize, fuse_rms_norm, fuse_silu_mul, fuse_qk_norm_rope_kv, fuse_moe, fuse_decode_attention, "
           "lower_gemv, group_low_latency, mark_pdl")
_PREFILL = ("canonicalize, fuse_rms_norm, fuse_silu_mul, fuse_qk_norm_rope_kv, fuse_moe, fuse_prefill_attention, "
            "lower_gemm, fuse_add_rms_norm")


@pytest.mark.parametrize("args, message", [
    (["verify", "--disable", "no_such_pass"],
     f"--disable no_such_pass: not a pass of the decode or prefill pipeline; their passes are {_DECODE}, "
     "fuse_prefill_attention, lower_gemm, fuse_add_rms_norm"),
    (["verify", "--step", "decode", "--disable", "canonicalize", "--disable", "no_such_pass"],
     f"--disable no_such_pass: not a pass of the decode pipeline; its passes are {_DECODE}"),
    (["verify", "--step", "prefill", "--disable", "mark_pdl"],
     f"--disable mark_pdl: not a pass of the prefill pipeline; its passes are {_PREFILL} (mark_pdl is a pass of "
     "the decode pipeline: --step decode)"),
    (["dump", "--out", "{tmp}/d", "--disable", "no_such_pass"],
     f"--disable no_such_pass: not a pass of the decode pipeline; its passes are {_DECODE}"),
    (["dump", "--out", "{tmp}/d", "--step", "prefill", "--disable", "fuse_decode_attention"],
     f"--disable fuse_decode_attention: not a pass of the prefill pipeline; its passes are {_PREFILL} "
     "(fuse_decode_attention is a pass of the decode pipeline: --step decode)"),
    (["verify", "--step", "prefill", "--fold-attention-combine"],
     "--fold-attention-combine applies only to the decode pipeline (its attention); drop it, or pass --step decode"),
    (["dump", "--out", "{tmp}/d", "--step", "prefill", "--split-lm-head-norm"],
     "--split-lm-head-norm / --no-split-lm-head-norm applies only to the decode pipeline (its LM head); drop it, "
     "or pass --step decode"),
    (["verify", "--step", "prefill", "--no-split-lm-head-norm"],
     "--split-lm-head-norm / --no-split-lm-head-norm applies only to the decode pipeline (its LM head); drop it, "
     "or pass --step decode"),
    (["dump", "--out", "{tmp}/d", "--step", "prefill", "--attention-splits", "2"],
     "--attention-splits applies only to the decode pipeline (its attention); drop it, or pass --step decode"),
    # the prefill ran at B=1 with --batch 4, the decode ignored --tokens: silently
    (["verify", "--step", "prefill", "--batch", "4"],
     "--batch 4 applies only to the decode pipeline (the prefill runs at B=1); drop it, or pass --step decode"),
    (["verify", "--step", "decode", "--tokens", "32"],
     "--tokens 32 applies only to the prefill pipeline (tokens per sequence); drop it, or pass --step prefill"),
    (["dump", "--out", "{tmp}/d", "--step", "prefill", "--batch", "2"],
     "--batch 2 applies only to the decode pipeline (the prefill runs at B=1); drop it, or pass --step decode"),
    (["dump", "--out", "{tmp}/d", "--tokens", "8"],
     "--tokens 8 applies only to the prefill pipeline (tokens per sequence); drop it, or pass --step prefill"),
])
def test_pass_flags_are_checked_before_any_output(capsys, tmp_path, args, message):
    """A --disable name that is no pass of the pipeline was refused only when the pipeline
    was built: `flintc verify` had printed its header first (with --step both, a decode pass
    such as mark_pdl after the whole decode table), `flintc dump` had built the model. Now
    the one error line comes first, before any output or work; so it does for the decode
    pass options with --step prefill, which were ignored silently."""
    # this process's CPU time, not wall time: see tests/cli/test_user_errors.py
    t0 = time.process_time()
    code = main([a.format(tmp=tmp_path) for a in args])
    out, err = capsys.readouterr()
    assert (code, out, err) == (2, "", f"flintc: error: {message}\n")
    assert list(tmp_path.iterdir()) == [] and time.process_time() - t0 < 3


def test_verify_split_lm_head_norm(capsys, tmp_path):
    """`flintc verify --split-lm-head-norm` reaches group_low_latency: the decode pipeline
    passes with one kernel more per forward than the default schedule (tiny: 2 dense layers
    of 6 kernels, 2 MoE layers of 7, the embedding and the head, here 2 kernels)."""
    out = tmp_path / "v.json"
    code = main(["verify", "--step", "decode", "--batch", "1", "--cache-len", "8", "--split-lm-head-norm",
                 "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    final = report["reports"][0]["stages"][-1]
    assert report["passed"] and final["name"] == "mark_pdl"
    assert final["kernels_per_layer"] == {"dense": 6, "moe": 7}
    assert final["kernels_per_forward"] == 2 * 6 + 2 * 7 + 1 + 2


def test_verify_both_steps_disable_a_pass_of_one_pipeline(capsys):
    """`--step both --disable mark_pdl`: mark_pdl is skipped in the decode pipeline, which
    has it, and the prefill pipeline runs in full (it failed after the decode table)."""
    code = main(["verify", "--disable", "mark_pdl", "--batch", "1", "--tokens", "4", "--cache-len", "8"])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    decode, prefill = out.split("\n== prefill")
    assert " mark_pdl " not in decode and " group_low_latency " in decode
    assert " fuse_add_rms_norm " in prefill and out.rstrip().endswith("all passes met their expectations")


def test_verify_names_the_disabled_pass_a_later_stage_needs(capsys):
    """`--disable fuse_silu_mul` failed a later stage's legality check ("op aten._to_copy
    is not allowed at this stage") without saying that the disabled pass was why."""
    assert main(["verify", "--disable", "fuse_silu_mul", "--step", "decode", "--batch", "1"]) == 1
    out, err = capsys.readouterr()
    assert err == "", err
    (failed,) = [line for line in out.splitlines() if line.startswith("FAILED: ")]
    assert "is not allowed at this stage" in failed and "(passes disabled: fuse_silu_mul; the later passes" in failed


@pytest.mark.parametrize("args, failed, what", [
    (["--disable", "fuse_rms_norm"], "fuse_qk_norm_rope_kv", "verify"),
    (["--step", "decode", "--disable", "group_low_latency", "--split-lm-head-norm"], "mark_pdl", "legality check"),
])
def test_verify_failed_legality_or_verify_check_keeps_table_and_json(capsys, tmp_path, args, failed, what):
    """Regression: a pass that failed its legality check or its own verify made `flintc
    verify` print only the first header, then the error (exit 2): no per-pass table, no
    --json, and with --step both the prefill step was never checked. Now it is reported as
    a missed numeric expectation is (and as `flintc dump` does): the table with the failed
    pass's row (FAILED and which check), the JSON report with the failure, every step
    checked, exit 1."""
    out = tmp_path / "v.json"
    code = main(["verify", "--batch", "1", "--cache-len", "8", *args, "--json", str(out)]
                + (["--tokens", "4"] if "--step" not in args else []))
    stdout, err = capsys.readouterr()
    assert code == 1 and err == "", err
    steps = ["decode"] if "--step" in args else ["decode", "prefill"]
    assert [line.split(" (")[0] for line in stdout.splitlines() if line.startswith("== ")] == \
        [f"== {s}" for s in steps], stdout
    rows = [line for line in stdout.splitlines() if f"FAILED ({what})" in line]
    assert len(rows) == len(steps) and all(f" {failed} " in r for r in rows), stdout
    assert stdout.count("\nFAILED: ") == len(steps) and stdout.rstrip().endswith("some pass missed its expectation")
    report = json.loads(out.read_text())
    assert report["passed"] is False and [r["step"] for r in report["reports"]] == steps
    for r in report["reports"]:
        assert r["passed"] is False and r["stages"][-1]["name"] == failed
        assert r["stages"][-1]["error"].startswith(f"{what} failed: ")


def test_verify_failed_capture_legality_check_goes_on(capsys, monkeypatch, tmp_path):
    """A captured graph that fails its legality check has no report (no pass ran): verify
    says FAILED with the error, records it in --json and checks the next step."""
    from flintc.graph.spec import GraphLegalityError
    from flintc.passes.manager import PassManager

    real = PassManager.run

    def run(self, graph):
        if graph.step == "decode":
            raise GraphLegalityError("captured graph after capture: broken")
        return real(self, graph)

    monkeypatch.setattr(PassManager, "run", run)
    out = tmp_path / "v.json"
    code = main(["verify", "--batch", "1", "--tokens", "4", "--cache-len", "8", "--json", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 1 and err == "", err
    assert "FAILED: captured graph after capture: broken" in stdout and "== prefill" in stdout
    decode, prefill = json.loads(out.read_text())["reports"]
    assert decode["passed"] is False and decode["error"] == "captured graph after capture: broken"
    assert prefill["passed"] is True


def test_failed_legality_check_is_recorded_in_the_dumps(capsys, monkeypatch, tmp_path):
    """Regression: `FLINTC_DUMP_DIR=d flintc verify --disable lower_gemv` failed the
    legality check after group_low_latency (exit 2), yet d/decode_b1/index.md ended in
    "Overall: passed." and report.json said "passed": true, the table stopping at pass 6.
    Now the failing pass is listed with its error, Overall FAILED, as a numeric failure.
    `flintc dump` removed its temporary folder on any failure, so its dumps were lost; now
    a failed check (a legality check's or a numeric one's) moves the dumps up to the failed
    pass into --out, which say so (tests/cli/test_dump_failed_check.py)."""
    from harness import assert_one_line_error

    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path / "env"))
    args = ["--batch", "1", "--cache-len", "8", "--disable", "lower_gemv"]
    code = main(["verify", "--step", "decode", *args])
    stdout, err = capsys.readouterr()
    message = "lowered graph after pass 'group_low_latency': op aten.index is not allowed at this stage"
    assert code == 1 and err == "" and f"\nFAILED: {message}" in stdout, (err, stdout)
    out = tmp_path / "env" / "decode_b1"
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is False and report["skipped"] == ["lower_gemv"]
    last = report["stages"][-1]
    assert last["name"] == "group_low_latency" and last["error"].startswith(f"legality check failed: {message}")
    index = (out / "index.md").read_text()
    assert f"Pass 7 'group_low_latency' failed: legality check failed: {message}" in index
    assert "Overall: **FAILED**." in index and "Overall: passed" not in index

    monkeypatch.delenv("FLINTC_DUMP_DIR")
    code = main(["dump", "--out", str(tmp_path / "d"), *args])
    _, err = capsys.readouterr()
    error, note = err.splitlines(keepends=True)
    assert_one_line_error(code, error, message)
    assert note.startswith(f"flintc: the dumps of the passes that ran, the failed one last, are in {tmp_path / 'd'} ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "env"]
    report = json.loads((tmp_path / "d" / "report.json").read_text())
    assert report["failed"]["name"] == "group_low_latency" and report["failed"]["reason"] == last["error"]
    assert f"Pass 7 'group_low_latency' failed: legality check failed: {message}" in index


def test_dump_writes_every_stage(capsys, tmp_path):
    out = tmp_path / "dump"
    assert main(["dump", "--out", str(out), "--step", "decode", "--batch", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    names = [s["name"] for s in report["stages"]]
    assert names[0] == "captured" and names[-1] == "mark_pdl"
    for s in report["stages"]:
        assert {"name", "nodes", "kernels_per_forward", "kernels_per_layer", "check"} <= set(s)
        assert s["check"]["passed"]
    index = (out / "index.md").read_text()
    assert "group_low_latency" in index
    files = sorted(p.name for p in out.iterdir())
    assert any(f.startswith("09-mark_pdl") and f.endswith(".onnx") for f in files)
    assert any(f.startswith("00-captured") and f.endswith(".svg") for f in files)


def test_dump_dir_from_environment(monkeypatch, tmp_path):
    from harness import tiny_model

    from flintc.passes.pipeline import compile_step

    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path))
    compile_step(tiny_model(), "prefill", batch=1, tokens=8, cache_len=16, disabled=["fuse_moe"])
    out = tmp_path / "prefill_t8"
    assert (out / "report.json").is_file() and (out / "index.md").is_file()


def test_flintc_dump_dir_keeps_every_step(monkeypatch, tmp_path):
    """Regression: every pipeline dumped into $FLINTC_DUMP_DIR itself, each clearing the
    previous one's stage files and index.md, so only the last step's dumps were left.
    Now one subfolder per step, named as a BUILD's functions; a step run again replaces
    its own subfolder only."""
    from harness import tiny_model

    from flintc.passes.pipeline import compile_step

    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path))
    model = tiny_model()
    for batch in (1, 2):
        compile_step(model, "decode", batch=batch, cache_len=16)
    compile_step(model, "prefill", batch=1, tokens=8, cache_len=16, disabled=["fuse_moe"])
    (tmp_path / "decode_b1" / "01-stale.py").write_text("")  # as if an earlier run wrote it
    compile_step(model, "decode", batch=1, cache_len=16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode_b1", "decode_b2", "prefill_t8"]
    for name, title in (("decode_b1", "decode"), ("decode_b2", "decode"), ("prefill_t8", "prefill")):
        index = (tmp_path / name / "index.md").read_text()
        assert index.startswith(f"# flintc pipeline: {title} step")
        assert json.loads((tmp_path / name / "report.json").read_text())["step"] == title
    assert "mark_pdl" in (tmp_path / "decode_b2" / "index.md").read_text()
    assert not (tmp_path / "decode_b1" / "01-stale.py").exists()


def test_verify_flintc_dump_dir_keeps_both_steps_and_user_files(capsys, monkeypatch, tmp_path):
    """Regression: `flintc verify` (both steps) left only prefill's dumps, and deleted
    the user's own files named like stage files (01-preprocess.py) in the folder."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "01-preprocess.py").write_text("print(1)\n")
    (proj / "99-final-figure.svg").write_text("x\n")
    monkeypatch.setenv("FLINTC_DUMP_DIR", str(proj))
    code = main(["verify", "--batch", "1", "--tokens", "4", "--cache-len", "8"])
    capsys.readouterr()
    assert code == 0
    assert sorted(p.name for p in proj.iterdir()) == ["01-preprocess.py", "99-final-figure.svg", "decode_b1",
                                                      "prefill_t4"]
    assert (proj / "01-preprocess.py").read_text() == "print(1)\n"
    assert (proj / "decode_b1" / "index.md").read_text().startswith("# flintc pipeline: decode step")
    assert (proj / "prefill_t4" / "index.md").read_text().startswith("# flintc pipeline: prefill step")


@pytest.mark.parametrize("api", ["verify", "run", "compile_step", "dump_dir"])
def test_dump_folder_with_foreign_files_is_refused(capsys, monkeypatch, tmp_path, request, api):
    """A dump folder that holds files and is not an earlier dump (no report.json and
    index.md) is refused before any work, naming it: its files matching NN-*.py|svg were
    deleted before. `flintc run` refused a later function's folder (prefill_t8) only after
    compiling and dumping the decode steps, naming `dump_dir`, no option of it."""
    from harness import assert_one_line_error, run_cli, tiny_model

    from flintc.errors import InputError
    from flintc.passes.pipeline import compile_step

    def never(*a, **k):
        raise AssertionError("captured before the dump folder was checked")

    sub = tmp_path / "proj" / ("prefill_t8" if api == "run" else "decode_b1")
    sub.mkdir(parents=True)
    (sub / "01-preprocess.py").write_text("print(1)\n")
    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path / "proj"))
    needle = (f"{sub}: not empty and not the output of an earlier flintc dump (no report.json and index.md)")
    if api == "verify":
        monkeypatch.setattr("flintc.passes.pipeline.compile_step", never)
        code, out, err = run_cli(capsys, "verify", "--step", "decode", "--batch", 1)
        assert_one_line_error(code, err, f"FLINTC_DUMP_DIR={tmp_path / 'proj'}: {needle}",
                              "set FLINTC_DUMP_DIR to another folder")
        assert out == ""
    elif api == "run":
        monkeypatch.setattr("flintc.runtime.build.compile_model", never)
        code, out, err = run_cli(capsys, "run", request.getfixturevalue("tiny_bf16_dir"), "--backend", "torch",
                                 "--max-batch", 1, "--max-tokens", 1, "--prompt", "hi")
        assert_one_line_error(code, err, f"FLINTC_DUMP_DIR={tmp_path / 'proj'}: {needle}",
                              "set FLINTC_DUMP_DIR to another folder")
        assert out == ""
        assert sorted(p.name for p in (tmp_path / "proj").iterdir()) == ["prefill_t8"]
    else:
        monkeypatch.setattr("flintc.passes.pipeline.capture", never)
        kw = {} if api == "compile_step" else {"dump_dir": sub}
        with pytest.raises(InputError, match="not the output of an earlier flintc dump"):
            compile_step(tiny_model(), "decode", batch=1, cache_len=16, **kw)
    assert [p.name for p in sub.iterdir()] == ["01-preprocess.py"]


def test_step_names_tell_prefill_batches_apart():
    """A prefill of two sequences went to the batch-1 step's prefill_t8; a BUILD's
    functions (batch-1 prefills) keep their names."""
    from flintc.passes.pipeline import step_name

    assert step_name("prefill", 1, 8) == "prefill_t8"
    assert step_name("prefill", 2, 8) == "prefill_b2_t8"
    assert step_name("decode", 2) == "decode_b2"


def test_verify_two_targets_keep_both_dumps(capsys, monkeypatch, tmp_path):
    """Regression: `flintc verify --config full` has two targets per step (kernel counts on
    meta weights, numerics on a few layers); both dumped into $FLINTC_DUMP_DIR/decode_b1/,
    the second clearing the first. Now counts/ and numerics/ below it, as `flintc dump`
    names them (`target_subfolder`); two tiny targets stand in for the full config's."""
    from harness import tiny_model

    import flintc.cli.verify as verify
    from flintc.cli.graphs import Target, target_subfolder

    assert [target_subfolder(i, 1) for i in range(1)] == [""]
    assert [target_subfolder(i, 2) for i in range(2)] == ["counts", "numerics"]
    model = tiny_model()
    monkeypatch.setattr(verify, "target_count", lambda args: 2)
    monkeypatch.setattr(verify, "build_targets", lambda args: [Target(model, None, "counts"),
                                                               Target(model, model, "numerics")])
    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path))
    assert main(["verify", "--step", "decode", "--batch", "1", "--cache-len", "16"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "decode_b1").iterdir()) == ["counts", "numerics"]
    for sub in ("counts", "numerics"):
        assert (tmp_path / "decode_b1" / sub / "index.md").read_text().startswith("# flintc pipeline: decode")
    assert json.loads((tmp_path / "decode_b1" / "counts" / "report.json").read_text())["stages"][0]["check"] is None


def test_interrupted_first_dump_is_replaced_next_time(monkeypatch, tmp_path):
    """Regression: a first dump that failed (or was interrupted) while stage 0's files were
    written left .py/.dot/.svg files without index.md and report.json, a folder every
    later run refused as not an earlier dump. Stage 0 now writes those two first."""
    from harness import tiny_model

    import flintc.graph.dump as dump
    from flintc.passes.pipeline import compile_step

    def broken(*a, **k):
        raise RuntimeError("interrupted")

    real = dump.graph_to_onnx
    monkeypatch.setattr(dump, "graph_to_onnx", broken)
    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path))
    model = tiny_model()
    with pytest.raises(RuntimeError, match="interrupted"):
        compile_step(model, "decode", batch=1, cache_len=16)
    out = tmp_path / "decode_b1"
    names = sorted(p.name for p in out.iterdir())
    assert "00-captured.py" in names and "index.md" in names and "report.json" in names
    monkeypatch.setattr(dump, "graph_to_onnx", real)
    compile_step(model, "decode", batch=1, cache_len=16)
    assert "mark_pdl" in (out / "index.md").read_text()


def test_verify_and_dump_record_and_show_the_pass_options(capsys, tmp_path):
    """Regression: `flintc verify --json`'s per-step reports had no pass options (step,
    batch, tokens, checked, passed, skipped, stages), so runs told apart only by
    --split-lm-head-norm / --attention-splits looked the same, and neither command's header
    named them. Now each step's report has `options` (as `flintc dump`'s report.json: those
    given that apply to the step; the prefill of --step both has none) and the header line
    shows them."""
    out = tmp_path / "v.json"
    code = main(["verify", "--batch", "1", "--tokens", "4", "--cache-len", "8", "--split-lm-head-norm",
                 "--attention-splits", "3", "--json", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 0 and err == "", err
    heads = [line for line in stdout.splitlines() if line.startswith("== ")]
    assert heads[0].startswith("== decode (B=1, attention_splits=3, split_lm_head_norm=True) -- "), heads
    assert heads[1].startswith("== prefill (B=1, T=4) -- "), heads
    decode, prefill = json.loads(out.read_text())["reports"]
    assert decode["options"] == {"attention_splits": 3, "split_lm_head_norm": True} and prefill["options"] == {}
    assert list(decode)[:4] == ["step", "batch", "tokens", "options"]

    code = main(["dump", "--out", str(tmp_path / "d"), "--batch", "1", "--cache-len", "8",
                 "--fold-attention-combine", "--attention-splits", "2"])
    stdout, err = capsys.readouterr()
    assert code == 0 and err == "", err
    (head,) = [line for line in stdout.splitlines() if line.startswith("== ")]
    assert head.startswith("== decode (attention_splits=2, fold_attention_combine=True) -- random weights"), head
    assert json.loads((tmp_path / "d" / "report.json").read_text())["options"] == {
        "attention_splits": 2, "fold_attention_combine": True}


@pytest.mark.parametrize("command", [["verify"], ["dump", "--out", "{tmp}/d"]])
def test_more_attention_splits_than_cache_rows_is_refused_before_any_output(capsys, tmp_path, command):
    """Regression: `--attention-splits 1000` with `--cache-len 64` compiled 1000 splits of
    a 64-row full-attention cache (936 empty chunks launched and combined). compile_step
    refuses it, naming both numbers; the commands check it before the first header."""
    from harness import assert_one_line_error

    code = main([a.format(tmp=tmp_path) for a in command] + ["--attention-splits", "1000", "--step", "decode"])
    out, err = capsys.readouterr()
    assert out == "", out
    assert_one_line_error(code, err, "attention_splits 1000 is more than the 64 rows of a full-attention cache")
    assert list(tmp_path.iterdir()) == []
