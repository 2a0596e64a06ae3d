"""Read floor of the MoE expert GEMVs: a kernel that only reads their bytes (GPU only).

`moe_topk_gate_up` and `moe_down_combine_residual` must read, per decode step, the
selected experts' weights, which are known only once the router's output is: a routed
block cannot issue a weight load before `griddepcontrol.wait` returns and it has read its
expert id. This module times the cheapest kernel with that same constraint: it reads
exactly the weight bytes the op reads (the shared expert's, then each (token, slot)'s
expert, codes then block scales) with 16-byte non-coherent loads, and keeps nothing but an
XOR of them (so no load can be dropped). No routing, no arithmetic, no outputs beyond one
word per warp. Its time in the same CUDA-graph chain (`bench_moe.graph_us`, PDL on) is a
lower bound for the op's at that batch, so `floor bytes / floor time` bounds the op's
achievable share of the copy bandwidth from above (issue 5 asks for 60% at N = 1-8).

The PDL trigger (`griddepcontrol.launch_dependents`) comes once a block's loads are
issued (`trigger="early"`) or at its end (`"late"`).

Two launch modes, both PDL-chained on the previous call:

* `dependent` (the op's constraint): the shared expert's loads are issued before
  `griddepcontrol.wait`, as the op does; a routed block waits, reads its expert id
  (coherent load: the previous kernel writes the ids), then loads.
* `ids_known` (no such kernel can exist; for scale only): the ids are read before the
  wait too, so every load of a call may overlap the previous call.

Work split: item 0 is the shared expert, item 1 + n * top_k + k token n's slot k; an
item's bytes (the matrices' codes, then their scales) are cut into chunks of
`threads x loads` 16-byte words, one block per (chunk, item), each thread `loads` words
`threads` apart (coalesced), all issued before the first is used.

Formats: NVFP4 (`[E, R, C / 2]` uint8 codes and `[E, R, C / 16]` E4M3 scales per matrix,
the checkpoint layout; the mma layout the op reads has the same bytes) and bf16 (`[E, R,
C]`, no scales).

    from read_floor import ReadFloor
    rf = ReadFloor(codes=[gate_codes, up_codes], scales=[gate_scales, up_scales],
                   shared_codes=[sg_codes, su_codes], shared_scales=[sg_sc, su_sc])
    rf(ids, threads=256, loads=4, mode="dependent", use_pdl=True)   # one launch
    rf.check(ids)   # the kernel's XOR of each item's bytes against torch's (exact)

Raises ValueError (naming the argument) for mismatched shapes, sizes that do not split
into whole chunks, or a launch outside 32..1024 threads / 1..16 loads.
"""

from __future__ import annotations

import numpy as np
import torch

SOURCE = r"""
// Read floor: item 0 the shared expert, item i > 0 the expert ids[i - 1]; chunk blockIdx.x
// of the item's NM matrices' codes (NC words each), then their scales (NS words each).
#define NM __NM__        // matrices per item (gate + up: 2; down: 1)
#define LOADS __LOADS__  // 16-byte words per thread, all in flight at once
typedef unsigned int u32;
__device__ __forceinline__ uint4 ld_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ long long ld_id(const long long* p) {  // coherent: written upstream
  long long v;
  asm volatile("ld.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
extern "C" __global__ void read_floor(
    const uint4* c0, const uint4* c1, const uint4* s0, const uint4* s1,
    const uint4* sc0, const uint4* sc1, const uint4* ss0, const uint4* ss1,
    const long long* ids, u32* out, int nc_words, int ns_words, int dependent, int pdl,
    int late) {
  const long long nc = nc_words, ns = ns_words;  // 16-byte words per expert
  const int item = blockIdx.y;
  const long long chunk = (long long)blockDim.x * LOADS;
  long long o = (long long)blockIdx.x * chunk;
  const uint4* p;
  long long e = 0;
  if (item > 0 && !dependent) e = ld_id(ids + item - 1);   // ids_known: before the wait
  if (item > 0 && dependent && pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (item > 0 && dependent) e = ld_id(ids + item - 1);
  const bool shared = item == 0;
  if (o < NM * nc) {
    const int m = (int)(o / nc);
    const uint4* base = shared ? (m ? sc1 : sc0) : (m ? c1 : c0) + e * nc;
    p = base + (o - m * nc);
  } else {
    o -= NM * nc;
    const int m = (int)(o / ns);
    const uint4* base = shared ? (m ? ss1 : ss0) : (m ? s1 : s0) + e * ns;
    p = base + (o - m * ns);
  }
  uint4 v[LOADS];
#pragma unroll
  for (int j = 0; j < LOADS; ++j) v[j] = ld_nc(p + threadIdx.x + j * blockDim.x);
  if (pdl && (shared || !dependent)) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (pdl && !late) asm volatile("griddepcontrol.launch_dependents;");
  u32 x = 0;
#pragma unroll
  for (int j = 0; j < LOADS; ++j) x ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, d);
  const int warps = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0)
    out[((size_t)item * gridDim.x + blockIdx.x) * warps + (threadIdx.x >> 5)] = x;
  if (pdl && late) asm volatile("griddepcontrol.launch_dependents;");
}
"""


def weight_floor(matrices: list) -> "ReadFloor":
    """The read floor of a GEMV whose weights do not depend on the previous kernel (a
    dense projection, or a fused one over 2 equal-size matrices such as gate and up): a
    `ReadFloor` whose only item is the shared one, so every load is issued before
    `griddepcontrol.wait`, as a GEMV's may be. Call it with no routed ids,
    `floor(NO_IDS.to(device), threads, loads, "dependent", use_pdl)`; `item_bytes()` is
    the weights' bytes (codes and scales; the fp32 global scale is not counted).

    Args:
        matrices: 1 or 2 weights of one size, each `[w]` bf16 `[F, K]` or NVFP4 `[codes
            [F, K / 2] uint8, scales [F, K / 16] float8_e4m3fn, global scale]`, or NVFP4
            in the mma layout (`nvfp4_mma.prepack`: codes int32 [F/16, K/64, 32, 4],
            scales uint8 [F/16, K/64, 32, 2]; the same bytes).

    Raises:
        ValueError: another count of matrices, formats or sizes that differ (naming them),
            a matrix whose codes and scales do not make one weight of those layouts, or
            sizes `ReadFloor` refuses.
    """
    if not isinstance(matrices, (list, tuple)) or len(matrices) not in (1, 2):
        got = len(matrices) if isinstance(matrices, (list, tuple)) else type(matrices).__name__
        raise ValueError(f"read_floor.weight_floor: needs 1 or 2 matrices; got {got}")
    kinds = {len(m) if isinstance(m, (list, tuple)) else -1 for m in matrices}
    if kinds not in ({1}, {3}) or not all(isinstance(t, torch.Tensor) for m in matrices
                                          for t in m[:2]):
        raise ValueError("read_floor.weight_floor: every matrix is [w] (bf16) or [codes, "
                         "scales, global_scale] (NVFP4) of tensors, all in one format")
    for i, m in enumerate(matrices):
        c, s = m[0], m[1] if len(m) == 3 else None
        if s is None:
            ok = c.dtype == torch.bfloat16 and c.dim() == 2
        elif c.dtype == torch.int32:  # the mma layout
            ok = s.dtype == torch.uint8 and c.dim() == 4 and tuple(c.shape[2:]) == (32, 4) \
                and tuple(s.shape) == tuple(c.shape[:2]) + (32, 2)
        else:  # packed
            ok = c.dtype == torch.uint8 and s.dtype in (torch.float8_e4m3fn, torch.uint8) \
                and c.dim() == 2 and c.shape[1] % 8 == 0 \
                and tuple(s.shape) == (c.shape[0], c.shape[1] // 8)
        if not ok:
            raise ValueError(f"read_floor.weight_floor: matrix {i} must be bf16 [F, K], NVFP4 "
                             f"uint8 [F, K/2] codes with [F, K/16] scales, or the mma layout; "
                             f"got " + ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in m[:2]))
    codes = [m[0] for m in matrices]
    scales = [m[1].view(torch.uint8) for m in matrices] if kinds == {3} else []
    if len({(t.dtype, tuple(t.shape)) for t in codes}) != 1:
        raise ValueError("read_floor.weight_floor: the matrices must have one size; got "
                         + ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in codes))
    return ReadFloor([t.unsqueeze(0) for t in codes], [t.unsqueeze(0) for t in scales],
                     codes, scales)


NO_IDS = torch.empty(0, dtype=torch.int64)  # no routed items: `weight_floor`'s calls

# (threads, loads) the benchmarks try, keeping the best (`best_launch`)
LAUNCHES = [(t, l) for t in (128, 256, 512, 1024) for l in (1, 2, 4, 8) if t * l <= 4096]


def best_launch(rf: "ReadFloor", time_fn) -> tuple[float, int, int]:
    """(time, threads, loads) of the fastest of `LAUNCHES` that split `rf`'s items into
    whole chunks, `time_fn(threads, loads)` timing one (any unit, smaller is better).
    Raises ValueError when none splits them."""
    best = None
    for t, ld in LAUNCHES:
        try:
            rf.chunks(t, ld)
        except ValueError:
            continue  # this launch does not split the weights into whole chunks
        us = time_fn(t, ld)
        if best is None or us < best[0]:
            best = (us, t, ld)
    if best is None:
        raise ValueError("read_floor.best_launch: no launch of LAUNCHES splits the items into "
                         "whole chunks")
    return best


def kernel_source(matrices: int, loads: int) -> str:
    """CUDA source of the read-floor kernel for `matrices` (1 or 2) per item and `loads`
    16-byte words per thread (1..16). Raises ValueError outside those."""
    if matrices not in (1, 2) or not 1 <= loads <= 16:
        raise ValueError(f"read_floor.kernel_source: matrices must be 1 or 2 and loads 1..16; "
                         f"got {matrices}, {loads}")
    return SOURCE.replace("__NM__", str(matrices)).replace("__LOADS__", str(loads))


def _words(t: torch.Tensor, name: str) -> int:
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 16 or t.data_ptr() % 16:
        raise ValueError(f"read_floor: {name} must be contiguous, 16-byte aligned, with a "
                         f"multiple of 16 bytes; got shape {tuple(t.shape)}, dtype {t.dtype}")
    return t.numel() * t.element_size() // 16


class ReadFloor:
    """The read-floor kernel over one op's weights.

    Args:
        codes: 1 or 2 stacked routed matrices `[E, ...]` (NVFP4 uint8 codes, or bf16
            weights), all the same size per expert.
        scales: their NVFP4 block scales `[E, ...]` (one per matrix), or [] for bf16.
        shared_codes, shared_scales: the shared expert's matrices (no E dimension), the
            same sizes per matrix as one routed expert's.
    """

    def __init__(self, codes: list, scales: list, shared_codes: list, shared_scales: list):
        if len(codes) not in (1, 2) or len(shared_codes) != len(codes):
            raise ValueError("read_floor: codes and shared_codes need 1 or 2 matrices each, "
                             f"the same count; got {len(codes)}, {len(shared_codes)}")
        if len(scales) not in (0, len(codes)) or len(shared_scales) != len(scales):
            raise ValueError("read_floor: scales and shared_scales need one per matrix or none")
        self.experts = codes[0].shape[0]
        for name, t in [("codes[0]", codes[0])] + ([("scales[0]", scales[0])] if scales else []):
            if _words(t, name) % self.experts or _words(t, name) // self.experts >= 2**31:
                raise ValueError(f"read_floor: {name} {tuple(t.shape)} must hold a whole number "
                                 f"of 16-byte words per expert (under 2^31) for its "
                                 f"{self.experts} experts")
        self.nc = _words(codes[0], "codes[0]") // self.experts
        self.ns = _words(scales[0], "scales[0]") // self.experts if scales else 0
        routed = [(f"codes[{i}]", t, self.nc) for i, t in enumerate(codes)] + \
            [(f"scales[{i}]", t, self.ns) for i, t in enumerate(scales)]
        for name, t, words in routed:
            if t.shape[0] != self.experts or _words(t, name) != words * self.experts:
                raise ValueError(f"read_floor: {name} has shape {tuple(t.shape)}; expected "
                                 f"{self.experts} experts of {16 * words} bytes")
        shared = [(f"shared_codes[{i}]", t, self.nc) for i, t in enumerate(shared_codes)] + \
            [(f"shared_scales[{i}]", t, self.ns) for i, t in enumerate(shared_scales)]
        for name, t, words in shared:
            if _words(t, name) != words:
                raise ValueError(f"read_floor: {name} must hold {16 * words} bytes")
        self.m = len(codes)

        def two(ts):  # the kernel takes 2 pointers per role; unused ones repeat a valid one
            return list(ts) + [ts[0]] * (2 - len(ts)) if ts else [codes[0]] * 2

        self.ptrs = two(codes) + two(scales) + two(shared_codes) + two(shared_scales)
        self.codes, self.scales = codes, scales
        self.shared = list(shared_codes) + list(shared_scales)
        self.item_words = self.m * (self.nc + self.ns)
        self._out = {}

    def item_bytes(self) -> int:
        """Bytes one item (one expert) reads: its matrices' codes and scales."""
        return 16 * self.item_words

    def chunks(self, threads: int, loads: int) -> int:
        """Blocks per item. Raises ValueError unless a chunk divides every matrix's codes
        and scales."""
        if not (32 <= threads <= 1024 and threads % 32 == 0 and 1 <= loads <= 16):
            raise ValueError(f"read_floor: threads must be a multiple of 32 in 32..1024 and "
                             f"loads 1..16; got {threads}, {loads}")
        chunk = threads * loads
        if self.nc % chunk or (self.ns and self.ns % chunk):
            raise ValueError(f"read_floor: a chunk of {threads} x {loads} words does not divide "
                             f"the {self.nc}-word codes / {self.ns}-word scales of an expert")
        return self.item_words // chunk

    def __call__(self, ids: torch.Tensor, threads: int = 256, loads: int = 4,
                 mode: str = "dependent", use_pdl: bool = True,
                 trigger: str = "early", out: torch.Tensor | None = None) -> torch.Tensor:
        """Launch once on the current stream. ids: int64 `[N, top_k]` (or flat) expert ids.
        out: the int32 `[items, chunks, threads / 32]` buffer to write (None: one kept per
        shape, so a CUDA graph can replay the launch).
        trigger: "early" (`launch_dependents` once the loads are issued) or "late" (at the
        end, after the XOR is stored, where the op's kernels trigger unless
        `nvfp4_mma.EARLY_TRIGGER` names them).
        Returns the per-warp XOR words, uint32 as int32 `[items, chunks, threads / 32]`."""
        from flintc.kernels import nvfp4_mma as M

        if trigger not in ("early", "late"):
            raise ValueError(f"read_floor: trigger must be 'early' or 'late'; got {trigger!r}")
        if mode not in ("dependent", "ids_known"):
            raise ValueError(f"read_floor: mode must be 'dependent' or 'ids_known'; got {mode!r}")
        if ids.dtype != torch.int64 or not ids.is_contiguous() \
                or ids.device != self.codes[0].device:
            raise ValueError(f"read_floor: ids must be contiguous int64 on "
                             f"{self.codes[0].device}; got {ids.dtype} on {ids.device}")
        chunks = self.chunks(threads, loads)
        items = 1 + ids.numel()
        shape = (items, chunks, threads // 32)
        if out is None:
            key = (shape, ids.device)
            out = self._out.get(key)
            if out is None:
                out = self._out[key] = torch.empty(shape, dtype=torch.int32, device=ids.device)
        elif tuple(out.shape) != shape or out.dtype != torch.int32 or out.device != ids.device:
            raise ValueError(f"read_floor: out must be int32 {list(shape)} on {ids.device}")
        kernel = M._compiled("read_floor", (self.m, loads), lambda: kernel_source(self.m, loads),
                             ids.device)
        M._launch(kernel, (chunks, items), threads,
                  self.ptrs + [ids, out, self.nc, self.ns, int(mode == "dependent"),
                               int(bool(use_pdl)), int(trigger == "late")], bool(use_pdl))
        return out

    def expected_xor(self, ids: torch.Tensor) -> list[int]:
        """The XOR of each item's bytes as 32-bit little-endian words, computed by numpy
        (item 0 the shared expert, item 1 + i the expert ids.flatten()[i])."""
        def xor(ts) -> int:
            words = np.concatenate([t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
                                    .view(np.uint32) for t in ts])
            return int(np.bitwise_xor.reduce(words))

        flat = ids.flatten().tolist()
        return [xor(self.shared)] + [xor([t[e] for t in self.codes] + [t[e] for t in self.scales])
                                     for e in flat]

    def check(self, ids: torch.Tensor, threads: int = 256, loads: int = 4,
              mode: str = "dependent") -> None:
        """Run once and compare each item's XOR with `expected_xor`; raises AssertionError
        naming the first item that differs (a load missed or read twice)."""
        flat = ids.flatten()
        if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < self.experts):
            raise ValueError(f"read_floor: ids must lie in [0, {self.experts})")
        # a fresh, poisoned buffer: a word the launch does not write keeps 0xFFFFFFFF
        poisoned = torch.full((1 + ids.numel(), self.chunks(threads, loads), threads // 32), -1,
                              dtype=torch.int32, device=ids.device)
        out = self(ids, threads, loads, mode, out=poisoned).cpu().numpy().view(np.uint32)
        got = np.bitwise_xor.reduce(out.reshape(out.shape[0], -1), axis=1)
        for item, want in enumerate(self.expected_xor(ids)):
            if int(got[item]) != want:
                raise AssertionError(f"read_floor: item {item} XOR {int(got[item]):#010x}, "
                                     f"expected {want:#010x}")
