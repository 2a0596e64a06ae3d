"""Decode kernels in CUDA C++ with `mma.sync`: NVFP4 W4A16 (the GEMV, the fused QKV, the
dense MLP's RMSNorm + gate/up + SiLU-and-mul (`mma_norm_gate_up`), the MoE gate/up with
top-k routing, the MoE down with the combine), the E2M1 codes decoded
straight into the tensor-core A-operand registers (issue 5's "CUDA C++ where Triton
cannot express what is needed"); and on bf16 weights read in place, the GEMV, the fused
QKV, the router (`mma_norm_router`), the dense gate/up and both MoE kernels, whose A
fragments load straight
from the row-major weight (no shared memory, no relayout).

Why CUDA here. The Triton NVFP4 GEMVs (`flintc.kernels.tiles`) decode a code tile into a
bf16 tile in registers, and Triton then moves that tile through shared memory into the
layout its `wgmma` operand needs (Nsight Compute: LDSM at 4x the ideal wavefronts, about
6 SASS instructions per weight in the K loop; docs/gpu-runs.md sessions 9-11). Triton
has no way to say "this register holds rows g and g + 8 of the A fragment", so the
round trip stays. Here the loader's codes are permuted once, at load time, into the
order of the `mma.sync.m16n8k16` A fragment (PTX ISA, "Matrix Fragments for
mma.m16n8k16 with floating point type"): each lane's 32-bit word holds exactly the 8
weights it feeds to one mma, so a k16 step is one word, ten LOP3 / shifts, four
`mul.rn.bf16x2` and one `mma`: about 20 SASS instructions per 8 weights, 2.6 per weight
in the whole K loop with its loads (cuobjdump of the 16384 x 2048 variant), against
about 6 in the Triton loop; no shared memory.

Layout (`pack_mma_layout`), for a weight W [F, K] (F a multiple of 16, K of 64). The sum
over K does not depend on the order of its terms, so the kernel assigns K to the mma's
k slots in the order that makes each lane's slice of x contiguous: in chunk kc (K 64 kc
.. 64 kc + 63), lane l = 4 g + t, k16 step s, the mma's k index 2t + 8 half + e (PTX ISA
fragment layout) is the physical k = 64 kc + 16 t + 4 s + 2 half + e. So a lane reads
x[n, 64 kc + 16 t .. + 15] (two 16-byte loads per chunk) and all its weights of a chunk
lie in one 16-weight block per row: one block scale per row per chunk.

* codes: int32 [F/16, K/64, 32, 4]: row tile ft (rows 16 ft .. 16 ft + 15), chunk kc,
  lane l, step s: the 8 weights of the lane's A fragment (PTX ISA): register r = 2 half
  + h (rows g + 8 h), low / high half e = 0 / 1, bits at `_CODE_BIT_POS`. A lane loads
  its four words with one 16-byte load; a warp's 512 bytes are contiguous.
* scales: uint8 [F/16, K/64, 32, 2]: lane l, byte h: the block scale of row g + 8 h,
  block 4 kc + t, as a `ue5m3` code (below).

Decode (FLINT_SPEC section 3: `x * (e2m1 * block_scale)` summed in fp32, times the
global scale once): the three magnitude bits of a code go to bf16 bits 8-6 and its sign
to bit 15, which is the E2M1 value times 2^-126 for every code (subnormal 0.5 included;
vLLM's Marlin FP4 dequant, `csrc/quantization/gptq_marlin/dequant.h`); one
`mul.rn.bf16x2` by `bf16(scale * 2^118)` gives `e2m1 * scale * 2^-8` exactly (at most 6
significant bits, normal range), and the fp32 result is multiplied by 256 * global scale
once, at the output: the same fp32 sums of the same exact products as the reference.

Block scales as `ue5m3` codes: the E4M3 scale 2^(e-7) (1 + m/8) (or 2^-6 m/8 when e = 0)
is re-encoded with a 5-bit exponent E' = unbiased exponent + 9 and a 3-bit mantissa,
which holds every E4M3 value, subnormals included, as a normal number; then
`bf16(scale * 2^118)` is `(code << 4) + (236 << 7)` (integer add, per 16-bit half): a
byte permute, a shift and an add per two scales. A zero scale has no code: it is stored
as code 0 and its block's code magnitudes are cleared (weights 0 either way).

Kernels (one source, specialised per shape at compile time; `kernel_source`):

* `nvfp4_mma_gemv` (`mma_gemv`): y = x @ W^T for N <= 8; grid F / 16 row tiles, the
  block's warps split K and add their sums in shared memory in warp order (no split-K
  workspace, no atomics unless an fp32 split output is asked for); epilogues fp32, bf16,
  bf16 + residual (with `mma_early_epilogue`, the residual loads right after the PDL
  wait, with x, instead of in the epilogue). The model's `gemv` / `gemv_residual` (O projection, dense down
  projection) run on it (`flintc.kernels.gemv`).
* `nvfp4_mma_qkv` (`mma_qkv`): kernel 1 of the layer, `flintc::norm_qkv_rope_kv`: the
  input RMSNorm in the prologue (the block's K slice of the normed x in shared memory),
  one block per (head, K slice), the K slices of a head a thread-block cluster whose
  blocks push their sums into the first block's shared memory (DSMEM), which runs the
  per-head RMSNorm, RoPE, the q store and the KV-cache write. Measured on the H200
  (docs/gpu-runs.md session 14): 5.7 us at N = 1 where the Triton kernel took 10.6 us.
* `nvfp4_mma_moe_gate_up` (`moe_topk_gate_up`): kernel 6 of the MoE layer: top-k
  routing in the prologue (a routed block runs its token's top-k up to its slot), then
  per (group of 16-row tiles of I, work item: the shared expert for all tokens, or one
  token's routed expert) the gate and up tiles, the block's warps splitting H, SiLU-and-
  mul in the epilogue; writes h, the routing weights and the ids.
* `nvfp4_mma_moe_down` (`moe_down`): kernel 7: per 16 rows of H, the warps take the work
  units (the shared expert, then each token's routed experts, each cut into K slices of
  the expert width) in turn, then the block adds the slices and combines its rows in the
  reference's order and adds the residual (with `mma_early_epilogue`, the residual and
  the routing weights are staged in shared memory before the block's barrier by the
  warps that finish first).

Unlike `flintc.kernels.moe`'s Triton kernels they do not deduplicate experts shared by
several tokens at batch > 1 (each (token, expert) item streams its weights; duplicates
mostly hit the L2).

Compiled at first use by NVRTC through `torch.cuda._compile_kernel` (torch >= 2.8 with
CUDA; no nvcc, no headers; about a second per variant) and launched with the driver's
`cuLaunchKernelEx`, with programmatic dependent launch when asked: weights that do not
depend on the previous kernel load before `griddepcontrol.wait` (in a basic block of its
own: ptxas hoists a wait above the loads of its block), activations after it with
coherent `ld.global` (an `ld.global.nc` may be hoisted above the wait).

Weights: `prepack` converts, at load time (the compiled runtime and `flintc bench` call
it for triton builds on CUDA, before the KV caches are sized), the NVFP4 weights these
kernels read (`PREPACK_SUFFIXES`) to this layout in place: the packed copies are freed,
so the model takes the same memory as with the Triton kernels. The other ops that take
those weights read the mma layout too: the prefill GEMMs (`flintc.kernels.gemm`,
`flintc.kernels.grouped_gemm`: a Triton tile loader of this layout) and the reference
ops (`NVFP4Tensor.dequantize`, through `unpack_mma_layout`). Ops called with packed
weights (tests, scripts) repack them at first use into a cache (`packed_weight`).
FLINTC_NVFP4_MMA=0 turns the conversion and the CUDA path for packed weights off (every
kernel on Triton); weights already converted keep running on these kernels.

Measured on the H200 (docs/gpu-runs.md session 12): a 16384 x 2048 GEMV at 72-75% of the
copy bandwidth (the Triton loop: 29%); in the model the O projection 6.95 -> 3.54 us, MoE
gate/up 13.0 -> 8.5 us (batch 1) and 52 -> 31 us (batch 8), down 7.8 -> 5.6 and 30.5 ->
11.8 us; the NVFP4 decode step at batch 1 / 1K 2.99 -> 2.56 ms, batch 8 / 1K 6.56 -> 4.52.
Session 14: the fused QKV 10.4 -> 6.4 us (NVFP4), the router 4.6 -> 3.1 us, the bf16 O
projection 8.0 -> 6.1 us (65% of copy; 4096 x 2048: 70%); NVFP4 decode b1/1K 2.33 ->
2.03 ms, b8/1K 4.63 -> 4.19; BF16 2.85 -> 2.68 and 6.18 -> 5.90. Session 15: the MoE down
kernel over K slices (NVFP4 6.0 -> 3.2 us at batch 1), bf16 experts on both MoE kernels,
the gate/up top-k in k + 1 rounds (NVFP4 9.3 -> 7.6 us); NVFP4 b1/1K 1.82 ms, b8/1K 3.53;
BF16 2.41 and 5.70.
"""

from __future__ import annotations

import ctypes
import math
import os
import weakref

import torch

from flintc.kernels.tuning import env_entries

__all__ = ["DOWN_LAUNCH", "DOWN_PREFETCH", "EARLY_EPILOGUE_KERNELS", "early_epilogue_default", "EARLY_TRIGGER", "GATE_UP_LAUNCH", "GATE_UP_MIN_BLOCKS",
           "GATE_UP_PREFETCH", "GATE_UP_ROUTE", "gate_up_route",
           "GEMV_LAUNCH", "gemv_launch",
           "MAX_SMEM", "MMA_KERNELS", "QKV_LAUNCH_ORDER", "gate_up_launch", "mma_trigger_early",
           "ROUTER_LAUNCH_ORDER", "SCALE_CODE_BIAS", "STATIC_SMEM", "available",
           "decode_mma_layout", "down_launch", "e4m3_to_scale_code", "enabled_from_env", "is_mma_layout",
           "kernel_source", "mma_early_epilogue", "mma_gemv", "mma_norm_router", "mma_operands", "mma_qkv",
           "moe_down", "moe_smem_bytes", "moe_topk_gate_up", "pack_mma_layout",
           "pack_mma_stack", "packed_weight", "prepack", "qkv_applies", "qkv_launch_config",
           "qkv_smem_bytes", "qkv_source", "refusal_note", "refusal_reason", "router_launch_config", "scale_code_to_bf16_bits",
           "supported", "unpack_mma_layout", "warps_for", "weight_dims"]

SCALE_CODE_BIAS = 9  # ue5m3: E' = unbiased exponent + 9, so 2^-9 (the smallest E4M3) has E' = 0
_BF16_EXP_OFFSET = 236  # bf16 exponent field = E' + 236 gives scale * 2^118
DEQUANT_UNSCALE = 256.0  # the fp32 result of `e2m1 * scale * 2^-8` products times this
EPI_FP32, EPI_BF16, EPI_RESIDUAL = 0, 1, 2  # the kernel's epilogues


def e4m3_to_scale_code(scales: torch.Tensor, name: str = "scales") -> torch.Tensor:
    """float8_e4m3fn block scales -> uint8 `ue5m3` codes (module docstring), same shape.

    Zero scales map to code 0 (the caller clears the codes of their blocks: see
    `pack_mma_layout`). Raises ValueError, naming `name`, for a dtype other than
    float8_e4m3fn or a negative or NaN scale (the packed NVFP4 layout has neither:
    `flintc.quant.nvfp4`).
    """
    if scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: expected float8_e4m3fn block scales, got {scales.dtype}")
    s = scales.to(torch.float32)
    if bool(torch.isnan(s).any()) or bool((s < 0).any()):
        raise ValueError(f"{name}: block scales must be finite and >= 0 (unsigned E4M3)")
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    e_unb = exp - 1  # s = (2 mant) * 2^(exp - 1), 2 mant in [1, 2)
    m3 = torch.round((2 * mant - 1) * 8).to(torch.int32)  # exact: E4M3 has 3 mantissa bits
    code = ((e_unb + SCALE_CODE_BIAS) << 3) | m3
    code = torch.where(s == 0, torch.zeros_like(code), code)
    if bool(((code < 0) | (code > 255)).any()):  # unreachable for E4M3 inputs
        raise ValueError(f"{name}: a block scale is outside the E4M3 range")
    return code.to(torch.uint8)


def scale_code_to_bf16_bits(code: torch.Tensor) -> torch.Tensor:
    """uint8 `ue5m3` codes -> int32 bf16 bit patterns of `scale * 2^118`: `(code << 4) +
    (236 << 7)` (the kernel computes it with `_scale2`, replayed by `decode_mma_layout`)."""
    return (code.to(torch.int32) << 4) + (_BF16_EXP_OFFSET << 7)


def pack_mma_layout(codes: torch.Tensor, scales: torch.Tensor,
                    name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Repack one NVFP4 matrix from the packed layout into the mma-fragment layout.

    Args:
        codes: uint8 [F, K/2] (byte j: weight 2j low nibble, 2j + 1 high nibble).
        scales: float8_e4m3fn [F, K/16].
        name: the tensor's name, for errors.

    Returns:
        (wq int32 [F/16, K/64, 32, 4], sq uint8 [F/16, K/64, 32, 2]) on codes' device
        (module docstring). Lossless: `decode_mma_layout` gives back every weight.

    Raises:
        ValueError: wrong dtypes or shapes, F not a multiple of 16 or K of 64, or a
            negative / NaN scale.
    """
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"{name}: codes must be uint8 [F, K/2], got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    F, K = codes.shape[0], 2 * codes.shape[1]
    if F % 16 or K % 64 or F == 0 or K == 0:
        raise ValueError(f"{name}: the mma layout needs F % 16 == 0 and K % 64 == 0 (both > 0), got "
                         f"F={F}, K={K}")
    if tuple(scales.shape) != (F, K // 16):
        raise ValueError(f"{name}: scales must be [F, K/16] = [{F}, {K // 16}], got "
                         f"{tuple(scales.shape)}")
    scode = e4m3_to_scale_code(scales, f"{name}.scales")
    table = _code_tables(codes.device)  # [4 registers, 16 codes] -> 16-bit patterns
    zero_block = scales.to(torch.float32) == 0  # +0 and -0
    wq = torch.empty((F // 16, K // 64, 32, 4), dtype=torch.int32, device=codes.device)
    rows = max(16, (1 << 22) // K // 16 * 16)  # row tiles per pass: bounded temporaries
    for r0 in range(0, F, rows):
        r1 = min(F, r0 + rows)
        c = codes[r0:r1].to(torch.int64)
        nib = torch.stack([c & 15, c >> 4], dim=-1).reshape(r1 - r0, K)
        # a zero block scale: keep the codes' signs, clear their magnitudes (weights 0)
        nib = torch.where(zero_block[r0:r1].repeat_interleave(16, dim=1), nib & 8, nib)
        # rows: [ft, h(2: row g + 8h), g(8)]; K: [kc, t(4), s(4), half(2), e(2)]
        n = nib.reshape((r1 - r0) // 16, 2, 8, K // 64, 4, 4, 2, 2).permute(0, 3, 2, 4, 5, 6, 1, 7)
        # -> [ft, kc, g, t, s, half, h, e]; register r = 2 * half + h
        n = n.reshape((r1 - r0) // 16, K // 64, 8, 4, 4, 4, 2)  # [..., s, r, e]
        word = torch.zeros(n.shape[:-2], dtype=torch.int64, device=codes.device)
        for r in range(4):
            word |= table[r][n[..., r, 0]] | (table[r][n[..., r, 1]] << 16)
        word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
        wq[r0 // 16:r1 // 16] = word.reshape((r1 - r0) // 16, K // 64, 32, 4)
    # scales [F, K/16] = [ft, h, g, kc, t] -> [ft, kc, g, t, h]
    sq = scode.reshape(F // 16, 2, 8, K // 64, 4).permute(0, 3, 2, 4, 1)
    return wq, sq.reshape(F // 16, K // 64, 32, 2).contiguous()


def pack_mma_stack(codes: torch.Tensor, scales: torch.Tensor,
                   name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_mma_layout` of a weight with leading dims (a stack of experts: codes uint8
    [..., F, K/2], scales float8_e4m3fn [..., F, K/16]), packed as its rows and reshaped
    back: (codes int32 [..., F/16, K/64, 32, 4], scale codes uint8 [..., F/16, K/64, 32,
    2]); expert e's row tiles are tiles e * F/16 .. of the flat pack, as the kernels
    address them. Raises ValueError as `pack_mma_layout`."""
    lead, F, K = tuple(codes.shape[:-2]), codes.shape[-2], 2 * codes.shape[-1]
    wq, sq = pack_mma_layout(codes.reshape(-1, K // 2), scales.reshape(-1, K // 16), name)
    return wq.reshape(*lead, F // 16, K // 64, 32, 4), sq.reshape(*lead, F // 16, K // 64, 32, 2)


def _code_tables(device: torch.device) -> torch.Tensor:
    """int64 [4, 16]: register r's 16-bit pattern of each 4-bit code (`_CODE_BIT_POS`)."""
    v = torch.arange(16, dtype=torch.int64)
    pos = torch.tensor(_CODE_BIT_POS, dtype=torch.int64)  # [r, bit]
    bits = (v[None, :, None] >> torch.arange(4)[None, None, :]) & 1  # [1, code, bit]
    return (bits << pos[:, None, :]).sum(-1).to(device)


def unpack_mma_layout(wq: torch.Tensor, sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_mma_layout`: (codes uint8 [F, K/2], scales float8_e4m3fn
    [F, K/16]) of the packed layout from wq int32 [F/16, K/64, 32, 4] and sq uint8
    [F/16, K/64, 32, 2]. Every decoded weight equals the original's; the bytes may not:
    a zero block scale comes back as 2^-9 (`ue5m3` code 0) with the codes' magnitudes
    cleared. Runs on any device, in passes of bounded size. Raises ValueError for other
    dtypes or shapes."""
    _check_mma_pair("unpack_mma_layout", wq, sq)
    FT, KC = wq.shape[0], wq.shape[1]
    F, K = FT * 16, KC * 64
    codes = torch.empty((F, K // 2), dtype=torch.uint8, device=wq.device)
    pos = torch.tensor(_CODE_BIT_POS, dtype=torch.int64, device=wq.device)  # [r, bit]
    step = max(1, (1 << 22) // (K * 16))  # row tiles per pass
    for t0 in range(0, FT, step):
        t1 = min(FT, t0 + step)
        w = (wq[t0:t1].to(torch.int64) & 0xFFFFFFFF)[..., None, None, None]  # [ft, kc, l, s, 1, 1, 1]
        shift = pos[None] + 16 * torch.arange(2, device=wq.device)[:, None, None]  # [e, r, bit]
        nib = (((w >> shift) & 1) << torch.arange(4, device=wq.device)).sum(-1)  # [.., s, e, r]
        nib = nib.transpose(-1, -2)  # [ft, kc, lane, s, r, e]
        nib = nib.reshape(t1 - t0, KC, 8, 4, 4, 2, 2, 2)  # [ft, kc, g, t, s, half, h, e]
        nib = nib.permute(0, 6, 2, 1, 3, 4, 5, 7).reshape((t1 - t0) * 16, K)
        codes[t0 * 16:t1 * 16] = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)
    c = sq.to(torch.int32)  # [ft, kc, g * 4 + t, h] -> [ft, h, g, kc, t]
    val = torch.exp2(((c >> 3) - SCALE_CODE_BIAS).to(torch.float32)) * (1 + (c & 7).to(torch.float32) / 8)
    val = val.reshape(FT, KC, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(F, K // 16)
    return codes, val.to(torch.float8_e4m3fn)


MAX_SCALE_CODE = ((8 + SCALE_CODE_BIAS) << 3) | 6  # 448 = 2^8 * 1.75, the largest E4M3


def _check_mma_pair(op: str, wq, sq) -> None:
    """wq int32 [F/16, K/64, 32, 4] and sq uint8 [F/16, K/64, 32, 2] (flat: one matrix or
    a stack's rows), every scale code <= MAX_SCALE_CODE; else ValueError naming `op`."""
    if not (isinstance(wq, torch.Tensor) and isinstance(sq, torch.Tensor)) \
            or wq.dtype != torch.int32 or wq.dim() != 4 or tuple(wq.shape[2:]) != (32, 4) \
            or sq.dtype != torch.uint8 or tuple(sq.shape) != (*wq.shape[:3], 2):
        raise ValueError(f"{op}: expected wq int32 [F/16, K/64, 32, 4] and sq uint8 "
                         f"[F/16, K/64, 32, 2], got {getattr(wq, 'dtype', type(wq).__name__)} "
                         f"{tuple(getattr(wq, 'shape', ()))} and "
                         f"{getattr(sq, 'dtype', type(sq).__name__)} {tuple(getattr(sq, 'shape', ()))}")
    if sq.numel() and int(sq.max()) > MAX_SCALE_CODE:
        raise ValueError(f"{op}: a scale code is {int(sq.max())}, above {MAX_SCALE_CODE} (448, the "
                         f"largest E4M3 scale): not made by pack_mma_layout")


def is_mma_layout(codes) -> bool:
    """Whether NVFP4 codes are in the mma layout (int32; the packed layout is uint8)."""
    return isinstance(codes, torch.Tensor) and codes.dtype == torch.int32


def weight_dims(codes: torch.Tensor) -> tuple[tuple[int, ...], int, int]:
    """(leading dims, F, K) of an NVFP4 weight's codes in either layout: packed uint8
    [..., F, K/2] or mma int32 [..., F/16, K/64, 32, 4]."""
    if is_mma_layout(codes):
        return tuple(codes.shape[:-4]), codes.shape[-4] * 16, codes.shape[-3] * 64
    return tuple(codes.shape[:-2]), codes.shape[-2], codes.shape[-1] * 2


def mma_operands(codes: torch.Tensor, scales: torch.Tensor,
                 name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' (wq [R/16, K/64, 32, 4], sq [R/16, K/64, 32, 2]) of one NVFP4 weight
    or stack (R = all its rows): codes already in the mma layout (`prepack`) as flat
    views; packed codes through `packed_weight`'s cache (a repacked copy). Raises
    ValueError (naming `name`) for mma scales that do not match the codes."""
    if is_mma_layout(codes):
        if scales.dtype != torch.uint8 or tuple(scales.shape) != (*codes.shape[:-1], 2) \
                or codes.dim() < 4 or tuple(codes.shape[-2:]) != (32, 4) \
                or not codes.is_contiguous() or not scales.is_contiguous():
            raise ValueError(f"{name}: mma-layout codes must be contiguous int32 [..., F/16, K/64, "
                             f"32, 4] with contiguous uint8 scales [..., F/16, K/64, 32, 2]; got "
                             f"codes {tuple(codes.shape)}, scales {scales.dtype} {tuple(scales.shape)}")
        return codes.reshape(-1, *codes.shape[-3:]), scales.reshape(-1, *scales.shape[-3:])
    return packed_weight(codes, scales)


# Register r of a k16 step: bit b of the low element's code (b = 0 mantissa, 1-2 exponent,
# 3 sign) sits at word bit _CODE_BIT_POS[r][b], the high element's 16 bits above. Registers
# 0-2 are three disjoint shifted copies of the bf16 target bits {6, 7, 8, 15} (shift 0, 3,
# 6: one mask, or a shift and a mask); register 3 takes the 4 bits left over.
_CODE_BIT_POS = ((6, 7, 8, 15), (3, 4, 5, 12), (0, 1, 2, 9), (10, 11, 13, 14))


# The kernel's decode of register r from a word q, as C expressions: pasted into the CUDA
# source (`kernel_source`) and evaluated on torch tensors by `_decode_register`, so the
# CPU tests replay the very expressions the GPU runs.
_DECODE_EXPR = ("q & 0x81C081C0u", "(q << 3) & 0x81C081C0u", "(q << 6) & 0x81C081C0u",
                "((q << 1) & 0x80008000u) | ((q >> 4) & 0x00C000C0u) | ((q >> 5) & 0x01000100u)")
# The scale decode: prmt selectors of the two scale bytes (row g, row g + 8) into both
# 16-bit halves, then `(d >> 4) + _SCALE_ADD` (also pasted into the source)
_SEL_G, _SEL_G8, _SCALE_ADD = 0x0404, 0x1414, 0x76007600


def _decode_register(w: torch.Tensor, r: int) -> torch.Tensor:
    """The kernel's `_DECODE_EXPR[r]` on int64 words (low 32 bits) -> bf16x2 bit patterns
    of `e2m1 * 2^-126` for register r (low half: even k)."""
    return eval(_DECODE_EXPR[r].replace("u", ""), {"q": w}) & 0xFFFFFFFF


def _prmt(a: torch.Tensor, sel: int) -> torch.Tensor:
    """PTX `prmt.b32 d, a, 0, sel` (default mode) on int64 words: output byte i is byte
    (sel >> 4i) & 7 of the 8 bytes {a, 0}, or its sign replicated when bit 3 is set."""
    out = torch.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 15
        byte = (a >> (8 * (nib & 7))) & 0xFF if (nib & 7) < 4 else torch.zeros_like(a)
        if nib & 8:
            byte = torch.where(byte & 0x80 != 0, 0xFF, 0)
        out |= byte << (8 * i)
    return out


def _scale2(codes: torch.Tensor, sel: int) -> torch.Tensor:
    """The kernel's `scale2`: bf16x2 bit patterns of `scale * 2^118` (both halves)."""
    return ((_prmt(codes, sel) >> 4) + _SCALE_ADD) & 0xFFFFFFFF


def _bits_to_bf16_value(bits: torch.Tensor) -> torch.Tensor:
    """int (low 16 bits) -> the fp32 value of that bf16 pattern."""
    return ((bits & 0xFFFF).to(torch.int32) << 16).view(torch.float32)


def decode_mma_layout(wq: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic, in torch: fp32 [F, K] of `e2m1 * scale` for every weight.

    Replays the CUDA decode bit for bit (the per-register shifts and masks, the ue5m3
    scale formula, the bf16 product, which is exact), then undoes the 2^-8 bias, so the
    result equals `flintc.quant.nvfp4.dequantize_packed` of the original codes and scales
    (without the global scale). Runs on any device; the CPU tests use it.

    Args: wq int32 [F/16, K/64, 32, 4] and sq uint8 [F/16, K/64, 32, 2] (`pack_mma_layout`;
    a stack flattened to its rows). Returns fp32 [F, K]. Raises ValueError for other
    dtypes or shapes, or a scale code above `MAX_SCALE_CODE` (no E4M3 value).
    """
    _check_mma_pair("decode_mma_layout", wq, sq)
    FT, KC = wq.shape[0], wq.shape[1]
    w = wq.to(torch.int64) & 0xFFFFFFFF  # [ft, kc, lane, s]
    out = []
    for r in range(4):
        bits = _decode_register(w, r)
        out.append(torch.stack([bits & 0xFFFF, bits >> 16], dim=-1))  # [..., e]
    bits = torch.stack(out, dim=-2)  # [ft, kc, lane, s, r, e]
    tiny = _bits_to_bf16_value(bits)  # e2m1 * 2^-126
    word = sq[..., 0].to(torch.int64) | (sq[..., 1].to(torch.int64) << 8)  # the u16 load
    sg = _bits_to_bf16_value(_scale2(word, _SEL_G))  # [ft, kc, lane]: scale * 2^118, row g
    sg8 = _bits_to_bf16_value(_scale2(word, _SEL_G8))  # row g + 8
    sval = torch.stack([sg, sg8], dim=-1)  # [ft, kc, lane, h]
    s_reg = sval[:, :, :, None, [0, 1, 0, 1]]  # [ft, kc, lane, s, r]: row g + 8 (r & 1)
    prod = (tiny.double() * s_reg[..., None].double()).float()  # exact in fp32 (and bf16)
    w8 = prod * DEQUANT_UNSCALE  # [ft, kc, g*4+t, s, r, e]
    # back to [F, K]: r = 2 * half + h, k = 64 kc + 16 t + 4 s + 2 half + e
    w8 = w8.reshape(FT, KC, 8, 4, 4, 2, 2, 2)  # [ft, kc, g, t, s, half, h, e]
    w8 = w8.permute(0, 6, 2, 1, 3, 4, 5, 7)  # [ft, h, g, kc, t, s, half, e]
    return w8.reshape(FT * 16, KC * 64)


_COMMON = r"""
#define RT __RT__        // 16-row tiles per block
#define KC __KC__        // K / 64: chunks per row
#define CPW __CPW__      // chunks per warp
#define PF __PF__        // chunks loaded ahead of the one in the tensor cores
#define WARPS __WARPS__  // warps per block (the GEMV: each a K / (WARPS * gridDim.y) slice)
#define EPI __EPI__      // 0: fp32 out (atomic add when split); 1: bf16 out; 2: bf16 out + residual
#define PDL __PDL__      // griddepcontrol.wait before reading x / residual
#define TRIG_EARLY __TRIG__  // PDL: launch_dependents once a block's first loads are issued
                             // (after the wait), not after its main loop
#define BF16W __BF16W__  // 1: bf16 weights, row-major [F, K] (ChunkB); 0: NVFP4 mma layout
#define EARLY_EPI __EARLY_EPI__  // 1: the epilogue's inputs from earlier kernels (the GEMV's
                                 // residual, the MoE down kernel's residual and routing
                                 // weights) load early, off the critical path
                                 // (`mma_early_epilogue`)
#define L2PF __L2PF__    // 1: the chunks of a warp's slice past the first PF (which load into
                         // registers) are prefetched into L2 once their address is known
                         // (`l2_prefetch_tiles`), so that their register loads hit L2
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 bmul(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ u32 scale2(u32 codes, u32 sel) {  // bf16x2 of scale * 2^118
  u32 d;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(codes), "r"(sel));
  return (d >> 4) + __SCALE_ADD__;  // (code << 4) + (236 << 7) in each half
}
__device__ __forceinline__ u16 to_bf16(float v) {
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
__device__ __forceinline__ float from_bf16(u16 h) { return __uint_as_float((u32)h << 16); }

struct Chunk { uint4 w[RT]; u32 s[RT]; uint4 x0, x1; };

// Volatile loads. ACT = false: weights loaded before griddepcontrol.wait (ld.global.nc; a
// __ldg may be moved past the wait: it reads memory that nothing writes). ACT = true: x
// and the residual, the previous kernel's outputs: coherent ld.global, never .nc, which
// ptxas may hoist above the wait (seen in the SASS).
template <bool ACT> __device__ __forceinline__ uint4 ld_v4(const uint4* p) {
  uint4 v;
  if (ACT)
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  else
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
template <bool ACT> __device__ __forceinline__ u16 ld_u16(const u16* p) {
  u16 v;
  if (ACT) asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  else asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}
#define ld_act(p) ld_v4<true>(p)
#define ld_act_u16(p) ld_u16<true>(p)

// one row tile's codes and scales of chunk c; EARLY: before griddepcontrol.wait (volatile)
template <bool EARLY> __device__ __forceinline__ void load_tile(uint4& w, u32& s,
                                                                const uint4* wp, const u16* sp,
                                                                int off) {
  if (EARLY) { w = ld_v4<false>(wp + off); s = ld_u16<false>(sp + off); }
  else { w = __ldg(wp + off); s = __ldg(sp + off); }
}

// wp, sp, xp: this lane's pointers at chunk 0 of the warp (row tile ft0); every other
// offset is a compile-time constant, so the loads need no address arithmetic
template <bool EARLY = false>
__device__ __forceinline__ void load_w(Chunk& ch, const uint4* __restrict__ wp,
                                       const u16* __restrict__ sp, int c) {
#pragma unroll
  for (int r = 0; r < RT; ++r) load_tile<EARLY>(ch.w[r], ch.s[r], wp, sp, (r * KC + c) * 32);
}
__device__ __forceinline__ unsigned long long ld_act_u64(const long long* p) {
  unsigned long long v;
  asm volatile("ld.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float ld_act_f32(const float* p) {
  float v;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float ld_f32_nc(const float* p) {  // a weight, before the wait
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void load_x(Chunk& ch, const uint4* xp, int c) {
  ch.x0 = ld_act(xp + 8 * c);
  ch.x1 = ld_act(xp + 8 * c + 1);
}

__device__ __forceinline__ void mma_chunk(const Chunk& ch, float (&acc)[RT][4]) {
  const u32 xv[8] = {ch.x0.x, ch.x0.y, ch.x0.z, ch.x0.w, ch.x1.x, ch.x1.y, ch.x1.z, ch.x1.w};
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const u32 wv[4] = {ch.w[r].x, ch.w[r].y, ch.w[r].z, ch.w[r].w};
    const u32 sg = scale2(ch.s[r], __SEL_G__);    // row g
    const u32 sg8 = scale2(ch.s[r], __SEL_G8__);  // row g + 8
#pragma unroll
    for (int st = 0; st < 4; ++st) {
      const u32 q = wv[st];
      const u32 a0 = bmul(__DEC0__, sg);  // registers 0-3: _DECODE_EXPR
      const u32 a1 = bmul(__DEC1__, sg8);
      const u32 a2 = bmul(__DEC2__, sg);
      const u32 a3 = bmul(__DEC3__, sg8);
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
          "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
          : "+f"(acc[r][0]), "+f"(acc[r][1]), "+f"(acc[r][2]), "+f"(acc[r][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(xv[2 * st]), "r"(xv[2 * st + 1]));
    }
  }
}
// bf16 weights: in chunk c (64 columns) lane (g, t) reads rows g and g + 8 at columns
// 8t .. 8t + 7 (words 0-3: k16 steps 0, 1) and 32 + 8t .. 32 + 8t + 7 (steps 2, 3), one
// 16-byte load each: a warp's load covers 64 contiguous bytes of 8 rows. The mma's k
// slots 2t + e / 2t + 8 + e of step s are the physical columns of those words (the sum
// does not depend on the order), and x is read in the same order (x0: columns 8t..,
// x1: 32 + 8t..).
struct ChunkB { uint4 w[RT][4]; uint4 x0, x1; };
template <bool EARLY = false>
__device__ __forceinline__ void load_wb(ChunkB& ch, const uint4* __restrict__ wp, int c) {
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // q: (row g, g + 8) x (columns 8t.., 32 + 8t..)
      const uint4* p = wp + (size_t)(r * 16 + (q >> 1) * 8) * (KC * 8) + c * 8 + (q & 1) * 4;
      ch.w[r][q] = EARLY ? ld_v4<false>(p) : __ldg(p);
    }
}
__device__ __forceinline__ void mma_chunk_b(const ChunkB& ch, float (&acc)[RT][4]) {
  const u32 xv[8] = {ch.x0.x, ch.x0.y, ch.x0.z, ch.x0.w, ch.x1.x, ch.x1.y, ch.x1.z, ch.x1.w};
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const u32 gw[8] = {ch.w[r][0].x, ch.w[r][0].y, ch.w[r][0].z, ch.w[r][0].w,
                       ch.w[r][1].x, ch.w[r][1].y, ch.w[r][1].z, ch.w[r][1].w};
    const u32 hw[8] = {ch.w[r][2].x, ch.w[r][2].y, ch.w[r][2].z, ch.w[r][2].w,
                       ch.w[r][3].x, ch.w[r][3].y, ch.w[r][3].z, ch.w[r][3].w};
#pragma unroll
    for (int st = 0; st < 4; ++st)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
          "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
          : "+f"(acc[r][0]), "+f"(acc[r][1]), "+f"(acc[r][2]), "+f"(acc[r][3])
          : "r"(gw[2 * st]), "r"(hw[2 * st]), "r"(gw[2 * st + 1]), "r"(hw[2 * st + 1]),
            "r"(xv[2 * st]), "r"(xv[2 * st + 1]));
  }
}
// the GEMV and MoE kernels take either format through these overloads (WChunk is the one
// compiled)
template <bool EARLY = false>
__device__ __forceinline__ void load_w(ChunkB& ch, const uint4* __restrict__ wp,
                                       const u16* __restrict__, int c) {
  load_wb<EARLY>(ch, wp, c);
}
__device__ __forceinline__ void load_x(ChunkB& ch, const uint4* xp, int c) {
  ch.x0 = ld_act(xp + 8 * c);
  ch.x1 = ld_act(xp + 8 * c + 4);
}
__device__ __forceinline__ void mma_chunk(const ChunkB& ch, float (&acc)[RT][4]) {
  mma_chunk_b(ch, acc);
}
// L2 prefetch of `bytes` (a multiple of 16) at p (16-byte aligned): one bulk request, no
// registers, no completion to wait for (PTX ISA 8.0, sm_90: cp.async.bulk.prefetch.L2)
__device__ __forceinline__ void l2_prefetch(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
}
// L2 prefetch (L2PF) of chunks [a, a + n) of a warp's slice of `tiles` consecutive 16-row
// tiles: w0 / s0 lane 0's `w_at` / `s_at` pointers at the slice's first chunk. NVFP4 (mma
// layout): a tile's chunks are contiguous, 512 code bytes and 64 scale bytes each, so a
// tile takes 2 requests; bf16 (row-major): one request per row of 128 n bytes. The warp's
// lanes share the requests.
__device__ __forceinline__ void l2_prefetch_tiles(const void* w0, const void* s0, int tiles,
                                                  int a, int n, int lane) {
#if L2PF
  if (n <= 0) return;
#if BF16W
  for (int p = lane; p < tiles * 16; p += 32)
    l2_prefetch(static_cast<const uint4*>(w0) + (size_t)p * (KC * 8) + a * 8, n * 128);
#else
  for (int p = lane; p < 2 * tiles; p += 32) {
    const size_t off = ((size_t)(p >> 1) * KC + a) * 32;
    if (p & 1) l2_prefetch(static_cast<const u16*>(s0) + off, n * 64);
    else l2_prefetch(static_cast<const uint4*>(w0) + off, n * 512);
  }
#endif
#endif
}
// a weight's fp32 global scale (NVFP4)
__device__ __forceinline__ float global_scale(const float* p) {
#if BF16W
  return 0.00390625f;  // bf16 weights: 2^-8, so that the epilogue's x 256 is exactly 1
#else
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
#endif
}
#if BF16W
typedef ChunkB WChunk;
#else
typedef Chunk WChunk;
#endif
// this lane's pointers at chunk c0 of 16-row tile `tile` (of a [tiles * 16, KC * 64]
// matrix): the weight's (bf16 row-major: row g, columns 8t..; NVFP4 mma layout: the
// lane's fragment words), its scales (NVFP4 only) and x's row (bf16: columns 8t..;
// NVFP4: the B fragment's 16 bytes at 16t..)
__device__ __forceinline__ const uint4* w_at(const uint4* w, size_t tile, int c0, int lane) {
#if BF16W
  return w + (tile * 16 + (lane >> 2)) * (KC * 8) + c0 * 8 + (lane & 3);
#else
  return w + (tile * KC + c0) * 32 + lane;
#endif
}
__device__ __forceinline__ const u16* s_at(const u16* s, size_t tile, int c0, int lane) {
#if BF16W
  return s;  // unused
#else
  return s + (tile * KC + c0) * 32 + lane;
#endif
}
__device__ __forceinline__ const uint4* x_at(const u16* xrow, int c0, int lane) {
  return reinterpret_cast<const uint4*>(xrow) + 8 * c0 + (BF16W ? (lane & 3) : 2 * (lane & 3));
}
"""

_GEMV_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(WARPS * 32)
nvfp4_mma_gemv(const uint4* __restrict__ wq, const u16* __restrict__ sq,
               const float* __restrict__ gscale, const u16* x, const u16* residual,
               void* __restrict__ out, int N, int F) {
#define RPW ((RT + WARPS - 1) / WARPS)  // row tiles each warp finishes in the epilogue
  __shared__ float red[WARPS][RT][4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int ft0 = blockIdx.x * RT;
  const int c0 = (blockIdx.y * WARPS + warp) * CPW;
  // B fragment column n = g: rows g >= N read row N - 1, their outputs are not stored
  const u16* xrow = x + (size_t)min(g, N - 1) * (KC * 64);
  float acc[RT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r) { acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f; }
  // NVFP4: wq / sq the mma layout; bf16 (BF16W): wq the row-major weight, sq unused
  const uint4* wp = w_at(wq, ft0, c0, lane);
  const u16* sp = s_at(sq, ft0, c0, lane);
  const uint4* xp = x_at(xrow, c0, lane);
  // the global scale x 256 (exact: undoes the decode's 2^-8; bf16: 1)
  const float out_scale = global_scale(gscale) * 256.0f;
  WChunk buf[PF + 1];
#pragma unroll
  for (int c = 0; c < PF && c < CPW; ++c) load_w<true>(buf[c], wp, sp, c);  // weights only
  l2_prefetch_tiles(w_at(wq, ft0, c0, 0), s_at(sq, ft0, c0, 0), RT, PF, CPW - PF, lane);
#if PDL
  // x is the previous kernel's output. The wait sits in its own basic block: ptxas hoists
  // a griddepcontrol.wait above the weight loads of the same block (seen in the SASS)
  if (N > 0) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#pragma unroll
  for (int c = 0; c < PF && c < CPW; ++c) load_x(buf[c], xp, c);
#if EPI == 2 && EARLY_EPI
  // the residual of this thread's outputs (row tiles warp, warp + WARPS, ...), loaded now,
  // after the wait: in the epilogue each load would sit between the reduction and the
  // store, one L2 round trip per output on the kernel's critical path
  u16 res[RPW][4];
#pragma unroll
  for (int i = 0; i < RPW; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = warp + i * WARPS, n = 2 * t + (j & 1);
      res[i][j] = r < RT && n < N
          ? ld_act_u16(residual + (size_t)n * F + (ft0 + r) * 16 + g + (j >> 1) * 8) : 0;
    }
#endif
#if PDL && TRIG_EARLY
  asm volatile("griddepcontrol.launch_dependents;");
#endif
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    if (c + PF < CPW) {
      load_w(buf[(c + PF) % (PF + 1)], wp, sp, c + PF);
      load_x(buf[(c + PF) % (PF + 1)], xp, c + PF);
    }
    mma_chunk(buf[c % (PF + 1)], acc);
  }
#if PDL && !TRIG_EARLY
  asm volatile("griddepcontrol.launch_dependents;");
#endif
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < 4; ++j) red[warp][r][j][lane] = acc[r][j];
  __syncthreads();
  // warp w finishes row tiles r = w, w + WARPS, ...
#if EARLY_EPI
#pragma unroll
  for (int i = 0; i < RPW; ++i) {  // unrolled: res[i] stays in registers
    const int r = warp + i * WARPS;
    if (r >= RT) break;
#else
  for (int r = warp; r < RT; r += WARPS) {
#endif
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) v += red[w][r][j][lane];  // fixed order
      v *= out_scale;
      const int row = (ft0 + r) * 16 + g + (j >> 1) * 8;
      const int n = 2 * t + (j & 1);
      if (n < N) {
        const size_t o = (size_t)n * F + row;
#if EPI == 0
        if (gridDim.y == 1) static_cast<float*>(out)[o] = v;
        else atomicAdd(static_cast<float*>(out) + o, v);
#elif EPI == 1
        static_cast<u16*>(out)[o] = to_bf16(v);
#else
#if EARLY_EPI
        static_cast<u16*>(out)[o] = to_bf16(from_bf16(res[i][j]) + from_bf16(to_bf16(v)));
#else
        static_cast<u16*>(out)[o] = to_bf16(from_bf16(ld_act_u16(residual + o)) +
                                           from_bf16(to_bf16(v)));
#endif
#endif
      }
    }
  }
}
"""

_GATE_UP_COMMON = r"""
// the gate/up kernels' (MoE and dense) shared parts
#define RTB (RT / 2)  // 16-row tiles per block, of the gate and of the up projection each
__device__ __forceinline__ float sigmoid_rn(float v) {  // torch: 1 / (1 + exp(-v))
  return __fdiv_rn(1.0f, 1.0f + expf(-v));
}
// chunk c of the block's row tiles: tiles r < RTB the gate's, RTB + r the up's
template <bool EARLY = false>
__device__ __forceinline__ void load_w2(Chunk& ch, const uint4* g_wp, const u16* g_sp,
                                        const uint4* u_wp, const u16* u_sp, int c) {
#pragma unroll
  for (int r = 0; r < RTB; ++r) {
    load_tile<EARLY>(ch.w[r], ch.s[r], g_wp, g_sp, (r * KC + c) * 32);
    load_tile<EARLY>(ch.w[RTB + r], ch.s[RTB + r], u_wp, u_sp, (r * KC + c) * 32);
  }
}
template <bool EARLY = false>  // bf16: a tile's rows g, g + 8 at columns 8t.., 32 + 8t..
__device__ __forceinline__ void load_w2(ChunkB& ch, const uint4* g_wp, const u16*,
                                        const uint4* u_wp, const u16*, int c) {
#pragma unroll
  for (int r = 0; r < RTB; ++r)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int off = (r * 16 + (q >> 1) * 8) * (KC * 8) + c * 8 + (q & 1) * 4;
      ch.w[r][q] = EARLY ? ld_v4<false>(g_wp + off) : __ldg(g_wp + off);
      ch.w[RTB + r][q] = EARLY ? ld_v4<false>(u_wp + off) : __ldg(u_wp + off);
    }
}

"""

_MOE_GATE_UP_SOURCE = r"""
// flintc::moe_topk_gate_up for NVFP4 (mma layout) or bf16 (row-major) experts: grid
// (I / (16 RTB) row-tile groups, 1 + N * KTOP items); item 0 is the shared expert for all
// N tokens (an N-column mma), item 1 + n * KTOP + k token n's k-th routed expert (one
// column). The block's warps split the reduction (H) into
// CPW-chunk slices, each computing the gate and the up tile (x read once for both); the
// block adds the warps' sums in warp order. Routing (top-k of sigmoid(logit) + bias, ties
// to the lower index; weights s / sum(s) * scaling) runs in the prologue of every
// routed block for its token, and in block (0, 0) for all tokens, which writes ids and
// weights.
#define KTOP __KTOP__
#define NE __NE__  // experts (a multiple of 32, at most 1024)
#define BLOCK_ROUTE __BLOCK_ROUTE__  // routed blocks: 1 every warp routes (route_slot_block),
                                     // 0 warp 0 alone

__device__ __forceinline__ long long route_key(float key, int e) {
  int bits = __float_as_int(key + 0.0f);  // -0 -> +0
  if (bits < 0) bits ^= 0x7FFFFFFF;  // signed-int order == float order
  return ((long long)bits << 32) | (unsigned)(NE - 1 - e);  // equal keys: lower e wins
}
// token n's routing keys, lane's experts lane + 32 j
__device__ __forceinline__ void load_keys(long long (&packed)[NE / 32], const float* logits,
                                          const float* bias, int lane) {
#pragma unroll
  for (int j = 0; j < NE / 32; ++j) {
    const int e = lane + 32 * j;
    packed[j] = route_key(sigmoid_rn(ld_act_f32(logits + e)) + __ldg(bias + e), e);
  }
}
#define LOWEST_KEY (-9223372036854775807LL - 1)  // below every expert's key
// the warp's largest key, taken out of packed (every lane gets it): each lane's largest,
// then redux.sync on the high words (the score's order) and on the low words (NE - 1 - e)
// of the lanes holding the largest high word. Keys are unique (the expert is in the low
// word), so the one equal to it is the one taken.
template <int J>
__device__ __forceinline__ long long take_best_key(long long (&packed)[J]) {
  long long best = packed[0];
#pragma unroll
  for (int j = 1; j < J; ++j) best = max(best, packed[j]);
  const int hi = __reduce_max_sync(0xffffffffu, (int)(best >> 32));
  const unsigned lo = __reduce_max_sync(0xffffffffu, (int)(best >> 32) == hi ? (unsigned)best : 0u);
  const long long key = (long long)(((unsigned long long)(unsigned)hi << 32) | lo);
#pragma unroll
  for (int j = 0; j < J; ++j) if (packed[j] == key) packed[j] = LOWEST_KEY;
  return key;
}
__device__ __forceinline__ int key_expert(long long key) { return NE - 1 - (int)(unsigned)key; }
__device__ __forceinline__ int take_best(long long (&packed)[NE / 32], int) {
  return key_expert(take_best_key(packed));
}
// token n's top-KTOP into ids[KTOP] / w[KTOP] (one warp; every lane gets the results)
__device__ void route_token(const float* logits, const float* bias, float scaling, int lane,
                            int* ids, float* w) {
  long long packed[NE / 32];
  load_keys(packed, logits, bias, lane);
  float sel[KTOP];
#pragma unroll
  for (int k = 0; k < KTOP; ++k) {
    const int e = take_best(packed, lane);
    ids[k] = e;
    sel[k] = sigmoid_rn(ld_act_f32(logits + e));
  }
  float total = 0.f;  // a pairwise tree over 8 slots (the Triton kernel's order for top-6)
  {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = k < KTOP ? sel[k] : 0.f;
#pragma unroll
    for (int width = 4; width > 0; width >>= 1)
#pragma unroll
      for (int k = 0; k < width; ++k) v[k] = v[k] + v[k + width];
    total = v[0];
  }
  if (!(total > 0.f)) total = 1.f;
#pragma unroll
  for (int k = 0; k < KTOP; ++k) w[k] = __fmul_rn(__fdiv_rn(sel[k], total), scaling);
}
// The block's routing (every routed block, for its token n and slot k): all warps share
// the experts, warp w taking e = lane + 32 (w + WARPS j), j < RJ. Each warp takes its own
// top-(k + 1) keys into s_cand[w][0..k]; the union of those holds the block's top-(k + 1),
// so warp 0's top-(k + 1) of the union ends on slot k's expert, as k + 1 rounds over all
// NE keys would (the same keys, the same order). bias_r: the warp's biases, loaded before
// the dependency wait (a weight).
// Warp 0 of the block that routes slot KTOP - 1 holds the token's top-k keys in order
// (top[]): that block (row group 0) writes the token's ids and weights (`write_routing`).
#define RJ ((NE / 32 + WARPS - 1) / WARPS)  // experts per lane
#define CJ ((WARPS * KTOP + 31) / 32)       // candidates per lane of warp 0's merge
__device__ __forceinline__ int route_slot_block(const float* logits, const float (&bias_r)[RJ],
                                                int k, int lane, int warp,
                                                long long (*s_cand)[KTOP], int* s_e,
                                                long long (&top)[KTOP]) {
  long long packed[RJ];
#pragma unroll
  for (int j = 0; j < RJ; ++j) {
    const int e = lane + 32 * (warp + WARPS * j);
    packed[j] = e < NE ? route_key(sigmoid_rn(ld_act_f32(logits + e)) + bias_r[j], e)
                       : LOWEST_KEY;
  }
  for (int r = 0; r <= k; ++r) {
    const long long key = take_best_key(packed);
    if (lane == 0) s_cand[warp][r] = key;
  }
  __syncthreads();
  if (warp == 0) {
    long long cand[CJ];
#pragma unroll
    for (int j = 0; j < CJ; ++j) {
      const int i = lane + 32 * j, w = i / KTOP, r = i - w * KTOP;
      cand[j] = w < WARPS && r <= k ? s_cand[w][r] : LOWEST_KEY;
    }
    long long key = LOWEST_KEY;
#pragma unroll
    for (int r = 0; r < KTOP; ++r)  // unrolled: top[] stays in registers
      if (r <= k) top[r] = key = take_best_key(cand);
    if (lane == 0) *s_e = key_expert(key);
  }
  __syncthreads();
  return *s_e;
}
// token's ids and weights from warp 0's top[] (every lane holds all KTOP keys): lane j
// takes slot j, with route_token's formulas and its pairwise sum over 8 slots (lanes 0-7,
// shuffles: lane k adds lane k + 4, then k + 2, then k + 1)
__device__ __forceinline__ void write_routing(const float* logits, const long long (&top)[KTOP],
                                              float scaling, int lane, long long* ids,
                                              float* w) {
  int e = 0;
#pragma unroll
  for (int j = 0; j < KTOP; ++j) if (lane == j) e = key_expert(top[j]);
  const float sel = lane < KTOP ? sigmoid_rn(ld_act_f32(logits + e)) : 0.f;
  float v = sel;
#pragma unroll
  for (int width = 4; width > 0; width >>= 1) v = v + __shfl_down_sync(0xffffffffu, v, width);
  float total = __shfl_sync(0xffffffffu, v, 0);
  if (!(total > 0.f)) total = 1.f;
  if (lane < KTOP) { ids[lane] = e; w[lane] = __fmul_rn(__fdiv_rn(sel, total), scaling); }
}

// L2 prefetch of this block's share (blockIdx.x of gridDim.x: the row groups) of `bytes`
// (a multiple of 16) at p, over the warp's lanes: the routed block's expert's down weights
// (d_wbytes / d_sbytes > 0), which the next kernel (flintc::moe_down_combine_residual)
// reads, so that its loads hit L2
__device__ __forceinline__ void l2_prefetch_share(const unsigned char* p, int bytes, int lane) {
  const int parts = gridDim.x * 32;
  const int piece = ((bytes + parts - 1) / parts + 15) & ~15;
  const long long lo = ((long long)blockIdx.x * 32 + lane) * piece;
  if (lo < bytes) l2_prefetch(p + lo, (unsigned)min((long long)piece, bytes - lo));
}
extern "C" __global__ void __launch_bounds__(WARPS * 32 __MINB__)
nvfp4_mma_moe_gate_up(const uint4* __restrict__ gwq, const u16* __restrict__ gsq,
                      const float* __restrict__ ggs, const uint4* __restrict__ uwq,
                      const u16* __restrict__ usq, const float* __restrict__ ugs, int gs_stride,
                      const uint4* __restrict__ sgwq, const u16* __restrict__ sgsq,
                      const float* __restrict__ sggs, const uint4* __restrict__ suwq,
                      const u16* __restrict__ susq, const float* __restrict__ sugs,
                      const u16* x, const float* logits, const float* __restrict__ bias,
                      double scaling_d, u16* __restrict__ hout, float* __restrict__ wout,
                      long long* __restrict__ ids_out, int N, int I,
                      const void* __restrict__ dwq, const void* __restrict__ dsq,
                      int d_wbytes, int d_sbytes) {
  __shared__ float red[WARPS][RT][4][32];
  __shared__ long long s_cand[WARPS][KTOP];
  __shared__ int s_e;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int ft = blockIdx.x * RTB, FT = I >> 4;  // the block's first row tile
  const int item = blockIdx.y;
  const int c0 = warp * CPW;
  const float scaling = (float)scaling_d;
  WChunk buf[PF + 1];
  const uint4 *g_wp, *u_wp;
  const u16 *g_sp, *u_sp;
  float gscale, uscale;
  if (item == 0) {  // the shared expert: its weights stream before the wait
    g_wp = w_at(sgwq, ft, c0, lane);
    g_sp = s_at(sgsq, ft, c0, lane);
    u_wp = w_at(suwq, ft, c0, lane);
    u_sp = s_at(susq, ft, c0, lane);
#pragma unroll
    for (int c = 0; c < PF && c < CPW; ++c) load_w2<true>(buf[c], g_wp, g_sp, u_wp, u_sp, c);
    l2_prefetch_tiles(w_at(sgwq, ft, c0, 0), s_at(sgsq, ft, c0, 0), RTB, PF, CPW - PF, lane);
    l2_prefetch_tiles(w_at(suwq, ft, c0, 0), s_at(susq, ft, c0, 0), RTB, PF, CPW - PF, lane);
  }
  long long top[KTOP];  // block route: warp 0's top-(k + 1) keys in order
  float bias_r[RJ];  // the routing biases (a weight: loaded before the wait)
#pragma unroll
  for (int j = 0; j < RJ; ++j) {
    const int e = lane + 32 * (warp + WARPS * j);
    bias_r[j] = BLOCK_ROUTE && item != 0 && e < NE ? ld_f32_nc(bias + e) : 0.f;
  }
#if PDL
  if (N > 0) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  int n = 0, k = 0;
  if (item == 0) {
    for (int tok = warp; !BLOCK_ROUTE && ft == 0 && tok < N; tok += WARPS) {  // warp mode:
      // the routing outputs, once (block route: `write_routing`)
      int ids[KTOP];
      float w[KTOP];
      route_token(logits + (size_t)tok * NE, bias, scaling, lane, ids, w);
      if (lane < KTOP) {
#pragma unroll
        for (int j = 0; j < KTOP; ++j)
          if (j == lane) { ids_out[tok * KTOP + j] = ids[j]; wout[tok * KTOP + j] = w[j]; }
      }
    }
    gscale = global_scale(sggs);
    uscale = global_scale(sugs);
  } else {
    n = (item - 1) / KTOP;
    k = (item - 1) % KTOP;
#if BLOCK_ROUTE
    const long long e = route_slot_block(logits + (size_t)n * NE, bias_r, k, lane, warp,
                                         s_cand, &s_e, top);
#else
    if (warp == 0) {  // warp 0 alone: this token's top-k up to slot k (k + 1 rounds)
      long long packed[NE / 32];
      load_keys(packed, logits + (size_t)n * NE, bias, lane);
      int e = 0;
      for (int r = 0; r <= k; ++r) e = take_best(packed, lane);
      if (lane == 0) s_e = e;
    }
    __syncthreads();
    const long long e = s_e;
#endif
    g_wp = w_at(gwq, e * FT + ft, c0, lane);
    g_sp = s_at(gsq, e * FT + ft, c0, lane);
    u_wp = w_at(uwq, e * FT + ft, c0, lane);
    u_sp = s_at(usq, e * FT + ft, c0, lane);
#pragma unroll
    for (int c = 0; c < PF && c < CPW; ++c) load_w2(buf[c], g_wp, g_sp, u_wp, u_sp, c);
    l2_prefetch_tiles(w_at(gwq, e * FT + ft, c0, 0), s_at(gsq, e * FT + ft, c0, 0), RTB, PF,
                      CPW - PF, lane);
    l2_prefetch_tiles(w_at(uwq, e * FT + ft, c0, 0), s_at(usq, e * FT + ft, c0, 0), RTB, PF,
                      CPW - PF, lane);
    if (d_wbytes > 0 && warp == WARPS - 1)  // this block's share of e's down weights
      l2_prefetch_share(static_cast<const unsigned char*>(dwq) + e * d_wbytes, d_wbytes, lane);
    if (d_sbytes > 0 && warp == WARPS - 1)
      l2_prefetch_share(static_cast<const unsigned char*>(dsq) + e * d_sbytes, d_sbytes, lane);
    gscale = global_scale(ggs + e * gs_stride);
    uscale = global_scale(ugs + e * gs_stride);
  }
  const int H = KC * 64;
  const u16* xrow = x + (size_t)(item == 0 ? min(g, N - 1) : n) * H;
  const uint4* xp = x_at(xrow, c0, lane);
#pragma unroll
  for (int c = 0; c < PF && c < CPW; ++c) load_x(buf[c], xp, c);
#if BLOCK_ROUTE
  if (item != 0 && ft == 0 && k == KTOP - 1 && warp == 0)  // its first loads are in flight
    write_routing(logits + (size_t)n * NE, top, scaling, lane, ids_out + n * KTOP,
                  wout + n * KTOP);
#endif
#if PDL && TRIG_EARLY
  asm volatile("griddepcontrol.launch_dependents;");  // the block's first loads are issued
#endif
  float acc[RT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    if (c + PF < CPW) {
      load_w2(buf[(c + PF) % (PF + 1)], g_wp, g_sp, u_wp, u_sp, c + PF);
      load_x(buf[(c + PF) % (PF + 1)], xp, c + PF);
    }
    mma_chunk(buf[c % (PF + 1)], acc);
  }
#if PDL && !TRIG_EARLY
  asm volatile("griddepcontrol.launch_dependents;");
#endif
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < 4; ++j) red[warp][r][j][lane] = acc[r][j];
  __syncthreads();
  for (int r = warp; r < RTB; r += WARPS) {  // warp w finishes row tiles w, w + WARPS, ..
    const int slots = KTOP + 1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = 2 * t + (j & 1);
      if (item == 0 ? col >= N : col != 0) continue;
      float vg = 0.f, vu = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) { vg += red[w][r][j][lane]; vu += red[w][RTB + r][j][lane]; }
      const float gv = from_bf16(to_bf16(vg * (gscale * 256.0f)));  // g, u rounded to bf16
      const float uv = from_bf16(to_bf16(vu * (uscale * 256.0f)));
      const float hv = gv * sigmoid_rn(gv) * uv;  // silu(g) * u in fp32, one rounding
      const int row = (ft + r) * 16 + g + (j >> 1) * 8;
      const size_t o = item == 0 ? ((size_t)col * slots + KTOP) * I + row
                                 : ((size_t)n * slots + k) * I + row;
      hout[o] = to_bf16(hv);
    }
  }
}
"""


_DENSE_GATE_UP_SOURCE = r"""
// flintc::norm_gate_up_silu (kernel 5 of a dense layer's decode schedule) for NVFP4 (mma
// layout) or bf16 (row-major) weights [F, H]. Grid (blocks, 1): block b computes row
// groups b, b + gridDim.x, ... < `groups` (a group: RTB 16-row tiles of the gate and the
// same rows of the up projection); the block's WARPS warps split H into CPW-chunk slices.
// Each warp's weight loads run as one stream over its (group, chunk) pairs, PF chunks
// ahead, so the next group's first chunks are in flight during a group's epilogue.
// Prologue: the first PF chunks' weights load before griddepcontrol.wait; then the
// post-attention RMSNorm (warp n takes token n: the whole row from L2 for the sum of
// squares, in a fixed order, then bf16(x * rstd * w) into shared memory, which the mma B
// fragments read). Epilogue per group: the warps' sums added in warp order, the global
// scale, g and u rounded to bf16, bf16(silu(g) * u) (FLINT_SPEC section 3).
#define NORM_BF16 __NORMBF__  // 1: the norm weight is bf16 (else fp32)
#define XST (KC * 64 + 8)  // row stride of the normed x in shared memory (+16 bytes: the
                           // 8 rows of a B fragment then hit distinct banks)
#define UPL ((KC * 8 + 31) / 32)  // 16-byte x vectors per lane per row (RMSNorm sums)
#define RED_FLOATS (WARPS * RT * 4 * 32)
#if BF16W
#define XV1 4  // a lane's second x vector of a chunk: columns 32 + 8t.. (first: 8t..)
#else
#define XV1 1  // columns 16t + 8.. (first: 16t..), the mma layout's order
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32)
nvfp4_mma_norm_gate_up(const uint4* __restrict__ gwq, const u16* __restrict__ gsq,
                       const float* __restrict__ ggs, const uint4* __restrict__ uwq,
                       const u16* __restrict__ usq, const float* __restrict__ ugs,
                       const u16* x, const void* __restrict__ norm, double eps_d,
                       u16* __restrict__ out, int N, int F, int groups) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* red = reinterpret_cast<float*>(smem);                   // [WARPS][RT][4][32]
  u16* xs = reinterpret_cast<u16*>(smem + RED_FLOATS * 4);       // [N][XST] normed x
  __shared__ float s_rstd[8];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int c0 = warp * CPW;
  int grp = blockIdx.x;
  const uint4* g_wp = w_at(gwq, (size_t)grp * RTB, c0, lane);
  const u16* g_sp = s_at(gsq, (size_t)grp * RTB, c0, lane);
  const uint4* u_wp = w_at(uwq, (size_t)grp * RTB, c0, lane);
  const u16* u_sp = s_at(usq, (size_t)grp * RTB, c0, lane);
  // one register set per chunk of the slice: the indices are compile-time constants
  // across the group loop too (chunk c of every group in buf[c]); at most PF + 1 are live
  WChunk buf[CPW];
#pragma unroll
  for (int c = 0; c < PF && c < CPW; ++c) load_w2<true>(buf[c], g_wp, g_sp, u_wp, u_sp, c);
#if L2PF
  for (int gi = grp; gi < groups; gi += gridDim.x) {  // the rest of every group's slice
    const int a = gi == grp ? PF : 0;
    l2_prefetch_tiles(w_at(gwq, (size_t)gi * RTB, c0, 0), s_at(gsq, (size_t)gi * RTB, c0, 0),
                      RTB, a, CPW - a, lane);
    l2_prefetch_tiles(w_at(uwq, (size_t)gi * RTB, c0, 0), s_at(usq, (size_t)gi * RTB, c0, 0),
                      RTB, a, CPW - a, lane);
  }
#endif
  // the global scales x 256 (exact: undoes the decode's 2^-8; bf16: 1)
  const float gscale = global_scale(ggs) * 256.0f, uscale = global_scale(ugs) * 256.0f;
  const float eps = (float)eps_d;
#if PDL
  // x is the previous kernel's output; the wait in its own basic block (see the GEMV)
  if (N > 0) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  // post-attention RMSNorm, as flintc.model.ops.rms_norm: bf16(x * rstd * w), rstd fp32.
  // (1) the raw rows into shared memory, every thread 16-byte vectors u of all N rows
  for (int u = threadIdx.x; u < KC * 8; u += WARPS * 32) {
    uint4 v[8];
#pragma unroll
    for (int n = 0; n < 8; ++n)
      if (n < N) v[n] = ld_act(reinterpret_cast<const uint4*>(x + (size_t)n * (KC * 64)) + u);
#pragma unroll
    for (int n = 0; n < 8; ++n)
      if (n < N) *reinterpret_cast<uint4*>(xs + n * XST + u * 8) = v[n];
  }
  __syncthreads();
  // (2) warp n: row n's sum of squares in a fixed order (each lane its vectors lane + 32 i
  // in turn, then a butterfly), rstd into s_rstd[n]
  for (int n = warp; n < N; n += WARPS) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < UPL; ++i) {
      if (lane + 32 * i >= KC * 8) continue;
      const uint4 v = *reinterpret_cast<const uint4*>(xs + n * XST + (lane + 32 * i) * 8);
      const u32 e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float f = from_bf16((u16)(e[j >> 1] >> (16 * (j & 1))));
        ss = __fadd_rn(ss, __fmul_rn(f, f));
      }
    }
    const float r = rms_rstd(warp_sum(ss), (float)(KC * 64), eps);
    if (lane == 0) s_rstd[n] = r;
  }
  __syncthreads();
  // (3) in place: bf16(x * rstd * w), every thread its vectors u of all rows
  for (int u = threadIdx.x; u < KC * 8; u += WARPS * 32) {
    float nw[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) nw[j] = norm_w(norm, u * 8 + j, NORM_BF16);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      if (n >= N) continue;
      uint4* p = reinterpret_cast<uint4*>(xs + n * XST + u * 8);
      const uint4 v = *p;
      const float r = s_rstd[n];
      const u32 e[4] = {v.x, v.y, v.z, v.w};
      u32 o[4];
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const float a = from_bf16((u16)(e[j >> 1] & 0xFFFFu));
        const float b = from_bf16((u16)(e[j >> 1] >> 16));
        const u16 ya = to_bf16(__fmul_rn(__fmul_rn(a, r), nw[j]));
        const u16 yb = to_bf16(__fmul_rn(__fmul_rn(b, r), nw[j + 1]));
        o[j >> 1] = (u32)ya | ((u32)yb << 16);
      }
      *p = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  __syncthreads();
#if PDL && TRIG_EARLY
  asm volatile("griddepcontrol.launch_dependents;");  // x is read and normed
#endif
  // B fragment column n = g: rows g >= N read row N - 1, their outputs are not stored
  const uint4* xp = reinterpret_cast<const uint4*>(xs + min(g, N - 1) * XST) + 8 * c0 +
                    (BF16W ? t : 2 * t);
  for (; grp < groups; grp += gridDim.x) {
    const int next = grp + gridDim.x;
    const bool more = next < groups;  // the same in every thread of the block
    const size_t nt = (size_t)(more ? next : grp) * RTB;
    const uint4* ng_wp = w_at(gwq, nt, c0, lane);
    const u16* ng_sp = s_at(gsq, nt, c0, lane);
    const uint4* nu_wp = w_at(uwq, nt, c0, lane);
    const u16* nu_sp = s_at(usq, nt, c0, lane);
    float acc[RT][4];
#pragma unroll
    for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
#pragma unroll
    for (int c = 0; c < CPW; ++c) {
      if (c + PF < CPW) load_w2(buf[c + PF], g_wp, g_sp, u_wp, u_sp, c + PF);
      else if (c + PF - CPW < CPW && more)  // the next group's first chunks
        load_w2(buf[c + PF - CPW], ng_wp, ng_sp, nu_wp, nu_sp, c + PF - CPW);
      buf[c].x0 = xp[8 * c];
      buf[c].x1 = xp[8 * c + XV1];
      mma_chunk(buf[c], acc);
    }
#if PDL && !TRIG_EARLY
    if (!more) asm volatile("griddepcontrol.launch_dependents;");
#endif
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) red[((warp * RT + r) * 4 + j) * 32 + lane] = acc[r][j];
    __syncthreads();
    // every thread finishes outputs (row tile r, row, column < N): consecutive threads
    // take consecutive rows of one column
    for (int i = threadIdx.x; i < RTB * 16 * N; i += WARPS * 32) {
      const int r = i / (16 * N), rem = i - r * 16 * N;
      const int col = rem >> 4, row16 = rem & 15;
      const int j = 2 * (row16 >> 3) + (col & 1), ln = 4 * (row16 & 7) + (col >> 1);
      float vg = 0.f, vu = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {  // fixed order
        vg += red[((w * RT + r) * 4 + j) * 32 + ln];
        vu += red[((w * RT + RTB + r) * 4 + j) * 32 + ln];
      }
      const float gv = from_bf16(to_bf16(vg * gscale));  // g, u rounded to bf16
      const float uv = from_bf16(to_bf16(vu * uscale));
      const float hv = gv * sigmoid_rn(gv) * uv;  // silu(g) * u in fp32, one rounding
      out[(size_t)col * F + (grp * RTB + r) * 16 + row16] = to_bf16(hv);
    }
    if (more) __syncthreads();  // red is rewritten by the next group
    g_wp = ng_wp; g_sp = ng_sp; u_wp = nu_wp; u_sp = nu_sp;
  }
}
"""


_MOE_DOWN_SOURCE = r"""
// flintc::moe_down_combine_residual for NVFP4 (mma layout) or bf16 (row-major) experts:
// block = 16 rows of H. Work units (item, s): item 0 the shared expert for all N tokens
// (an N-column mma), item 1 + n * KTOP + k token n's k-th routed expert (one column);
// s < KSPLIT a KC / KSPLIT-chunk slice of the reduction (I). The warps take the units in
// turn; the block adds the slices' sums in s order, then combines its 16 rows in the
// reference's order.
#define KTOP __KTOP__
#define KSPLIT __KSPLIT__  // warps (units) per item, each a K slice
#define CPS (KC / KSPLIT)  // chunks per slice
extern "C" __global__ void __launch_bounds__(WARPS * 32)
nvfp4_mma_moe_down(const uint4* __restrict__ wq, const u16* __restrict__ sq,
                   const float* __restrict__ gs, int gs_stride,
                   const uint4* __restrict__ swq, const u16* __restrict__ ssq,
                   const float* __restrict__ sgs, const u16* h, const long long* ids,
                   const float* wts, const u16* residual, u16* __restrict__ out,
                   int N, int H) {
  __shared__ float part[KSPLIT][8][KTOP + 1][16];  // the slices' fp32 sums of the 16 rows
  __shared__ float scl[8][KTOP + 1];  // each item's global scale x 256
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int ft = blockIdx.x, FT = H >> 4;
  const int items = 1 + N * KTOP;
  const int I = KC * 64;
  WChunk buf[PF + 1];
  bool first = true;
  for (int u = warp; u < items * KSPLIT; u += WARPS) {
    const int item = u / KSPLIT, s = u % KSPLIT, c0 = s * CPS;
    const uint4* wp;
    const u16* sp;
    const u16* xrow;
    float scale;
    if (item == 0) {  // the shared expert: column n = token n (rows g >= N repeat N - 1)
      wp = w_at(swq, ft, c0, lane);
      sp = s_at(ssq, ft, c0, lane);
      if (first) {  // weights only before the wait (PDL)
#pragma unroll
        for (int c = 0; c < PF && c < CPS; ++c) load_w<true>(buf[c], wp, sp, c);
      } else {  // a later unit of this warp (WARPS < KSPLIT: several shared-expert slices)
#pragma unroll
        for (int c = 0; c < PF && c < CPS; ++c) load_w(buf[c], wp, sp, c);
      }
      l2_prefetch_tiles(w_at(swq, ft, c0, 0), s_at(ssq, ft, c0, 0), 1, PF, CPS - PF, lane);
      xrow = h + ((size_t)min(g, N - 1) * (KTOP + 1) + KTOP) * I;
    } else {
      const int p = item - 1, n = p / KTOP;
      if (first) {
#if PDL
        if (N > 0) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
      }
      const long long e = (long long)ld_act_u64(ids + p);
      wp = w_at(wq, e * FT + ft, c0, lane);
      sp = s_at(sq, e * FT + ft, c0, lane);
      xrow = h + (size_t)(n * (KTOP + 1) + p % KTOP) * I;  // every column: token n
#pragma unroll
      for (int c = 0; c < PF && c < CPS; ++c) load_w(buf[c], wp, sp, c);
      l2_prefetch_tiles(w_at(wq, e * FT + ft, c0, 0), s_at(sq, e * FT + ft, c0, 0), 1, PF,
                        CPS - PF, lane);
      scale = global_scale(gs + e * gs_stride);
    }
    if (item == 0) {
#if PDL
      if (first && N > 0) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
      scale = global_scale(sgs);
    }
    const uint4* xp = x_at(xrow, c0, lane);
#pragma unroll
    for (int c = 0; c < PF && c < CPS; ++c) load_x(buf[c], xp, c);
    first = false;
#if PDL && TRIG_EARLY
    if (u == warp) asm volatile("griddepcontrol.launch_dependents;");  // first unit's loads issued
#endif
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int c = 0; c < CPS; ++c) {
      if (c + PF < CPS) {
        load_w(buf[(c + PF) % (PF + 1)], wp, sp, c + PF);
        load_x(buf[(c + PF) % (PF + 1)], xp, c + PF);
      }
      mma_chunk(buf[c % (PF + 1)], acc);
    }
    if (item == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = 2 * t + (j & 1);
        if (n < N) part[s][n][KTOP][g + (j >> 1) * 8] = acc[0][j];
      }
      if (s == 0 && lane < N) scl[lane][KTOP] = scale * 256.0f;  // exact: undoes the 2^-8
    } else if (t == 0) {  // column 0 (all columns hold the same token)
      const int p = item - 1;
      part[s][p / KTOP][p % KTOP][g] = acc[0][0];
      part[s][p / KTOP][p % KTOP][g + 8] = acc[0][2];
      if (s == 0 && g == 0) scl[p / KTOP][p % KTOP] = scale * 256.0f;
    }
  }
#if PDL
  if (warp >= items * KSPLIT && N > 0) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (!TRIG_EARLY || warp >= items * KSPLIT) asm volatile("griddepcontrol.launch_dependents;");
#endif
  // the combine's inputs from the previous kernels (the residual, the routing weights),
  // staged in shared memory before the barrier by the block's last threads (the warps
  // with the fewest work units finish first): loaded in the combine, after the barrier,
  // they would add an L2 round trip to the kernel's critical path
#if EARLY_EPI
  __shared__ u16 res[8][16];
  __shared__ float wk[8][KTOP];
  const int last = WARPS * 32 - 1 - threadIdx.x;
  for (int i = last; i < N * 16; i += WARPS * 32)
    res[i >> 4][i & 15] = ld_act_u16(residual + (size_t)(i >> 4) * H + ft * 16 + (i & 15));
  for (int i = last; i < N * KTOP; i += WARPS * 32) wk[i / KTOP][i % KTOP] = ld_act_f32(wts + i);
#endif
  __syncthreads();
  // combine, as flintc.model.ops.expert_combine: y = bf16(sum of the slices x scale); sum_k
  // (w_k * y_k) in k order (separate fp32 multiply and add), plus the shared expert, one
  // rounding; then the residual add
  for (int i = threadIdx.x; i < N * 16; i += WARPS * 32) {
    const int n = i >> 4, row = i & 15;
    float y[KTOP + 1];
#pragma unroll
    for (int k = 0; k <= KTOP; ++k) {
      float v = part[0][n][k][row];
#pragma unroll
      for (int s = 1; s < KSPLIT; ++s) v += part[s][n][k][row];
      y[k] = from_bf16(to_bf16(v * scl[n][k]));
    }
    float m = 0.f;
#pragma unroll
    for (int k = 0; k < KTOP; ++k) {
#if EARLY_EPI
      const float wt = wk[n][k];
#else
      const float wt = ld_act_f32(wts + n * KTOP + k);
#endif
      m = __fadd_rn(m, __fmul_rn(wt, y[k]));
    }
    m = __fadd_rn(m, y[KTOP]);
    const size_t o = (size_t)n * H + ft * 16 + row;
#if EARLY_EPI
    const u16 rv = res[n][row];
#else
    const u16 rv = ld_act_u16(residual + o);
#endif
    out[o] = to_bf16(from_bf16(rv) + from_bf16(to_bf16(m)));
  }
}
"""


_NORM_COMMON = r"""
// RMSNorm helpers of the kernels with a norm prologue (QKV, router, dense gate/up)
__device__ __forceinline__ float norm_w(const void* p, int i, int bf16) {
  return bf16 ? from_bf16(__ldg(static_cast<const u16*>(p) + i))
              : __ldg(static_cast<const float*>(p) + i);
}
__device__ __forceinline__ float warp_sum(float v) {  // butterfly: every lane, same value
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
__device__ __forceinline__ float rms_rstd(float ss, float n, float eps) {  // IEEE, as torch's CPU
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, n), eps)));
}
"""

_QKV_SOURCE = r"""
// flintc::norm_qkv_rope_kv for NVFP4 (mma layout) or bf16 weights (kernel 1 of the decode
// schedule). Grid (HQ + 2 HKV heads, CL), launched as clusters of (1, CL, 1) when CL > 1:
// block (head, rank) computes the head's HD rows over K slice `rank` (KS columns); its
// WARPS warps form RS row groups (RT row tiles each) of WK warps, CPW chunks each.
// Prologue: the input RMSNorm (warp n takes token n: the whole row from L2 for the sum of
// squares, in a fixed order; then the block's slice of bf16(x * rstd * w) into shared
// memory, which the mma B fragments read). Then the warps' sums are added in warp order;
// the other blocks of the cluster store theirs into rank 0's shared memory (`part`,
// distributed shared memory), rank 0 adds them in rank order and runs the epilogue:
// global scale, bf16, per-head RMSNorm (Q, K heads), rotate-half RoPE, the q store and
// the KV-cache write.
#define HD __HD__        // head dim D: TT = HD / 16 row tiles per head
#define RS __RS__        // row groups: the block's warps split the head's rows RS ways
#define WK (WARPS / RS)  // warps per row group, each CPW chunks of the K slice
#define TT (RT * RS)     // row tiles per head (RT: per warp)
#define HQ __HQ__        // query heads
#define HKV __HKV__      // KV heads
#define CL __CL__        // blocks per head (a cluster), each a K slice
#define KS (KC * 64 / CL)  // K columns per block
#define XST (KS + 8)     // row stride of the normed x slice in shared memory (+16 bytes:
                         // the 8 rows of a B fragment then hit distinct banks)
#define ROPE __ROPE__
#define NORM_BF16 __NORMBF__  // bit 0: norm, bit 1: q_norm, bit 2: k_norm bf16 (else fp32)
#define SLOT64 __SLOT64__     // slots int64 (else int32)
#define ROUTER __ROUTER__     // 1: flintc::norm_router (HQ row blocks of a bf16 router, HKV 0):
                              // fp32 logits out, the normed x out; no head norm / RoPE / cache
#define UPL ((KC * 8 + 31) / 32)  // 16-byte x vectors per lane per row (RMSNorm sums)
#define RED_BYTES (WARPS * RT * 4 * 32 * 4)
#define XS_BYTES (8 * XST * 2)
#define A_BYTES (RED_BYTES > XS_BYTES ? RED_BYTES : XS_BYTES)
#define YH_OFF A_BYTES                    // yh: fp32 [8][HD]
#define PART_OFF (YH_OFF + 8 * HD * 4)    // part: fp32 [CL - 1][TT][4][32]
#define SMEM_BYTES (PART_OFF + (CL - 1) * TT * 4 * 32 * 4)  // = qkv_smem_bytes()
#define HALF_PER_LANE ((HD / 2 + 31) / 32)  // epilogue: (d, d + HD / 2) pairs per lane

__device__ __forceinline__ int ld_act_s32(const int* p) {
  int v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
#if BF16W
#define XT0 8   // lane t's first x column in a chunk: 8t (second: 32 + 8t)
#define X1 32
typedef ChunkB QChunk;
#else
#define XT0 16  // lane t's x columns in a chunk: 16t .. 16t + 15 (the mma layout's order)
#define X1 8
typedef Chunk QChunk;
#endif

__device__ __forceinline__ float bf16_round(float v) { return from_bf16(to_bf16(v)); }
// loads of constants (norm weights, RoPE tables) issued where they stand: volatile, so
// the compiler does not sink them to their use in the epilogue
__device__ __forceinline__ float ld_const_f32(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float norm_w_early(const void* p, int i, int bf16) {
  return bf16 ? from_bf16(ld_u16<false>(static_cast<const u16*>(p) + i))
              : ld_const_f32(static_cast<const float*>(p) + i);
}
// token n's position, its slot (kv: a K / V head) and this lane's RoPE table entries
// (rope), cos / sin of columns d = lane + 32 i < HD / 2 (0 elsewhere)
__device__ __forceinline__ void load_token(int n, const long long* pos, const void* slots,
                                           const float* cos_t, const float* sin_t, bool kv,
                                           bool rope, int lane, long long& p, long long& slot,
                                           float (&cs)[HALF_PER_LANE],
                                           float (&sn)[HALF_PER_LANE]) {
  p = (long long)ld_act_u64(pos + n);
  if (kv)
    slot = SLOT64 ? (long long)ld_act_u64(static_cast<const long long*>(slots) + n)
                  : (long long)ld_act_s32(static_cast<const int*>(slots) + n);
#pragma unroll
  for (int i = 0; i < HALF_PER_LANE; ++i) {
    const int d = lane + 32 * i;
    const bool use = rope && d < HD / 2;
    cs[i] = use ? ld_const_f32(cos_t + p * (HD / 2) + d) : 0.f;
    sn[i] = use ? ld_const_f32(sin_t + p * (HD / 2) + d) : 0.f;
  }
}

#if CL > 1
// a store into block `rank`'s shared memory at the address of p in this block's (DSMEM)
__device__ __forceinline__ void st_cluster_f32(float* p, unsigned rank, float v) {
  unsigned a, b;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
               : "=r"(a) : "l"(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(b) : "r"(a), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(b), "f"(v) : "memory");
}
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32)
nvfp4_mma_qkv(const uint4* __restrict__ qw, const u16* __restrict__ qs,
              const float* __restrict__ qg, const uint4* __restrict__ kw,
              const u16* __restrict__ ks, const float* __restrict__ kg,
              const uint4* __restrict__ vw, const u16* __restrict__ vs,
              const float* __restrict__ vg, const u16* x, const void* __restrict__ norm,
              const void* __restrict__ q_norm, const void* __restrict__ k_norm,
              const float* __restrict__ cos_t, const float* __restrict__ sin_t,
              u16* k_cache, u16* v_cache, const void* slots, const long long* pos,
              void* __restrict__ q_out, u16* __restrict__ x_out, double eps_d, int N, int S,
              int window) {
  extern __shared__ __align__(16) unsigned char smem[];
  u16* xs = reinterpret_cast<u16*>(smem);           // [8][XST] normed x slice (main loop)
  float* red = reinterpret_cast<float*>(smem);      // [WARPS][RT][4][32] (after it)
  float* yh = reinterpret_cast<float*>(smem + YH_OFF);  // [8][HD] the head's outputs
  float* part = reinterpret_cast<float*>(smem + PART_OFF);  // [CL - 1][TT][4][32]: ranks
                                                            // 1.. push their sums to rank 0
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int head = blockIdx.x;
  const int rank = blockIdx.y;  // the block's rank in its (1, CL, 1) cluster
  const float eps = (float)eps_d;
#if CL > 1
  // phase 1 of the cluster barrier: this block has started (its shared memory may be
  // written by the others once they have waited for this phase)
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
  const uint4* w;
  const u16* s;
  const float* gs;
  int hl;
  if (head < HQ) { w = qw; s = qs; gs = qg; hl = head; }
  else if (head < HQ + HKV) { w = kw; s = ks; gs = kg; hl = head - HQ; }
  else { w = vw; s = vs; gs = vg; hl = head - HQ - HKV; }
  const int rg = warp / WK;                   // the warp's row group (RT row tiles)
  const int cl0 = (warp % WK) * CPW;          // the warp's first chunk in the slice
  const int c0 = rank * (KC / CL) + cl0;      // ... in the row
  QChunk buf[PF + 1];
#if BF16W
  const uint4* wp = w + (size_t)(hl * HD + rg * RT * 16 + g) * (KC * 8) + c0 * 8 + t;
#pragma unroll
  for (int c = 0; c < PF && c < CPW; ++c) load_wb<true>(buf[c], wp, c);  // weights only
#else
  const uint4* wp = w + ((size_t)(hl * TT + rg * RT) * KC + c0) * 32 + lane;
  const u16* sp = s + ((size_t)(hl * TT + rg * RT) * KC + c0) * 32 + lane;
#pragma unroll
  for (int c = 0; c < PF && c < CPW; ++c) load_w<true>(buf[c], wp, sp, c);  // weights only
#endif
#if !ROUTER
  // the epilogue's constants (rank 0): global scale, head-norm weights of this lane's d
  const bool qk = head < HQ + HKV;
  const void* hn = head < HQ ? q_norm : k_norm;
  const int hbf = head < HQ ? (NORM_BF16 >> 1) & 1 : (NORM_BF16 >> 2) & 1;
  float out_scale = 0.f, nlo[HALF_PER_LANE], nhi[HALF_PER_LANE];
  if (rank == 0) {
#if BF16W
    out_scale = 1.f;
#else  // the global scale x 256 (exact: undoes the decode's 2^-8)
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(out_scale) : "l"(gs) : "memory");
    out_scale *= 256.0f;
#endif
#pragma unroll
    for (int i = 0; i < HALF_PER_LANE; ++i) {
      const int d = lane + 32 * i;
      nlo[i] = qk && d < HD / 2 ? norm_w_early(hn, d, hbf) : 0.f;
      nhi[i] = qk && d < HD / 2 ? norm_w_early(hn, d + HD / 2, hbf) : 0.f;
    }
  }
#endif
#if PDL
  if (N > 0) asm volatile("griddepcontrol.wait;" ::: "memory");  // x, slots, positions
#endif
#if !ROUTER
  // rank 0, warp n < N: token n's position, slot and RoPE table rows, loaded now (they
  // arrive during the main loop); a warp with more tokens (N > WARPS) loads the rest later
  long long p0 = 0, slot0 = -1;
  float cs0[HALF_PER_LANE], sn0[HALF_PER_LANE];
  if (rank == 0 && warp < N)
    load_token(warp, pos, slots, cos_t, sin_t, head >= HQ, ROPE && qk, lane, p0, slot0, cs0, sn0);
#endif
  // input RMSNorm, as flintc.model.ops.rms_norm: bf16(x * rstd * w), rstd in fp32
  for (int n = warp; n < N; n += WARPS) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)n * (KC * 64));
    uint4 v[UPL];
#pragma unroll
    for (int i = 0; i < UPL; ++i)
      if (lane + 32 * i < KC * 8) v[i] = ld_act(xr + lane + 32 * i);
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < UPL; ++i) {
      if (lane + 32 * i >= KC * 8) continue;
      const u32 e[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float f = from_bf16((u16)(e[j >> 1] >> (16 * (j & 1))));
        ss = __fadd_rn(ss, __fmul_rn(f, f));
      }
    }
    const float r = rms_rstd(warp_sum(ss), (float)(KC * 64), eps);
#pragma unroll
    for (int i = 0; i < UPL; ++i) {
      const int u = lane + 32 * i - rank * (KS / 8);  // 16-byte vector index in the slice
      if (u < 0 || u >= KS / 8) continue;
      const int k = (rank * (KS / 8) + u) * 8;
      const u32 e[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
      u32 o[4];
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const float a = from_bf16((u16)(e[j >> 1] & 0xFFFFu));
        const float b = from_bf16((u16)(e[j >> 1] >> 16));
        const u16 ya = to_bf16(__fmul_rn(__fmul_rn(a, r), norm_w(norm, k + j, NORM_BF16 & 1)));
        const u16 yb = to_bf16(__fmul_rn(__fmul_rn(b, r), norm_w(norm, k + j + 1, NORM_BF16 & 1)));
        o[j >> 1] = (u32)ya | ((u32)yb << 16);
      }
      *reinterpret_cast<uint4*>(xs + n * XST + u * 8) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  __syncthreads();
#if PDL && TRIG_EARLY
  asm volatile("griddepcontrol.launch_dependents;");  // x is read and normed
#endif
#if ROUTER  // the first row block's blocks store the normed x, each its K slice
  if (head == 0)
    for (int i = threadIdx.x; i < N * (KS / 8); i += WARPS * 32) {
      const int n = i / (KS / 8), u = i % (KS / 8);
      reinterpret_cast<uint4*>(x_out + (size_t)n * (KC * 64) + rank * KS)[u] =
          *reinterpret_cast<const uint4*>(xs + n * XST + u * 8);
    }
#endif
  // B fragment column n = g: rows g >= N read row N - 1, their outputs are not stored
  const u16* xsp = xs + min(g, N - 1) * XST + cl0 * 64 + XT0 * t;
  float acc[RT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r) { acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f; }
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    QChunk& ch = buf[c % (PF + 1)];
    ch.x0 = *reinterpret_cast<const uint4*>(xsp + 64 * c);
    ch.x1 = *reinterpret_cast<const uint4*>(xsp + 64 * c + X1);
#if BF16W
    if (c + PF < CPW) load_wb(buf[(c + PF) % (PF + 1)], wp, c + PF);
    mma_chunk_b(ch, acc);
#else
    if (c + PF < CPW) load_w(buf[(c + PF) % (PF + 1)], wp, sp, c + PF);
    mma_chunk(ch, acc);
#endif
  }
#if PDL && !TRIG_EARLY
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  __syncthreads();  // every warp is done with xs: red takes its place
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < 4; ++j) red[((warp * RT + r) * 4 + j) * 32 + lane] = acc[r][j];
  __syncthreads();
#if CL > 1
  // phase 1 done: every block of the cluster has started
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
  // warp w sums the head's row tiles T = w, w + WARPS, ... over the WK warps of T's row
  // group (in warp order): rank 0 into SUM(T) (the slot of the group's first warp, which
  // only this thread reads), the other ranks into rank 0's part[rank - 1] (DSMEM)
#define SUM(T, j) red[((((T) / RT) * WK * RT + (T) % RT) * 4 + (j)) * 32 + lane]
  for (int T = warp; T < TT; T += WARPS)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v = 0.f;
#pragma unroll
      for (int w2 = 0; w2 < WK; ++w2)
        v += red[((((T / RT) * WK + w2) * RT + T % RT) * 4 + j) * 32 + lane];
#if CL > 1
      if (rank != 0) st_cluster_f32(part + (((rank - 1) * TT + T) * 4 + j) * 32 + lane, 0, v);
      else
#endif
      SUM(T, j) = v;
    }
#if CL > 1
  // phase 2: the pushes are visible to rank 0 after its wait; the other blocks are done
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  if (rank != 0) return;
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  for (int T = warp; T < TT; T += WARPS)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v = SUM(T, j);
#pragma unroll
      for (int q = 1; q < CL; ++q) v += part[(((q - 1) * TT + T) * 4 + j) * 32 + lane];
      SUM(T, j) = v;  // rank order
    }
#endif
#if ROUTER  // logits, fp32, never rounded
  for (int T = warp; T < TT; T += WARPS)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = 2 * t + (j & 1);
      if (n < N)
        static_cast<float*>(q_out)[(size_t)n * (HQ * HD) + head * HD + T * 16 + g + (j >> 1) * 8] =
            SUM(T, j);
    }
#else
  for (int T = warp; T < TT; T += WARPS)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = 2 * t + (j & 1);
      if (n < N)  // q / k / v rounded after the GEMV
        yh[n * HD + T * 16 + g + (j >> 1) * 8] = bf16_round(SUM(T, j) * out_scale);
    }
  __syncthreads();
  for (int n = warp; n < N; n += WARPS) {
    const float* y = yh + n * HD;
    long long p = p0, slot = slot0;
    float cs[HALF_PER_LANE], sn[HALF_PER_LANE];
#pragma unroll
    for (int i = 0; i < HALF_PER_LANE; ++i) { cs[i] = cs0[i]; sn[i] = sn0[i]; }
    if (n != warp)  // N > WARPS: this token's values were not loaded in the prologue
      load_token(n, pos, slots, cos_t, sin_t, head >= HQ, ROPE && qk, lane, p, slot, cs, sn);
    float rn = 1.f;
    if (qk) {  // per-head RMSNorm over D (fp32, one rounding)
      float ss = 0.f;
      for (int d = lane; d < HD; d += 32) ss = __fadd_rn(ss, __fmul_rn(y[d], y[d]));
      rn = rms_rstd(warp_sum(ss), (float)HD, eps);
    }
    u16* dst = nullptr;
    if (head < HQ) {
      dst = static_cast<u16*>(q_out) + ((size_t)n * HQ + head) * HD;
    } else {  // KV-cache write (flintc.ops.attention.write_kv, T = 1)
      const long long row = window > 0 ? p % window : p;
      if (slot >= 0 && row >= 0 && row < S)  // a negative slot: a padding row
        dst = (head < HQ + HKV ? k_cache : v_cache) +
              (((size_t)slot * S + row) * HKV + (head - HQ) % HKV) * HD;
    }
#pragma unroll
    for (int i = 0; i < HALF_PER_LANE; ++i) {
      const int d = lane + 32 * i;
      if (d >= HD / 2) continue;
      float lo = y[d], hi = y[d + HD / 2];
      if (qk) {
        lo = bf16_round(__fmul_rn(__fmul_rn(lo, rn), nlo[i]));
        hi = bf16_round(__fmul_rn(__fmul_rn(hi, rn), nhi[i]));
#if ROPE  // rotate-half RoPE (flintc.model.ops.apply_rope): fp32, one rounding, no FMA
        const float rlo = __fsub_rn(__fmul_rn(lo, cs[i]), __fmul_rn(hi, sn[i]));
        const float rhi = __fadd_rn(__fmul_rn(hi, cs[i]), __fmul_rn(lo, sn[i]));
        lo = bf16_round(rlo);
        hi = bf16_round(rhi);
#endif
      }
      if (dst) { dst[d] = to_bf16(lo); dst[d + HD / 2] = to_bf16(hi); }
    }
  }
#endif
}
"""


_KERNELS: dict[tuple, object] = {}  # compiled variants, by (device index, _kernel's arguments)


def _kernel(row_tiles: int, k: int, splits: int, prefetch: int, warps: int, epilogue: int,
            pdl: bool, moe_top_k: int = 0, experts: int = 0, bf16: bool = False,
            trigger_early: bool = False, min_blocks: int = 0, block_route: bool = True,
            l2_prefetch: bool = False, early_epilogue: bool = False, *,
            device: torch.device):
    """The compiled variant for `device` (NVRTC through `torch.cuda._compile_kernel`, about
    a second the first time; cached for the process per device)."""
    args = (row_tiles, k, splits, prefetch, warps, epilogue, bool(pdl), moe_top_k, experts,
            bool(bf16), bool(trigger_early), int(min_blocks), bool(block_route),
            bool(l2_prefetch), bool(early_epilogue))
    name = ("nvfp4_mma_moe_gate_up" if experts else "nvfp4_mma_moe_down") if moe_top_k \
        else "nvfp4_mma_gemv"
    return _compiled(name, args, lambda: kernel_source(*args), device)


def _compiled(name: str, args: tuple, source, device: torch.device, smem: int = 0):
    """Kernel `name` of `source()` compiled for `device`, cached by (device, name, args).
    `smem`: dynamic shared memory bytes it is launched with (above 48 KiB the kernel is
    allowed it once, cuFuncSetAttribute)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, name, *args)
    kernel = _KERNELS.get(key)
    if kernel is None:
        compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
        if compile_kernel is None:
            raise RuntimeError("nvfp4_mma needs torch.cuda._compile_kernel (torch >= 2.8 "
                               f"with CUDA); this torch is {torch.__version__}")
        with torch.cuda.device(index):
            kernel = compile_kernel(source(), name)
            if smem > 48 * 1024:
                lib = torch.cuda._utils._get_gpu_runtime_library()
                err = lib.cuFuncSetAttribute(kernel.func, _MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
                if err != 0:
                    raise RuntimeError(f"nvfp4_mma: {name} cannot use {smem} bytes of shared "
                                       f"memory on cuda:{index} (CUDA error {err})")
        _KERNELS[key] = kernel
    return kernel


def kernel_source(row_tiles: int, k: int, splits: int, prefetch: int, warps: int,
                  epilogue: int = EPI_FP32, pdl: bool = False, moe_top_k: int = 0,
                  experts: int = 0, bf16: bool = False, trigger_early: bool = False,
                  min_blocks: int = 0, block_route: bool = True,
                  l2_prefetch: bool = False, early_epilogue: bool = False) -> str:
    """The CUDA source of one kernel variant (every argument is compiled in): the GEMV
    (`nvfp4_mma_gemv`); with moe_top_k > 0 the MoE down kernel (`nvfp4_mma_moe_down`,
    row_tiles 1, k the expert width, splits the warps per work item, each a K / splits
    slice), or with experts > 0 too the MoE gate/up kernel (`nvfp4_mma_moe_gate_up`,
    row_tiles 2 x the block's 16-row tiles of gate and up, k = H, splits 1). `bf16`: row-major bf16 weights instead of
    the NVFP4 mma layout. `trigger_early` (with `pdl`): each block's
    `griddepcontrol.launch_dependents` right after its first weight and activation loads
    are issued instead of after its main loop (`mma_trigger_early`). `min_blocks` > 0 (the
    gate/up kernel): `__launch_bounds__(warps * 32, min_blocks)`, so ptxas caps the
    registers for that many resident blocks per SM (spilling if it must). `block_route` (the
    gate/up kernel): every warp of a routed block takes a share of the top-k
    (`route_slot_block`), else warp 0 alone (`gate_up_route`); the other kernels take only
    the default. `l2_prefetch`: each warp
    prefetches the chunks of its slice past the first `prefetch` into L2 once their
    address is known (`mma_l2_prefetch`). `early_epilogue` (the GEMV with the residual
    epilogue, the MoE down kernel): the epilogue's inputs from earlier kernels load early
    (`mma_early_epilogue`). Raises ValueError for
    sizes below 1, k not a multiple of 64, an MoE variant over `STATIC_SMEM`,
    down-kernel splits that do not divide k / 64, or a parameter of another kernel
    (experts without moe_top_k, gate/up splits other than 1, block_route False outside
    the gate/up kernel, min_blocks outside it, early_epilogue on another kernel or
    epilogue) so that no two argument sets name one kernel."""
    if min(row_tiles, splits, warps) < 1 or prefetch < 0 or k < 64 or k % 64:
        raise ValueError(f"kernel_source: needs row_tiles, splits, warps >= 1, prefetch >= 0 "
                         f"and k a multiple of 64; got {row_tiles}, {splits}, {warps}, "
                         f"{prefetch}, k = {k}")
    if moe_top_k and moe_smem_bytes(experts, warps, row_tiles // 2 if experts else splits,
                                    moe_top_k) > STATIC_SMEM:
        raise ValueError(f"kernel_source: this MoE variant needs more than {STATIC_SMEM} bytes "
                         "of static shared memory (`moe_smem_bytes`)")
    chunks = k // 64
    if moe_top_k and not experts and chunks % splits:
        raise ValueError(f"kernel_source: the MoE down kernel's {splits} K slices per item "
                         f"must divide its {chunks} chunks of 64")
    subs = {"__RT__": row_tiles, "__KC__": chunks, "__CPW__": chunks // (warps * splits),
            "__PF__": prefetch, "__WARPS__": warps, "__EPI__": epilogue, "__PDL__": int(pdl),
            "__KTOP__": moe_top_k, "__NE__": experts, "__BF16W__": int(bf16),
            "__KSPLIT__": splits, "__TRIG__": int(bool(trigger_early)),
            "__BLOCK_ROUTE__": int(bool(block_route)), "__L2PF__": int(bool(l2_prefetch)),
            "__EARLY_EPI__": int(bool(early_epilogue))}
    gate_up = bool(moe_top_k and experts)
    if experts and not moe_top_k or gate_up and splits != 1 or not block_route and not gate_up:
        raise ValueError(f"kernel_source: experts and block_route are for the MoE gate/up kernel "
                         f"(moe_top_k and experts > 0, splits 1); got moe_top_k {moe_top_k}, "
                         f"experts {experts}, splits {splits}, block_route {block_route}")
    if min_blocks < 0 or (min_blocks and not experts) or min_blocks * warps * 32 > 2048:
        raise ValueError(f"kernel_source: min_blocks is for the MoE gate/up kernel, >= 0, with "
                         f"min_blocks x warps x 32 <= 2048; got {min_blocks} (warps {warps})")
    if early_epilogue and (gate_up or epilogue != EPI_RESIDUAL):
        raise ValueError("kernel_source: early_epilogue is for the GEMV with the residual "
                         "epilogue and the MoE down kernel")
    body = (_GATE_UP_COMMON + _MOE_GATE_UP_SOURCE if experts else _MOE_DOWN_SOURCE) \
        if moe_top_k else _GEMV_SOURCE
    body = body.replace("__MINB__", f", {min_blocks}" if min_blocks else "")
    return _render(body, subs)


def _render(body: str, subs: dict) -> str:
    """`_COMMON` + body with the compile-time constants `subs` and the decode expressions
    (`_DECODE_EXPR`, `_SEL_G`, `_SEL_G8`, `_SCALE_ADD`) pasted in."""
    src = _COMMON + body
    subs = {"__L2PF__": 0, "__EARLY_EPI__": 0, **subs}
    for key, value in subs.items():
        src = src.replace(key, str(int(value)))
    for r, expr in enumerate(_DECODE_EXPR):
        src = src.replace(f"__DEC{r}__", f"({expr})")
    return (src.replace("__SEL_G8__", f"0x{_SEL_G8:04X}u").replace("__SEL_G__", f"0x{_SEL_G:04X}u")
            .replace("__SCALE_ADD__", f"0x{_SCALE_ADD:08X}u"))


def qkv_source(h: int, d: int, heads: int, kv_heads: int, cluster: int, warps: int,
               prefetch: int = 1, pdl: bool = False, rope: bool = True, norm_bf16: int = 0,
               slot64: bool = True, bf16: bool = False, row_groups: int = 1,
               router: bool = False, trigger_early: bool = False) -> str:
    """The CUDA source of one fused QKV variant (`nvfp4_mma_qkv`; every argument compiled
    in): hidden size h (a multiple of 64 * cluster * warps / row_groups), head dim d (a
    multiple of 16 * row_groups), `heads` / `kv_heads` query / KV heads, `cluster` blocks
    per head (each an h / cluster slice of K; a thread-block cluster when > 1), `warps`
    per block in `row_groups` groups (each group d / row_groups rows, its warps K
    slices), `prefetch` chunks loaded ahead, `norm_bf16` bits (1: the input norm, 2:
    q_norm, 4: k_norm are bf16, else fp32), `slot64` (int64 slots, else int32), `bf16`
    (row-major bf16 weights instead of NVFP4 in the mma layout); `router`: the
    `flintc::norm_router` variant (`mma_norm_router`: `heads` row blocks of d rows of a
    bf16 router, kv_heads 0; fp32 logits and the normed x out); `trigger_early`: the PDL
    trigger once the normed x is in shared memory, not after the main loop
    (`mma_trigger_early`). Raises ValueError for a split that does not divide h or d."""
    if not _qkv_split_fits(h, d, cluster, warps, row_groups):
        raise ValueError(f"qkv_source: needs h % (64 * cluster * warps / row_groups) == 0, "
                         f"d % (16 * row_groups) == 0 and cluster <= 8; got h={h}, d={d}, "
                         f"cluster={cluster}, warps={warps}, row_groups={row_groups}")
    kc, wk = h // 64, warps // row_groups
    subs = {"__RT__": d // 16 // row_groups, "__KC__": kc, "__CPW__": kc // (cluster * wk),
            "__PF__": prefetch, "__WARPS__": warps, "__EPI__": EPI_BF16, "__PDL__": int(pdl),
            "__HD__": d, "__HQ__": heads, "__HKV__": kv_heads, "__CL__": cluster,
            "__ROPE__": int(rope), "__NORMBF__": norm_bf16, "__SLOT64__": int(slot64),
            "__RS__": row_groups, "__BF16W__": int(bf16), "__ROUTER__": int(router),
            "__TRIG__": int(bool(trigger_early))}
    if router and (not bf16 or kv_heads or rope):
        raise ValueError("qkv_source: the router variant takes bf16 weights, kv_heads 0, no RoPE")
    return _render(_NORM_COMMON + _QKV_SOURCE, subs)


def _qkv_split_fits(h: int, d: int, cluster: int, warps: int, row_groups: int) -> bool:
    """Whether (cluster, warps, row_groups) splits h (64-column chunks over cluster x warps
    / row_groups K slices) and d (16-row tiles over row_groups) exactly."""
    if row_groups < 1 or warps < row_groups or warps % row_groups or not 1 <= cluster <= 8:
        return False
    return h % 64 == 0 and d % (16 * row_groups) == 0 \
        and (h // 64) % (cluster * (warps // row_groups)) == 0


def qkv_smem_bytes(h: int, d: int, cluster: int, warps: int, row_groups: int = 1) -> int:
    """Dynamic shared memory of a `qkv_source` variant: the larger of the normed x slice
    (8 rows of h / cluster + 8 bf16) and the warps' sums (warps x d / (16 row_groups) x
    512 bytes), plus the head's outputs (8 x d fp32) and the other cluster blocks' sums
    (cluster - 1 times d / 16 x 512 bytes)."""
    red = warps * (d // 16 // row_groups) * 512
    xs = 8 * (h // cluster + 8) * 2
    return max(red, xs) + 8 * d * 4 + (cluster - 1) * (d // 16) * 512


# -- launching ------------------------------------------------------------------------

class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic", ctypes.c_int),
                ("cluster", ctypes.c_uint * 3)]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute (cuda.h)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _launch(kernel, grid: tuple[int, int], threads: int, args: list, use_pdl: bool,
            cluster: int = 1, smem: int = 0) -> None:
    """cuLaunchKernelEx of an NVRTC kernel on the current stream of the first tensor
    argument's device (in that device's context); with `use_pdl` the launch
    may overlap the previous kernel (programmatic stream serialization: the kernel's
    `griddepcontrol.wait` then orders its reads). `cluster` > 1: thread-block clusters of
    (1, cluster, 1) blocks; `smem`: dynamic shared memory bytes. Tensors pass as pointers,
    ints as int, floats as double."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    keep, ptrs = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            c = ctypes.c_void_p(a.data_ptr())
        elif isinstance(a, float):
            c = ctypes.c_double(a)
        else:
            c = ctypes.c_int(a)
        keep.append(c)
        ptrs.append(ctypes.cast(ctypes.byref(c), ctypes.c_void_p))
    params = (ctypes.c_void_p * len(ptrs))(*ptrs)
    attrs = (_LaunchAttr * 2)()
    n_attrs = 0
    if use_pdl:
        attrs[n_attrs].id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n_attrs].value.programmatic = 1
        n_attrs += 1
    if cluster > 1:
        attrs[n_attrs].id = _CLUSTER_DIMENSION
        attrs[n_attrs].value.cluster[:] = (1, cluster, 1)
        n_attrs += 1
    cfg = _LaunchConfig()
    cfg.grid[:] = (grid[0], grid[1], 1)
    cfg.block[:] = (threads, 1, 1)
    cfg.shared_mem = smem
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    cfg.stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    cfg.attrs = ctypes.cast(attrs, ctypes.POINTER(_LaunchAttr)) if n_attrs else None
    cfg.num_attrs = n_attrs
    with torch.cuda.device(device):
        err = lib.cuLaunchKernelEx(ctypes.byref(cfg), kernel.func, params, None)
    if err != 0:
        raise RuntimeError(f"nvfp4_mma: cuLaunchKernelEx failed with CUDA error {err}")


def enabled_from_env() -> bool:
    """FLINTC_NVFP4_MMA: "1" or unset (default) uses the CUDA kernels where they apply,
    "0" keeps every NVFP4 decode kernel on Triton (and skips the load-time repack).

    Raises:
        TuningEnvError (a ValueError): any other value.
    """
    value = os.environ.get("FLINTC_NVFP4_MMA", "1").strip() or "1"
    if value not in ("0", "1"):
        from flintc.kernels.tuning import TuningEnvError

        raise TuningEnvError(f"FLINTC_NVFP4_MMA must be 0 or 1, got {value!r}")
    return value == "1"


def available(device: torch.device) -> bool:
    """Whether the CUDA path runs for packed-layout weights on `device`: FLINTC_NVFP4_MMA
    not 0 (`enabled_from_env`, which raises on a bad value) and `supported(device)`."""
    return enabled_from_env() and supported(device)


def supported(device: torch.device) -> bool:
    """Whether the CUDA kernels can run on `device`: a CUDA device of compute capability
    9.0 or newer (`mul.rn.bf16x2`, `griddepcontrol`), torch with
    `torch.cuda._compile_kernel`, and NVRTC able to compile there (`_compiles`, probed
    once). Weights already in the mma layout run on them whenever this holds
    (`refusal_reason` says why not)."""
    return not refusal_reason(device)


def refusal_reason(device: torch.device) -> str:
    """Why weights in the mma layout cannot run on `device`, for the launchers' errors:
    not a CUDA device, one below sm_90, a torch without `torch.cuda._compile_kernel`, or
    NVRTC failing its probe (`_compiles`, whose error it quotes). "" when
    `supported(device)`: the launch's shapes or arguments are then the reason, which the
    caller names. (Converted weights run on the CUDA kernels under TRITON_INTERPRET=1 too:
    Triton's kernels cannot read them, and NVRTC's do not depend on the interpreter.)"""
    if device.type != "cuda":
        return f"the tensors are on {device}, not a CUDA device"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(index)
    if cap < (9, 0):
        return f"cuda:{index} is sm_{cap[0]}{cap[1]}, below sm_90"
    if not _compiles(index):
        return (f"NVRTC cannot compile the CUDA kernels on cuda:{index} "
                f"({_COMPILE_ERRORS.get(index, 'see the first warning')})")
    return ""


def refusal_note(device: torch.device, config=None) -> str:
    """"; here: <reason>" for a launcher's error refusing mma-layout weights: a config
    given (the CUDA kernels take none), else `refusal_reason`; "" when neither (the
    shapes are the reason, which the message names)."""
    why = "a config is given" if config is not None else refusal_reason(device)
    return f"; here: {why}" if why else ""


_PROBE = 'extern "C" __global__ void flintc_probe(int* p) { if (p) *p = 1; }'
_COMPILES: dict[int, bool] = {}
_COMPILE_ERRORS: dict[int, str] = {}  # the probe's failure, for `refusal_reason`


def _compiles(index: int) -> bool:
    """Whether NVRTC compiles and loads a kernel on device `index` (once per process:
    torch's `_compile_kernel` needs the CUDA headers, CUDA_HOME, that pip-only images may
    lack). False, with a warning, sends every NVFP4 kernel to Triton."""
    ok = _COMPILES.get(index)
    if ok is None:
        try:
            with torch.cuda.device(index):
                torch.cuda._compile_kernel(_PROBE, "flintc_probe")
            ok = True
        except Exception as e:  # noqa: BLE001  (any failure: the Triton kernels still work)
            import warnings

            warnings.warn(f"flintc: NVFP4 kernels stay on Triton on cuda:{index}: NVRTC "
                          f"cannot compile the CUDA kernels ({type(e).__name__}: {e})",
                          stacklevel=3)
            ok = False
            _COMPILE_ERRORS[index] = f"{type(e).__name__}: {e}"
        _COMPILES[index] = ok
    return ok


def warps_for(k: int) -> int:
    """Warps per block (each a K slice) for reduction length k: the largest of 16, 14, 8,
    4, 2, 1 dividing k / 64 (measured best at the model's shapes, docs/gpu-runs.md
    session 12: K = 4096 and 2048 with 16, 3584 with 14)."""
    return next(w for w in (16, 14, 8, 4, 2, 1) if (k // 64) % w == 0)


def _check_fmt_n(op: str, table: dict, fmt, n) -> None:
    """ValueError unless `fmt` is a format of the launch `table` and `n` an int batch in
    1..8 (the launch tables' keys), naming `op`."""
    if fmt not in table or type(n) is not int or not 1 <= n <= 8:
        raise ValueError(f"{op}: fmt must be 'nvfp4' or 'bf16' and n an int in 1..8; got {fmt!r}, {n!r}")


def _fmt_n_entry(entry: str, fields: int) -> tuple[tuple[str, int], tuple[int, ...]]:
    """One `fmt:N=v1,v2,...` tuning entry: ((fmt, N), the `fields` ints), fmt "nvfp4" or
    "bf16" (any case), 1 <= N <= 8. Raises ValueError for any other form (the caller
    checks the values' ranges)."""
    key, value = entry.split("=")
    f, nn = key.split(":")
    f, nn = f.strip().lower(), int(nn)
    vals = tuple(int(v) for v in value.split(","))
    if f not in ("nvfp4", "bf16") or not 1 <= nn <= 8 or len(vals) != fields:
        raise ValueError
    return (f, nn), vals


# (warps, prefetch) of the GEMV kernel by (weight format, F, K), where measured better than
# the rule (`warps_for(K)` warps, 2 chunks ahead); FLINTC_MMA_GEMV_LAUNCH overrides it
# (`gemv_launch`).
GEMV_LAUNCH: dict = {}


def gemv_launch(fmt: str, F: int, K: int) -> tuple[int, int]:
    """(warps, prefetch) of the GEMV kernel for an [F, K] weight in format `fmt` (nvfp4 or
    bf16), splits 1: `GEMV_LAUNCH`'s entry, else (`warps_for(K)`, 2); the entries of
    FLINTC_MMA_GEMV_LAUNCH, when set, take precedence: `/`-separated `fmt:FxK=warps,
    prefetch` (e.g. "nvfp4:2048x10240=16,6/nvfp4:2048x4096=16,4"), for tuning runs.

    Raises:
        ValueError: `fmt` other than "nvfp4" or "bf16".
        TuningEnvError (a ValueError): an entry that is not `fmt:FxK=w,p` with fmt nvfp4
            or bf16, F and K positive multiples of 16 and 64, 1 <= w <= 32 dividing K / 64,
            and 0 <= p <= 16.
    """
    if fmt not in ("nvfp4", "bf16"):
        raise ValueError(f"gemv_launch: fmt must be 'nvfp4' or 'bf16'; got {fmt!r}")
    def parse(entry: str) -> tuple:
        key, value = entry.split("=")
        f, shape = key.split(":")
        f = f.strip().lower()
        ff, kk = (int(v) for v in shape.lower().split("x"))
        w, pf = (int(v) for v in value.split(","))
        if f not in ("nvfp4", "bf16") or ff < 16 or ff % 16 or kk < 64 or kk % 64 \
                or not 1 <= w <= 32 or (kk // 64) % w or not 0 <= pf <= 16:
            raise ValueError
        return (f, ff, kk), (w, pf)

    entries = dict(env_entries("FLINTC_MMA_GEMV_LAUNCH", parse,
                                "fmt:FxK=warps,prefetch (fmt nvfp4 or bf16, F % 16 == 0, K % 64 "
                                "== 0, warps 1-32 dividing K / 64, prefetch 0-16)"))
    return entries.get((fmt, F, K), GEMV_LAUNCH.get((fmt, F, K), (warps_for(K), 2)))


def mma_gemv(x: torch.Tensor, wq: torch.Tensor, sq: torch.Tensor, gscale: torch.Tensor,
             out: torch.Tensor, *, row_tiles: int = 1, splits: int = 1,
             prefetch: int | None = None, warps: int | None = None,
             residual: torch.Tensor | None = None, use_pdl: bool = False) -> torch.Tensor:
    """`x @ W^T * global_scale` for decode batches, W NVFP4 in the mma layout, or `x @ W^T`
    for W bf16 (CUDA only).

    Args:
        x: bf16 [N, K], contiguous, N in 1..8.
        wq, sq: `pack_mma_layout` of W [F, K] (K a multiple of 64); or wq the bf16 weight
            [F, K] itself (row-major, contiguous, 16-byte aligned; F % 16 == 0), sq and
            gscale then unused (None).
        gscale: fp32 tensor of one element on x's device: the global scale (read by the
            kernel, so no host sync).
        out: contiguous [N, F]: fp32 (the raw product; with splits > 1 it must hold
            zeros, the split-K blocks add into it atomically) or bf16 (one rounding;
            splits must be 1).
        row_tiles: 16-row tiles per block (F / 16 must be a multiple).
        splits: split-K factor: grid (F / (16 row_tiles), splits).
        prefetch: chunks (64 K) each warp loads ahead of the one it computes (a hint:
            ptxas schedules the loads; the first ones are issued before the PDL wait).
        warps: warps per block, each a K / (warps * splits) slice (a whole number of
            chunks); the block adds the warps' sums in shared memory in warp order.
            None for either: with splits 1 `gemv_launch` for the format and shape, else
            `warps_for(K / splits)` warps and prefetch 2.
        residual: bf16 [N, F] contiguous, only with a bf16 out:
            `out = bf16(residual + bf16(x @ W^T * global_scale))`.
        use_pdl: launch with programmatic dependent launch (the first weights are loaded
            before the kernel's `griddepcontrol.wait`, x and residual after).

    Returns `out`. Raises ValueError for a shape, dtype or split that does not fit;
    RuntimeError without CUDA or torch.cuda._compile_kernel, or when the launch fails.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x: expected a bf16 tensor [N, K], got {type(x).__name__}")
    N, K = x.shape
    bf16 = isinstance(wq, torch.Tensor) and wq.dtype == torch.bfloat16
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or not 1 <= N <= 8 \
            or x.data_ptr() % 16:
        raise ValueError(f"x: expected contiguous, 16-byte aligned bf16 [N <= 8, K], got "
                         f"{x.dtype} {tuple(x.shape)} at offset {x.data_ptr() % 16}")
    if bf16:
        F = wq.shape[0] if wq.dim() == 2 else -1
        FT, KC = F // 16, K // 64
        if wq.dim() != 2 or wq.shape[1] != K or F % 16 or K % 64 or F <= 0 \
                or not wq.is_contiguous() or wq.data_ptr() % 16:
            raise ValueError(f"wq: expected a contiguous, 16-byte aligned bf16 [F, {K}] with "
                             f"F % 16 == 0 and K % 64 == 0, got {tuple(wq.shape)}")
        sq = gscale = wq  # unused by the bf16 kernel
    else:
        FT, KC = wq.shape[0], wq.shape[1]
        F = FT * 16
        if K != KC * 64 or tuple(wq.shape) != (FT, KC, 32, 4) or wq.dtype != torch.int32:
            raise ValueError(f"wq: expected int32 [F/16, K/64, 32, 4] with K = {K}, got "
                             f"{wq.dtype} {tuple(wq.shape)}")
        if tuple(sq.shape) != (FT, KC, 32, 2) or sq.dtype != torch.uint8:
            raise ValueError(f"sq: expected uint8 [{FT}, {KC}, 32, 2], got {sq.dtype} "
                             f"{tuple(sq.shape)}")
        if not isinstance(gscale, torch.Tensor) or gscale.dtype != torch.float32 \
                or gscale.numel() != 1 or gscale.device != x.device:
            raise ValueError(f"gscale: expected an fp32 tensor of one element on {x.device}")
    if tuple(out.shape) != (N, F) or out.dtype not in (torch.float32, torch.bfloat16) \
            or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous fp32 or bf16 [{N}, {F}], got "
                         f"{out.dtype} {tuple(out.shape)}")
    if out.dtype == torch.bfloat16:
        if splits != 1:
            raise ValueError("splits: a bf16 out needs splits == 1")
        epi = EPI_BF16 if residual is None else EPI_RESIDUAL
    else:
        if residual is not None:
            raise ValueError("residual: needs a bf16 out")
        epi = EPI_FP32
    if residual is not None and (residual.dtype != torch.bfloat16 or tuple(residual.shape)
                                 != (N, F) or not residual.is_contiguous()):
        raise ValueError(f"residual: expected contiguous bf16 [{N}, {F}], got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    d_warps, d_prefetch = gemv_launch("bf16" if bf16 else "nvfp4", F, K) if splits == 1 \
        else (warps_for(K // splits), 2)
    warps = warps or d_warps
    prefetch = d_prefetch if prefetch is None else prefetch
    if type(warps) is not int or not 1 <= warps <= 32:
        raise ValueError(f"warps: expected an int in [1, 32] (32 threads each, at most 1024 "
                         f"per block), got {warps!r}")
    if type(prefetch) is not int or not 0 <= prefetch <= 16:
        raise ValueError(f"prefetch: expected an int in [0, 16], got {prefetch!r}")
    if FT % row_tiles or KC % (warps * splits):
        raise ValueError(f"row_tiles={row_tiles}, warps={warps}, splits={splits} do not "
                         f"divide F/16={FT} and K/64={KC}")
    if x.device.type != "cuda":
        raise RuntimeError(f"nvfp4_mma: needs a CUDA device, got {x.device}")
    kernel = _kernel(row_tiles, K, splits, prefetch, warps, epi, bool(use_pdl), bf16=bf16,
                     trigger_early=mma_trigger_early("gemv"),
                     l2_prefetch=mma_l2_prefetch("gemv"),
                     early_epilogue=epi == EPI_RESIDUAL and mma_early_epilogue(
                         "gemv", "bf16" if bf16 else "nvfp4", K, N),
                     device=x.device)
    _launch(kernel, (FT // row_tiles, splits), 32 * warps,
            [wq, sq, gscale, x, residual if residual is not None else x, out, N, F],
            bool(use_pdl))
    return out


def _moe_weight(w, name: str, device: torch.device) -> tuple[bool, tuple, int, int]:
    """(bf16, lead dims, F, K) of one expert weight or stack, checked without repacking:
    `[w]` bf16 [..., F, K] (contiguous and 16-byte aligned: the kernels read it in place in
    16-byte vectors) or NVFP4 `[codes, scales, global_scale]` in either layout, the global
    scale fp32 of the lead dims or []. Raises ValueError naming `name` and what is wrong."""
    if isinstance(w, (list, tuple)) and len(w) == 1 and isinstance(w[0], torch.Tensor):
        t = w[0]
        wrong = [why for bad, why in (
            (t.dtype != torch.bfloat16, f"dtype {t.dtype}"), (t.dim() < 2, "fewer than 2 dims"),
            (not t.is_contiguous(), "not contiguous"),
            (t.data_ptr() % 16 != 0, "not 16-byte aligned"),
            (t.device != device, f"on {t.device}")) if bad]
        if wrong:
            raise ValueError(f"{name}: a bf16 weight must be a contiguous, 16-byte aligned bf16 "
                             f"tensor [..., F, K] on {device}; got {tuple(t.shape)}: "
                             + ", ".join(wrong))
        return True, tuple(t.shape[:-2]), t.shape[-2], t.shape[-1]
    if not (isinstance(w, (list, tuple)) and len(w) == 3
            and all(isinstance(t, torch.Tensor) for t in w)):
        what = f"{type(w).__name__} of {len(w)}" if isinstance(w, (list, tuple)) \
            else type(w).__name__
        raise ValueError(f"{name}: expected a list [w] (bf16) or [codes, scales, "
                         f"global_scale] (NVFP4) of tensors, got {what}")
    codes, _, gs = w
    if codes.dim() < 2 or codes.device != device:
        raise ValueError(f"{name}: NVFP4 codes must be [..., F, K/2] (packed) or [..., F/16, "
                         f"K/64, 32, 4] (mma layout) on {device}; got {tuple(codes.shape)} on "
                         f"{codes.device}")
    lead, F, K = weight_dims(codes)
    if gs.dtype != torch.float32 or gs.device != device or tuple(gs.shape) not in (lead, ()):
        raise ValueError(f"{name}: the global scale must be an fp32 tensor of shape "
                         f"{list(lead)} or [] on {device}; got {gs.dtype} {tuple(gs.shape)} on "
                         f"{gs.device}")
    return False, lead, F, K


def _moe_pointers(w: list, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(wq, sq, global scale) the kernel takes for a weight `_moe_weight` accepted: bf16
    `w` itself three times (sq and the scale are never read: the kernel is compiled
    without them); NVFP4 `mma_operands` (a packed weight is repacked at its first use)."""
    if len(w) == 1:
        return w[0], w[0], w[0]
    wq, sq = mma_operands(w[0], w[1], name)
    return wq, sq, w[2]


STATIC_SMEM = 48 * 1024  # bytes of static __shared__ a kernel may declare


def moe_smem_bytes(experts: int, warps: int, tiles: int, top_k: int) -> int:
    """Static shared memory of an MoE kernel variant (its __shared__ arrays): gate/up
    (experts > 0; tiles = 16-row tiles per block) the warps' fp32 sums, their routing
    candidates (top_k keys each) and the routed expert; down (tiles = K slices per item)
    the slices' fp32 sums of 8 tokens x (top_k + 1) items x 16 rows, the items' scales,
    and the combine's staged inputs (8 tokens' 16 bf16 residual rows and top_k fp32
    routing weights; counted whether the variant stages them or not,
    `mma_early_epilogue`)."""
    if experts:
        return 4 * warps * 2 * tiles * 4 * 32 + 8 * warps * top_k + 4
    return 4 * tiles * 8 * (top_k + 1) * 16 + 4 * 8 * (top_k + 1) + 2 * 8 * 16 + 4 * 8 * top_k


def _check_moe_launch(op: str, warps: int, tiles: int, prefetch: int, tiles_name: str,
                      smem: int) -> None:
    """ValueError unless 1 <= warps <= 32, tiles >= 1, 0 <= prefetch <= 16 (ints, not
    bools) and the static shared memory fits (`STATIC_SMEM`)."""
    for name, v, lo, hi in (("warps", warps, 1, 32), (tiles_name, tiles, 1, None),
                            ("prefetch", prefetch, 0, 16)):
        if type(v) is not int or v < lo or (hi is not None and v > hi):
            raise ValueError(f"{op}: {name} must be an int "
                             f"{f'in [{lo}, {hi}]' if hi is not None else f'>= {lo}'}, got {v!r}")
    if smem > STATIC_SMEM:
        raise ValueError(f"{op}: warps {warps} and {tiles_name} {tiles} need {smem} bytes of "
                         f"shared memory, more than {STATIC_SMEM}")


# The CUDA kernels whose PDL trigger (`griddepcontrol.launch_dependents`) comes right
# after each block's first loads are issued (after its `griddepcontrol.wait`), not after
# its main loop; FLINTC_MMA_TRIGGER overrides it (`mma_trigger_early`). Measured on the
# H200 (docs/gpu-runs.md session 19, runs 3-4): the MoE down kernel alone at N = 8 11.5 ->
# 9.4 us (52 -> 64% of copy), N = 4 6.8 -> 5.8; the NVFP4 forward at b8/1K 3.58 -> 3.49
# ms, other points unchanged. Early for every kernel: BF16 b8/1K 5.84 -> 5.94 ms; for the
# gate/up kernel alone, slower (N = 4 14.5 -> 16.7 us).
MMA_KERNELS = ("gemv", "qkv", "router", "gate_up", "down", "norm_gate_up")
EARLY_TRIGGER: frozenset = frozenset({"down"})


def mma_trigger_early(kernel: str) -> bool:
    """Whether the CUDA `kernel` (one of `MMA_KERNELS`: `mma_gemv`, `mma_qkv`,
    `mma_norm_router`, `moe_topk_gate_up`, `moe_down`, `mma_norm_gate_up`) triggers its
    dependents early:
    FLINTC_MMA_TRIGGER, when set, is a comma-separated list of the kernels that do ("" or
    "none": none; "all": every one); otherwise `EARLY_TRIGGER`. The trigger is a
    scheduling hint: the dependents' `griddepcontrol.wait` still waits for this grid to
    complete and its writes to be visible, so the outputs do not depend on it.

    Raises:
        TuningEnvError (a ValueError): FLINTC_MMA_TRIGGER names something else.
    """
    return kernel in _kernel_set("FLINTC_MMA_TRIGGER", EARLY_TRIGGER, MMA_KERNELS)


def _kernel_set(var: str, default: frozenset, names: tuple) -> frozenset:
    """The kernels listed in the environment variable `var` (a comma-separated list of
    `names`; "all": every one; "" or "none": none), or `default` when it is unset.

    Raises:
        TuningEnvError (a ValueError): `var` names something else.
    """
    text = os.environ.get(var)
    if text is None:
        return default
    got = {t.strip().lower() for t in text.split(",") if t.strip()}
    if got == {"none"}:
        got = set()
    elif "all" in got:
        got = (got - {"all"}) | set(names)
    if not got <= set(names):  # also "none" next to a kernel: contradictory
        from flintc.kernels.tuning import TuningEnvError

        raise TuningEnvError(f"{var} must list kernels among {', '.join(names)} (or be all, "
                             f"or none / empty alone); got {text!r}")
    return frozenset(got)


# The CUDA kernels whose warps prefetch the rest of their weight slices into L2
# (`cp.async.bulk.prefetch.L2`) once the addresses are known: before the PDL wait for
# weights that do not depend on the previous kernel, right after the routing or the ids
# for the routed experts. "down_weights": the MoE gate/up kernel also prefetches its
# share of each selected expert's down weights (when the launcher is given them), which
# the next kernel reads. FLINTC_MMA_L2_PREFETCH overrides it (`mma_l2_prefetch`).
# Session 23 wrote these prefetches; session 25 measured them on the H200 (docs/gpu-runs.md
# runs 1 and 5): all of them slow the MoE gate/up (NVFP4 N = 8 18.6 -> 21.9 us, the model
# b8/1K 3.16 -> 3.36 ms; BF16 b1/1K 2.33 -> 2.46) and the GEMVs gain 1-2% alone, so none
# is on by default.
L2_PREFETCH_KERNELS = ("gemv", "gate_up", "down", "norm_gate_up", "down_weights")
L2_PREFETCH: frozenset = frozenset()


def mma_l2_prefetch(kernel: str) -> bool:
    """Whether the CUDA `kernel` (one of `L2_PREFETCH_KERNELS`) prefetches into L2:
    FLINTC_MMA_L2_PREFETCH, when set, is a comma-separated list of those that do ("" or
    "none": none; "all": every one); otherwise `L2_PREFETCH`. A prefetch changes only when
    bytes arrive, never the results.

    Raises:
        TuningEnvError (a ValueError): FLINTC_MMA_L2_PREFETCH names something else.
    """
    return kernel in _kernel_set("FLINTC_MMA_L2_PREFETCH", L2_PREFETCH, L2_PREFETCH_KERNELS)


# The CUDA kernels whose epilogue inputs from earlier kernels load early (session 40): the
# GEMV's residual right after the PDL wait, with x (in the epilogue each output's load sat
# between the warps' reduction and its store: one L2 round trip per output on the
# critical path, serialised by the stores), the MoE down kernel's residual and routing
# weights staged in shared memory before the block's barrier by the warps that finish
# first (loaded in the combine, after the barrier). The same results, bit for bit.
# FLINTC_MMA_EARLY_EPILOGUE, when set, lists the kernels that do at every shape
# (`mma_early_epilogue`); unset, `early_epilogue_default` decides per shape, from the
# H200 A/B of session 42 (docs/gpu-runs.md; `scripts/gpu_kernel_ab.sh`, 3 rounds, us old
# -> new): the GEMV + residual bf16 O projection 5.8 -> 5.6 / 6.7 -> 6.2 (N = 1 / 8), bf16
# dense down 13.1 -> 12.0 / 14.4 -> 12.9, NVFP4 O projection (K 4096) 3.5 -> 3.4 / 3.7 ->
# 3.5, but NVFP4 dense down (K 10240) 6.6 -> 7.2 / 7.2 -> 7.4; the MoE down kernel bf16
# 5.3 -> 5.1 / 8.2 -> 8.0 / 23.5 -> 23.3 (N = 1 / 2 / 8), NVFP4 3.2 -> 3.0 / 4.2 -> 4.0,
# but 9.5 -> 9.9 at N = 8.
EARLY_EPILOGUE_KERNELS = ("gemv", "down")
EARLY_EPILOGUE_MAX_NVFP4_GEMV_K = 4096
EARLY_EPILOGUE_MAX_NVFP4_DOWN_N = 2


def early_epilogue_default(kernel: str, fmt: str, K: int, N: int) -> bool:
    """Whether the CUDA `kernel` ("gemv": the GEMV with the residual epilogue; "down": the
    MoE down kernel) loads its epilogue's inputs early when FLINTC_MMA_EARLY_EPILOGUE is
    unset, for weights in `fmt` ("bf16" or "nvfp4"), K inputs and N tokens: bf16 always;
    NVFP4 the GEMV at K <= 4096 and the MoE down kernel at N <= 2, the shapes where the
    H200 measured it faster (comment above)."""
    if fmt == "bf16":
        return True
    if kernel == "gemv":
        return K <= EARLY_EPILOGUE_MAX_NVFP4_GEMV_K
    return N <= EARLY_EPILOGUE_MAX_NVFP4_DOWN_N


def mma_early_epilogue(kernel: str, fmt: str | None = None, K: int = 0, N: int = 1) -> bool:
    """Whether the CUDA `kernel` (one of `EARLY_EPILOGUE_KERNELS`) loads its epilogue's
    inputs early: FLINTC_MMA_EARLY_EPILOGUE, when set, is a comma-separated list of those
    that do at every shape ("" or "none": none; "all": every one); unset,
    `early_epilogue_default(kernel, fmt, K, N)` (False without a `fmt`). Changes only when
    the loads are issued, never the results.

    Raises:
        TuningEnvError (a ValueError): FLINTC_MMA_EARLY_EPILOGUE names something else.
    """
    listed = _kernel_set("FLINTC_MMA_EARLY_EPILOGUE", None, EARLY_EPILOGUE_KERNELS)
    if listed is not None:
        return kernel in listed
    return fmt is not None and early_epilogue_default(kernel, fmt, K, N)


# (warps, K slices per item) of the MoE down kernel by weight format, per N (1-8); the
# prefetch depth is DOWN_PREFETCH's (docs/gpu-runs.md session 15); FLINTC_MMA_DOWN_LAUNCH
# overrides both (`down_launch`)
DOWN_LAUNCH = {"nvfp4": {n: (32, 4 if n == 1 else 2 if n <= 3 else 1) for n in range(1, 9)},
               "bf16": {n: (32, 4) for n in range(1, 9)}}
DOWN_PREFETCH = {"nvfp4": 2, "bf16": 2}


def down_launch(fmt: str, n: int) -> tuple[int, int, int]:
    """(warps, K slices per item, prefetch) of the MoE down kernel for weight format `fmt`
    and batch `n`: `DOWN_LAUNCH` and `DOWN_PREFETCH`, with the entries of
    FLINTC_MMA_DOWN_LAUNCH, when set, in their place: `/`-separated
    `fmt:N=warps,splits[,prefetch]` (prefetch `DOWN_PREFETCH`'s when left out; e.g.
    "nvfp4:2=32,4/nvfp4:1=32,4,3"), for tuning runs. The launcher cuts the slices to a
    divisor of I / 64.

    Raises:
        ValueError: `fmt` other than "nvfp4" or "bf16", or `n` not an int in 1..8.
        TuningEnvError (a ValueError): an entry that is not `fmt:N=w,s[,p]` with fmt nvfp4
            or bf16, 1 <= N <= 8, 1 <= w <= 32, 1 <= s <= 64 and 0 <= p <= 16, whose shared
            memory fits at top-k 8 (`moe_smem_bytes`).
    """
    _check_fmt_n("down_launch", DOWN_LAUNCH, fmt, n)

    def parse(entry: str) -> tuple:
        fields = 3 if entry.count(",") == 2 else 2
        key, vals = _fmt_n_entry(entry, fields)
        w, sp, p = vals if fields == 3 else (*vals, DOWN_PREFETCH[key[0]])
        if not 1 <= w <= 32 or not 1 <= sp <= 64 or not 0 <= p <= 16 \
                or moe_smem_bytes(0, w, sp, 8) > STATIC_SMEM:
            raise ValueError
        return key, (w, sp, p)

    entries = dict(env_entries("FLINTC_MMA_DOWN_LAUNCH", parse,
                                "fmt:N=warps,splits[,prefetch] (fmt nvfp4 or bf16, N 1-8, warps "
                                "1-32, splits 1-64 within the static shared memory, prefetch "
                                "0-16)"))
    return entries.get((fmt, n), (*DOWN_LAUNCH[fmt][n], DOWN_PREFETCH[fmt]))


def moe_down(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, down: list,
             shared_down: list, residual: torch.Tensor, *, warps: int | None = None,
             splits: int | None = None, prefetch: int | None = None,
             use_pdl: bool = False) -> torch.Tensor:
    """`flintc::moe_down_combine_residual` on the CUDA mma kernel:
    `bf16(residual + bf16(sum_k w_k * bf16(y_k) + bf16(y_shared)))`, y_k = token n's k-th
    routed expert's down GEMV, y_shared the shared expert's (reference:
    `flintc.ops.grouped.moe_down_combine_residual`; the sum over k in k order, each
    `w_k * y_k` a separate fp32 multiply, as `flintc.kernels.moe`'s Triton kernel).

    Args:
        h: bf16 [N, K + 1, I] contiguous (the shared expert's input last), N <= 8.
        ids: int64 [N, K] contiguous (expert indices < E; not checked on the device).
        weights: fp32 [N, K] contiguous (routing weights).
        down: `[w]` bf16 [E, H, I] (row-major, read in place) or NVFP4 `[codes [E, H,
            I/2], scales [E, H, I/16], global_scale [E] or []]` (either layout).
        shared_down: [H, I] in the same format (global scale []).
        residual: bf16 [N, H] contiguous.
        warps, splits, prefetch: the kernel's warps per block (each takes work units in
            turn: (item, K slice), the items the shared expert and one per (token,
            slot)), K slices per item (dividing I / 64) and chunks loaded ahead; None:
            `down_launch`'s for the format and N (the slices cut to a divisor of I / 64).
        use_pdl: programmatic dependent launch (the shared expert's first weights load
            before `griddepcontrol.wait`; routed experts need the ids).

    Returns bf16 [N, H]. Packed NVFP4 weights are repacked at their first use
    (`packed_weight`), after the checks.
    Raises ValueError for arguments that do not fit (naming them: I % 64, H % 16, N > 8,
    top-k > 16, splits not dividing I / 64, warps outside [1, 32], shared memory over
    `STATIC_SMEM`, formats that differ, a bad dtype / shape / global scale);
    RuntimeError as `mma_gemv`.
    """
    for name, t, dims in (("h", h, 3), ("ids", ids, 2), ("weights", weights, 2),
                          ("residual", residual, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise ValueError(f"moe_down: {name} must be a {dims}-d tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    N, slots, I = h.shape
    K = ids.shape[1]
    bf16, lead, H, I_w = _moe_weight(down, "down", h.device)
    sbf16, slead, sH, sI = _moe_weight(shared_down, "shared_down", h.device)
    if sbf16 != bf16 or slead != () or (sH, sI) != (H, I_w) or len(lead) != 1:
        raise ValueError(f"moe_down: down must be a stack [E, H, I] and shared_down [H, I] in "
                         f"the same format; got {lead + (H, I_w)} ({'bf16' if bf16 else 'nvfp4'}) "
                         f"and {slead + (sH, sI)} ({'bf16' if sbf16 else 'nvfp4'})")
    if not 1 <= N <= 8 or slots != K + 1 or I % 64 or I != I_w or H % 16 or not 1 <= K <= 16:
        raise ValueError(f"moe_down: needs N <= 8, h [N, K + 1, I] with I % 64 == 0 matching "
                         f"the weights, H % 16 == 0, K <= 16; got h {tuple(h.shape)}, K = {K}, "
                         f"weights [{H}, {I_w}]")
    fmt = "bf16" if bf16 else "nvfp4"
    d_warps, d_splits, d_prefetch = down_launch(fmt, N)
    warps = d_warps if warps is None else warps
    splits = math.gcd(d_splits, I // 64) if splits is None else splits
    prefetch = d_prefetch if prefetch is None else prefetch
    _check_moe_launch("moe_down", warps, splits, prefetch, "splits",
                      moe_smem_bytes(0, warps, splits if isinstance(splits, int) else 1, K))
    if (I // 64) % splits:
        raise ValueError(f"moe_down: splits {splits} must divide I / 64 = {I // 64}")
    if tuple(ids.shape) != (N, K) or tuple(weights.shape) != (N, K):
        raise ValueError(f"moe_down: ids and weights must be [{N}, {K}], got "
                         f"{tuple(ids.shape)} and {tuple(weights.shape)}")
    for name, t, dt in (("h", h, torch.bfloat16), ("ids", ids, torch.int64),
                        ("weights", weights, torch.float32), ("residual", residual,
                                                               torch.bfloat16)):
        if t.dtype != dt or not t.is_contiguous() or t.device != h.device:
            raise ValueError(f"moe_down: {name} must be a contiguous {dt} tensor on {h.device}")
    if h.data_ptr() % 16:
        raise ValueError("moe_down: h must be 16-byte aligned (the kernel reads it in 16-byte "
                         "vectors)")
    if tuple(residual.shape) != (N, H):
        raise ValueError(f"moe_down: residual must be [{N}, {H}], got {tuple(residual.shape)}")
    if h.device.type != "cuda":
        raise RuntimeError(f"nvfp4_mma: needs a CUDA device, got {h.device}")
    wq, sq, gs = _moe_pointers(down, "down")
    swq, ssq, sgs = _moe_pointers(shared_down, "shared_down")
    out = torch.empty((N, H), dtype=torch.bfloat16, device=h.device)
    kernel = _kernel(1, I, splits, prefetch, warps, EPI_RESIDUAL, bool(use_pdl), K, bf16=bf16,
                     trigger_early=mma_trigger_early("down"),
                     l2_prefetch=mma_l2_prefetch("down"),
                     early_epilogue=mma_early_epilogue("down", "bf16" if bf16 else "nvfp4", I, N),
                     device=h.device)
    _launch(kernel, (H // 16, 1), 32 * warps,
            [wq, sq, gs, 1 if gs.numel() > 1 else 0, swq, ssq, sgs, h, ids, weights,
             residual, out, N, H], bool(use_pdl))
    return out


# (warps, 16-row tiles per block) of the MoE gate/up kernel by weight format, per N (1-8):
# fewer warps (more blocks per SM) as N grows. Measured on the H200 (docs/gpu-runs.md
# session 15), kernel alone, us: NVFP4 N = 1: 7.5 (w8), 2: 9.3 (w4), 4: 14.1 (w2; 13.7
# with 2 row tiles), 8: 22.7 (w2; 20.8 with w4 and 4 row tiles); bf16 N = 1: 11.5 (w4),
# 2: 17.8 (w2; the bf16 kernel runs at N <= 2 only, `moe.BF16_MMA_N`). In the model's
# step (b8/1K) the 4-row-tile launch was slower (27.6 against 24.5 us per layer), so
# every entry keeps one row tile; N = 3, 5-7 interpolated. NVFP4 N = 8: 4 warps with the
# registers capped for 6 blocks per SM (`GATE_UP_MIN_BLOCKS`; session 20, run 3: the
# forward at b8/1K 3.49 -> 3.40 ms, twice, alternated). Session 22 (every warp routes,
# `route_slot_block`; run 2, kernel alone, us): N = 4 4 warps 12.3, 2 warps 13.5; in the
# model (run 3, alternated twice) b4/1K 2.45 -> 2.43 ms with 4 warps, so NVFP4 N = 4-7 take
# 4 warps (N = 5-7 interpolated). 3 chunks ahead at N = 1 (5.5 against 5.8 us alone) did
# not move the model's b1/1K (1.74 ms both). Session 25: NVFP4 N = 8 alone 18.0 (4 warps)
# -> 17.0 us (2 warps); in the model b8/1K 3.17 -> 3.11 ms (defaults before and after);
# N = 4 with 2 warps 2.41 -> 2.40 (noise), so only N = 8 takes 2 warps.
GATE_UP_LAUNCH = {"nvfp4": {n: (8, 1) if n == 1 else (2, 1) if n == 8 else (4, 1)
                            for n in range(1, 9)},
                  "bf16": {n: (4, 1) if n == 1 else (2, 1) for n in range(1, 9)}}

# Resident blocks per SM the gate/up kernel's registers are capped for (`min_blocks`; 0: no
# cap), by weight format and N. Measured on the H200 (docs/gpu-runs.md session 19, run 6;
# session 20, runs 2-3): 2 warps capped for 12 blocks spill and lose (N = 8 22.8 -> 24.5
# us alone); 4 warps capped for 6 (80 registers) beat the default alone at N = 4 and 8
# (N = 8 23.7 -> 22.7 us) and in the model at N = 8 (b8/1K 3.49 -> 3.40 ms, twice), not
# at N = 4 (b4/1K 2.54 -> 2.57 ms), so only NVFP4 N = 8 was capped. Session 22 (block
# routing; run 5): 4 warps use 76 registers uncapped (6 blocks per SM already), and the cap
# for 6 forces 80 with 16 bytes of spill: N = 8 alone 18.8 -> 18.3 us uncapped, the forward
# at b8/1K 3.23 -> 3.17 ms. No entry is capped now; the knob stays for tuning runs.
GATE_UP_MIN_BLOCKS = {fmt: {n: 0 for n in range(1, 9)} for fmt in ("nvfp4", "bf16")}

# Chunks each warp of the gate/up kernel loads ahead, by weight format and N.
GATE_UP_PREFETCH = {fmt: {n: 2 for n in range(1, 9)} for fmt in ("nvfp4", "bf16")}


def gate_up_launch(fmt: str, n: int) -> tuple[int, int, int, int]:
    """(warps, row_tiles, min_blocks, prefetch) of the gate/up kernel for weight format
    `fmt` and batch `n`: `GATE_UP_LAUNCH`, `GATE_UP_MIN_BLOCKS` and `GATE_UP_PREFETCH`, with
    the entries of FLINTC_MMA_GATE_UP_LAUNCH, when set, in their place: `/`-separated
    `fmt:N=warps,row_tiles,min_blocks[,prefetch]` (prefetch 2 when left out; e.g.
    "nvfp4:8=4,1,6/nvfp4:1=8,1,0,3"), for tuning runs.

    Raises:
        ValueError: `fmt` other than "nvfp4" or "bf16", or `n` not an int in 1..8.
        TuningEnvError (a ValueError): an entry that is not `fmt:N=w,r,b[,p]` with fmt nvfp4
            or bf16, 1 <= N <= 8, 1 <= w <= 32, r >= 1, 0 <= b <= 32 (b x w x 32 <= 2048)
            and 0 <= p <= 8, whose shared memory fits at top-k 8 (`moe_smem_bytes`; what
            depends on H and I, H % (64 w) and I % (16 r), is the launcher's check).
    """
    _check_fmt_n("gate_up_launch", GATE_UP_LAUNCH, fmt, n)
    def parse(entry: str) -> tuple:
        fields = 4 if entry.count(",") == 3 else 3
        key, vals = _fmt_n_entry(entry, fields)
        w, r, b, p = vals if fields == 4 else (*vals, 2)
        if not 1 <= w <= 32 or r < 1 or not 0 <= b <= 32 or b * w * 32 > 2048 \
                or not 0 <= p <= 8 or moe_smem_bytes(1, w, r, 8) > STATIC_SMEM:
            raise ValueError
        return key, (w, r, b, p)

    entries = dict(env_entries("FLINTC_MMA_GATE_UP_LAUNCH", parse,
                                "fmt:N=warps,row_tiles,min_blocks[,prefetch] (fmt nvfp4 or "
                                "bf16, N 1-8, warps 1-32, row_tiles >= 1, min_blocks 0-32 with "
                                "min_blocks x warps x 32 <= 2048, prefetch 0-8, default 2; "
                                "warps x row_tiles within the static shared memory)"))
    return entries.get((fmt, n), (*GATE_UP_LAUNCH[fmt][n], GATE_UP_MIN_BLOCKS[fmt][n],
                                  GATE_UP_PREFETCH[fmt][n]))


# How the gate/up kernel's routed blocks find their expert: "block" (every warp routes a
# share of the experts, then warp 0 merges the warps' top-(k + 1) candidates:
# `route_slot_block`) or "warp" (warp 0 alone, k + 1 rounds over all experts while the
# other warps wait at the barrier; sessions 15-21). FLINTC_MMA_GATE_UP_ROUTE overrides it.
# Measured on the H200 (docs/gpu-runs.md session 22, runs 1 and 3; `bench_moe.py --pdl`,
# kernel alone, us, warp -> block): NVFP4 N = 1 / 2 / 4 / 8 8.2 / 10.1 / 15.2 / 22.6 -> 5.9
# / 8.0 / 13.9 / 18.9; bf16 N = 1 / 2 12.2 / 18.0 -> 9.9 / 17.2; the NVFP4 forward at 1K,
# b1 / b8, 1.83 / 3.36 -> 1.74 / 3.18 ms. Then (run 5) the token's ids and weights moved
# from block (0, 0), where warp 0 routed every token alone before its shared-expert
# GEMV, to the block that routes slot k - 1 in row group 0 (`write_routing`): NVFP4 N = 1
# 5.9 -> 5.4 us alone.
GATE_UP_ROUTE = "block"


def gate_up_route() -> str:
    """"block" or "warp": FLINTC_MMA_GATE_UP_ROUTE when set (case and spaces ignored), else
    (unset or empty) `GATE_UP_ROUTE`. Both give the same experts (the same keys, ties to the lower index).

    Raises:
        TuningEnvError (a ValueError): another value in the variable.
    """
    text = os.environ.get("FLINTC_MMA_GATE_UP_ROUTE")
    if text is None or not text.strip():  # unset or empty, as the other variables
        return GATE_UP_ROUTE
    value = text.strip().lower()
    if value not in ("block", "warp"):
        from flintc.kernels.tuning import TuningEnvError
        raise TuningEnvError(f"FLINTC_MMA_GATE_UP_ROUTE must be 'block' or 'warp', got {text!r}")
    return value


def moe_topk_gate_up(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, gate: list,
                     up: list, shared_gate: list, shared_up: list, top_k: int, scaling: float,
                     *, warps: int | None = None, row_tiles: int | None = None,
                     prefetch: int | None = None, min_blocks: int | None = None,
                     use_pdl: bool = False, down: list | None = None):
    """`flintc::moe_topk_gate_up` on the CUDA mma kernel (reference:
    `flintc.ops.grouped.moe_topk_gate_up`): top-k routing (`flintc.model.ops.select_topk`:
    scores = sigmoid(logits), top-k of scores + bias with ties to the lower index,
    weights = scores / sum * scaling, the sum a pairwise tree over 8 slots as in
    `flintc.kernels.moe`), then each selected and the shared expert's gate and up GEMVs,
    g and u rounded to bf16, `bf16(silu(g) * u)`.

    Args:
        x: bf16 [N, H] contiguous (the normed activations), N <= 8.
        logits: fp32 [N, E] contiguous; bias: fp32 [E].
        gate, up: stacks [E, I, H]: `[w]` bf16 (row-major, read in place) or NVFP4
            `[codes [E, I, H/2], scales [E, I, H/16], global_scale [E] or []]` (either
            layout; the same global-scale shape); shared_gate, shared_up: [I, H] in the
            same format.
        top_k: experts per token (<= 8); scaling: the routing weights' factor.
        warps, row_tiles, prefetch: warps per block (each an H / (64 warps)-chunk slice),
            16-row tiles of the gate and of the up projection per block, chunks loaded
            ahead (at most 16). None: `gate_up_launch`'s for the format and N (the row
            tiles cut to a divisor of I / 16).
        min_blocks: resident blocks per SM the registers are capped for (0: no cap).
            None for any of these: `gate_up_launch` for the format and N (min_blocks
            None with other warps or row tiles than the table's: no cap).
        use_pdl: programmatic dependent launch (the shared expert's first weights load
            before `griddepcontrol.wait`).
        down: the routed experts' down stack [E, H, I] in the same format, which the
            next kernel (`moe_down`) reads: each routed block prefetches its share of
            its expert's down weights into L2 (when `mma_l2_prefetch("down_weights")`);
            None: no prefetch. The outputs do not depend on it.

    Returns (h bf16 [N, top_k + 1, I] (the shared expert last), weights fp32 [N, top_k],
    ids int64 [N, top_k]). Raises ValueError for arguments that do not fit (naming them: E
    % 32, E > 1024, top_k not an int in [1, 8], scaling not a finite number, weights whose
    E or H differ from logits' and x's, H % (64 warps), I % (16 row_tiles), N > 8, warps outside
    [1, 32], shared memory over `STATIC_SMEM`, formats that differ, a bad dtype / shape /
    bias / global scale); RuntimeError as `mma_gemv`. Packed NVFP4 weights are repacked
    at their first use, after the checks.
    """
    for name, t, dims in (("x", x, 2), ("logits", logits, 2), ("bias", bias, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            raise ValueError(f"moe_topk_gate_up: {name} must be a {dims}-d tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    N, H = x.shape
    E = logits.shape[1]
    weights = ((gate, "gate"), (up, "up"), (shared_gate, "shared_gate"), (shared_up, "shared_up"))
    ops = [_moe_weight(w, name, x.device) for w, name in weights]
    bf16, lead, I, H_w = ops[0]
    if any(o[0] != bf16 or o[2:4] != (I, H_w) for o in ops) or ops[1][1] != lead \
            or ops[2][1] != () or ops[3][1] != ():
        raise ValueError("moe_topk_gate_up: gate and up must be stacks [E, I, H], shared_gate "
                         "and shared_up [I, H], all in one format; got "
                         + ", ".join(f"{o[1] + o[2:4]} ({'bf16' if o[0] else 'nvfp4'})"
                                     for o in ops))
    fmt = "bf16" if bf16 else "nvfp4"
    if not 1 <= N <= 8:
        raise ValueError(f"moe_topk_gate_up: needs 1 <= N <= 8, got x {tuple(x.shape)}")
    d_warps, d_rows, d_blocks, d_prefetch = gate_up_launch(fmt, N)
    if min_blocks is None:  # the table's cap belongs to the table's warps and row tiles
        min_blocks = d_blocks if warps in (None, d_warps) and row_tiles in (None, d_rows) else 0
    warps = d_warps if warps is None else warps
    prefetch = d_prefetch if prefetch is None else prefetch
    if type(min_blocks) is not int or not 0 <= min_blocks <= 32 \
            or (isinstance(warps, int) and min_blocks * warps * 32 > 2048):
        raise ValueError(f"moe_topk_gate_up: min_blocks must be an int in [0, 32] with "
                         f"min_blocks x warps x 32 <= 2048 threads per SM, got {min_blocks!r} "
                         f"with warps {warps!r}")
    if type(top_k) is not int or not 1 <= top_k <= 8:
        raise ValueError(f"moe_topk_gate_up: top_k must be an int in [1, 8], got {top_k!r}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) \
            or not math.isfinite(scaling):
        raise ValueError(f"moe_topk_gate_up: scaling must be a finite number, got {scaling!r}")
    row_tiles = math.gcd(d_rows, max(I // 16, 1)) if row_tiles is None else row_tiles
    _check_moe_launch("moe_topk_gate_up", warps, row_tiles, prefetch, "row_tiles",
                      moe_smem_bytes(E, warps if type(warps) is int else 1,
                                     row_tiles if type(row_tiles) is int else 1, top_k))
    if lead != (E,) or H != H_w:
        raise ValueError(f"moe_topk_gate_up: the weights do not match the inputs: gate / up "
                         f"{lead + (I, H_w)} must be [E, I, H] with E = {E} (logits "
                         f"{tuple(logits.shape)}) and H = {H} (x {tuple(x.shape)})")
    if E % 32 or not 32 <= E <= 1024 \
            or H % (64 * warps) or I % (16 * row_tiles):
        raise ValueError(f"moe_topk_gate_up: needs E % 32 == 0 and 32 <= E <= 1024, "
                         f"H % {64 * warps} == 0, I % {16 * row_tiles} == 0; got x "
                         f"{tuple(x.shape)}, logits {tuple(logits.shape)}, gate "
                         f"{lead + (I, H_w)}, top_k {top_k}")
    for name, t, dt in (("x", x, torch.bfloat16), ("logits", logits, torch.float32),
                        ("bias", bias, torch.float32)):
        if t.dtype != dt or not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"moe_topk_gate_up: {name} must be a contiguous {dt} tensor on "
                             f"{x.device}")
    if x.data_ptr() % 16:
        raise ValueError("moe_topk_gate_up: x must be 16-byte aligned (the kernel reads it in "
                         "16-byte vectors)")
    if tuple(bias.shape) != (E,) or logits.shape[0] != N:
        raise ValueError(f"moe_topk_gate_up: logits must be [{N}, E] and bias [E]; got logits "
                         f"{tuple(logits.shape)}, bias {tuple(bias.shape)}")
    if not bf16 and gate[2].shape != up[2].shape:
        raise ValueError("moe_topk_gate_up: gate and up need global scales of one shape")
    if down is not None:
        d_bf16, d_lead, d_h, d_i = _moe_weight(down, "down", x.device)
        if (d_bf16, d_lead, d_h, d_i) != (bf16, (E,), H, I):
            raise ValueError(f"moe_topk_gate_up: down must be the routed experts' down stack "
                             f"[{E}, {H}, {I}] ({fmt}); got {d_lead + (d_h, d_i)} "
                             f"({'bf16' if d_bf16 else 'nvfp4'})")
    if x.device.type != "cuda":
        raise RuntimeError(f"nvfp4_mma: needs a CUDA device, got {x.device}")
    (gwq, gsq, ggs), (uwq, usq, ugs), (sgwq, sgsq, sggs), (suwq, susq, sugs) = (
        _moe_pointers(w, name) for w, name in weights)
    h = torch.empty((N, top_k + 1, I), dtype=torch.bfloat16, device=x.device)
    wts = torch.empty((N, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((N, top_k), dtype=torch.int64, device=x.device)
    d_args = [x, x, 0, 0]  # no down weights to prefetch
    if down is not None and mma_l2_prefetch("down_weights"):
        dwq, dsq, _ = _moe_pointers(down, "down")
        wb, sb = dwq[0].numel() * dwq.element_size(), dsq[0].numel() * dsq.element_size()
        if wb < 2 ** 31:  # the kernel takes int byte counts
            d_args = [dwq, dsq, wb, 0 if bf16 else sb]
    kernel = _kernel(2 * row_tiles, H, 1, prefetch, warps, EPI_BF16, bool(use_pdl), top_k, E,
                     bf16=bf16, trigger_early=mma_trigger_early("gate_up"),
                     min_blocks=min_blocks, block_route=gate_up_route() == "block",
                     l2_prefetch=mma_l2_prefetch("gate_up"), device=x.device)
    _launch(kernel, (I // (16 * row_tiles), 1 + N * top_k), 32 * warps,
            [gwq, gsq, ggs, uwq, usq, ugs, 1 if not bf16 and ggs.numel() > 1 else 0,
             sgwq, sgsq, sggs, suwq, susq, sugs, x, logits, bias,
             float(scaling), h, wts, ids, N, I, *d_args], bool(use_pdl))
    return h, wts, ids


# (cluster, warps, row_groups) candidates of the fused QKV kernel, best first, per weight
# format (`qkv_launch_config`; measured at the model's shapes, docs/gpu-runs.md session 14)
QKV_LAUNCH_ORDER = {
    "nvfp4": ((4, 8, 1), (8, 4, 1), (2, 16, 1), (2, 8, 1), (1, 16, 1), (4, 4, 1), (2, 4, 1),
              (1, 8, 1), (1, 4, 1), (1, 2, 1), (1, 1, 1)),
    "bf16": ((4, 8, 4), (4, 4, 2), (2, 8, 4), (2, 16, 8), (2, 8, 2), (1, 8, 2), (1, 4, 1),
             (1, 2, 1), (1, 1, 1)),
}


def qkv_launch_config(h: int, d: int = 128, fmt: str = "nvfp4") -> tuple[int, int, int]:
    """(cluster, warps, row_groups) of the fused QKV kernel for hidden size h and head
    dim d: the first of `QKV_LAUNCH_ORDER[fmt]` ("nvfp4" or "bf16") whose split fits
    (cluster x warps / row_groups divides h / 64, 16 row_groups divides d). Raises
    ValueError when h % 64 != 0 or d % 16 != 0."""
    if h % 64 or h <= 0 or d % 16 or d <= 0:
        raise ValueError(f"qkv_launch_config: hidden size must be a positive multiple of 64 "
                         f"and head dim of 16, got {h} and {d}")
    return next((c, w, r) for c, w, r in QKV_LAUNCH_ORDER[fmt]
                if _qkv_split_fits(h, d, c, w, r))


MAX_SMEM = 232448  # bytes of shared memory a block may use on sm_90 (227 KiB)


def qkv_applies(h: int, d: int, fmt: str = "nvfp4") -> bool:
    """Whether the fused QKV kernel takes hidden size h and head dim d with weights of
    `fmt` ("nvfp4" or "bf16"): h % 64 == 0, d a multiple of 16 up to 256, and the shared
    memory of its `qkv_launch_config` within `MAX_SMEM`. (Registers per lane grow with
    d and h: the accumulators d / 4 over the row groups, the prologue's x row h / 256
    16-byte vectors; the model's shapes do not spill.)"""
    if not (h > 0 and h % 64 == 0 and 16 <= d <= 256 and d % 16 == 0):
        return False
    cl, w, r = qkv_launch_config(h, d, fmt)
    return qkv_smem_bytes(h, d, cl, w, r) <= MAX_SMEM


def mma_qkv(x: torch.Tensor, norm: torch.Tensor, wq: list, wk: list, wv: list,
            q_norm: torch.Tensor, k_norm: torch.Tensor, cos_table: torch.Tensor,
            sin_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            slots: torch.Tensor, positions: torch.Tensor, eps: float, num_heads: int,
            num_kv_heads: int, rope: bool, window: int, q: torch.Tensor, *,
            cluster: int | None = None, warps: int | None = None, row_groups: int = 1,
            prefetch: int = 1, use_pdl: bool = False) -> torch.Tensor:
    """`flintc::norm_qkv_rope_kv` for NVFP4 or bf16 weights on the CUDA mma kernel (reference:
    `flintc.ops.grouped.norm_qkv_rope_kv`; the launcher with the argument checks is
    `flintc.kernels.fused_gemv.norm_qkv_rope_kv`): input RMSNorm, the Q / K / V GEMVs,
    per-head Q / K RMSNorm, rotate-half RoPE, the KV-cache write; q written to `q`.

    One block per (head, K slice): grid (Hq + 2 Hkv, cluster), the `cluster` blocks of a
    head a thread-block cluster that adds its partial sums through distributed shared
    memory (no split-K workspace, no atomics); the head's first block runs the epilogue.

    Args:
        x: bf16 [N, H] contiguous, 16-byte aligned, N <= 8 (the un-normed hidden state).
        norm: fp32/bf16 [H]; q_norm, k_norm: fp32/bf16 [D] (contiguous).
        wq, wk, wv: NVFP4 `[codes, scales, global_scale]` of [Hq D, H], [Hkv D, H],
            [Hkv D, H], in the mma layout or packed (repacked once, `packed_weight`); or
            `[weight]` bf16 [F, H] contiguous, 16-byte aligned, read in place (all three
            one format).
        cos_table, sin_table: fp32 [P, D/2] contiguous.
        k_cache, v_cache: bf16 [num_slots, S, Hkv, D] contiguous; row positions[n] (or
            positions[n] % window when window > 0) of slot slots[n] is written; nothing
            for a negative slot or a row outside [0, S).
        slots: int32/int64 [N]; positions: int64 [N, 1] contiguous.
        eps: RMSNorm epsilon; num_heads, num_kv_heads: Hq, Hkv; rope: apply RoPE.
        q: bf16 [N, 1, Hq, D] contiguous, written.
        cluster, warps, row_groups: blocks per head, warps per block and the warps' row
            groups (None: `qkv_launch_config`); prefetch: 64-column chunks each warp
            loads ahead.
        use_pdl: programmatic dependent launch (weights load before the wait).

    Returns q. Numerics: the reference's rounding points with IEEE division and square
    root and no FMA contraction; only the summation orders differ (the GEMV's: exact
    products summed in fp32 by the tensor cores; the RMSNorm sums of squares: a fixed
    per-lane then butterfly order). Raises ValueError for shapes or dtypes the kernel
    does not take; RuntimeError without CUDA or when the launch fails.
    """
    def bad(name: str, what: str, t=None):
        got = (f", got {t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor)
               else f", got {type(t).__name__}" if t is not None else "")
        raise ValueError(f"mma_qkv: {name} must be {what}{got}")

    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        bad("x", "a bf16 tensor [N, H]", x)
    N, H = x.shape
    dev = x.device
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.data_ptr() % 16 \
            or not 1 <= N <= 8:
        bad("x", "a contiguous, 16-byte aligned bf16 tensor [N <= 8, H]", x)
    if not (isinstance(num_heads, int) and isinstance(num_kv_heads, int)
            and num_heads >= 1 and num_kv_heads >= 1):
        bad("num_heads / num_kv_heads", f"ints >= 1 (got {num_heads!r}, {num_kv_heads!r})")
    ws = (("wq", wq), ("wk", wk), ("wv", wv))
    for name, w in ws:
        if not isinstance(w, (list, tuple)) or len(w) not in (1, 3) \
                or not all(isinstance(t, torch.Tensor) and t.device == dev for t in w):
            bad(name, f"a list [weight] (bf16) or [codes, scales, global_scale] (NVFP4) of "
                      f"tensors on {dev}")
    bf16 = len(wq) == 1
    if any((len(w) == 1) != bf16 for _, w in ws):
        bad("wq / wk / wv", "all bf16 ([weight]) or all NVFP4 ([codes, scales, global_scale])")
    if bf16:
        for name, w in ws:
            t = w[0]
            if t.dtype != torch.bfloat16 or t.dim() != 2 or not t.is_contiguous() \
                    or t.data_ptr() % 16:
                bad(name, "a contiguous, 16-byte aligned bf16 tensor [F, H] (as wq)", t)
        dims = [(w[0].shape[0], w[0].shape[1]) for _, w in ws]
    else:
        for name, w in ws:
            if w[2].dtype != torch.float32 or w[2].numel() != 1:
                bad(f"{name}[2] (global scale)", "an fp32 tensor of one element", w[2])
            if w[0].dim() not in (2, 4):
                bad(f"{name}[0] (codes)", "NVFP4 codes, packed [F, H/2] or mma layout "
                    "[F/16, H/64, 32, 4]", w[0])
        dims = [weight_dims(w[0])[1:] for _, w in ws]
    FQ = dims[0][0]
    D = FQ // num_heads
    fmt = "bf16" if bf16 else "nvfp4"
    if not qkv_applies(H, D, fmt) or dims != [(num_heads * D, H), (num_kv_heads * D, H),
                                               (num_kv_heads * D, H)]:
        bad("wq / wk / wv", f"[Hq D, H], [Hkv D, H], [Hkv D, H] with H % 64 == 0, D % 16 == 0, "
            f"D <= 256 (Hq = {num_heads}, Hkv = {num_kv_heads}; got {dims})")
    bf16_bits = 0
    for bit, (name, t, n) in enumerate((("norm", norm, H), ("q_norm", q_norm, D),
                                        ("k_norm", k_norm, D))):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.bfloat16) \
                or tuple(t.shape) != (n,) or not t.is_contiguous() or t.device != dev:
            bad(name, f"a contiguous fp32 or bf16 tensor [{n}] on {dev}", t)
        bf16_bits |= (t.dtype == torch.bfloat16) << bit
    for name, t in (("cos_table", cos_table), ("sin_table", sin_table)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2 \
                or t.shape[1] != D // 2 or not t.is_contiguous() or t.device != dev:
            bad(name, f"a contiguous fp32 tensor [P, {D // 2}] on {dev}", t)
    if tuple(sin_table.shape) != tuple(cos_table.shape):
        bad("sin_table", f"the shape of cos_table {tuple(cos_table.shape)}", sin_table)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 4 \
                or tuple(t.shape[2:]) != (num_kv_heads, D) or not t.is_contiguous() \
                or t.device != dev:
            bad(name, f"a contiguous bf16 tensor [num_slots, S, {num_kv_heads}, {D}] on {dev}", t)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        bad("v_cache", f"the shape of k_cache {tuple(k_cache.shape)}", v_cache)
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) \
            or tuple(slots.shape) != (N,) or not slots.is_contiguous() or slots.device != dev:
        bad("slots", f"a contiguous int32/int64 tensor [{N}] on {dev}", slots)
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 \
            or tuple(positions.shape) != (N, 1) or not positions.is_contiguous() \
            or positions.device != dev:
        bad("positions", f"a contiguous int64 tensor [{N}, 1] on {dev}", positions)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 \
            or tuple(q.shape) != (N, 1, num_heads, D) or not q.is_contiguous() or q.device != dev:
        bad("q", f"a contiguous bf16 tensor [{N}, 1, {num_heads}, {D}] on {dev}", q)
    if not isinstance(window, int) or not 0 <= window <= k_cache.shape[1]:
        bad("window", f"an int in [0, S = {k_cache.shape[1]}] (got {window!r})")
    if (cluster is None) != (warps is None):
        bad("cluster / warps", "both given or both None")
    if cluster is not None:
        if not _qkv_split_fits(H, D, cluster, warps, row_groups):
            bad("cluster / warps / row_groups", f"a split of H = {H} and D = {D} (H / 64 chunks "
                "over cluster x warps / row_groups K slices, D / 16 row tiles over row_groups, "
                f"cluster <= 8; got {cluster}, {warps}, {row_groups})")
        if qkv_smem_bytes(H, D, cluster, warps, row_groups) > MAX_SMEM:
            bad("cluster / warps / row_groups", f"a launch within {MAX_SMEM} bytes of shared "
                "memory")
    if x.device.type != "cuda":
        raise RuntimeError(f"nvfp4_mma: needs a CUDA device, got {x.device}")
    if cluster is None or warps is None:
        cluster, warps, row_groups = qkv_launch_config(H, D, "bf16" if bf16 else "nvfp4")
    if bf16:  # the weight for the unused scale / global-scale pointers
        wargs = [t for w in (wq, wk, wv) for t in (w[0], w[0], w[0])]
    else:
        ops = [mma_operands(w[0], w[1], name) for w, name in ((wq, "wq"), (wk, "wk"), (wv, "wv"))]
        wargs = [t for o, w in zip(ops, (wq, wk, wv)) for t in (o[0], o[1], w[2])]
    args = (H, D, num_heads, num_kv_heads, cluster, warps, prefetch, bool(use_pdl), bool(rope),
            bf16_bits, slots.dtype == torch.int64, bf16, row_groups, False,
            mma_trigger_early("qkv"))
    smem = qkv_smem_bytes(H, D, cluster, warps, row_groups)
    kernel = _compiled("nvfp4_mma_qkv", args, lambda: qkv_source(*args), x.device, smem)
    _launch(kernel, (num_heads + 2 * num_kv_heads, cluster), 32 * warps,
            [*wargs, x, norm, q_norm, k_norm, cos_table, sin_table, k_cache, v_cache, slots,
             positions, q, q, float(eps), N, k_cache.shape[1], int(window)],
            bool(use_pdl), cluster=cluster, smem=smem)
    return q


# (rows per block, cluster, warps, row_groups) of the router kernel, best first
ROUTER_LAUNCH_ORDER = ((16, 8, 4, 1), (16, 4, 8, 1), (16, 4, 4, 1), (16, 2, 8, 1),
                       (16, 2, 4, 1), (16, 1, 4, 1), (16, 1, 2, 1), (16, 1, 1, 1))


def router_launch_config(h: int, e: int) -> tuple[int, int, int, int] | None:
    """(rows per block, cluster, warps, row_groups) of `mma_norm_router` for hidden size h
    and e experts: the first of `ROUTER_LAUNCH_ORDER` that divides them; None when none
    does (h % 64 or e % 16 not 0)."""
    if h <= 0 or e <= 0 or h % 64:
        return None
    return next(((d, c, w, r) for d, c, w, r in ROUTER_LAUNCH_ORDER
                 if _router_launch_fits(h, e, (d, c, w, r))), None)


def _router_launch_fits(h: int, e: int, launch) -> bool:
    """Whether (rows per block d, cluster c, warps w, row_groups r) splits h and e exactly
    and its shared memory fits (`MAX_SMEM`)."""
    d, c, w, r = launch
    return (d > 0 and e % d == 0 and _qkv_split_fits(h, d, c, w, r)
            and qkv_smem_bytes(h, d, c, w, r) <= MAX_SMEM)


def mma_norm_router(x: torch.Tensor, norm: torch.Tensor, router: torch.Tensor, eps: float,
                    *, launch: tuple[int, int, int, int] | None = None,
                    use_pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`flintc::norm_router` (kernel 5 of the MoE layer; reference
    `flintc.ops.grouped.norm_router`, launcher with the argument checks
    `flintc.kernels.moe.norm_router`) on the CUDA mma kernel: the fused QKV kernel's
    RMSNorm prologue and bf16 mma GEMV (`qkv_source(router=True)`), the router's rows in
    blocks of 16, each split over K in a thread-block cluster; the first row block's
    blocks also store the normed x.

    Args:
        x: bf16 [N, H] contiguous, 16-byte aligned, N <= 8; norm: fp32/bf16 [H].
        router: bf16 [E, H] contiguous, 16-byte aligned. eps: the RMSNorm epsilon.
        launch: (rows per block, cluster, warps, row_groups); None: `router_launch_config`.
        use_pdl: programmatic dependent launch (the router rows load before the wait).

    Returns (normed x bf16 [N, H] = bf16(x * rstd * norm) as the reference; logits fp32
    [N, E] = normed x @ router^T, exact products summed in fp32 by the tensor cores, not
    rounded). Raises ValueError for shapes it does not take (`router_launch_config`
    None, N > 8); RuntimeError without CUDA or when the launch fails.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"mma_norm_router: x must be a bf16 tensor [N, H], got "
                         f"{tuple(getattr(x, 'shape', ()))}")
    N, H = x.shape
    E = router.shape[0] if router.dim() == 2 else -1
    if launch is not None and (len(launch) != 4 or not _router_launch_fits(H, E, launch)):
        raise ValueError(f"mma_norm_router: launch {launch} does not split H = {H} and E = {E} "
                         "exactly (rows per block d: E % d == 0 and d % (16 row_groups) == 0; "
                         "cluster x warps / row_groups dividing H / 64) or needs more than "
                         f"{MAX_SMEM} bytes of shared memory")
    cfg = launch or router_launch_config(H, E)
    if cfg is None or not 1 <= N <= 8 or router.dim() != 2 or router.shape[1] != H \
            or router.dtype != torch.bfloat16 or not router.is_contiguous() \
            or router.data_ptr() % 16 or router.device != x.device or norm.device != x.device:
        raise ValueError(f"mma_norm_router: needs N <= 8, H % 64 == 0, E % 16 == 0 and a "
                         f"contiguous 16-byte aligned bf16 router [E, H] on x's device; got x "
                         f"{tuple(x.shape)}, router {router.dtype} {tuple(router.shape)}")
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.data_ptr() % 16:
        raise ValueError("mma_norm_router: x must be a contiguous, 16-byte aligned bf16 tensor")
    if norm.dtype not in (torch.float32, torch.bfloat16) or tuple(norm.shape) != (H,) \
            or not norm.is_contiguous():
        raise ValueError(f"mma_norm_router: norm must be a contiguous fp32 or bf16 tensor [{H}]")
    if x.device.type != "cuda":
        raise RuntimeError(f"nvfp4_mma: needs a CUDA device, got {x.device}")
    d, cluster, warps, row_groups = cfg
    h = torch.empty((N, H), dtype=torch.bfloat16, device=x.device)
    logits = torch.empty((N, E), dtype=torch.float32, device=x.device)
    args = (H, d, E // d, 0, cluster, warps, 1, bool(use_pdl), False,
            int(norm.dtype == torch.bfloat16), True, True, row_groups, True,
            mma_trigger_early("router"))
    smem = qkv_smem_bytes(H, d, cluster, warps, row_groups)
    kernel = _compiled("nvfp4_mma_qkv", args, lambda: qkv_source(*args), x.device, smem)
    _launch(kernel, (E // d, cluster), 32 * warps,
            [router, router, router, router, router, router, router, router, router,
             x, norm, norm, norm, norm, norm, x, x, x, x, logits, h, float(eps), N, 1, 0],
            bool(use_pdl), cluster=cluster, smem=smem)
    return h, logits


# -- dense MLP: RMSNorm + gate/up + SiLU-and-mul ----------------------------------------

def norm_gate_up_source(h: int, warps: int, row_tiles: int, prefetch: int, pdl: bool = False,
                        bf16: bool = False, norm_bf16: bool = False,
                        trigger_early: bool = False, l2_prefetch: bool = False) -> str:
    """The CUDA source of one dense gate/up variant (`nvfp4_mma_norm_gate_up`; every
    argument compiled in): hidden size h (h / 64 a multiple of warps, each warp a slice of
    at least 2 chunks of 64), `row_tiles` 16-row tiles of the gate and of the up
    projection per row group, `prefetch` chunks loaded ahead (0 to the slice's chunks - 1:
    the next group's first chunks load while a group finishes), `bf16` weights
    (row-major) instead of NVFP4 (mma layout), `norm_bf16` (the RMSNorm weight bf16, else
    fp32), `trigger_early` (PDL trigger once the normed x is in shared memory, not after
    the block's last main loop), `l2_prefetch` (before the dependency wait, each warp
    prefetches the rest of its slice of every row group of the block into L2,
    `mma_l2_prefetch`). Raises ValueError for a split or prefetch that does not fit."""
    kc = h // 64 if h % 64 == 0 else 0
    if min(warps, row_tiles) < 1 or kc < 2 * warps or kc % warps \
            or not 0 <= prefetch < kc // warps:
        raise ValueError(f"norm_gate_up_source: needs warps, row_tiles >= 1, h a multiple of "
                         f"64 * warps with at least 2 chunks of 64 per warp, 0 <= prefetch < "
                         f"chunks per warp; got h={h}, warps={warps}, row_tiles={row_tiles}, "
                         f"prefetch={prefetch}")
    subs = {"__RT__": 2 * row_tiles, "__KC__": kc, "__CPW__": kc // warps, "__PF__": prefetch,
            "__WARPS__": warps, "__EPI__": EPI_BF16, "__PDL__": int(pdl),
            "__BF16W__": int(bf16), "__NORMBF__": int(bool(norm_bf16)),
            "__TRIG__": int(bool(trigger_early)), "__L2PF__": int(bool(l2_prefetch))}
    return _render(_NORM_COMMON + _GATE_UP_COMMON + _DENSE_GATE_UP_SOURCE, subs)


def norm_gate_up_smem_bytes(h: int, warps: int, row_tiles: int, n: int) -> int:
    """Dynamic shared memory of a `norm_gate_up_source` variant at n tokens: the warps'
    fp32 sums (warps x 2 row_tiles x 512 bytes) and the normed x (n rows of h + 8 bf16)."""
    return warps * 2 * row_tiles * 512 + n * (h + 8) * 2


# (warps, row_tiles, prefetch, blocks per SM) of the dense gate/up kernel by weight format,
# per N (1-8); blocks per SM 0: one row group per block (grid F / (16 row_tiles)), else a
# grid of that many blocks per SM, each looping over row groups. Measured on the H200 at H
# 2048, F 10240 (docs/gpu-runs.md session 21, runs 1-2 and 6; kernel alone, us): with the
# epilogue spread over all threads (run 6), (4, 2, 2, 0) is the best launch at every
# measured N: 11.3 / 11.6 / 12.1 / 13.6 at N = 1 / 2 / 4 / 8 (the Triton kernel: 22.0 /
# 36.1 / 35.7 / 32.8); N = 3, 5-7 interpolated. bf16 N = 2 / 4: 26.1 / 26.8 with (8, 1, 2,
# 2) (Triton: 31.9 / 33.8).
NORM_GATE_UP_LAUNCH = {
    "nvfp4": {n: (4, 2, 2, 0) for n in range(1, 9)},
    "bf16": {n: (8, 1, 2, 2) for n in range(1, 9)}}
# weight formats whose dense gate/up runs on the CUDA kernel by default (`fused_gemv`;
# FLINTC_MMA_NORM_GATE_UP_FORMATS overrides it, `norm_gate_up_formats`), and the batches
# at which bf16 does (`NORM_GATE_UP_BF16_N`): the Triton kernel is faster at N = 1 (23.4
# against 24.8 us) and 8 (26.0 against 27.4), session 21 run 1
NORM_GATE_UP_FORMATS = frozenset({"nvfp4", "bf16"})
NORM_GATE_UP_BF16_N = frozenset({2, 3, 4})


def norm_gate_up_formats() -> frozenset:
    """The weight formats whose dense gate/up runs on the CUDA kernel (bf16 at the batches
    of `NORM_GATE_UP_BF16_N` only): the comma-separated FLINTC_MMA_NORM_GATE_UP_FORMATS
    when set ("nvfp4", "bf16", both, or "none" / empty: neither, so NVFP4 dense gate and
    up stay packed and on Triton), else `NORM_GATE_UP_FORMATS`.

    Raises:
        TuningEnvError (a ValueError): another name in the variable.
    """
    text = os.environ.get("FLINTC_MMA_NORM_GATE_UP_FORMATS")
    if text is None:
        return NORM_GATE_UP_FORMATS
    names = {t.strip().lower() for t in text.split(",") if t.strip()} - {"none"}
    if not names <= {"nvfp4", "bf16"} or ("none" in text.lower() and names):
        from flintc.kernels.tuning import TuningEnvError

        raise TuningEnvError("FLINTC_MMA_NORM_GATE_UP_FORMATS must list formats among nvfp4, "
                             f"bf16 (or be none / empty); got {text!r}")
    return frozenset(names)


def norm_gate_up_launch(fmt: str, n: int) -> tuple[int, int, int, int]:
    """(warps, row_tiles, prefetch, blocks per SM) of the dense gate/up kernel for weight
    format `fmt` and batch `n`: `NORM_GATE_UP_LAUNCH`, with the entries of
    FLINTC_MMA_NORM_GATE_UP_LAUNCH, when set, in their place: `/`-separated
    `fmt:N=warps,row_tiles,prefetch,blocks` (e.g. "nvfp4:1=4,1,3,0/nvfp4:8=8,2,2,3"), for
    tuning runs.

    Raises:
        ValueError: `fmt` other than "nvfp4" or "bf16", or `n` not an int in 1..8.
        TuningEnvError (a ValueError): an entry that is not `fmt:N=w,r,p,b` with fmt nvfp4
            or bf16, 1 <= N <= 8, 1 <= w <= 32, 1 <= r <= 8, 0 <= p <= 16 and 0 <= b <= 32.
    """
    _check_fmt_n("norm_gate_up_launch", NORM_GATE_UP_LAUNCH, fmt, n)

    def parse(entry: str) -> tuple:
        key, (w, r, pf, b) = _fmt_n_entry(entry, 4)
        if not 1 <= w <= 32 or not 1 <= r <= 8 or not 0 <= pf <= 16 or not 0 <= b <= 32:
            raise ValueError
        return key, (w, r, pf, b)

    entries = dict(env_entries("FLINTC_MMA_NORM_GATE_UP_LAUNCH", parse,
                                "fmt:N=warps,row_tiles,prefetch,blocks (fmt nvfp4 or bf16, N "
                                "1-8, warps 1-32, row_tiles 1-8, prefetch 0-16, blocks per SM "
                                "0-32)"))
    return entries.get((fmt, n), NORM_GATE_UP_LAUNCH[fmt][n])


def norm_gate_up_fits(h: int, f: int, n: int, launch: tuple) -> str:
    """Why the dense gate/up kernel cannot run launch (warps, row_tiles, prefetch, blocks
    per SM) at hidden size h, MLP width f and batch n, or "" when it can: warps in 1..32
    dividing h / 64 with at least 2 chunks of 64 each, prefetch below the chunks per warp,
    row_tiles in 1..8 with f a multiple of 16 row_tiles, and the shared memory for n rows
    (`norm_gate_up_smem_bytes`) at most `MAX_SMEM`."""
    if not isinstance(launch, (tuple, list)) or len(launch) != 4 \
            or any(type(v) is not int for v in launch):
        return f"launch must be 4 ints (warps, row_tiles, prefetch, blocks per SM), got {launch!r}"
    warps, row_tiles, prefetch, per_sm = launch
    kc = h // 64
    if not 1 <= warps <= 32 or h % 64 or kc % warps or kc < 2 * warps:
        return (f"warps {warps} must be in 1..32 and divide H / 64 = {h / 64:g} with at least "
                f"2 chunks of 64 each")
    if not 0 <= prefetch < kc // warps:
        return f"prefetch {prefetch} must be in 0..{kc // warps - 1} (the chunks per warp - 1)"
    if not 1 <= row_tiles <= 8 or f % (16 * row_tiles):
        return f"row_tiles {row_tiles} must be in 1..8 with F = {f} a multiple of 16 row_tiles"
    if per_sm < 0:
        return f"blocks per SM {per_sm} must be >= 0"
    smem = norm_gate_up_smem_bytes(h, warps, row_tiles, n)
    if smem > MAX_SMEM:
        return f"it needs {smem} bytes of shared memory at N = {n}, more than {MAX_SMEM}"
    return ""


def norm_gate_up_applies(h: int, f: int) -> bool:
    """Whether the dense gate/up kernel runs at hidden size h and MLP width f at every
    batch 1-8 with `norm_gate_up_launch("nvfp4", n)` (`norm_gate_up_fits`), and NVFP4 is
    among `norm_gate_up_formats()`. `prepack` converts an NVFP4 dense gate or up weight
    [f, h] to the mma layout only then, so a converted weight always has the CUDA kernel."""
    if "nvfp4" not in norm_gate_up_formats():
        return False
    return all(not norm_gate_up_fits(h, f, n, norm_gate_up_launch("nvfp4", n))
               for n in range(1, 9))


def mma_norm_gate_up(x: torch.Tensor, norm: torch.Tensor, gate: list, up: list, eps: float,
                     *, launch: tuple[int, int, int, int] | None = None,
                     use_pdl: bool = False) -> torch.Tensor:
    """`flintc::norm_gate_up_silu` (kernel 5 of a dense layer; reference
    `flintc.ops.grouped.norm_gate_up_silu`, launcher with the argument checks
    `flintc.kernels.fused_gemv.norm_gate_up_silu`) on the CUDA mma kernel: the
    post-attention RMSNorm in each block's prologue (into shared memory), the gate and up
    GEMVs in one K loop over the same rows, g and u rounded to bf16, `bf16(silu(g) * u)`
    (FLINT_SPEC section 3).

    Args:
        x: bf16 [N, H] contiguous, 16-byte aligned, 1 <= N <= 8 (the residual stream, not
            normed); norm: fp32/bf16 [H] contiguous; eps: the RMSNorm epsilon.
        gate, up: [F, H]: `[w]` bf16 (row-major, contiguous, 16-byte aligned: read in
            place) or NVFP4 `[codes, scales, global_scale []]` in either layout (a packed
            weight is repacked at its first use), both in one format.
        launch: (warps, row_tiles, prefetch, blocks per SM) (`norm_gate_up_launch`); None:
            that function's for the format and N.
        use_pdl: programmatic dependent launch (the first weight chunks load before
            `griddepcontrol.wait`, x after).

    Returns h bf16 [N, F]. Raises ValueError for arguments that do not fit (naming them:
    shapes, dtypes, formats, N outside 1..8, a launch that `norm_gate_up_fits` refuses);
    RuntimeError without CUDA or when the launch fails.
    """
    op = "mma_norm_gate_up"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{op}: x must be a bf16 tensor [N, H], got "
                         f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    N, H = x.shape
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.data_ptr() % 16 \
            or not 1 <= N <= 8:
        raise ValueError(f"{op}: x must be a contiguous, 16-byte aligned bf16 tensor [N <= 8, "
                         f"H]; got {x.dtype} {tuple(x.shape)}")
    g_bf16, g_lead, F, g_k = _moe_weight(gate, "gate", x.device)
    u_bf16, u_lead, u_f, u_k = _moe_weight(up, "up", x.device)
    if (g_bf16, g_lead, F, g_k) != (u_bf16, u_lead, u_f, u_k) or g_lead != () or g_k != H:
        raise ValueError(f"{op}: gate and up must be [F, {H}] in one format; got gate "
                         f"{g_lead + (F, g_k)} ({'bf16' if g_bf16 else 'nvfp4'}), up "
                         f"{u_lead + (u_f, u_k)} ({'bf16' if u_bf16 else 'nvfp4'})")
    if not isinstance(norm, torch.Tensor) or norm.dtype not in (torch.float32, torch.bfloat16) \
            or tuple(norm.shape) != (H,) or not norm.is_contiguous() or norm.device != x.device:
        raise ValueError(f"{op}: norm must be a contiguous fp32 or bf16 tensor [{H}] on "
                         f"{x.device}")
    fmt = "bf16" if g_bf16 else "nvfp4"
    launch = norm_gate_up_launch(fmt, N) if launch is None else launch
    why = norm_gate_up_fits(H, F, N, launch)
    if why:
        raise ValueError(f"{op}: launch {launch!r} does not fit H = {H}, F = {F}, N = {N}: {why}")
    warps, row_tiles, prefetch, per_sm = launch
    if x.device.type != "cuda":
        raise RuntimeError(f"nvfp4_mma: needs a CUDA device, got {x.device}")
    (gwq, gsq, ggs), (uwq, usq, ugs) = _moe_pointers(gate, "gate"), _moe_pointers(up, "up")
    groups = F // (16 * row_tiles)
    if per_sm:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        grid = min(groups, per_sm * sms)
    else:
        grid = groups
    args = (H, warps, row_tiles, prefetch, bool(use_pdl), g_bf16, norm.dtype == torch.bfloat16,
            mma_trigger_early("norm_gate_up"), mma_l2_prefetch("norm_gate_up"))
    kernel = _compiled("nvfp4_mma_norm_gate_up", args, lambda: norm_gate_up_source(*args),
                       x.device, min(MAX_SMEM, norm_gate_up_smem_bytes(H, warps, row_tiles, 8)))
    out = torch.empty((N, F), dtype=torch.bfloat16, device=x.device)
    _launch(kernel, (grid, 1), 32 * warps,
            [gwq, gsq, ggs, uwq, usq, ugs, x, norm, float(eps), out, N, F, groups],
            bool(use_pdl), smem=norm_gate_up_smem_bytes(H, warps, row_tiles, N))
    return out


_PACKED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

# The weights the CUDA kernels read in the decode schedule (canonical names,
# flintc.model.weights): norm_qkv_rope_kv's (Q, K, V projections), norm_gate_up_silu's
# (dense gate and up projections), gemv_residual's (O projection, dense down projection),
# moe_topk_gate_up's and moe_down_combine_residual's
# (stacked routed and shared experts).
QKV_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
DENSE_GATE_UP_SUFFIXES = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
PREPACK_SUFFIXES = QKV_SUFFIXES + DENSE_GATE_UP_SUFFIXES + ("self_attn.o_proj.weight",
                    "mlp.down_proj.weight",
                    "mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight",
                    "mlp.experts.down_proj.weight", "mlp.shared_experts.gate_proj.weight",
                    "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight")


def _key(codes: torch.Tensor, scales: torch.Tensor) -> tuple:
    """Storage, shape, device and in-place version of both tensors: a weight written in
    place gets a new key (and a fresh repack)."""
    return (codes.data_ptr(), scales.data_ptr(), tuple(codes.shape), str(codes.device),
            codes._version, scales._version)


def packed_weight(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mma layout of one NVFP4 weight (codes [F, K/2] or stacked [E, F, K/2], scales
    to match; a stack packs as its E * F rows, expert e's row tiles at e * F / 16).

    Repacked at its first use (weights the runtime converted with `prepack` do not come
    here: `mma_operands`), and cached for as long as `codes` lives (a finalizer drops the entry with the tensor, so unloading a model frees both
    copies). A first use during CUDA-graph capture raises RuntimeError (the callers then
    run their Triton kernel). Extra device memory: the weight's bytes again."""
    key = _key(codes, scales)
    hit = _PACKED.get(key)
    if hit is None:
        if codes.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("nvfp4_mma: a weight was first seen during CUDA-graph capture")
        hit = _PACKED[key] = pack_mma_layout(codes.reshape(-1, codes.shape[-1]),
                                             scales.reshape(-1, scales.shape[-1]))
        weakref.finalize(codes, _PACKED.pop, key, None)
    return hit


def clear() -> None:
    """Drop every repacked weight (their memory returns with the next allocation)."""
    _PACKED.clear()


def _moe_kernels_apply(config) -> bool:
    """Whether the model's MoE decode kernels run on the CUDA kernels for converted experts
    (`flintc.kernels.moe._mma_gate_up_applies` / `_mma_down_applies`, shape part): a shared
    expert, E % 32 == 0 with 32 <= E <= 1024, top-k <= 8, H % 1024 == 0, I % 64 == 0."""
    E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    return (config.n_shared_experts >= 1 and E % 32 == 0 and 32 <= E <= 1024
            and 1 <= config.num_experts_per_tok <= 8 and H % 1024 == 0 and I % 64 == 0)


def prepack(weights: dict, config) -> int:
    """Convert, in place, the NVFP4 weights of `weights` (canonical name -> weight) that
    the CUDA decode kernels read (`PREPACK_SUFFIXES`) to the mma layout, when `available`
    on their device: each entry becomes an `NVFP4Tensor` of int32 codes and uint8 scale
    codes, exactly as many bytes as the packed tensors, which are freed once nothing else
    holds them (one weight at a time: the peak is one weight's size above the model's). Every op that takes these
    weights reads the mma layout: the CUDA decode kernels directly, the prefill GEMMs
    (`flintc.kernels.gemm`, `flintc.kernels.grouped_gemm`) through their mma tile loader,
    the reference ops through `NVFP4Tensor.dequantize`. Call it before anything else
    (a model, a runner) takes references to the weights, or the packed copies stay alive.
    The compiled runtime and `flintc bench` call it for triton builds on CUDA.

    `config` (the model's FlintConfig) decides the MoE weights: they are converted only
    when its MoE decode kernels run on the CUDA kernels (a shared expert, E % 32 == 0 and
    32 <= E <= 1024, top-k <= 8, H % 1024 == 0, I % 64 == 0); the Q, K and V projections
    when the fused QKV kernel takes H and D (`qkv_applies`); the O projection and the
    dense down projection whenever F % 16 == 0 and K % 64 == 0; the dense gate and up
    projections [F, K] when the dense gate/up kernel's launches take K and F at every
    batch (`norm_gate_up_applies`).

    Returns the bytes converted (0 when nothing applies: another device, shapes the
    kernels do not take, FLINTC_NVFP4_MMA=0, TRITON_INTERPRET=1 in this process (the
    launchers then run Triton's kernels, which read only the packed layout), or already
    converted).
    The weights' fingerprints (`flintc.runtime.build.weight_fingerprint`) are kept
    (`NVFP4Tensor.origin`). Raises ValueError, before converting anything, for a
    negative or NaN block scale.
    """
    from flintc.quant.nvfp4 import NVFP4Tensor
    from flintc.runtime.build import fingerprint_parts

    from flintc.kernels.platform import interpreting

    if interpreting():  # every launcher's condition for the CUDA kernels (`refusal_reason`)
        return 0
    moe = _moe_kernels_apply(config)
    qkv = qkv_applies(config.hidden_size, config.head_dim)
    todo = []
    for name in list(weights):
        w = weights[name]
        if not (isinstance(w, NVFP4Tensor) and w.layout == "packed"
                and name.endswith(PREPACK_SUFFIXES)):
            continue
        if (".mlp.experts." in name or ".mlp.shared_experts." in name) and not moe:
            continue
        if name.endswith(QKV_SUFFIXES) and not qkv:
            continue
        _, F, K = weight_dims(w.codes)
        if name.endswith(DENSE_GATE_UP_SUFFIXES) and not norm_gate_up_applies(K, F):
            continue
        if F % 16 or K % 64 or not available(w.codes.device):
            continue
        s = w.scales.to(torch.float32)
        if bool(torch.isnan(s).any()) or bool((s < 0).any()):  # before converting anything
            raise ValueError(f"{name}: block scales must be finite and >= 0 (unsigned E4M3)")
        todo.append(name)
    done = 0
    for name in todo:
        w = weights[name]
        wq, sq = pack_mma_stack(w.codes, w.scales, name)
        done += w.codes.numel() + w.scales.numel()
        weights[name] = NVFP4Tensor(wq, sq, w.global_scale, origin=w.origin or fingerprint_parts(w))
        _PACKED.pop(_key(w.codes, w.scales), None)
        del w
    return done
