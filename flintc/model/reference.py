"""The reference Flint model: plain PyTorch, FLINT_SPEC sections 2 and 3 to the letter.

`FlintModel(config, weights, mode)` holds the canonical weights (see
`flintc.model.weights`) as buffers and runs one step over new tokens: a prefill of
T tokens per sequence or a decode step (T = 1), reading and writing the KV cache
in place. The forward has no Python control flow that depends on tensor values,
so torch.fx can trace it; routed experts are gathered per token (top-k only,
never all E). The model knows nothing of passes or kernels.

KV cache (one pair of tensors per layer, see `new_kv_cache`): full-attention
layers keep every position, [num_slots, S_max, Hkv, D]; sliding layers keep a
ring buffer of the last W positions, [num_slots, W, Hkv, D], position p in slot
p % W. The ring is W rows whatever the cache length, as in the compiled runtime, its
passes and kernels (ring rows == W everywhere); a W longer than the sequences could be
cut to their length without changing a number, but FlintConfig refuses a W above
max_position_embeddings instead, which bounds the ring by a full layer's cache. A forward writes k (after norm and RoPE) and v for its new tokens into the
cache rows named by `slots`.
"""

from __future__ import annotations

import torch
from torch import nn

from flintc.config import FlintConfig
from flintc.model import ops
from flintc.model.weights import Weight, WeightDict, check_weights
from flintc.quant.nvfp4 import NVFP4Tensor

MODES = {"bf16": (torch.bfloat16, torch.float32), "float64": (torch.float64, torch.float64)}


def kv_cache_shapes(config: FlintConfig, num_slots: int, max_len: int) -> list[tuple[int, int, int, int]]:
    """The shapes of the tensors `FlintModel.new_kv_cache(num_slots, max_len)`
    allocates, in its order [k_0, v_0, k_1, v_1, ...]: a full-attention layer's K and
    V are [num_slots, max_len, Hkv, D] each, a sliding layer's [num_slots, W, Hkv, D]
    (a ring of sliding_window rows at any max_len). The one place that sizes the KV
    caches: the allocation, the build's plan (`flintc.runtime.build`) and the serve
    memory check (`kv_cache_bytes`) all read it."""
    c = config
    out: list[tuple[int, int, int, int]] = []
    for i in range(c.num_hidden_layers):
        rows = c.sliding_window if c.is_sliding_layer(i) else max_len
        shape = (num_slots, rows, c.num_key_value_heads, c.head_dim)
        out += [shape, shape]
    return out


def kv_cache_bytes(config: FlintConfig, num_slots: int, max_len: int, itemsize: int = 2,
                   sliding_only: bool = False) -> int:
    """Bytes of `FlintModel.new_kv_cache(num_slots, max_len)` (the tensors of
    `kv_cache_shapes`) at `itemsize` bytes a value (2: bf16, the activation dtype of
    the default mode; 8 in float64 mode). `sliding_only`: the sliding layers' rings
    alone (K and V; the same at any max_len). An int, in bytes."""
    shapes = kv_cache_shapes(config, num_slots, max_len)
    total = 0
    for i in range(config.num_hidden_layers):
        if sliding_only and not config.is_sliding_layer(i):
            continue
        for n_slots, rows, heads, dim in shapes[2 * i:2 * i + 2]:
            total += n_slots * rows * heads * dim
    return total * itemsize


class WeightHolder(nn.Module):
    """One weight as buffers: `weight` (a plain tensor), or `codes`, `scales` and
    `global_scale` (NVFP4). `value` returns it as a tensor or an NVFP4Tensor."""

    def __init__(self, w: Weight, name: str):
        super().__init__()
        self.name = name  # the canonical weight name (flintc.model.weights)
        self.is_nvfp4 = isinstance(w, NVFP4Tensor)
        if self.is_nvfp4:
            self.register_buffer("codes", w.codes)
            self.register_buffer("scales", w.scales)
            self.register_buffer("global_scale", w.global_scale)
        else:
            self.register_buffer("weight", w)

    @property
    def value(self) -> Weight:
        if self.is_nvfp4:
            return NVFP4Tensor(self.codes, self.scales, self.global_scale)
        return self.weight


def _holders(weights: WeightDict, prefix: str, names: dict[str, str]) -> nn.ModuleDict:
    return nn.ModuleDict({a: WeightHolder(weights[prefix + n], prefix + n) for a, n in names.items()})


class Attention(nn.Module):
    """QKV projections, per-head Q/K RMSNorm, RoPE (sliding layers), KV-cache write,
    attention with sinks over the visible keys, O projection."""

    def __init__(self, config: FlintConfig, weights: WeightDict, i: int):
        super().__init__()
        self.config, self.is_sliding = config, config.is_sliding_layer(i)
        p = f"model.layers.{i}.self_attn."
        self.w = _holders(weights, p, {
            "q": "q_proj.weight", "k": "k_proj.weight", "v": "v_proj.weight", "o": "o_proj.weight",
            "q_norm": "q_norm.weight", "k_norm": "k_norm.weight", "sinks": "sinks",
        })

    def forward(self, x, positions, slots, cos, sin, visible, k_cache, v_cache, cdt):
        c, w = self.config, self.w
        B, T, _ = x.shape
        x2 = x.reshape(B * T, -1)  # [N, H]
        q = ops.linear(x2, w["q"].value, cdt).view(B, T, c.num_attention_heads, c.head_dim)
        k = ops.linear(x2, w["k"].value, cdt).view(B, T, c.num_key_value_heads, c.head_dim)
        v = ops.linear(x2, w["v"].value, cdt).view(B, T, c.num_key_value_heads, c.head_dim)
        q = ops.rms_norm(q, w["q_norm"].value, c.rms_norm_eps, cdt)  # [B, T, Hq, D]
        k = ops.rms_norm(k, w["k_norm"].value, c.rms_norm_eps, cdt)  # [B, T, Hkv, D]
        if self.is_sliding:
            q = ops.apply_rope(q, cos, sin, cdt)
            k = ops.apply_rope(k, cos, sin, cdt)
            keys, values = self._sliding_kv(k, v, positions, slots, k_cache, v_cache)
        else:
            k_cache[slots[:, None], positions] = k  # [B, T] rows of [S_max, Hkv, D]
            v_cache[slots[:, None], positions] = v
            keys, values = k_cache[slots], v_cache[slots]  # [B, S_max, Hkv, D]
        o = ops.attention_with_sink(q, keys, values, visible, w["sinks"].value, cdt)  # [B, T, Hq*D]
        return ops.linear(o.reshape(B * T, -1), w["o"].value, cdt).view(B, T, -1)  # [B, T, H]

    def _sliding_kv(self, k, v, positions, slots, k_cache, v_cache):
        """Keys/values a sliding layer's new tokens may see: the ring as it was
        (positions `ring_pos`), then the new tokens; then the last min(T, W) new
        tokens overwrite their ring slots."""
        W, T = self.config.sliding_window, k.shape[1]
        keys = torch.cat([k_cache[slots], k], dim=1)  # [B, W+T, Hkv, D]
        values = torch.cat([v_cache[slots], v], dim=1)
        n = min(T, W)  # a prefill longer than W keeps only its last W tokens
        ring_slot = positions[:, T - n:] % W  # [B, n]
        k_cache[slots[:, None], ring_slot] = k[:, T - n:]
        v_cache[slots[:, None], ring_slot] = v[:, T - n:]
        return keys, values


class DenseMLP(nn.Module):
    """`down(bf16(silu(gate(x)) * up(x)))`."""

    def __init__(self, weights: WeightDict, prefix: str):
        super().__init__()
        self.w = _holders(weights, prefix, {
            "gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight",
        })

    def forward(self, x, cdt):  # x: [N, H]
        g = ops.linear(x, self.w["gate"].value, cdt)  # [N, F]
        u = ops.linear(x, self.w["up"].value, cdt)  # [N, F]
        return ops.linear(ops.silu_mul(g, u, cdt), self.w["down"].value, cdt)  # [N, H]


class MoE(nn.Module):
    """Sigmoid router, bias-corrected top-k, the selected experts only, shared expert,
    fp32 weighted combine (FLINT_SPEC 2, MoE steps 1-6)."""

    def __init__(self, config: FlintConfig, weights: WeightDict, i: int):
        super().__init__()
        self.config = config
        p = f"model.layers.{i}.mlp."
        self.w = _holders(weights, p, {
            "router": "gate.weight", "bias": "gate.e_score_correction_bias",
            "gate": "experts.gate_proj.weight", "up": "experts.up_proj.weight",
            "down": "experts.down_proj.weight",
        })
        self.shared = DenseMLP(weights, p + "shared_experts.") if config.n_shared_experts else None

    def forward(self, x, cdt):  # x: [N, H]
        c, w = self.config, self.w
        weights, selected = ops.route_topk(
            x, w["router"].value, w["bias"].value, c.num_experts_per_tok, c.routed_scaling_factor, cdt
        )  # [N, K] each
        y = ops.routed_experts(x, w["gate"].value, w["up"].value, w["down"].value, selected, cdt)
        shared = self.shared(x, cdt) if self.shared is not None else None  # [N, H]
        return ops.expert_combine(y, weights, shared, cdt)  # [N, H]


class DecoderLayer(nn.Module):
    def __init__(self, config: FlintConfig, weights: WeightDict, i: int):
        super().__init__()
        p = f"model.layers.{i}."
        self.eps = config.rms_norm_eps
        self.norms = _holders(weights, p, {
            "input": "input_layernorm.weight", "post": "post_attention_layernorm.weight",
        })
        self.self_attn = Attention(config, weights, i)
        self.is_moe = config.is_moe_layer(i)
        self.mlp = MoE(config, weights, i) if self.is_moe else DenseMLP(weights, p + "mlp.")

    def forward(self, x, positions, slots, cos, sin, visible, k_cache, v_cache, cdt):
        B, T, H = x.shape
        h = ops.rms_norm(x, self.norms["input"].value, self.eps, cdt)  # [B, T, H]
        a = self.self_attn(h, positions, slots, cos, sin, visible, k_cache, v_cache, cdt)
        x = ops.residual_add(x, a, cdt)  # [B, T, H]
        h = ops.rms_norm(x, self.norms["post"].value, self.eps, cdt).reshape(B * T, H)  # [N, H]
        return ops.residual_add(x, self.mlp(h, cdt).view(B, T, H), cdt)  # [B, T, H]


class FlintModel(nn.Module):
    """The Flint decoder (FLINT_SPEC sections 2-3) in one numeric `mode`.

    Args:
        config: the model shape.
        weights: the canonical weight dict (BF16 or NVFP4 linears), see `weight_specs`.
        mode: "bf16" (reference numerics: bf16 activations, fp32 inside every op) or
            "float64" (no rounding anywhere; the oracle).
        max_positions: rows of the RoPE tables (default `max_position_embeddings`):
            the positions this model will be run at, as vLLM sizes by max_model_len. The
            runners pass `--max-model-len` when given (a config's 2**22 positions made
            1 GB of tables for a 64-token run); row p is the same for any count, so this
            changes no number.

    Raises:
        CheckpointError: `weights` does not match `config` (via `check_weights`).
        ValueError: unknown mode.
    """

    def __init__(self, config: FlintConfig, weights: WeightDict, mode: str = "bf16",
                 max_positions: int | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown numeric mode {mode!r}; expected one of {sorted(MODES)}")
        check_weights(config, weights)
        self.config, self.mode = config, mode
        self.act_dtype, self.compute_dtype = MODES[mode]
        self.max_positions = max_positions or config.max_position_embeddings
        self.embed = WeightHolder(weights["model.embed_tokens.weight"], "model.embed_tokens.weight")
        self.layers = nn.ModuleList(DecoderLayer(config, weights, i) for i in range(config.num_hidden_layers))
        self.norm = WeightHolder(weights["model.norm.weight"], "model.norm.weight")
        self.lm_head = WeightHolder(weights["lm_head.weight"], "lm_head.weight")
        device = weights["model.norm.weight"].device
        cos, sin = ops.rope_tables(config.rope_theta, config.head_dim, self.max_positions, self.compute_dtype)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)  # [P, D/2]
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def new_kv_cache(self, num_slots: int, max_len: int, device=None) -> list[torch.Tensor]:
        """Zeroed KV cache, [k_0, v_0, k_1, v_1, ...] of the shapes `kv_cache_shapes`
        gives: full layers [num_slots, max_len, Hkv, D], sliding layers [num_slots, W,
        Hkv, D]; activation dtype, on `device` (default: the model's). Bytes:
        `kv_cache_bytes` with the activation dtype's itemsize."""
        device = device or self.rope_cos.device
        return [torch.zeros(shape, dtype=self.act_dtype, device=device)
                for shape in kv_cache_shapes(self.config, num_slots, max_len)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kv_cache: list[torch.Tensor], logits_rows: torch.Tensor | None = None):
        """One step over T new tokens per sequence.

        Args:
            input_ids: int64 [B, T], token ids < vocab_size.
            positions: int64 [B, T], consecutive absolute positions (p0, p0+1, ...),
                below `max_positions` and below the full layers' cache length.
            slots: int64 [B], the cache row of each sequence.
            kv_cache: from `new_kv_cache`; updated in place.
            logits_rows: None (every position's logits), or int64 [M]: the rows of the
                step's B*T tokens (row b*T + t is sequence b's token t) whose logits are
                wanted, as vLLM's logits_indices: the LM head runs on those rows only
                (a prefill samples one token per sequence: its last real row).

        Returns:
            logits [B, T, V], fp32 (float64 in float64 mode); with `logits_rows`, the
            tuple (logits [M, V] of those rows, the final-normed hidden states [B, T, H]
            in the activation dtype: `lm_head` of their rows gives the other positions'
            logits, as `logits_from_hidden` does).
        """
        c, cdt = self.config, self.compute_dtype
        B, T = input_ids.shape
        x = self.embed.value[input_ids].to(self.act_dtype)  # [B, T, H]
        cos = sin = None  # RoPE is for the sliding layers only: none, no lookup (a dead node in a capture)
        if "sliding_attention" in c.layer_types:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [B, T, D/2]
        full_visible, sliding_visible = self._visibility(positions, kv_cache)
        for i, layer in enumerate(self.layers):
            visible = sliding_visible if c.is_sliding_layer(i) else full_visible
            x = layer(x, positions, slots, cos, sin, visible, kv_cache[2 * i], kv_cache[2 * i + 1], cdt)
        if logits_rows is not None:
            h = ops.rms_norm(x, self.norm.value, c.rms_norm_eps, cdt)  # [B, T, H]
            picked = h.reshape(B * T, -1).index_select(0, logits_rows)  # [M, H]
            return ops.lm_head(picked, self.lm_head.value, cdt), h  # [M, V], [B, T, H]
        h = ops.rms_norm(x, self.norm.value, c.rms_norm_eps, cdt).reshape(B * T, -1)  # [N, H]
        return ops.lm_head(h, self.lm_head.value, cdt).view(B, T, -1)  # [B, T, V]

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed hidden states [..., H] (the second output of
        `forward` with `logits_rows`): fp32 logits [..., V], the same op and dtypes as
        `forward` applies to every position without `logits_rows`."""
        h = hidden.reshape(-1, hidden.shape[-1])
        return ops.lm_head(h, self.lm_head.value, self.compute_dtype).view(*hidden.shape[:-1], -1)

    def _visibility(self, positions: torch.Tensor, kv_cache: list[torch.Tensor]):
        """Masks of the keys each query sees: causal (j <= i) for full layers over
        cache rows 0..S_max-1; causal and within the window (i - j < W) for sliding
        layers over [ring as it was, new tokens]. Returns (full [B, T, S_max] or None,
        sliding [B, T, W+T] or None)."""
        c = self.config
        qpos = positions[:, :, None]  # [B, T, 1]
        full = sliding = None
        if "full_attention" in c.layer_types:
            s_max = kv_cache[2 * c.layer_types.index("full_attention")].shape[1]
            key_pos = torch.arange(s_max, device=positions.device)  # [S_max]
            full = key_pos[None, None, :] <= qpos  # [B, T, S_max]
        if "sliding_attention" in c.layer_types:
            W = c.sliding_window
            p0 = positions[:, :1]  # [B, 1]
            slot = torch.arange(W, device=positions.device)[None, :]  # [1, W]
            ring_pos = p0 - 1 - torch.remainder(p0 - 1 - slot, W)  # [B, W]; < 0: never written
            key_pos = torch.cat([ring_pos, positions], dim=1)[:, None, :]  # [B, 1, W+T]
            sliding = (key_pos >= 0) & (key_pos <= qpos) & (qpos - key_pos < W)  # [B, T, W+T]
        return full, sliding
