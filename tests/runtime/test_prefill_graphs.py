"""Prefill from a CUDA graph (`CompiledRunner.prefill_graph`), checked on the CPU.

A GPU prefill runs the generated `prefill_t{C}` with the triton backend: the Triton
prefill attention, the MoE route (cuBLAS + torch sort), the grouped expert GEMMs
(Triton for NVFP4; torch's grouped_mm for BF16 on sm_90), cuBLAS GEMMs, the Triton norms
and elementwise kernels (`flintc.kernels.prefill_norm`), plus aten glue. Here:

* the whole generated function runs with those implementations (Triton's interpreter,
  the MoE impl CUDA would pick) under `forbid_host_sync()`: no host sync, no copy of
  host data, no allocation sized by a device value anywhere on the path;
* with the Triton norms its logits and caches agree with the CPU's torch bodies;
* the runner's graph path (static input buffers, one replay per chunk, the sliding
  rows of a padded last chunk saved and restored around the replay, logits cloned out
  of the static output, the capture's warm-up on slot 0 saved and restored) runs with a
  stand-in for the CUDA graph that re-runs the function into the static output: its
  logits and KV caches must equal the eager path's bit for bit, and no other slot
  may change;
* FLINTC_PREFILL_GRAPHS and the backend decide whether prefill uses a graph.

What the CPU cannot show (a real capture, cuBLAS / CUTLASS under capture, replay
timing) is `scripts/gpu_prefill_graph.py`'s job on a GPU.
"""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend needs triton")

from flintc.checkpoint.loader import load_checkpoint
from flintc.errors import InputError
from flintc.runtime.compiled import CompiledRunner, load_build
from harness import cpu_interpreter_only

MAX_LEN = 48


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Tiny dummy-weight builds (triton backend, CPU), one decode bucket each (compile
    time): NVFP4 with 1 slot, BF16 with 2 (the graph-path test prefills slot 1 while slot 0
    holds a live sequence); prefill chunk 8 (W = 9); and BF16 with chunks of 16 (longer
    than W: a second, 8-token tail function)."""
    from flintc.runtime.build import BuildOptions, compile_model

    root = tmp_path_factory.mktemp("prefill_graphs")
    out = {}
    for name, fmt, slots, chunk in (("nvfp4", "nvfp4", 1, None), ("bf16", "bf16", 2, None),
                                    ("bf16-c16", "bf16", 2, 16)):
        ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt=fmt, progress=False)
        compile_model(ckpt, root / name, BuildOptions(max_batch=slots, decode_buckets=(slots,), max_model_len=MAX_LEN,
                                                      prefill_chunk=chunk, backend="triton", device="cpu",
                                                      check=False, dump=False),
                      progress=False, log=lambda m: None)
        out[name] = (root / name, ckpt)
    return out


def runner_for(builds, fmt, backend=None, **kw):
    path, ckpt = builds[fmt]
    if backend is None:
        return load_build(path, ckpt=ckpt, progress=False, **kw)
    from flintc.runtime.compiled import read_manifest

    # the generated functions do not depend on the backend, only the kernel table does
    return CompiledRunner(path, dict(read_manifest(path), backend=backend), ckpt, torch.device("cpu"), **kw)


@cpu_interpreter_only("scripts/gpu_prefill_graph.py captures the prefill graphs (a host sync fails the capture)")
@pytest.mark.parametrize("fmt,moe_impl", [("nvfp4", "triton"), ("bf16", "triton"),
                                           ("bf16", "grouped_mm")])
def test_generated_prefill_has_no_host_sync(builds, fmt, moe_impl, monkeypatch):
    """The generated prefill function with the kernels a GPU runs, under forbid_host_sync:
    the MoE through triton (what "auto" picks on a GPU; on the CPU "auto" would take the
    loop fallback for NVFP4, which syncs: that is the CPU path) or, for BF16, torch's
    grouped_mm (sync-free on sm_90 / sm_100)."""
    from flintc.kernels import grouped_gemm as GG
    from flintc.kernels import prefill_ops as P
    from flintc.runtime.hostsync import forbid_host_sync

    real = GG._pick_impl
    monkeypatch.setattr(GG, "_pick_impl", lambda op, impl, nvfp4, dev: real(op, moe_impl, nvfp4, dev))
    monkeypatch.setattr(P, "_use_triton", lambda t: True)  # the Triton norms, as on CUDA
    runner = runner_for(builds, fmt)
    assert runner.backend == "triton" and runner.prefill_graphs and not runner.use_cuda_graphs
    C = runner.prefill_chunk
    name = f"prefill_t{C}"
    ids = torch.randint(0, runner.config.vocab_size, (1, C), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5, 5 + C)[None]
    slots, rows = torch.tensor([0]), torch.tensor([C - 3])
    with forbid_host_sync():
        logits, hidden = runner.forward(name, ids, pos, slots, rows)
        every = runner.logits_from_hidden(hidden[0])  # what all_logits computes
    assert logits.shape == (1, runner.config.vocab_size) and bool(torch.isfinite(logits).all())
    assert hidden.shape == (1, C, runner.config.hidden_size) and every.shape == (C, runner.config.vocab_size)


@cpu_interpreter_only("tests/kernels/test_prefill_norm.py, and the 4-layer prefill check of scripts/gpu_runtime.py")
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_prefill_norm_kernels_match_the_cpu_path(builds, fmt, monkeypatch):
    """The generated prefill with the Triton norms and elementwise kernels a GPU runs
    (`flintc.kernels.prefill_norm`, `add_rms_norm` included) against the same function with
    the CPU's torch bodies (bit-identical to the reference ops), from the same cache
    contents: logits within the pipelines' tolerance (atol 0.06, rtol 0.02,
    tests/runtime/test_compiled.py), and the KV caches written alike."""
    from flintc.kernels import prefill_ops as P

    runner = runner_for(builds, fmt)
    C = runner.prefill_chunk
    name = f"prefill_t{C}"
    assert "K.add_rms_norm(" in (runner.build / "runtime.py").read_text()
    ids = torch.randint(0, runner.config.vocab_size, (1, C), generator=torch.Generator().manual_seed(2))
    pos, slots = torch.arange(5, 5 + C)[None], torch.tensor([0])
    fill(runner, 3)  # an earlier chunk's keys and values
    before = [t.clone() for t in runner.kv]
    want, want_h = (t.clone() for t in runner.forward(name, ids, pos, slots))
    want_kv = [t.clone() for t in runner.kv]
    for t, b in zip(runner.kv, before):
        t.copy_(b)
    monkeypatch.setattr(P, "_use_triton", lambda t: True)
    got, got_h = runner.forward(name, ids, pos, slots)
    print(f"{fmt}: logits max abs diff {(got - want).abs().max().item():.3g}, "
          f"{(got != want).float().mean().item():.2%} differ")
    assert torch.allclose(got, want, atol=0.06, rtol=0.02)
    assert torch.allclose(got_h.float(), want_h.float(), atol=0.06, rtol=0.02)
    for a, b in zip(runner.kv, want_kv):
        assert torch.allclose(a.float(), b.float(), atol=0.06, rtol=0.02)


class StandInGraph:
    """torch.cuda.CUDAGraph's part the runner uses, on the CPU: `replay()` runs the
    captured function again and copies its output into the static output tensor (each
    of them: a prefill function returns logits and hidden states)."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        new = self.fn()
        if isinstance(self.out, tuple):
            for a, b in zip(self.out, new):
                a.copy_(b)
        else:
            self.out.copy_(new)


def stand_in_graph_of(fn):
    """`CompiledRunner._graph_of` without CUDA: the two warm-ups, then a 'capture' that
    (unlike a real one) executes, so the runner must also undo what it writes."""
    fn()
    fn()
    out = fn()
    return StandInGraph(fn, out), out


def fill(runner, seed):
    g = torch.Generator().manual_seed(seed)
    for t in runner.kv:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


@pytest.mark.parametrize("build,pieces", [("bf16", [8, 8, 8]), ("bf16-c16", [16, 8])])
def test_graph_path_equals_eager_path(builds, monkeypatch, build, pieces):
    """Prefill 20 tokens (chunks 8, 8, 4+4 padding; with 16-token chunks: 16, then 4+4
    padding in the tail function) then 5 more at start 20, into slot 1, once through the
    graph path (one graph per chunk size) and once eagerly, from the same cache
    contents; slot 0 (where each capture warms up) holds a live sequence that must not
    change."""
    runner = runner_for(builds, build, backend="torch")  # fast reference ops; same function
    runner.use_cuda_graphs = runner.prefill_graphs = True
    monkeypatch.setattr(runner, "_graph_of", stand_in_graph_of)
    prompt = [(7 * i + 3) % runner.config.vocab_size for i in range(25)]
    assert [p[2] for p in runner.prefill_pieces(20)] == pieces and runner.config.sliding_window == 9

    def run(graphs):
        fill(runner, 0)
        runner.prefill_graphs = graphs
        live = [t[0].clone() for t in runner.kv]
        a = runner.prefill(1, prompt[:20], all_logits=True)
        b = runner.prefill(1, prompt[20:], start=20)
        assert all(torch.equal(t[0], k) for t, k in zip(runner.kv, live)), "slot 0 changed"
        return a, b, [t[1].clone() for t in runner.kv]

    a_g, b_g, kv_g = run(True)
    assert sorted(runner._prefill_entries) == sorted(set(pieces))
    entry = runner.prefill_graph()
    C, V, H = runner.prefill_chunk, runner.config.vocab_size, runner.config.hidden_size
    assert entry[1].shape == (1, C) and entry[4].shape == (1,)  # input_ids, logits_rows
    assert entry[5][0].shape == (1, V) and entry[5][1].shape == (1, C, H)  # no [1, C, V] static output
    with pytest.raises(InputError, match="no prefill function of 12 tokens"):
        runner.prefill_graph(12)
    a_e, b_e, kv_e = run(False)
    assert a_g.shape == (20, runner.config.vocab_size) and b_g.shape == (runner.config.vocab_size,)
    assert torch.equal(a_g, a_e) and torch.equal(b_g, b_e)
    assert not torch.equal(a_g[0], a_g[8]), "chunks must not alias the static output"
    for i, (g, e) in enumerate(zip(kv_g, kv_e)):
        assert torch.equal(g, e), f"KV cache {i} differs between graph and eager prefill"


def test_decode_graph_path_equals_eager_path(builds, monkeypatch):
    """Decode through the graph path (token ids, positions and slots staged in one host
    buffer [3, B] from a ring, one copy into the graph's static inputs, replay) against
    eager calls: 7 steps (more than the ring holds), with one live row and a padding row,
    then both rows, from the same cache contents: equal logits and KV caches."""
    runner = runner_for(builds, "bf16", backend="torch")
    assert runner.buckets == [2]
    steps = [([1], [11], [4]), ([0, 1], [5, 6], [3, 5]), ([1, 0], [9, 2], [6, 4]), ([0], [3], [5]),
             ([0, 1], [7, 8], [6, 7]), ([1], [1], [8]), ([0, 1], [4, 4], [7, 9])]
    assert len(steps) > runner.STAGING_RING

    def run(graphs):
        fill(runner, 0)
        runner.use_cuda_graphs = graphs
        out = [runner.decode(*step).clone() for step in steps]  # a replay rewrites its output
        return out, [t.clone() for t in runner.kv]

    monkeypatch.setattr(runner, "_graph_of", stand_in_graph_of)
    got, kv_g = run(True)
    assert list(runner._graphs) == [2] and runner._staging_next[2] == len(steps) % runner.STAGING_RING
    static = runner.decode_graph(2)
    assert static[1].shape == (2, 1) and static[2].shape == (2, 1) and static[3].shape == (2,)
    want, kv_e = run(False)
    for i, (g, e) in enumerate(zip(got, want)):
        assert g.shape == (len(steps[i][0]), runner.config.vocab_size)
        assert torch.equal(g, e), f"step {i}: graph-path logits differ from eager"
    for i, (g, e) in enumerate(zip(kv_g, kv_e)):
        assert torch.equal(g, e), f"KV cache {i} differs between graph and eager decode"


@cpu_interpreter_only("scripts/gpu_prefill_graph.py (exits 2 when a build cannot use prefill graphs)")
def test_who_gets_prefill_graphs(builds, monkeypatch):
    on_cpu = runner_for(builds, "nvfp4")
    assert on_cpu.prefill_graphs and not on_cpu.use_cuda_graphs
    with pytest.raises(InputError, match="prefill graphs need a CUDA device"):
        on_cpu.prefill_graph()
    assert not runner_for(builds, "nvfp4", prefill_graphs=False).prefill_graphs
    assert not runner_for(builds, "nvfp4", backend="torch").prefill_graphs  # reference attention syncs
    with pytest.raises(InputError, match="needs the triton backend"):
        runner_for(builds, "nvfp4", backend="torch", prefill_graphs=True)
    monkeypatch.setenv("FLINTC_PREFILL_GRAPHS", "0")
    assert not runner_for(builds, "nvfp4").prefill_graphs
    assert runner_for(builds, "nvfp4", prefill_graphs=True).prefill_graphs  # the argument wins
    monkeypatch.setenv("FLINTC_PREFILL_GRAPHS", "yes")
    with pytest.raises(InputError, match="FLINTC_PREFILL_GRAPHS must be 0 or 1, got 'yes'"):
        runner_for(builds, "nvfp4")


def test_gpu_prefill_graph_script_logic(builds, monkeypatch, capsys):
    """scripts/gpu_prefill_graph.py on the CPU: its capture / graph-vs-eager / timing steps
    with the stand-in graph pass (exit 0), and a replay that is off by a rounding fails
    (exit 1)."""
    import importlib.util
    import sys
    from pathlib import Path

    import flintc.runtime.compiled as compiled

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_prefill_graph.py"
    spec = importlib.util.spec_from_file_location("flintc_gpu_prefill_graph", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path, _ = builds["bf16"]

    def load(graph_of):
        def fake_load_build(p, **kw):
            r = runner_for(builds, "bf16", backend="torch")
            r.use_cuda_graphs = r.prefill_graphs = True
            r._graph_of = graph_of
            return r
        return fake_load_build

    def off_by_a_bit(fn):
        g, out = stand_in_graph_of(fn)

        def replay():  # the logits and hidden states a rounding off
            for a, b in zip(out, fn()):
                a.copy_(b * 1.0001)

        g.replay = replay
        return g, out

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    argv = ["gpu_prefill_graph.py", "--build", str(path), "--prompt-len", "20", "--continue-len", "5",
            "--time-len", "0", "--iters", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    for graph_of, code in ((stand_in_graph_of, 0), (off_by_a_bit, 1)):
        monkeypatch.setattr(compiled, "load_build", load(graph_of))
        with pytest.raises(SystemExit) as e:
            mod.main()
        assert e.value.code == code, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "ok (bit-identical)" in out and "FAIL" in out


def test_load_build_on_cpu_selects_the_interpreter(builds, monkeypatch):
    """`load_build` of a triton build on the CPU, in a process that never ran the CLI and
    has no TRITON_INTERPRET: it selects Triton's interpreter as `flintc run --device cpu`
    does, so the kernels it loads are interpreted (before: Triton's "0 active drivers" at
    the first launch). TRITON_INTERPRET=0 is a clear InputError instead."""
    import subprocess
    import sys
    from pathlib import Path

    import flintc

    path, _ = builds["nvfp4"]
    code = ("import os\n"
            "from flintc.runtime.compiled import load_build\n"
            f"r = load_build({str(path)!r}, load_format='dummy', progress=False)\n"
            "from triton.runtime.interpreter import InterpretedFunction\n"
            "import flintc.kernels.gemv as gemv\n"
            "assert r.backend == 'triton' and os.environ['TRITON_INTERPRET'] == '1'\n"
            "assert any(isinstance(v, InterpretedFunction) for v in vars(gemv).values())\n"
            "print('interpreted')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(flintc.__file__).resolve().parents[1]),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "interpreted", proc.stderr[-2000:]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InputError, match=r"needs Triton's interpreter, but TRITON_INTERPRET='0' is set"):
        load_build(path, load_format="dummy", progress=False)
