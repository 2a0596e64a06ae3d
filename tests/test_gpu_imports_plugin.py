"""`tests/gpu_imports.py`, the plugin that gives a CPU run a GPU machine's kernel imports:
under it, a test that runs Triton kernels on CPU tensors in-process fails as on a GPU
machine (InputError from `load_build`), and with FLINTC_TEST_FAKE_CUDA=1 the
`cpu_interpreter_only` mark skips it as on a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the plugin imports flintc's Triton kernels")

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tests/runtime/test_fold_attention_combine.py"


def run(tmp_path, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLINTC_TEST_FAKE_CUDA")}
    full.update(PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
                FLINTC_CACHE_DIR=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gpu_imports", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-rs", TARGET], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="emulates a GPU machine on a CPU one; on a GPU machine the mark skips the "
                           "test itself (tests/runtime/test_fold_attention_combine.py)")
def test_plugin_reproduces_the_gpu_failure_and_the_mark_skips_it(tmp_path):
    r = run(tmp_path)
    assert r.returncode == 1 and "1 failed, 1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert "was imported before TRITON_INTERPRET=1 was set" in r.stdout, r.stdout[-3000:]
    r = run(tmp_path, FLINTC_TEST_FAKE_CUDA="1")
    assert r.returncode == 0 and "1 passed, 1 skipped" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert "on the GPU: scripts/gpu_attn_fold.sh" in r.stdout
