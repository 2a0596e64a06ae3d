"""The canonical weight table: every tensor the reference model consumes.

Loaders (BF16 safetensors, NVFP4 GGUF, dummy) all produce the same mapping
`canonical name -> tensor`, described by :func:`weight_specs`. Canonical names are
the Hugging Face names of FLINT_SPEC section 4, except that routed experts are
stacked per layer (`model.layers.{i}.mlp.experts.gate_proj.weight`, [E, Im, H]),
the layout the MoE kernels read. Kinds:

* `linear`: a matmul weight [..., N, K]; a bf16 tensor in BF16 checkpoints, an
  :class:`~flintc.quant.nvfp4.NVFP4Tensor` in NVFP4 ones.
* `bf16`: always bf16 (embedding, LM head, router).
* `fp32`: always fp32 (norm weights, sinks, the correction bias). BF16 checkpoints
  store norm weights in bf16; loaders upcast them, which is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from flintc.config import FlintConfig
from flintc.quant.nvfp4 import NVFP4Tensor

Weight = Union[torch.Tensor, NVFP4Tensor]
WeightDict = dict[str, Weight]

KINDS = ("linear", "bf16", "fp32")


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor: `name`, logical `shape`, `kind` (see module doc),
    `hf_names` (its name(s) in a BF16 checkpoint; one per expert when stacked),
    `gguf_name` (its name in an NVFP4 GGUF file)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    hf_names: tuple[str, ...]
    gguf_name: str

    @property
    def is_stacked(self) -> bool:
        return len(self.hf_names) > 1


def weight_specs(config: FlintConfig) -> list[TensorSpec]:
    """All canonical tensors of a model with `config`, in layer order."""
    c = config
    H, D, V = c.hidden_size, c.head_dim, c.vocab_size
    specs: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], kind: str, gguf: str, hf: tuple[str, ...] | None = None):
        specs.append(TensorSpec(name, tuple(shape), kind, hf or (name,), gguf))

    add("model.embed_tokens.weight", (V, H), "bf16", "token_embd.weight")
    for i in range(c.num_hidden_layers):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        add(p + "input_layernorm.weight", (H,), "fp32", g + "attn_norm.weight")
        add(p + "self_attn.q_proj.weight", (c.q_size, H), "linear", g + "attn_q.weight")
        add(p + "self_attn.k_proj.weight", (c.kv_size, H), "linear", g + "attn_k.weight")
        add(p + "self_attn.v_proj.weight", (c.kv_size, H), "linear", g + "attn_v.weight")
        add(p + "self_attn.o_proj.weight", (H, c.q_size), "linear", g + "attn_output.weight")
        add(p + "self_attn.q_norm.weight", (D,), "fp32", g + "attn_q_norm.weight")
        add(p + "self_attn.k_norm.weight", (D,), "fp32", g + "attn_k_norm.weight")
        add(p + "self_attn.sinks", (c.num_attention_heads,), "fp32", g + "attn_sinks.weight")
        add(p + "post_attention_layernorm.weight", (H,), "fp32", g + "ffn_norm.weight")
        if not c.is_moe_layer(i):
            I = c.intermediate_size
            add(p + "mlp.gate_proj.weight", (I, H), "linear", g + "ffn_gate.weight")
            add(p + "mlp.up_proj.weight", (I, H), "linear", g + "ffn_up.weight")
            add(p + "mlp.down_proj.weight", (H, I), "linear", g + "ffn_down.weight")
            continue
        E, Im = c.n_routed_experts, c.moe_intermediate_size
        add(p + "mlp.gate.weight", (E, H), "bf16", g + "ffn_gate_inp.weight")
        add(p + "mlp.gate.e_score_correction_bias", (E,), "fp32", g + "exp_probs_b.bias")
        for proj, shape, gname in (
            ("gate_proj", (E, Im, H), "ffn_gate_exps.weight"),
            ("up_proj", (E, Im, H), "ffn_up_exps.weight"),
            ("down_proj", (E, H, Im), "ffn_down_exps.weight"),
        ):
            hf = tuple(f"{p}mlp.experts.{e}.{proj}.weight" for e in range(E))
            add(f"{p}mlp.experts.{proj}.weight", shape, "linear", g + gname, hf)
        if c.n_shared_experts:
            add(p + "mlp.shared_experts.gate_proj.weight", (Im, H), "linear", g + "ffn_gate_shexp.weight")
            add(p + "mlp.shared_experts.up_proj.weight", (Im, H), "linear", g + "ffn_up_shexp.weight")
            add(p + "mlp.shared_experts.down_proj.weight", (H, Im), "linear", g + "ffn_down_shexp.weight")
    add("model.norm.weight", (H,), "fp32", "output_norm.weight")
    add("lm_head.weight", (V, H), "bf16", "output.weight")
    return specs


def check_weights(config: FlintConfig, weights: WeightDict, source: str = "<weights>") -> None:
    """Check that `weights` holds exactly the canonical tensors with the right shapes
    and dtypes.

    Raises:
        CheckpointError: listing the first few missing, unexpected or mis-shaped
            tensors, naming `source`.
    """
    from flintc.errors import CheckpointError, listing

    specs = {s.name: s for s in weight_specs(config)}
    problems: list[str] = []
    for name in specs.keys() - weights.keys():
        problems.append(f"missing {name}")
    for name in weights.keys() - specs.keys():
        problems.append(f"unexpected {name}")
    for name, spec in specs.items():
        w = weights.get(name)
        if w is None:
            continue
        if tuple(w.shape) != spec.shape:
            problems.append(f"{name}: expected shape {list(spec.shape)}, found {list(w.shape)}")
            continue
        if spec.kind == "linear":
            ok = isinstance(w, NVFP4Tensor) or w.dtype == torch.bfloat16
        elif spec.kind == "bf16":
            ok = isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16
        else:
            ok = isinstance(w, torch.Tensor) and w.dtype == torch.float32
        if not ok:
            found = "nvfp4" if isinstance(w, NVFP4Tensor) else str(w.dtype)
            problems.append(f"{name}: expected {spec.kind}, found {found}")
    if problems:
        problems.sort()
        raise CheckpointError(f"{source}: " + listing(problems, 4, "; "))
