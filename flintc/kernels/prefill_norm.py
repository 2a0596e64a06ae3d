"""Triton kernels for the prefill step's norms and elementwise ops on the GPU: RMSNorm
(alone and after the residual add, `flintc::add_rms_norm`), the per-head Q/K RMSNorm with
RoPE, the MoE expert combine with the shared expert, and SiLU-and-mul, each one launch
over a whole chunk. `flintc.kernels.prefill_ops` calls them for CUDA tensors (its torch
bodies, bit-identical to the reference, stay the CPU path); they also run under Triton's
interpreter (`TRITON_INTERPRET=1`), where tests check them against the references in
`flintc.model.ops`. `rms_norm` also runs the decode schedule's final norm in a build
compiled with `split_lm_head_norm` (`flintc.kernels.fused_gemv.rms_norm`, with PDL:
`USE_PDL`, as every decode kernel).

Numerics (FLINT_SPEC 3): bf16 loads upcast to fp32 at once, fp32 math, one rounding to
bf16 (round to nearest even, `flintc.kernels.gemv._round_to_bf16`) at each of the
reference's rounding points and nowhere else. What differs from the reference ops:

* the sums run in another order: the RMSNorm sum of squares (a tree over the row, where
  torch's `mean` has its own), and the combine's `sum_k w_k y_k` in slot order k = 0..K-1;
* 1/sqrt is IEEE `sqrt_rn` and `div_rn` (as torch's CPU rsqrt; torch's CUDA rsqrt is an
  approximation), Triton's sigmoid is not torch's, and on the GPU Triton contracts a
  multiply and an add into one FMA (RoPE's `x1 c - x2 s`, the combine's `acc + w y`).

Bounds, per output element against the reference op on the same inputs (`ulp`: the bf16
spacing at the reference value; `u` = 2^-24):

* `rms_norm`, `add_rms_norm`'s normed output: the sum of squares has relative error at
  most (H - 1) u (all terms >= 0), so the fp32 value before rounding is within
  (H / 2 + 4) u relative of the reference's (2^-14 at H = 2048), far below a bf16 ulp
  (>= 2^-8 relative): equal, or one ulp away where that value sits next to a rounding
  boundary. `add_rms_norm`'s h is bit-identical (one fp32 add of two bf16, one rounding).
* `qk_norm_rope` without RoPE: as `rms_norm` (over D). With RoPE the normed values n (bf16,
  a rounding point) may be one ulp apart, and the rotation `n1 c - n2 s` can cancel, so:
  |got - ref| <= ulp + 2^-7 (|n1 c| + |n2 s|) (computed with the reference's n).
* `expert_combine`: |got - ref| <= ulp + (K + 1) 2^-23 (sum_k |w_k y_k| + |y_shared|)
  (fp32 reordering of K + 1 terms, then one rounding; the sum may cancel).
* `silu_mul`: equal or one ulp away (a few fp32 ulps from sigmoid, no cancellation).

On the GPU an fp32 subnormal may also be flushed to zero (an extra 2^-126 absolute).
NaN and infinities propagate as in the reference (a row holding one gets NaN / 0 from the
norm, as torch's). tests/kernels/test_prefill_norm.py checks these bounds and reports the
share of elements that differ. Nothing runs at import; no host sync and no data-dependent
shape (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flintc.kernels.gemv import _bf16_grid, _round_to_bf16, fail
from flintc.kernels.pdl import PDL_OFF, pdl_mode
from flintc.kernels.platform import interpreting

# Largest tile one program holds: a whole row of H (rms_norm), or BLOCK_HEADS heads of D.
MAX_ROW = 16384
HEAD_TILE = 1024  # elements per qk_norm_rope program (8 heads of 128)
COL_BLOCK = 1024  # columns per program of the combine and SiLU-and-mul


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output allocation (torch.empty); a seam for tests, which poison it with NaN."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _warps(elements: int) -> int:
    """Warps for a program of `elements` (~8 per thread, 1 to 16 warps), a power of two:
    compiled Triton refuses any other num_warps (the interpreter does not check; 8 heads
    of D = 96 gave 3 and failed on an H100 in session 34)."""
    n = max(1, min(16, elements // 256))
    return 1 << (n.bit_length() - 1)


# ---------------------------------------------------------------------------- kernels
@triton.jit
def rms_norm_kernel(
    x_ptr, y_ptr,  # bf16 rows [R, H] (row strides x_stride, y_stride; y: HAS_RESIDUAL only)
    w_ptr,  # norm weight [H], fp32, bf16 or fp16
    h_ptr,  # out: bf16 [R, H], the residual sum bf16(x + y) (HAS_RESIDUAL only)
    out_ptr,  # out: bf16 [R, H] (row stride H), the RMSNorm
    H, x_stride, y_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = PDL_OFF,  # flintc.kernels.pdl (the decode schedule's final norm)
):
    # Program r: row r, all H columns in one tile (BLOCK_H >= H; the mask drops the padding
    # columns, loaded as 0 so they add nothing to the sum of squares).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before gdc_wait
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x (and y) are written by the previous kernel
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # flintc.model.ops.residual_add: fp32 sum of two bf16, rounded once; the norm reads
        # the rounded h, as the reference's rms_norm(h) does.
        y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = _bf16_grid(x + y)
        tl.store(h_ptr + row * H + cols, x.to(tl.bfloat16), mask=mask)
    ss = tl.sum(x * x, axis=0)
    r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, H * 1.0) + eps))
    tl.store(out_ptr + row * H + cols, _round_to_bf16(x * r * w), mask=mask)
    if USE_PDL == 1:  # PDL_LATE: trigger after the stores
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def qk_norm_rope_kernel(
    q_ptr, k_ptr,  # bf16 [N, HQ, D], [N, HKV, D] (N = B * T), contiguous
    qn_ptr, kn_ptr,  # per-head norm weights [D], fp32, bf16 or fp16
    cos_ptr, sin_ptr,  # fp32 [N, D/2] (the tables' rows at each token's position; ROPE only)
    q_out_ptr, k_out_ptr,  # out: bf16, shaped as q and k
    eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, ROPE: tl.constexpr,
):
    # Program (n, j): token n; heads [j BH, (j + 1) BH) of q for j < Q_BLOCKS, else heads
    # [(j - Q_BLOCKS) BH, ...) of k (BH = BLOCK_HEADS). Each head is held as its two RoPE
    # halves, lo = dims [0, D/2) and hi = [D/2, D), each [BLOCK_HEADS, BLOCK_HALF]; the
    # mask drops heads past the tensor's count and dims past D/2 (BLOCK_HALF >= D/2).
    HALF: tl.constexpr = D // 2
    Q_BLOCKS: tl.constexpr = (HQ + BLOCK_HEADS - 1) // BLOCK_HEADS
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    if j < Q_BLOCKS:
        src = q_ptr + n * (HQ * D)
        dst = q_out_ptr + n * (HQ * D)
        w_ptr = qn_ptr
        h0 = j * BLOCK_HEADS
        num_heads = HQ
    else:
        src = k_ptr + n * (HKV * D)
        dst = k_out_ptr + n * (HKV * D)
        w_ptr = kn_ptr
        h0 = (j - Q_BLOCKS) * BLOCK_HEADS
        num_heads = HKV
    heads = h0 + tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_HALF)
    mask_d = d < HALF
    mask = (heads < num_heads)[:, None] & mask_d[None, :]
    offs = heads[:, None] * D + d[None, :]
    lo = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    # per-head RMSNorm over D (flintc.model.ops.rms_norm), rounded to bf16: a rounding point
    ss = tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)
    r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, D * 1.0) + eps))
    w_lo = tl.load(w_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    w_hi = tl.load(w_ptr + HALF + d, mask=mask_d, other=0.0).to(tl.float32)
    lo = _bf16_grid(lo * r[:, None] * w_lo[None, :])
    hi = _bf16_grid(hi * r[:, None] * w_hi[None, :])
    if ROPE:
        # rotate-half RoPE (flintc.model.ops.apply_rope) in fp32 from the normed bf16 values
        c = tl.load(cos_ptr + n * HALF + d, mask=mask_d, other=0.0)[None, :]
        s = tl.load(sin_ptr + n * HALF + d, mask=mask_d, other=0.0)[None, :]
        new_lo = lo * c - hi * s
        new_hi = hi * c + lo * s
        lo = new_lo
        hi = new_hi
    tl.store(dst + offs, _round_to_bf16(lo), mask=mask)
    tl.store(dst + offs + HALF, _round_to_bf16(hi), mask=mask)


@triton.jit
def expert_combine_kernel(
    y_ptr,  # bf16 [N, K, H]: the routed experts' outputs (strides y_s0, y_s1, 1)
    w_ptr,  # fp32 [N, K]: routing weights (strides w_s0, w_s1)
    shared_ptr,  # bf16 [N, H] (row stride shared_s0): the shared expert (HAS_SHARED only)
    out_ptr,  # out: bf16 [N, H], contiguous
    H, y_s0, y_s1, w_s0, w_s1, shared_s0,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Program (n, c): token n, columns [c BLOCK_H, (c + 1) BLOCK_H); the mask drops columns
    # past H. fp32 sum of w_k * y_k in slot order, then the shared expert, one rounding.
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    y_row = y_ptr + n * y_s0 + cols
    acc = tl.load(w_ptr + n * w_s0) * tl.load(y_row, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(1, K):
        wk = tl.load(w_ptr + n * w_s0 + k * w_s1)
        acc += wk * tl.load(y_row + k * y_s1, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + n * shared_s0 + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * H + cols, _round_to_bf16(acc), mask=mask)


@triton.jit
def silu_mul_kernel(
    g_ptr, u_ptr,  # bf16 rows [R, F] (row strides g_stride, u_stride)
    out_ptr,  # out: bf16 rows [R, F] (row stride out_stride)
    F, g_stride, u_stride, out_stride,
    BLOCK_F: tl.constexpr,
):
    # Program (r, c): row r, columns [c BLOCK_F, (c + 1) BLOCK_F); the mask drops columns
    # past F. flintc.model.ops.silu_mul: silu(g) * u in fp32, one rounding.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < F
    g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, _round_to_bf16(g * tl.sigmoid(g) * u), mask=mask)


# ---------------------------------------------------------------------------- launchers
def _check(op: str, name: str, t, dtypes, device=None) -> None:
    """t is a tensor of one of `dtypes` (on `device`, when given) with a contiguous last dim."""
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    what = f"a {'/'.join(str(d) for d in dtypes)} tensor with a contiguous last dim" + \
        (f" on {device}" if device is not None else "")
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() == 0 \
            or (device is not None and t.device != device) or (t.numel() and t.stride(-1) != 1):
        fail(op, name, what, t)


def _rows(op: str, name: str, t: torch.Tensor, width: int) -> tuple[int, int]:
    """(rows, row stride) of t [..., width] seen as [rows, width]: its leading dims must
    collapse into one stride (a contiguous tensor, or a 2-D row-strided slice)."""
    if t.shape[-1] != width:
        fail(op, name, f"a tensor [..., {width}]", t)
    try:
        flat = t.view(-1, width)
    except RuntimeError:
        fail(op, name, "a tensor whose leading dims collapse into one row stride", t)
    return flat.shape[0], (flat.stride(0) if flat.shape[0] > 1 else width)


_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # each exact in fp32


def _launch_rms_norm(op, x, y, weight, eps, use_pdl: bool = False):
    _check(op, "x", x, torch.bfloat16)
    H = x.shape[-1]
    dev = x.device
    if y is not None:
        _check(op, "y", y, torch.bfloat16, dev)
        if y.shape != x.shape:
            fail(op, "y", f"a tensor of x's shape {list(x.shape)}", y)
    _check(op, "weight", weight, _WEIGHT_DTYPES, dev)
    if tuple(weight.shape) != (H,) or not weight.is_contiguous():
        fail(op, "weight", f"a contiguous tensor [{H}]", weight)
    if H > MAX_ROW:
        fail(op, "x", f"a tensor [..., H] with H <= {MAX_ROW}", x)
    R, x_stride = _rows(op, "x", x, H)
    y_stride = _rows(op, "y", y, H)[1] if y is not None else 0
    out = _alloc(*x.shape, dtype=torch.bfloat16, device=dev)
    h = _alloc(*x.shape, dtype=torch.bfloat16, device=dev) if y is not None else out
    if R:
        block = triton.next_power_of_2(H)
        pdl = bool(use_pdl) and dev.type == "cuda" and not interpreting()
        rms_norm_kernel[(R,)](x, y if y is not None else x, weight, h, out, H, x_stride, y_stride,
                              float(eps), HAS_RESIDUAL=y is not None, BLOCK_H=block,
                              USE_PDL=pdl_mode(pdl), num_warps=_warps(block),
                              **({"launch_pdl": True} if pdl else {}))
    return h, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_pdl: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim, `bf16(x * rsqrt(mean(x^2) + eps) * w)` with fp32 math
    (`flintc.model.ops.rms_norm`, FLINT_SPEC 3), one program per row.

    Args:
        x: bf16 [..., H], H <= MAX_ROW, last dim contiguous and the leading dims collapsible
            into one row stride. weight: fp32, bf16 or fp16 [H], contiguous, on x's device.
        eps: the epsilon.
        use_pdl: launch with programmatic dependent launch on CUDA (`flintc.kernels.pdl`:
            the weight is read before `gdc_wait`, x after it); the decode schedule's final
            norm (`flintc compile --split-lm-head-norm`, `flintc.kernels.fused_gemv`'s
            `rms_norm`). Ignored elsewhere (the interpreter, the prefill's calls).

    Returns:
        bf16 [..., H], contiguous; within the bound of the module doc (equal, or one bf16
        ulp from the reference). Reads 2 H bytes per row (+ the weight), writes 2 H.

    Raises:
        ValueError: a dtype, shape, device or layout does not match (names the tensor).
    """
    return _launch_rms_norm("rms_norm", x, None, weight, eps, use_pdl)[1]


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add and the RMSNorm after it, `flintc::add_rms_norm`: h = bf16(fp32 x
    + fp32 y) (`flintc.model.ops.residual_add`) and `rms_norm(h, weight, eps)`, one program
    per row that keeps h in registers.

    Args:
        x, y: bf16 [..., H] of one shape (last dims contiguous, leading dims collapsible into
            one row stride each); weight: fp32, bf16 or fp16 [H], contiguous; all on one device.
        eps: the epsilon.

    Returns:
        (h, normed), both bf16 [..., H], contiguous: h bit-identical to the reference,
        normed within the bound of the module doc. Reads 4 H bytes per row, writes 4 H
        (the unfused ops: 4 kernels for the add, 7 for the norm, ~30 H bytes).

    Raises:
        ValueError: a dtype, shape, device or layout does not match (names the tensor).
    """
    return _launch_rms_norm("add_rms_norm", x, y, weight, eps)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, rope: bool):
    """Per-head RMSNorm of q and k over D, then (when `rope`) rotate-half RoPE, as
    `flintc::qk_norm_rope` (`flintc.model.ops.rms_norm`, `apply_rope`; FLINT_SPEC 2 steps
    2-3): the normed values rounded to bf16, the rotation in fp32 from them, one rounding.
    One launch for both tensors: program (token, block of heads of q or of k).

    Args:
        q: bf16 [B, T, Hq, D]; k: bf16 [B, T, Hkv, D]; contiguous, D even.
        q_norm, k_norm: fp32, bf16 or fp16 [D], contiguous.
        cos, sin: fp32 [B, T, D/2], contiguous (read only when `rope`).
        eps: the epsilon; rope: apply RoPE (sliding layers).

    Returns:
        (q, k) bf16, shaped as the inputs; within the bounds of the module doc. Reads and
        writes 2 D bytes per head (+ 4 D bytes of table per token with RoPE).

    Raises:
        ValueError: a dtype, shape, device or layout does not match (names the tensor).
    """
    op = "qk_norm_rope"
    for name, t in (("q", q), ("k", k)):
        _check(op, name, t, torch.bfloat16, q.device if name == "k" else None)
        if t.dim() != 4 or not t.is_contiguous():
            fail(op, name, "a contiguous bf16 tensor [B, T, heads, D]", t)
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if tuple(k.shape) != (B, T, Hkv, D):
        fail(op, "k", f"a tensor [{B}, {T}, Hkv, {D}]", k)
    if D % 2 or D > HEAD_TILE:
        fail(op, "q", f"a head dim D that is even and <= {HEAD_TILE}", q)
    for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
        _check(op, name, t, _WEIGHT_DTYPES, q.device)
        if tuple(t.shape) != (D,) or not t.is_contiguous():
            fail(op, name, f"a contiguous tensor [{D}]", t)
    if rope:
        for name, t in (("cos", cos), ("sin", sin)):
            _check(op, name, t, torch.float32, q.device)
            if tuple(t.shape) != (B, T, D // 2) or not t.is_contiguous():
                fail(op, name, f"a contiguous fp32 tensor [{B}, {T}, {D // 2}]", t)
    if q_norm.dtype != k_norm.dtype:
        # the kernel picks one pointer per program with a branch, and compiled Triton (not
        # the interpreter) needs both branches to have one pointer type: fp32 holds either
        q_norm, k_norm = q_norm.float(), k_norm.float()
    q_out = _alloc(*q.shape, dtype=torch.bfloat16, device=q.device)
    k_out = _alloc(*k.shape, dtype=torch.bfloat16, device=q.device)
    N = B * T
    if N:
        per_tile = max(1, HEAD_TILE // D)
        per_tile = 1 << (per_tile.bit_length() - 1)  # tl.arange needs a power of two (D = 96: 8, not 10)
        heads = min(triton.next_power_of_2(max(Hq, Hkv)), per_tile)
        grid = (N, triton.cdiv(Hq, heads) + triton.cdiv(Hkv, heads))
        tables = (cos, sin) if rope else (q_norm, q_norm)  # not read without RoPE
        qk_norm_rope_kernel[grid](q, k, q_norm, k_norm, *tables, q_out, k_out, float(eps),
                                  HQ=Hq, HKV=Hkv, D=D, BLOCK_HEADS=heads,
                                  BLOCK_HALF=triton.next_power_of_2(D // 2), ROPE=bool(rope),
                                  num_warps=_warps(heads * D))
    return q_out, k_out


def expert_combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """The MoE combine with the shared expert, `bf16(sum_k w_k * y_k + y_shared)` in fp32
    (`flintc.model.ops.expert_combine`, FLINT_SPEC 2 MoE step 6), summed in slot order.

    Args:
        y: bf16 [N, K, H], last dim contiguous; weights: fp32 [N, K]; shared: bf16 [N, H]
            (last dim contiguous) or None; all on one device.

    Returns:
        bf16 [N, H], contiguous; within the bound of the module doc. Reads 2 (K + 1) H bytes
        per token, writes 2 H (the torch expression: an fp32 [N, K, H] product, 3 kernels).

    Raises:
        ValueError: a dtype, shape, device or layout does not match (names the tensor).
    """
    op = "expert_combine"
    _check(op, "y", y, torch.bfloat16)
    if y.dim() != 3:
        fail(op, "y", "a bf16 tensor [N, K, H]", y)
    N, K, H = y.shape
    dev = y.device
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 \
            or tuple(weights.shape) != (N, K) or weights.device != dev:
        fail(op, "weights", f"an fp32 tensor [{N}, {K}] on {dev}", weights)
    if shared is not None:
        _check(op, "shared", shared, torch.bfloat16, dev)
        if tuple(shared.shape) != (N, H):
            fail(op, "shared", f"a bf16 tensor [{N}, {H}]", shared)
    if K == 0:
        fail(op, "y", "a tensor with at least one expert slot (K >= 1)", y)
    out = _alloc(N, H, dtype=torch.bfloat16, device=dev)
    if N and H:
        block = min(triton.next_power_of_2(H), COL_BLOCK)
        s = shared if shared is not None else y
        expert_combine_kernel[(N, triton.cdiv(H, block))](
            y, weights, s, out, H, y.stride(0), y.stride(1), weights.stride(0), weights.stride(1),
            shared.stride(0) if shared is not None else 0,
            K=K, HAS_SHARED=shared is not None, BLOCK_H=block, num_warps=_warps(block))
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU-and-mul, `bf16(silu(g) * u)` with fp32 math (`flintc.model.ops.silu_mul`).

    Args:
        gate, up: bf16 [..., F] of one shape, last dims contiguous, leading dims collapsible
            into one row stride each (e.g. a 2-D row-strided slice).
        out: optional bf16 tensor of gate's shape and device to write into, laid out the
            same way (e.g. the shared expert's slot `h[:, K]`); None: a new contiguous one.

    Returns:
        `out` (or the new tensor); within the bound of the module doc. Reads 4 F bytes per
        row, writes 2 F.

    Raises:
        ValueError: a dtype, shape, device or layout does not match (names the tensor).
    """
    op = "silu_mul"
    _check(op, "gate", gate, torch.bfloat16)
    dev, F = gate.device, gate.shape[-1]
    _check(op, "up", up, torch.bfloat16, dev)
    if up.shape != gate.shape:
        fail(op, "up", f"a tensor of gate's shape {list(gate.shape)}", up)
    if out is None:
        out = _alloc(*gate.shape, dtype=torch.bfloat16, device=dev)
    else:
        _check(op, "out", out, torch.bfloat16, dev)
        if out.shape != gate.shape:
            fail(op, "out", f"a tensor of gate's shape {list(gate.shape)}", out)
    R, g_stride = _rows(op, "gate", gate, F)
    u_stride = _rows(op, "up", up, F)[1]
    o_stride = _rows(op, "out", out, F)[1]
    if R and F:
        block = min(triton.next_power_of_2(F), COL_BLOCK)
        silu_mul_kernel[(R, triton.cdiv(F, block))](gate, up, out, F, g_stride, u_stride, o_stride,
                                                    BLOCK_F=block, num_warps=_warps(block))
    return out


def aot_probe_specs():
    """Compile specs for `scripts/triton_aot_probe.py` (sm_90 without a GPU) at the full
    model's shapes: H = 2048 (rms_norm, add_rms_norm), Hq = 32, Hkv = 4, D = 128
    (qk_norm_rope, with and without RoPE), K = 6 + shared (combine), F = 512 (silu_mul)."""
    def spec(name, fn, types, consts, elements):
        # the i32 arguments (sizes and strides) are multiples of 16 at these shapes, which a
        # launch specialises on (vector loads)
        return {"name": name, "fn": fn, "constexprs": consts, "num_warps": _warps(elements),
                "num_stages": 1, "signature": {a: types.get(a, "constexpr") for a in fn.arg_names},
                "divisible": tuple(a for a, t in types.items() if t == "i32")}

    norm_types = {"x_ptr": "*bf16", "y_ptr": "*bf16", "w_ptr": "*fp32", "h_ptr": "*bf16",
                  "out_ptr": "*bf16", "H": "i32", "x_stride": "i32", "y_stride": "i32",
                  "eps": "fp32"}
    qk_types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "qn_ptr": "*fp32", "kn_ptr": "*fp32",
                "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_out_ptr": "*bf16", "k_out_ptr": "*bf16",
                "eps": "fp32"}
    combine_types = {"y_ptr": "*bf16", "w_ptr": "*fp32", "shared_ptr": "*bf16", "out_ptr": "*bf16",
                     **{a: "i32" for a in ("H", "y_s0", "y_s1", "w_s0", "w_s1", "shared_s0")}}
    silu_types = {"g_ptr": "*bf16", "u_ptr": "*bf16", "out_ptr": "*bf16",
                  **{a: "i32" for a in ("F", "g_stride", "u_stride", "out_stride")}}
    qk = {"HQ": 32, "HKV": 4, "D": 128, "BLOCK_HEADS": 8, "BLOCK_HALF": 64}
    return [
        spec("rms_norm H=2048", rms_norm_kernel, norm_types,
             {"HAS_RESIDUAL": False, "BLOCK_H": 2048, "USE_PDL": PDL_OFF}, 2048),
        # the decode schedule's final norm (--split-lm-head-norm): gdc_wait / launch_dependents
        spec("rms_norm PDL H=2048", rms_norm_kernel, norm_types,
             {"HAS_RESIDUAL": False, "BLOCK_H": 2048, "USE_PDL": 1}, 2048),
        spec("add_rms_norm H=2048", rms_norm_kernel, norm_types,
             {"HAS_RESIDUAL": True, "BLOCK_H": 2048, "USE_PDL": PDL_OFF}, 2048),
        spec("qk_norm_rope rope", qk_norm_rope_kernel, qk_types, {**qk, "ROPE": True}, 1024),
        spec("qk_norm_rope nope", qk_norm_rope_kernel, qk_types, {**qk, "ROPE": False}, 1024),
        spec("expert_combine K=6 shared", expert_combine_kernel, combine_types,
             {"K": 6, "HAS_SHARED": True, "BLOCK_H": COL_BLOCK}, COL_BLOCK),
        spec("silu_mul F=512", silu_mul_kernel, silu_types, {"BLOCK_F": 512}, 512),
    ]
