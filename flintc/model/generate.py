"""Generation on the reference model: prefill each prompt, then decode the batch.

This is flintc's *reference backend*: the numbers every compiled backend is
checked against. `generate` wraps the model in a `ReferenceRunner` (one KV-cache
slot per prompt, or per prompt of a batch with `max_batch`; caches as long as the
request can grow) and runs the same loop as
every backend, `flintc.runtime.generate.generate_with_runner`: each prompt is
prefilled on its own (in chunks of at most `prefill_chunk` tokens, so a long prompt
needs bounded workspace), then all live sequences decode together, one token per
step, each at its own position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from flintc.errors import InputError
from flintc.model.reference import FlintModel
from flintc.sampling import SamplingParams, params_per_prompt
from flintc.stop_strings import TOKENIZER_EOS


@dataclass
class GenerationResult:
    """prompt_ids / output_ids: one list per prompt. prompt_logits: fp32 [T_i, V]
    per prompt when asked for (logits at each prompt position), else None.
    step_logits: per decode step, fp32 [B, V] of the rows that produced a token.

    What a prompt's output holds, as vLLM's `CompletionOutput` (`token_ids`, `text`,
    `finish_reason`, `stop_reason`):
    output_ids: every generated token, the stop token a sequence ended at (end-of-text, a
        generation-config end id or one of stop_token_ids) included, and for a stop
        string the token that completed it (its characters past the stop string are in
        no text).
    texts: with a tokenizer (`generate(..., tokenizer=)`, `flintc.api`), each prompt's
        output text (special tokens kept, though stop strings are matched on the text
        without them, as `flintc serve`'s default): without the stop token the sequence
        ended at and cut before the stop string it ended at, unless include_stop_str_in_output
        (then with the stop token's text, or up to the end of the stop string); None
        without a tokenizer.
    finish_reasons: "stop" or "length" (below).
    stop_reasons: vLLM's stop_reason: the stop string (`SamplingParams.stop`) or the id of
        the stop token that ended the sequence (one of `SamplingParams.stop_token_ids`, or
        of the generation config's end ids, `<|user|>` / `<|observation|>` with Flint's
        tokenizer: `flintc.stop_strings.stop_token_end`); None for end-of-text (even one
        stop_token_ids lists, unless ignore_eos: vLLM checks end-of-text first), a
        complete grammar, and "length". `flintc serve` reports the same as each choice's
        `stop_reason`.
    """

    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    prompt_logits: list[torch.Tensor] | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    step_logits: list[torch.Tensor] = field(default_factory=list)
    # Per prompt: "stop" (a stop token: `flintc.stop_strings.stop_token_end`; a stop string; a
    # structured output's grammar complete) or "length" (max_tokens, or prompt + generated
    # tokens reached max_model_len: vLLM's convention, as `flintc serve`'s).
    finish_reasons: list[str] = field(default_factory=list)
    # Per prompt: whether output_ids end with the stop token the sequence stopped at (False
    # for "length", a stop string, and a grammar that completed on its own last token);
    # empty: every "stop" did
    stopped_by_token: list[bool] = field(default_factory=list)
    texts: list[str] | None = None
    stop_reasons: list[str | int | None] = field(default_factory=list)

    def text_ids(self, i: int) -> list[int]:
        """The output ids of prompt `i` that its text is decoded from: without the
        stop token it stopped at (finish reason "stop"), which vLLM and `flintc
        serve` leave out of the text too; output_ids keep it. A stop string's cut and
        include_stop_str_in_output are not in them: `texts` has the text as vLLM's."""
        ids = self.output_ids[i]
        if i < len(self.stopped_by_token):
            return ids[:-1] if self.stopped_by_token[i] else ids
        return ids[:-1] if i < len(self.finish_reasons) and self.finish_reasons[i] == "stop" else ids


def check_prompt(ids: list[int], vocab_size: int, max_len: int, name: str = "prompt") -> None:
    """Raises InputError for an empty prompt, a token id outside [0, vocab_size), or a
    prompt of `max_len` tokens or more: `max_len` (max_model_len) counts the prompt and
    the generated tokens, as vLLM's does, so a prompt leaves room for at least one."""
    if len(ids) == 0:
        raise InputError(f"{name} is empty")
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise InputError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_len:
        raise InputError(f"{name} has {len(ids)} token{'' if len(ids) == 1 else 's'}, more than the maximum of {max_len - 1} "
                         f"(the maximum model length {max_len} counts the prompt and at least "
                         "one generated token)")


@torch.inference_mode()
def generate(
    model: FlintModel,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    eos_token_id=TOKENIZER_EOS,
    return_prompt_logits: bool = False,
    keep_step_logits: bool = False,
    on_token: Callable[[int, int], None] | None = None,
    prefill_chunk: int = 512,
    max_model_len: int | None = None,
    max_batch: int | None = None,
    tokenizer=None,
    generation_stop_ids=None,
) -> GenerationResult:
    """Generate up to `params.max_tokens` tokens after each prompt (max_tokens None: until
    the prompt and its generated tokens fill max_model_len).

    Args:
        prompts: token ids per prompt (each non-empty, ids < vocab_size).
        params: one SamplingParams for all prompts, or one per prompt.
        eos_token_id: the end-of-text id: a sequence stops after producing it (unless
            ignore_eos). Not passed: the tokenizer's (none without a tokenizer); None:
            none. `generate_with_runner`'s.
        on_token: called as on_token(prompt_index, token_id) as tokens appear.
        max_model_len: the most tokens a sequence holds, prompt and generated (vLLM's
            meaning; default: the model's max_positions); generation stops there.
        max_batch: the most sequences decoded together (default: all the prompts);
            more prompts run in consecutive batches of max_batch, as
            `flintc.runtime.generate.generate_with_runner` runs them.
        tokenizer: the model's FlintTokenizer, which params with structured_outputs or
            stop strings need; with one, the result's `texts` hold the output texts, and
            a sequence stops at the model's stop tokens as in `flintc serve` and vLLM
            (end-of-text and the generation config's end ids:
            `flintc.checkpoint.tokenizer.model_stop_token_ids`) unless ignore_eos.
        generation_stop_ids: the generation config's end ids besides eos_token_id, which
            end a sequence unless ignore_eos (None: the tokenizer's with an end-of-text
            id, else none; token ids alone, without a tokenizer, pass them here):
            `generate_with_runner`'s.

    Raises:
        InputError: no prompts, a prompt is empty, holds an out-of-range id, or has
            max_model_len tokens or more; max_model_len below 1 or above the model's
            max_positions; max_batch not an int of at least 1; structured_outputs
            or stop strings without a tokenizer; min_tokens over the rest of a prompt's
            context with max_tokens None; and `generate_with_runner`'s.
    """
    from flintc.runtime.generate import generate_with_runner
    from flintc.runtime.runner import ReferenceRunner

    cfg = model.config
    if not prompts:
        raise InputError("no prompts: give at least one")
    if max_model_len is not None and not 1 <= max_model_len <= model.max_positions:
        raise InputError(f"max_model_len {max_model_len}: expected 1..{model.max_positions} (the model's "
                         "max_positions)")
    if max_batch is not None and (not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1):
        raise InputError(f"max_batch: expected an int of at least 1 (or None for all the prompts), got {max_batch!r}")
    max_len = max_model_len or model.max_positions
    plist = params_per_prompt(params, len(prompts))
    for i, ids in enumerate(prompts):
        check_prompt(ids, cfg.vocab_size, max_len, name=f"prompt {i}" if len(prompts) > 1 else "prompt")
    # One slot per prompt; caches only as long as this request can grow (max_model_len
    # counts the prompt and at least one generated token, even at max_tokens 0); max_tokens
    # None grows to max_len (`generate_with_runner` resolves it against the runner's length)
    cache_len = min(max_len, max(max_len if q.max_tokens is None else len(p) + max(q.max_tokens, 1)
                                 for p, q in zip(prompts, plist)))
    runner = ReferenceRunner(model, max_batch=min(len(prompts), max_batch or len(prompts)), max_model_len=cache_len,
                             prefill_chunk=prefill_chunk)
    return generate_with_runner(runner, prompts, plist, eos_token_id=eos_token_id,
                                return_prompt_logits=return_prompt_logits,
                                keep_step_logits=keep_step_logits, on_token=on_token, tokenizer=tokenizer,
                                generation_stop_ids=generation_stop_ids)
