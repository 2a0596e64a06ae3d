"""The interface every backend offers to generation loops and the server: a
`ModelRunner` owns the weights and the KV caches of `max_batch` sequence slots and
runs prefill (one sequence, any number of tokens) and decode (up to `max_batch`
sequences, one token each).

Slots are integers 0..max_batch-1 chosen by the caller (a scheduler); a runner
keeps each slot's cache until the caller reuses the slot. Positions are absolute
token positions (0-based) within the sequence; a slot's cache holds the tokens
at positions < the next position the caller passes. The caller never asks for
position >= max_model_len.

Implementations: `ReferenceRunner` (this file: the eager reference model) and
`flintc.runtime.compiled.CompiledRunner` (the generated runtime).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch

from flintc.config import FlintConfig
from flintc.errors import InputError
from flintc.sampling import first_outside_vocab


@runtime_checkable
class ModelRunner(Protocol):
    config: FlintConfig
    device: torch.device
    max_batch: int  # slots, and the largest decode batch
    max_model_len: int  # positions available per slot

    def prefill(self, slot: int, token_ids: Sequence[int], start: int = 0,
                all_logits: bool = False) -> torch.Tensor:
        """Run `token_ids` at positions start, start+1, ... of `slot` and write their
        K/V into its cache. -> fp32 logits [V] of the last token, or [T, V] with
        `all_logits`. Raises InputError for an empty or too long sequence, or a token
        id outside [0, vocab_size)."""
        ...

    def decode(self, slots: Sequence[int], token_ids: Sequence[int],
               positions: Sequence[int]) -> torch.Tensor:
        """One token per slot (distinct slots, 1 <= len <= max_batch). -> fp32 logits
        [B, V] in the order given. Raises InputError as `prefill` does, and for slots
        that are not distinct. With CUDA graphs they may be a view of the graph's
        output, which the next decode call rewrites: read (or copy) them before then."""
        ...


def check_request(runner, slot: int, start: int, token_ids: Sequence[int]) -> None:
    """The checks every runner makes before prefill/decode of `token_ids` at `start`.

    Raises:
        InputError: a slot outside [0, max_batch), no token, positions past
            max_model_len, or a token id outside [0, vocab_size) (the embedding lookup
            would fail on the CPU, wrap a negative id around, or read past the table on
            a GPU).
    """
    n = len(token_ids)
    if not 0 <= slot < runner.max_batch:
        raise InputError(f"slot {slot} is outside [0, {runner.max_batch})")
    if n < 1:
        raise InputError("prefill needs at least one token")
    if start < 0 or start + n > runner.max_model_len:
        raise InputError(f"positions {start}..{start + n - 1} exceed max_model_len "
                         f"{runner.max_model_len}")
    vocab = runner.config.vocab_size
    bad = first_outside_vocab(token_ids, vocab)
    if bad is not None:
        raise InputError(f"token id {bad} is outside the vocabulary [0, {vocab})")


class ReferenceRunner:
    """The eager reference model (`FlintModel`) behind the `ModelRunner` interface.

    Args:
        model: a FlintModel (its device is the weights' device).
        max_batch: sequence slots (caches are allocated for all of them up front).
        max_model_len: positions per slot; the full-attention caches hold this many
            rows [max_batch, max_model_len, Hkv, D] bf16, sliding layers a ring of W.
        prefill_chunk: the most tokens one forward call takes (bounds the workspace).
    """

    def __init__(self, model, max_batch: int = 8, max_model_len: int | None = None,
                 prefill_chunk: int = 512):
        self.model = model
        self.config = model.config
        self.device = model.rope_cos.device
        self.max_batch = int(max_batch)
        self.max_model_len = int(min(max_model_len or model.max_positions, model.max_positions))
        self.prefill_chunk = int(prefill_chunk)
        self.kv = model.new_kv_cache(self.max_batch, self.max_model_len)

    @torch.inference_mode()
    def prefill(self, slot, token_ids, start=0, all_logits=False):
        ids = [int(t) for t in token_ids]
        check_request(self, slot, start, ids)
        slots = torch.tensor([slot], device=self.device)
        out = []
        for s in range(0, len(ids), self.prefill_chunk):
            piece = torch.tensor([ids[s:s + self.prefill_chunk]], device=self.device)  # [1, t]
            pos = torch.arange(start + s, start + s + piece.shape[1], device=self.device)[None]
            logits = self.model(piece, pos, slots, self.kv)[0]  # [t, V]
            out.append(logits if all_logits else logits[-1:].clone())  # not a view: frees [t, V]
        logits = torch.cat(out).float()
        return logits if all_logits else logits[-1]

    @torch.inference_mode()
    def decode(self, slots, token_ids, positions):
        n = len(slots)
        if not 1 <= n <= self.max_batch or len(set(slots)) != n:
            raise InputError(f"decode needs 1..{self.max_batch} distinct slots, got {list(slots)}")
        if len(token_ids) != n or len(positions) != n:
            raise InputError("decode needs one token id and one position per slot")
        for s, t, p in zip(slots, token_ids, positions):
            check_request(self, s, p, [int(t)])
        ids = torch.tensor([[int(t)] for t in token_ids], device=self.device)
        pos = torch.tensor([[int(p)] for p in positions], device=self.device)
        sl = torch.tensor([int(s) for s in slots], device=self.device)
        return self.model(ids, pos, sl, self.kv)[:, 0].float()
