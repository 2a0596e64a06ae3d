"""Fast plain-torch baselines for the decode kernels' benchmarks (`bench_gemv.py`,
`bench_moe.py`): what a PyTorch user gets for the same op on a GPU without custom
kernels, timed eagerly and under `torch.compile` (issue 5: "compare each with what torch
gives for the same op").

- bf16 weights: bf16 GEMMs (`x @ w.T`: cuBLAS, fp32 accumulation inside, bf16 out).
- NVFP4 weights: each call dequantizes the packed codes to bf16 (`nvfp4_to_bf16`:
  `e2m1 * E4M3 block scale` is exact in bf16), runs the bf16 GEMM, then multiplies by the
  fp32 global scale. Hopper has no FP4 tensor cores (`torch._scaled_mm`'s FP4 path needs
  sm_100), so this dequantize-then-GEMM is the plain-torch W4A16 path there.
- MoE: the reference's routing (`flintc.model.ops.select_topk`: sigmoid, stable sort of
  scores + bias, normalised weights), then the selected experts only: bf16 experts as one
  grouped GEMM per projection over the (token, expert) rows sorted by expert
  (`torch.nn.functional.grouped_mm`, where it runs without a host sync: sm_90 / sm_100,
  and the CPU; each distinct expert read once, in place), NVFP4 experts (and bf16 on
  other GPUs) gathered per token (`w[ids]`) and multiplied in bf16
  (`flintc.bench.fast_model.experts`).
- Norms, SiLU-and-mul, the combine and residual adds: `flintc.model.ops` in fp32, each
  result rounded once to bf16 (elementwise; `torch.compile` fuses them).
- GEMVs also in the multiply-and-sum form (`linear_mulsum`: fp32 products summed over
  K, the NVFP4 decode inside the expression), which `torch.compile` fuses into one
  reduction kernel over the packed weight: the other way a PyTorch user can write a
  decode GEMV, compiled only.

These are speed baselines, not references: they round where cuBLAS and bf16 arithmetic
round (e.g. a GEMM's output to bf16 before the NVFP4 global scale, the router logits to
bf16), not at FLINT_SPEC section 3's rounding points, which the reference ops
(`torch.ops.flintc.*`, fp32) and flintc's kernels follow. tests/bench/test_torch_baselines.py
checks them against the reference ops on the CPU (ids exactly, values within bf16
tolerances).

Weights are passed as lists, as the benchmarks hold them: `[w]` (bf16 [..., F, K]) or
`[codes, scales, global_scale]` (NVFP4: uint8 [..., F, K/2], float8_e4m3fn [..., F, K/16],
fp32 [] or [E]; the loader's packed layout, FLINT_SPEC section 4).

`nvfp4_to_bf16`, `linear`, `linear_mulsum`, `logits` and `experts` live in `flintc.bench.fast_model`
(the whole-model fast baseline of `flintc bench --baselines fast` is built from them)
and are imported here under the same names.
"""

from __future__ import annotations

import torch

from flintc.bench.fast_model import experts, linear, linear_mulsum, logits, nvfp4_to_bf16  # noqa: F401  (this module's API)
from flintc.model import ops

F32 = torch.float32
BF16 = torch.bfloat16


def norm_router(x: torch.Tensor, norm: torch.Tensor, router: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (fp32, rounded to bf16) and the router GEMM in bf16. x: bf16 [..., H];
    norm: fp32 [H]; router: bf16 [E, H]. -> (normed x bf16 [N, H], logits fp32 [N, E])."""
    h = ops.rms_norm(x, norm, eps, F32).reshape(-1, x.shape[-1])
    return h, (h @ router.T).to(F32)


def moe_topk_gate_up(x, logits_, bias, gate, up, shared_gate, shared_up, top_k: int,
                     scaling: float):
    """Top-k routing, then the selected and the shared experts' gate/up GEMVs and
    SiLU-and-mul. x: bf16 [N, H]; logits_: fp32 [N, E]; bias: fp32 [E]; gate, up: stacked
    [E, F, H]; shared_gate / shared_up: [F, H]. -> (h bf16 [N, K + 1, F] (the shared
    expert last), weights fp32 [N, K], ids int64 [N, K]), as `flintc::moe_topk_gate_up`."""
    weights, ids = ops.select_topk(logits_, bias, top_k, scaling)
    g = torch.cat([experts(x, ids, gate), linear(x, shared_gate)[:, None]], dim=1)
    u = torch.cat([experts(x, ids, up), linear(x, shared_up)[:, None]], dim=1)
    return ops.silu_mul(g, u, F32), weights, ids


def moe_down_combine_residual(h, ids, weights, down, shared_down, residual):
    """The selected and shared experts' down GEMVs, the weighted combine and the residual
    add. h: bf16 [N, K + 1, F]; ids: int64 [N, K]; weights: fp32 [N, K]; down: stacked
    [E, H, F]; shared_down: [H, F]; residual: bf16 [..., H]. -> bf16, residual's shape."""
    k = ids.shape[1]
    y = experts(h[:, :k], ids, down)  # [N, K, H]
    m = ops.expert_combine(y, weights, linear(h[:, k], shared_down), F32)
    return ops.residual_add(residual, m.view(residual.shape), F32)


def moe_layer(x, norm, router, bias, gate, up, down, shared_gate, shared_up, shared_down,
              top_k: int, scaling: float, eps: float):
    """The three MoE kernels' ops chained (x: bf16 [..., H]; -> bf16, x's shape)."""
    xn, lg = norm_router(x, norm, router, eps)
    h, w, ids = moe_topk_gate_up(xn, lg, bias, gate, up, shared_gate, shared_up, top_k, scaling)
    return moe_down_combine_residual(h, ids, w, down, shared_down, x)


def compile_fresh(fn, **kwargs):
    """`torch.compile(fn, dynamic=False, **kwargs)` after `torch._dynamo.reset()`, with
    `fail_on_recompile_limit_hit` on where torch has it.

    Why: Dynamo keeps at most `recompile_limit` (8) compiled variants per code object and
    past that runs the function eagerly with one warning in the log; a benchmark that
    compiles one expression for 2 formats x 4 batches then times eager code in its
    "compile" column (bench_gemv.py did in session 36's H100 run: the limit was hit three
    times, and several rows' compile times equal their eager ones). The reset starts each
    compile with an empty cache; the flag makes a hit raise instead."""
    import torch._dynamo as dynamo

    dynamo.reset()
    if hasattr(dynamo.config, "fail_on_recompile_limit_hit"):
        dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(fn, dynamic=False, **kwargs)
