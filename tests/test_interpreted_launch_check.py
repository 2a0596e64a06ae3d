"""`interpreter_checks.check_interpreted_launches`, which tests/conftest.py applies before
each test once triton is imported: a num_warps that compiled Triton refuses (not a power
of two) fails the launch in the interpreter too, naming the kernel; a power of two runs. Nothing here imports triton at collection: imported before a kernel
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
