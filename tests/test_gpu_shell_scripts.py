"""The GPU call scripts (`scripts/*.sh`) only run on the H200, so CI parses them: `bash -n`
catches a syntax error (an unclosed quote or `if`) before it costs a device call."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.sh"))


def _dry_run_env(tmp_path: Path, var: str) -> dict:
    """The environment of a GPU script's dry run: a stand-in Python (`fakepy`) that prints
    its arguments (`ARG[...]`) and the A/B variable `var` (`VAR[...]`), and the output
    and work folders in `tmp_path`."""
    fake = tmp_path / "fakepy"
    fake.write_text('#!/usr/bin/env bash\nprintf "ARG[%s]\\n" "$@"\n'
                    f'echo "VAR[${{{var}-unset}}]"\n')
    fake.chmod(0o755)
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(fake),
            "GPU_SITE": str(tmp_path / "site"), "OUT": str(tmp_path / "out"),
            "AB_WORK": str(tmp_path / "work")}


def run_script(name: str, tmp_path: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """`bash scripts/NAME` in `tmp_path` with exactly `env`; its output captured as text."""
    return subprocess.run(["bash", str(SCRIPTS[0].parent / name)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, f"{script.name}: {r.stderr}"


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10 and any(s.name == "gpu_prefill_chunks.sh" for s in SCRIPTS)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_env_ab_splits_tests_and_values_like_the_shell(tmp_path):
    """`scripts/gpu_env_ab.sh` dry-run with a stand-in Python that prints its arguments and
    the A/B variable: AB_TESTS is split as the shell would (a quoted `-k` expression stays
    one argument), AB_TESTS_VALUE sets the variable for the tests, and each AB_MOE value
    (`;`-separated; empty or "-": unset) runs `bench_moe.py` once with its own setting."""
    env = {**_dry_run_env(tmp_path, "FLINTC_AB_PROBE"), "AB_VAR": "FLINTC_AB_PROBE", "AB_TESTS": "tests/x.py -k 'a or b'",
           "AB_TESTS_VALUE": "v1", "AB_MOE": ";x y;-", "AB_SETS": "", "AB_RUNTIME": ""}
    r = run_script("gpu_env_ab.sh", tmp_path, env, 120)
    assert r.returncode == 0, r.stderr
    tests = (tmp_path / "out" / "tests.log").read_text().splitlines()
    assert tests[-4:] == ["ARG[tests/x.py]", "ARG[-k]", "ARG[a or b]", "VAR[v1]"]
    runs = [line for line in r.stdout.splitlines() if line.startswith("VAR[")]
    assert runs == ["VAR[v1]", "VAR[unset]", "VAR[x y]", "VAR[unset]"], r.stdout  # tests, moe
    # the flintc bench step: one run per AB_SETS value, the build patterns passed unexpanded
    # (the script runs in the repository root, where an unquoted READM* would become README.md)
    env.update(AB_MOE="", AB_TESTS="", AB_SETS="-", AB_BUILD_GLOB="READM*")
    r = run_script("gpu_env_ab.sh", tmp_path, env, 120)
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "work" / "bench-0.log").read_text().splitlines()
    assert log[log.index("ARG[--build-glob]") + 1] == "ARG[READM*]", log
    assert (tmp_path / "out" / "env_ab.tgz").stat().st_size > 0


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_env_ab_refuses_to_empty_a_work_folder_holding_out_or_the_repo(tmp_path):
    """`scripts/gpu_env_ab.sh` empties AB_WORK: it refuses (exit 1, nothing removed) a
    relative path, /, and a folder that holds OUT or the repository."""
    keep = tmp_path / "keep.txt"
    keep.write_text("x")
    root = Path(__file__).resolve().parents[1]
    for work in ("work", "/", str(tmp_path), str(root), str(root.parent) + "/"):
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": "/bin/false",
               "GPU_SITE": str(tmp_path / "site"), "OUT": str(tmp_path / "out"),
               "AB_WORK": work, "AB_TESTS": "", "AB_MOE": "", "AB_SETS": "", "AB_RUNTIME": ""}
        r = run_script("gpu_env_ab.sh", tmp_path, env, 120)
        assert r.returncode == 1 and "AB_WORK" in r.stderr, (work, r.stderr)
        assert keep.exists() and (root / "scripts" / "gpu_env_ab.sh").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_l2_prefetch_plan_dry_run(tmp_path):
    """`scripts/gpu_l2_prefetch.sh` (the planned H200 runs of the L2 prefetch) with a
    stand-in Python: part 1 runs the tests with one `-k` expression and `bench_moe.py` with
    FLINTC_MMA_L2_PREFETCH none / the in-kernel prefetches / all; another PART is refused."""
    env = _dry_run_env(tmp_path, "FLINTC_MMA_L2_PREFETCH")
    r = run_script("gpu_l2_prefetch.sh", tmp_path, env, 120)
    assert r.returncode == 0, r.stderr
    tests = (tmp_path / "out" / "tests.log").read_text().splitlines()
    k = tests[tests.index("ARG[-k]") + 1]
    assert k.startswith("ARG[moe_topk_gate_up_matches and (True-1- or True-8-) or") \
        and k.endswith("or converted]") and tests[-1] == "VAR[unset]", tests
    runs = [line for line in r.stdout.splitlines() if line.startswith("VAR[")]
    assert runs[1:3] == ["VAR[none]", "VAR[all]"], r.stdout
    r = run_script("gpu_l2_prefetch.sh", tmp_path, {**env, "PART": "3"}, 60)
    assert r.returncode == 1 and "PART must be 1 or 2" in r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_attn_fold_plan_dry_run(tmp_path):
    """`scripts/gpu_attn_fold.sh` (the planned H200 run of the folded attention combine)
    with a stand-in Python and stand-in builds: the fused-launch GPU tests, the model
    benched on the full-nvfp4* and fold-nvfp4* builds alternately, the 4-layer check on the
    fold4d builds; without the builds it stops first, naming the missing one."""
    env = {**_dry_run_env(tmp_path, "FLINTC_DECODE_ATTN_PRELOAD"), "BUILDS": str(tmp_path / "b")}
    r = run_script("gpu_attn_fold.sh", tmp_path, env, 60)
    assert r.returncode == 1 and "full-nvfp4 missing: run scripts/gpu_builds.sh" in r.stderr
    for b in ("full-nvfp4", "full-nvfp4-b1", "fold-nvfp4", "fold-nvfp4-b1", "fold4d-nvfp4-b1"):
        (tmp_path / "b" / b).mkdir(parents=True)
        (tmp_path / "b" / b / "build.json").write_text("{}")
    r = run_script("gpu_attn_fold.sh", tmp_path, env, 120)
    assert r.returncode == 0, r.stderr
    work = tmp_path / "work"
    tests = (work / "tests.log").read_text()
    assert "ARG[(combine_gpu and (1K-context or 100K or B8-mixed or ring)) or cuda_graph]" in tests \
        and "ARG[-m]" in tests
    assert "ARG[route_topk_rows]" in (work / "route.log").read_text()
    globs = []
    for i in range(4):
        args = (work / f"bench-{i}.log").read_text().splitlines()
        globs.append(args[args.index("ARG[--build-glob]") + 1])
    assert globs == ["ARG[full-nvfp4*]", "ARG[fold-nvfp4*]"] * 2
    check = (work / "check.log").read_text().splitlines()
    assert check[check.index("ARG[--build-prefix]") + 1] == "ARG[fold4d]"
    assert (tmp_path / "out" / "attn_fold.tgz").is_file()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sampler_plan_dry_run(tmp_path):
    """`scripts/gpu_sampler_ab.sh` (the planned H200 run of the one-launch sampler) with a
    stand-in Python: the sampler tests with FLINTC_SAMPLER=triton and every test of the
    two files (`-m 'gpu or not gpu'` after the script's `-m gpu`), then flintc bench with
    torch, then triton."""
    env = _dry_run_env(tmp_path, "FLINTC_SAMPLER")
    r = run_script("gpu_sampler_ab.sh", tmp_path, env, 120)
    assert r.returncode == 0, r.stderr
    tests = (tmp_path / "out" / "tests.log").read_text().splitlines()
    assert tests[-1] == "VAR[triton]" and "ARG[gpu or not gpu]" in tests, tests
    assert "ARG[tests/kernels/test_sampler.py]" in tests
    micro = [line for line in r.stdout.splitlines() if line.startswith("VAR[")]
    # the tests (triton), then per value the profile and the end-to-end runs at b1 and b8
    assert micro == ["VAR[triton]"] + ["VAR[torch]"] * 3 + ["VAR[triton]"] * 3, r.stdout
    sets = [line for line in r.stdout.splitlines() if line.startswith("FLINTC_SAMPLER=")]
    assert sets == ["FLINTC_SAMPLER=torch", "FLINTC_SAMPLER=triton"], r.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_ring_launch_plan_dry_run(tmp_path):
    """`scripts/gpu_ring_launch.sh` (session 25's follow-up run) with a stand-in Python and
    stand-in builds: the ring and sampler GPU tests with FLINTC_SAMPLER unset, the ring
    sweep, and four model benches: the defaults, the ring launch, the gate/up launch, the
    defaults again (each setting in its own bench alone)."""
    env = {**_dry_run_env(tmp_path, "FLINTC_SAMPLER"), "BUILDS": str(tmp_path / "b")}
    fake = tmp_path / "fakepy"
    fake.write_text('#!/usr/bin/env bash\nprintf "ARG[%s]\\n" "$@"\n'
                    'echo "RING[${FLINTC_DECODE_ATTN_RING_LAUNCH-unset}]"\n'
                    'echo "GATE_UP[${FLINTC_MMA_GATE_UP_LAUNCH-unset}]"\n'
                    'echo "SAMPLER[${FLINTC_SAMPLER-unset}]"\n')
    r = run_script("gpu_ring_launch.sh", tmp_path, env, 60)
    assert r.returncode == 1 and "full-nvfp4 missing: run scripts/gpu_builds.sh" in r.stderr
    for b in ("full-nvfp4", "full-nvfp4-b1"):
        (tmp_path / "b" / b).mkdir(parents=True)
        (tmp_path / "b" / b / "build.json").write_text("{}")
    r = run_script("gpu_ring_launch.sh", tmp_path, {**env, "FLINTC_SAMPLER": "torch"}, 120)
    assert r.returncode == 0, r.stderr
    work = tmp_path / "work"
    tests = (work / "tests.log").read_text()
    assert "ARG[tests/kernels/test_sampler.py]" in tests and "SAMPLER[unset]" in tests
    assert "ARG[--sweep-ring-only]" in (work / "micro.log").read_text()
    sets = []
    for i in range(4):
        log = (work / f"bench-{i}.log").read_text().splitlines()
        assert log[log.index("ARG[--build-glob]") + 1] == "ARG[full-nvfp4*]"
        sets.append([line for line in log if line.startswith(("RING[", "GATE_UP["))])
    assert sets == [["RING[unset]", "GATE_UP[unset]"], ["RING[2=32,2,2,1]", "GATE_UP[unset]"],
                    ["RING[unset]", "GATE_UP[nvfp4:4=2,1,0/nvfp4:8=2,1,0]"],
                    ["RING[unset]", "GATE_UP[unset]"]]
    assert (tmp_path / "out" / "ring_launch.tgz").is_file()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_split_layout_plan_dry_run(tmp_path):
    """`scripts/gpu_split_layout.sh` (session 26) with a stand-in Python, stand-in builds
    and an old tree: the short-context microbenchmark on both trees, four model benches
    (old, new, new with FLINTC_DECODE_ATTN_MIN_ROWS, old; the old ones run in the old
    tree), then the GPU tests, the sampler's launch sweep and the 4-layer check."""
    env = {**_dry_run_env(tmp_path, "FLINTC_DECODE_ATTN_MIN_ROWS"), "BUILDS": str(tmp_path / "b"),
           "AB_OLD": str(tmp_path / "old")}
    r = run_script("gpu_split_layout.sh", tmp_path, env, 60)
    assert r.returncode == 1 and "full-nvfp4 missing: run scripts/gpu_builds.sh" in r.stderr
    for b in ("full-nvfp4", "full-nvfp4-b1"):
        (tmp_path / "b" / b).mkdir(parents=True)
        (tmp_path / "b" / b / "build.json").write_text("{}")
    (tmp_path / "old").mkdir()
    (tmp_path / "fakepy").write_text('#!/usr/bin/env bash\nprintf "ARG[%s]\\n" "$@"\n'
                                     'echo "VAR[${FLINTC_DECODE_ATTN_MIN_ROWS-unset}]"\n'
                                     'echo "CWD[$PWD]"\n')
    r = run_script("gpu_split_layout.sh", tmp_path, env, 120)
    assert r.returncode == 0, r.stderr
    work = tmp_path / "work"
    for name in ("micro-new", "micro-old"):
        assert "ARG[--short-only]" in (work / f"{name}.log").read_text()
    assert f"CWD[{tmp_path / 'old'}]" in (work / "micro-old.log").read_text()
    seen = []
    for i in range(4):
        log = (work / f"bench-{i}.log").read_text().splitlines()
        assert log[log.index("ARG[--build-glob]") + 1] == "ARG[full-nvfp4*]"
        seen.append((next(x for x in log if x.startswith("VAR[")),
                     next(x for x in log if x.startswith("CWD[")) == f"CWD[{tmp_path / 'old'}]"))
    assert seen == [("VAR[unset]", True), ("VAR[unset]", False), ("VAR[64]", False),
                    ("VAR[unset]", True)]
    assert "ARG[tests/kernels/test_decode_attention.py]" in (work / "tests.log").read_text()
    assert "ARG[--launch-sweep]" in (work / "sampler.log").read_text()
    assert "ARG[full4d]" in (work / "check.log").read_text()
    assert (tmp_path / "out" / "split_layout.tgz").is_file()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_prefill_logits_rows_plan_dry_run(tmp_path):
    """`scripts/gpu_prefill_logits_rows.sh` (session 31) with a stand-in Python: the new
    code's steps import the working tree, the old code's steps gpu_builds/old-src (its
    own copy of the script, on the old builds), then the 4-layer check."""
    env = _dry_run_env(tmp_path, "PYTHONPATH")
    r = run_script("gpu_prefill_logits_rows.sh", tmp_path, env, 120)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    repo = SCRIPTS[0].parent.parent
    logs = {name: (out / f"{name}.log").read_text() for name in
            ("new_graph", "new_peak", "old_graph", "old_peak", "runtime4")}
    for name, log in logs.items():
        path = next(x for x in log.splitlines() if x.startswith("VAR["))[4:-1].split(":")
        old = str(repo / "gpu_builds" / "old-src")
        assert (old in path) == name.startswith("old_") and (str(repo) in path) != name.startswith("old_"), \
            (name, path)
    assert f"ARG[{repo / 'gpu_builds' / 'old-src' / 'scripts' / 'gpu_prefill_graph.py'}]" not in logs["old_graph"]
    assert "ARG[gpu_builds/old-src/scripts/gpu_prefill_graph.py]" in logs["old_graph"]
    assert "ARG[gpu_builds/old]" in logs["old_graph"] and "ARG[gpu_builds/old/full-nvfp4-b1]" in logs["old_peak"]
    assert "ARG[scripts/gpu_runtime.py]" in logs["runtime4"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_suite_runs_pytest_and_summarises(tmp_path):
    """`scripts/gpu_suite.sh` (README's suite on a GPU machine) with this machine's Python
    on a small test file: the GPU tests deselected but the `gpu_suite` ones (`-m "not gpu or
    gpu_suite"`), one torch thread per worker, and suite.md naming the failed test, the skip
    reason and the counts; the exit status is pytest's."""
    import sys

    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os\nimport pytest\n\n"
        "def test_ok():\n    assert os.environ['OMP_NUM_THREADS'] == '1'\n\n"
        "def test_broken():\n    assert 1 == 2\n\n"
        "@pytest.mark.skip(reason='a stated reason')\ndef test_skipped():\n    pass\n\n"
        "@pytest.mark.gpu\ndef test_on_the_gpu():\n    raise AssertionError('deselected')\n\n"
        "@pytest.mark.gpu\n@pytest.mark.gpu_suite\ndef test_in_the_suite():\n    pass\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "GPU_WHEELS": str(tmp_path / "no-wheels"), "SUITE_ARGS": str(probe), "SUITE_WORKERS": "2",
           "SUITE_BUDGET_S": "300", "FLINTC_CACHE_DIR": str(tmp_path / "cache")}
    r = run_script("gpu_suite.sh", tmp_path, env, 320)
    assert r.returncode == 1, r.stdout + r.stderr
    md = (tmp_path / "out" / "suite.md").read_text()
    assert "finished: 1 failed, 2 passed, 1 skipped" in md, md
    assert "pytest summary: 1 failed, 2 passed, 1 skipped" in md, md  # test_on_the_gpu deselected
    assert "test_on_the_gpu" not in (tmp_path / "out" / "suite.log").read_text()
    assert "test_probe.py::test_broken" in md and "a stated reason" in md, md
    assert "## started, never finished (0)" in md, md


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("rerun_passes", [True, False])
def test_kernels_reruns_out_of_memory_failures_alone(tmp_path, rerun_passes):
    """`scripts/gpu_kernels.sh` with a stand-in Python whose xdist run fails two tests out
    of GPU memory (one test id holding spaces): those two run again in one process, each
    node id one argument, the report shows both runs, and the exit status is the rerun's."""
    fake = tmp_path / "fakepy"
    rerun_rc = 0 if rerun_passes else 1
    fake.write_text(f"""#!/usr/bin/env bash
case " $* " in
  *" -c "*) exit 0 ;;
  *" -n "*)
    echo "E   torch.OutOfMemoryError: CUDA out of memory."
    echo "=========================== short test summary info ============================"
    echo "FAILED tests/kernels/test_a.py::test_big[bf16-m16 f128 k128 w4 st2 even-odd] - torch.OutOfMemoryError"
    echo "FAILED tests/kernels/test_a.py::test_plain"
    echo "============= 2 failed, 5 passed in 9.00s ============="
    exit 1 ;;
  *" pytest "*)
    printf "ARG[%s]\\n" "$@" >"$OUT/rerun_args.txt"
    echo "2 passed in 1.00s"
    exit {rerun_rc} ;;
esac
exit 0
""")
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(fake), "OUT": str(tmp_path / "out"),
           "KERNELS_BENCHES": "bench_pdl.py", "KERNELS_BUDGET_S": "200"}
    r = run_script("gpu_kernels.sh", tmp_path, env, 120)
    assert r.returncode == (0 if rerun_passes else 1), r.stdout + r.stderr
    args = (tmp_path / "out" / "rerun_args.txt").read_text().splitlines()
    assert "ARG[-n]" not in args, args
    assert args[-2:] == ["ARG[tests/kernels/test_a.py::test_big[bf16-m16 f128 k128 w4 st2 even-odd]]",
                         "ARG[tests/kernels/test_a.py::test_plain]"], args
    report = (tmp_path / "out" / "kernels.md").read_text()
    assert "FAILED, exit status 1" in report and "The 2 failed tests again, in one process" in report, report
    assert "2 passed in 1.00s" in report


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_kernels_lists_the_tests_a_cut_run_did_not_reach_and_runs_them_from_a_file(tmp_path):
    """`scripts/gpu_kernels.sh` whose pytest step is cut by its cap (a stand-in Python that
    logs two outcomes, xdist's form and the plain one, then hangs): the collected tests
    with no outcome go to pytest_gpu_unrun.txt (a node id with spaces whole, the started
    but unfinished one included) and the report says so; given back as KERNELS_TESTS_FILE,
    each line is one pytest argument (comments and blank lines skipped)."""
    fake = tmp_path / "fakepy"
    fake.write_text("""#!/usr/bin/env bash
case " $* " in
  *" -c "*) exit 0 ;;
  *" --collect-only "*)
    echo "tests/kernels/test_a.py::test_done[x]"
    echo "tests/kernels/test_a.py::test_plain_done"
    echo "tests/kernels/test_a.py::test_plain_skipped"
    echo "tests/kernels/test_a.py::test_big[bf16-m16 f128 k128 w4 st2]"
    echo "tests/kernels/test_b.py::test_running"
    echo ""
    echo "5 tests collected in 0.10s"
    exit 0 ;;
  *" pytest "*)
    printf "ARG[%s]\\n" "$@" >"$OUT/pytest_args.txt"
    echo "[gw0] [ 25%] PASSED tests/kernels/test_a.py::test_done[x] "
    echo "tests/kernels/test_a.py::test_plain_done PASSED                 [ 50%]"
    echo "tests/kernels/test_a.py::test_plain_skipped SKIPPED (no GPU: x) [ 75%]"
    echo "tests/kernels/test_b.py::test_running "
    sleep 60 ;;
esac
exit 0
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(fake), "OUT": str(out),
           "KERNELS_BENCHES": "bench_pdl.py", "KERNELS_BUDGET_S": "60", "KERNELS_PYTEST_S": "5",
           "KERNELS_PYTEST_WORKERS": "1"}
    r = run_script("gpu_kernels.sh", tmp_path, env, 120)
    assert r.returncode == 1, r.stdout + r.stderr  # the cut counts as a failure
    unrun = (out / "pytest_gpu_unrun.txt").read_text().splitlines()
    assert unrun == ["tests/kernels/test_a.py::test_big[bf16-m16 f128 k128 w4 st2]",
                     "tests/kernels/test_b.py::test_running"], unrun
    report = (out / "kernels.md").read_text()
    assert "TIMED OUT" in report and "2 tests not reached" in report, report
    ids = tmp_path / "ids.txt"
    ids.write_text("# the rest of session 46\n\n" + "\n".join(unrun) + "\n")
    env["KERNELS_TESTS_FILE"] = str(ids)
    run_script("gpu_kernels.sh", tmp_path, env, 120)
    args = (out / "pytest_args.txt").read_text().splitlines()
    assert args[-2:] == [f"ARG[{u}]" for u in unrun], args
    env["KERNELS_TESTS_FILE"] = str(tmp_path / "missing.txt")
    r = run_script("gpu_kernels.sh", tmp_path, env, 120)
    assert r.returncode == 2 and "missing.txt: no such readable file" in r.stderr, r.stderr
