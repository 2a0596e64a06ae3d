"""`flintc dump` when a pass fails its checks: the dumps up to the failed pass are kept
in --out (they are what one needs to debug it); on an interrupt or any other error,
nothing is left, as before."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flintc.graph.match import find_nodes
from harness import run_cli

aten = torch.ops.aten
ARGS = ("--batch", 1, "--cache-len", 8)


def break_after(monkeypatch, pass_cls, wrong, from_run: int = 1):
    """Make `pass_cls.run` do its work, then `wrong(gm)` (from its `from_run`-th run on)."""
    real = pass_cls.run
    runs = []

    def run(self, gm):
        result = real(self, gm)
        runs.append(1)
        if len(runs) >= from_run:
            wrong(gm)
        return result

    monkeypatch.setattr(pass_cls, "run", run)


def drop_residual_add(gm):
    """A wrong rewrite: layer 1's attention residual add replaced by its input."""
    adds = [n for n in find_nodes(gm, aten.add) if n.meta.get("flintc_layer") == 1
            and n.meta.get("flintc_block") is None and len(n.all_input_nodes) == 2]
    adds[0].replace_all_uses_with(adds[0].args[0])
    gm.graph.eliminate_dead_code()


def assert_error_and_note(code, err, out, *needles):
    """Exit 2, the error line (holding every needle), then one line saying where the dumps are."""
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2 and "Traceback" not in err, err
    assert lines[0].startswith("flintc: error: ") and all(str(n) in lines[0] for n in needles), err
    assert lines[1] == (f"flintc: the dumps of the passes that ran, the failed one last, are in {out} "
                        f"(see {out}/index.md)"), err


def printed_tables(stdout):
    """The per-pass tables `flintc dump` printed: [(header line, [row cells, ...]), ...],
    each row's cells split on the runs of 2+ spaces between the columns (none is empty)."""
    tables = []
    for line in stdout.splitlines():
        if line.startswith("== "):
            tables.append((line, []))
        elif line and not line.startswith("#") and set(line) != {"-", " "}:  # not the column names, nor the rule
            tables[-1][1].append(re.split(r" {2,}", line))
    return tables


OK, MAX_ABS = 8, 9  # the columns of `format_table`: ok, then max_abs


def test_failed_numeric_check_keeps_the_dumps_up_to_the_failed_pass(capsys, monkeypatch, tmp_path):
    """Regression: a pass that missed its numeric expectation made `flintc dump` remove its
    temporary folder, the dumps of that pass and of those before it, the ones needed to see
    what went wrong. Now they are moved into --out, the failed pass's output graph last;
    index.md and report.json name it and say why; the next run replaces them."""
    from flintc.passes.fuse_silu_mul import SiLUMulFusionPass

    out = tmp_path / "d"
    with monkeypatch.context() as m:
        break_after(m, SiLUMulFusionPass, drop_residual_add)
        code, stdout, err = run_cli(capsys, "dump", "--out", out, *ARGS)
    assert_error_and_note(code, err, out, "pass 'fuse_silu_mul' missed its expectation (bit-exact)")
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary folder left
    names = {p.name for p in out.iterdir()}
    for prefix in ("00-captured", "01-canonicalize", "02-fuse_rms_norm", "03-fuse_silu_mul"):
        assert {f"{prefix}.py", f"{prefix}.onnx", f"{prefix}.summary.svg"} <= names, names
    assert not any(n.startswith("04-") for n in names)
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is False and [s["name"] for s in report["stages"]][-1] == "fuse_silu_mul"
    failed = report["failed"]
    assert (failed["index"], failed["name"]) == (3, "fuse_silu_mul")
    assert failed["reason"].startswith("missed its expectation (bit-exact): ") and "max_abs " in failed["reason"]
    assert "first differing node: " in failed["reason"]
    assert report["stages"][-1]["check"]["passed"] is False
    index = (out / "index.md").read_text()
    assert f"\nPass 3 'fuse_silu_mul' {failed['reason']}\n" in index
    assert index.rstrip().endswith("Overall: **FAILED**.")
    # the per-pass table of the passes that ran, as on success (it was not printed), the failed one last
    [(head, rows)] = printed_tables(stdout)
    assert head.startswith("== decode -- random weights") and head.endswith(f" -> {out}"), stdout
    assert [r[:2] for r in rows] == [["0", "captured"], ["1", "canonicalize"], ["2", "fuse_rms_norm"],
                                     ["3", "fuse_silu_mul"]], stdout
    assert [r[OK] for r in rows] == ["yes", "yes", "yes", "FAILED (numeric check)"], stdout
    assert rows[-1][OK - 1] == "bit-exact" and rows[-1][MAX_ABS] == f"{report['stages'][-1]['check']['max_abs']:.3g}"

    code, stdout, err = run_cli(capsys, "dump", "--out", out, *ARGS)  # a partial dump is an earlier dump
    assert code == 0 and err == "", err
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and report["failed"] is None and report["stages"][-1]["name"] == "mark_pdl"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


@pytest.mark.parametrize("failing", ["counts", "numerics"])
def test_two_targets_keep_the_dumps_up_to_the_failed_one(capsys, monkeypatch, tmp_path, failing):
    """The two targets of `--config full` (counts/, numerics/; two tiny ones stand in):
    the partial dumps get index.md and report.json at the top naming the failed target and
    pass, so that the folder is an earlier dump (`is_dump_output`) even when numerics/ was
    never written, and the next run may replace it."""
    from harness import tiny_model

    import flintc.cli.dump as dump
    from flintc.cli.graphs import Target
    from flintc.graph.dump import is_dump_output

    model = tiny_model()
    monkeypatch.setattr(dump, "build_targets", lambda args: [Target(model, None, "counts"),
                                                             Target(model, model, "numerics")])
    out = tmp_path / "d"
    with monkeypatch.context() as m:
        if failing == "counts":  # a legality failure: the only check without a check model
            args = (*ARGS, "--disable", "lower_gemv")
            pass_name, needle = "group_low_latency", "op aten.index is not allowed at this stage"
        else:  # the pass goes wrong in the second target only
            from flintc.passes.fuse_silu_mul import SiLUMulFusionPass

            break_after(m, SiLUMulFusionPass, drop_residual_add, from_run=2)
            args, pass_name, needle = ARGS, "fuse_silu_mul", "missed its expectation"
        code, stdout, err = run_cli(capsys, "dump", "--out", out, *args)
    assert_error_and_note(code, err, out, needle)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
    # the tables of the targets that ran: counts/ complete before numerics/ failed; the failed one
    # up to its failed pass (a legality failure: no numeric columns; counts/ has no check model)
    tables = printed_tables(stdout)
    assert [head for head, _ in tables] == [f"== decode -- {t} -> {out / t}" for t in
                                            ["counts", *(["numerics"] if failing == "numerics" else [])]], stdout
    *complete, (_, rows) = tables
    for _, done in complete:
        assert done[-1][1] == "mark_pdl" and {r[OK] for r in done} == {"-"}, stdout
    assert rows[-1][1] == pass_name and [r[0] for r in rows] == [str(i) for i in range(len(rows))], stdout
    if failing == "counts":
        assert rows[-1][OK:] == ["FAILED (legality check)", "-", "-", "-", "-"], stdout
        assert {r[OK] for r in rows[:-1]} == {"-"}, stdout
    else:
        assert rows[-1][OK] == "FAILED (numeric check)" and {r[OK] for r in rows[:-1]} == {"yes"}, stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["index.md", "report.json", "counts", *(["numerics"] if failing == "numerics" else [])])
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is False and report["failed"]["target"] == failing
    assert f"'{pass_name}'" in report["failed"]["reason"] and needle in report["failed"]["reason"]
    assert json.loads((out / failing / "report.json").read_text())["failed"]["name"] == pass_name
    index = (out / "index.md").read_text()
    assert f"Target `{failing}` (" in index and f"[{failing}/index.md]({failing}/index.md)" in index
    assert is_dump_output(out)

    code, stdout, err = run_cli(capsys, "dump", "--out", out, *ARGS)
    assert code == 0 and err == "", err
    assert sorted(p.name for p in out.iterdir()) == ["counts", "numerics"]


@pytest.mark.parametrize("error", [KeyboardInterrupt, "Terminated", RuntimeError])
def test_interrupt_or_unexpected_error_still_leaves_nothing(capsys, monkeypatch, tmp_path, error):
    """Only a pass's check failure keeps the dumps: Ctrl-C, SIGTERM (Terminated) or an
    error of flintc itself in a pass leaves no --out and no temporary folder (all or
    nothing, as before), and an earlier dump in --out untouched."""
    from flintc.errors import Terminated
    from flintc.passes.fuse_silu_mul import SiLUMulFusionPass

    error = Terminated if error == "Terminated" else error

    def raise_it(gm):
        raise error("in the middle of a pass")

    for earlier in (False, True):
        out = tmp_path / "d"
        if earlier:
            (out).mkdir()
            (out / "index.md").write_text("earlier\n")
            (out / "report.json").write_text("{}\n")
        with monkeypatch.context() as m:
            break_after(m, SiLUMulFusionPass, raise_it)
            if error is RuntimeError:
                with pytest.raises(RuntimeError, match="in the middle of a pass"):
                    run_cli(capsys, "dump", "--out", out, *ARGS)
                code = None
            else:
                code, _, err = run_cli(capsys, "dump", "--out", out, *ARGS)
        if code is not None:
            words = "terminated" if error is Terminated else "interrupted"
            assert (code, err) == (143 if error is Terminated else 130, f"flintc: {words}\n")
        if earlier:
            assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
            assert sorted(p.name for p in out.iterdir()) == ["index.md", "report.json"]
            assert (out / "index.md").read_text() == "earlier\n"
        else:
            assert list(tmp_path.iterdir()) == []


def test_dump_refuses_an_earlier_dump_holding_other_files(capsys, tmp_path):
    """`flintc dump --out` replaces an earlier dump whole: a folder that merely has an
    index.md and a report.json, or a real dump with a user's file beside the stage files,
    lost every other file (a new-user test). Refused, naming them; a dump's own files
    (two targets' subfolders too) are replaced as before."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.md").write_text("# notes")
    (site / "report.json").write_text("{}")
    (site / "thesis.tex").write_text("precious")
    (site / "figs").mkdir()
    code, out, err = run_cli(capsys, "dump", "--out", site)
    assert code == 2 and err.count("\n") == 1 and out == "", err
    assert f"--out {site}: an earlier flintc dump that also holds figs/, thesis.tex, which a dump does not " \
           "write" in err, err
    assert (site / "thesis.tex").read_text() == "precious"
    (site / "thesis.tex").unlink()
    (site / "figs").rmdir()
    for name in ("00-captured.py", "01-canonicalize.summary.svg"):
        (site / name).write_text("old")
    (site / "numerics").mkdir()
    (site / "numerics" / "note.txt").write_text("mine")
    code, _, err = run_cli(capsys, "dump", "--out", site)
    assert code == 2 and "numerics/note.txt" in err, err
    (site / "numerics" / "note.txt").unlink()
    code, _, err = run_cli(capsys, "dump", "--out", site)
    assert code == 0, err
    assert (site / "index.md").read_text() != "# notes" and not (site / "numerics").exists()
