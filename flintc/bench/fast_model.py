"""The fast plain-PyTorch Flint decoder: the model a PyTorch user would write for speed,
the network behind `flintc bench`'s "fast" baseline (torch.compile of its decode step).

`FastFlintModel(config, weights)` computes what `flintc.model.reference.FlintModel`
does, with the same forward signature, KV-cache layout (`new_kv_cache`, ring buffers for
the sliding layers, rows named by `slots`) and weight holders (it subclasses it and
shares its buffers: no weight is copied), but written the way HF transformers and the
gpt-oss reference code are, where the reference computes every op in fp32:

- activations bf16 ([B, T, H]); every GEMM a bf16 GEMM (`F.linear` / `@`: cuBLAS
  accumulates in fp32 and rounds its output to bf16);
- NVFP4 weights: each call dequantizes the packed codes to bf16 (`nvfp4_to_bf16`:
  `e2m1 * E4M3 block scale` is exact in bf16), runs the bf16 GEMM, then multiplies the
  output by the fp32 global scale and rounds to bf16. Hopper has no FP4 GEMM in torch
  (`torch._scaled_mm`'s FP4 path needs sm_100), so this is the plain-torch W4A16 path;
- RMSNorm (hidden, per-head Q/K, final) in fp32, rounded to bf16 once (HF style);
  RoPE from the reference's fp32 tables, in fp32, rounded once; SiLU-and-mul likewise;
- attention: q @ k^T as a bf16 GEMM per KV head (the G query heads of a KV head are
  folded into the GEMM's rows, so K is never repeated); full layers whose caches hold a
  slot per sequence (the benchmark's baselines) read them in place, the queries put in
  slot order, else the sequences' cache rows are gathered (`k_cache[slots]`); the scores then scaled,
  masked and, with the learned sink logit concatenated (gpt-oss), softmaxed in fp32;
  the sink's column dropped, probabilities rounded to bf16, then the bf16 GEMM with V;
- MoE: router bf16 GEMM -> fp32 logits, the spec's sigmoid + bias top-k
  (`flintc.model.ops.select_topk`); bf16 experts as one grouped GEMM per projection
  (`torch._grouped_mm` over the (token, expert) rows sorted by expert: each distinct
  selected expert read once, in place; sm_90 / sm_100 and CPU) from `GROUPED_MIN_ROWS`
  (token, expert) rows on, NVFP4 experts (and bf16 below that, or where grouped_mm
  cannot run without a host sync) gathered per token (`w[ids]`, never all E) and
  multiplied in bf16: the faster form at each size; the shared expert, the weighted combine in fp32
  rounded once; residual adds in bf16 (`x + y`);
- LM head: bf16 GEMM, the logits then widened to fp32.

A speed baseline, not a reference: it rounds where bf16 GEMMs round (every GEMM's
output, the router logits, the attention scores and probabilities), not at
FLINT_SPEC section 3's rounding points. tests/bench/test_fast_model.py bounds its
distance to the reference model on the CPU.

The helpers `nvfp4_to_bf16`, `linear` (and its multiply-and-sum form `linear_mulsum`),
`logits` and `experts` are the plain-torch ops
`benchmarks/torch_baselines.py` (the kernel benchmarks' baselines) uses too; weights go
to them as lists, `[w]` (bf16 [..., F, K]) or `[codes, scales, global_scale]` (NVFP4:
uint8 [..., F, K/2], float8_e4m3fn [..., F, K/16], fp32 [] or [E]; the packed layout).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flintc.config import FlintConfig
from flintc.kernels.platform import grouped_mm_fn, grouped_mm_sync_free
from flintc.model import ops
from flintc.model.reference import FlintModel, WeightHolder
from flintc.model.weights import WeightDict
from flintc.quant.nvfp4 import BLOCK, NVFP4Tensor, decode_e2m1

F32 = torch.float32
BF16 = torch.bfloat16


# -- plain-torch ops (shared with benchmarks/torch_baselines.py) ------------------------------
def nvfp4_to_bf16(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed NVFP4 -> bf16 [..., F, K] of `e2m1 * block scale` (no global scale), exact:
    a product has at most 6 significant bits (2 of e2m1 times 4 of E4M3, e.g. 1.5 x 1.875
    = 2.8125), bf16 holds 8, and its exponent range holds every product. codes: uint8
    [..., F, K/2], element 2j in the low nibble; scales: float8_e4m3fn [..., F, K/16].
    Raises ValueError on mismatched shapes."""
    if codes.shape[:-1] != scales.shape[:-1] or codes.shape[-1] * 2 != scales.shape[-1] * BLOCK:
        raise ValueError(f"nvfp4_to_bf16: codes {tuple(codes.shape)} and scales "
                         f"{tuple(scales.shape)} do not describe one [..., F, K] matrix "
                         f"(codes [..., F, K/2], scales [..., F, K/{BLOCK}])")
    v = torch.stack([decode_e2m1(codes & 0x0F, BF16), decode_e2m1(codes >> 4, BF16)], dim=-1)
    v = v.flatten(-2).unflatten(-1, (-1, BLOCK))  # [..., F, K/16, 16]
    return (v * scales.to(BF16)[..., None]).flatten(-2)


def linear(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """bf16 `x @ W^T`. x: bf16 [N, K]; w: `[W]` or `[codes, scales, global_scale]` for a
    [F, K] matrix. -> bf16 [N, F]."""
    if len(w) == 1:
        return F.linear(x, w[0])
    return (F.linear(x, nvfp4_to_bf16(w[0], w[1])).to(F32) * w[2].to(F32)).to(BF16)


def linear_mulsum(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
    """`x @ W^T` written as a multiply-and-sum over K, for `torch.compile` of decode
    GEMVs: `sum_k x[n, k] * W[f, k]` in fp32 (NVFP4: `e2m1 * block scale` decoded inside
    the expression), times the global scale, rounded to bf16 once. Inductor fuses the
    decode, the product and the sum into one reduction kernel that reads the packed weight
    in place (one generated kernel on the CPU backend; `tests/bench/test_torch_baselines.py`),
    where `linear`'s dequantize-then-GEMM writes a bf16 copy of W first. Eager, it
    materialises [N, F, K] fp32 products: only meant to be compiled. x: bf16 [N, K]; w as
    `linear`'s. -> bf16 [N, F]."""
    wf = w[0].to(F32) if len(w) == 1 else nvfp4_to_bf16(w[0], w[1]).to(F32)
    y = (x.to(F32)[:, None, :] * wf[None]).sum(-1)  # [N, F]
    return y.to(BF16) if len(w) == 1 else (y * w[2].to(F32)).to(BF16)


def logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """LM head: bf16 GEMM, logits then widened to fp32. h: bf16 [N, H]; w: bf16 [V, H]."""
    return F.linear(h, w).to(F32)


def grouped_experts_apply(device: torch.device) -> bool:
    """Whether `experts` runs bf16 experts as one grouped GEMM on `device`: torch has
    grouped_mm and, on CUDA, its CUTLASS path reads the group offsets on the device
    (sm_90 / sm_100; elsewhere torch copies them to the host, which CUDA-graph capture
    forbids). CPU: torch's own fallback."""
    if grouped_mm_fn() is None:
        return False
    if device.type == "cpu":  # torch's CPU grouped_mm came with the public API (torch 2.9)
        return getattr(F, "grouped_mm", None) is not None
    return grouped_mm_sync_free(device)


@torch.library.custom_op("flintc_fast::grouped_mm", mutates_args=())
def _grouped_mm_op(rows: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped_mm behind an opaque op: torch.compile(mode="max-autotune")
    otherwise autotunes Inductor's grouped-GEMM templates and the aten kernel on made-up
    group offsets, which trip the aten kernel's device-side bounds assert and kill the
    CUDA context (torch 2.11 on an H100, docs/gpu-runs.md session 37). Inductor runs
    this op as it is (cuBLAS-style extern call), inside its CUDA graphs. Inference only:
    it has no autograd formula (the baseline never differentiates)."""
    return grouped_mm_fn()(rows, w_t, offs=offs)


@_grouped_mm_op.register_fake
def _(rows: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], w_t.shape[-1])


def _experts_grouped(x: torch.Tensor, ids: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """bf16 experts as one grouped GEMM: the N x K (token, expert) rows sorted by expert,
    group offsets counted on the device (no host sync, fixed shapes), each distinct
    expert's matrix read once, in place. x: bf16 [N, In] or [N, K, In]; ids: int64
    [N, K]; W: bf16 [E, Out, In]. -> bf16 [N, K, Out]."""
    N, K = ids.shape
    E, Out, In = W.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = (x[:, None, :].expand(N, K, In) if x.dim() == 2 else x).reshape(N * K, In)
    counts = torch.zeros(E, dtype=torch.int32, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    y = _grouped_mm_op(rows[order].contiguous(), W.transpose(1, 2), offs)  # sorted rows
    return y[torch.argsort(order)].view(N, K, Out)


# From how many (token, expert) rows bf16 experts run as one grouped GEMM rather than
# gathered (`w[ids]`). Measured on the fast model's decode step, 6 full-width layers,
# CUDA graphs (scripts/gpu_fast_parts.py, docs/benchmarks/fast-parts-2026-12-07-s46-h200.md,
# H200, torch 2.11): grouped / gathered 1.030 / 0.947 ms at 6 rows (b1), 1.117 / 1.141 at
# 12 (b2), 1.281 / 1.419 at 24 (b4); at 48 (b8) the MoE layer alone 184 / 373 us (H100,
# session 37). At b1 the three grouped GEMMs per layer (15 us each) cost more than the
# gather of six experts' weights (18 us per layer) and its batched GEMMs.
GROUPED_MIN_ROWS = 12


def experts(x: torch.Tensor, ids: torch.Tensor, w: list[torch.Tensor],
            grouped: bool | None = None) -> torch.Tensor:
    """Each token's selected experts' GEMVs. x: bf16 [N, In] (every expert of a token
    reads it) or [N, K, In] (one row per selected expert); ids: int64 [N, K]; w: stacked
    [E, Out, In] as `[W]` or `[codes, scales, global_scale ([E] or [])]`. bf16 with
    `grouped` (None: `grouped_experts_apply(ids.device)`, a device query that a compiled
    caller should make once, outside the traced code) and at least `GROUPED_MIN_ROWS`
    rows N x K (a shape, fixed at trace time): one grouped GEMM over the rows
    sorted by expert, reading each distinct selected expert once, in place (what prefill
    MoE code does with `torch._grouped_mm`); otherwise, and for NVFP4 (grouped_mm takes
    no FP4 operand), the N x K selected matrices gathered (`w[ids]`; NVFP4: the packed
    codes and scales, dequantized after the gather), never all E. -> bf16 [N, K, Out]."""
    if grouped is None:
        grouped = grouped_experts_apply(ids.device)
    if len(w) == 1 and grouped and ids.numel() >= GROUPED_MIN_ROWS:
        return _experts_grouped(x, ids, w[0])
    xk = x[:, None, :, None] if x.dim() == 2 else x[..., None]  # [N, 1 | K, In, 1]
    if len(w) == 1:
        return (w[0][ids] @ xk)[..., 0]
    y = (nvfp4_to_bf16(w[0][ids], w[1][ids]) @ xk)[..., 0]  # [N, K, Out]
    g = w[2].to(F32) if w[2].dim() == 0 else w[2][ids].to(F32)[..., None]  # [] or [N, K, 1]
    return (y.to(F32) * g).to(BF16)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
              sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a learned sink per query head, bf16 GEMMs and an fp32 softmax.

    q: bf16 [B, T, Hq, D]; keys, values: bf16 [B, S, Hkv, D] (the cache's layout);
    visible: bool [B, T, S]; sinks: fp32 [Hq]. Query head h reads KV head h // G. The G
    query heads of a KV head are the rows of one GEMM with its keys ([G*T, D] x [D, S]).
    Returns o bf16 [B, T, Hq*D]; a query that sees no key gets o = 0."""
    B, T, Hq, D = q.shape
    S, Hkv = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    qh = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    scores = (qh @ keys.permute(0, 2, 3, 1)).view(B, Hkv, G, T, S).to(F32) * (D**-0.5)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    sink = sinks.to(F32).view(1, Hkv, G, 1, 1).expand(B, Hkv, G, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [B, Hkv, G, T, S]
    o = probs.to(BF16).reshape(B, Hkv, G * T, S) @ values.permute(0, 2, 1, 3)  # [B, Hkv, G*T, D]
    return o.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq * D)


def _w(h: WeightHolder) -> list[torch.Tensor]:
    """A holder's tensors as the ops above take them (the buffers themselves, no copy)."""
    return [h.codes, h.scales, h.global_scale] if h.is_nvfp4 else [h.weight]


# -- the model --------------------------------------------------------------------------------
class FastFlintModel(FlintModel):
    """The Flint decoder in plain PyTorch written for speed (module doc): bf16 GEMMs,
    NVFP4 dequantized to bf16 per call, fp32 norms and softmax.

    Args:
        config: the model shape.
        weights: the canonical weight dict (BF16 or NVFP4 linears; NVFP4 in the mma
            layout is unpacked to the packed one first).
        max_positions: rows of the RoPE tables (default `max_position_embeddings`).

    `forward(input_ids [B, T], positions [B, T], slots [B], kv_cache, logits_rows=None)`
    and `new_kv_cache` are `FlintModel`'s (bf16 caches); logits fp32 [B, T, V] (with
    `logits_rows`: fp32 [M, V] and the final-normed bf16 hidden states [B, T, H]).

    `grouped_experts`: whether bf16 experts may run as one grouped GEMM
    (`grouped_experts_apply` of the weights' device, set at construction and after
    `.to()`, so that `forward` queries no device property and Dynamo traces no device
    query; `experts` also needs `GROUPED_MIN_ROWS` rows).

    Raises:
        CheckpointError: `weights` does not match `config`.
    """

    def __init__(self, config: FlintConfig, weights: WeightDict, max_positions: int | None = None):
        weights = {k: v.packed() if isinstance(v, NVFP4Tensor) else v for k, v in weights.items()}
        super().__init__(config, weights, mode="bf16", max_positions=max_positions)
        self.grouped_experts = grouped_experts_apply(self.embed.weight.device)

    def _apply(self, fn, *args, **kwargs):  # .to() / .cuda(): the device may change
        out = super()._apply(fn, *args, **kwargs)
        if hasattr(self, "grouped_experts"):
            self.grouped_experts = grouped_experts_apply(self.embed.weight.device)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kv_cache: list[torch.Tensor], logits_rows: torch.Tensor | None = None):
        c = self.config
        B, T = input_ids.shape
        x = self.embed.weight[input_ids]  # [B, T, H] bf16
        cos = sin = None
        if "sliding_attention" in c.layer_types:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # fp32 [B, T, D/2]
        full_visible, sliding_visible = self._visibility(positions, kv_cache)
        for i, layer in enumerate(self.layers):
            visible = sliding_visible if c.is_sliding_layer(i) else full_visible
            h = ops.rms_norm(x, layer.norms["input"].weight, c.rms_norm_eps, F32)
            x = x + self._attention(layer.self_attn, h, positions, slots, cos, sin, visible,
                                    kv_cache[2 * i], kv_cache[2 * i + 1])
            h = ops.rms_norm(x, layer.norms["post"].weight, c.rms_norm_eps, F32).reshape(B * T, -1)
            mlp = self._moe(layer.mlp, h) if layer.is_moe else self._dense(layer.mlp.w, h)
            x = x + mlp.view(B, T, -1)
        h = ops.rms_norm(x, self.norm.weight, c.rms_norm_eps, F32)  # [B, T, H]
        if logits_rows is not None:
            return logits(h.reshape(B * T, -1).index_select(0, logits_rows), self.lm_head.weight), h
        return logits(h.reshape(B * T, -1), self.lm_head.weight).view(B, T, -1)

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed bf16 hidden states [..., H] -> fp32 [..., V]."""
        return logits(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight).view(*hidden.shape[:-1], -1)

    def _attention(self, attn, x, positions, slots, cos, sin, visible, k_cache, v_cache):
        c, w = self.config, attn.w
        B, T, _ = x.shape
        x2 = x.reshape(B * T, -1)
        q = linear(x2, _w(w["q"])).view(B, T, c.num_attention_heads, c.head_dim)
        k = linear(x2, _w(w["k"])).view(B, T, c.num_key_value_heads, c.head_dim)
        v = linear(x2, _w(w["v"])).view(B, T, c.num_key_value_heads, c.head_dim)
        q = ops.rms_norm(q, w["q_norm"].weight, c.rms_norm_eps, F32)
        k = ops.rms_norm(k, w["k_norm"].weight, c.rms_norm_eps, F32)
        if attn.is_sliding:
            q = ops.apply_rope(q, cos, sin, F32)
            k = ops.apply_rope(k, cos, sin, F32)
            keys, values = attn._sliding_kv(k, v, positions, slots, k_cache, v_cache)  # the reference's ring
        else:
            k_cache[slots[:, None], positions] = k
            v_cache[slots[:, None], positions] = v
            if k_cache.shape[0] == B:  # a slot per sequence (slots a permutation of 0..B-1):
                # the caches read in place, the queries (and masks) put in slot order and
                # the outputs back, instead of a gathered copy of every key and value
                inv = torch.argsort(slots)  # inv[s]: the batch row in slot s
                o = attention(q[inv], k_cache, v_cache, visible[inv], w["sinks"].weight)[slots]
                return linear(o.reshape(B * T, -1), _w(w["o"])).view(B, T, -1)
            keys, values = k_cache[slots], v_cache[slots]  # [B, S_max, Hkv, D]
        o = attention(q, keys, values, visible, w["sinks"].weight)  # [B, T, Hq*D]
        return linear(o.reshape(B * T, -1), _w(w["o"])).view(B, T, -1)

    @staticmethod
    def _dense(w, x):  # SwiGLU MLP, x: bf16 [N, H] -> [N, H]
        a = ops.silu_mul(linear(x, _w(w["gate"])), linear(x, _w(w["up"])), F32)
        return linear(a, _w(w["down"]))

    def _moe(self, moe, x):  # x: bf16 [N, H] -> [N, H]
        c, w = self.config, moe.w
        weights, ids = ops.select_topk(logits(x, w["router"].weight), w["bias"].weight,
                                       c.num_experts_per_tok, c.routed_scaling_factor)  # fp32, int64 [N, K]
        g = self.grouped_experts
        a = ops.silu_mul(experts(x, ids, _w(w["gate"]), g), experts(x, ids, _w(w["up"]), g), F32)  # [N, K, F]
        y = experts(a, ids, _w(w["down"]), g)  # [N, K, H]
        shared = self._dense(moe.shared.w, x) if moe.shared is not None else None
        return ops.expert_combine(y, weights, shared, F32)


__all__ = ["GROUPED_MIN_ROWS", "FastFlintModel", "attention", "experts", "grouped_experts_apply", "linear", "linear_mulsum",
           "logits", "nvfp4_to_bf16"]
