"""The shared test harness: a tiny model, freshly captured graphs, pass contexts."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time

import pytest
import torch

from flintc.checkpoint.init import random_weights
from flintc.config import FlintConfig
from flintc.graph.trace import capture
from flintc.model.reference import FlintModel
from flintc.passes.base import PassContext

TINY = FlintConfig.preset("tiny")


def cpu_interpreter_only(gpu_check: str):
    """Mark a test that runs flintc's Triton kernels on CPU tensors in the pytest process,
    in Triton's interpreter. On a machine with a CUDA GPU the kernel modules are imported
    with Triton's JIT (the test modules set TRITON_INTERPRET=1 only where no GPU is
    visible, tests/conftest.py), so such a test cannot run there: it is skipped, naming
    `gpu_check`, the check that covers the same code on the GPU. With TRITON_INTERPRET=1
    set for the whole run it runs on a GPU machine too."""
    return pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                              reason=f"runs Triton kernels on CPU tensors (the interpreter), which a GPU "
                                     f"machine's JIT-compiled kernels cannot; on the GPU: {gpu_check}")


@functools.lru_cache(maxsize=None)
def checkpoint_model_and_tokenizer(folder):
    """(FlintModel, FlintTokenizer) of a checkpoint folder: the reference model on its
    weights and its tokenizer (the tests of sampling and structured outputs)."""
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.checkpoint.tokenizer import load_tokenizer

    ckpt = load_checkpoint(folder, progress=False)
    return FlintModel(ckpt.config, ckpt.weights), load_tokenizer(ckpt.tokenizer_dir)


def tiny_model(seed: int = 0) -> FlintModel:
    return FlintModel(TINY, random_weights(TINY, seed))


def fresh_graph(step: str = "decode", batch: int = 2, tokens: int | None = None, model=None):
    """A newly captured graph (passes rewrite in place, so never share one)."""
    model = model or tiny_model()
    return capture(model, step, batch=batch, tokens=tokens, cache_len=48)


def context(g, fmt: str = "bf16") -> PassContext:
    return PassContext(g.config, g.step, g.batch, g.tokens, g.cache_len, fmt)


@functools.lru_cache(maxsize=None)
def tiny_nvfp4_model(seed: int = 0) -> FlintModel:
    from flintc.quant.nvfp4 import quantize

    w = random_weights(TINY, seed)
    w = {k: quantize(v) if v.dim() >= 2 and "proj" in k else v for k, v in w.items()}
    return FlintModel(TINY, w)


def run_passes(passes, step: str = "decode", batch: int = 2, tokens: int | None = None,
               fmt: str = "bf16", options=None):
    """Capture tiny `step`, run `passes` through the manager with numeric checks against
    each graph before. Returns (graph, report)."""
    from flintc.passes.manager import NumericChecker, PassManager

    model = tiny_model() if fmt == "bf16" else tiny_nvfp4_model()
    g = fresh_graph(step, batch, tokens, model=model)
    ctx = PassContext(g.config, g.step, g.batch, g.tokens, g.cache_len, fmt, dict(options or {}))
    report = PassManager(passes, ctx, checker=NumericChecker(model, g)).run(g)
    return g, report


def count_ops(gm, *names: str) -> dict:
    """Occurrences of ops by short name, e.g. count_ops(gm, "flintc.gemv", "aten.mm")."""
    from flintc.graph.match import op_name

    found = [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]
    return {name: found.count(name) for name in names}


@functools.lru_cache(maxsize=None)
def compiled(step: str, fmt: str = "bf16", batch: int = 2, tokens: int | None = None,
             disabled: tuple = (), splits: int = 3):
    """compile_step on tiny with every check on, cached: (graph, report). Treat as read-only."""
    from flintc.passes.pipeline import compile_step, step_options

    model = tiny_model() if fmt == "bf16" else tiny_nvfp4_model()
    return compile_step(model, step, batch=batch, tokens=tokens, cache_len=48, check_model=model,
                        disabled=disabled, options=step_options(step, {"attention_splits": splits}))


def stage(report, name: str):
    return next(s for s in report.stages if s.name == name)


def assert_same(name: str, got: torch.Tensor, want: torch.Tensor, dots: bool = False) -> None:
    """Finite (written) and bit-identical; `dots`: the result of the grouped GEMM's dots,
    within a stated bound instead.

    Why a bound there: the mma layout's kernel runs one dot per 8-row half of each weight
    tile (`_load_mma_halves`), a different program from the packed layout's, and the fp32
    sums of the same exact products may come out in another order: under the interpreter
    numpy's BLAS sums a [M, K] x [K, F/2] product differently from the [M, K] x [K, F]
    one, and on the H200 the two compiled variants differ in 37 of 1.57M gate/up outputs
    (at most 1e-3 absolute; each variant differs from the "loop" reference in 277:
    session 13, docs/gpu-runs.md). Bound: 2 bf16 ulps of the packed result plus 2^-10 of
    its largest magnitude (h = silu(g) * u after g and u were rounded to bf16 moves a
    small h by more than its own ulp), in at most 1% of the elements."""
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
    assert bool(torch.isfinite(got).all()), f"{name}: {(~torch.isfinite(got)).sum()} non-finite (unwritten?)"
    assert bool(torch.isfinite(want).all()), f"{name}: packed-layout result not finite"
    ibits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    diff = (got.view(ibits) != want.view(ibits)).sum().item()
    if dots:
        w = want.double()
        tol = 2 * w.abs() * 2.0**-7 + 2.0**-10 * w.abs().max()
        worst = float(((got.double() - w).abs() - tol).max())
        assert worst <= 0, f"{name}: a value is {worst:.3g} past the bound from the packed layout"
        print(f"{name}: {diff} of {got.numel()} elements differ from the packed layout")
        assert diff <= 0.01 * got.numel(), f"{name}: {diff} of {got.numel()} elements differ"
        return
    assert diff == 0, f"{name}: {diff} of {got.numel()} elements differ from the packed layout"


def run_cli(capsys, *args):
    """`flintc ARGS...` in process (every arg str()-ed): (exit code, stdout, stderr)."""
    from flintc.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    """A CLI user error: exit code 2, one line `flintc: error: ...` on stderr holding every
    needle, no traceback."""
    assert code == 2, err
    assert err.startswith("flintc: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert str(n) in err, (n, err)


def reference_at_cache_length(model: FlintModel, prompt_ids: list[int], params, max_model_len: int,
                              keep_step_logits: bool = False):
    """The reference model's generation of one prompt alone, with caches of `max_model_len`
    rows per slot (a server fixture's), not `generate()`'s request-sized ones: on some CPUs
    (an AVX512-BF16 EPYC, session 33) attention over 12 rows and over 1,024 masked rows
    rounds differently (logits 0.02 apart), which a seeded draw turned into another
    token. -> flintc.runtime.generate's result (output_ids, step_logits if kept)."""
    from flintc.runtime.generate import generate_with_runner
    from flintc.runtime.runner import ReferenceRunner

    runner = ReferenceRunner(model, max_batch=1, max_model_len=max_model_len)
    return generate_with_runner(runner, [prompt_ids], params, keep_step_logits=keep_step_logits)


@contextlib.contextmanager
def fifo_read(path):
    """Make a FIFO at `path` and read it to its end on a thread while the body runs;
    yields a list that holds the bytes read once the body is done (empty when nothing
    opened the FIFO for writing: it is then opened once here so the reader ends)."""
    os.mkfifo(path)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(open(path, "rb").read()))
    reader.start()
    try:
        yield got
    finally:
        if reader.is_alive():  # unblock the reader if nothing opened the FIFO
            with open(path, "wb"):
                pass
        reader.join()


def wait_until(cond, timeout: float = 20.0, interval: float = 0.02) -> bool:
    """Poll `cond()` every `interval` seconds until it is true (-> True) or `timeout`
    seconds have passed (-> False): for tests that watch a server or engine thread."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return False
