"""Shared fixtures: tiny checkpoints written once per test session."""

from __future__ import annotations

import os

import pytest

from flintc.checkpoint.writer import make_checkpoint


@pytest.fixture(scope="session")
def tiny_bf16_dir(tmp_path_factory):
    """A tiny BF16 checkpoint folder (seed 0)."""
    return make_checkpoint("tiny", "bf16", tmp_path_factory.mktemp("ckpt") / "bf16", seed=0)


@pytest.fixture(scope="session")
def tiny_nvfp4_gguf(tmp_path_factory):
    """A tiny NVFP4 GGUF file (seed 0), config.json and tokenizer beside it."""
    return make_checkpoint("tiny", "nvfp4", tmp_path_factory.mktemp("ckpt") / "nvfp4", seed=0)


# ---------------------------------------------------------------- TRITON_INTERPRET leaks
# A test module that needs Triton's interpreter sets TRITON_INTERPRET=1 at import, before
# triton decorates any kernel, and must do so only where no GPU is visible: on a GPU the
# variable would stay set for every module collected after it, so their kernels would be
# interpreted (slow) and the CUDA kernels' dispatch, which reads it at each call
# (`flintc.kernels.platform.interpreting`), would send the GPU tests to other code paths.
_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")
_INTERPRET_LEAK: list[str] = []


def pytest_configure(config):
    """On a machine with a CUDA GPU (TRITON_INTERPRET not 1), import every flintc.kernels
    module now, so that Triton JIT-compiles their kernels whatever runs first: a fixture's
    in-process CPU run (`flintc compile` without --device sets TRITON_INTERPRET=1) would
    otherwise import the ones no collected module had imported as interpreted functions,
    for the rest of the process (session 35: "Cannot call @triton.jit'd outside of the
    scope of a kernel" in the tiny CUDA tests of a partial run). Without a GPU, nothing:
    the kernel test modules select the interpreter at import."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch

    if not torch.cuda.is_available():
        return
    from interpreter_checks import import_kernel_modules

    try:
        import_kernel_modules()
    except ImportError:  # no triton: the kernel tests skip
        pass


def pytest_collectreport(report):
    """Remember the first collected module after which TRITON_INTERPRET changed on a
    machine with a CUDA GPU."""
    if _INTERPRET_LEAK or os.environ.get("TRITON_INTERPRET") == _INTERPRET_AT_START:
        return
    import torch

    if torch.cuda.is_available():
        _INTERPRET_LEAK.append(report.nodeid or "(a conftest)")


def _set_interpret(value: str | None) -> None:
    if os.environ.get("TRITON_INTERPRET") != value:
        if value is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = value


@pytest.fixture(autouse=True)
def _restore_triton_interpret():
    """Start each test with TRITON_INTERPRET as `interpreter_checks.interpret_for_a_test` says, and
    set that starting value again after the test. A test that runs flintc on the CPU in this process (`flintc run
    --device cpu`, `load_build` of a CPU triton build) selects Triton's interpreter by
    setting it (`use_triton_interpreter`), and `flintc.kernels.platform.interpreting`
    reads it at each call: left set on a GPU machine, it would send every later GPU
    test's kernels down the interpreter paths."""
    from interpreter_checks import interpret_for_a_test

    before = interpret_for_a_test(os.environ.get("TRITON_INTERPRET"))
    _set_interpret(before)
    yield
    _set_interpret(before)


def pytest_collection_finish(session):
    """Refuse to run GPU tests whose collection turned on Triton's interpreter.

    Raises:
        pytest.UsageError: naming the module that set TRITON_INTERPRET.
    """
    from interpreter_checks import INTERPRET_COLLECTED

    INTERPRET_COLLECTED[:] = [os.environ.get("TRITON_INTERPRET")]
    if _INTERPRET_LEAK:
        raise pytest.UsageError(
            f"{_INTERPRET_LEAK[0]} set TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} "
            f"at import on a machine with a CUDA GPU (it was {_INTERPRET_AT_START!r}): set it "
            "only when torch.cuda.is_available() is False, as the other kernel tests do")


# ------------------------------------------------- launch options the interpreter lets by
@pytest.fixture(autouse=True)
def _interpreted_launches_checked():
    """`interpreter_checks.check_interpreted_launches` before each test: an interpreted
    launch with a num_warps compiled Triton refuses fails (a no-op until the first
    @triton.jit under TRITON_INTERPRET=1 imports Triton's interpreter)."""
    from interpreter_checks import check_interpreted_launches

    check_interpreted_launches()
    yield
