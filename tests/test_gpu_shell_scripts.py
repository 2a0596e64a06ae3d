"""The GPU call scripts (`scripts/*.sh`) only run on the H200, so CI parses them: `bash -n`
catches a syntax error (an unclosed quote or `if`) before it costs a device call."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.sh"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, f"{script.name}: {r.stderr}"


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10 and any(s.name == "gpu_prefill_chunks.sh" for s in SCRIPTS)
