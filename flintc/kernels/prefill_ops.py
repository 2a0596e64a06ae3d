"""The prefill step's norms and elementwise ops: launchers for `flintc::rms_norm`,
`flintc::add_rms_norm`, `flintc::silu_mul` and `flintc::qk_norm_rope` (references: the op
bodies in `flintc/ops/norm.py` and `flintc/ops/attention.py`, i.e. `flintc.model.ops`),
plus `expert_combine` and `silu_mul(..., out=)` for `flintc.kernels.grouped_gemm`.

Two implementations, picked per call by the device of the first tensor (`_use_triton`):

* CUDA: one Triton kernel each (`flintc.kernels.prefill_norm`), fp32 math with the
  reference's rounding points, within the bounds that module states (sums in another
  order: equal, or one bf16 ulp away at a rounding boundary). An aten expression would
  launch 4-26 elementwise and reduction kernels per op over fp32 intermediates.
* elsewhere (the CPU): the reference expressions with fewer aten kernels, bit-identical to
  them. They compute the same fp32 values in the same order and drop only launches that
  change no value,

  - an upcast copy `t.to(float32)` feeding a binary op whose other operand is fp32: type
    promotion converts the bf16 operand to fp32 on load (exact), so `a.to(f32) * b` and
    `a * b` compute the same fp32 products;
  - a final `.to(bfloat16)` after the last fp32 op, and `torch.cat` of fp32 halves
    followed by one: the last op writes into a bf16 `out=` tensor (or its two halves)
    instead; it still computes in fp32 (the common dtype of its inputs) and rounds once on
    the store, with the same round-to-nearest-even conversion as the copy.

  Reductions (the RMSNorm mean, the combine's sum over experts) stay the very same torch
  ops on the same fp32 inputs, so their summation order is unchanged.

A RoPE table that is not fp32, or a weight list not bf16-shaped, takes the reference op.
No host sync and no data-dependent shape anywhere (CUDA-graph capturable).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flintc.kernels import prefill_norm

F32 = torch.float32


def _use_triton(t: torch.Tensor) -> bool:
    """Whether a call on `t` takes the Triton kernel: on CUDA. A seam: the op counter
    (`flintc.runtime.opcount`, `gpu_like`) makes CPU calls count as the GPU's."""
    return t.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_pdl: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim, as `flintc::rms_norm` (`flintc.model.ops.rms_norm`):
    `x * rsqrt(mean(x^2) + eps) * w` in fp32, rounded once to x's dtype.

    Args:
        x: bf16 [..., H]; weight: [H] (fp32, or any dtype fp32 holds exactly, e.g. bf16).
        eps: the epsilon. use_pdl: accepted for the kernel contract; ignored.

    Returns:
        [..., H] in x's dtype. CUDA: 1 Triton kernel (`prefill_norm.rms_norm`, within one
        bf16 ulp). CPU: bit-identical to the reference, 7 kernels (the reference: 8).

    Raises:
        ValueError (CUDA): a dtype, shape or layout the kernel does not take.
    """
    del use_pdl
    if _use_triton(x):
        return prefill_norm.rms_norm(x, weight, eps)
    xc = x.to(F32)
    r = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)
    return torch.mul(xc * r, weight, out=torch.empty_like(x))


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it, as `flintc::add_rms_norm`:
    `h = bf16(fp32 x + fp32 y)` (`flintc.model.ops.residual_add`), `rms_norm(h)`.

    Args:
        x, y: bf16 [..., H] of one shape; weight: [H] (as for `rms_norm`); eps: the epsilon.
        use_pdl: ignored.

    Returns:
        (h, normed), both [..., H] in x's dtype. CUDA: 1 Triton kernel (h bit-identical,
        normed within one bf16 ulp). CPU: bit-identical to the reference, 9 kernels (12).

    Raises:
        ValueError (CUDA): a dtype, shape or layout the kernel does not take.
    """
    del use_pdl
    if _use_triton(x):
        return prefill_norm.add_rms_norm(x, y, weight, eps)
    h = torch.add(x, y.to(F32), out=torch.empty_like(x))  # fp32 sum (promotion), one rounding
    return h, rms_norm(h, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None,
             use_pdl: bool = False) -> torch.Tensor:
    """`silu(g) * u` in fp32, rounded once, as `flintc::silu_mul` (`flintc.model.ops.silu_mul`).

    Args:
        gate, up: bf16 [..., F], same shape.
        out: optional tensor of gate's dtype and shape to write into (e.g. a strided slice).
        use_pdl: ignored.

    Returns:
        `out` (or a new tensor like gate). CUDA: 1 Triton kernel (within one bf16 ulp).
        CPU: bit-identical to the reference, 4 kernels (6).

    Raises:
        ValueError (CUDA): a dtype, shape or layout the kernel does not take.
    """
    del use_pdl
    if _use_triton(gate):
        return prefill_norm.silu_mul(gate, up, out=out)
    g = gate.to(F32)
    return torch.mul(g * torch.sigmoid(g), up, out=torch.empty_like(gate) if out is None else out)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`flintc.model.ops.apply_rope` (x bf16 [B, T, heads, D]; cos, sin fp32 [B, T, D/2]):
    each half written by its last fp32 op into the bf16 output. 6 kernels (9)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # bf16, promoted to fp32 by the products
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.empty_like(x)
    torch.sub(x1 * c, x2 * s, out=out[..., :half])
    torch.add(x2 * c, x1 * s, out=out[..., half:])
    return out


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, rope: bool, *,
                 use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then RoPE when `rope`, as `flintc::qk_norm_rope`.

    Args:
        q: bf16 [B, T, Hq, D]; k: bf16 [B, T, Hkv, D]; q_norm, k_norm: fp32 [D];
        cos, sin: fp32 [B, T, D/2] (ignored unless `rope`; other dtypes take the
        reference op). eps: the epsilon. use_pdl: ignored.

    Returns:
        (q, k) bf16, normed and rotated. CUDA: 1 Triton kernel for both (within the bound
        of `flintc.kernels.prefill_norm`). CPU: bit-identical to the reference, 26 kernels
        with RoPE, 14 without.

    Raises:
        ValueError (CUDA): a dtype, shape or layout the kernel does not take.
    """
    del use_pdl
    if rope and (cos.dtype != F32 or sin.dtype != F32):
        return torch.ops.flintc.qk_norm_rope.default(q, k, q_norm, k_norm, cos, sin, eps, rope)
    if _use_triton(q):
        return prefill_norm.qk_norm_rope(q, k, q_norm, k_norm, cos, sin, eps, rope)
    q = rms_norm(q, q_norm, eps)
    k = rms_norm(k, k_norm, eps)
    if rope:
        q = _rope(q, cos, sin)
        k = _rope(k, cos, sin)
    return q, k


def expert_combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """`flintc.model.ops.expert_combine` in fp32: `bf16(sum_k w_k * y_k + y_shared)`.

    Args:
        y: bf16 [N, K, H]; weights: fp32 [N, K]; shared: bf16 [N, H] or None.

    Returns:
        [N, H] in y's dtype. CUDA: 1 Triton kernel (slot-order sum, within the bound of
        `flintc.kernels.prefill_norm`). CPU: bit-identical to the reference (the same fp32
        products summed over k by the same reduction), 3 kernels with a shared expert (6),
        else 3 (4).

    Raises:
        ValueError (CUDA): a dtype, shape or layout the kernel does not take.
    """
    if _use_triton(y):
        return prefill_norm.expert_combine(y, weights, shared)
    m = (weights.to(F32)[..., None] * y).sum(dim=1)  # [N, H] fp32
    if shared is None:
        return m.to(y.dtype)
    return torch.add(m, shared, out=torch.empty(m.shape, dtype=y.dtype, device=m.device))


KERNELS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "silu_mul": silu_mul,
    "qk_norm_rope": qk_norm_rope,
}
