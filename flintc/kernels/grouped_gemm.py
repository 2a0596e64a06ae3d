"""Prefill MoE: routing and the routed experts as grouped GEMMs over tokens sorted by
expert; launchers for `flintc::moe_route`, `flintc::moe_gate_up` and
`flintc::moe_down_combine` (references: the op bodies in `flintc/ops/moe.py`, built
from `flintc.model.ops.route_topk` / `expert_matmul` / `silu_mul` / `expert_combine`).

The reference gathers a full expert matrix per (token, k) (~19 GB for 1024 tokens of the
full model). Here the N*K (token, k) slots are sorted by expert (a stable argsort of the
flattened ids), so each expert's weights are read once per tile of its tokens:

* `moe_route`: router GEMM with fp32 accumulation (cuBLAS bf16 GEMM with fp32 output on
  CUDA; the reference expression on CPU), then the selection: on CPU the reference's own
  code (`select_topk`: sigmoid, stable descending sort of `scores + bias` so ties go to
  the lower index, normalised weights times the scaling), bit-identical; on CUDA one
  Triton launch with the same definition (`flintc.kernels.moe.route_topk_rows`: K
  max-reductions over packed keys per token). On CUDA the logits differ from the
  reference's fp32 GEMM only by fp32 reordering and the sigmoid by an ulp, so ids are
  equal except where two of `scores + bias` are within a few fp32 ulps of the k-th place
  (a near-tie), and weights are within a few fp32 ulps.
* `moe_gate_up` / `moe_down_combine`, three implementations (`impl=`):
  - `"triton"`: one Triton grouped GEMM kernel (below). Rows are gathered through index
    arrays (no sorted copy of x), weights are bf16 or NVFP4 decoded in-kernel (W4A16:
    only the experts some token selected are ever read), fp32 accumulation, the
    per-expert global scale on the fp32 accumulator, one rounding. gate/up run in one
    kernel with two accumulators and SiLU-and-mul in the epilogue; down writes each
    expert's bf16 output to its (token, k) slot.
    NVFP4 weights may also come in the mma layout of the CUDA decode kernels (int32
    codes, `flintc.kernels.nvfp4_mma.pack_mma_layout`; the runtime keeps only that
    layout on CUDA): `MMA_LAYOUT` (K order only) loads whole words (8 weights, rows g and
    g + 8 of a 16-row tile) and each lane's two scale codes as one u16, decodes them with
    the CUDA kernels' word decode (inline PTX on the GPU; the same values by shifts under
    the interpreter) into two K-order half tiles (`flintc.kernels.gemm._load_mma_halves`),
    runs one dot per half and puts the rows back in order once per tile, on the
    accumulators. Same exact products and fp32 sums as the packed layout's kernel; being
    another compiled program, the sums may come out in another order (H200, 512 tokens:
    37 of 1.57M gate/up outputs differ by one or two bf16 ulps). At 2K-8K tokens it is
    5-10% faster than the packed layout's (docs/gpu-runs.md session 13).
  - `"grouped_mm"` (bf16 weights only): `torch._grouped_mm` (CUTLASS on sm_90, fp32
    accumulation, bf16 output: one rounding) on the sorted rows; `prefill_ops.silu_mul`.
    NVFP4 cannot use it: grouped_mm only returns bf16 for bf16 inputs (torch <= 2.13), so
    the global scale would meet an already-rounded value (a second rounding).
  - `"loop"`: a Python loop over the experts that have tokens, each a plain fp32 matmul
    (host sync for the counts). The torch fallback for CPUs without grouped_mm / Triton.
  `"auto"` picks triton on CUDA (for bf16 too: 806 us per MoE layer at 512 tokens against
  912 for grouped_mm on the H200, docs/gpu-runs.md session 8 run 3), and on CPU
  grouped_mm for bf16 if torch has it, else loop.
  The shared expert is two / one plain GEMMs (`flintc.kernels.gemm.gemm`) and its SiLU-and-
  mul. The weighted combine with the shared expert is `prefill_ops.expert_combine` on the
  [N, K, H] expert outputs: on the CPU the reference's expression (bit-identical given
  identical expert outputs), on CUDA one Triton kernel summing in slot order (within
  `flintc.kernels.prefill_norm`'s bound: <= 1 bf16 ulp + (K + 1) 2^-23 sum |w_k y_k|).

Rounding points kept (FLINT_SPEC 3): g and u rounded to bf16 before SiLU-and-mul, h
rounded once; each expert's down output rounded to bf16 before the fp32 weighted combine;
the combine rounded once. Differences from the reference come only from the GEMMs'
fp32 summation order (<= 1 bf16 ulp + K * 2^-24 * sum |x_k w_k| per rounded value,
most elements bit-identical), on CUDA from the combine's summation order (above) and, in
the Triton epilogue and SiLU-and-mul, from Triton's sigmoid against torch's (an fp32 ulp,
so h can land one bf16 ulp away at a rounding boundary).

CUDA graphs (the runtime captures the prefill function, `CompiledRunner.prefill_graph`):
no host syncs and no data-dependent allocation in `triton` and `grouped_mm`. The slots
are sorted once per MoE layer: `moe_gate_up` makes an `ExpertPlan` (one stable sort; the
tile table from one `expert_tiles_kernel` launch over cdiv(table size, TILES_BLOCK_T)
programs, each redoing the per-expert searches and writing its own entries; the kernel
computes each slot's row offsets itself) and `moe_down_combine` reuses it when it gets the
h and ids of that call (the tile table has the static size min(cdiv(N*K, BLOCK_M) + E, N*K);
unused tiles return after reading two integers; the grid is (table size, cdiv(F, BLOCK_F)),
from shapes only).
torch's grouped_mm is sync-free only on its CUTLASS path (bf16, sm_90 / sm_100); other
GPUs take its fallback, which copies the offsets to the host, so inside a capture it is
refused there. `loop` syncs (`.tolist()` of the counts); it is the CPU fallback, and inside a
capture `_pick_impl` refuses it with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flintc.kernels import gemm as _gemm_kernels
from flintc.kernels.gemm import (
    MMA_CHUNK,
    MMA_TILE_ROWS,
    _load_mma_halves,
    _load_weight_tile,
    _round_to_bf16,
    mma_unhalve,
)
from flintc.kernels.gemm import gemm as dense_gemm
from flintc.kernels.nvfp4_mma import is_mma_layout
from flintc.kernels.pdl import pdl_mode
from flintc.kernels.platform import grouped_mm_fn, grouped_mm_sync_free, interpreting
from flintc.kernels.prefill_ops import expert_combine, silu_mul
from flintc.kernels.tiles import (
    DEQUANT_UNSCALE,
    dequant_tile,
    dequant_tile_k_order,
    dot_2d,
    dot_tile,
    load_weight_tile,
)
from flintc.model import ops

NVFP4_BLOCK = 16
IMPLS = ("auto", "triton", "grouped_mm", "loop")


def _alloc(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output allocation (torch.empty); a seam for tests, which poison it with NaN."""
    return torch.empty(*shape, dtype=dtype, device=device)


# ---------------------------------------------------------------------------- Triton kernel
@triton.jit
def _mma(acc, a, w, SWAP: tl.constexpr, GPU: tl.constexpr):
    """acc += a [M, K] @ w [F, K]^T (acc [M, F]), or with SWAP acc [F, M] += w @ a^T: the
    weight tile is then the left operand, which Hopper's wgmma may take from registers
    (where the NVFP4 decode leaves it) while the small activation tile goes through
    shared memory. Exact products in bf16 on the GPU; IEEE fp32 in the interpreter."""
    if SWAP:
        return dot_2d(acc, w, a, GPU)
    return dot_2d(acc, a, w, GPU)


@triton.jit
def moe_grouped_gemm_kernel(
    a_ptr,  # bf16 activations: the row of slot (token t, k) starts at t * a_s0 + k * a_s1, K contiguous
    order_ptr,  # int64 [M]: the slot (token * TOPK + k) at each sorted position
    out_ptr,  # bf16 output: the row of slot (t, k) starts at t * o_s0 + k * o_s1, F contiguous
    w_ptr,  # [E, F, K] bf16, or NVFP4 codes uint8 [E, F, K/2] (gate for GATE_UP); MMA_LAYOUT:
    #         int32 [E, F/16, K/64, 32, 4] (`pack_mma_layout` of the [E * F, K] stack)
    w2_ptr,  # up weights, same layout (GATE_UP only)
    s_ptr, s2_ptr,  # NVFP4 block scales float8_e4m3fn [E, F, K/16] (unused for bf16); MMA_LAYOUT:
    #                 ue5m3 scale codes uint8 [E, F/16, K/64, 32, 2]
    g_ptr, g2_ptr,  # NVFP4 global scales fp32 [E] (unused for bf16)
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,  # int32 [NUM_TILES]
    F, K, TOPK, a_s0, a_s1, o_s0, o_s1,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
    IS_NVFP4: tl.constexpr, GATE_UP: tl.constexpr, DOT_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
    K_ORDER: tl.constexpr = True,  # NVFP4: dot in K order (else even / odd halves)
    SWAP: tl.constexpr = False,  # K order only: accumulate [F, M] = W @ a^T (weights on the left)
    MMA_LAYOUT: tl.constexpr = False,  # NVFP4 in the mma layout (needs K_ORDER; K % 64 == 0)
):
    # Program (tile, pid_f): sorted slots [start, end) (all of one expert e, at most
    # BLOCK_M) times output columns [pid_f * BLOCK_F, (pid_f + 1) * BLOCK_F) of expert e.
    # Tiles past the last used one have start == end: they return at once.
    tile = tl.program_id(0)
    pid_f = tl.program_id(1)
    if USE_PDL == 2:  # PDL_EARLY: let the next kernel launch and prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the tile table and activations come from earlier kernels
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:
        return  # an unused entry of the static-size tile table
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end  # rows of the tile past the expert's last slot are padding
    slot = tl.load(order_ptr + offs_m, mask=mask_m, other=0)
    tok = slot // TOPK
    kk = slot - tok * TOPK
    a_off = tok * a_s0 + kk * a_s1
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_f = offs_f < F  # the last F block may stick out past F

    if IS_NVFP4:
        # Row pointers of expert e's [F, K/2] codes and [F, K/16] scales; the tile loader
        # and the inline-asm decode are the decode GEMVs' (`flintc.kernels.tiles`).
        w_rows = w_ptr + e * F * (K // 2) + offs_f.to(tl.int64) * (K // 2)
        w2_rows = w2_ptr + e * F * (K // 2) + offs_f.to(tl.int64) * (K // 2)
        s_rows = s_ptr + e * F * (K // 16) + offs_f.to(tl.int64) * (K // 16)
        s2_rows = s2_ptr + e * F * (K // 16) + offs_f.to(tl.int64) * (K // 16)
        kb = tl.arange(0, BLOCK_K // 16)
        j = tl.arange(0, 8)
        # MMA_LAYOUT: expert e's rows are rows e * F + f of the flat [E * F, K] pack (its
        # 16-row tiles e * F/16 ..); this program's from e * F + pid_f * BLOCK_F
        mma_row0 = e * F + pid_f * BLOCK_F
        mma_row_end = e * F + F
    else:
        w_base = w_ptr + e * F * K
        w2_base = w2_ptr + e * F * K
    if SWAP and not (IS_NVFP4 and not K_ORDER):
        acc = tl.zeros((BLOCK_F, BLOCK_M), dtype=tl.float32)  # transposed: [F, M]
        acc2 = tl.zeros((BLOCK_F, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    # MMA_LAYOUT: one accumulator per row half of the weight tiles (`_load_mma_halves`)
    acc_lo = tl.zeros((BLOCK_M, BLOCK_F // 2), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, BLOCK_F // 2), dtype=tl.float32)
    acc2_lo = tl.zeros((BLOCK_M, BLOCK_F // 2), dtype=tl.float32)
    acc2_hi = tl.zeros((BLOCK_M, BLOCK_F // 2), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if IS_NVFP4 and not K_ORDER:
            # Weights 2j (low nibbles) and 2j + 1 (high nibbles) of each code byte j, as
            # e2m1 * scale * 2^-8 (exact), [BLOCK_F, BLOCK_K/16, 8] each; the activations
            # they meet: columns k0 + 16 kb + 2 j (even) and + 1 (odd), [BLOCK_M, KB, 8].
            ct, st = load_weight_tile(w_rows, s_rows, mask_f, k0, K, BLOCK_K, True)
            w_lo, w_hi = dequant_tile(ct, st, DOT_BF16)
            col = k0 + 16 * kb[:, None] + 2 * j[None, :]  # [KB, 8]
            mask_a = mask_m[:, None, None] & (col < K)[None, :, :]
            a_row = a_ptr + a_off[:, None, None] + col[None, :, :]
            a_even = tl.load(a_row, mask=mask_a, other=0.0)
            a_odd = tl.load(a_row + 1, mask=mask_a, other=0.0)
            acc = dot_tile(acc, a_even, w_lo, BLOCK_M, BLOCK_F, BLOCK_K // 2, DOT_BF16)
            acc = dot_tile(acc, a_odd, w_hi, BLOCK_M, BLOCK_F, BLOCK_K // 2, DOT_BF16)
            if GATE_UP:
                ct2, st2 = load_weight_tile(w2_rows, s2_rows, mask_f, k0, K, BLOCK_K, True)
                u_lo, u_hi = dequant_tile(ct2, st2, DOT_BF16)
                acc2 = dot_tile(acc2, a_even, u_lo, BLOCK_M, BLOCK_F, BLOCK_K // 2, DOT_BF16)
                acc2 = dot_tile(acc2, a_odd, u_hi, BLOCK_M, BLOCK_F, BLOCK_K // 2, DOT_BF16)
        else:
            # One [BLOCK_M, BLOCK_K] activation tile and [BLOCK_F, BLOCK_K] weight tiles in
            # K order; NVFP4 weights decoded and interleaved back into K order (weight 2j,
            # then 2j + 1, of each code byte j).
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_a = mask_m[:, None] & (offs_k < K)[None, :]
            a = tl.load(a_ptr + a_off[:, None] + offs_k[None, :], mask=mask_a, other=0.0)
            if MMA_LAYOUT:
                # e2m1 * scale * 2^-8, exact, as dequant_tile_k_order's; one dot per row half
                w_lo, w_hi = _load_mma_halves(w_ptr, s_ptr, mma_row0, mma_row_end, k0, K,
                                              BLOCK_F, BLOCK_K, 8, DOT_BF16)
                acc_lo = _mma(acc_lo, a, w_lo, False, DOT_BF16)
                acc_hi = _mma(acc_hi, a, w_hi, False, DOT_BF16)
                if GATE_UP:
                    u_lo, u_hi = _load_mma_halves(w2_ptr, s2_ptr, mma_row0, mma_row_end, k0, K,
                                                  BLOCK_F, BLOCK_K, 8, DOT_BF16)
                    acc2_lo = _mma(acc2_lo, a, u_lo, False, DOT_BF16)
                    acc2_hi = _mma(acc2_hi, a, u_hi, False, DOT_BF16)
            else:
                if IS_NVFP4:
                    ct, st = load_weight_tile(w_rows, s_rows, mask_f, k0, K, BLOCK_K, True)
                    wt = dequant_tile_k_order(ct, st, BLOCK_F, BLOCK_K, DOT_BF16)
                else:
                    wt, _ = _load_weight_tile(w_base, s_ptr, offs_f, mask_f, k0, K, BLOCK_K,
                                              False)
                acc = _mma(acc, a, wt, SWAP, DOT_BF16)
                if GATE_UP:
                    if IS_NVFP4:
                        ct2, st2 = load_weight_tile(w2_rows, s2_rows, mask_f, k0, K, BLOCK_K,
                                                    True)
                        wt2 = dequant_tile_k_order(ct2, st2, BLOCK_F, BLOCK_K, DOT_BF16)
                    else:
                        wt2, _ = _load_weight_tile(w2_base, s2_ptr, offs_f, mask_f, k0, K,
                                                   BLOCK_K, False)
                    acc2 = _mma(acc2, a, wt2, SWAP, DOT_BF16)
    if MMA_LAYOUT:  # the rows back in order, once per tile
        acc = mma_unhalve(acc_lo, acc_hi, BLOCK_M, BLOCK_F)
        if GATE_UP:
            acc2 = mma_unhalve(acc2_lo, acc2_hi, BLOCK_M, BLOCK_F)
    if SWAP and not (IS_NVFP4 and not K_ORDER):
        acc = tl.trans(acc)
        acc2 = tl.trans(acc2)
    if USE_PDL == 1:  # PDL_LATE: trigger after the main loop
        tl.extra.cuda.gdc_launch_dependents()  # a scheduling hint: no memory ordering

    if IS_NVFP4:
        # Undo the decode's 2^-8 (exact), then the global scale on the fp32 accumulator.
        acc = acc * DEQUANT_UNSCALE * tl.load(g_ptr + e)
        if GATE_UP:
            acc2 = acc2 * DEQUANT_UNSCALE * tl.load(g2_ptr + e)
    if GATE_UP:
        # g and u are rounded to bf16 (their rounding point), then fp32 silu(g) * u, as
        # `ops.silu_mul`: g * sigmoid(g) * u, rounded once at the store.
        g = _round_to_bf16(acc).to(tl.float32)
        u = _round_to_bf16(acc2).to(tl.float32)
        res = g * tl.sigmoid(g) * u
    else:
        res = acc
    out_off = tok * o_s0 + kk * o_s1
    # mask: real slot rows and real output columns.
    tl.store(out_ptr + out_off[:, None] + offs_f[None, :], _round_to_bf16(res),
             mask=mask_m[:, None] & mask_f[None, :])


class GroupedConfig(NamedTuple):
    """Launch configuration of `moe_grouped_gemm_kernel`: tile sizes, warps, pipeliner
    stages, and for NVFP4 `k_order` (decoded weights interleaved back into K order, one
    dot per step; else two dots over the even / odd halves) and `swap` (K order only:
    the weight tile as the dot's left operand, [F, M] accumulator; on triton 3.6 it
    compiles only with block_f == block_m, see `_choose_blocks`)."""

    block_m: int
    block_f: int
    block_k: int
    num_warps: int
    num_stages: int
    k_order: bool = True
    swap: bool = False


# A GroupedConfig to use instead of `_choose_blocks`'s rule: set by
# `benchmarks/bench_prefill_moe.py --sweep` (None: the rule).
BLOCKS_OVERRIDE: GroupedConfig | None = None


def _choose_blocks(M: int, E: int, F: int, gate_up: bool, is_nvfp4: bool, device):
    """The `GroupedConfig` for one launch, from shapes only (no autotuning at call time).

    Rule, from the H200 sweeps of `benchmarks/bench_prefill_moe.py --sweep` at 512 tokens
    (one prefill chunk) and 2,048 (session 8 runs 1-2, docs/gpu-runs.md). BLOCK_M follows
    the average slots per expert (M / E), from 16 (tl.dot's minimum) up to
    - NVFP4: 32, with BLOCK_F 128 (64 for gate/up at BLOCK_M 16), BLOCK_K 64, weights
      decoded in K order, 4 warps, 2 stages: gate/up 507 us, down 363 at 512 tokens; 994 /
      886 at 2,048 (the previous rule's BLOCK_M 64 even / odd tiles: 2,827 / 1,694).
      K order at BLOCK_M 64 does not compile on triton 3.6 ("Illegal shared layout" in
      TritonGPUOptimizeDotOperands); SWAP there does (gate/up 916 us at 2,048), but only
      where BLOCK_F == BLOCK_M, so the rule leaves it to the sweep.
    - bf16: 64, with BLOCK_F 64, BLOCK_K 128, 4 warps, 3 stages: gate/up 419 us, down 338
      at 512 tokens; 587 / 694 at 2,048 (torch's grouped_mm: 480 / 376 and 647 / 721).
    """
    if BLOCKS_OVERRIDE is not None:
        return BLOCKS_OVERRIDE
    avg = max(1, M // max(E, 1))
    block_m = max(16, triton.next_power_of_2(avg))
    if device.type != "cuda":  # interpreter: few, large programs (each costs ~ms in numpy)
        return GroupedConfig(min(64, block_m), min(128, max(16, triton.next_power_of_2(F))), 128, 4, 1)
    if is_nvfp4:
        block_m = min(32, block_m)
        return GroupedConfig(block_m, 64 if (gate_up and block_m < 32) else 128, 64, 4, 2)
    return GroupedConfig(min(64, block_m), 64, 128, 4, 3)


# ---------------------------------------------------------------------------- sorting
def sort_by_expert(ids: torch.Tensor, num_experts: int):
    """Group the N*K (token, k) slots by expert, sync-free.

    Args:
        ids: int64 [N, K] expert ids in [0, E) (not range-checked: that needs a sync).
        num_experts: E.

    Returns:
        (order int64 [N*K]: slot (= token * K + k) of each sorted position, stable within
        an expert; counts int64 [E]; ends int64 [E]: cumulative counts, expert e's slots
        are sorted positions [ends[e] - counts[e], ends[e])).
    """
    flat = ids.reshape(-1)
    # The narrowest key type that holds the ids: a radix sort takes one pass per key byte,
    # so uint8 keys (E <= 256, as Flint) sort in one pass instead of int64's eight (on an
    # H200, 8 of the ~10 sort launches per MoE layer of a prefill chunk, 2.2 ms of a
    # 1,024-token prefill, docs/benchmarks.md). Same stable order.
    keys = flat.to(torch.uint8 if num_experts <= 256 else
                   torch.int16 if num_experts <= 2**15 else torch.int64)
    order = torch.argsort(keys, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts, torch.cumsum(counts, 0)


def tile_table(counts: torch.Tensor, ends: torch.Tensor, M: int, block_m: int):
    """Per-tile (expert, start, end) over the sorted slots: each expert's slots cut into
    tiles of at most `block_m`. The table has the static size min(cdiv(M, block_m) + E, M)
    (an upper bound on sum_e cdiv(counts[e], block_m)); unused tiles get start == end == 0.
    M = sum(counts) >= 1.
    Returns three int32 [num_tiles] tensors."""
    E = counts.numel()
    num_tiles = min(triton.cdiv(M, block_m) + E, M)  # every used tile holds >= 1 slot
    per = (counts + block_m - 1) // block_m  # tiles of each expert
    tile_cum = torch.cumsum(per, 0)
    t = torch.arange(num_tiles, device=counts.device)
    expert = torch.searchsorted(tile_cum, t, right=True)  # E for unused tiles
    used = expert < E
    ec = expert.clamp(max=E - 1)
    start = ends[ec] - counts[ec] + (t - (tile_cum[ec] - per[ec])) * block_m
    end = torch.minimum(start + block_m, ends[ec])
    start = torch.where(used, start, torch.zeros_like(start))
    end = torch.where(used, end, torch.zeros_like(end))
    return ec.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


# Tile-table entries per `expert_tiles_kernel` program: its [TILES_BLOCK_T, BLOCK_E]
# expert lookup is 8K elements at E = 256 (64 per thread at 4 warps), no more work than
# its searches; a 512-token chunk of the full model (M = 3,072, 448 entries at BLOCK_M 16)
# is 14 programs, one wave.
TILES_BLOCK_T = 32
# Probes per search step and expert in `expert_tiles_kernel`: an 8-ary search needs 4
# dependent load rounds for M = 3,072 where a binary search needs 12, for 8x the loads per
# round (2 * 8 * 256 = 4K gathers at E = 256, 32 per thread, all from the same 24 KB of
# sorted ids, so L1 / L2 hits). Chosen by that count, not yet timed on the GPU.
TILES_FANOUT = 8


def _search_steps(M: int, fanout: int) -> int:
    """Steps of `_upper_bound_step` that narrow any interval of size <= M to size 0."""
    steps = 0
    while M > 0:
        M = triton.cdiv(M, fanout) - 1
        steps += 1
    return steps


@triton.jit
def _upper_bound_step(sorted_ptr, lo, hi, target, R: tl.constexpr):
    """One `R`-ary search step per lane toward the first position p with sorted[p] > target
    (lo, hi, target: int32 [BLOCK_E]; invariant: sorted[< lo] <= target < sorted[>= hi]).
    Probes lo + j * w, j < R, w = cdiv(hi - lo, R); c of them are <= target (a prefix), so
    the answer is lo if c == 0, else in [lo + (c-1) w + 1, min(lo + c w, hi)]: the size
    n goes to <= cdiv(n, R) - 1. Returns the new (lo, hi)."""
    w = (hi - lo + R - 1) // R
    pos = lo[:, None] + tl.arange(0, R)[None, :] * w[:, None]  # [BLOCK_E, R]
    act = pos < hi[:, None]
    v = tl.load(sorted_ptr + pos, mask=act, other=0)
    c = tl.sum((act & (v <= target[:, None])).to(tl.int32), axis=1)
    new_lo = tl.where(c > 0, lo + (c - 1) * w + 1, lo)
    new_hi = tl.minimum(lo + c * w, hi)
    return new_lo, new_hi


@triton.jit
def expert_tiles_kernel(sorted_ptr, t_e_ptr, t_s_ptr, t_end_ptr, M, E, NUM_TILES, block_m, n_iter,
                        BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, R: tl.constexpr):
    """`tile_table`, entries [pid * BLOCK_T, (pid + 1) * BLOCK_T) of it per program (grid
    cdiv(NUM_TILES, BLOCK_T), from shapes only), from the sorted expert ids (int64 [M],
    ascending) into t_e / t_s / t_end (int32 [NUM_TILES]). Every program recomputes the
    per-expert layout (cheap, E lanes): expert e's slots are sorted positions
    [starts[e], ends[e]) with ends[e] = #{ids <= e} and starts[e] = #{ids <= e - 1}, both
    by `R`-ary search (`n_iter` = `_search_steps(M, R)` steps, the two searches' loads
    independent); its tiles are table entries [first[e], first[e] + per[e]),
    per[e] = cdiv(count, block_m), first = exclusive cumsum of per. Then each of the
    program's tiles t finds its expert (the e with first[e] <= t < first[e] + per[e]; E,
    i.e. unused, past the last) and writes its entry. Integer arithmetic only: the table is
    `tile_table`'s, entry for entry."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    lo = tl.zeros([BLOCK_E], dtype=tl.int32)  # upper bound of e
    hi = lo + M
    lo2 = lo  # upper bound of e - 1
    hi2 = hi
    for _ in range(0, n_iter):
        lo, hi = _upper_bound_step(sorted_ptr, lo, hi, e, R)
        lo2, hi2 = _upper_bound_step(sorted_ptr, lo2, hi2, e - 1, R)
    ends = tl.where(e_ok, lo, M)
    starts = tl.where(e_ok, lo2, M)
    per = (ends - starts + block_m - 1) // block_m  # 0 past E
    cum = tl.cumsum(per, 0)  # inclusive: expert e's tiles end at cum[e]
    first = cum - per
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # searchsorted(cum, t, right=True): E for the unused tiles past the last expert's
    expert = tl.sum(((cum[None, :] <= t[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
    used = expert < E
    ec = tl.minimum(expert, E - 1)
    pick = e[None, :] == ec[:, None]  # [BLOCK_T, BLOCK_E], one expert per tile
    st = tl.sum(tl.where(pick, starts[None, :], 0), axis=1)
    fi = tl.sum(tl.where(pick, first[None, :], 0), axis=1)
    en = tl.sum(tl.where(pick, ends[None, :], 0), axis=1)
    start = st + (t - fi) * block_m
    end = tl.minimum(start + block_m, en)
    ok = t < NUM_TILES
    tl.store(t_e_ptr + t, ec, mask=ok)
    tl.store(t_s_ptr + t, tl.where(used, start, 0), mask=ok)
    tl.store(t_end_ptr + t, tl.where(used, end, 0), mask=ok)


class ExpertPlan:
    """The N*K (token, k) slots of one `ids` [N, K] grouped by expert, computed once per
    MoE layer and shared by `moe_gate_up` and `moe_down_combine` (`_expert_plan`).

    Attributes: order int64 [M] (slot = token * K + k at each sorted position, stable
    within an expert), sorted_ids int64 [M] (ascending), E, K; `tiles(block_m)`, the tile
    table (three int32 [num_tiles], as `tile_table`), and `ends()`, int32 [E] cumulative
    counts, are computed on first use and kept."""

    def __init__(self, ids: torch.Tensor, num_experts: int):
        flat = ids.reshape(-1)
        self.sorted_ids, self.order = torch.sort(flat, stable=True)
        self.E, self.K, self.M = num_experts, ids.shape[1], flat.numel()
        self._tiles: dict[int, tuple] = {}
        self._ends: torch.Tensor | None = None

    def ends(self) -> torch.Tensor:
        """int32 [E]: expert e's slots are sorted positions [ends[e-1], ends[e])."""
        if self._ends is None:
            e = torch.arange(self.E, device=self.order.device)
            self._ends = torch.searchsorted(self.sorted_ids, e, right=True, out_int32=True)
        return self._ends

    def tiles(self, block_m: int):
        """(expert, start, end) int32 [min(cdiv(M, block_m) + E, M)] each: `tile_table`'s
        table, made by one `expert_tiles_kernel` launch of cdiv(size, TILES_BLOCK_T)
        programs (a grid from shapes only: CUDA-graph safe)."""
        table = self._tiles.get(block_m)
        if table is None:
            n = min(triton.cdiv(self.M, block_m) + self.E, self.M)
            table = tuple(torch.empty(n, dtype=torch.int32, device=self.order.device) for _ in range(3))
            expert_tiles_kernel[(triton.cdiv(n, TILES_BLOCK_T),)](
                self.sorted_ids, *table, self.M, self.E, n, block_m, _search_steps(self.M, TILES_FANOUT),
                BLOCK_E=triton.next_power_of_2(self.E), BLOCK_T=TILES_BLOCK_T, R=TILES_FANOUT,
                num_warps=4)
            self._tiles[block_m] = table
        return table


# The plan of the latest `moe_gate_up` call: (weakref to its ids, weakref to its output h,
# plan). `moe_down_combine(h, ids, ...)` reuses it when given that very h and ids (the
# generated runtime's MoE layer); any other call sorts again. Holds no tensor alive but
# the plan's own.
_LAST_PLAN: list = [None]


def _expert_plan(ids: torch.Tensor, num_experts: int, h: torch.Tensor | None = None) -> ExpertPlan:
    """The `ExpertPlan` of `ids`: the one `moe_gate_up` made for the same ids tensor if
    `h` is the tensor that call returned (and, outside inference mode, ids has not been
    modified in place since), else a new one. No host sync either way."""
    last = _LAST_PLAN[0]
    if h is not None and last is not None:
        ids_ref, h_ref, version, plan = last
        if ids_ref() is ids and h_ref() is h and plan.E == num_experts and version == _version(ids):
            return plan
    return ExpertPlan(ids, num_experts)


def _version(t: torch.Tensor) -> int | None:
    """t's in-place version counter, or None for an inference tensor (which has none)."""
    return None if t.is_inference() else t._version


def _token_and_k(plan: ExpertPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, k) int64 [M] of each sorted slot, computed once per plan."""
    tk = getattr(plan, "_tok_k", None)
    if tk is None:
        tk = plan._tok_k = (torch.div(plan.order, plan.K, rounding_mode="floor"),
                            torch.remainder(plan.order, plan.K))
    return tk


def _remember_plan(ids: torch.Tensor, h: torch.Tensor, plan: ExpertPlan) -> None:
    import weakref

    _LAST_PLAN[0] = (weakref.ref(ids), weakref.ref(h), _version(ids), plan)


# ---------------------------------------------------------------------------- checks
def _fail(op: str, name: str, what: str, t) -> None:
    if isinstance(t, torch.Tensor):
        got = f"dtype {t.dtype}, shape {tuple(t.shape)}, strides {tuple(t.stride())}, device {t.device}"
    else:
        got = type(t).__name__
    raise ValueError(f"{op}: {name} must be {what}; got {got}")


def _is_mma(w) -> bool:
    """Whether a weight list is NVFP4 in the mma layout (`nvfp4_mma.is_mma_layout`)."""
    return len(w) == 3 and is_mma_layout(w[0])


def _stacked_dims(w) -> tuple[int, int]:
    """(E, F) of a checked stacked weight list, either NVFP4 layout or bf16."""
    return w[0].shape[0], w[0].shape[1] * (MMA_TILE_ROWS if _is_mma(w) else 1)


def _check_stacked_gscale(op: str, name: str, gs, E: int, device) -> None:
    """`name`[2] of a stacked NVFP4 weight: fp32 global scales [E] on `device`."""
    if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32 or tuple(gs.shape) != (E,) \
            or gs.device != device:
        _fail(op, f"{name}[2] (NVFP4 global scales)", f"an fp32 tensor [{E}] on {device}", gs)


def _check_stacked_mma(op: str, name: str, w, E: int | None, K: int, device):
    """A stacked NVFP4 weight in the mma layout: [codes int32 [E, F/16, K/64, 32, 4],
    scales uint8 [E, F/16, K/64, 32, 2], global_scale fp32 [E]]. Returns (True, E, F)."""
    codes, scales, gs = w
    if K % MMA_CHUNK:
        raise ValueError(f"{op}: mma-layout NVFP4 {name} (int32 codes) needs the reduction dim "
                         f"{K} to be a multiple of {MMA_CHUNK}")
    KC = K // MMA_CHUNK
    if codes.dim() != 5 or (E is not None and codes.shape[0] != E) or codes.shape[2] != KC \
            or tuple(codes.shape[3:]) != (32, 4) or codes.device != device \
            or not codes.is_contiguous():
        _fail(op, f"{name}[0] (NVFP4 mma-layout codes)",
              f"a contiguous int32 tensor [E{'' if E is None else '=' + str(E)}, F/16, {KC}, 32, 4] "
              f"on {device}", codes)
    E, FT = codes.shape[0], codes.shape[1]
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 \
            or tuple(scales.shape) != (E, FT, KC, 32, 2) or not scales.is_contiguous() \
            or scales.device != device:
        _fail(op, f"{name}[1] (NVFP4 mma-layout scale codes)",
              f"a contiguous uint8 tensor [{E}, {FT}, {KC}, 32, 2] on {device}", scales)
    _check_stacked_gscale(op, name, gs, E, device)
    return True, E, FT * MMA_TILE_ROWS


def _check_stacked(op: str, name: str, w, E: int | None, K: int, device):
    """A stacked expert weight [E, F, K]: bf16 [weight], or NVFP4 [codes, scales,
    global_scale [E]] in the packed layout (uint8 codes) or the mma layout (int32 codes,
    `_check_stacked_mma`). Returns (is_nvfp4, E, F)."""
    if not isinstance(w, (list, tuple)) or len(w) not in (1, 3):
        raise ValueError(f"{op}: {name} must be a list [weight] (bf16) or [codes, scales, "
                         f"global_scale] (NVFP4)")
    if _is_mma(w):
        return _check_stacked_mma(op, name, w, E, K, device)
    t0 = w[0]
    if not isinstance(t0, torch.Tensor) or t0.dim() != 3 or (E is not None and t0.shape[0] != E) \
            or t0.device != device or not t0.is_contiguous():
        _fail(op, f"{name}[0]", f"a contiguous [E{'' if E is None else '=' + str(E)}, F, "
              f"{K if len(w) == 1 else K // 2}] tensor on {device}", t0)
    E, F = t0.shape[0], t0.shape[1]
    if len(w) == 1:
        if t0.dtype != torch.bfloat16 or t0.shape[2] != K:
            _fail(op, f"{name}[0]", f"a bf16 tensor [E, F, {K}]", t0)
        return False, E, F
    codes, scales, gs = w
    if codes.dtype != torch.uint8 or codes.shape[2] * 2 != K:
        _fail(op, f"{name}[0] (NVFP4 codes)", f"a uint8 tensor [E, F, {K // 2}]", codes)
    if K % NVFP4_BLOCK:
        raise ValueError(f"{op}: NVFP4 {name} needs the reduction dim {K} to be a multiple of 16")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float8_e4m3fn \
            or tuple(scales.shape) != (E, F, K // NVFP4_BLOCK) or not scales.is_contiguous() \
            or scales.device != device:
        _fail(op, f"{name}[1] (NVFP4 block scales)",
              f"a contiguous float8_e4m3fn tensor [{E}, {F}, {K // NVFP4_BLOCK}] on {device}", scales)
    _check_stacked_gscale(op, name, gs, E, device)
    return True, E, F


def _check_ids(op: str, ids, N: int, device):
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 2 \
            or ids.shape[0] != N or ids.device != device:
        _fail(op, "ids", f"an int64 tensor [{N}, K] on {device}", ids)


def _pick_impl(op: str, impl: str, is_nvfp4: bool, device) -> str:
    """The implementation `impl` names ("auto": module docstring; triton on CUDA).

    Raises:
        ValueError: unknown impl; grouped_mm for NVFP4 or without torch's grouped_mm;
            triton on CPU tensors outside the interpreter; inside CUDA-graph capture, an
            impl that syncs with the host ("loop", grouped_mm off sm_90 / sm_100).
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if device.type == "cuda":
            return "triton"
        return "grouped_mm" if not is_nvfp4 and grouped_mm_fn() is not None else "loop"
    if impl == "grouped_mm" and (is_nvfp4 or grouped_mm_fn() is None):
        raise ValueError(f"{op}: impl='grouped_mm' needs bf16 weights and a torch with grouped_mm")
    if impl == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(f"{op}: impl='triton' on CPU tensors needs TRITON_INTERPRET=1")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if impl == "loop" or (impl == "grouped_mm" and not grouped_mm_sync_free(device)):
            raise ValueError(f"{op}: impl={impl!r} reads the expert counts on the host here, which "
                             "CUDA-graph capture forbids; use impl='triton' (or 'auto')")
    return impl


# ---------------------------------------------------------------------------- grouped GEMM
def _launch_triton(a, a_strides, out, out_strides, w, w2, plan: ExpertPlan, K, gate_up, use_pdl):
    """Run `moe_grouped_gemm_kernel` over the plan's sorted slots; the row of slot
    (token t, k) starts at element t * s0 + k * s1 of `a` / `out` ((s0, s1) = a_strides /
    out_strides)."""
    is_nvfp4 = len(w) == 3
    mma = _is_mma(w)
    E, F = _stacked_dims(w)
    dev = a.device
    M = plan.M
    cfg = _choose_blocks(M, E, F, gate_up, is_nvfp4, dev)
    if mma:
        # the mma-layout loader yields K-order tiles of whole 16-row tiles and 64-column
        # chunks; an even / odd config also gets BLOCK_M <= 32 as `_choose_blocks`'s NVFP4
        # rule (K order at BLOCK_M 64 does not compile on triton 3.6)
        if not cfg.k_order:
            cfg = cfg._replace(k_order=True, block_m=min(cfg.block_m, 32))
        # one dot per 8-row half of each 16-row tile: halves of at least 16 rows (tl.dot)
        cfg = cfg._replace(swap=False, block_f=max(cfg.block_f, 2 * MMA_TILE_ROWS),
                           block_k=max(cfg.block_k, MMA_CHUNK))
    block_m, block_f = cfg.block_m, cfg.block_f
    t_e, t_s, t_end = plan.tiles(block_m)
    w2 = w2 if w2 is not None else w
    if is_nvfp4:
        args = (w[0], w2[0], w[1], w2[1], w[2], w2[2])
    else:
        args = (w[0], w2[0], w[0], w2[0], w[0], w2[0])  # scale pointers unused for bf16
    pdl = bool(use_pdl) and dev.type == "cuda"
    grid = (t_e.numel(), triton.cdiv(F, block_f))
    moe_grouped_gemm_kernel[grid](
        a, plan.order, out, *args, t_e, t_s, t_end, F, K, plan.K, *a_strides, *out_strides,
        BLOCK_M=block_m, BLOCK_F=block_f, BLOCK_K=cfg.block_k, IS_NVFP4=is_nvfp4,
        GATE_UP=gate_up, DOT_BF16=dev.type == "cuda", USE_PDL=pdl_mode(pdl), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, K_ORDER=cfg.k_order, SWAP=cfg.swap, MMA_LAYOUT=mma,
        **({"launch_pdl": True} if pdl else {}),
    )


def _expert_weight_fp32(w, e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert e's matrix in fp32 without the global scale, and that scale (NVFP4) or None.
    The mma layout is decoded by `flintc.kernels.nvfp4_mma.decode_mma_layout` (the same
    values as `dequantize_packed` of the packed layout)."""
    if len(w) == 1:
        return w[0][e].to(torch.float32), None
    if _is_mma(w):
        from flintc.kernels.nvfp4_mma import decode_mma_layout

        return decode_mma_layout(w[0][e], w[1][e]), w[2][e]
    from flintc.quant.nvfp4 import dequantize_packed

    return dequantize_packed(w[0][e], w[1][e], None, torch.float32), w[2][e]


def _loop_expert_mm(rows: torch.Tensor, w, counts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """fp32 [M, F] = per-expert `rows[slice_e] @ W_e^T` (times the global scale), looping
    over the experts that have rows (host sync); unrounded."""
    M = rows.shape[0]
    F = _stacked_dims(w)[1]
    y = torch.empty(M, F, dtype=torch.float32, device=rows.device)
    for e, (c, stop) in enumerate(zip(counts.tolist(), ends.tolist())):
        if c == 0:
            continue
        we, g = _expert_weight_fp32(w, e)
        ye = rows[stop - c:stop].to(torch.float32) @ we.T
        y[stop - c:stop] = ye * g if g is not None else ye
    return y


def _routed_gemm_bf16(rows, w, plan: ExpertPlan, impl) -> torch.Tensor:
    """bf16 [M, F]: each sorted row times its expert's W^T, fp32 accumulation, one rounding."""
    ends = plan.ends()
    if impl == "grouped_mm":
        return grouped_mm_fn()(rows, w[0].transpose(1, 2), offs=ends)
    ends = ends.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return _loop_expert_mm(rows, w, counts, ends).to(torch.bfloat16)


# ---------------------------------------------------------------------------- launchers
def moe_route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int,
              scaling: float, *, use_pdl: bool = False):
    """Router GEMM, sigmoid, bias-corrected top-k and weights, as `flintc::moe_route`
    (reference: `flintc.model.ops.route_topk`).

    Args:
        x: bf16 [N, H], last dim contiguous.
        router: bf16 [E, H]; bias: fp32 [E] (selects, never weights). Same device as x.
        top_k: K, 1 <= K <= E. scaling: routed_scaling_factor.
        use_pdl: accepted for the kernel contract; ignored (cuBLAS + torch ops).

    Returns:
        (weights fp32 [N, K], ids int64 [N, K]) in the reference's order (descending
        `scores + bias`, ties to the lower index). Numerics: module docstring.

    Raises:
        ValueError: a dtype, shape or device does not match.
    """
    del use_pdl
    op = "moe_route"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 \
            or x.stride(-1) != 1:
        _fail(op, "x", "a bf16 tensor [N, H] with a contiguous last dim", x)
    H = x.shape[1]
    if not isinstance(router, torch.Tensor) or router.dtype != torch.bfloat16 or router.dim() != 2 \
            or router.shape[1] != H or router.device != x.device:
        _fail(op, "router", f"a bf16 tensor [E, {H}] on {x.device}", router)
    E = router.shape[0]
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32 or tuple(bias.shape) != (E,) \
            or bias.device != x.device:
        _fail(op, "bias", f"an fp32 tensor [{E}] on {x.device}", bias)
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"{op}: top_k must be an int in [1, {E}], got {top_k!r}")
    # cuBLAS with fp32 output on CUDA; on CPU the reference's expression (same operands
    # and layout as `x.to(CDT) @ router.to(CDT).T`: bit-identical)
    logits = _gemm_kernels._mm_fp32(x, router.T)
    if x.is_cuda and not interpreting():
        # one Triton launch for the selection (session 24; the 1,024-token NVFP4 prefill
        # 44.8 -> 43.2 ms with it and the uint8 sort keys, session 25): the
        # decode top-k's packed-key max-reductions instead of a stable sort of all E keys
        # per token and its elementwise launches (about 1.1 ms of sorts and ~6 small
        # launches per MoE layer in a 1,024-token prefill, docs/benchmarks.md)
        from flintc.kernels.moe import route_topk_rows

        return route_topk_rows(logits.contiguous(), bias, top_k, scaling)
    return ops.select_topk(logits, bias, top_k, scaling)


def moe_gate_up(x: torch.Tensor, ids: torch.Tensor, gate: list[torch.Tensor], up: list[torch.Tensor],
                shared_gate: list[torch.Tensor], shared_up: list[torch.Tensor], *,
                use_pdl: bool = False, impl: str = "auto") -> torch.Tensor:
    """Routed experts' gate/up grouped GEMMs + the shared expert's, then SiLU-and-mul, as
    `flintc::moe_gate_up`.

    Args:
        x: bf16 [N, H], last dim contiguous.
        ids: int64 [N, K] selected experts, each in [0, E) (not checked: needs a sync).
        gate, up: stacked [E, F, H]: `[w]` bf16, or NVFP4 `[codes, scales, global_scale
            fp32 [E]]` in the packed layout (codes uint8 [E, F, H/2], scales float8_e4m3fn
            [E, F, H/16]) or the mma layout (told by codes' dtype: codes int32
            [E, F/16, H/64, 32, 4], scales uint8 ue5m3 codes [E, F/16, H/64, 32, 2], i.e.
            `flintc.kernels.nvfp4_mma.pack_mma_layout` of the [E * F, H] stack reshaped;
            H % 64 == 0); contiguous; same format and layout for both. Both layouts give
            bit-identical results for the same weights with impl "loop"; with "triton"
            the same exact products and fp32 sums, possibly summed in another order
            (module docstring).
        shared_gate, shared_up: [F, H] in any of these formats (see
            `flintc.kernels.gemm.gemm`), or both empty lists (no shared expert).
        use_pdl: PDL launch of the Triton kernel (CUDA only).
        impl: "auto" | "triton" | "grouped_mm" | "loop" (module docstring).

    Returns:
        h bf16 [N, K(+1), F], the shared expert last. Numerics: module docstring.

    Raises:
        ValueError: a dtype, shape, device or layout does not match (the message names the
            tensor, e.g. `gate[1] (NVFP4 mma-layout scale codes)`, and the expected shape),
            gate and up differ in format or layout, or `impl` cannot run (grouped_mm takes
            bf16 weights only).
    """
    op = "moe_gate_up"
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 \
            or x.stride(-1) != 1:
        _fail(op, "x", "a bf16 tensor [N, H] with a contiguous last dim", x)
    N, H = x.shape
    dev = x.device
    _check_ids(op, ids, N, dev)
    K = ids.shape[1]
    is_nvfp4, E, F = _check_stacked(op, "gate", gate, None, H, dev)
    is_nvfp4_u, _, F_u = _check_stacked(op, "up", up, E, H, dev)
    if is_nvfp4_u != is_nvfp4 or F_u != F or _is_mma(up) != _is_mma(gate):
        raise ValueError(f"{op}: up must have gate's format, layout and shape [E={E}, F={F}, "
                         f"H={H}]")
    if bool(shared_gate) != bool(shared_up):
        raise ValueError(f"{op}: shared_gate and shared_up must both be given or both be empty")
    impl = _pick_impl(op, impl, is_nvfp4, dev)
    S = K + (1 if shared_gate else 0)
    out = _alloc(N, S, F, dtype=torch.bfloat16, device=dev)
    M = N * K
    if M:
        plan = ExpertPlan(ids, E)
        if impl == "triton":
            _launch_triton(x, (x.stride(0), 0), out, (S * F, F), gate, up, plan, H, True, use_pdl)
        else:
            tok, kk = _token_and_k(plan)
            xs = x[tok]  # [M, H] sorted rows
            g = _routed_gemm_bf16(xs, gate, plan, impl)
            u = _routed_gemm_bf16(xs, up, plan, impl)
            out[tok, kk] = silu_mul(g, u)
        _remember_plan(ids, out, plan)
    if shared_gate:
        gs = dense_gemm(x, shared_gate)
        us = dense_gemm(x, shared_up)
        silu_mul(gs, us, out=out[:, K])
    return out


def moe_down_combine(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     down: list[torch.Tensor], shared_down: list[torch.Tensor], *,
                     use_pdl: bool = False, impl: str = "auto") -> torch.Tensor:
    """Routed experts' down grouped GEMM, the shared expert's down GEMM and the fp32
    weighted combine `bf16(sum_k w_k * y_k + y_shared)`, as `flintc::moe_down_combine`.

    Args:
        h: bf16 [N, K(+1), F] from `moe_gate_up` (last dim contiguous).
        ids: int64 [N, K] (as for `moe_gate_up`); weights: fp32 [N, K].
        down: stacked [E, H, F], bf16 `[w]` or NVFP4 `[codes, scales, global_scale fp32 [E]]`
            in the packed layout (codes uint8 [E, H, F/2], scales float8_e4m3fn
            [E, H, F/16]) or the mma layout (codes int32 [E, H/16, F/64, 32, 4], scales
            uint8 [E, H/16, F/64, 32, 2]; F % 64 == 0), as for `moe_gate_up`; contiguous.
            Both layouts give the same results as for `moe_gate_up`.
        shared_down: [H, F] in any of these formats (`flintc.kernels.gemm.gemm`), or []
            (then h has K slots).
        use_pdl: PDL launch of the Triton kernel (CUDA only).
        impl: "auto" | "triton" | "grouped_mm" | "loop" (module docstring).

    Returns:
        bf16 [N, H]. Numerics: module docstring (on the CPU the combine is bit-identical to
        the reference's expression given the same expert outputs; on CUDA within one bf16
        ulp plus fp32 reordering of the K + 1 terms).

    Raises:
        ValueError: a dtype, shape, device or layout does not match (the message names the
            tensor and the expected shape), or `impl` cannot run (grouped_mm takes bf16
            weights only).
    """
    op = "moe_down_combine"
    if not isinstance(h, torch.Tensor) or h.dtype != torch.bfloat16 or h.dim() != 3 \
            or h.stride(-1) != 1:
        _fail(op, "h", "a bf16 tensor [N, K(+1), F] with a contiguous last dim", h)
    N, S, F = h.shape
    dev = h.device
    _check_ids(op, ids, N, dev)
    K = ids.shape[1]
    if S != K + (1 if shared_down else 0):
        raise ValueError(f"{op}: h has {S} slots per token; expected K={K}"
                         f"{' + 1 (shared expert)' if shared_down else ''}")
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 \
            or tuple(weights.shape) != (N, K) or weights.device != dev:
        _fail(op, "weights", f"an fp32 tensor [{N}, {K}] on {dev}", weights)
    is_nvfp4, E, H = _check_stacked(op, "down", down, None, F, dev)
    impl = _pick_impl(op, impl, is_nvfp4, dev)
    y = _alloc(N, K, H, dtype=torch.bfloat16, device=dev)
    M = N * K
    if M:
        plan = _expert_plan(ids, E, h)
        if impl == "triton":
            _launch_triton(h, (h.stride(0), h.stride(1)), y, (K * H, H), down, None, plan, F, False,
                           use_pdl)
        else:
            tok, kk = _token_and_k(plan)
            y[tok, kk] = _routed_gemm_bf16(h[tok, kk], down, plan, impl)
    shared = dense_gemm(h[:, K], shared_down) if shared_down else None
    return expert_combine(y, weights, shared)


KERNELS: dict[str, Callable] = {
    "moe_route": moe_route,
    "moe_gate_up": moe_gate_up,
    "moe_down_combine": moe_down_combine,
}
