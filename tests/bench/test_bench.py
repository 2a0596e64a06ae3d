"""`flintc bench` (issue 8): the roofline model against the real weight tensors, the
timing and breakdown helpers on synthetic inputs, the targets' evaluation, and one
CPU run of the whole command on the tiny model (CI's twin of the H200 run: same code
paths except CUDA graphs, the profiler and the compile baseline), checking that its
files are written and its figures are positive and consistent with the build's plan.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from flintc.bench import instrument, report, roofline, timing
from flintc.checkpoint.dummy import dummy_weights
from flintc.cli import main
from flintc.config import FlintConfig
from flintc.quant.nvfp4 import NVFP4Tensor

TINY = FlintConfig.preset("tiny")
FULL = FlintConfig.preset("full")


def storage_bytes(w) -> int:
    if isinstance(w, NVFP4Tensor):
        return sum(t.numel() * t.element_size() for t in (w.codes, w.scales, w.global_scale))
    return w.numel() * w.element_size()


# -- roofline ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_weight_bytes_equal_the_tensors(fmt):
    """All experts and every embedding row: the formula must equal the bytes the dummy
    loader's tensors actually occupy, part by part."""
    w = dummy_weights(TINY, fmt, "cpu", seed=3)
    wb = roofline.weight_bytes(TINY, fmt, TINY.n_routed_experts, TINY.vocab_size)
    actual = sum(storage_bytes(t) for t in w.values())
    assert wb.total == actual, (wb.as_dict(), actual)
    experts = sum(storage_bytes(t) for n, t in w.items() if ".mlp.experts." in n)
    assert wb.routed_experts == experts
    assert wb.embedding == storage_bytes(w["model.embed_tokens.weight"])
    assert wb.lm_head == storage_bytes(w["lm_head.weight"]) + storage_bytes(w["model.norm.weight"])
    moe_layers = len(roofline.moe_layers(TINY))
    assert wb.per_expert * TINY.n_routed_experts * moe_layers == experts


def test_weight_bytes_count_only_selected_experts_and_rows():
    full = roofline.weight_bytes(TINY, "bf16", TINY.n_routed_experts, TINY.vocab_size)
    six = roofline.weight_bytes(TINY, "bf16", 6, 1)
    per_layer = {i: (3 if i == 2 else 6) for i in roofline.moe_layers(TINY)}
    mixed = roofline.weight_bytes(TINY, "bf16", per_layer, 1)
    assert six.layers_dense == full.layers_dense and six.lm_head == full.lm_head
    assert six.routed_experts == 6 * len(roofline.moe_layers(TINY)) * six.per_expert
    assert mixed.routed_experts == six.routed_experts - 3 * six.per_expert
    assert six.embedding == full.embedding // TINY.vocab_size
    with pytest.raises(ValueError, match="experts_read"):
        roofline.weight_bytes(TINY, "bf16", TINY.n_routed_experts + 1, 1)
    with pytest.raises(ValueError, match="fmt"):
        roofline.weight_bytes(TINY, "fp8", 6, 1)


def test_full_model_bytes_match_flint_spec():
    """FLINT_SPEC 1: ~2.11e9 active parameters in the layers + 0.31e9 in the LM head per
    token; 28 KiB of full-attention KV per token; NOTES: 2.87 GB of KV at 100K."""
    wb = roofline.weight_bytes(FULL, "bf16", FULL.num_experts_per_tok, 1)
    params = (wb.total - wb.embedding) / 2  # bf16 linears; norms are fp32 but tiny
    assert abs(params - (2.11e9 + 0.31e9)) / 2.42e9 < 0.01, params
    nv = roofline.weight_bytes(FULL, "nvfp4", FULL.num_experts_per_tok, 1)
    assert 0.25 < nv.total / wb.total < 0.45  # 4.5-bit linears, bf16 LM head
    kv = roofline.kv_bytes_read(FULL, 100000)
    assert kv == 14 * 100000 * 2048 + 35 * 513 * 2048  # K and V, 4 heads x 128 x bf16 per row
    assert abs(14 * 100000 * 2048 - 2.87e9) < 0.01e9
    r = roofline.decode_roofline(FULL, "bf16", [100000], 6, 4250.0, 790.0)
    assert r["bound"] == "bytes" and r["ms"] == pytest.approx((wb.total + kv) / 4250e9 * 1e3)


def test_prefill_flops_against_a_loop():
    cfg = TINY
    T = 23  # > W = 9: the sliding window caps the keys
    p = cfg.num_parameters()
    pairs = 0
    for i in range(cfg.num_hidden_layers):
        for pos in range(T):
            keys = min(pos + 1, cfg.sliding_window) if cfg.is_sliding_layer(i) else pos + 1
            pairs += keys
    expect = 2 * p["active_layers"] * T + 2 * p["active_lm_head"] + 4 * cfg.num_attention_heads * cfg.head_dim * pairs
    assert roofline.prefill_flops(cfg, T) == expect
    r = roofline.prefill_roofline(cfg, "nvfp4", T, 100.0, 1.0)
    assert r["ms"] == max(r["flops_ms"], r["bytes_ms"]) > 0


# -- timing and instrumentation helpers ------------------------------------------------------
def test_host_timers_measure_the_call():
    cpu = torch.device("cpu")
    seen = []
    r = timing.time_replays(lambda: time.sleep(0.004), seen.append, cpu, warmup=1, iters=3)
    assert seen == [0, 1, 2, 3], "prepare runs before every call with its index"
    assert 0.003 < r["median_s"] < 0.2 and r["iters"] == 3
    h = timing.time_host(lambda i: time.sleep(0.002), cpu, warmup=0, iters=2)
    assert 0.0015 < h["median_s"] < 0.2
    with pytest.raises(ValueError, match="iters"):
        timing.time_host(lambda i: None, cpu, warmup=0, iters=0)


def test_step_timeout_interrupts():
    with pytest.raises(timing.StepTimeout), timing.step_timeout(0.05):
        time.sleep(2)
    with timing.step_timeout(None):
        time.sleep(0.001)


def test_ceilings_on_cpu_are_positive():
    assert timing.copy_bandwidth_gbs(torch.device("cpu"), nbytes=1 << 20, iters=3) > 0
    assert timing.matmul_tflops(torch.device("cpu"), n=64, iters=3) > 0


def test_critical_path_with_overlapping_kernels():
    # k1 0-10; k2 starts early (PDL) at 5, ends 14; k3 after an idle gap 20-30
    ks = [{"name": "a", "start_us": 0.0, "end_us": 10.0}, {"name": "b", "start_us": 5.0, "end_us": 14.0},
          {"name": "c", "start_us": 20.0, "end_us": 30.0}]
    charges, gaps = instrument.critical_path(ks)
    assert charges == [10.0, 4.0, 10.0] and gaps == [0.0, 0.0, 6.0]
    assert sum(charges) + sum(gaps) == ks[-1]["end_us"] - ks[0]["start_us"]


def test_breakdown_matches_launches_and_takes_medians():
    launches = [{"op": "embedding", "layer": -1}, {"op": "gemv", "layer": 0}, {"op": "gemv", "layer": 1}]
    def replay(t0, d):
        return [{"name": f"k{i}", "start_us": t0 + sum(d[:i]), "end_us": t0 + sum(d[:i + 1])} for i in range(3)]
    reps = [replay(0, [1, 2, 3]), replay(100, [1, 4, 5]), replay(200, [1, 2, 7])]
    bd = instrument.breakdown_from_kernels(reps, launches)
    assert bd["matched_to_plan"] and bd["kernels"] == 3
    ops = {o["op"]: o for o in bd["ops"]}
    assert ops["gemv"]["calls"] == 2 and ops["gemv"]["us"] == pytest.approx(2 + 5)  # medians per kernel
    assert ops["gemv"]["per_layer"] == {"0": 2.0, "1": 5.0}
    assert bd["ops"][0]["op"] == "gemv", "largest first"
    assert sum(o["us"] for o in bd["ops"]) == pytest.approx(bd["kernel_us"])
    unmatched = instrument.breakdown_from_kernels(reps, launches[:2])
    assert not unmatched["matched_to_plan"] and {o["op"] for o in unmatched["ops"]} == {"k0", "k1", "k2"}
    assert instrument.split_replays(reps[0] + reps[1], 3) == reps[:2]
    with pytest.raises(ValueError):
        instrument.split_replays(reps[0], 2)


# -- targets and merging ---------------------------------------------------------------------
def _fake_results(device="cuda:0"):
    meta = {"date": "d", "device": device, "full_model": True, "command": "c"}
    dec = [{"engine": "flintc", "fmt": "nvfp4", "batch": 1, "context": 100000, "fwd_ms": 1.5, "e2e_ms": 1.7,
            "peak_gib": 30.0, "fwd_roofline_share": 0.8},
           {"engine": "flintc", "fmt": "bf16", "batch": 1, "context": 1024, "fwd_ms": 1.2, "e2e_ms": 1.4}]
    base = [{"engine": "compile", "fmt": "bf16", "batch": 1, "context": 1024, "fwd_ms": 4.5, "e2e_ms": 4.9}]
    bd = [{"fmt": "nvfp4", "batch": 1, "context": 100000, "gap_us": 12.0, "step_us": 1500.0,
           "ops": [{"op": "decode_attention", "us": 700.0, "share": 0.5}, {"op": "moe", "us": 500.0, "share": 0.4}]}]
    return {"meta": meta, "ceilings": {"copy_gbs": 4250.0}, "decode": dec, "baselines": base, "breakdown": bd,
            "prefill": [], "kernels": [{"fmt": "bf16", "function": "decode_b1", "measured": 343}], "notes": []}


def test_targets_are_judged_with_margins():
    t = {x["key"]: x for x in report.evaluate_targets(_fake_results())}
    assert t["nvfp4_fwd_b1_100k"]["met"] is False
    assert t["nvfp4_fwd_b1_100k"]["by"].startswith("0.15 ms over (11%)")
    assert "decode_attention 700 us" in t["nvfp4_fwd_b1_100k"]["points_to"]
    assert t["nvfp4_peak_b1_262k"]["measured"] is None and t["nvfp4_peak_b1_262k"]["by"] == "not measured"
    assert t["bf16_e2e_b1_1k"]["met"] is True
    assert t["bf16_kernels"]["met"] is True and t["nvfp4_kernels"]["measured"] is None
    sp = t["bf16_vs_compile_b1_1k"]
    assert sp["measured"] == pytest.approx(4.9 / 1.4) and sp["met"] is True
    assert report.evaluate_targets(_fake_results(device="cpu")) == [], "targets are the GPU's"


def test_prefill_target_points_to_the_prefill_breakdown():
    """A missed prefill target names the largest kernels of the breakdown of its own
    length, also when a shorter prefill's breakdown comes after it (a merge keeps the
    first position of a key)."""
    res = {"meta": {"full_model": True, "device": "cuda"},
           "prefill": [{"engine": "flintc", "fmt": "bf16", "tokens": 8192, "ms": 2400.0}],
           "prefill_breakdown": [{"fmt": "bf16", "tokens": 8192, "gap_us": 5000.0, "ops": [
               {"op": "flash_kernel", "us": 1.5e6, "share": 0.6}, {"op": "moe", "us": 5e5, "share": 0.2}]},
               {"fmt": "bf16", "tokens": 1024, "gap_us": 1.0, "ops": [{"op": "other", "us": 1.0, "share": 1.0}]}]}
    [t] = [t for t in report.evaluate_targets(res) if t["key"] == "bf16_prefill_8192"]
    assert t["met"] is False
    assert t["points_to"] == "prefill 8192 tokens: flash_kernel 1500.0 ms (60%), moe 500.0 ms (20%); gaps 5.0 ms"


def test_merge_keeps_the_later_record():
    a, b = _fake_results(), _fake_results()
    b["decode"] = [dict(a["decode"][0], fwd_ms=1.0)]
    b["baselines"] = [{"engine": "compile", "fmt": "bf16", "batch": 8, "context": 1024, "e2e_ms": 10.0}]
    m = report.merge_results([a, b])
    assert report.find(m["decode"], fmt="nvfp4", batch=1)["fwd_ms"] == 1.0
    assert len(m["decode"]) == 2 and len(m["baselines"]) == 2 and len(m["meta"]["runs"]) == 2


def test_merged_rows_name_their_run():
    """Each merged row carries the number of the run it comes from (the report's "run"
    column, matching the header's "Run i" lines), also through a re-merge; one run has
    no such column; prefill rows show their calls ("2 x 2048 + 1 x 512")."""
    a, b, c = _fake_results(), _fake_results(), _fake_results()
    full = {"roofline_ms": 1.0, "fwd_roofline_share": 0.5, "e2e_roofline_share": 0.4,
            "distinct_experts": {"mean": 6}, "roofline": {"bytes": 1e9}, "kernels_measured": 343,
            "kernels_plan": 343, "peak_gib": 30.0}
    for r in (a, b, c):
        r["decode"] = [dict(d, **full) for d in r["decode"]]
        r["breakdown"] = []
    b["decode"] = [dict(a["decode"][0], fwd_ms=1.0)]  # replaces a's nvfp4 b1 row
    c["decode"] = [dict(a["decode"][1], fwd_ms=2.0)]
    pre = {"engine": "flintc", "fmt": "bf16", "tokens": 4700, "ms": 300.0, "min_ms": 290.0, "tokens_per_s": 1.0,
           "chunk": 2048, "pieces": [2048, 2048, 512, 512], "roofline": {"bound": "flops"}, "roofline_ms": 30.0,
           "roofline_share": 0.1}
    old = dict(pre, tokens=1024, pieces=None, chunk=512)  # a run before pieces were recorded
    c["prefill"] = [pre, old]
    ab = report.merge_results([a, b])
    assert sorted(r["run"] for r in ab["decode"]) == [1, 2]
    m = report.merge_results([ab, c])
    assert len(m["meta"]["runs"]) == 3
    runs = {(r["fmt"], r["batch"]): r["run"] for r in m["decode"]}
    assert runs[(a["decode"][0]["fmt"], a["decode"][0]["batch"])] == 2
    assert runs[(a["decode"][1]["fmt"], a["decode"][1]["batch"])] == 3
    md = report.render_markdown(m)
    assert "| run |" in md.split("## Decode step")[1].split("\n\n")[2]
    # each run's line names its flintc and commit (the header holds the first run's only)
    m["meta"]["runs"][2] = dict(m["meta"]["runs"][2], flintc="0.1.0", flintc_commit="abcdef012345")
    assert "  - Run 3: " in report.render_markdown(m)
    assert "flintc 0.1.0 (commit abcdef012345); " in report.render_markdown(m).split("  - Run 3: ")[1]
    assert "| 2 x 2048 + 2 x 512 |" in md and "| 2 x 512 |" in md
    a["ceilings"]["matmul_tflops"] = 790.0
    assert "| run |" not in report.render_markdown(a)


# -- the command on the CPU ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16", "--contexts", "64",
                 "--batches", "1,2", "--prefill", "16", "--baselines", "eager", "--out", str(out),
                 "--builds", str(out / "builds")])
    assert code == 0
    return out, json.loads((out / "bench.json").read_text())


def _copy_build(cpu_run, tmp_path, name: str = "tiny-bf16") -> Path:
    """A --builds folder in tmp_path holding a copy of the fixture's build, named `name`."""
    import shutil

    out, _ = cpu_run
    builds = tmp_path / "builds"
    shutil.copytree(out / "builds" / "tiny-bf16", builds / name)
    return builds


def _bench_on_builds(builds, formats: str = "bf16") -> list[str]:
    """bench arguments measuring batch 1 context 64 of `formats` on the builds there are
    in `builds` (--no-compile), no baseline, no plots; --out to be added."""
    return ["bench", "--config", "tiny", "--device", "cpu", "--formats", formats, "--contexts", "64",
            "--batches", "1", "--prefill", "none", "--baselines", "none", "--no-compile", "--no-plots",
            "--builds", str(builds)]


def test_cpu_run_writes_its_files(cpu_run):
    out, res = cpu_run
    md = (out / "bench.md").read_text()
    assert "## Decode step" in md and "| bf16 | 2 | 64 |" in md and "## Prefill" in md
    assert "## Where the time goes: bf16 decode b1/64" in md
    assert "## Where the time goes: bf16 prefill 16 tokens" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert any("matplotlib" in n for n in res["notes"])
    else:
        for name in ("decode_vs_context.png", "latency_vs_batch.png", "breakdown.png"):
            data = (out / name).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, name
    assert (out / "builds").is_dir() and any("compiling" in n for n in res["notes"])


def test_the_record_names_its_code(cpu_run, monkeypatch, tmp_path):
    """bench.json's meta names flintc's version (or the source tree) and, in a git
    checkout (this one, or CI's clone), its commit, which the report's Software line
    shows; outside a git checkout the commit is None and the line leaves it out."""
    import re
    from pathlib import Path

    from flintc.bench import core

    out, res = cpu_run
    m = res["meta"]
    assert m["flintc"]
    if (Path(core.__file__).resolve().parents[2] / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{12}(\+modified)?", m["flintc_commit"] or ""), m["flintc_commit"]
        assert f"flintc {m['flintc']} (commit {m['flintc_commit']})" in (out / "bench.md").read_text()
    monkeypatch.setattr(core, "__file__", str(tmp_path / "a" / "b" / "core.py"))  # no git here
    assert core._source_commit() is None
    # flintc copied into another project's repository (site-packages of a venv inside it):
    # not flintc's commit, so none
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    site = tmp_path / "venv" / "site-packages"
    monkeypatch.setattr(core, "__file__", str(site / "flintc" / "bench" / "core.py"))
    assert core._source_commit() is None
    md = report.render_markdown({"meta": dict(m, flintc_commit=None), "ceilings": {}})
    assert f"flintc {m['flintc']}" in md and "(commit" not in md


def test_cpu_run_figures_are_positive_and_consistent(cpu_run):
    out, res = cpu_run
    assert res["ceilings"]["copy_gbs"] > 0 and res["ceilings"]["matmul_tflops"] > 0
    [build] = [b for b in res["builds"] if b["fmt"] == "bf16"]
    plan = json.loads((out / "builds" / "tiny-bf16" / "plan.json").read_text())["steps"]
    dec = {(r["batch"], r["context"]): r for r in res["decode"]}
    assert set(dec) == {(1, 64), (2, 64)}
    moe = roofline.moe_layers(TINY)
    for (b, c), r in dec.items():
        assert r["fwd_ms"] > 0 and r["e2e_ms"] > 0 and r["roofline_ms"] > 0
        assert r["fwd_roofline_share"] == pytest.approx(r["roofline_ms"] / r["fwd_ms"])
        assert r["kernels_measured"] == r["kernels_plan"] == plan[f"decode_b{r['bucket']}"]["kernels"]
        per_layer = {int(k): v for k, v in r["distinct_experts"]["per_layer"].items()}
        assert sorted(per_layer) == moe
        k = TINY.num_experts_per_tok
        assert all(k <= v <= min(b * k, TINY.n_routed_experts) for v in per_layer.values()), per_layer
        wb = r["roofline"]["weight_bytes"]
        assert wb["routed_experts"] == round(wb["per_expert"] * sum(per_layer.values()))
        assert r["roofline"]["kv_bytes"] == b * roofline.kv_bytes_read(TINY, c)
    assert all(v == TINY.num_experts_per_tok for v in dec[(1, 64)]["distinct_experts"]["per_layer"].values())
    [pre] = res["prefill"]
    assert pre["tokens"] == 16 and pre["ms"] > 0 and pre["roofline_ms"] > 0
    assert {(r["engine"], r["batch"], r["context"]) for r in res["baselines"]} == {("eager", 1, 64), ("eager", 2, 64)}
    assert all(r["fwd_ms"] > 0 and r["e2e_ms"] > 0 for r in res["baselines"])
    [bd] = res["breakdown"]
    assert bd["matched_to_plan"] and bd["kernels"] == plan["decode_b1"]["kernels"]
    assert sum(o["calls"] for o in bd["ops"]) == bd["kernels"]
    assert sum(o["us"] for o in bd["ops"]) == pytest.approx(bd["kernel_us"]) and bd["kernel_us"] > 0
    [pbd] = res["prefill_breakdown"]  # one prefill chunk through the recording kernel table
    chunk = plan_chunk = int(json.loads((out / "builds" / "tiny-bf16" / "build.json").read_text())["prefill_chunk"])
    assert pbd["tokens"] == 16 and pbd["function"] == f"prefill_t{plan_chunk}" and chunk > 0
    kernel_calls = sum(1 for launch in plan[f"prefill_t{chunk}"]["launches"] if not launch["op"].startswith("aten."))
    assert sum(o["calls"] for o in pbd["ops"]) == pbd["kernels"] == kernel_calls
    assert pbd["kernel_us"] > 0 and {o["op"] for o in pbd["ops"]} >= {"gemm", "prefill_attention_kv"}
    assert res["targets"] == [] and build["max_batch"] >= 2


def test_from_json_rerenders(cpu_run, tmp_path):
    out, res = cpu_run
    assert main(["bench", "--from-json", str(out / "bench.json"), "--no-plots", "--out", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "bench.json").read_text())
    assert again["decode"] == res["decode"]
    assert (tmp_path / "bench.md").read_text().count("| bf16 |") >= 3


def test_caches_are_sized_to_the_points(cpu_run, tmp_path):
    """The fixture's build was compiled for contexts <= 64 and its functions do not depend
    on the cache length: a run at context 100 loads it with caches of 100 positions (by
    default), or skips the point with a note (--build-caches)."""
    out, _ = cpu_run
    builds = out / "builds"
    common = ["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16", "--contexts", "100",
              "--batches", "1", "--prefill", "none", "--baselines", "none", "--no-compile", "--no-plots",
              "--builds", str(builds)]
    assert main(common + ["--out", str(tmp_path / "sized")]) == 0
    res = json.loads((tmp_path / "sized" / "bench.json").read_text())
    [rec] = res["decode"]
    assert (rec["batch"], rec["context"]) == (1, 100) and rec["fwd_ms"] > 0
    assert rec["build_max_model_len"] == 100 and rec["build_compiled_max_model_len"] == 64
    [b] = res["builds"]
    assert b["caches_resizable"] and b["loaded_max_model_len"] == 100
    assert b["loaded_kv_cache_bytes"] == rec["kv_cache_bytes_allocated"] > b["kv_cache_bytes"]
    assert "loaded here with caches of 100 positions" in (tmp_path / "sized" / "bench.md").read_text()
    assert main(common + ["--build-caches", "--out", str(tmp_path / "fixed")]) == 1  # nothing measured
    res = json.loads((tmp_path / "fixed" / "bench.json").read_text())
    assert res["decode"] == [] and any("no build covers it" in n for n in res["notes"])


def test_build_glob_picks_the_builds(cpu_run, tmp_path):
    """--build-glob: only builds whose folder name matches a pattern are used (two copies
    of the fixture's build: the point runs on the named one); none matching with
    --no-compile is refused up front (test_build_glob_that_names_no_build_is_refused)."""
    for name in ("a-tiny-bf16", "b-tiny-bf16"):
        builds = _copy_build(cpu_run, tmp_path, name)
    args = _bench_on_builds(builds)
    for glob, want in (("b-*", "b-tiny-bf16"), ("zz*, a-*", "a-tiny-bf16"), (None, "a-tiny-bf16")):
        run = tmp_path / f"out-{want}-{glob is None}"
        assert main(args + (["--build-glob", glob] if glob else []) + ["--out", str(run)]) == 0
        res = json.loads((run / "bench.json").read_text())
        assert [r["build"] for r in res["decode"]] == [want], (glob, res["notes"])
        assert {b["path"] for b in res["builds"]} == (
            {str(builds / want)} if glob else {str(builds / n) for n in ("a-tiny-bf16", "b-tiny-bf16")})
    # none matching with --no-compile: refused before anything is measured (it measured
    # no flintc point, with a note at the end, exit 0)
    assert main(args + ["--build-glob", "zz*", "--out", str(tmp_path / "none")]) == 2
    assert not (tmp_path / "none").exists()


def _small_and_large_builds(cpu_run, tmp_path) -> Path:
    """A --builds folder holding a-tiny-bf16, the fixture's build with max batch 1 (its
    decode_b1 function is the same; its caches hold 1 slot), and b-tiny-bf16, the
    fixture's (max batch 2): points of batch 1 go to a-tiny-bf16, which needs less
    KV-cache memory for them, and it runs first."""
    builds = _copy_build(cpu_run, tmp_path, "a-tiny-bf16")
    _copy_build(cpu_run, tmp_path, "b-tiny-bf16")
    manifest = builds / "a-tiny-bf16" / "build.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), max_batch=1)))
    return builds


def test_points_a_build_has_no_room_for_move_on_to_the_next_build(cpu_run, tmp_path, monkeypatch):
    """A build without the free device memory for its points hands them on to the next
    covering build (an H100 run skipped full-bf16-b1, "no point fits in the 4.3 GiB
    free", and never measured its batch-1 and prefill points, which full-bf16 covers):
    here a-tiny-bf16 sees no memory free and b-tiny-bf16 plenty (the free memory `_fit`
    sees, once per build); every point is measured on b-tiny-bf16, which is loaded once."""
    from flintc.bench import core

    builds = _small_and_large_builds(cpu_run, tmp_path)
    free = iter([0, 1 << 40])
    monkeypatch.setattr(core._Bench, "_free_bytes", lambda self: next(free))
    out = tmp_path / "out"
    args = ["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16", "--contexts", "64", "--batches",
            "1,2", "--prefill", "16", "--baselines", "none", "--no-compile", "--no-plots", "--builds", str(builds)]
    assert main(args + ["--out", str(out)]) == 0
    res = json.loads((out / "bench.json").read_text())
    assert sorted((r["batch"], r["build"]) for r in res["decode"]) == [(1, "b-tiny-bf16"), (2, "b-tiny-bf16")]
    assert [(r["tokens"], r["build"]) for r in res["prefill"]] == [(16, "b-tiny-bf16")]
    [note] = [n for n in res["notes"] if "could not take" in n]
    assert note.startswith("bf16: build a-tiny-bf16 could not take batch 1 context 64, prefill 16: KV caches of "
                           "1 slot x 64 positions (0.0 GiB) and 1.0 GiB of workspace for all 2 of its points do "
                           "not fit in the 0.0 GiB free next to the weights ("), note
    assert note.endswith("; trying build b-tiny-bf16"), note
    assert not any("skipped" in n for n in res["notes"]), res["notes"]
    assert next(free, None) is None  # each build's free memory was read once: none loaded twice


def test_a_point_no_build_has_room_for_is_skipped_with_a_note(cpu_run, tmp_path, monkeypatch):
    """Free memory for the decode step (its caches and intermediates take tens of KiB on
    the tiny config, next to the 1 GiB `_workspace` keeps) but not for the eager
    baseline's fp32 copy of the LM head (512 KiB): a-tiny-bf16 measures the decode point
    and hands the eager one on to b-tiny-bf16, which has no room for it either and is
    not loaded; the eager point is skipped, and the notes say so."""
    from flintc.bench import core

    builds = _small_and_large_builds(cpu_run, tmp_path)
    lm_head_fp32 = 2 * 4 * TINY.vocab_size * TINY.hidden_size
    monkeypatch.setattr(core._Bench, "_free_bytes", lambda self: (1 << 30) + lm_head_fp32 // 2)
    out = tmp_path / "out"
    args = _bench_on_builds(builds)
    args[args.index("--baselines") + 1] = "eager"
    assert main(args + ["--out", str(out)]) == 0
    res = json.loads((out / "bench.json").read_text())
    assert [(r["batch"], r["context"], r["build"]) for r in res["decode"]] == [(1, 64, "a-tiny-bf16")]
    assert res["baselines"] == [] and res["failures"] == []
    assert {b["path"] for b in res["builds"]} == {str(builds / n) for n in ("a-tiny-bf16", "b-tiny-bf16")}
    a, b = [n for n in res["notes"] if "could not take" in n]
    assert a.startswith("bf16: build a-tiny-bf16 could not take eager baseline batch 1 context 64: KV caches of "
                        "1 slot x 64 positions (0.0 GiB) and 1.0 GiB of workspace for all 2 of its points do not "
                        "fit in the 1.0 GiB free next to the weights ("), a
    assert a.endswith("; trying build b-tiny-bf16"), a
    assert b.startswith("bf16: build b-tiny-bf16 could not take eager baseline batch 1 context 64: KV caches of "
                        "2 slots x 64 positions (0.0 GiB) and 1.0 GiB of workspace do not fit in "), b
    assert b.endswith("; skipped eager baseline batch 1 context 64: no build left covers it"), b


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "{}", None])
def test_a_build_with_a_broken_plan_is_skipped_with_a_note(cpu_run, tmp_path, content):
    """A build in --builds whose plan.json is missing or unreadable is named in a note and
    not used (no traceback)."""
    builds = _copy_build(cpu_run, tmp_path)
    plan = builds / "tiny-bf16" / "plan.json"
    if content is None:
        plan.unlink()
    else:
        plan.write_text(content)
    assert main(_bench_on_builds(builds) + ["--out", str(tmp_path / "out")]) == 1  # no flintc point measured
    res = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert res["decode"] == []
    assert any(str(plan) in n and "not used" in n for n in res["notes"]), res["notes"]


def test_a_plotting_failure_keeps_the_report(tmp_path, monkeypatch):
    def broken(results):
        raise RuntimeError("no display")

    monkeypatch.setattr(report, "render_plots", broken)
    res = {"meta": {"date": "d", "device": "cpu", "command": "c"}, "ceilings": {}, "decode": [], "prefill": [],
           "baselines": [], "breakdown": [], "kernels": [], "notes": []}
    paths = report.write_outputs(res, tmp_path, plots=True, log=lambda *a: None)
    assert paths["plots"] == [] and (tmp_path / "bench.md").is_file()
    assert any("plots not written: RuntimeError: no display" in n for n in res["notes"])


def _old_pair_on_a_full_disk(tmp_path, monkeypatch, marker: str):
    """A folder tmp_path/o holding an old bench.json / bench.md, and a disk that fills up
    when the temporary file whose name holds `marker` is written (`set_public_mode` runs
    right after each one). Returns (folder, the real set_public_mode to restore)."""
    import errno

    from flintc import fileio

    out = tmp_path / "o"
    out.mkdir()
    (out / "bench.json").write_text("old json")
    (out / "bench.md").write_text("old md")
    real = fileio.set_public_mode

    def full(path):
        if marker in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path)

    monkeypatch.setattr(fileio, "set_public_mode", full)
    return out, real


def test_plots_are_written_with_the_report(tmp_path, monkeypatch):
    """The PNGs are written in one group with bench.json and bench.md: a failed write
    of any of them (here a PNG, as on a full disk) leaves the folder as it was, with no
    truncated PNG (they were saved straight into --out before); a good write publishes
    all of them, and bench.md links each."""
    from flintc import fileio

    pngs = {"decode_vs_context.png": b"\x89PNG\r\n\x1a\n one", "breakdown.png": b"\x89PNG\r\n\x1a\n two"}
    monkeypatch.setattr(report, "render_plots", lambda results: dict(pngs))
    out, real = _old_pair_on_a_full_disk(tmp_path, monkeypatch, ".breakdown.png.")
    res = {"meta": {"date": "d", "device": "cpu", "command": "c"}, "ceilings": {}}
    with pytest.raises(OSError):
        report.write_outputs(res, out, plots=True, log=lambda *a: None)
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]
    assert (out / "bench.json").read_text() == "old json"
    monkeypatch.setattr(fileio, "set_public_mode", real)
    paths = report.write_outputs(res, out, plots=True, log=lambda *a: None)
    assert paths["plots"] == [str(out / name) for name in pngs]
    assert {name: (out / name).read_bytes() for name in pngs} == pngs
    md = (out / "bench.md").read_text()
    assert "(decode_vs_context.png)" in md and "(breakdown.png)" in md


def test_write_plots_writes_what_render_plots_gives(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "render_plots", lambda results: {"breakdown.png": b"png bytes"})
    assert report.write_plots({}, tmp_path / "p") == [str(tmp_path / "p" / "breakdown.png")]
    assert (tmp_path / "p" / "breakdown.png").read_bytes() == b"png bytes"


def test_bad_arguments_are_user_errors(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--contexts", "1k", "--out", str(tmp_path)]) == 2
    assert "--contexts" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--batches", "16", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--device", "cpu", "--baselines", "jit", "--out", str(tmp_path)]) == 2
    assert main(["bench", "--device", "cpu", "--baseline-points", "1-64", "--out", str(tmp_path)]) == 2
    if not torch.cuda.is_available():
        assert main(["bench", "--device", "cuda", "--out", str(tmp_path)]) == 2


_SIZE_FLAGS = ("--contexts", "--batches", "--prefill")


@pytest.mark.parametrize("flag, value, needles", [
    ("--batches", "1,,2", ["'1,,2'", "empty item"]),
    ("--batches", "1,2,", ["'1,2,'", "empty item"]),
    ("--contexts", "1k", ["'1k' is not an integer"]),
    ("--contexts", "1.5e3,1.5", ["'1.5' is not an integer"]),
    ("--prefill", "16,0", ["0 is not a positive integer"]),
    ("--batches", "-1", ["-1 is not a positive integer"]),
    ("--contexts", ",", ["empty item"]),
    ("--batches", " ", ["at least one value"]),
    # a value given twice was measured twice
    ("--batches", "1,1", ["'1,1': 1 given twice"]),
    ("--contexts", "16,64,16", ["'16,64,16': 16 given twice"]),
    ("--prefill", "16,1.6e1", ["16 given twice"]),
    ("--formats", "bf16,bf16", ["'bf16,bf16': bf16 given twice"]),
    ("--baselines", "eager,eager", ["eager given twice"]),
    ("--breakdown", "1x64,1x64", ["1x64 given twice"]),
])
def test_bad_sizes_name_only_their_flag(tmp_path, capsys, flag, value, needles):
    """A bad --contexts / --batches / --prefill value: one line naming that flag and the
    bad value, not the other two; empty, zero and negative items are refused."""
    # Small, quick settings first (should a bad value pass, no full-size run starts); the
    # flag under test comes last and wins.
    quick = ["--config", "tiny", "--formats", "bf16", "--baselines", "none", "--no-flintc", "--no-plots",
             "--contexts", "64", "--batches", "1", "--prefill", "16"]
    assert main(["bench", "--device", "cpu", *quick, flag, value, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flintc: error: {flag}") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    assert not [f for f in _SIZE_FLAGS if f != flag and f in err], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field, flag", [("contexts", "--contexts"), ("batches", "--batches"),
                                         ("prefill", "--prefill")])
def test_bench_options_name_the_field_with_a_non_positive_size(tmp_path, field, flag):
    from flintc.bench.core import BenchOptions
    from flintc.errors import InputError

    with pytest.raises(InputError) as exc:
        BenchOptions(out=tmp_path, device="cpu", **{field: [4, 0]}).resolved()
    msg = str(exc.value)
    assert msg.startswith(flag) and "got 0" in msg and not [f for f in _SIZE_FLAGS if f != flag and f in msg]


def test_sizes_parse_separators_and_exponents():
    from flintc.cli.bench import _ints

    assert _ints("1, 2,4", "--batches") == [1, 2, 4]
    assert _ints("1_024,1e5", "--contexts") == [1024, 100000]


# Small settings that measure nothing but the ceilings (and load the weights): the tests
# below fail or stop before anything else would run.
_QUICK = ["--device", "cpu", "--config", "tiny", "--formats", "bf16", "--contexts", "64", "--batches", "1",
          "--prefill", "16", "--baselines", "none", "--no-flintc", "--no-plots"]


@pytest.mark.parametrize("flag, value", [
    ("--formats", ","), ("--formats", "nvfp4,,bf16"), ("--formats", "bf16,"), ("--baselines", "eager,"),
    ("--baselines", ","), ("--baseline-points", "1x64,"), ("--breakdown", ","), ("--prefill", "16,,32"),
])
def test_list_options_refuse_empty_items(tmp_path, capsys, flag, value):
    """Every comma-list option of bench shares one parser: an empty item is one line
    naming the option, exit 2, nothing written (`--formats ,` used to mean no format)."""
    assert main(["bench", *_QUICK, flag, value, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flintc: error: {flag} {value!r}: empty item") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag, value, needle", [
    ("--breakdown", "", "--breakdown: expected at least one value: comma-separated BATCHxCONTEXT items"),
    ("--baseline-points", " ", "--baseline-points: expected at least one value: comma-separated BATCHxCONTEXT"),
    ("--prefill", "", "--prefill: expected at least one value, or none: comma-separated positive integers"),
    ("--baselines", "", "--baselines: expected at least one value, or none: comma-separated names out of eager"),
])
def test_empty_list_options_are_refused(tmp_path, capsys, flag, value, needle):
    """An empty value is not the default: `--breakdown ''` and `--baseline-points ''` ran
    the default points, `--prefill ''` and `--baselines ''` measured none, all silently.
    One line naming the option, exit 2, nothing written; `none` still means none."""
    assert main(["bench", *_QUICK, flag, value, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flintc: error: {needle}") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_none_means_an_empty_list():
    from flintc.cli.bench import _ints, _none_or

    assert _none_or(" none ", "--prefill", "sizes", lambda t: _ints(t, "--prefill")) == []
    assert _none_or("16,32", "--prefill", "sizes", lambda t: _ints(t, "--prefill")) == [16, 32]


@pytest.mark.parametrize("args, needle", [
    (["--config", "bogus"], "--config bogus: unknown config preset 'bogus'"),
    (["--breakdown", "0x64"], "--breakdown: expected BATCHxCONTEXT items of positive integers"),
    (["--load-format", "auto"], "--load-format auto needs a MODEL"),
    (["no-such-checkpoint"], "MODEL no-such-checkpoint: no such checkpoint"),
    # points for no baseline were taken and ignored without a word
    (["--baselines", "none", "--baseline-points", "1x64"],
     "--baseline-points 1x64: sets the baselines' points, and --baselines is none"),
])
def test_bad_options_write_nothing(tmp_path, capsys, args, needle):
    """Options are checked before the first output: `--config bogus` used to write
    bench.json and bench.md (ceilings measured) before failing."""
    assert main(["bench", *_QUICK, *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["build.json", "config.json", "model.safetensors", "model-nvfp4.gguf"])
def test_out_holding_a_checkpoint_or_build_is_refused(tmp_path, capsys, name):
    """`flintc bench --out CKPT` wrote bench.json and the plots into a checkpoint folder,
    which dump and compile refuse; now it is refused too, before any work, nothing
    written."""
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / name).write_text("{}")
    assert main(["bench", *_QUICK, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flintc: error: --out {out}: holds {name} (a checkpoint or a build)"), err
    assert err.count("\n") == 1 and sorted(p.name for p in out.iterdir()) == [name]


_GIVEN_TO_FORMATS = "which --load-format auto measures; pass --formats {fmt} (or --load-format dummy for random " \
                    "weights of each format with its config)"


@pytest.mark.parametrize("args, message", [
    (["{tmp}/empty"], "{tmp}/empty: no config found (looked for {tmp}/empty/config.json)"),
    (["{bf16}", "--load-format", "auto", "--formats", "bf16,nvfp4"],
     "--formats bf16,nvfp4: MODEL {bf16} holds bf16 weights, " + _GIVEN_TO_FORMATS.format(fmt="bf16")),
    (["{gguf}", "--load-format", "auto"],
     "--formats bf16: MODEL {gguf} holds nvfp4 weights, " + _GIVEN_TO_FORMATS.format(fmt="nvfp4")),
    (["{bf16}", "--device", "cpu", "small memory"], "the config {bf16}/config.json: its bf16 weights take about"),
    (["--hf-config-path", "{bf16}"], "--hf-config-path {bf16} applies only with a MODEL (the config of a .gguf file); "
                                     "without one, the random weights take their config from --config"),
    (["--builds", "{tmp}/file"], "--builds {tmp}/file: exists and is a file, expected a folder (of builds)"),
    (["--builds", "{tmp}/file/sub"], "--builds {tmp}/file/sub: {tmp}/file is a file, not a folder: cannot make the "
                                     "folder to compile missing builds into"),
])
def test_model_and_builds_are_checked_before_measuring(tmp_path, capsys, monkeypatch, tiny_bf16_dir,
                                                       tiny_nvfp4_gguf, args, message):
    """A MODEL that is no checkpoint, or holds another format than --formats with
    --load-format auto (the default --formats bf16,nvfp4 with a BF16 MODEL), or is too
    large for the CPU's memory, and a --builds that is a file, failed only after the
    ceilings had been measured and bench.json / bench.md written (exit 1, or 2 for
    --builds); --hf-config-path without MODEL was ignored. Now one line, exit 2, before
    any output, nothing written."""
    import flintc.runtime.device as device

    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a folder")
    if "small memory" in args:
        args = [a for a in args if a != "small memory"]
        monkeypatch.setattr(device, "available_memory_bytes", lambda: 2**20)
    given = {"tmp": tmp_path, "bf16": tiny_bf16_dir, "gguf": tiny_nvfp4_gguf}
    quick = [a for a in _QUICK if a != "--no-flintc"]  # the builds would be used
    # this process's CPU time, not wall time: see tests/cli/test_user_errors.py
    t0 = time.process_time()
    code = main(["bench", *quick, *[a.format(**given) for a in args], "--out", str(tmp_path / "o")])
    out, err = capsys.readouterr()
    assert err.startswith(f"flintc: error: {message.format(**given)}") and err.count("\n") == 1, err
    assert (code, out) == (2, "") and not (tmp_path / "o").exists() and time.process_time() - t0 < 5


@pytest.mark.parametrize("var, value, backend", [
    ("FLINTC_PREFILL_GRAPHS", "x", "torch"), ("FLINTC_GEMV_TUNED", "/no/such/file.json", "triton"),
    ("FLINTC_PDL_TRIGGER", "soon", None),
])
def test_bad_environment_is_refused_before_any_work(tmp_path, capsys, monkeypatch, var, value, backend):
    """A malformed FLINTC_* variable used to surface only when a build loaded, after a
    compile, as a note with a traceback, and bench exited 0: now one line naming the
    variable, exit 2, before anything is measured or written."""
    monkeypatch.setenv(var, value)
    extra = ["--backend", backend] if backend else []
    assert main(["bench", *_QUICK, *extra, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flintc: error: {var}") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_a_failed_measurement_exits_non_zero(tmp_path, capsys, monkeypatch):
    """A measurement that fails is one line on stderr (no traceback), a record with its
    traceback in bench.json, and exit code 1 (it used to be a printed traceback and 0)."""
    from flintc.bench import core

    def broken(self, fmt):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(core._Bench, "_load", broken)
    assert main(["bench", *_QUICK, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "bf16: load weights: failed: RuntimeError: boom\n" in err and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("flintc: error: 1 measurement failed")
    [fail] = json.loads((tmp_path / "bench.json").read_text())["failures"]
    assert fail["what"] == "bf16: load weights" and "RuntimeError: boom" in fail["traceback"]


def test_dummy_weights_are_announced(tmp_path, capsys, tiny_bf16_dir):
    """bench's MODEL with the default --load-format dummy measures random weights of its
    config: a notice says so (and --help), none with --load-format auto."""
    common = ["bench", "--device", "cpu", "--formats", "bf16", "--baselines", "none", "--no-flintc",
              "--no-plots"]
    assert main([*common, str(tiny_bf16_dir), "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert f"random (dummy) weights with {tiny_bf16_dir}'s config" in err and "--load-format auto" in err
    assert main([*common, str(tiny_bf16_dir), "--load-format", "auto", "--out", str(tmp_path / "b")]) == 0
    assert "dummy" not in capsys.readouterr().err
    from flintc.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    assert "the weights are random" in " ".join(capsys.readouterr().out.split())


def test_from_json_refuses_bytes_that_are_not_text_in_one_line(tmp_path, capsys):
    """A .npy from --logits-out: one line (it was UnicodeDecodeError's traceback and exit
    status 1, session 34's new-user test). JSON in UTF-16 (as PowerShell's `>` saves it) is
    read: "{}" there is refused for what it holds, not for its encoding."""
    f = tmp_path / "x.json"
    f.write_bytes(b"\x93NUMPY\x01\x00")
    assert main(["bench", "--from-json", str(f), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flintc: error: --from-json {f}: not valid JSON: not UTF-8 text (byte 0"), err
    assert err.count("\n") == 1 and "Traceback" not in err and not (tmp_path / "o").exists()
    f.write_bytes("{}".encode("utf-16"))
    assert main(["bench", "--from-json", str(f), "--out", str(tmp_path / "o")]) == 2
    assert "no 'meta' object" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--contexts", "64,100000"), ("--prefill", "5000")])
def test_points_past_the_models_longest_context_are_refused_up_front(tmp_path, capsys, flag, value):
    """A context or prefill longer than max_position_embeddings (4096 for tiny): one line
    before anything is compiled. It used to compile both builds, skip every point with a
    note to compile with a --max-model-len that `flintc compile` refuses, and run on."""
    code = main(["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16", flag, value,
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"flintc: error: {flag}: {value.split(',')[-1]} tokens is more than the model serves " \
           "(max_position_embeddings 4096 in the tiny config); pass values up to 4096" in err, err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_default_points_are_cut_at_the_models_longest_context(tmp_path):
    """Without --contexts / --prefill, the defaults the model serves: for tiny (4,096
    tokens) the 1,024-token points only; for full (262,144) all of them."""
    from flintc.bench.core import DEFAULT_CONTEXTS, DEFAULT_PREFILL, BenchOptions

    o = BenchOptions(out=tmp_path, device="cpu", config="tiny", formats=["bf16"]).resolved()
    assert (o.contexts, o.prefill) == ([1024], [1024])
    assert o.cut_defaults == ["--contexts: the default 1024,8192,32768,100000,262144 cut to 1024, what the "
                              "model serves (max_position_embeddings 4096)",
                              "--prefill: the default 1024,8192 cut to 1024, what the model serves "
                              "(max_position_embeddings 4096)"]
    o = BenchOptions(out=tmp_path, device="cpu", config="tiny", contexts=[64], prefill=[]).resolved()
    assert (o.contexts, o.prefill, o.cut_defaults) == ([64], [], [])
    o = BenchOptions(out=tmp_path, device="cuda", config="full").resolved()  # no weight-size check off the CPU
    assert (o.contexts, o.prefill, o.cut_defaults) == (list(DEFAULT_CONTEXTS), list(DEFAULT_PREFILL), [])


def test_default_points_of_a_model_shorter_than_every_default(tmp_path, tiny_bf16_dir):
    """A MODEL whose max_position_embeddings (512) is below every default point: decode at
    512, no prefill point, both said in the notes; an explicit --prefill 1024 is refused
    naming the MODEL's config."""
    import json
    import shutil

    from flintc.bench.core import BenchOptions
    from flintc.errors import InputError

    short = tmp_path / "short"
    shutil.copytree(tiny_bf16_dir, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 512}))
    o = BenchOptions(out=tmp_path / "o", model=str(short), device="cpu", formats=["bf16"]).resolved()
    assert (o.contexts, o.prefill) == ([512], [])
    assert [n.split(":")[0] for n in o.cut_defaults] == ["--contexts", "--prefill"]
    assert "cut to 512, what" in o.cut_defaults[0] and "cut to none, what" in o.cut_defaults[1]
    with pytest.raises(InputError, match=f"--prefill: 1024 tokens is more than the model serves "
                                         f"\\(max_position_embeddings 512 in MODEL {short}'s config\\)"):
        BenchOptions(out=tmp_path / "o", model=str(short), device="cpu", formats=["bf16"], prefill=[1024]).resolved()


@pytest.mark.parametrize("content, needle", [
    ("{}", "no 'meta' object"), ("[1, 2]", "got a JSON array"),
    ('{"build_version": 3, "config": {}}', "(it is a build's build.json)"),
    ('{"meta": {}, "ceilings": {}, "decode": 5}', "its 'decode' is not a list of records"),
])
def test_from_json_refuses_what_is_not_a_bench_report(tmp_path, capsys, content, needle):
    f = tmp_path / "x.json"
    f.write_text(content)
    assert main(["bench", "--from-json", str(f), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flintc: error: --from-json {f}: expected a bench.json") and needle in err, err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_merged_header_lists_each_runs_ceilings(tmp_path, capsys):
    """--from-json A --from-json B: the header names each source file with its own
    ceilings (it used to show only A's, though B's rows use B's), also after a re-merge."""
    a, b = ({"meta": {"date": "d", "device": "cuda:0", "command": f"flintc bench {n}"}, "ceilings": {
        "copy_gbs": gbs, "matmul_tflops": tf, "method": "m"}} for n, gbs, tf in (("a", 4162.0, 790.0),
                                                                              ("b", 4093.0, 760.0)))
    for name, res in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(res))
    srcs = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    assert main(["bench", "--from-json", srcs[0], "--from-json", srcs[1], "--no-plots",
                 "--out", str(tmp_path / "m")]) == 0
    md = (tmp_path / "m" / "bench.md").read_text()
    assert "Merged from 2 runs" in md
    assert f"Run 1 ({srcs[0]})" in md and "copy bandwidth **4162 GB/s**, bf16 matmul **790 TFLOP/s**" in md
    assert f"Run 2 ({srcs[1]})" in md and "copy bandwidth **4093 GB/s**, bf16 matmul **760 TFLOP/s**" in md
    merged = json.loads((tmp_path / "m" / "bench.json").read_text())
    again = report.render_markdown(report.merge_results([merged, a], sources=["m", "a2"]))
    assert "Merged from 3 runs" in again and f"({srcs[1]})" in again and "Run 3 (a2)" in again
    capsys.readouterr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_tiny(tmp_path):
    """The GPU twin of the CPU run: CUDA graphs, device events, the graph's kernel count,
    the profiler breakdown and the compile baseline on the tiny model (a few minutes,
    most of it Triton and Inductor compiling)."""
    out = tmp_path / "bench"
    code = main(["bench", "--config", "tiny", "--device", "cuda", "--formats", "nvfp4", "--contexts", "64,200",
                 "--batches", "1,2", "--prefill", "16", "--baselines", "eager,compile", "--baseline-points",
                 "1x64", "--iters", "20", "--e2e-iters", "5", "--out", str(out), "--builds", str(tmp_path / "b")])
    assert code == 0
    res = json.loads((out / "bench.json").read_text())
    plan = json.loads((tmp_path / "b" / "tiny-nvfp4" / "plan.json").read_text())["steps"]
    assert {(r["batch"], r["context"]) for r in res["decode"]} == {(1, 64), (1, 200), (2, 64), (2, 200)}
    for r in res["decode"]:
        assert 0 < r["fwd_ms"] < r["e2e_ms"], r
        assert r["kernels_measured"] == plan[f"decode_b{r['bucket']}"]["kernels"], r["kernel_count_method"]
        assert r["peak_gib"] > 0
    [bd] = res["breakdown"]
    assert bd["matched_to_plan"], bd["kernel_names"]
    # medians over replays: charges + gaps equal the span per replay, about so across them
    assert bd["kernel_us"] + bd["gap_us"] == pytest.approx(bd["step_us"], rel=0.15)
    engines = {(r["engine"], r["batch"], r["context"]) for r in res["baselines"]}
    failures = res["baseline_failures"]
    assert ("eager", 1, 64) in engines
    assert ("compile", 1, 64) in engines or failures, "a compile failure must be recorded"


@pytest.mark.parametrize("engine,fmt", [("compile", "bf16"), ("fast", "nvfp4")])
def test_cpu_compiled_baselines_tiny(tmp_path, monkeypatch, engine, fmt):
    """The torch.compile baselines' own path (`_standalone_baseline` with `CompiledStep`,
    mode max-autotune) on the tiny model on the CPU, ~40 s each: "compile" of the
    reference model (on the H200, session 4, it compiled the full model and then crashed
    on `step.model`, which only `EagerStep` has; the GPU twin above allows a recorded
    compile failure, this one does not) and "fast" of `FastFlintModel` (NVFP4 weights,
    dequantized to bf16 in the step; the report gets its columns). Inductor gets a cache
    folder of its own: a truncated .so left in the machine's shared
    /tmp/torchinductor_<user> by a killed process failed it ("file too short")."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    out = tmp_path / "bench"
    code = main(["bench", "--config", "tiny", "--device", "cpu", "--formats", fmt, "--no-flintc",
                 "--contexts", "64", "--batches", "1", "--prefill", "none", "--baselines", engine,
                 "--baseline-points", "1x64", "--iters", "3", "--e2e-iters", "2", "--no-plots",
                 "--out", str(out)])
    assert code == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["baseline_failures"] == [], res["baseline_failures"]
    [rec] = res["baselines"]
    assert (rec["engine"], rec["fmt"], rec["batch"], rec["context"], rec["mode"]) == (
        engine, fmt, 1, 64, "max-autotune")
    assert 0 < rec["fwd_ms"] and 0 < rec["e2e_ms"] and rec["compile_s"] > 0
    assert isinstance(rec["graph_breaks"], int)
    if engine == "fast":
        assert rec["graph_breaks"] == 0, rec["cudagraph_notes"]  # one graph: the baseline's best case
        md = (out / "bench.md").read_text()
        assert "fast = the same `torch.compile`" in md and "| fast | nvfp4 | 1 |" in md


def test_fast_baseline_columns_only_when_measured():
    """The decode table gets "fast e2e ms" / "vs fast" and the targets a vs-fast line only
    when a fast record exists; a report without one renders as before."""
    full = {"roofline_ms": 1.0, "fwd_roofline_share": 0.5, "e2e_roofline_share": 0.4,
            "distinct_experts": {"mean": 6}, "roofline": {"bytes": 1e9}, "kernels_measured": 343,
            "kernels_plan": 343, "peak_gib": 30.0}
    res = _fake_results()
    res["decode"] = [dict(d, **full) for d in res["decode"]]
    res["breakdown"], res["ceilings"]["matmul_tflops"] = [], 790.0
    md = report.render_markdown(res)
    assert "vs fast" not in md and "fast e2e ms" not in md and "fast =" not in md
    res["baselines"].append({"engine": "fast", "fmt": "bf16", "batch": 1, "context": 1024, "fwd_ms": 2.5,
                             "e2e_ms": 2.8, "compile_s": 60.0, "cudagraphs": True, "graph_breaks": 0})
    t = {x["key"]: x for x in report.evaluate_targets(res)}
    assert t["bf16_vs_compile_b1_1k"]["measured"] == pytest.approx(4.9 / 1.4), "the target stays vs compile"
    assert t["bf16_vs_compile_b1_1k"]["vs_fast"] == pytest.approx(2.8 / 1.4)
    assert "vs_fast" not in t["bf16_vs_compile_b1_100k"]
    md = report.render_markdown(res)
    header = md.split("## Decode step")[1].split("\n\n")[2].splitlines()[0]
    assert header.endswith("| compile e2e ms | vs compile | fast e2e ms | vs fast |"), header
    assert "| 4.9 | 3.50x | 2.8 | 2.00x |" in md
    assert "BF16 end to end vs fast, b1/1K 2.00x (fast 2.80 ms, flintc 1.400 ms)" in md
    assert "| fast | bf16 | 1 | 1K | 2.5 | 2.8 | 60 | yes | 0 |" in md


def test_compiled_step_counts_graph_breaks(monkeypatch):
    """`CompiledStep.graph_breaks`: 0 for a step Dynamo traces whole, the count and the
    first reason (in `cudagraph_notes`, shown under the baselines table) for one it
    breaks; a break splits the step's CUDA graph, so a baseline with breaks is not the
    compiler's best case and the report must say so."""
    from flintc.bench import baselines

    class Step(torch.nn.Module):
        def __init__(self, model, kv):
            super().__init__()
            self.model = model

        def forward(self, ids, positions, slots):
            y = ids.float() * 2
            if self.model.broken:
                torch._dynamo.graph_break()
            return y + positions

    monkeypatch.setattr(baselines, "_StaticDecode", Step)
    example = (torch.ones(2, 1), torch.zeros(2, 1), torch.zeros(2, dtype=torch.long))
    for broken, want in ((False, 0), (True, 1)):
        model = torch.nn.Module()
        model.broken = broken
        step = baselines.CompiledStep(model, [], example, mode="default")
        assert step.error is None, step.error
        assert step.graph_breaks == want, step.cudagraph_notes
        torch.testing.assert_close(step(*example), example[0] * 2)
        notes = [n for n in step.cudagraph_notes if n.startswith("Dynamo graph break")]
        assert len(notes) == want and all("graph_break()" in n for n in notes), notes


@pytest.mark.parametrize("text, what", [("[" * 100000 + "]" * 100000, "nested too deeply"),
                                        ('{"meta": {"batch": 1' + "0" * 5000 + "}}", "Exceeds the limit")])
def test_from_json_that_json_itself_cannot_take_is_one_line(tmp_path, capsys, text, what):
    """Arrays nested past Python's recursion limit and an integer of more digits than
    int() takes were bare RecursionError / ValueError tracebacks: one line, exit 2."""
    f = tmp_path / "x.json"
    f.write_text(text)
    assert main(["bench", "--from-json", str(f), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flintc: error: --from-json {f}: not valid JSON for flintc bench (") and what in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["missing", "folder"])
def test_from_json_names_the_flag_for_a_file_it_cannot_read(tmp_path, capsys, kind):
    """A --from-json path that does not exist, or is a folder, printed the bare OSError
    ("flintc: error: x.json: No such file or directory", "...: Is a directory") without
    the flag or what was expected, unlike its other errors; nothing is written."""
    f = tmp_path / "x.json"
    if kind == "folder":
        f.mkdir()
    assert main(["bench", "--from-json", str(f), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flintc: error: --from-json {f}: cannot read it ("), err
    assert "expected a bench.json written by flintc bench" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


# -- --from-json: records checked before anything is written (session 38's new-user test) ------
_REAL_JSON = "docs/benchmarks/bench-2026-12-06-s37-h100-bf16-b1.json"


def _docs_benchmarks():
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def _mutate(path: str, edit):
    data = json.loads((_docs_benchmarks().parent.parent / path).read_text())
    edit(data)
    return data


def _delete(section, i, field):
    def edit(d):
        del d[section][i][field]
    return edit


def _set(value, *keys):
    def edit(d):
        t = d
        for k in keys[:-1]:
            t = t[k]
        t[keys[-1]] = value
    return edit


@pytest.mark.parametrize("edit, needle", [
    (_delete("decode", 0, "batch"), "decode[0] has no 'batch' field (expected an integer)"),
    (_set([{"engine": "flintc"}], "prefill"), "prefill[0] has no 'fmt' field (expected a string)"),
    (_set("x", "breakdown", 0, "ops"), 'breakdown[0].ops: expected a list of objects, got "x"'),
    (_delete("breakdown", 0, "step_us"), "breakdown[0] has no 'step_us' field (expected a number)"),
    (_set("x", "kernels", 0, "measured"), 'kernels[0].measured: expected an integer or null, got "x"'),
    (_set("x", "loads", 0, "weight_bytes"), 'loads[0].weight_bytes: expected a number, got "x"'),
    (_set("fast", "ceilings", "copy_gbs"), 'ceilings.copy_gbs: expected a number, got "fast"'),
    (_set("x", "decode", 0, "fwd_ms"), 'decode[0].fwd_ms: expected a number, got "x"'),
    (_set(True, "decode", 0, "context"), "decode[0].context: expected an integer, got true"),
    (_set({"x": 1.0}, "breakdown", 0, "ops", 0, "per_layer"), "breakdown[0].ops[0].per_layer: expected an object"),
    (_set(7, "meta", "timing"), "meta.timing: expected a string or null, got 7"),
    (_set([{"ceilings": []}], "meta", "runs"), "meta.runs[0].ceilings: expected an object, got []"),
    (_set([1], "notes"), "its 'notes' is not a list of strings"),
])
def test_from_json_names_the_record_and_field_it_cannot_read(tmp_path, capsys, edit, needle):
    """A bench.json record without a field the report reads, or with one of another kind:
    it was a traceback (KeyError, TypeError in report.py, exit 1) after bench.json was
    written into --out without bench.md (over an earlier --out: a new bench.json beside
    the old bench.md), or it rendered silently ("copy bandwidth **fast GB/s**"). Now one
    line naming the file, the record and the field, exit 2, and --out untouched."""
    f = tmp_path / "x.json"
    f.write_text(json.dumps(_mutate(_REAL_JSON, edit)))
    out = tmp_path / "o"
    out.mkdir()
    (out / "bench.json").write_text("old json")
    (out / "bench.md").write_text("old md")
    code = main(["bench", "--from-json", str(f), "--no-plots", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"flintc: error: --from-json {f}: "), err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]
    assert (out / "bench.json").read_text() == "old json" and (out / "bench.md").read_text() == "old md"
    assert main(["bench", "--from-json", str(f), "--no-plots", "--out", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()


def test_every_bench_json_in_the_docs_still_renders(tmp_path, capsys):
    """The records check accepts every run in docs/benchmarks (older runs lack fields newer
    ones have: kv_slots, pieces, loaded_max_model_len, ...), one by one and merged."""
    from flintc.cli.bench import _load_report

    files = sorted(str(f) for f in _docs_benchmarks().glob("bench*.json"))
    assert len(files) >= 40
    for f in files:
        report.render_markdown(report.merge_results([_load_report(f)], sources=[f]))
    args = [a for f in files for a in ("--from-json", f)]
    assert main(["bench", *args, "--no-plots", "--out", str(tmp_path / "m")]) == 0
    merged = tmp_path / "m" / "bench.json"
    assert main(["bench", "--from-json", str(merged), "--from-json", files[0], "--no-plots",
                 "--out", str(tmp_path / "m2")]) == 0
    assert f"Merged from {len(files) + 1} runs" in (tmp_path / "m2" / "bench.md").read_text()
    capsys.readouterr()


def test_a_record_the_check_passes_renders(tmp_path):
    """Every field of a real report (its first record of each section, also merged, with
    meta.runs), deleted or replaced by a value of another kind: `check_records` refuses
    it, or the report renders (no KeyError / TypeError / ValueError from the renderer,
    the targets or the merge)."""
    import copy

    def load():
        res = json.loads((_docs_benchmarks() / "bench-2026-12-05-s29-h100-new.json").read_text())
        fast = json.loads((_docs_benchmarks() / "bench-fast-2026-12-06-s37-h100-bf16.json").read_text())
        res["baselines"] = fast["baselines"]
        res["baseline_failures"] = [{"engine": "compile", "fmt": "bf16", "batch": 1, "context": 1024,
                                     "error": "boom"}]
        for key, value in res.items():
            if isinstance(value, list):
                res[key] = value[:1]
        return res

    def paths(obj, prefix=()):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj[:1]) if isinstance(obj, list) else []
        for k, v in items:
            yield prefix + (k,)
            yield from paths(v, prefix + (k,))

    single = load()
    merged = json.loads(json.dumps(report.merge_results([load(), load()], sources=["a", "b"])))
    tried = 0
    for base, only in ((single, None), (merged, "meta")):
        for path in paths(base):
            if len(path) < 2 or path[0] in ("targets", "failures", "notes") or only and path[0] != only:
                continue
            for value in (KeyError, "x", True, None, {}):
                res = copy.deepcopy(base)
                parent = res
                for k in path[:-1]:
                    parent = parent[k]
                if value is KeyError:
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = value
                tried += 1
                try:
                    report.check_records(res)
                except report.RecordError:
                    continue
                res = report.merge_results([res])
                res["targets"] = report.evaluate_targets(res)
                report.render_markdown(res, [])
    assert tried > 500


def test_the_report_is_rendered_before_anything_is_written(tmp_path):
    """`write_outputs` renders the Markdown first: a results dict it cannot render raises
    with no folder made and an earlier pair left as it was (bench.json used to be written
    first, then the render failed)."""
    bad = {"meta": {"device": "cpu"}, "ceilings": {}, "decode": [{"engine": "flintc", "fmt": "bf16"}]}
    with pytest.raises(KeyError):
        report.write_outputs(bad, tmp_path / "o", plots=False)
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "bench.json").write_text("old")
    with pytest.raises(KeyError):
        report.write_outputs(bad, tmp_path / "o", plots=False)
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["bench.json"]
    assert (tmp_path / "o" / "bench.json").read_text() == "old"


def test_a_failed_write_keeps_the_previous_pair(tmp_path, monkeypatch, capsys):
    """bench.json and bench.md are written as a pair: a full disk while bench.md is written
    leaves both as they were (bench.json used to be replaced already), no temporary file."""
    from flintc import fileio

    out, real = _old_pair_on_a_full_disk(tmp_path, monkeypatch, ".bench.md.")
    res = {"meta": {"date": "d", "device": "cpu", "command": "c"}, "ceilings": {}}
    with pytest.raises(OSError):
        report.write_outputs(res, out, plots=False)
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]
    assert (out / "bench.json").read_text() == "old json" and (out / "bench.md").read_text() == "old md"
    monkeypatch.setattr(fileio, "set_public_mode", real)
    report.write_outputs(res, out, plots=False)
    assert json.loads((out / "bench.json").read_text())["meta"]["date"] == "d"
    assert "# flintc bench" in (out / "bench.md").read_text()
    capsys.readouterr()


# -- --max-model-len and --contexts agree with flintc compile's bounds -------------------------
@pytest.mark.parametrize("args, message", [
    (["--max-model-len", "1"], "--max-model-len must be >= 2 (a prompt token and one generated), got 1"),
    (["--max-model-len", "1", "--contexts", "64"], "--max-model-len must be >= 2"),
    (["--max-model-len", "32", "--contexts", "16,64", "--prefill", "16", "--build-caches"],
     "--max-model-len 32 is shorter than the longest point measured (--contexts 64) and --build-caches keeps a "
     "build's caches at its max model len; pass --max-model-len >= 64"),
    (["--max-model-len", "32", "--contexts", "16", "--build-caches"],
     "--max-model-len 32 is shorter than the longest point measured (--prefill 1024, the default)"),
    (["--max-model-len", "5000", "--contexts", "64", "--prefill", "none"],
     "--max-model-len 5000 is more than the model serves (max_position_embeddings 4096 in the tiny config); "
     "pass at most 4096"),
])
def test_max_model_len_out_of_bounds_is_refused_up_front(tmp_path, capsys, args, message):
    """bench's --max-model-len took 1 (its help said >= 1), and more than the model serves,
    which `flintc compile` refuses: the run measured the ceilings, printed the report and
    failed in the compile, leaving bench.json and bench.md; one shorter than the longest
    point with --build-caches compiled a build that did not hold it. Now one line before any
    work."""
    code = main(["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16", "--baselines", "none",
                 "--no-plots", *args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"flintc: error: {message}"), err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_max_model_len_help_states_the_real_bounds(capsys):
    from flintc.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(>= 1)" not in text
    assert ("max model length of a build compiled here: at least 2, at most the model's max_position_embeddings, "
            "and with --build-caches at least the longest --contexts / --prefill point") in text


@pytest.mark.parametrize("points, measured", [
    (["--contexts", "64,128", "--prefill", "none"], ([(1, 64), (1, 128)], [])),
    (["--contexts", "64", "--prefill", "128"], ([(1, 64)], [128])),
])
def test_max_model_len_shorter_than_a_point_runs_with_resizable_caches(tmp_path, capsys, points, measured):
    """A --max-model-len shorter than the longest point was refused, although by default a
    build's caches are resizable and sized to the points it serves (--build-caches is
    what keeps them at the max model len): the build of length 64 measures context 128
    (and the 128-token prefill), as it did before the check."""
    out = tmp_path / "o"
    code = main(["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16", "--baselines", "none",
                 "--no-plots", *points, "--batches", "1", "--max-model-len", "64", "--iters", "1",
                 "--e2e-iters", "1", "--prefill-iters", "1", "--warmup", "0", "--rotations", "1",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0 and "error" not in err, err
    res = json.loads((out / "bench.json").read_text())
    assert ([(r["batch"], r["context"]) for r in res["decode"]],
            [r["tokens"] for r in res["prefill"]]) == measured, res["notes"]
    assert json.loads((out / "builds" / "tiny-bf16" / "build.json").read_text())["max_model_len"] == 64


def test_max_model_len_shorter_than_a_point_is_not_checked_without_flintc(tmp_path):
    """With --no-flintc no build is compiled or measured: --max-model-len is not refused
    for being shorter than a point, even with --build-caches."""
    from flintc.bench.core import BenchOptions

    opts = BenchOptions(out=tmp_path, device="cpu", config="tiny", contexts=[64, 128], batches=[1], prefill=[],
                        baselines=["eager"], run_flintc=False, size_caches=False, max_model_len=64).resolved()
    assert opts.max_model_len == 64


def test_context_1_compiles_a_build_of_length_2(tmp_path, capsys):
    """--contexts 1 --prefill none compiled a build of max model len 1 (the longest point),
    which `flintc compile` refuses: after the ceilings and the whole report, "--max-model-len
    must be in 2..4096 ... got 1" although no --max-model-len was given. Now the build gets
    2, flintc's least, and the point is measured."""
    out = tmp_path / "o"
    code = main(["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16", "--baselines", "none",
                 "--no-plots", "--contexts", "1", "--batches", "1", "--prefill", "none", "--iters", "1",
                 "--e2e-iters", "1", "--warmup", "0", "--rotations", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0 and "error" not in err, err
    res = json.loads((out / "bench.json").read_text())
    assert [(r["batch"], r["context"]) for r in res["decode"]] == [(1, 1)]
    assert json.loads((out / "builds" / "tiny-bf16" / "build.json").read_text())["max_model_len"] == 2


# -- --builds and --build-glob -----------------------------------------------------------------
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe\x00", b'{"build_version": 1}'])
def test_a_build_with_an_unreadable_manifest_is_skipped_with_a_note(cpu_run, tmp_path, content):
    """A subfolder of --builds whose build.json is not JSON (or not UTF-8 text), not an
    object, or of another build_version was skipped silently (a build for other weights
    gets a note): now a note naming the file, once for all formats."""
    builds = _copy_build(cpu_run, tmp_path)
    manifest = builds / "tiny-bf16" / "build.json"
    manifest.write_bytes(content)
    assert main(_bench_on_builds(builds, "bf16,nvfp4") + ["--out", str(tmp_path / "out")]) == 1  # none measured
    res = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert res["decode"] == []
    notes = [n for n in res["notes"] if str(manifest) in n]
    assert len(notes) == 1 and notes[0].endswith("; not used"), res["notes"]


@pytest.mark.parametrize("glob, extra, message", [
    ("[", [], "--build-glob '[': a '[' that no ']' closes; expected shell patterns"),
    ("a-[bc", [], "--build-glob 'a-[bc': a '[' that no ']' closes"),
    ("zz*", [], "--build-glob zz*: matches no build in {builds} (builds there: a-tiny-bf16) and a missing build "
                "is compiled only under a name a pattern matches (tiny-bf16); pass patterns that match a build's "
                "folder name, or leave --build-glob out"),
    ("zz*", ["--no-compile"], "--build-glob zz*: matches no build in {builds} (builds there: a-tiny-bf16) and "
                              "--no-compile is given"),
    # a build of another format matched: no nvfp4 point runs on it (a note at the end, exit 0)
    ("a-*", ["--formats", "nvfp4"], "--build-glob a-*: matches no nvfp4 build in {builds} (it matches: a-tiny-bf16 "
                                    "(bf16)) and a missing build is compiled only under a name a pattern matches "
                                    "(tiny-nvfp4); pass patterns"),
    ("a-*", ["--formats", "nvfp4", "--no-compile"], "--build-glob a-*: matches no nvfp4 build in {builds} (it "
                                                    "matches: a-tiny-bf16 (bf16)) and --no-compile is given"),
    ("", [], "--build-glob: expected at least one value: comma-separated shell patterns"),
    ("a-*,", [], "--build-glob 'a-*,': empty item"),
])
def test_build_glob_that_names_no_build_is_refused(cpu_run, tmp_path, capsys, glob, extra, message):
    """--build-glob '[' (an unclosed set, matching only a literal '[') or one matching no
    build: bench compiled a new build into --builds under a name the patterns did not
    match (or, with --no-compile, measured no flintc point and exited 0). Now one line
    before anything is measured; an empty pattern is refused as every list option's. So
    are patterns matching only builds of another format than --formats (they passed, and
    no flintc point was measured)."""
    builds = _copy_build(cpu_run, tmp_path, "a-tiny-bf16")
    code = main(["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16", "--contexts", "64",
                 "--batches", "1", "--prefill", "none", "--baselines", "none", "--no-plots", *extra,
                 "--builds", str(builds), "--build-glob", glob, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("flintc: error: " + message.format(builds=builds)), err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()
    assert sorted(p.name for p in builds.iterdir()) == ["a-tiny-bf16"]


def test_an_unreadable_builds_folder_is_one_line(tmp_path, capsys, monkeypatch):
    """--build-glob with a --builds folder that cannot be listed: PermissionError's
    traceback from the up-front check. Now one line naming --builds. (As root, chmod 000
    does not stop the listing: Path.iterdir raises it instead.)"""
    import errno

    builds = tmp_path / "builds"
    builds.mkdir()
    if os.geteuid() == 0:
        real = Path.iterdir

        def iterdir(self):
            if self == builds:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real(self)

        monkeypatch.setattr(Path, "iterdir", iterdir)
    else:
        builds.chmod(0)
    try:
        code = main(_bench_on_builds(builds) + ["--build-glob", "a-*", "--out", str(tmp_path / "o")])
    finally:
        builds.chmod(0o755)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"flintc: error: --builds {builds}: cannot be read: Permission denied; "
                                        "pass a folder of builds this user can read"), err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_build_glob_compiles_only_a_build_it_names(cpu_run, tmp_path):
    """With --build-glob, a format without a matching build is compiled only when the name
    it gets (CONFIG-FORMAT) matches a pattern; otherwise a note says why it was not
    (nvfp4 here: tiny-nvfp4 does not match 'tiny-bf16'), and bf16 runs on its build."""
    builds = _copy_build(cpu_run, tmp_path)
    assert main(["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16,nvfp4", "--contexts", "64",
                 "--batches", "1", "--prefill", "none", "--baselines", "none", "--no-plots",
                 "--builds", str(builds), "--build-glob", "tiny-bf16", "--out", str(tmp_path / "o")]) == 0
    res = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert [(r["fmt"], r["build"]) for r in res["decode"]] == [("bf16", "tiny-bf16")]
    assert sorted(p.name for p in builds.iterdir()) == ["tiny-bf16"]
    want = (f"nvfp4: no build for these weights matching --build-glob tiny-bf16 in {builds}; not compiling "
            f"{builds / 'tiny-nvfp4'}: its name matches no pattern")
    assert any(n.startswith(want) for n in res["notes"]), res["notes"]


# -- timings that are no measurement: negative, NaN, Infinity (left39) ------------------------
@pytest.mark.parametrize("edit, needle", [
    (_set(-1.0, "decode", 0, "fwd_ms"), "decode[0].fwd_ms: expected a finite number > 0, got -1.0"),
    (_set(0.0, "decode", 0, "e2e_ms"), "decode[0].e2e_ms: expected a finite number > 0, got 0.0"),
    (_set(float("nan"), "decode", 0, "fwd_ms"), "decode[0].fwd_ms: expected a finite number > 0, got NaN"),
    (_set(float("inf"), "ceilings", "copy_gbs"), "ceilings.copy_gbs: expected a finite number > 0, got Infinity"),
    (_set(-3.0, "breakdown", 0, "gap_us"), "breakdown[0].gap_us: expected a finite number >= 0, got -3.0"),
    (_set(float("nan"), "decode", 0, "min_ms"), "decode[0].min_ms: expected a finite number, got NaN"),
    (_set({"0": -1.0}, "breakdown", 0, "ops", 0, "per_layer"), "breakdown[0].ops[0].per_layer: expected an object "
     "of layer index -> microseconds, each a finite number >= 0"),
    (_set(-2, "decode", 0, "batch"), "decode[0].batch: expected an integer >= 1, got -2"),
    # user39b: an integer too large for a float raised a bare OverflowError (math.isfinite)
    (_set(10 ** 400, "decode", 0, "fwd_ms"), "decode[0].fwd_ms: expected a finite number > 0, got 1000"),
    (_set(10 ** 400, "meta", "layers"), "meta.layers: expected an integer >= 0 or null, got 1000"),
    # user39b: a batch, context or prompt length of 0 was rendered as a measured point
    (_set(0, "decode", 0, "context"), "decode[0].context: expected an integer >= 1, got 0"),
    (_set(0, "breakdown", 0, "batch"), "breakdown[0].batch: expected an integer >= 1, got 0"),
])
def test_from_json_refuses_timings_that_are_no_measurement(tmp_path, capsys, edit, needle):
    """Negative, zero (where a time must pass), NaN and Infinity timings were rendered, and
    NaN was written back into --out's bench.json as a bare NaN token (not JSON). Now one
    line naming the file, the record, the field and the value; nothing written."""
    f = tmp_path / "x.json"
    f.write_text(json.dumps(_mutate(_REAL_JSON, edit)))  # Python writes NaN / Infinity tokens
    code = main(["bench", "--from-json", str(f), "--no-plots", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"flintc: error: --from-json {f}: {needle}"), err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_bench_json_is_never_written_with_nan(tmp_path):
    """The writer refuses NaN (json.dumps(allow_nan=False)) with one line naming the field,
    before anything is written; a live measurement giving NaN is a failed measurement,
    not a record."""
    res = {"meta": {"date": "d", "device": "cpu", "command": "c"}, "ceilings": {}, "notes": [],
           "decode": [], "extra": [{"x": float("nan")}]}
    with pytest.raises(report.NonFiniteError, match=r"bench.json not written: extra\[0\].x is nan"):
        report.write_outputs(res, tmp_path / "o", plots=False)
    assert not (tmp_path / "o").exists()
    assert report.non_finite({"a": [1.0, {"b": float("-inf")}]}) == (".a[1].b", float("-inf"))

    from flintc.bench.core import BenchOptions, _Bench, _Clock

    results = {"notes": [], "failures": []}
    bench = _Bench(BenchOptions(out=tmp_path, device="cpu"), torch.device("cpu"), _Clock(None), results,
                   lambda *a: None)
    assert bench.guarded("bf16 flintc decode batch 1 context 64", lambda: {"fwd_ms": float("nan")}) is None
    assert results["notes"] == ["bf16 flintc decode batch 1 context 64: failed: ValueError: fwd_ms is nan, not a "
                                "finite number; not recorded"]
    assert len(results["failures"]) == 1


def test_messages_name_json_types_and_null_versions_render_unknown(tmp_path, capsys):
    """A --from-json file holding `null` said "got a JSON NoneType" (Python's name); JSON's
    names now. A record with meta.flintc null rendered "flintc None"."""
    f = tmp_path / "x.json"
    for text, name in (("null", "null"), ('"x"', "string"), ("1.5", "number"), ("true", "boolean")):
        f.write_text(text)
        assert main(["bench", "--from-json", str(f), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.rstrip().endswith(f"; got a JSON {name}"), err
    from flintc.config import FlintConfig
    from flintc.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^c.json: expected a JSON object, found a JSON array$"):
        FlintConfig.from_dict([], source="c.json")
    data = dict(TINY.to_dict(), hidden_size=None)
    with pytest.raises(ConfigError, match=r"field 'hidden_size' has the wrong type \(a JSON null: null; expected "
                                          r"an integer\)"):
        FlintConfig.from_dict(data, source="c.json")
    md = report.render_markdown({"meta": {"flintc": None, "torch": None, "cuda": None}, "ceilings": {}})
    assert "flintc unknown" in md and "torch unknown (no CUDA)" in md and "None" not in md


@pytest.mark.parametrize("extra, flag", [
    (["--formats", "bogus"], "--formats"), (["--contexts", "64"], "--contexts"), (["--no-compile"], "--no-compile"),
    (["--device", "cpu", "--iters", "3"], "--device"), (["--max-model-len", "8"], "--max-model-len"),
    (["some/model"], "MODEL (some/model)"),
])
def test_from_json_refuses_measurement_flags(tmp_path, capsys, extra, flag):
    """--from-json renders saved runs: options of a measurement (even --formats bogus) were
    accepted and ignored silently. Now one line naming the first such option; nothing
    written. --no-plots and --out are the options it reads."""
    f = str(_docs_benchmarks() / Path(_REAL_JSON).name)
    code = main(["bench", "--from-json", f, *extra, "--no-plots", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"flintc: error: {flag} applies to a measurement, and --from-json "
                                        "measures nothing"), err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()
    assert main(["bench", "--from-json", f, "--no-plots", "--out", str(tmp_path / "o")]) == 0


@pytest.mark.parametrize("args, message", [
    (["--max-model-len", "8", "--contexts", "200", "--prefill", "none"],
     "--max-model-len 8 is shorter than the longest point measured (--contexts 200), and the bf16 build bench would "
     "compile at it (--builds {tmp}/o/builds holds none it can use) cannot resize its KV caches to it (its "
     "functions are traced at its full cache length, 16 rows); pass --max-model-len >= 200, one whose build "
     "resizes its caches (e.g. 22), or leave it out"),
    (["--max-model-len", "21", "--contexts", "16"], "--max-model-len 21 is shorter than the longest point measured "
                                                    "(--prefill 1024, the default), and the bf16 build bench would "
                                                    "compile at it"),
])
def test_max_model_len_too_short_to_resize_is_refused_up_front(tmp_path, capsys, args, message):
    """--max-model-len 8 --contexts 200 (no --build-caches) compiled a build of length 8,
    whose functions are traced at its full cache length (so its caches do not resize),
    skipped the point with a note and exited 0. Now one line naming both flags, before
    any work; a build of 22 resizes (test_max_model_len_shorter_than_a_point_runs_with_...
    runs one of 64)."""
    code = main(["bench", "--config", "tiny", "--device", "cpu", "--formats", "bf16", "--baselines", "none",
                 "--no-plots", "--batches", "1", *args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"flintc: error: {message.format(tmp=tmp_path)}"), err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def _short_len_args(builds, out, formats: str = "bf16") -> list[str]:
    """bench arguments: --max-model-len 8 (too short for resizable caches) and context 200,
    on the builds in `builds` (compiling what is missing)."""
    return ["bench", "--config", "tiny", "--device", "cpu", "--formats", formats, "--baselines", "none",
            "--no-plots", "--batches", "1", "--max-model-len", "8", "--contexts", "200", "--prefill", "none",
            "--iters", "1", "--e2e-iters", "1", "--warmup", "0", "--rotations", "1", "--builds", str(builds),
            "--out", str(out)]


def test_max_model_len_too_short_is_not_refused_when_builds_has_a_build(cpu_run, tmp_path, capsys):
    """--max-model-len 8 with context 200 was refused up front ("cannot resize its KV
    caches") although --builds held a usable build (the fixture's, of length 64, whose
    caches resize), so nothing would be compiled at 8. Now the run measures context 200
    on it; the refusal stays for a format bench would compile (nvfp4: no build; bf16 with
    a build of other weights, which bench does not use)."""
    builds = _copy_build(cpu_run, tmp_path)
    capsys.readouterr()
    code = main(_short_len_args(builds, tmp_path / "o"))
    err = capsys.readouterr().err
    assert code == 0 and "error" not in err, err
    res = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert [(r["batch"], r["context"], r["build"]) for r in res["decode"]] == [(1, 200, "tiny-bf16")], res["notes"]
    assert sorted(p.name for p in builds.iterdir()) == ["tiny-bf16"], "nothing compiled"

    code = main(_short_len_args(builds, tmp_path / "o2", "bf16,nvfp4"))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(
        "flintc: error: --max-model-len 8 is shorter than the longest point measured (--contexts 200), and the "
        f"nvfp4 build bench would compile at it (--builds {builds} holds none it can use) cannot resize its KV "
        "caches to it (its functions are traced at its full cache length, 16 rows); pass --max-model-len >= 200, "
        "one whose build resizes its caches (e.g. 22)"), err
    assert err.count("\n") == 1 and not (tmp_path / "o2").exists()

    manifest = builds / "tiny-bf16" / "build.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), weight_sha256="0" * 64)))
    code = main(_short_len_args(builds, tmp_path / "o3"))
    err = capsys.readouterr().err
    assert code == 2 and "the bf16 build bench would compile at it" in err and err.count("\n") == 1, err
    assert not (tmp_path / "o3").exists()


def test_formats_to_compile_reads_the_builds_as_the_run_does(cpu_run, tmp_path, tiny_bf16_dir):
    """`_formats_to_compile` (before any weight is read) counts the builds `_builds_for`
    uses: --build-glob, --backend, readable manifest and plan; dummy weights by their
    recipe, a MODEL's by the manifest's weight_source; none with --no-compile."""
    from flintc.bench.core import BenchOptions, _formats_to_compile

    builds = _copy_build(cpu_run, tmp_path)
    tiny = FlintConfig.preset("tiny")

    def compile_for(**kw):
        o = BenchOptions(out=tmp_path / "o", device="cpu", config="tiny", formats=["bf16", "nvfp4"],
                         **{"builds": builds, **kw})
        return _formats_to_compile(o, tiny)

    assert compile_for() == ["nvfp4"]
    assert compile_for(compile_missing=False) == []
    assert compile_for(build_globs=["other*"]) == ["bf16", "nvfp4"]
    assert compile_for(build_globs=["tiny-*"]) == ["nvfp4"]
    assert compile_for(backend="triton") == ["bf16", "nvfp4"]
    assert compile_for(model=str(tiny_bf16_dir), load_format="auto") == ["bf16", "nvfp4"], "built on dummy weights"
    manifest = builds / "tiny-bf16" / "build.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(m, weight_source=str(Path(tiny_bf16_dir).resolve()))))
    assert compile_for(model=str(tiny_bf16_dir), load_format="auto") == ["nvfp4"]
    manifest.write_text(json.dumps(m))
    (builds / "tiny-bf16" / "plan.json").write_text("{corrupt")
    assert compile_for() == ["bf16", "nvfp4"]
    assert compile_for(builds=tmp_path / "none") == ["bf16", "nvfp4"]


def test_only_unusable_builds_is_an_error_naming_each(cpu_run, tmp_path, capsys):
    """--build-glob matching only builds bench cannot use (another build_version, a corrupt
    plan.json) measured no flintc point and exited 0 ("flintc not measured" in a note).
    Now exit 1 and one line naming each build and why; the report is still written."""
    builds = _copy_build(cpu_run, tmp_path, "a-tiny-bf16")
    _copy_build(cpu_run, tmp_path / "x", "b-tiny-bf16")
    import shutil

    shutil.move(str(tmp_path / "x" / "builds" / "b-tiny-bf16"), str(builds / "b-tiny-bf16"))
    manifest = builds / "a-tiny-bf16" / "build.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), build_version=99)))
    (builds / "b-tiny-bf16" / "plan.json").write_text("{corrupt")
    capsys.readouterr()
    code = main(_bench_on_builds(builds) + ["--build-glob", "*-tiny-bf16", "--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flintc: error")]
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("flintc: error: no flintc point was measured: not used: "), err
    assert f"{manifest}: build_version 99" in err[0] and f"{builds / 'b-tiny-bf16' / 'plan.json'} is not valid JSON" \
        in err[0], err
    assert (tmp_path / "o" / "bench.md").exists()


def test_from_json_keeps_the_unusable_builds(cpu_run, tmp_path, capsys):
    """--from-json dropped `unusable_builds` from the bench.json it writes (merged or
    not). Now a merge keeps each file's, tagged with its run (the header's "Run i", whose
    line names the file), an entry that several runs name once; the report names each
    build as the single file's does (its "not used" note)."""
    runs = {}
    for name, edit in (("a", {"weight_sha256": "0" * 64}), ("b", {"build_version": 99})):
        builds = _copy_build(cpu_run, tmp_path / name)
        manifest = builds / "tiny-bf16" / "build.json"
        manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), **edit)))
        assert main(_bench_on_builds(builds) + ["--out", str(tmp_path / name / "o")]) == 1  # nothing measured
        runs[name] = tmp_path / name / "o" / "bench.json"
        res = json.loads(runs[name].read_text())
        assert [b["path"] for b in res["unusable_builds"]] == [str(builds / "tiny-bf16")], res["unusable_builds"]
    capsys.readouterr()
    a, b = (json.loads(runs[n].read_text())["unusable_builds"][0] for n in "ab")
    assert main(["bench", "--from-json", str(runs["a"]), "--no-plots", "--out", str(tmp_path / "one")]) == 0
    assert json.loads((tmp_path / "one" / "bench.json").read_text())["unusable_builds"] == [a]
    single = (tmp_path / "one" / "bench.md").read_text()
    assert f"{a['path']}: {a['why']}; not used" in single

    assert main(["bench", "--from-json", str(runs["a"]), "--from-json", str(runs["b"]), "--from-json",
                 str(runs["a"]), "--no-plots", "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "bench.json").read_text())
    assert merged["unusable_builds"] == [dict(a, run=3), dict(b, run=2)]  # a once, as its last run's
    assert [r["source"] for r in merged["meta"]["runs"]] == [str(runs["a"]), str(runs["b"]), str(runs["a"])]
    md = (tmp_path / "m" / "bench.md").read_text()
    assert f"{a['path']}: {a['why']}; not used" in md and f"{b['why']}; not used" in md
    again = report.merge_results([merged, json.loads(runs["b"].read_text())])  # a re-merge: runs renumbered
    assert again["unusable_builds"] == [dict(a, run=3), dict(b, run=4)]
    capsys.readouterr()


def test_from_json_checks_the_unusable_builds(tmp_path, capsys):
    """`unusable_builds` is read by the merge: a file whose entries are not records with
    a path and a why is refused in one line naming the field, nothing written."""
    f = tmp_path / "x.json"
    base = {"meta": {"date": "d", "device": "cpu"}, "ceilings": {}}
    for value, needle in (("x", "its 'unusable_builds' is not a list of records (objects)"),
                          ([{"path": "p"}], "unusable_builds[0] has no 'why' field (expected a string)"),
                          ([{"path": 3, "why": "w"}], "unusable_builds[0].path: expected a string, got 3")):
        f.write_text(json.dumps(dict(base, unusable_builds=value)))
        code = main(["bench", "--from-json", str(f), "--no-plots", "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"flintc: error: --from-json {f}: ") and needle in err, err
        assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_no_flintc_point_names_the_unusable_builds_and_the_first_skipped_points():
    """`flintc_unmeasured`: the builds not used, then the first three notes of points
    skipped or not measured and how many more (`flintc.errors.listing`)."""
    from types import SimpleNamespace

    from flintc.bench.core import flintc_unmeasured

    o = SimpleNamespace(run_flintc=True, contexts=[64], batches=[1], prefill=[])
    notes = [f"b{i}: not measured" for i in range(5)] + ["an unrelated note"]
    assert flintc_unmeasured(o, {"notes": notes[:3]}) == "b0: not measured; b1: not measured; b2: not measured"
    assert flintc_unmeasured(o, {"notes": notes}) == \
        "b0: not measured; b1: not measured; b2: not measured; 2 more points skipped"
    assert flintc_unmeasured(o, {"unusable_builds": [{"path": "p", "why": "bad"}], "notes": notes[:1]}) == \
        "not used: p: bad; b0: not measured"
    assert flintc_unmeasured(o, {"notes": notes[5:]}) == "see the notes"
    assert flintc_unmeasured(o, {"decode": [{"engine": "flintc"}]}) is None


def test_exit_status_does_not_resolve_the_options_again_after_the_run(cpu_run, tmp_path, capsys, monkeypatch):
    """The exit status (`flintc_unmeasured`) resolved the options a second time after the
    run: a check of the machine's state then (the free memory, a MODEL or --builds
    folder) could turn a finished, measured run into exit 2 "flintc: error: ..." about an
    option. The options resolved before the run are used."""
    from flintc.bench import core
    from flintc.errors import InputError

    builds = _copy_build(cpu_run, tmp_path)
    calls = []
    real = core.BenchOptions.resolved

    def resolved(self):
        calls.append(1)
        if len(calls) > 2:  # the CLI's check, run_bench's own: then the machine changed
            raise InputError("resolved again after the run")
        return real(self)

    monkeypatch.setattr(core.BenchOptions, "resolved", resolved)
    code = main(_bench_on_builds(builds) + ["--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 0 and "resolved again" not in err, err
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["decode"]


def test_no_flintc_point_measured_still_counts_the_failures(cpu_run, tmp_path, capsys, monkeypatch):
    """When every flintc point failed (an error each: a failure record with its
    traceback), the exit line said only "no flintc point was measured: see the notes",
    dropping the line that counts the failed measurements and points at their
    tracebacks in bench.json."""
    from flintc.bench import core

    builds = _copy_build(cpu_run, tmp_path)

    def boom(*a, **k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(core._Bench, "_decode_point", boom)
    code = main(_bench_on_builds(builds) + ["--out", str(tmp_path / "o")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flintc: error")]
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("flintc: error: no flintc point was measured: ") and "1 measurement failed" in err[0], err
    assert str(tmp_path / "o" / "bench.json") in err[0], err


def test_from_json_knows_every_measurement_option():
    """Every option of bench but those --from-json reads (`FROM_JSON_OPTIONS`) records
    itself as a measurement's whenever typed (any spelling, its default value too), so
    that --from-json refuses it: a new option added without `_Given` fails here, rather
    than being ignored silently with --from-json."""
    import argparse

    from flintc.cli import build_parser
    from flintc.cli.bench import FROM_JSON_OPTIONS

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    options = [a for a in sub._actions if a.option_strings]
    assert {o for a in options for o in a.option_strings} >= {"--formats", "--no-flintc", "--out", "--no-plots"}
    for a in options:
        flag = a.option_strings[-1]
        if flag in FROM_JSON_OPTIONS or set(a.option_strings) & set(FROM_JSON_OPTIONS):
            continue
        value = [] if a.nargs == 0 else [str(a.choices[0]) if a.choices else
                                         str(a.default) if a.default is not None else "1"]
        for typed in ([flag, *value], [f"{flag}={value[0]}"] if value else [flag[:-1]]):
            ns = parser.parse_args(["bench", "--from-json", "x.json", "--out", "o", *typed])
            assert ns.measure_flags == (flag,), (typed, ns.measure_flags)
    ns = parser.parse_args(["bench", "--from-json", "x.json", "--no-plots", "--out", "o"])
    assert ns.measure_flags == () and ns.no_plots


def test_a_build_not_used_is_never_compiled_over(cpu_run, tmp_path):
    """user39b: OUT/builds/tiny-bf16 holding a build bench does not use (here: compiled for
    other weights; also another backend, an unreadable plan) was replaced by the build
    bench compiled for the missing format, under the same name: the user's build was
    gone. It is kept (a note says so) and the new build goes to the next free name."""
    builds = _copy_build(cpu_run, tmp_path)
    manifest = builds / "tiny-bf16" / "build.json"
    m = json.loads(manifest.read_text())
    m["weight_sha256"] = "0" * 64
    manifest.write_text(json.dumps(m))
    before = {p.name: p.read_bytes() for p in (builds / "tiny-bf16").iterdir() if p.is_file()}
    args = [a for a in _bench_on_builds(builds) if a != "--no-compile"]
    assert main(args + ["--out", str(tmp_path / "o")]) == 0
    assert {p.name: p.read_bytes() for p in (builds / "tiny-bf16").iterdir() if p.is_file()} == before
    res = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert [r["build"] for r in res["decode"]] == ["tiny-bf16-2"]
    assert any(n.startswith(f"bf16: {builds / 'tiny-bf16'} exists and is not used here; it is kept")
               for n in res["notes"]), res["notes"]


def test_builds_naming_a_build_is_refused(cpu_run, tmp_path, capsys):
    """user39b: --builds BUILD (a build, not the folder holding builds) skipped the build
    given (only subfolders are builds), compiled a new one inside it (BUILD/tiny-bf16)
    and exited 0. Now one line saying it is a build and how to use it, before anything
    is measured or written."""
    build = _copy_build(cpu_run, tmp_path) / "tiny-bf16"
    args = [a for a in _bench_on_builds(build) if a != "--no-compile"]
    code = main(args + ["--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"flintc: error: --builds {build}: is a build (it holds build.json), "
                                        f"expected the folder holding builds; pass --builds {build.parent} "
                                        "--build-glob tiny-bf16 to use it"), err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()
    assert sorted(p.name for p in build.iterdir() if p.is_dir()) == sorted(
        p.name for p in (cpu_run[0] / "builds" / "tiny-bf16").iterdir() if p.is_dir())


@pytest.mark.parametrize("where", ["out", "builds", "from-json"])
def test_out_or_builds_inside_a_build_is_refused(cpu_run, tmp_path, capsys, where):
    """user39b: --out or --builds inside a BUILD (BUILD/x) wrote the report, and compiled
    builds, into it: the next flintc compile into that BUILD replaced it whole, results
    and all. Now one line naming the flag and the BUILD, before anything is written."""
    build = _copy_build(cpu_run, tmp_path) / "tiny-bf16"
    inside = build / "x"
    if where == "from-json":
        args = ["bench", "--from-json", str(cpu_run[0] / "bench.json"), "--no-plots", "--out", str(inside)]
    elif where == "out":
        args = _bench_on_builds(tmp_path / "builds") + ["--out", str(inside)]
    else:
        args = [a for a in _bench_on_builds(inside) if a != "--no-compile"] + ["--out", str(tmp_path / "o")]
    code = main(args)
    err = capsys.readouterr().err
    flag = "--builds" if where == "builds" else "--out"
    assert code == 2 and err.startswith(f"flintc: error: {flag} {inside}: inside the flintc BUILD {build} "
                                        "(it holds build.json)"), err
    assert err.count("\n") == 1 and not inside.exists() and not (tmp_path / "o").exists()
