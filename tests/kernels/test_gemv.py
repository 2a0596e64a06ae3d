"""`flintc.kernels.gemv` against `gemv_reference` (FLINT_SPEC section 3).

On the CPU the kernel runs in the Triton interpreter on tiny, awkward shapes; the
`gpu` tests run the model's real shapes on CUDA, for every configuration the benchmark
sweep may pick. The kernel reduces in a different order from torch's matmul, so outputs
may differ by one bf16 ulp where a value sits on a rounding boundary; each check reports
the share of differing elements and the largest difference, and asserts that most
elements are bit-identical.
"""

from __future__ import annotations

import os

# The interpreter must be chosen before triton decorates any kernel (no GPU in CI).
if not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the GEMV kernel needs it")

import triton  # noqa: E402

from flintc.kernels import gemv as G  # noqa: E402
from flintc.kernels.gemv import GemvConfig, gemv, gemv_reference, lm_head  # noqa: E402
from flintc.ops.common import as_weight  # noqa: E402
from flintc.quant.nvfp4 import E2M1_VALUES, NVFP4Tensor, quantize  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


def make_weight(F: int, K: int, fmt: str, device="cpu") -> list[torch.Tensor]:
    """Fresh random weights [F, K]: bf16, or NVFP4 with (nvfp4_gs) / without a global scale."""
    w = (torch.randn(F, K) * 0.05).to(torch.bfloat16)
    if fmt == "bf16":
        return [w.to(device)]
    q = quantize(w, use_global_scale=(fmt == "nvfp4_gs"))
    return [q.codes.to(device), q.scales.to(device), q.global_scale.to(device)]


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of the bf16 grid at |v| (8 significant bits), floored at the smallest normal."""
    _, e = torch.frexp(v.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), e - 8)


def assert_close_bf16(out, ref, x, w, min_identical: float = 0.95):
    """Equal up to reduction order: within one bf16 ulp of the larger value plus the fp32
    reordering bound `K * 2^-24 * sum_k |x_k w_k|` (which only matters where the sum
    cancels to near zero, so a bf16 ulp there is tiny), and bit-identical in at least
    `min_identical` of the elements. fp32 outputs (logits): the reordering bound only."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, r = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(o).all(), f"non-finite outputs (unwritten?): {(~torch.isfinite(o)).sum()}"
    dense = as_weight([t.cpu() for t in w])
    if isinstance(dense, NVFP4Tensor):
        dense = dense.dequantize(torch.float64)
    K = x.shape[1]
    mag = x.cpu().double().abs() @ dense.double().abs().T  # [N, F]
    tol = K * 2.0**-24 * mag
    if out.dtype == torch.bfloat16:
        tol = tol + torch.maximum(bf16_ulp(o), bf16_ulp(r)).double()
    diff = (o - r).abs()
    share = (out.cpu() != ref.cpu()).float().mean().item()
    msg = (f"{share:.2%} of {o.numel()} elements differ, max diff {diff.max().item():.3g}, "
           f"max diff / tolerance {(diff / tol).max().item():.2f}")
    assert bool((diff <= tol).all()), msg
    if out.dtype == torch.bfloat16:
        assert 1.0 - share >= min_identical, msg


def poisoned(N: int, F: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.full((N, F), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "nvfp4_gs"])
@pytest.mark.parametrize("K,F", [(64, 40), (192, 16)])
@pytest.mark.parametrize("N", [1, 3, 8])
def test_gemv_matches_reference(N, K, F, fmt):
    """Default configuration on tiny non-power-of-two shapes, NaN-poisoned output."""
    x = torch.randn(N, K).to(torch.bfloat16).to(DEV)
    w = make_weight(F, K, fmt, DEV)
    out = poisoned(N, F)
    y = gemv(x, w, out=out)
    assert y is out
    assert_close_bf16(y, gemv_reference(x, w), x, w)


# Each reduction path the sweep can choose, at interpreter-sized tiles: tensor-core dot
# with and without the register prefetch, the FMA reduction, the FMA reduction with
# block scales applied after 16-wide partial sums, and one-launch split-K (3 splits).
CPU_CONFIGS = [
    GemvConfig(use_dot=True, block_f=16, block_k=64, split_k=1, prefetch=True),
    GemvConfig(use_dot=True, block_f=32, block_k=32, split_k=3, prefetch=False),
    GemvConfig(use_dot=False, block_f=16, block_k=64, split_k=2, prefetch=True),
    GemvConfig(use_dot=False, block_f=16, block_k=32, split_k=3, prefetch=False, scale_after=True),
    # one-step configs (`one_step_configs`): block_k * split_k == K, one K step per program
    GemvConfig(use_dot=True, block_f=16, block_k=64, split_k=3, prefetch=True),
    GemvConfig(use_dot=False, block_f=32, block_k=64, split_k=3, prefetch=True),
    GemvConfig(use_dot=False, block_f=16, block_k=64, split_k=2, prefetch=True, acc_full=True),
    # 2-D tiles on the tensor cores (NVFP4 decoded into K order), split-K
    GemvConfig(use_dot=True, block_f=16, block_k=32, split_k=2, prefetch=False, flat=True),
    # the swapped dot (weight tile on the left, accumulator [F, N]): 3-D tiles with the
    # register prefetch, and 2-D tiles
    GemvConfig(use_dot=True, block_f=32, block_k=64, split_k=2, prefetch=True, swap=True),
    GemvConfig(use_dot=True, block_f=16, block_k=32, split_k=3, prefetch=False, flat=True,
               swap=True),
]


@pytest.mark.parametrize("cfg", CPU_CONFIGS, ids=lambda c: c.short().replace(" ", "_"))
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
@pytest.mark.parametrize("N", [1, 8])
def test_gemv_configs(N, fmt, cfg):
    """Every reduction path and split-K agree with the reference (K = 192: several steps
    per split, and a last split shorter than the others)."""
    K, F = 192, 40
    x = torch.randn(N, K).to(torch.bfloat16).to(DEV)
    w = make_weight(F, K, fmt, DEV)
    out = poisoned(N, F)
    assert_close_bf16(gemv(x, w, out=out, config=cfg), gemv_reference(x, w), x, w)


# 2-D tiles and the swapped dot where K is not a multiple of BLOCK_K and the last split
# is shorter than the others: K = 320 in steps of 128 over 2 splits of 256, so split 0
# makes 2 steps and split 1 one step with only 64 of its 128 columns inside K (masked
# codes, scales and x); the NVFP4 block scales past each split's end must stay masked.
TAIL_CONFIGS = [
    GemvConfig(use_dot=True, block_f=16, block_k=128, split_k=2, prefetch=False, flat=True,
               swap=True),
    GemvConfig(use_dot=True, block_f=16, block_k=128, split_k=2, prefetch=False, flat=True),
    GemvConfig(use_dot=True, block_f=32, block_k=128, split_k=2, prefetch=True, swap=True),
]


@pytest.mark.parametrize("cfg", TAIL_CONFIGS, ids=lambda c: c.short().replace(" ", "_"))
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
def test_flat_and_swap_at_k_tails(fmt, cfg):
    """K = 320 (NVFP4 quantizes rows of multiples of 64), F = 24 (a partial F block), N = 3,
    2 splits: a full last step in split 0, a half-masked single step in split 1."""
    N, K, F = 3, 320, 24
    split, per = G._effective_split(K, cfg.block_k, cfg.split_k)
    assert (split, per, K % cfg.block_k) == (2, 256, 64)  # the shape this test is about
    x = torch.randn(N, K).to(torch.bfloat16).to(DEV)
    w = make_weight(F, K, fmt, DEV)
    out = poisoned(N, F)
    assert_close_bf16(gemv(x, w, out=out, config=cfg), gemv_reference(x, w), x, w)


def test_split_k_counters_are_left_zero():
    """One-launch split-K leaves its arrival counters at zero, so the next launch (here a
    second one with another shape) starts clean."""
    cfg = GemvConfig(use_dot=True, block_f=16, block_k=32, split_k=4)
    for N, K, F in [(2, 128, 32), (3, 96, 16)]:
        x = torch.randn(N, K).to(torch.bfloat16).to(DEV)
        w = make_weight(F, K, "bf16", DEV)
        assert_close_bf16(gemv(x, w, out=poisoned(N, F), config=cfg), gemv_reference(x, w), x, w)
        assert int(G.split_k_counters(x.device, 1)[:64].abs().sum()) == 0


def test_lm_head_fp32_logits():
    """`lm_head`: fp32 logits, never rounded, within the fp32 reordering bound."""
    from flintc.ops import linear

    x = torch.randn(3, 128).to(torch.bfloat16).to(DEV)
    w = (torch.randn(512, 128) * 0.05).to(torch.bfloat16).to(DEV)
    cfg = GemvConfig(use_dot=True, block_f=128, block_k=64, split_k=2)
    y = lm_head(x, w, config=cfg)
    assert y.dtype == torch.float32
    assert_close_bf16(y, linear.lm_head(x, w), x, [w])


def test_kernels_table_entries():
    """KERNELS maps the op names to launchers with the contract's signature."""
    from flintc.ops import linear

    assert set(G.KERNELS) == {"gemv", "lm_head"}
    x = torch.randn(9, 64).to(torch.bfloat16).to(DEV)  # N > 8: falls back to the reference
    w = make_weight(16, 64, "bf16", DEV)
    assert torch.equal(G.KERNELS["gemv"](x, w, use_pdl=False), linear.gemv(x, w))


def _bad_inputs():
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.randn(16, 64).to(torch.bfloat16)
    q = quantize(w)
    nv = [q.codes, q.scales, q.global_scale]
    return [
        ("x", x.float(), [w], None),  # wrong dtype
        ("x", torch.randn(9, 64).to(torch.bfloat16), [w], None),  # N > 8
        ("x", torch.randn(64, 4).to(torch.bfloat16).t(), [w], None),  # not contiguous
        ("w[0]", x, [w.float()], None),
        ("w[0]", x, [torch.randn(16, 32).to(torch.bfloat16)], None),  # K mismatch
        ("w[0]", x, [torch.randn(64, 16).to(torch.bfloat16).t()], None),  # not contiguous
        ("w[0]", x, [q.codes.to(torch.int8), q.scales, q.global_scale], None),
        ("w[1]", x, [q.codes, q.scales.float(), q.global_scale], None),
        ("w[1]", x, [q.codes, q.scales[:, :2].contiguous(), q.global_scale], None),
        ("w[2]", x, [q.codes, q.scales, q.global_scale.reshape(1)], None),
        ("w must", x, [w, w], None),
        ("out", x, [w], torch.empty(2, 16)),  # fp32 out
        ("out", x, nv, torch.empty(2, 15, dtype=torch.bfloat16)),
        ("out", x, [w], torch.empty(16, 2, dtype=torch.bfloat16).t()),  # not contiguous
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_gemv_rejects_bad_inputs(case):
    name, x, w, out = _bad_inputs()[case]
    with pytest.raises(ValueError, match=f"gemv: {name}".replace("[", r"\[").replace("]", r"\]")):
        gemv(x, w, out=out)


# The model's shapes as [F, K] weights: q_proj, o_proj, experts gate/up, expert down,
# the dense down projection, and the bf16 LM head.
GPU_SHAPES = [(4096, 2048, "q_proj"), (2048, 4096, "o_proj"), (512, 2048, "expert_gate_up"),
              (2048, 512, "expert_down"), (2048, 10240, "dense_down"), (151552, 2048, "lm_head")]


@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
@pytest.mark.parametrize("N", [1, 8])
@pytest.mark.parametrize("F,K,name", GPU_SHAPES, ids=[s[2] for s in GPU_SHAPES])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gemv_model_shapes_gpu(F, K, name, N, fmt, use_pdl):
    if name == "lm_head" and fmt != "bf16":
        pytest.skip("the lm_head stays bf16")
    x = torch.randn(N, K, device="cuda").to(torch.bfloat16)
    w = make_weight(F, K, fmt, "cuda")
    out = torch.full((N, F), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemv(x, w, out=out, use_pdl=use_pdl)
    torch.cuda.synchronize()
    assert_close_bf16(out, gemv_reference(x, w), x, w, min_identical=0.9)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_gs"])
@pytest.mark.parametrize("N", [1, 3, 8])
@pytest.mark.parametrize("F,K", [(4096, 2048), (2048, 4096)])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_every_sweep_config_gpu(F, K, N, fmt):
    """Every candidate `benchmarks/bench_gemv.py --sweep` may write into TUNED is correct
    (configs that do not fit the GPU are skipped, as the sweep skips them); the one-step
    family at N = 1 only, where its sweeps ran (it keeps the GPU run short)."""
    x = torch.randn(N, K, device="cuda").to(torch.bfloat16)
    w = make_weight(F, K, fmt, "cuda")
    ref = gemv_reference(x, w)
    fmt_key = "nvfp4" if fmt.startswith("nvfp4") else "bf16"
    cands = G.sweep_configs(fmt_key, N, F, K, x.device, family="all" if N == 1 else "classic",
                            flat_ok=True)
    cands += [c for c in G.sweep_configs(fmt_key, N, F, K, x.device, family="swap") if c not in cands]
    for cfg in cands:
        out = torch.full((N, F), float("nan"), dtype=torch.bfloat16, device="cuda")
        try:
            gemv(x, w, out=out, config=cfg, use_pdl=True)
            torch.cuda.synchronize()
        except triton.runtime.errors.OutOfResources:
            continue
        assert_close_bf16(out, ref, x, w, min_identical=0.9)
