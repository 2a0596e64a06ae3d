"""`flintc verify` and `flintc dump` on tiny."""

from __future__ import annotations

import json

from flintc.cli import main


def test_verify_prints_table_and_passes(capsys, tiny_nvfp4_gguf, tmp_path):
    code = main(["verify", str(tiny_nvfp4_gguf), "--step", "decode", "--batch", "2",
                 "--json", str(tmp_path / "v.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "group_low_latency" in out and "mark_pdl" in out and "all passes met" in out
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["passed"] and report["reports"][0]["stages"][-1]["kernels_per_layer"] == {"dense": 6, "moe": 7}


def test_verify_unknown_pass_is_a_clean_error(capsys):
    assert main(["verify", "--disable", "no_such_pass", "--step", "decode"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flintc: error:") and "no_such_pass" in err


def test_verify_names_the_disabled_pass_a_later_stage_needs(capsys):
    """`--disable fuse_silu_mul` failed a later stage's legality check ("op aten._to_copy
    is not allowed at this stage") without saying that the disabled pass was why."""
    assert main(["verify", "--disable", "fuse_silu_mul", "--step", "decode", "--batch", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flintc: error:") and err.count("\n") == 1, err
    assert "is not allowed at this stage" in err and "(passes disabled: fuse_silu_mul; the later passes" in err, err


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
    assert (tmp_path / "report.json").is_file() and (tmp_path / "index.md").is_file()
