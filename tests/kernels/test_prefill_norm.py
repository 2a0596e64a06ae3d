"""The prefill norm and elementwise kernels (`flintc.kernels.prefill_norm`) against the
reference ops (`flintc.model.ops`), within the bounds that module states; the launchers'
argument checks; and `flintc.kernels.prefill_ops` sending CUDA calls to them.

CPU: Triton's interpreter at tiny and moderate shapes (non-power-of-two widths, a row
split over several column blocks, a single row, row-strided views, bf16 and fp32
weights, inputs holding zeros, infinities, NaN and a subnormal). Outputs start as NaN
(`poisoned`), so an element the kernel never writes fails the check. GPU (`-m gpu`): the
full model's shapes (a chunk of 2048 tokens, H = 2048, Hq = 32, Hkv = 4, D = 128, K = 6).
Every check prints the share of elements that differ from the reference (`-s`).
"""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel

import pytest
import torch

pytest.importorskip("triton", reason="the prefill kernels need triton")

import flintc.ops  # noqa: F401  (registers torch.ops.flintc.*)
from flintc.kernels import prefill_norm as PN
from flintc.kernels import prefill_ops as P
from flintc.model import ops

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16 = torch.float32, torch.bfloat16
EPS = 1e-5
# Share of elements allowed to differ from the reference (rounding-boundary cases); most
# are bit-identical (measured: 1 of 131072 at [64, 2048], none at the tiny shapes).
MAX_SHARE = 0.01


def rand_bf16(*shape, seed: int, scale: float = 3.0, special: bool = False) -> torch.Tensor:
    """Random bf16 values with a spread of magnitudes; `special`: also a zero, a -0, a
    subnormal, and +-inf and NaN (in the rows they land in, the norm is NaN or 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 6, shape, generator=g).float()) * scale
    if special:
        flat = x.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:6]
        flat[idx] = torch.tensor([0.0, -0.0, 1e-40, float("inf"), float("-inf"), float("nan")])
    return x.to(BF16).to(DEV)


def norm_weight(n: int, seed: int, dtype=F32) -> torch.Tensor:
    return (torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.5).to(dtype).to(DEV)


def bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at |t| (float64; 2^-133 at zero and among subnormals)."""
    _, e = torch.frexp(t.double().abs())
    return torch.exp2((e - 8).clamp(min=-133).double())


def check_within(name: str, got: torch.Tensor, want: torch.Tensor, extra=0.0) -> float:
    """got equals want, or is within one bf16 ulp of it plus `extra` (a float or a
    tensor of want's shape) plus 2^-126 (an fp32 subnormal flushed on the GPU); NaN
    exactly where want has NaN (a poisoned, unwritten element is NaN where want is not).
    Prints and returns the share of elements whose bits differ."""
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), \
        f"{name}: NaN at {(nan_got != nan_want).sum().item()} elements where the reference has none (unwritten?)"
    g, w = got.double(), want.double()
    same = (g == w) | nan_want
    bound = bf16_ulp(want) + extra + 2.0**-126
    over = ~same & ~((g - w).abs() <= bound)
    assert not bool(over.any()), \
        f"{name}: {over.sum().item()} elements past the bound, e.g. {got[over][:4]} vs {want[over][:4]}"
    share = (got.view(torch.int16) != want.view(torch.int16)).sum().item() / max(1, got.numel())
    print(f"{name}: {share:.4%} of {got.numel()} elements differ from the reference")
    return share


def check_rms_norm(x, w, label=""):
    want = ops.rms_norm(x, w, EPS, F32)
    got = PN.rms_norm(x, w, EPS)
    assert got.is_contiguous()
    assert check_within(f"rms_norm {label}", got, want) <= MAX_SHARE


def check_add_rms_norm(x, y, w, label=""):
    h_want = ops.residual_add(x, y, F32)
    h, normed = PN.add_rms_norm(x, y, w, EPS)
    assert torch.equal(h.view(torch.int16), h_want.contiguous().view(torch.int16)), "h is not bit-identical"
    want = ops.rms_norm(h_want, w, EPS, F32)
    assert check_within(f"add_rms_norm {label}", normed, want) <= MAX_SHARE


def check_qk_norm_rope(B, T, Hq, Hkv, D, rope, seed=0, p0=20):
    q = rand_bf16(B, T, Hq, D, seed=seed, scale=1.0, special=True)
    k = rand_bf16(B, T, Hkv, D, seed=seed + 1, scale=1.0)
    qn, kn = norm_weight(D, seed + 2), norm_weight(D, seed + 3, BF16)
    cos, sin = ops.rope_tables(10000.0, D, p0 + B * T, F32)
    pos = (p0 + torch.arange(B * T)).view(B, T)
    cos, sin = cos[pos].to(DEV), sin[pos].to(DEV)
    got = PN.qk_norm_rope(q, k, qn, kn, cos, sin, EPS, rope)
    want = torch.ops.flintc.qk_norm_rope(q, k, qn, kn, cos, sin, EPS, rope)
    for name, x, nw, a, b in (("q", q, qn, got[0], want[0]), ("k", k, kn, got[1], want[1])):
        extra = 0.0
        if rope:
            # the normed bf16 values may be one ulp apart, and the rotation can cancel:
            # 2^-7 (|n1 c| + |n2 s|), from the reference's normed n
            n = ops.rms_norm(x, nw, EPS, F32).double()
            half = D // 2
            c, s = cos.double()[:, :, None, :], sin.double()[:, :, None, :]
            lo = n[..., :half].abs() * c.abs() + n[..., half:].abs() * s.abs()
            hi = n[..., half:].abs() * c.abs() + n[..., :half].abs() * s.abs()
            extra = 2.0**-7 * torch.cat([lo, hi], dim=-1)
        label = f"qk_norm_rope {name} [{B}, {T}, {x.shape[2]}, {D}] rope={rope}"
        assert check_within(label, a, b, extra) <= MAX_SHARE


def check_combine(N, K, H, shared, seed=0):
    y = rand_bf16(N, K, H, seed=seed)
    w = torch.rand(N, K, generator=torch.Generator().manual_seed(seed + 1)).to(DEV) * 2.5
    s = rand_bf16(N, H, seed=seed + 2) if shared else None
    got = PN.expert_combine(y, w, s)
    want = ops.expert_combine(y, w, s, F32)
    # fp32 reordering of K + 1 terms, then one rounding; the sum may cancel
    mass = (w.double()[..., None] * y.double()).abs().sum(dim=1)
    if s is not None:
        mass = mass + s.double().abs()
    extra = (K + 1) * 2.0**-23 * mass
    assert check_within(f"expert_combine [{N}, {K}, {H}] shared={shared}", got, want, extra) <= MAX_SHARE


# ---------------------------------------------------------------------------- CPU twins
@pytest.mark.parametrize("shape,wdtype", [((1, 128), F32), ((37, 128), F32), ((3, 5, 200), BF16),
                                          ((64, 2048), F32)])
def test_rms_norm(shape, wdtype, poisoned):
    x = rand_bf16(*shape, seed=1, special=shape == (37, 128))  # (a single row would be all NaN)
    check_rms_norm(x, norm_weight(shape[-1], 2, wdtype), str(list(shape)))


@pytest.mark.parametrize("shape", [(1, 8, 128), (2, 3, 200), (64, 2048)])
def test_add_rms_norm(shape, poisoned):
    x = rand_bf16(*shape, seed=3, special=True)
    y = rand_bf16(*shape, seed=4)
    check_add_rms_norm(x, y, norm_weight(shape[-1], 5), str(list(shape)))


def test_add_rms_norm_row_strided_inputs(poisoned):
    """x and y as column slices of wider rows (a row stride > H), as 2-D views."""
    H = 96
    x = rand_bf16(7, H + 32, seed=6)[:, 16:16 + H]
    y = rand_bf16(7, 2 * H, seed=7)[:, :H]
    assert x.stride(0) != H and y.stride(0) != H
    check_add_rms_norm(x, y, norm_weight(H, 8), "row-strided")


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("B,T,Hq,Hkv,D", [(1, 11, 8, 2, 32), (2, 3, 32, 4, 128), (1, 2, 6, 3, 24),
                                           (1, 2, 32, 4, 96)])  # 1024 // 96 = 10 heads: 8 per tile
def test_qk_norm_rope(B, T, Hq, Hkv, D, rope, poisoned):
    check_qk_norm_rope(B, T, Hq, Hkv, D, rope)


@pytest.mark.parametrize("N,K,H,shared", [(13, 6, 128, True), (13, 6, 128, False), (1, 1, 1100, True),
                                          (32, 6, 2048, True)])
def test_expert_combine(N, K, H, shared, poisoned):
    check_combine(N, K, H, shared)


def test_silu_mul(poisoned):
    g, u = rand_bf16(9, 7, 64, seed=9, special=True), rand_bf16(9, 7, 64, seed=10)
    assert check_within("silu_mul [9, 7, 64]", PN.silu_mul(g, u), ops.silu_mul(g, u, F32)) <= MAX_SHARE
    g, u = rand_bf16(3, 1100, seed=11), rand_bf16(3, 1100, seed=12)  # two column blocks
    assert check_within("silu_mul [3, 1100]", PN.silu_mul(g, u), ops.silu_mul(g, u, F32)) <= MAX_SHARE


def test_silu_mul_into_a_strided_slot():
    """The shared expert's write into slot K of h [N, K + 1, F] (`moe_gate_up`): only
    that slot changes."""
    g, u = rand_bf16(5, 64, seed=13), rand_bf16(5, 64, seed=14)
    h = torch.full((5, 4, 64), float("nan"), dtype=BF16, device=DEV)
    assert PN.silu_mul(g, u, out=h[:, 3]).data_ptr() == h[:, 3].data_ptr()
    check_within("silu_mul out=h[:, 3]", h[:, 3], ops.silu_mul(g, u, F32))
    assert bool(torch.isnan(h[:, :3]).all())


def test_warps_are_powers_of_two():
    """Compiled Triton takes only a power of two for num_warps (the interpreter takes any):
    8 heads of D = 96 (768 elements) gave 3 warps before session 34."""
    got = {e: PN._warps(e) for e in range(9000)}
    assert all(w & (w - 1) == 0 and 1 <= w <= 16 for w in got.values()), got
    assert got[768] == 2 and got[1024] == 4 and got[8192] == 16


def test_empty_inputs_launch_nothing():
    w = norm_weight(16, 0)
    assert PN.rms_norm(torch.empty(0, 16, dtype=BF16, device=DEV), w, EPS).shape == (0, 16)
    y = torch.empty(0, 6, 16, dtype=BF16, device=DEV)
    assert PN.expert_combine(y, torch.empty(0, 6, device=DEV), None).shape == (0, 16)


def _bad(name: str, call):
    with pytest.raises(ValueError, match=rf"\b{name} must be"):
        call()


def test_launchers_name_the_bad_tensor():
    x = rand_bf16(4, 16, seed=0)
    w = norm_weight(16, 0)
    _bad("x", lambda: PN.rms_norm(x.float(), w, EPS))
    _bad("weight", lambda: PN.rms_norm(x, norm_weight(8, 0), EPS))
    _bad("weight", lambda: PN.rms_norm(x, w.double(), EPS))
    _bad("y", lambda: PN.add_rms_norm(x, x[:2], w, EPS))
    _bad("x", lambda: PN.rms_norm(rand_bf16(16, 4, seed=0).t(), norm_weight(4, 0), EPS))
    q, k = rand_bf16(1, 2, 4, 8, seed=0), rand_bf16(1, 2, 2, 8, seed=1)
    qn = norm_weight(8, 0)
    cos = torch.zeros(1, 2, 4, device=DEV)
    _bad("q", lambda: PN.qk_norm_rope(q.transpose(1, 2), k, qn, qn, cos, cos, EPS, True))
    _bad("k", lambda: PN.qk_norm_rope(q, rand_bf16(1, 3, 2, 8, seed=1), qn, qn, cos, cos, EPS, True))
    _bad("k_norm", lambda: PN.qk_norm_rope(q, k, qn, norm_weight(4, 0), cos, cos, EPS, True))
    _bad("sin", lambda: PN.qk_norm_rope(q, k, qn, qn, cos, cos.double(), EPS, True))
    y = rand_bf16(3, 2, 16, seed=0)
    _bad("weights", lambda: PN.expert_combine(y, torch.rand(3, 2, device=DEV).to(BF16), None))
    _bad("shared", lambda: PN.expert_combine(y, torch.rand(3, 2, device=DEV), x))
    _bad("up", lambda: PN.silu_mul(x, x[:, :8]))
    _bad("out", lambda: PN.silu_mul(x, x, out=torch.empty(4, 8, dtype=BF16, device=DEV)))
    # leading dims that do not collapse into one row stride
    _bad("gate", lambda: PN.silu_mul(rand_bf16(4, 3, 8, seed=0)[:, ::2], rand_bf16(4, 2, 8, seed=1)))


def test_prefill_ops_send_cuda_calls_to_the_kernels(monkeypatch):
    """`prefill_ops` takes the Triton kernels where `_use_triton` says so (CUDA tensors),
    and its torch bodies elsewhere (bit-identical, tests/kernels/test_prefill_glue.py)."""
    called = []
    for name in ("rms_norm", "add_rms_norm", "qk_norm_rope", "expert_combine", "silu_mul"):
        real = getattr(PN, name)
        monkeypatch.setattr(PN, name, lambda *a, _real=real, _name=name, **kw: called.append(_name) or _real(*a, **kw))
    x, w = rand_bf16(3, 16, seed=0), norm_weight(16, 0)
    q, k = rand_bf16(1, 3, 4, 8, seed=1), rand_bf16(1, 3, 2, 8, seed=2)
    cos = torch.rand(1, 3, 4, device=DEV)
    y = rand_bf16(3, 2, 16, seed=3)

    def run_all():
        P.rms_norm(x, w, EPS)
        P.add_rms_norm(x, x, w, EPS)
        P.qk_norm_rope(q, k, norm_weight(8, 0), norm_weight(8, 1), cos, cos, EPS, True)
        P.expert_combine(y, torch.rand(3, 2, device=DEV), x)
        P.silu_mul(x, x)

    monkeypatch.setattr(P, "_use_triton", lambda t: False)
    run_all()
    assert called == []
    monkeypatch.setattr(P, "_use_triton", lambda t: True)
    run_all()
    assert called == ["rms_norm", "add_rms_norm", "qk_norm_rope", "expert_combine", "silu_mul"]


def test_kernels_compile_for_sm90():
    """The kernels' GPU code (which the interpreter never compiles) through Triton's whole
    pipeline down to ptxas for sm_90, at the full model's shapes, without a GPU
    (`scripts/triton_aot_probe.py`, `prefill_norm.aot_probe_specs`): every one compiles,
    spills nothing and loads 16 bytes per thread (vectorised bf16 rows)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning
    proc = subprocess.run([sys.executable, str(root / "scripts" / "triton_aot_probe.py"),
                           "flintc.kernels.prefill_norm"], capture_output=True, text=True,
                          timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(PN.aot_probe_specs()), proc.stdout
    for line in lines:
        assert "spills st/ld 0/0" in line and "ld.v4.b32" in line, line


# ---------------------------------------------------------------------------- GPU, full shapes
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                    reason="needs CUDA (and TRITON_INTERPRET=0 in the environment)")
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "qk_rope", "qk_nope", "combine", "silu_mul"])
def test_full_shapes_gpu(op):
    """A 2048-token chunk of the full model: H = 2048, Hq = 32, Hkv = 4, D = 128 (positions
    from 100000), K = 6 + shared, dense F = 10240."""
    T, H = 2048, 2048
    if op == "rms_norm":
        check_rms_norm(rand_bf16(T, H, seed=1), norm_weight(H, 2), "full")
    elif op == "add_rms_norm":
        check_add_rms_norm(rand_bf16(T, H, seed=1), rand_bf16(T, H, seed=2), norm_weight(H, 3), "full")
    elif op in ("qk_rope", "qk_nope"):
        check_qk_norm_rope(1, T, 32, 4, 128, op == "qk_rope", p0=100000)
    elif op == "combine":
        check_combine(T, 6, H, True)
    else:
        g, u = rand_bf16(T, 10240, seed=4), rand_bf16(T, 10240, seed=5)
        assert check_within("silu_mul full", P.silu_mul(g, u), ops.silu_mul(g, u, F32)) <= MAX_SHARE
