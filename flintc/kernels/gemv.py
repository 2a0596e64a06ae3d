"""Small-batch GEMV (decode, N <= 8 rows of activations) over bf16 or NVFP4 weights.

`y[N, F] = x[N, K] @ W[F, K]^T` with the numerics of `flintc::gemv` (FLINT_SPEC
section 3): products and accumulation in fp32, NVFP4 weights decoded in fp32 as
`e2m1 * block_scale` with the global scale multiplied on the fp32 accumulator, and
one rounding to bf16 at the store. Assumes contiguous row-major tensors, NVFP4 in
the packed layout of `flintc.quant.nvfp4` (byte j of a row holds weight 2j in its
low nibble and 2j + 1 in its high nibble; one float8_e4m3fn scale per 16 weights)
and a scalar global scale. The reduction order differs from torch's matmul, so
results agree with `gemv_reference` to within one bf16 ulp, not bit for bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flintc.model import ops
from flintc.ops.common import CDT, as_weight

MAX_N = 8  # decode batch limit of the op contract
NVFP4_BLOCK = 16  # weights per E4M3 block scale


@triton.jit
def _e2m1_to_fp32(v):
    """E2M1 codes (int32, 0..15) to fp32 from the bits: sign bit 3, exponent bits 2-1,
    mantissa bit 0; exponent 0 is subnormal (0 or 0.5). Code 8 (-0) gives -0.0, which
    adds like +0.0 into the accumulator."""
    m = (v & 1).to(tl.float32)
    e = (v >> 1) & 3
    # 2^(e-1) for e >= 1 as an integer shift: no transcendental, exact on every backend.
    pow2 = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return tl.where((v & 8) != 0, -mag, mag)


@triton.jit
def _round_to_bf16(v):
    """fp32 -> bf16, round to nearest even, done on the bits.

    HACK: the Triton interpreter (3.9, and 3.6) converts fp32 -> bf16 by truncation, so a
    plain `.to(tl.bfloat16)` differs from torch in half the elements there. Rounding the
    fp32 value onto the bf16 grid first makes the final cast exact on every backend.
    Remove when the interpreter's cast rounds to nearest even (then this is a no-op cost
    of a few integer ops per output element on the GPU).
    """
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    rounded = bits.to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded).to(tl.bfloat16)  # NaN stays NaN


@triton.jit
def _dot_acc(acc, x, w, DOT_BF16: tl.constexpr):
    """acc[BLOCK_N, BLOCK_F] += x[BLOCK_N, k] @ w[BLOCK_F, k]^T with exact products and
    fp32 accumulation. Every operand value is exact in bf16 (bf16 activations and
    weights; e2m1 * e4m3 needs at most 6 significant bits), so on the GPU the tensor
    cores take bf16 with fp32 accumulation. The interpreter mishandles bf16 math
    (NOTES), so there both sides are upcast and the fp32 dot runs in IEEE precision."""
    if DOT_BF16:
        return tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    else:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                      input_precision="ieee")


@triton.jit
def _load_weight_tile(w_ptr, scales_ptr, offs_f, mask_f, k0, k_end, K,
                      BLOCK_K: tl.constexpr, IS_NVFP4: tl.constexpr):
    """Raw (undecoded) weight tile for columns [k0, k0 + BLOCK_K) of rows `offs_f`.

    bf16: returns (w [BLOCK_F, BLOCK_K] bf16, w again as a placeholder).
    NVFP4: returns (codes [BLOCK_F, BLOCK_K/2] uint8, scales [BLOCK_F, BLOCK_K/2] fp8), the
    scale repeated for each of the 8 bytes it covers.
    """
    if IS_NVFP4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte column of the packed row
        # mask: row exists, and the byte's two weights lie inside this split and inside K
        # (K is even, so 2 * byte < k_end implies 2 * byte + 1 < k_end).
        mask = mask_f[:, None] & (2 * offs_b < k_end)[None, :]
        codes = tl.load(w_ptr + offs_f[:, None] * (K // 2) + offs_b[None, :], mask=mask, other=0)
        # One scale per 16 weights = 8 bytes: load [BLOCK_F, BLOCK_K/16] contiguous scales,
        # then repeat each 8 times along the row in registers.
        offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        mask_s = mask_f[:, None] & (16 * offs_s < k_end)[None, :]
        scales = tl.load(scales_ptr + offs_f[:, None] * (K // 16) + offs_s[None, :],
                         mask=mask_s, other=0.0)
        scales = tl.broadcast_to(scales[:, :, None], (scales.shape[0], BLOCK_K // 16, 8))
        scales = tl.reshape(scales, (scales.shape[0], BLOCK_K // 2))
        return codes, scales
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # mask: row exists and column lies inside this split and inside K.
        mask = mask_f[:, None] & (offs_k < k_end)[None, :]
        w = tl.load(w_ptr + offs_f[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        return w, w


@triton.jit
def gemv_kernel(
    x_ptr,  # bf16 [N, K], contiguous
    w_ptr,  # bf16 [F, K], or NVFP4 codes uint8 [F, K/2]; contiguous
    scales_ptr,  # NVFP4 block scales float8_e4m3fn [F, K/16] (unused for bf16)
    gscale_ptr,  # NVFP4 global scale fp32 [] (unused for bf16)
    out_ptr,  # bf16 [N, F] when SPLIT_K == 1, else fp32 workspace [N, F] (zeroed)
    N, F, K,
    K_PER_SPLIT,  # columns per split-K program; a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,  # N padded to 16, the smallest tl.dot M
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    USE_PDL: tl.constexpr,  # must be False under TRITON_INTERPRET (gdc_* raise there)
    DOT_BF16: tl.constexpr,  # bf16 tensor-core dot (GPU); False: fp32 IEEE dot (interpreter)
):
    # Tile-to-program mapping: program (pid_f, pid_k) computes the partial dot products of
    # all N activation rows with weight rows [pid_f * BLOCK_F, (pid_f + 1) * BLOCK_F) over
    # columns [pid_k * K_PER_SPLIT, (pid_k + 1) * K_PER_SPLIT) of K, BLOCK_K at a time.
    pid_f = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = offs_f < F  # the last F block may stick out past F (F need not divide)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N  # rows of x past N are zero padding up to BLOCK_N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)

    acc = tl.zeros((BLOCK_N, BLOCK_F), dtype=tl.float32)
    # Software pipeline: the weight tile of the next step is loaded before the current
    # one is used. The first weight tile goes out before gdc_wait, so under PDL the
    # weight stream starts while the previous kernel (which writes x) still runs.
    w_cur, s_cur = _load_weight_tile(w_ptr, scales_ptr, offs_f, mask_f, k_start, k_end, K,
                                     BLOCK_K, IS_NVFP4)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by the previous kernel: wait before reading it
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        k0 = k_start + k
        # Prefetch the next tile; fully masked (no memory traffic) past this split's end.
        w_next, s_next = _load_weight_tile(w_ptr, scales_ptr, offs_f, mask_f, k0 + BLOCK_K,
                                           k_end, K, BLOCK_K, IS_NVFP4)
        if IS_NVFP4:
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            # mask: real x row, and the even column 2b inside this split and inside K.
            mask_x = mask_n[:, None] & (2 * offs_b < k_end)[None, :]
            x_row = x_ptr + offs_n[:, None] * K + 2 * offs_b[None, :]
            # Even columns meet the low nibbles, odd columns the high nibbles: no interleave.
            x_even = tl.load(x_row, mask=mask_x, other=0.0)
            x_odd = tl.load(x_row + 1, mask=mask_x, other=0.0)
            c = w_cur.to(tl.int32)
            s = s_cur.to(tl.float32)  # e4m3 -> fp32 is exact
            w_lo = _e2m1_to_fp32(c & 15) * s  # e2m1 * scale: exact in fp32 and in bf16
            w_hi = _e2m1_to_fp32(c >> 4) * s
            acc = _dot_acc(acc, x_even, w_lo, DOT_BF16)
            acc = _dot_acc(acc, x_odd, w_hi, DOT_BF16)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            # mask: real x row, and the column inside this split and inside K.
            mask_x = mask_n[:, None] & (offs_k < k_end)[None, :]
            x = tl.load(x_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_x, other=0.0)
            acc = _dot_acc(acc, x, w_cur, DOT_BF16)
        w_cur = w_next
        s_cur = s_next
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # a scheduling hint: no memory ordering

    # mask: real x rows and real weight rows; out is [N, F] row-major.
    out_offs = offs_n[:, None] * F + offs_f[None, :]
    mask_out = mask_n[:, None] & mask_f[None, :]
    if SPLIT_K == 1:
        if IS_NVFP4:
            acc = acc * tl.load(gscale_ptr)  # global scale on the fp32 accumulator
        tl.store(out_ptr + out_offs, _round_to_bf16(acc), mask=mask_out)  # the one rounding
    else:
        # Partial sums meet in the fp32 workspace; the launcher scales and rounds once.
        tl.atomic_add(out_ptr + out_offs, acc, mask=mask_out)


def _fail(name: str, what: str, t: torch.Tensor) -> None:
    raise ValueError(
        f"gemv: {name} must be {what}; got dtype {t.dtype}, shape {tuple(t.shape)}, "
        f"strides {tuple(t.stride())}"
    )


def _check(name: str, t, dtype: torch.dtype, shape: tuple[int, ...], device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"gemv: {name} must be a torch.Tensor, got {type(t).__name__}")
    what = f"a contiguous {dtype} tensor of shape {list(shape)} on {device}"
    if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device != device:
        _fail(name, what, t)
    if not t.is_contiguous():
        _fail(name, what + " (it is not contiguous)", t)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _choose_blocks(N: int, F: int, K: int, is_nvfp4: bool, device: torch.device):
    """Block sizes and split-K for one launch. x is padded to 16 rows (tl.dot's minimum).
    A weight tile is BLOCK_F x BLOCK_K; a large BLOCK_F keeps the re-reads of x (one per
    F block) small next to the weights on big matrices. Split-K is used when the F
    blocks alone would not fill the GPU."""
    # Measured on an H200 (N=1, CUDA graphs): bf16 best at 64 x 128 tiles, NVFP4 at
    # 16 x 128 (its decode, not memory, limits it), split-K best near 2 programs per SM
    # and at most 8 splits.
    block_n = 16
    block_k = 128
    block_f = 16 if is_nvfp4 else 64
    if not is_nvfp4 and device.type == "cuda" and triton.cdiv(F, 128) >= 2 * _num_sms(
            device.index or 0):
        block_f = 128
    num_f_blocks = triton.cdiv(F, block_f)
    num_k_tiles = triton.cdiv(K, block_k)
    target = 2 * _num_sms(device.index or 0) if device.type == "cuda" else 1
    split_k = max(1, min(target // num_f_blocks, num_k_tiles, 8))
    return block_n, block_f, block_k, split_k


def gemv(x: torch.Tensor, w: list[torch.Tensor], out: torch.Tensor | None = None,
         use_pdl: bool = False, split_k: int | None = None) -> torch.Tensor:
    """`x @ W^T` for decode batches, as `flintc::gemv`.

    Args:
        x: bf16 [N, K], 1 <= N <= 8, contiguous.
        w: `[weight]` bf16 [F, K], or NVFP4 `[codes, scales, global_scale]` with codes
            uint8 [F, K/2], scales float8_e4m3fn [F, K/16], global_scale fp32 [];
            K % 16 == 0 for NVFP4. All contiguous, on x's device.
        out: optional bf16 [N, F] contiguous output; allocated when None.
        use_pdl: launch with programmatic dependent launch (CUDA, sm_90+ only): the kernel
            starts streaming weights before the previous kernel finishes and waits for
            it only before reading x.
        split_k: number of programs splitting K (fp32 atomics into a workspace, then one
            scale-and-round); None picks one from the shape and the SM count.

    Returns:
        bf16 [N, F].

    Bytes read: weights (bf16: 2*F*K; NVFP4: F*K/2 codes + F*K/16 scales + 4) plus
    x (2*N*K). Bytes written: 2*N*F (with split-K > 1 also 4*N*F of fp32 workspace,
    written, atomically accumulated, and read back).

    Raises:
        ValueError: a dtype, shape, device or contiguity does not match the above; the
            message names the argument.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"gemv: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not (1 <= x.shape[0] <= MAX_N):
        _fail("x", f"a bf16 tensor [N, K] with 1 <= N <= {MAX_N}", x)
    if not x.is_contiguous():
        _fail("x", "contiguous", x)
    N, K = x.shape
    dev = x.device
    if not isinstance(w, (list, tuple)) or len(w) not in (1, 3):
        raise ValueError("gemv: w must be a list [weight] (bf16) or [codes, scales, "
                         "global_scale] (NVFP4)")
    is_nvfp4 = len(w) == 3
    if is_nvfp4:
        codes, scales, gscale = w
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
            raise ValueError("gemv: w[0] (NVFP4 codes) must be a uint8 tensor [F, K/2]")
        if K % NVFP4_BLOCK:
            raise ValueError(f"gemv: x has K={K}, NVFP4 weights need K % {NVFP4_BLOCK} == 0")
        F = codes.shape[0]
        _check("w[0] (NVFP4 codes)", codes, torch.uint8, (F, K // 2), dev)
        _check("w[1] (NVFP4 block scales)", scales, torch.float8_e4m3fn,
               (F, K // NVFP4_BLOCK), dev)
        _check("w[2] (NVFP4 global scale)", gscale, torch.float32, (), dev)
        w_arg, s_arg, g_arg = codes, scales, gscale
    else:
        (weight,) = w
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError("gemv: w[0] (weight) must be a bf16 tensor [F, K]")
        F = weight.shape[0]
        _check("w[0] (weight)", weight, torch.bfloat16, (F, K), dev)
        w_arg = s_arg = g_arg = weight  # scale pointers unused for bf16
    if out is None:
        out = torch.empty((N, F), dtype=torch.bfloat16, device=dev)
    else:
        _check("out", out, torch.bfloat16, (N, F), dev)

    block_n, block_f, block_k, auto_split = _choose_blocks(N, F, K, is_nvfp4, dev)
    num_k_tiles = triton.cdiv(K, block_k)
    if split_k is None:
        split_k = auto_split
    if not (1 <= split_k):
        raise ValueError(f"gemv: split_k must be >= 1, got {split_k}")
    split_k = min(split_k, num_k_tiles)
    k_per_split = triton.cdiv(num_k_tiles, split_k) * block_k
    split_k = triton.cdiv(K, k_per_split)  # no empty splits
    grid = (triton.cdiv(F, block_f), split_k)
    target = out if split_k == 1 else torch.zeros((N, F), dtype=torch.float32, device=dev)
    use_pdl = bool(use_pdl) and dev.type == "cuda"
    launch_opts = {"launch_pdl": True} if use_pdl else {}
    gemv_kernel[grid](
        x, w_arg, s_arg, g_arg, target, N, F, K, k_per_split,
        BLOCK_N=block_n, BLOCK_F=block_f, BLOCK_K=block_k, SPLIT_K=split_k,
        IS_NVFP4=is_nvfp4, USE_PDL=use_pdl, DOT_BF16=dev.type == "cuda", num_warps=4,
        **launch_opts,
    )
    if split_k > 1:
        # TODO(perf): fold this scale-and-round into the kernel (last-arriving program per
        # F block, via a counter) so split-K stays one launch.
        if is_nvfp4:
            target = target * g_arg
        out.copy_(target)
    return out


def gemv_reference(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """The op's reference (`flintc.model.ops.linear`): plain torch, fp32, one rounding."""
    return ops.linear(x, as_weight(w), CDT)
