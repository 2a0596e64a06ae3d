"""Token sampling in one launch: temperature, top-k, top-p and the draw (FLINT_SPEC
section 6), for a batch whose rows may each have their own settings and seed.

Contract and reference: `flintc.sampling.sampling_probs` (the distribution) and
`flintc.sampling.sample` (which calls this kernel on CUDA when `FLINTC_SAMPLER=triton`,
for rows with 1 <= top_k <= `MAX_TOP_K` < V, and greedy rows). The torch path launches
about 70 kernels per step at batch 1 (torch.topk, the top-p masses, the uniforms of
each row, the Gumbel-max draw): on an H200 0.22-0.25 ms per token after the forward,
mostly the gaps between small dependent launches (docs/gpu-runs.md session 18). Here
it is one grid.

Work decomposition, grid (B, NCHUNK), one program per CHUNK logits of a row:
- x = logits / temperature (IEEE division, `div_rn`); greedy rows (temperature below
  `GREEDY_TEMPERATURE`) keep the logits and act as top-k 1.
- Each program takes its chunk's k largest *distinct* values, each with its count, and,
  among the tokens of that value, the one with the largest uniform u (the draw's noise,
  one per token) and that u (`_chunk_top_values`). Every token whose value is at least
  the row's k-th largest lies in some chunk's list: a chunk holding such a token outside
  its list would hold k distinct larger values, so at least k tokens above the k-th.
- The last program of the row to arrive (an arrival counter per row, atomic acq_rel
  after a CTA barrier, as `decode_attention`'s in-kernel merges) merges the B x NCHUNK x
  KMAX records: distinct values v_0 > v_1 > ... in order, until their counts reach k
  (v_j = the k-th largest value: its ties stay or go together), weights e_j = c_j
  exp(v_j - v_0) in fp64, top-p keeps v_j when the mass of the larger values is below
  top_p times the total (as `sampling_probs`), and the draw is the Gumbel-max over the
  kept values: score_j = (v_j - v_0) + G(u_j), with u_j the largest uniform among the
  c_j tokens of v_j. The maximum of c iid Gumbel(0) is Gumbel(log c), so this is the
  Gumbel-max draw over the kept tokens with every token its own noise (Gumbel 1954;
  Maddison et al. 2014), and the winner is v_j's token with that largest uniform: each
  token of a value equally likely. Greedy rows: v_0's lowest token id (their "uniform"
  decreases with the id).
- Uniforms: counter-based Philox 4x32-10 (`tl.philox`, Salmon et al. 2011), key = the
  row's 64-bit seed, counter = (token id, draw offset low, draw offset high, 0), so a
  row's draw depends only on its seed and offset, not on the batch.

Numerics: the keep decisions and the weights are fp64 sums over at most k values, as in
`flintc.sampling._top_k_scores`, in another order (a decision can differ only where a
mass equals top_p times the total to the last fp64 bits). Tests (interpreter) compare the
kernel with a torch model of this rule on the same uniforms (`u` test input) token for
token, and the rule's kept set and weights with `sampling_probs`.

Written in session 24 without a GPU: interpreter-checked (tests/kernels/test_sampler.py)
and compiled for sm_90 (188 registers with triton 3.9, 205 with the H200's 3.6, no
spill; `aot_probe_specs`). Session 25 ran it on the H200 (43.9 us device time at batch 1,
70.9 at 8, against the torch path's 71-78 launches, 129-176 us; end to end 0.18 ms per
token less at batch 1): the default on CUDA since (`flintc.sampling.DEFAULT_SAMPLER`).

Scratch: the records (4 x 4 B x B x NCHUNK x KMAX) per launch; the arrival counters are
the decode kernels' per-device zeroed pool (`flintc.kernels.gemv.split_k_counters`),
left zeroed by every launch (launches sharing it must not run concurrently on different
streams).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flintc.kernels.gemv import split_k_counters
from flintc.kernels.platform import interpreting

GREEDY_TEMPERATURE = 1e-5  # as flintc.sampling.GREEDY_TEMPERATURE
MAX_TOP_K = 64  # KMAX is the next power of two >= the batch's largest top_k
GPU_CHUNK = 4096  # logits per program (37 programs per row at V = 151,552)
GPU_NUM_WARPS = 4
CPU_CHUNK = 64  # the interpreter: small chunks so that tests merge many records


@triton.jit
def _chunk_top_values(x, u, offs, V, kk, rec, KMAX: tl.constexpr):
    # The chunk's kk largest distinct values of x, each with its count, and the token of
    # the largest u among its tokens (lowest id on equal u) and that u, into the records
    # rec [4, KMAX] (value, count, token, u); the slots past kk, and past the chunk's
    # distinct values, hold value -inf and count 0.
    slots = tl.arange(0, KMAX)
    tl.store(rec + slots, tl.full([KMAX], float("-inf"), tl.float32))
    tl.store(rec + KMAX + slots, tl.zeros([KMAX], tl.float32))
    tl.debug_barrier()  # before the slots' own stores below
    # (u, token) as one int64 key, so one max finds the largest u and, on equal u, the
    # lowest token (`_pack_u_token`): three reductions per round instead of four.
    key = _pack_u_token(u, offs)
    prev = tl.max(x, axis=0) + float("inf")  # +inf (a tensor: the loop carries one)
    for j in range(0, kk):
        # (the first round takes max(x) unfiltered: a +inf logit is a value like any other)
        v = tl.max(tl.where(x < prev, x, tl.where(j == 0, x, float("-inf"))), axis=0)
        eq = (x == v) & (x > float("-inf"))
        c = tl.sum(eq.to(tl.int32), axis=0)
        bu, bt = _unpack_u_token(tl.max(tl.where(eq, key, -1), axis=0))
        tl.store(rec + j, tl.where(c > 0, v, float("-inf")))
        tl.store(rec + KMAX + j, c.to(tl.float32))
        tl.store(rec + 2 * KMAX + j, bt.to(tl.float32))
        tl.store(rec + 3 * KMAX + j, tl.where(c > 0, bu, -1.0))
        prev = v


@triton.jit
def _pack_u_token(u, tok):
    # u in [0, 1] (fp32, so its bits order like the values) in the high word, 2^32 - 1 -
    # tok in the low word: the max key is the largest u, then the lowest token.
    hi = u.to(tl.int32, bitcast=True).to(tl.int64)
    return (hi << 32) | (4294967295 - tok.to(tl.int64))


@triton.jit
def _unpack_u_token(k):
    # (u, token) of `_pack_u_token`'s key k >= 0
    u = (k >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return u, 4294967295 - (k & 4294967295)


@triton.jit
def sample_kernel(
    logits_ptr, stride_row, params_ptr, u_ptr, rec_ptr, counter_ptr, out_ptr, V, NCHUNK,
    CHUNK: tl.constexpr, KMAX: tl.constexpr, MERGE: tl.constexpr, GREEDY_EPS: tl.constexpr,
    U_FROM_PTR: tl.constexpr,
):
    # Program (row, ch): logits [ch * CHUNK, (ch + 1) * CHUNK) of the row. params [5, B]
    # int64: seed, draw offset, top_k, temperature (fp32 bits) and top_p (fp64 bits, the
    # Python float that `sampling_probs` compares). Records
    # [B, NCHUNK, 4, KMAX] fp32: value, count, token, u. (Token ids < 2^24 are exact in
    # fp32: V = 151,552.)
    row = tl.program_id(0)
    ch = tl.program_id(1)
    B = tl.num_programs(0)
    k = tl.load(params_ptr + 2 * B + row).to(tl.int32)
    temp = tl.load(params_ptr + 3 * B + row).to(tl.int32).to(tl.float32, bitcast=True)
    greedy = temp < GREEDY_EPS
    # (clamped to the records' KMAX slots: a caller's max_top_k below a row's top_k then
    # samples that row with top-k KMAX instead of writing past its records)
    kk = tl.minimum(tl.where(greedy, 1, k), KMAX)
    offs = ch * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=mask,
                other=float("-inf")).to(tl.float32)
    if not greedy:
        x = tl.math.div_rn(x, tl.where(mask, temp, 1.0))
    if U_FROM_PTR:  # tests: the uniforms given, [B, V]
        u = tl.load(u_ptr + row.to(tl.int64) * V + offs, mask=mask, other=0.0)
    else:
        seed = tl.load(params_ptr + row)
        off = tl.load(params_ptr + B + row)
        zero = tl.zeros([CHUNK], tl.uint32)
        r0, _, _, _ = tl.philox(seed, offs.to(tl.uint32), zero + (off & 0xFFFFFFFF).to(tl.uint32),
                                zero + ((off >> 32) & 0xFFFFFFFF).to(tl.uint32), zero)
        u = tl.uint_to_uniform_float(r0)
    # greedy: the lowest id wins among equal maxima
    u = tl.where(greedy, (V - offs).to(tl.float32) / V, u)
    rec = rec_ptr + (row.to(tl.int64) * NCHUNK + ch) * 4 * KMAX
    _chunk_top_values(x, u, offs, V, kk, rec, KMAX)
    # All threads' stores before the release of the arrival count.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == NCHUNK - 1:
        tl.debug_barrier()
        top_p = tl.load(params_ptr + 4 * B + row).to(tl.float64, bitcast=True)
        _merge_and_draw(rec_ptr + row.to(tl.int64) * NCHUNK * 4 * KMAX, NCHUNK, V, kk, greedy,
                        top_p, out_ptr + row, KMAX, MERGE)
        tl.atomic_xchg(counter_ptr + row, 0)  # ready for the next launch


@triton.jit
def _merge_and_draw(rec, NCHUNK, V, kk, greedy, top_p, out, KMAX: tl.constexpr,
                    MERGE: tl.constexpr):
    # The row's records [NCHUNK, 4, KMAX]: its distinct values in descending order until
    # their counts reach kk, top-p over them, the Gumbel-max draw; the token to out.
    i = tl.arange(0, MERGE)
    n = NCHUNK * KMAX
    live = i < n
    base = (i // KMAX) * 4 * KMAX + i % KMAX  # record i: chunk i // KMAX, slot i % KMAX
    # .cg: the other programs' records are at L2
    rv = tl.load(rec + base, mask=live, other=float("-inf"), cache_modifier=".cg")
    rc = tl.load(rec + base + KMAX, mask=live, other=0.0, cache_modifier=".cg")
    rt = tl.load(rec + base + 2 * KMAX, mask=live, other=0.0, cache_modifier=".cg")
    ru = tl.load(rec + base + 3 * KMAX, mask=live, other=-1.0, cache_modifier=".cg")
    # (the records' u of live slots is in [0, 1]; empty slots never match below)
    rkey = _pack_u_token(tl.maximum(ru, 0.0), rt.to(tl.int64))
    j_ = tl.arange(0, KMAX)
    vals = tl.full([KMAX], float("-inf"), tl.float32)
    cnts = tl.zeros([KMAX], tl.float64)
    toks = tl.zeros([KMAX], tl.float32)
    us = tl.full([KMAX], -1.0, tl.float32)
    prev = tl.max(rv, axis=0) + float("inf")  # +inf (a tensor: the loop carries one)
    cum = tl.sum(rc, axis=0) * 0.0
    for j in range(0, kk):  # the counts reach kk within kk distinct values
        v = tl.max(tl.where(rv < prev, rv, tl.where(j == 0, rv, float("-inf"))), axis=0)
        eq = (rv == v) & (rv > float("-inf"))
        c = tl.sum(tl.where(eq, rc, 0.0), axis=0)
        bu, bt = _unpack_u_token(tl.max(tl.where(eq, rkey, -1), axis=0))
        bt = bt.to(tl.float32)
        need = (cum < kk) & (c > 0)  # the values until the counts reach k
        put = j_ == j
        vals = tl.where(put, tl.where(need, v, float("-inf")), vals)
        cnts = tl.where(put, tl.where(need, c.to(tl.float64), 0.0), cnts)
        toks = tl.where(put, bt, toks)
        us = tl.where(put, bu, us)
        cum += c
        prev = v
    kept = vals > float("-inf")
    m = tl.max(vals, axis=0).to(tl.float64)  # v_0
    e = tl.where(kept, cnts * tl.exp(vals.to(tl.float64) - m), 0.0)
    total = tl.sum(e, axis=0)
    larger = tl.cumsum(e, axis=0) - e  # mass of the strictly larger values
    keep = kept & (larger < top_p * total)
    uu = tl.where(kept, us, 0.5).to(tl.float64)  # (the slots not kept: any u in (0, 1))
    gumbel = -tl.log(-tl.log(uu))  # u = 0: -inf, never drawn
    score = tl.where(keep, vals.to(tl.float64) - m + gumbel, float("-inf"))
    score = tl.where(greedy, tl.where(j_ == 0, 0.0, float("-inf")), score)
    best = tl.max(score, axis=0)
    win = tl.min(tl.where(score == best, j_, KMAX), axis=0)
    tok = tl.sum(tl.where(j_ == win, toks, 0.0), axis=0)
    tok = tl.where(tok < V, tok, 0.0)  # no finite logit (NaN row): token 0
    tl.store(out, tok.to(tl.int64))


def pack_params(seeds, offsets, top_k, temperature, top_p) -> torch.Tensor:
    """The kernel's per-row parameters as one int64 [5, B] host tensor (pinned by the
    caller if it wants an asynchronous copy): seed, draw offset, top_k, the fp32 bits of
    temperature (the torch path divides fp32 logits by it as fp32 too) and the fp64 bits of
    top_p (compared in fp64, as `sampling_probs`: an fp32 top_p would move the cut).
    Raises ValueError on lists of different lengths."""
    B = len(seeds)
    if not (len(offsets) == len(top_k) == len(temperature) == len(top_p) == B):
        raise ValueError("pack_params: one seed, offset, top_k, temperature and top_p per row")
    out = torch.empty(5, B, dtype=torch.int64)
    out[0] = torch.tensor([int(s) & (2**63 - 1) for s in seeds], dtype=torch.int64)
    out[1] = torch.tensor([int(o) & (2**63 - 1) for o in offsets], dtype=torch.int64)
    out[2] = torch.tensor([int(k) for k in top_k], dtype=torch.int64)
    out[3] = torch.tensor(list(temperature), dtype=torch.float32).view(torch.int32).to(torch.int64)
    out[4] = torch.tensor(list(top_p), dtype=torch.float64).view(torch.int64)
    return out


def launch_sample(logits: torch.Tensor, params: torch.Tensor, max_top_k: int, *,
                  uniforms: torch.Tensor | None = None, chunk: int | None = None,
                  num_warps: int | None = None) -> torch.Tensor:
    """Draw one token per row (see the module docstring).

    logits: fp32 or bf16 [B, V], rows contiguous; params: int64 [5, B] on logits' device
    (`pack_params`): per row the Philox seed and draw offset, top_k (1..MAX_TOP_K, < V;
    ignored for greedy rows), temperature (< GREEDY_TEMPERATURE: greedy) and top_p in
    (0, 1]; max_top_k: the largest top_k of the sampled rows, a host value (1 for an
    all-greedy batch); the kernel keeps the next power of two of it per chunk; uniforms: tests only, fp32 [B, V] in [0, 1) used instead of Philox's; chunk,
    num_warps: launch knobs (default GPU_* on CUDA, CPU_CHUNK in the interpreter).
    Returns int64 [B] on logits' device. A row holding NaN logits gets an unspecified
    token of that row. Raises ValueError naming the argument on a wrong dtype, shape,
    device or top_k (the values of params are not read on the host: no sync).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or \
            logits.dtype not in (torch.float32, torch.bfloat16) or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected an fp32 or bf16 tensor [B, V] with contiguous rows, got "
                         f"{getattr(logits, 'dtype', type(logits))} {tuple(getattr(logits, 'shape', ()))}")
    B, V = logits.shape
    if not (isinstance(params, torch.Tensor) and params.dtype == torch.int64
            and tuple(params.shape) == (5, B) and params.is_contiguous() and params.device == logits.device):
        raise ValueError(f"params: expected a contiguous int64 tensor [5, {B}] on {logits.device} "
                         "(pack_params), got "
                         f"{getattr(params, 'dtype', type(params))} {tuple(getattr(params, 'shape', ()))}")
    if V >= 2**24:
        raise ValueError(f"logits: V = {V} token ids do not fit the records' fp32 (< 2^24)")
    if uniforms is not None and not (uniforms.dtype == torch.float32 and tuple(uniforms.shape) == (B, V)
                                     and uniforms.is_contiguous() and uniforms.device == logits.device):
        raise ValueError(f"uniforms: expected a contiguous fp32 tensor [{B}, {V}] on {logits.device}")
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if isinstance(max_top_k, bool) or not isinstance(max_top_k, int) or not 1 <= max_top_k <= MAX_TOP_K \
            or max_top_k >= V:
        raise ValueError(f"max_top_k: the Triton sampler takes top_k in 1..{MAX_TOP_K} and below V = {V}, "
                         f"got {max_top_k!r}")
    kmax = triton.next_power_of_2(max_top_k)
    on_gpu = logits.is_cuda and not interpreting()
    chunk = chunk or (GPU_CHUNK if on_gpu else CPU_CHUNK)
    nchunk = triton.cdiv(V, chunk)
    rec = torch.empty(B * nchunk * 4 * kmax, dtype=torch.float32, device=logits.device)
    extra = {"num_warps": num_warps or GPU_NUM_WARPS} if on_gpu else {}
    sample_kernel[(B, nchunk)](
        logits, logits.stride(0), params, uniforms if uniforms is not None else logits, rec,
        split_k_counters(logits.device, B), out, V, nchunk,
        CHUNK=chunk, KMAX=kmax, MERGE=triton.next_power_of_2(nchunk * kmax),
        GREEDY_EPS=GREEDY_TEMPERATURE, U_FROM_PTR=uniforms is not None, **extra,
    )
    return out


def supports(top_ks, vocab: int) -> bool:
    """Whether the kernel takes rows of these top_k values (greedy rows: pass 1):
    1 <= top_k <= MAX_TOP_K and top_k < vocab."""
    return all(1 <= int(k) <= MAX_TOP_K and int(k) < vocab for k in top_ks)


__all__ = ["GREEDY_TEMPERATURE", "MAX_TOP_K", "launch_sample", "pack_params", "sample_kernel",
           "supports"]


def aot_probe_specs():
    """Compile specs for `scripts/triton_aot_probe.py` (sm_90 without a GPU): the full
    vocabulary's launch (GPU_CHUNK, GPU_NUM_WARPS) for top_k up to 32 (the default 20)
    and up to MAX_TOP_K, Philox uniforms."""
    types = {"logits_ptr": "*fp32", "stride_row": "i32", "params_ptr": "*i64", "u_ptr": "*fp32",
             "rec_ptr": "*fp32", "counter_ptr": "*i32", "out_ptr": "*i64", "V": "i32", "NCHUNK": "i32"}
    nchunk = triton.cdiv(151552, GPU_CHUNK)
    specs = []
    for kmax in (32, MAX_TOP_K):
        specs.append({
            "name": f"sample top_k <= {kmax} V=151552 CHUNK={GPU_CHUNK} warps={GPU_NUM_WARPS}",
            "fn": sample_kernel,
            "signature": {n: types.get(n, "constexpr") for n in sample_kernel.arg_names},
            "constexprs": {"CHUNK": GPU_CHUNK, "KMAX": kmax,
                           "MERGE": triton.next_power_of_2(nchunk * kmax),
                           "GREEDY_EPS": GREEDY_TEMPERATURE, "U_FROM_PTR": False},
            "num_warps": GPU_NUM_WARPS, "num_stages": 1,
        })
    return specs
