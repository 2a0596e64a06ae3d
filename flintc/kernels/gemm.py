"""Prefill GEMM (bf16 and NVFP4 W4A16 weights), the NVFP4 dequantization kernel, the LM
head and the embedding lookup: launchers for `flintc::gemm`, `flintc::lm_head` and
`flintc::embedding` (references: the op bodies in `flintc/ops/linear.py`, i.e.
`flintc.model.ops.linear` / `lm_head` and `table[ids]`).

Design. Prefill runs N = 512..8192 rows per chunk, where a GEMM is compute-bound, so the
matmul itself is cuBLAS (`torch.mm`). For NVFP4 weights a Triton kernel first decodes the
whole matrix to bf16 (`e2m1 * e4m3` has at most 4 significant bits and lies in bf16's
range: exact) into a reusable per-device workspace; cuBLAS then multiplies bf16 x bf16.

Numerics (FLINT_SPEC section 3). On CUDA the GEMM is `aten::mm.dtype` (bf16 operands,
fp32 accumulation, **fp32 output**), then for NVFP4 the global scale multiplies the fp32
result, then one rounding to bf16. This keeps the reference's single rounding point; a
bf16-output `torch.mm` would also accumulate in fp32, but cuBLAS may then reduce split-K
partials in bf16 (`allow_bf16_reduced_precision_reduction` is on by default), which adds
a rounding, so fp32 output is the one closer to the reference (`precise=False` selects
bf16 output for the benchmark's comparison). Every product is exact in fp32, so the only
difference from the reference (an fp32 `x.float() @ w.float().T`) is the order of the fp32
additions: |out - ref| <= one bf16 ulp + K * 2^-24 * sum_k |x_k w_k|, and most elements
are bit-identical. On CPU the launchers compute the reference expression itself
(bit-identical). `lm_head` is the same GEMM with the fp32 result returned unrounded;
`embedding` is a row gather (bit-exact).

Nothing here host-synchronizes or allocates data-dependently; the NVFP4 workspace grows on
the first call with a larger weight, so the first call must not be inside CUDA-graph
capture: the runtime warms the prefill function up before capturing it, and the graph
holds a reference to the workspace it was captured with (`CompiledRunner._capture_prefill`),
so a later growth cannot free memory the graph writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from flintc.kernels.tiles import e2m1_fp32
from flintc.model import ops
from flintc.ops.common import CDT, as_weight

NVFP4_BLOCK = 16  # weights per E4M3 block scale
DEQUANT_BLOCK = 1024  # code bytes (2048 weights) per dequant program


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------- Triton helpers
# E2M1 decode: the shared one of the decode kernels (`flintc.kernels.tiles.e2m1_fp32`,
# integer ops only, exact on every backend); also imported by flintc.kernels.grouped_gemm.
_e2m1_to_fp32 = e2m1_fp32


@triton.jit
def _round_to_bf16(v):
    """fp32 -> bf16, round to nearest even, done on the bits (the Triton interpreter's
    fp32 -> bf16 cast truncates; rounding onto the bf16 grid first makes the final cast
    exact on every backend). NaN stays NaN."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    rounded = bits.to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded).to(tl.bfloat16)


@triton.jit
def _dot_acc(acc, a, w, DOT_BF16: tl.constexpr):
    """acc[M, F] += a[M, k] @ w[F, k]^T, exact products, fp32 accumulation. All operand
    values are exact in bf16 (bf16 activations and weights, e2m1 * e4m3), so on the GPU the
    tensor cores take bf16; the interpreter mishandles bf16 math, so there both sides are
    upcast and the dot runs in IEEE fp32."""
    if DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    else:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")


@triton.jit
def _load_weight_tile(w_ptr, scales_ptr, offs_f, mask_f, k0, K,
                      BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr):
    """Raw weight tile of rows `offs_f`, columns [k0, k0 + BLOCK_K) of a row-major [F, K]
    matrix at w_ptr. bf16: (w [BLOCK_F, BLOCK_K], w again as a placeholder). NVFP4: (codes
    uint8 [BLOCK_F, BLOCK_K/2], scales fp8 [BLOCK_F, BLOCK_K/2], each scale repeated for
    the 8 bytes it covers), from codes [F, K/2] at w_ptr and scales [F, K/16] at scales_ptr."""
    if IS_NVFP4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        # mask: row exists and the byte's two weights lie inside K (K even).
        mask = mask_f[:, None] & (2 * offs_b < K)[None, :]
        codes = tl.load(w_ptr + offs_f[:, None] * (K // 2) + offs_b[None, :], mask=mask, other=0)
        offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        mask_s = mask_f[:, None] & (16 * offs_s < K)[None, :]
        scales = tl.load(scales_ptr + offs_f[:, None] * (K // 16) + offs_s[None, :],
                         mask=mask_s, other=0.0)
        scales = tl.broadcast_to(scales[:, :, None], (scales.shape[0], BLOCK_K // 16, 8))
        scales = tl.reshape(scales, (scales.shape[0], BLOCK_K // 2))
        return codes, scales
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_f[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + offs_f[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        return w, w


# ---------------------------------------------------------------------------- NVFP4 dequant
@triton.jit
def nvfp4_dequant_kernel(
    codes_ptr,  # uint8 [R * K/2] (R rows of K weights, contiguous): weight 2j low nibble of byte j
    scales_ptr,  # float8_e4m3fn [R * K/16]: one scale per 16 weights = 8 bytes of codes
    out_ptr,  # bf16 [R * K]
    n_bytes,  # R * K/2
    BLOCK: tl.constexpr,  # code bytes per program
):
    # Program p decodes code bytes [p * BLOCK, (p + 1) * BLOCK) of the flattened matrix.
    # K % 16 == 0, so a row's K/2 bytes are a whole number of 8-byte scale groups and the
    # scale of flat byte b is flat scale b // 8, whatever row b lies in.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes  # the last program may stick out past the matrix
    c = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scales_ptr + offs // 8, mask=mask, other=0.0).to(tl.float32)  # exact
    # e2m1 * e4m3: <= 4 significant bits, exponent within bf16's range: exact in bf16, so
    # the casts below do not round (and the interpreter's truncating cast is harmless).
    lo = (_e2m1_to_fp32(c & 15) * s).to(tl.bfloat16)  # weight 2j
    hi = (_e2m1_to_fp32(c >> 4) * s).to(tl.bfloat16)  # weight 2j + 1
    tl.store(out_ptr + 2 * offs, lo, mask=mask)
    tl.store(out_ptr + 2 * offs + 1, hi, mask=mask)


_WORKSPACE: dict[tuple[str, int | None], torch.Tensor] = {}


def _workspace(numel: int, device: torch.device) -> torch.Tensor:
    """A bf16 buffer of at least `numel` elements on `device`, reused across calls (grown
    when too small). Kernels on one stream use it in order, so reuse is safe there."""
    key = (device.type, device.index)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.bfloat16, device=device)
        _WORKSPACE[key] = buf
    return buf[:numel]


def nvfp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
                     use_triton: bool | None = None) -> torch.Tensor:
    """Decode packed NVFP4 codes and block scales to bf16, without the global scale.

    Args:
        codes: uint8 [..., R, K/2], contiguous (layout of `flintc.quant.nvfp4`).
        scales: float8_e4m3fn [..., R, K/16], contiguous, on codes' device.
        out: optional contiguous bf16 [..., R, K] to write into; allocated when None.
        use_triton: run the Triton kernel (default: on CUDA, or on CPU under
            TRITON_INTERPRET=1); False: the torch decoder `flintc.quant.nvfp4.dequantize_packed`.

    Returns:
        bf16 [..., R, K]: `e2m1(code) * e4m3(scale)`, exact (equal in value to
        `NVFP4Tensor.dequantize(with_global_scale=False)`; code 8 decodes to -0.0 here).

    Raises:
        ValueError: a dtype, shape, device or contiguity is wrong (the message names it).
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() < 2 \
            or not codes.is_contiguous():
        raise ValueError("nvfp4_dequantize: codes must be a contiguous uint8 tensor [..., R, K/2]")
    K = codes.shape[-1] * 2
    lead = tuple(codes.shape[:-1])
    if K % NVFP4_BLOCK:
        raise ValueError(f"nvfp4_dequantize: codes has K={K} weights per row; NVFP4 needs "
                         f"K % {NVFP4_BLOCK} == 0")
    if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float8_e4m3fn
            or tuple(scales.shape) != lead + (K // NVFP4_BLOCK,) or not scales.is_contiguous()
            or scales.device != codes.device):
        raise ValueError(f"nvfp4_dequantize: scales must be a contiguous float8_e4m3fn tensor "
                         f"{list(lead) + [K // NVFP4_BLOCK]} on {codes.device}, got "
                         f"{getattr(scales, 'dtype', None)} {tuple(getattr(scales, 'shape', ()))}")
    if out is None:
        out = torch.empty(lead + (K,), dtype=torch.bfloat16, device=codes.device)
    elif (out.dtype != torch.bfloat16 or tuple(out.shape) != lead + (K,) or not out.is_contiguous()
          or out.device != codes.device):
        raise ValueError(f"nvfp4_dequantize: out must be a contiguous bf16 tensor {list(lead) + [K]} "
                         f"on {codes.device}")
    if use_triton is None:
        use_triton = codes.device.type == "cuda" or _interpreting()
    if not use_triton:
        from flintc.quant.nvfp4 import dequantize_packed

        out.copy_(dequantize_packed(codes, scales, None, torch.float32))
        return out
    n_bytes = codes.numel()
    if n_bytes:
        nvfp4_dequant_kernel[(triton.cdiv(n_bytes, DEQUANT_BLOCK),)](
            codes, scales, out, n_bytes, BLOCK=DEQUANT_BLOCK, num_warps=4)
    return out


# ---------------------------------------------------------------------------- checks
def _fail(op: str, name: str, what: str, t) -> None:
    if isinstance(t, torch.Tensor):
        got = f"dtype {t.dtype}, shape {tuple(t.shape)}, strides {tuple(t.stride())}, device {t.device}"
    else:
        got = type(t).__name__
    raise ValueError(f"{op}: {name} must be {what}; got {got}")


def _check_weight(op: str, w, K: int, device: torch.device):
    """Validate a 2-D weight list; returns (is_nvfp4, F)."""
    if not isinstance(w, (list, tuple)) or len(w) not in (1, 3):
        raise ValueError(f"{op}: w must be a list [weight] (bf16) or [codes, scales, "
                         f"global_scale] (NVFP4), got {type(w).__name__} of length "
                         f"{len(w) if isinstance(w, (list, tuple)) else '-'}")
    if len(w) == 1:
        (weight,) = w
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 \
                or weight.dim() != 2 or weight.shape[1] != K or weight.device != device:
            _fail(op, "w[0] (weight)", f"a bf16 tensor [F, {K}] on {device}", weight)
        return False, weight.shape[0]
    codes, scales, gscale = w
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 2 \
            or codes.shape[1] * 2 != K or codes.device != device or not codes.is_contiguous():
        _fail(op, "w[0] (NVFP4 codes)", f"a contiguous uint8 tensor [F, {K // 2}] on {device}", codes)
    if K % NVFP4_BLOCK:
        raise ValueError(f"{op}: x has K={K}; NVFP4 weights need K % {NVFP4_BLOCK} == 0")
    F = codes.shape[0]
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float8_e4m3fn \
            or tuple(scales.shape) != (F, K // NVFP4_BLOCK) or scales.device != device \
            or not scales.is_contiguous():
        _fail(op, "w[1] (NVFP4 block scales)",
              f"a contiguous float8_e4m3fn tensor [{F}, {K // NVFP4_BLOCK}] on {device}", scales)
    if not isinstance(gscale, torch.Tensor) or gscale.dtype != torch.float32 or gscale.dim() != 0 \
            or gscale.device != device:
        _fail(op, "w[2] (NVFP4 global scale)", f"an fp32 scalar tensor [] on {device}", gscale)
    return True, F


def _check_x(op: str, x) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() < 2:
        _fail(op, "x", "a bf16 tensor [..., K] (at least 2-D)", x)
    if x.stride(-1) != 1:
        _fail(op, "x", "a tensor with a contiguous last dim", x)


def _mm_fp32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """fp32 [M, F] = a [M, K] @ b_t [K, F] for bf16 operands with fp32 accumulation, no
    rounding: cuBLAS bf16 GEMM with fp32 output (`aten::mm.dtype`) on CUDA; on CPU the
    reference's own expression (upcast, fp32 matmul), so CPU results are bit-identical."""
    if a.device.type == "cuda" and hasattr(torch.ops.aten.mm, "dtype"):
        return torch.ops.aten.mm.dtype(a, b_t, torch.float32)
    return a.to(torch.float32) @ b_t.to(torch.float32)


# ---------------------------------------------------------------------------- gemm
def gemm(x: torch.Tensor, w: list[torch.Tensor], *, use_pdl: bool = False,
         precise: bool = True) -> torch.Tensor:
    """Prefill `x @ W^T`, as `flintc::gemm` (reference: `flintc.model.ops.linear`).

    Args:
        x: bf16 [..., K] (usually [N, K], N = chunk tokens), last dim contiguous.
        w: `[weight]` bf16 [F, K] (any strides), or NVFP4 `[codes, scales, global_scale]`:
            codes uint8 [F, K/2], scales float8_e4m3fn [F, K/16] (both contiguous),
            global_scale fp32 []; K % 16 == 0. All on x's device.
        use_pdl: accepted for the kernel contract; cuBLAS launches ignore it.
        precise: True (default): fp32-output GEMM, then (NVFP4) the global scale, then
            one rounding. False: bf16-output cuBLAS GEMM (one fewer pass over the output,
            may round split-K partials in bf16); for NVFP4 the fp32 path is always used,
            since the global scale must meet the unrounded accumulator.

    Returns:
        bf16 [..., F]. Numerics: see the module docstring (<= 1 bf16 ulp + reordering
        bound from the reference on CUDA; bit-identical on CPU).

    Raises:
        ValueError: a dtype, shape, device or stride does not match the above.
    """
    del use_pdl
    _check_x("gemm", x)
    K = x.shape[-1]
    is_nvfp4, F = _check_weight("gemm", w, K, x.device)
    x2 = x.reshape(-1, K)
    if is_nvfp4:
        codes, scales, gscale = w
        wd = nvfp4_dequantize(codes, scales, out=_workspace(F * K, x.device).view(F, K))
        # the global scale on the fp32 accumulator (FLINT_SPEC 3), rounded once as the
        # product is stored (fp32 multiply, then the same RNE as `.to(bfloat16)`)
        out = torch.empty(x2.shape[0], F, dtype=torch.bfloat16, device=x.device)
        return torch.mul(_mm_fp32(x2, wd.T), gscale, out=out).view(*x.shape[:-1], F)
    if precise or x.device.type != "cuda":
        y = _mm_fp32(x2, w[0].T)
    else:
        return (x2 @ w[0].T).view(*x.shape[:-1], F)
    return y.to(torch.bfloat16).view(*x.shape[:-1], F)


def gemm_reference(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """The op's reference (`flintc.model.ops.linear`): plain torch, fp32, one rounding."""
    return ops.linear(x, as_weight(w), CDT)


# ---------------------------------------------------------------------------- lm_head
def lm_head(x: torch.Tensor, w: torch.Tensor, *, use_pdl: bool = False) -> torch.Tensor:
    """Logits `x @ lm_head^T` with fp32 accumulation, never rounded, as `flintc::lm_head`
    (reference: `flintc.model.ops.lm_head`).

    For prefill the runtime usually needs only the last token's row; the op contract
    returns every row, so pass only the rows you need (e.g. `x[-1:]`) to save the GEMM.

    Args:
        x: bf16 [N, H], last dim contiguous.
        w: bf16 [V, H] on x's device.
        use_pdl: accepted for the kernel contract; ignored (cuBLAS).

    Returns:
        fp32 [N, V]. On CUDA: cuBLAS bf16 GEMM with fp32 output, equal to the reference up
        to fp32 reordering (|diff| <= H * 2^-24 * sum |x_k w_k|); on CPU bit-identical.

    Raises:
        ValueError: wrong dtype, rank, shape or device.
    """
    del use_pdl
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 \
            or x.stride(-1) != 1:
        _fail("lm_head", "x", "a bf16 tensor [N, H] with a contiguous last dim", x)
    H = x.shape[1]
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2 \
            or w.shape[1] != H or w.device != x.device:
        _fail("lm_head", "w", f"a bf16 tensor [V, {H}] on {x.device}", w)
    return _mm_fp32(x, w.T)


# ---------------------------------------------------------------------------- embedding
def embedding(ids: torch.Tensor, table: torch.Tensor, *, use_pdl: bool = False) -> torch.Tensor:
    """Row lookup `table[ids]`, as `flintc::embedding` (bit-exact).

    Args:
        ids: int64 [B, T] token ids in [0, V) (not range-checked here: that would need a
            host sync; out-of-range ids raise on CPU and trip a device assert on CUDA).
        table: bf16 [V, H] on ids' device.
        use_pdl: accepted for the kernel contract; ignored.

    Returns:
        bf16 [B, T, H], a new tensor.

    Raises:
        ValueError: wrong dtype, rank or device.
    """
    del use_pdl
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 2:
        _fail("embedding", "ids", "an int64 tensor [B, T]", ids)
    if not isinstance(table, torch.Tensor) or table.dtype != torch.bfloat16 or table.dim() != 2 \
            or table.device != ids.device:
        _fail("embedding", "table", f"a bf16 tensor [V, H] on {ids.device}", table)
    return torch.nn.functional.embedding(ids, table)


KERNELS: dict[str, Callable] = {
    "gemm": gemm,
    "lm_head": lm_head,
    "embedding": embedding,
}
