"""`interpreter_checks.check_interpreted_launches`, which tests/conftest.py applies before
each test once triton is imported: a num_warps that compiled Triton refuses (not a power
of two) fails the launch in the interpreter too, naming the kernel; a power of two runs;
and a 16-bit tl.dot with K < 16, which the interpreter computes and the NVIDIA compile
refuses, fails too (fp16 here: the interpreter's bf16 dot is wrong anyway, NOTES.md). Nothing here imports triton at collection: imported before a kernel
test module sets TRITON_INTERPRET=1, triton.language's own functions would not run in the
interpreter."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the suite's kernels run in the interpreter only "
                    "on a machine without a GPU")
def test_interpreted_launch_refuses_a_num_warps_compiled_triton_refuses(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when @triton.jit decorates (conftest restores it)
    triton = pytest.importorskip("triton", reason="checks Triton launches")
    import triton.language as tl
    from interpreter_checks import check_interpreted_launches
    from triton.runtime.interpreter import InterpretedFunction

    @triton.jit
    def probe_kernel(x_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(x_ptr + o, o.to(tl.float32))

    assert isinstance(probe_kernel, InterpretedFunction)
    check_interpreted_launches()  # as before every test; here triton may be new to the process
    for warps in (1, 2, 4, 8, 16):
        x = torch.zeros(16)
        probe_kernel[(1,)](x, N=16, num_warps=warps)
        assert x.tolist() == list(range(16))
    with pytest.raises(AssertionError, match="probe_kernel launched with num_warps=3: compiled Triton"):
        probe_kernel[(1,)](torch.zeros(16), N=16, num_warps=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the suite's kernels run in the interpreter only "
                    "on a machine without a GPU")
def test_interpreted_dot_takes_nvidias_shape_bounds(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton", reason="checks Triton launches")
    pytest.importorskip("triton.backends.nvidia.compiler", reason="a triton without the NVIDIA backend")
    import triton.language as tl
    from interpreter_checks import check_interpreted_launches

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, o_ptr, K: tl.constexpr):
        m, k, n = tl.arange(0, 16), tl.arange(0, K), tl.arange(0, 16)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * 16 + n[None, :])
        tl.store(o_ptr + m[:, None] * 16 + n[None, :], tl.dot(a, b))

    check_interpreted_launches()
    for K, fails in ((16, False), (8, True)):
        a, b = torch.randn(16, K).half(), torch.randn(K, 16).half()
        out = torch.empty(16, 16)
        if fails:
            with pytest.raises(Exception, match="K >= 16"):
                dot_kernel[(1,)](a, b, out, K=K)
        else:
            dot_kernel[(1,)](a, b, out, K=K)
            torch.testing.assert_close(out, a.float() @ b.float(), rtol=1e-2, atol=1e-2)
