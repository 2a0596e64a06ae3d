"""Token sampling (FLINT_SPEC section 6): temperature, then top-k, then top-p on the
renormalised distribution; temperature 0 is greedy. Runs on the logits' device.

Defaults are Flint's: temperature 1.0, top-p 0.95, top-k 20. Each request may carry
a seed; a seeded request draws from its own `torch.Generator`, so its tokens do
not depend on what else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flintc.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature: >= 0; 0 means greedy (argmax, ties to the lower token id).
    top_k: keep the k most likely tokens; 0 or -1 keeps all.
    top_p: in (0, 1]; keep the smallest set of most likely tokens whose
        probability (after top-k, renormalised) reaches top_p.
    max_tokens: tokens to generate at most (>= 0); reasoning tokens count.
    seed: seeds this request's generator; None draws from a fresh random seed.
    ignore_eos: keep generating after the end-of-text token.
    """

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 20
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "SamplingParams":
        """Raises InputError naming the field when a value is out of range."""
        t, p, k = self.temperature, self.top_p, self.top_k
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise InputError(f"sampling field 'temperature' must be a finite number >= 0, got {t!r}")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise InputError(f"sampling field 'top_p' must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise InputError(f"sampling field 'top_k' must be an integer >= 1, or 0 / -1 for all, got {k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InputError(f"sampling field 'max_tokens' must be an integer >= 0, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise InputError(f"sampling field 'seed' must be an integer in [0, 2**63), got {self.seed!r}")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self, device: torch.device | str) -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: fp32 [..., V], zero outside the
    top-k / top-p set, renormalised. logits: fp32 [..., V]. Not for greedy."""
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= params.top_p  # keeps at least the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]):
    """Draw one token per row. logits: fp32 [B, V]; params and generators: one per row
    (a generator may be None for greedy rows). Returns int64 [B] on logits' device."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError("sample() needs logits [B, V] and one params/generator per row")
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for b, (p, g) in enumerate(zip(params, generators)):
        if p.is_greedy:
            out[b] = torch.argmax(logits[b])
        else:
            probs = sampling_probs(logits[b], p)
            out[b] = torch.multinomial(probs, 1, generator=g)[0]
    return out
