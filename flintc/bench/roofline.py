"""Roofline model of one Flint step: the bytes a decode step must read and the FLOPs a
prefill must do, from the canonical weight table (`flintc.model.weights.weight_specs`)
and the storage rules of each weight format.

Bytes per weight (what the checkpoint's tensors occupy on the device, `NVFP4Tensor` as
described in `flintc.quant.nvfp4`):

- kind `linear`, BF16: 2 B per parameter;
- kind `linear`, NVFP4: 1/2 B of E2M1 codes + 1/16 B of E4M3 block scales per
  parameter, plus one fp32 global scale per matrix (one per expert for stacked experts);
- kind `bf16` (embedding, LM head, router): 2 B per parameter;
- kind `fp32` (norm weights, sinks, the router's correction bias): 4 B per parameter.

A decode step of B tokens must read (FLINT_SPEC sections 1-2):

- every weight of every layer except the routed experts, once (whatever B);
- of each MoE layer's routed experts, only the distinct experts the batch selected
  (top-k = 6 per token; B tokens select between 6 and 6 B distinct experts);
- B rows of the embedding and the whole LM head;
- the KV cache each sequence attends over: a sequence at context C (the step that
  makes it C tokens long: C keys, the last one its own) reads C rows in each full
  layer and min(C, W) rows in each sliding layer, each row K and V, Hkv x D bf16.

Activations, the KV rows written and the logits are left out (under 0.1% of the bytes at
batch <= 8). The decode roofline time is bytes / measured copy bandwidth; FLOPs (2 per
multiply-add) over the measured bf16 matmul rate are given as well and the larger of the
two times is the bound (at batch <= 8 it is always the bytes).

Prefill of T tokens must do 2 FLOPs per multiply-add of every linear for every token
(top-k routed experts + shared expert per token, the router), the causal attention
(QK^T and PV, 4 x Hq x D FLOPs per visible query-key pair; a query at position p sees
p + 1 keys in a full layer and min(p + 1, W) in a sliding one) and the LM head for the
last token only (the logits a generation needs); it must read every non-expert weight
once and the experts the prompt selects, counted as the expected number under uniform
routing, E (1 - (1 - k/E)^T) per layer (all 256 from a few hundred tokens on). The
prefill roofline time is max(FLOPs / matmul rate, bytes / copy bandwidth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flintc.config import FlintConfig
from flintc.model.weights import weight_specs

FORMATS = ("bf16", "nvfp4")
KINDS_BYTES = {"bf16": 2, "fp32": 4}


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")


def tensor_bytes(shape: tuple[int, ...], kind: str, fmt: str) -> int:
    """Device bytes of one canonical tensor of `shape` and `kind` (module doc's rules).

    Raises ValueError for an unknown kind or format, or an NVFP4 reduction dim that is
    not a multiple of 16 (the block-scale size)."""
    _check_fmt(fmt)
    n = math.prod(shape)
    if kind == "linear":
        if fmt == "bf16":
            return 2 * n
        if shape[-1] % 16:
            raise ValueError(f"shape: an NVFP4 weight needs K % 16 == 0, got {shape}")
        matrices = shape[0] if len(shape) == 3 else 1
        return n // 2 + n // 16 + 4 * matrices
    if kind in KINDS_BYTES:
        return KINDS_BYTES[kind] * n
    raise ValueError(f"kind: expected linear, bf16 or fp32, got {kind!r}")


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes of one step, by part. `routed_experts` counts the experts read;
    `per_expert` is the bytes of one expert (gate + up + down) of one layer."""

    layers_dense: int  # attention, norms, dense MLPs, routers, shared experts of all layers
    routed_experts: int
    embedding: int
    lm_head: int  # final norm + LM head
    per_expert: int

    @property
    def total(self) -> int:
        return self.layers_dense + self.routed_experts + self.embedding + self.lm_head

    def as_dict(self) -> dict:
        return {"layers_dense": self.layers_dense, "routed_experts": self.routed_experts,
                "embedding": self.embedding, "lm_head": self.lm_head,
                "per_expert": self.per_expert, "total": self.total}


def moe_layers(config: FlintConfig) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def weight_bytes(config: FlintConfig, fmt: str, experts_read, embedding_rows: int) -> WeightBytes:
    """Weight bytes a step reads.

    Args:
        config: the model shape.
        fmt: "bf16" or "nvfp4" (the linear weights' format).
        experts_read: distinct routed experts read per MoE layer: one number for every
            layer, or a dict {layer index: number} (a mean over steps may be fractional).
            Use `config.n_routed_experts` for "all experts".
        embedding_rows: embedding rows read (the step's tokens; V for the whole table).

    Raises ValueError for an unknown format or a count outside [0, E].
    """
    _check_fmt(fmt)
    E = config.n_routed_experts
    per_layer = experts_read if isinstance(experts_read, dict) else {i: experts_read for i in moe_layers(config)}
    for i, n in per_layer.items():
        if not 0 <= n <= E:
            raise ValueError(f"experts_read[{i}]: expected 0..{E}, got {n}")
    dense = routed = emb = head = per_expert = 0
    for spec in weight_specs(config):
        b = tensor_bytes(spec.shape, spec.kind, fmt)
        name = spec.name
        if name == "model.embed_tokens.weight":
            emb = b // spec.shape[0] * embedding_rows
        elif name in ("lm_head.weight", "model.norm.weight"):
            head += b
        elif ".mlp.experts." in name:
            layer = int(name.split(".")[2])
            one = b // spec.shape[0]
            per_expert += one if layer == moe_layers(config)[0] else 0
            routed += one * per_layer.get(layer, 0)
        else:
            dense += b
    return WeightBytes(dense, round(routed), emb, head, per_expert)


def kv_bytes_read(config: FlintConfig, context: int) -> int:
    """KV-cache bytes one sequence at `context` reads in one decode step: `context` rows
    per full layer, min(context, W) per sliding layer; K and V, Hkv x D bf16 each.
    Raises ValueError for context < 1."""
    if context < 1:
        raise ValueError(f"context: expected >= 1, got {context}")
    row = 2 * config.num_key_value_heads * config.head_dim * 2
    total = 0
    for i in range(config.num_hidden_layers):
        rows = min(context, config.sliding_window) if config.is_sliding_layer(i) else context
        total += rows * row
    return total


def decode_flops(config: FlintConfig, contexts: list[int]) -> int:
    """FLOPs of one decode step, one token per sequence at the given contexts: 2 per
    multiply-add of the active linears (top-k + shared experts, router, LM head) plus
    attention (4 x Hq x D per visible key)."""
    p = config.num_parameters()
    per_token = 2 * (p["active_layers"] + p["active_lm_head"])
    attn = 0
    for C in contexts:
        for i in range(config.num_hidden_layers):
            keys = min(C, config.sliding_window) if config.is_sliding_layer(i) else C
            attn += 4 * config.num_attention_heads * config.head_dim * keys
    return per_token * len(contexts) + attn


def decode_roofline(config: FlintConfig, fmt: str, contexts: list[int], experts_read,
                    copy_gbs: float, matmul_tflops: float | None = None) -> dict:
    """The roofline of one decode step of len(contexts) sequences.

    Args:
        contexts: the context of each sequence of the step (padding rows of a bucket
            count as context 1).
        experts_read: distinct experts per MoE layer (see `weight_bytes`).
        copy_gbs: measured copy bandwidth, GB/s (1e9 B/s).
        matmul_tflops: measured bf16 matmul rate (None: FLOPs not used).

    Returns {"weight_bytes": {...}, "kv_bytes", "bytes", "flops", "bytes_ms", "flops_ms",
    "ms" (the larger), "bound" ("bytes" or "flops")}. Raises ValueError for copy_gbs <= 0.
    """
    if copy_gbs <= 0:
        raise ValueError(f"copy_gbs: expected > 0, got {copy_gbs}")
    wb = weight_bytes(config, fmt, experts_read, embedding_rows=len(contexts))
    kv = sum(kv_bytes_read(config, C) for C in contexts)
    total = wb.total + kv
    flops = decode_flops(config, contexts)
    bytes_ms = total / (copy_gbs * 1e9) * 1e3
    flops_ms = flops / (matmul_tflops * 1e12) * 1e3 if matmul_tflops else 0.0
    return {"weight_bytes": wb.as_dict(), "kv_bytes": kv, "bytes": total, "flops": flops,
            "bytes_ms": bytes_ms, "flops_ms": flops_ms, "ms": max(bytes_ms, flops_ms),
            "bound": "bytes" if bytes_ms >= flops_ms else "flops"}


def prefill_flops(config: FlintConfig, tokens: int) -> int:
    """FLOPs a prefill of `tokens` tokens (positions 0..T-1) must do (module doc)."""
    if tokens < 1:
        raise ValueError(f"tokens: expected >= 1, got {tokens}")
    p = config.num_parameters()
    linear = 2 * p["active_layers"] * tokens + 2 * p["active_lm_head"]  # LM head: last token
    pairs_full = tokens * (tokens + 1) // 2
    W = config.sliding_window
    if tokens <= W:
        pairs_sliding = pairs_full
    else:
        pairs_sliding = W * (W + 1) // 2 + (tokens - W) * W
    attn = 0
    for i in range(config.num_hidden_layers):
        pairs = pairs_sliding if config.is_sliding_layer(i) else pairs_full
        attn += 4 * config.num_attention_heads * config.head_dim * pairs
    return linear + attn


def prefill_roofline(config: FlintConfig, fmt: str, tokens: int, copy_gbs: float,
                     matmul_tflops: float) -> dict:
    """The roofline of a prefill of `tokens` tokens: max(FLOPs / matmul rate, bytes of
    the weights (experts: the expected distinct count, module doc) + the embedding rows
    / copy bandwidth). Returns the
    same keys as `decode_roofline`. Raises ValueError for non-positive rates."""
    if copy_gbs <= 0 or matmul_tflops <= 0:
        raise ValueError(f"copy_gbs and matmul_tflops: expected > 0, got {copy_gbs}, {matmul_tflops}")
    E = config.n_routed_experts
    expected = E * (1 - (1 - config.num_experts_per_tok / E) ** tokens)
    wb = weight_bytes(config, fmt, expected, embedding_rows=min(tokens, config.vocab_size))
    flops = prefill_flops(config, tokens)
    bytes_ms = wb.total / (copy_gbs * 1e9) * 1e3
    flops_ms = flops / (matmul_tflops * 1e12) * 1e3
    return {"weight_bytes": wb.as_dict(), "kv_bytes": 0, "bytes": wb.total, "flops": flops,
            "bytes_ms": bytes_ms, "flops_ms": flops_ms, "ms": max(bytes_ms, flops_ms),
            "bound": "bytes" if bytes_ms >= flops_ms else "flops"}


def memory_estimate(config: FlintConfig, fmt: str, kv_cache_bytes: int) -> int:
    """Device bytes of all weights plus a build's KV caches (`plan.json` kv_cache.bytes):
    what loading that build needs before any workspace."""
    return weight_bytes(config, fmt, config.n_routed_experts, config.vocab_size).total + kv_cache_bytes


__all__ = ["WeightBytes", "decode_flops", "decode_roofline", "kv_bytes_read", "memory_estimate",
           "prefill_flops", "prefill_roofline", "tensor_bytes", "weight_bytes"]
