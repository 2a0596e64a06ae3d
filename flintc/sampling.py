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
    """Draw one token per row, rows with the same settings batched: `sampling_probs` runs
    once per group of rows with equal (temperature, top_k, top_p), not once per row (at
    batch 8 the per-row version cost ~3 ms per decode step on an H200, about half a
    forward; docs/gpu-runs.md, session 11). No host-to-device copy: the launches queue
    behind the forward pass instead of waiting for it. Greedy rows take the argmax (ties
    to the lower token id); each sampled row then draws with `torch.multinomial` from its
    own generator, so a seeded request's tokens do not depend on the rest of the batch.

    Args:
        logits: fp32 (or bf16) [B, V].
        params: B `SamplingParams`, one per row.
        generators: B generators on logits' device (None: torch's default generator;
            greedy rows ignore theirs).
    Returns: int64 [B] on logits' device.
    Raises:
        ValueError: logits not [B, V] or lists of another length than B.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError("sample() needs logits [B, V] and one params/generator per row")
    B = logits.shape[0]
    if all(p.is_greedy for p in params):
        return torch.argmax(logits, dim=-1)  # first maximum: the lower token id
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    greedy = [b for b, p in enumerate(params) if p.is_greedy]
    if greedy:
        top = torch.argmax(_rows(logits, greedy), dim=-1)
        for j, b in enumerate(greedy):
            out[b] = top[j]
    for b, probs in sampling_probs_rows(logits, params).items():
        out[b] = torch.multinomial(probs, 1, generator=generators[b])[0]
    return out


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] without an index tensor (whose host-to-device copy would wait for the GPU):
    x itself when rows are all of x in order, else a stack of row views."""
    if rows == list(range(x.shape[0])):
        return x
    return torch.stack([x[b] for b in rows])


def sampling_probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> dict:
    """`sampling_probs` of every non-greedy row of logits [B, V] with its own params,
    computed once per group of rows with equal (temperature, top_k, top_p).
    Returns {row: fp32 [V]} for the non-greedy rows (views into each group's result)."""
    groups: dict[tuple, list[int]] = {}
    for b, p in enumerate(params):
        if not p.is_greedy:
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(b)
    out = {}
    for rows in groups.values():
        probs = sampling_probs(_rows(logits, rows), params[rows[0]])
        for j, b in enumerate(rows):
            out[b] = probs[j]
    return out
