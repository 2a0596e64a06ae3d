"""Debug dumps of a pass pipeline: every stage's graph as code, pictures and ONNX.

`dump_stage(gm, report, ctx, out_dir)` is what `PassManager` calls after the
capture and after every pass. For the stage just appended to `report.stages` it
writes files named `{index:02d}-{name}` so they sort in pipeline order:

* `NN-name.py`: the graph as readable code, one line per node with its dtype and
  shape, grouped under the source line and layer that produced it;
* `NN-name.summary.{dot,svg}`: one box per layer with its kernel count;
* `NN-name.layerI-dense.{dot,svg}`, `NN-name.layerJ-moe.{dot,svg}`: the first
  dense and the first MoE layer of the graph, node by node (`flintc.graph.dump_dot`;
  the SVG is drawn without Graphviz);
* `NN-name.onnx`: the whole graph for Netron, weights as inputs, not embedded
  (`flintc.graph.dump_onnx`);

then rewrites `index.md` (a table of all stages so far, linking their files) and
`report.json` (the config, the step, the pass options and every stage's
`StageReport.as_dict()` plus its `files`). A pass whose graph fails its legality check or its own verify is
dumped too, as a failed stage with its error (`StageReport.error`), as one that missed
its numeric expectation is: index.md says under the table which pass failed and why
(`failure_reason`: the error, or the check's message, max errors and first differing
node), Overall FAILED, and report.json's `failed` holds the same (null: none failed). Stage 0 writes index.md and report.json first too, so an interrupted first dump
is still recognised as an earlier dump. Every file is written atomically (a temporary name, then a
rename), so a reader never sees half a file. Stage 0 starts a new pipeline: it
removes the previous run's stage files (`NN-*.py|onnx|dot|svg`) from `out_dir`, which
must be empty or an earlier dump (`check_dump_dir`): files flintc did not write are
never deleted.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from torch.fx import GraphModule

from flintc.fileio import naming_write_errors
from flintc.graph.dump_dot import layer_graph, layer_views, summary_graph, to_dot, to_svg
from flintc.graph.dump_onnx import graph_to_onnx

DUMP_SUFFIXES = (".py", ".onnx", ".dot", ".svg")
_STAGE_FILE_RE = re.compile(r"^\d{2,}-.+\.(py|onnx|dot|svg)$")


def stage_prefix(stage) -> str:
    """`03-fuse_router_topk`: the stage's index, zero-padded, and its name made safe
    for a file name."""
    return f"{stage.index:02d}-{re.sub(r'[^A-Za-z0-9_-]+', '_', stage.name)}"


def is_dump_output(folder: Path) -> bool:
    """True for a folder an earlier dump wrote: report.json and index.md at its top, or
    in counts/ and numerics/ (the two targets of `flintc dump --config full`)."""
    def one(d: Path) -> bool:
        return (d / "report.json").is_file() and (d / "index.md").is_file()

    return one(folder) or (one(folder / "counts") and one(folder / "numerics"))


DUMP_TARGETS = ("counts", "numerics")  # `flintc dump --config full`'s two subfolders


def foreign_dump_files(folder: Path, targets: bool = True) -> list[str]:
    """The entries of the dump folder `folder` that no dump writes, as paths relative to
    it (a folder's with a trailing slash), sorted: anything but index.md, report.json,
    the stage files (`NN-name....py|onnx|dot|svg`) and, with `targets`, the subfolders
    counts/ and numerics/ (each checked the same way). A dump that replaces `folder`
    whole would delete them (`flintc dump --out`; a BUILD's dumps/).
    Links are foreign (a dump writes none)."""
    out = []
    for p in sorted(Path(folder).iterdir()):
        if p.is_symlink():
            out.append(p.name)
        elif p.is_dir():
            if targets and p.name in DUMP_TARGETS:
                out += [f"{p.name}/{f}" for f in foreign_dump_files(p, targets=False)]
            else:
                out.append(p.name + "/")
        elif p.name not in ("index.md", "report.json") and not _STAGE_FILE_RE.match(p.name):
            out.append(p.name)
    return out


def check_dump_dir(out: str | Path, what: str, fix: str) -> None:
    """Refuse a dump folder whose stage files would be cleared although flintc did not
    write them: one that exists and is neither empty nor an earlier dump.

    Raises:
        InputError: "{what}: not empty and not the output of an earlier flintc dump ...; {fix}"."""
    from flintc.errors import InputError

    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not is_dump_output(out):
        raise InputError(f"{what}: not empty and not the output of an earlier flintc dump (no report.json "
                         f"and index.md), whose files flintc would replace; {fix}")


def dump_stage(gm: GraphModule, report, ctx, out_dir: str | Path) -> list[Path]:
    """Write the dumps of `report.stages[-1]` (the graph `gm`) and refresh the index.

    Args:
        report: the PipelineReport so far; its last stage is the one `gm` is in.
        ctx: the PassContext (config, step and shapes).
        out_dir: the dump folder, created if missing.

    Returns:
        The paths written for this stage, index.md and report.json last.

    A failed stage (`stage.error`: its graph failed its legality check or verify) gets
    index.md and report.json written even when one of its views fails to write (an illegal
    graph may not convert): the index records the failure, not "Overall: passed", and the
    view's error goes on up (the pass manager raises the pass's own error from it).
    """
    out = Path(out_dir)
    stage = report.stages[-1]
    if stage.index == 0:
        check_dump_dir(out, f"dump folder {out}", "choose another dump folder")
    out.mkdir(parents=True, exist_ok=True)
    if stage.index == 0:
        _clear_stage_files(out)
        # index.md and report.json first (no files listed yet), so that a dump interrupted
        # or failing while stage 0's files are written is still an earlier dump
        # (`is_dump_output`), which the next run replaces, not a folder it refuses
        _write_index(report, ctx, out)
    try:
        written = _write_stage_files(gm, stage, ctx, out)
    except BaseException:
        if stage.error:  # the failure is recorded even so (the index would say "Overall: passed")
            _write_index(report, ctx, out)
        raise
    written.extend(_write_index(report, ctx, out))
    return written


def _write_stage_files(gm: GraphModule, stage, ctx, out: Path) -> list[Path]:
    """Write `stage`'s .py, its dot/svg views and its ONNX into `out`; the paths."""
    prefix = stage_prefix(stage)
    title = (f"{prefix} ({stage.stage}): {ctx.step} B={ctx.batch} T={ctx.tokens}, "
             f"{stage.kernels.per_forward} kernels per forward")
    written = [_write(out / f"{prefix}.py", readable_code(gm, stage, ctx))]
    views = [("summary", summary_graph(ctx.config, stage.kernels, title))]
    for view, layer in layer_views(gm, ctx.config):
        views.append((view, layer_graph(gm, layer, f"{prefix}: {view}")))
    for view, g in views:
        written.append(_write(out / f"{prefix}.{view}.dot", to_dot(g)))
        written.append(_write(out / f"{prefix}.{view}.svg", to_svg(g)))
    model = graph_to_onnx(gm, name=prefix, doc=title)
    written.append(_write(out / f"{prefix}.onnx", model.SerializeToString()))
    return written


def _write_index(report, ctx, out: Path) -> list[Path]:
    """(Re)write index.md and report.json for the stages so far and the files in `out`."""
    index = _write(out / "index.md", index_markdown(report, ctx, out))
    report_json = json.dumps(report_dict(report, ctx, out), indent=2) + "\n"
    return [index, _write(out / "report.json", report_json)]


def readable_code(gm: GraphModule, stage, ctx) -> str:
    """`gm` as Python (FX's `print_readable`, dtype and shape on every line, each group
    of lines under its source line and layer), after a header naming the stage."""
    k = stage.kernels
    header = [
        f"# flintc stage {stage.index} '{stage.name}' ({stage.stage}): {ctx.step} step, "
        f"B={ctx.batch} T={ctx.tokens} cache_len={ctx.cache_len} weights={ctx.weight_format}",
        f"# {stage.nodes} op nodes; {k.per_forward} kernels per forward; per layer kind: "
        + (", ".join(f"{kind} {n}" for kind, n in k.per_kind.items()) or "none"),
        f"# check: {_check_line(stage.check)}",
        *([f"# FAILED: {stage.error}"] if stage.error else []),
        "",
    ]
    code = gm.print_readable(print_output=False, additional_meta=["flintc_layer", "flintc_block"])
    code = re.sub(r"^class <lambda>\(", "class FlintcGraph(", code)  # make_fx names it <lambda>
    return "\n".join(header) + code.rstrip() + "\n"


def _check_line(check) -> str:
    if check is None:
        return "none ran"
    verdict = "passed" if check.passed else f"FAILED ({check.message})"
    return (f"{check.expected}, {verdict}, max_abs {check.max_abs:.3g}, "
            f"max_rel {check.max_rel:.3g}, "
            f"share differing {check.share_differing:.3g}")


def stage_files(out: Path, stage) -> list[str]:
    """The dump files of `stage` in `out`, in a fixed order: .py, views, .onnx."""
    prefix = stage_prefix(stage)
    names = [p.name for p in out.glob(f"{prefix}.*") if p.suffix in DUMP_SUFFIXES]
    order = {".py": 0, ".svg": 1, ".dot": 2, ".onnx": 3}
    return sorted(names, key=lambda n: (n.endswith(".onnx"), Path(n).stem, order[Path(n).suffix]))


def report_dict(report, ctx, out: Path) -> dict:
    """report.json's content: the config, the step, the pipeline's pass options
    (`PassContext.options`: `attention_splits`, `fold_attention_combine`,
    `split_lm_head_norm`, as the caller set them; {} for none), and one dict per stage
    (`StageReport.as_dict()` plus `files`); infinities and NaNs as strings."""
    stages = [{**s.as_dict(), "files": stage_files(out, s)} for s in report.stages]
    failed = next((s for s in report.stages if not s.passed), None)
    data = {"config": ctx.config.to_dict(), "step": report.step, "batch": report.batch,
            "tokens": report.tokens, "cache_len": ctx.cache_len, "weight_format": ctx.weight_format,
            "options": dict(ctx.options),
            "passed": report.passed, "skipped": list(report.skipped),
            "failed": None if failed is None else {"index": failed.index, "name": failed.name,
                                                   "reason": failure_reason(failed)},
            "stages": stages}
    return _json_safe(data)


def failure_reason(stage) -> str | None:
    """Why `stage` failed, in one line: its legality or verify error (`stage.error`), or
    its missed numeric expectation (the check's message, max errors and first differing
    node); None for a stage that passed. The pipeline stops at the first failed stage."""
    if stage.error:
        return stage.error
    ch = stage.check
    if ch is None or ch.passed:
        return None
    return (f"missed its expectation ({ch.expected}): {ch.message}; max_abs {ch.max_abs:.3g}, "
            f"max_rel {ch.max_rel:.3g}; first differing node: {ch.first_differing_node or 'none found'}")


def _json_safe(x):
    """Strict JSON has no inf or NaN: write them as "inf", "-inf", "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


_COLUMNS = ("#", "pass", "stage", "nodes", "kernels/forward", "dense layer", "moe layer",
            "expected", "passed", "max_abs", "max_rel", "share differing", "experts agree", "files")


def index_markdown(report, ctx, out: Path) -> str:
    """index.md: one table row per stage so far, with links to its files."""
    c = ctx.config
    lines = [
        f"# flintc pipeline: {report.step} step",
        "",
        f"B={report.batch}, T={report.tokens}, cache_len={ctx.cache_len}, "
        f"weights={ctx.weight_format}; "
        f"{c.num_hidden_layers} layers ({c.first_k_dense_replace} dense), "
        f"{c.n_routed_experts} experts top-{c.num_experts_per_tok}, hidden {c.hidden_size}. "
        f"Kernel columns: launches of one forward, and of the most expensive layer of each kind.",
        "",
        "| " + " | ".join(_COLUMNS) + " |",
        "|" + "|".join("---" for _ in _COLUMNS) + "|",
    ]
    for s in report.stages:
        ch = s.check
        check_cells = ["-", "**NO**" if s.error else "-", *["-"] * 4] if ch is None else [
            ch.expected, "yes" if ch.passed else "**NO**", f"{ch.max_abs:.3g}", f"{ch.max_rel:.3g}",
            f"{ch.share_differing:.3g}",
            "-" if ch.experts_agree is None else f"{ch.experts_agree:.1%}"]
        links = " ".join(f"[{_link_label(s, f)}]({f})" for f in stage_files(out, s))
        kinds = [str(s.kernels.per_kind.get(kind, "-")) for kind in ("dense", "moe")]
        row = [str(s.index), s.name, s.stage, str(s.nodes), str(s.kernels.per_forward), *kinds,
               *check_cells, links]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    lines.append("")
    for s in report.stages:
        reason = failure_reason(s)
        if reason is None:
            continue
        if s.error:  # a legality or verify failure: the pipeline stopped there
            lines.append(f"Pass {s.index} '{s.name}' failed: {reason}")
        else:  # a missed numeric expectation: so did it
            lines.append(f"Pass {s.index} '{s.name}' {reason}")
        lines.append("")
    lines.append(f"Overall: {'passed' if report.passed else '**FAILED**'}.")
    if report.skipped:
        lines.append(f"Skipped passes: {', '.join(report.skipped)}.")
    return "\n".join(lines) + "\n"


def _link_label(stage, file_name: str) -> str:
    return file_name[len(stage_prefix(stage)) + 1:]


def _write(path: Path, content: str | bytes) -> Path:
    """Write `content` to `path` atomically: a temporary file beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = content.encode() if isinstance(content, str) else content
    try:
        with naming_write_errors(path), open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _clear_stage_files(out: Path) -> None:
    """Remove a previous pipeline's stage files, so index.md links only this run's."""
    for p in out.iterdir():
        if p.is_file() and _STAGE_FILE_RE.match(p.name):
            p.unlink()
