"""Generation on the reference model: prefill each prompt, then decode the batch.

This is flintc's *reference backend*: the numbers every compiled backend is
checked against. Each prompt is prefilled on its own (in chunks of at most
`prefill_chunk` tokens, so a long prompt needs bounded workspace) into its own
KV-cache slot; then all live sequences decode together, one token per step, each
at its own position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from flintc.errors import InputError
from flintc.model.reference import FlintModel
from flintc.sampling import SamplingParams, sample


@dataclass
class GenerationResult:
    """prompt_ids / output_ids: one list per prompt. prompt_logits: fp32 [T_i, V]
    per prompt when asked for (logits at each prompt position), else None.
    step_logits: per decode step, fp32 [B, V] of the rows that produced a token."""

    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    prompt_logits: list[torch.Tensor] | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    step_logits: list[torch.Tensor] = field(default_factory=list)
    # Per prompt: "stop" (end-of-text token), "length" (max_tokens), or
    # "max_model_len" (the sequence reached the positions available).
    finish_reasons: list[str] = field(default_factory=list)


def check_prompt(ids: list[int], vocab_size: int, max_len: int, name: str = "prompt") -> None:
    """Raises InputError for an empty prompt, a token id outside [0, vocab_size), or a
    prompt longer than `max_len`."""
    if len(ids) == 0:
        raise InputError(f"{name} is empty")
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise InputError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_len:
        raise InputError(f"{name} has {len(ids)} tokens, more than the maximum of {max_len}")


@torch.inference_mode()
def generate(
    model: FlintModel,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    eos_token_id: int | None = None,
    return_prompt_logits: bool = False,
    keep_step_logits: bool = False,
    on_token: Callable[[int, int], None] | None = None,
    prefill_chunk: int = 512,
    max_model_len: int | None = None,
) -> GenerationResult:
    """Generate up to `params.max_tokens` tokens after each prompt.

    Args:
        prompts: token ids per prompt (each non-empty, ids < vocab_size).
        params: one SamplingParams for all prompts, or one per prompt.
        eos_token_id: a sequence stops after producing it (unless ignore_eos).
        on_token: called as on_token(prompt_index, token_id) as tokens appear.
        max_model_len: positions available per sequence (default: the model's
            max_positions); generation stops there.

    Raises:
        InputError: a prompt is empty, holds an out-of-range id, or is longer than
            max_model_len.
    """
    import time

    cfg = model.config
    max_len = min(max_model_len or model.max_positions, model.max_positions)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError("need one SamplingParams per prompt")
    for i, ids in enumerate(prompts):
        check_prompt(ids, cfg.vocab_size, max_len, name=f"prompt {i}" if len(prompts) > 1 else "prompt")
    device = model.rope_cos.device
    B = len(prompts)
    cache_len = min(max_len, max(len(p) + q.max_tokens for p, q in zip(prompts, plist)))
    kv = model.new_kv_cache(B, cache_len)
    gens = [None if q.is_greedy else q.make_generator(device) for q in plist]
    result = GenerationResult([list(p) for p in prompts], [[] for _ in prompts])
    result.prompt_logits = [] if return_prompt_logits else None
    result.finish_reasons = ["length"] * B

    t0 = time.perf_counter()
    last_logits = []
    for b, ids in enumerate(prompts):
        logits = _prefill(model, ids, b, kv, prefill_chunk, device)  # [T, V]
        if return_prompt_logits:
            result.prompt_logits.append(logits.float().cpu())
        last_logits.append(logits[-1])
    result.prefill_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    logits = torch.stack(last_logits)  # [B, V]
    live = list(range(B))
    pos = [len(p) for p in prompts]
    while True:
        live = [b for b in live if len(result.output_ids[b]) < plist[b].max_tokens]
        if not live:
            break
        toks = sample(logits.float(), [plist[b] for b in live], [gens[b] for b in live]).tolist()
        if keep_step_logits:
            result.step_logits.append(logits.float().cpu())
        still = []
        for b, t in zip(live, toks):
            result.output_ids[b].append(t)
            if on_token is not None:
                on_token(b, t)
            if t == eos_token_id and not plist[b].ignore_eos:
                result.finish_reasons[b] = "stop"
            elif len(result.output_ids[b]) >= plist[b].max_tokens:
                result.finish_reasons[b] = "length"
            elif pos[b] >= cache_len:
                result.finish_reasons[b] = "max_model_len"
            else:
                still.append(b)
        live = still
        if not live:
            break
        ids = torch.tensor([[result.output_ids[b][-1]] for b in live], device=device)  # [B', 1]
        positions = torch.tensor([[pos[b]] for b in live], device=device)  # [B', 1]
        logits = model(ids, positions, torch.tensor(live, device=device), kv)[:, 0]  # [B', V]
        for b in live:
            pos[b] += 1
        result.decode_steps += 1
    result.decode_seconds = time.perf_counter() - t1
    return result


def _prefill(model: FlintModel, ids: list[int], slot: int, kv, chunk: int, device) -> torch.Tensor:
    """Prefill one prompt into cache row `slot`, `chunk` tokens at a time. -> logits [T, V]."""
    out = []
    slots = torch.tensor([slot], device=device)
    for start in range(0, len(ids), chunk):
        piece = torch.tensor([ids[start:start + chunk]], device=device)  # [1, t]
        positions = torch.arange(start, start + piece.shape[1], device=device)[None]  # [1, t]
        out.append(model(piece, positions, slots, kv)[0])
    return torch.cat(out)
