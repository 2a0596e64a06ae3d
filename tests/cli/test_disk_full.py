"""A full disk (or a quota) while writing an output: one line that names the output the
user gave and the file being written, no traceback, no partial output and no temporary
file left (`flintc.fileio.naming_write_errors` / `final_output_error`).

Before (a new-user test on a 200 KB tmpfs, session 37): `make-checkpoint` printed a bare
safetensors traceback (SafetensorError is not an OSError); compile, dump and bench said
"No space left on device" without a path; `run --logits-out` and an NVFP4 checkpoint said
numpy's "18432 requested and 10784 written"; bench left a truncated bench.json.tmp. The
full disk is simulated here by the error each writer raises on one."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from harness import assert_one_line_error, run_cli


class SafetensorError(Exception):
    """What safetensors' Rust writer raises on a full disk (matched by class name)."""


def _left_in(folder) -> list[str]:
    return sorted(os.listdir(folder))


class _Full:
    """A file opened by `os.fdopen` on a full disk: a write stores a few bytes, then
    raises ENOSPC."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def write(self, text):
        self.f.write(text[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __exit__(self, *exc):
        self.f.close()


def test_bf16_checkpoint_on_a_full_disk(capsys, tmp_path, monkeypatch):
    from flintc.checkpoint import safetensors_io

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors_io, "save_file", full)
    code, _, err = run_cli(capsys, "make-checkpoint", "--out", tmp_path / "ck")
    assert_one_line_error(code, err, f"{tmp_path / 'ck'}: No space left on device (writing model.safetensors)")
    assert _left_in(tmp_path) == []


def test_nvfp4_checkpoint_short_write(capsys, tmp_path, monkeypatch):
    from gguf import GGUFWriter

    def short(self, *args, **kwargs):
        raise OSError("18432 requested and 10784 written")  # numpy's tofile on a full disk

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", short)
    code, _, err = run_cli(capsys, "make-checkpoint", "--format", "nvfp4", "--out", tmp_path / "ck")
    assert_one_line_error(code, err, f"{tmp_path / 'ck'}: short write (18432 bytes requested, 10784 "
                          "written): the disk or a quota is probably full (writing model-nvfp4.gguf)")
    assert _left_in(tmp_path) == []


def test_gguf_header_write_error_is_not_hidden_by_the_close(tmp_path, monkeypatch):
    """A full disk while the GGUF header and metadata sit in the writer's buffer: the
    cleanup's `close()` flushes and fails again; that second error used to replace the
    named one (a bare "No space left on device") and skip the temporary file's removal."""
    from gguf import GGUFWriter

    from flintc.checkpoint.gguf_io import save_gguf
    from flintc.checkpoint.init import random_weights
    from flintc.config import FlintConfig

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(GGUFWriter, "write_kv_data_to_file", full)
    monkeypatch.setattr(GGUFWriter, "close", full)
    cfg = FlintConfig.preset("tiny")
    with pytest.raises(OSError) as e:
        save_gguf(cfg, random_weights(cfg, seed=0), tmp_path / "m.gguf")
    assert (e.value.filename, e.value.errno) == (str(tmp_path / "m.gguf"), errno.ENOSPC)
    assert _left_in(tmp_path) == []


def test_logits_file_short_write_names_it_and_leaves_nothing(tmp_path, monkeypatch):
    from flintc.cli import run

    target = tmp_path / "l.npy"
    target.write_bytes(b"before")

    def short(f, array):
        f.write(b"x" * 10)
        raise OSError("204288 requested and 51168 written")

    monkeypatch.setattr(np, "save", short)
    with pytest.raises(OSError) as e:
        run._save_npy_atomic(str(target), np.zeros(3))
    assert e.value.filename == str(target) and "short write" in e.value.strerror
    assert target.read_bytes() == b"before" and _left_in(tmp_path) == ["l.npy"]


def test_atomic_text_write_on_a_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    """`write_text_atomic` (bench.json, bench.md, manifests, tokenizer files): a write
    that fails leaves the previous file whole and no temporary file; the OSError names
    the file. Before, flintc bench left a truncated bench.json.tmp."""
    from flintc import fileio

    target = tmp_path / "bench.json"
    target.write_text('{"old": 1}')
    real_fdopen = os.fdopen
    monkeypatch.setattr(fileio.os, "fdopen", lambda fd, *a, **k: _Full(real_fdopen(fd, *a, **k)))
    with pytest.raises(OSError) as e:
        fileio.write_text_atomic(target, '{"new": 2}')
    assert e.value.filename == str(target) and e.value.errno == errno.ENOSPC
    assert target.read_text() == '{"old": 1}' and _left_in(tmp_path) == ["bench.json"]


def test_atomic_write_onto_a_folder_is_refused_naming_it(tmp_path):
    """`write_text_atomic` is `write_texts_atomic` with one file: a path that is a folder
    is refused naming it (os.replace's error named the temporary file too) and no
    temporary file is left."""
    from flintc import fileio

    (tmp_path / "bench.json").mkdir()
    with pytest.raises(IsADirectoryError) as e:
        fileio.write_text_atomic(tmp_path / "bench.json", "{}")
    assert e.value.filename == str(tmp_path / "bench.json") and e.value.filename2 is None
    assert _left_in(tmp_path) == ["bench.json"]


def test_atomic_pair_write_on_a_full_disk_keeps_both_old_files(tmp_path, monkeypatch):
    """`write_texts_atomic` (bench.json with bench.md): the second file's write failing
    leaves both files as they were (the first is not renamed into place alone) and no
    temporary file; a path that is a folder is refused before any rename."""
    from flintc import fileio

    a, b = tmp_path / "bench.json", tmp_path / "bench.md"
    a.write_text("old a")
    b.write_text("old b")
    real_fdopen = os.fdopen
    calls = []

    def fdopen(fd, *args, **kwargs):
        calls.append(fd)
        f = real_fdopen(fd, *args, **kwargs)
        return f if len(calls) == 1 else _Full(f)

    monkeypatch.setattr(fileio.os, "fdopen", fdopen)
    with pytest.raises(OSError) as e:
        fileio.write_texts_atomic({a: "new a", b: "new b"})
    assert e.value.filename == str(b) and e.value.errno == errno.ENOSPC
    assert (a.read_text(), b.read_text()) == ("old a", "old b") and _left_in(tmp_path) == ["bench.json", "bench.md"]
    monkeypatch.undo()
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        fileio.write_texts_atomic({a: "new a", tmp_path / "d": "x"})
    assert a.read_text() == "old a" and _left_in(tmp_path) == ["bench.json", "bench.md", "d"]
    fileio.write_texts_atomic({a: "new a", b: "new b"})
    assert (a.read_text(), b.read_text()) == ("new a", "new b")
    assert _left_in(tmp_path) == ["bench.json", "bench.md", "d"]


def test_atomic_write_into_a_fifo_writes_into_it(tmp_path):
    """Regression: `write_texts_atomic` renamed its temporary file over a FIFO (verify
    --json /dev/stdout on a pipe; as root, /dev/null became a regular file): a device,
    FIFO or socket is written into, the other files still renamed into place."""
    import stat

    from harness import fifo_read

    from flintc import fileio

    fifo, a = tmp_path / "fifo", tmp_path / "a.json"
    with fifo_read(fifo) as got:
        fileio.write_texts_atomic({a: "new a", fifo: '{"passed": true}'})
    assert got == [b'{"passed": true}'] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert a.read_text() == "new a" and _left_in(tmp_path) == ["a.json", "fifo"]
    assert fileio.is_special_file(os.devnull) and not fileio.is_special_file(a)
    assert not fileio.is_special_file(tmp_path) and not fileio.is_special_file(tmp_path / "missing")


def test_atomic_write_of_bytes_into_a_device_or_fifo(tmp_path):
    """`write_texts_atomic` takes bytes (bench's PNGs) as well as text; a device or FIFO
    among its paths was opened in text mode, so bytes for it were a TypeError after the
    other files had been renamed into place. Written as they are."""
    from harness import fifo_read

    from flintc import fileio

    fileio.write_texts_atomic({os.devnull: b"\x89PNG\r\n", tmp_path / "a.md": "a"})
    assert (tmp_path / "a.md").read_text() == "a"
    with fifo_read(tmp_path / "fifo") as got:
        fileio.write_texts_atomic({tmp_path / "fifo": b"\x89PNG\xff"})
    assert got == [b"\x89PNG\xff"]


def test_final_output_error_names_the_output_not_the_hidden_folder(tmp_path):
    from flintc.fileio import final_output_error, naming_write_errors

    tmp, out = tmp_path / ".b.123.tmp", tmp_path / "b"
    exc = OSError(errno.ENOSPC, "No space left on device", str(tmp / "dumps" / "x.py"))
    got = final_output_error(exc, tmp, out)
    assert (got.filename, got.errno) == (str(out), errno.ENOSPC)
    assert got.strerror == f"No space left on device (writing {os.path.join('dumps', 'x.py')})"
    assert final_output_error(OSError(errno.ENOSPC, "full", str(tmp_path / "other")), tmp, out) is None
    moved = final_output_error(OSError(errno.ENOTEMPTY, "Directory not empty", str(tmp)), tmp, out)
    assert moved.strerror == "Directory not empty (moving the new output into place)"  # not "writing ."
    assert final_output_error(ValueError("x"), tmp, out) is None
    named = OSError(errno.EACCES, "Permission denied", "/elsewhere")  # already names a file: kept
    with pytest.raises(OSError) as e, naming_write_errors(tmp_path / "f"):
        raise named
    assert e.value is named
    with pytest.raises(RuntimeError), naming_write_errors(tmp_path / "f"):  # not a write error
        raise RuntimeError("other")
