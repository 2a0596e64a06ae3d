"""Deterministic random weights for test checkpoints.

:func:`random_weights` gives the canonical weight dict of
:func:`flintc.model.weights.weight_specs` (stacked experts, norms in fp32), drawn
from a CPU ``torch.Generator`` so that a seed gives the same bits on every machine.
:func:`init_rule` is the distribution of each tensor, shared with the dummy loader
(:mod:`flintc.checkpoint.dummy`), which draws on the target device instead.

Distributions: embedding N(0, 1); `linear` weights [..., N, K] N(0, 1/sqrt(K));
router and LM head N(0, 1/sqrt(H)); norm weights 1 + 0.1 N(0, 1), rounded to
bf16-representable values and stored as fp32 (so a BF16 file holds them exactly);
sinks N(0, 1); `e_score_correction_bias` N(0, 0.05). It draws every element on
the CPU, so it is meant for small configs (the `tiny` preset takes milliseconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flintc.config import FlintConfig
from flintc.model.weights import TensorSpec, weight_specs


@dataclass(frozen=True)
class InitRule:
    """How one canonical tensor is drawn: `mean + std * N(0, 1)`, stored as `dtype`;
    `bf16_exact` rounds the values to bf16 first (fp32 norm weights)."""

    mean: float
    std: float
    dtype: torch.dtype
    bf16_exact: bool = False


def init_rule(spec: TensorSpec) -> InitRule:
    """The distribution of the canonical tensor `spec` (see the module docstring)."""
    K = spec.shape[-1]
    if spec.kind == "linear":
        return InitRule(0.0, 1.0 / math.sqrt(K), torch.bfloat16)
    if spec.kind == "bf16":
        if spec.name == "model.embed_tokens.weight":
            return InitRule(0.0, 1.0, torch.bfloat16)
        # router [E, H] and lm_head [V, H]: the last dim is H
        return InitRule(0.0, 1.0 / math.sqrt(K), torch.bfloat16)
    if spec.name.endswith("sinks"):
        return InitRule(0.0, 1.0, torch.float32)
    if spec.name.endswith("e_score_correction_bias"):
        return InitRule(0.0, 0.05, torch.float32)
    if "norm" in spec.name:
        return InitRule(1.0, 0.1, torch.float32, bf16_exact=True)
    raise ValueError(f"no init rule for {spec.name} (kind {spec.kind})")


def has_global_scale(spec: TensorSpec) -> bool:
    """Whether made-up NVFP4 weights of `spec` get a global scale other than 1.

    Attention and routed-expert weights do; dense-MLP and shared-expert weights keep
    a unit global scale (no `.scale` tensor in a GGUF file), so that test checkpoints
    exercise both paths. Used by :func:`flintc.checkpoint.gguf_io.save_gguf` when it
    quantizes bf16 weights and by the dummy loader.
    """
    return spec.kind == "linear" and (".self_attn." in spec.name or ".mlp.experts." in spec.name)


def apply_rule(rule: InitRule, normal: torch.Tensor) -> torch.Tensor:
    """Turn standard-normal fp32 samples into a tensor drawn by `rule`."""
    x = normal * rule.std + rule.mean
    if rule.bf16_exact:
        x = x.to(torch.bfloat16)
    return x.to(rule.dtype)


def random_weights(
    config: FlintConfig, seed: int = 0, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Canonical BF16 weights for `config`, deterministic for `seed`.

    Returns:
        name -> tensor: `linear` and `bf16` kinds bf16, `fp32` kind fp32, shapes of
        :func:`weight_specs` (routed experts stacked [E, N, K]), on `device`.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for spec in weight_specs(config):
        normal = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
        weights[spec.name] = apply_rule(init_rule(spec), normal).to(device)
    return weights
