"""`scripts/gpu_serve_features.py` (prefix caching's second-turn time to first token and
structured outputs' decode step, for a GPU) runs on the CPU on the tiny checkpoint at
tiny settings: its tables have every row, positive times, no cached tokens with prefix
caching off and some with it on; bad arguments are one argparse line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_serve_features.py"


def _rows(text: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    rows = []
    for ln in lines[at + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def test_tiny_run_on_the_cpu(tiny_bf16_dir, tmp_path):
    out = tmp_path / "serve-features.md"
    r = subprocess.run([sys.executable, str(SCRIPT), str(tiny_bf16_dir), "--device", "cpu", "--max-model-len", "160",
                        "--max-batch", "8", "--turn1-len", "24", "--reply-len", "4", "--turn2-len", "4",
                        "--repeats", "2", "--batches", "1,8", "--prompt-len", "8", "--steps", "3", "--warmup", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text.strip() == r.stdout.strip()
    prefix = _rows(text, "| second turn |")
    assert [row[:2] for row in prefix] == [["chat template", "off"], ["chat template", "on"],
                                           ["continuation", "off"], ["continuation", "on"]]
    for case, on, n, cached, ttft in prefix:
        assert int(n) > 24 and float(ttft) > 0, prefix
        assert (int(cached) > 0) == (on == "on"), prefix
    # the continuation reuses the reply too: more than the chat template's first turn
    assert int(prefix[3][3]) > int(prefix[1][3])
    so = _rows(text, "| batch |")
    assert [row[:2] for row in so] == [["1", "none"], ["1", "JSON schema"], ["8", "none"], ["8", "JSON schema"]]
    for batch, kind, step, batched, serial, rowwise in so:
        assert float(step) > 0, so
        if kind == "none":
            assert batched == serial == rowwise == "-"
        else:
            assert float(batched) > 0 and float(serial) > 0 and float(rowwise) > 0, so
    assert re.search(r"tokenizer: .+", text)


def test_bad_arguments_are_one_line(tmp_path):
    for args, expect in ((["--batches", "1,x"], "--batches"), (["--steps", "0"], "--steps: must be at least 1")):
        r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                           check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr and expect in r.stderr, r.stderr
