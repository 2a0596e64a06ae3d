"""Generation over any `ModelRunner`: prompts in consecutive batches of at most the
runner's max_batch; in each, prefill each prompt into its own slot, then decode the
live sequences together, one token per sequence per step, sampling on
the runner's device (FLINT_SPEC section 6: temperature, top-k then top-p, greedy at
temperature 0, per-request seeds; and vLLM's penalties, min_p, min_tokens,
logit_bias, allowed_token_ids and bad words, see `flintc.sampling`: a prompt whose
params adjust the logits keeps a `TokenHistory` of its tokens for `sample`). There is
no tokenizer here: bad words must come as token ids (`bad_words_token_ids`, or
`SamplingParams.with_tokenizer` called before, as `flintc.api` does). Structured outputs
(`SamplingParams.structured_outputs`) need the tokenizer (`tokenizer=`): each such prompt
gets a `flintc.structured.GrammarMatcher` in its TokenHistory, fed each token it
generates, and stops with "stop" once its grammar is complete. Stop strings
(`SamplingParams.stop`) need it too: with a tokenizer each prompt's text is made token by
token (`flintc.stop_strings.StopStringText`, the serving engine's match) and returned in
`GenerationResult.texts`. The texts keep the special tokens' strings, but stop strings are
matched on the text without them (`flintc.stop_strings.VisibleText`), as `flintc serve`
matches them by default and vLLM's `LLM.generate` (skip_special_tokens, default true):
a stop string never matches inside `<|user|>` or any other special token.

Same result type and stopping rules as the reference loop (`flintc.model.generate`),
and as `flintc serve`'s engine: a sequence stops at a stop token (`flintc.stop_strings.
stop_token_end`, vLLM's `check_stop`: its end-of-text token and the model's generation-config
end ids, `<|user|>` / `<|observation|>` with Flint's tokenizer, unless ignore_eos; one of its
params' stop_token_ids even with ignore_eos; never before min_tokens, which masks them all
until then), when one of its stop strings ends in
the latest token's text (the first in the order given, looked for once more than
min_tokens tokens are out: `flintc.stop_strings`), when its structured
output's grammar is complete, at max_tokens, or when prompt + generated tokens reach the
runner's max_model_len (vLLM's meaning: the last token needs no cache position, so a
sequence uses max_model_len - 1 positions). The finish reason is "stop" for the first
three, "length" for the others (as vLLM and `flintc serve` report them).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from flintc.errors import InputError
from flintc.model.generate import GenerationResult, check_prompt
from flintc.sampling import (SamplingParams, TokenHistory, drawn_outside_allowed, first_outside_vocab,
                             params_per_prompt, sample)
from flintc.stop_strings import TOKENIZER_EOS, StopStringText, resolve_eos_token_id, stop_token_end


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _grammar(q: SamplingParams, tokenizer, stops):
    """The GrammarMatcher of a prompt whose params have structured_outputs, else None."""
    if q.structured_outputs is None:
        return None
    from flintc.structured import GrammarMatcher

    return GrammarMatcher(q.structured_outputs, tokenizer, stops)


def _check_sampling_ids(q: SamplingParams, vocab: int, where: str) -> None:
    """InputError for an id of q's logit_bias, allowed_token_ids, bad_words_token_ids or
    stop_token_ids outside [0, vocab), or bad_words not made into ids (no tokenizer
    here)."""
    fields = (("logit_bias", [t for t, _ in q.logit_bias or ()]), ("allowed_token_ids", q.allowed_token_ids),
              ("bad_words_token_ids", [t for ids in q.bad_words_token_ids or () for t in ids]),
              ("stop_token_ids", q.stop_token_ids))
    for name, ids in fields:
        bad = first_outside_vocab(ids or (), vocab)
        if bad is not None:
            raise InputError(f"sampling field '{name}'{where}: token id {bad} is outside the vocabulary "
                             f"[0, {vocab})")
    if q.bad_words is not None and q.bad_words_token_ids is None:
        raise InputError(f"sampling field 'bad_words'{where}: the words need a tokenizer to become token ids "
                         f"(SamplingParams.with_tokenizer(tokenizer), or flintc.load with a tokenizer); "
                         f"or give bad_words_token_ids")


@torch.inference_mode()
def generate_with_runner(
    runner,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    eos_token_id=TOKENIZER_EOS,
    return_prompt_logits: bool = False,
    keep_step_logits: bool = False,
    on_token: Callable[[int, int], None] | None = None,
    tokenizer=None,
    generation_stop_ids=None,
) -> GenerationResult:
    """Generate after each prompt with `runner` (a ModelRunner).

    Any number of prompts: they run in consecutive batches of at most
    `runner.max_batch` (prompts 0..max_batch-1 first, then the next max_batch, ...; each
    batch prefilled into slots 0.. and decoded to its end before the next starts), as
    vLLM's `LLM.generate` takes any number. The result holds every prompt in input
    order. A prompt's sampling does not depend on the batch it falls in: it draws from
    its own generator, made when its batch starts (seeded with its own `seed`, so the
    same draws as alone; random without one; `flintc.sampling.sample`), and its stopping
    rules are its own. Its logits are its own row of the batch's decode bucket (the
    smallest that fits the live sequences), so a greedy or seeded prompt gets the tokens
    it gets alone wherever the buckets round its row alike (the tiny CPU builds of
    tests/runtime do). prefill_seconds, decode_seconds and decode_steps add up over the
    batches; step_logits hold each batch's steps in turn.

    Args:
        prompts: token ids per prompt (at least one).
        params: one SamplingParams for all, or one per prompt. max_tokens None: each
            prompt generates until prompt + generated tokens reach runner.max_model_len
            (`SamplingParams.for_prompt`; finish reason "length" there).
        on_token: called as on_token(prompt_index, token_id) as tokens appear
            (prompt_index into `prompts`, whatever batch it runs in).
        tokenizer: the model's FlintTokenizer: needed by params with structured_outputs
            (their grammars are compiled for it) or stop strings (`stop`: the text is
            made as the tokens come). With one, the result's `texts` hold each prompt's
            output text (module docstring); without, `texts` is None.
        eos_token_id: the end-of-text token id: it ends a sequence unless ignore_eos
            (stop_reason None). Not passed (`flintc.stop_strings.TOKENIZER_EOS`): the
            tokenizer's, as vLLM always takes it from the tokenizer (none without a
            tokenizer); None: none.
        generation_stop_ids: the model's generation-config end ids besides eos_token_id
            (an iterable of ints): they end a sequence unless ignore_eos, stop_reason the
            id, and are masked before min_tokens (vLLM's
            `SamplingParams.update_from_generation_config`, which adds them to every
            request's stop_token_ids). None: `flintc.checkpoint.tokenizer.
            generation_stop_token_ids(tokenizer)` with a tokenizer and an end-of-text id
            (Flint's: `<|user|>`, `<|observation|>`), else none (a caller that ends on no
            end-of-text token gets none of the generation config's other end ids either);
            () for none. So `tokenizer=` alone stops where `flintc serve` and vLLM do
            (`flintc.checkpoint.tokenizer.model_stop_token_ids(tokenizer)`).

    Returns:
        A GenerationResult: output_ids (a stop token that ended a sequence, or the token
        that completed its stop string, kept, as vLLM's token_ids), finish_reasons,
        stop_reasons (vLLM's stop_reason: the stop string, or the id of the stop token
        that ended the sequence, a stop_token_ids or generation_stop_ids one; else None:
        end-of-text, a complete grammar, "length"), and with a tokenizer texts (the text
        ends before the stop string or stop token, or after it with
        include_stop_str_in_output; special tokens kept).

    Raises:
        InputError: no prompts, an empty prompt, an id outside the vocabulary (in a
            prompt, a logit_bias, allowed_token_ids, bad_words_token_ids or
            stop_token_ids; or in generation_stop_ids), bad_words without their token
            ids, structured_outputs or stop strings without a tokenizer, a prompt of
            max_model_len tokens or more, or min_tokens over the rest of a prompt's
            context with max_tokens None; all checked before any prompt runs.
            While generating: a token drawn outside allowed_token_ids (the params' other
            masks, bad_words or min_tokens, left none of the allowed tokens to draw).
        flintc.structured.StructuredOutputError: a grammar refused a generated token
            (the mask allows only the tokens it takes: the params' other masks left none
            of them, or the grammar hit one of llguidance's limits as it ran).
    """
    cfg = runner.config
    B = len(prompts)
    if B == 0:
        raise InputError("no prompts: give at least one")
    plist = params_per_prompt(params, B)
    for i, ids in enumerate(prompts):
        check_prompt(ids, cfg.vocab_size, runner.max_model_len,
                     name=f"prompt {i}" if B > 1 else "prompt")
    # max_tokens None: each prompt's rest of the context (vLLM's; `flintc serve`'s "max_tokens": null)
    plist = [q.for_prompt(len(ids), runner.max_model_len, f" of prompt {i}" if B > 1 else "")
             for i, (q, ids) in enumerate(zip(plist, prompts))]
    for i, q in enumerate(plist):
        _check_sampling_ids(q, cfg.vocab_size, f" of prompt {i}" if B > 1 else "")
        if q.structured_outputs is not None and tokenizer is None:
            raise InputError(f"sampling field 'structured_outputs'{f' of prompt {i}' if B > 1 else ''}: "
                             f"structured outputs need the model's tokenizer (tokenizer=...)")
        if q.stop is not None and tokenizer is None:
            raise InputError(f"sampling field 'stop'{f' of prompt {i}' if B > 1 else ''}: stop strings are "
                             f"matched in the output text, which needs the model's tokenizer (tokenizer=...); "
                             f"without one, end on token ids with stop_token_ids")
    from flintc.checkpoint.tokenizer import generation_stop_token_ids, model_stop_token_ids

    eos_token_id = resolve_eos_token_id(tokenizer, eos_token_id)
    if generation_stop_ids is None:  # `model_stop_token_ids`' default, checked as the caller's are
        generation_stop_ids = (generation_stop_token_ids(tokenizer)
                               if tokenizer is not None and eos_token_id is not None else ())
    generation_stop_ids = list(generation_stop_ids)
    bad = first_outside_vocab(generation_stop_ids, cfg.vocab_size)
    if bad is not None:
        raise InputError(f"generation_stop_ids: token id {bad!r} is outside the vocabulary [0, {cfg.vocab_size})")
    model_stops = model_stop_token_ids(tokenizer, eos_token_id, generation_stop_ids)
    step = int(runner.max_batch)
    result = None
    for start in range(0, B, step):
        part = _generate_batch(runner, prompts[start:start + step], plist[start:start + step], eos_token_id,
                               return_prompt_logits, keep_step_logits,
                               None if on_token is None else (lambda b, t, _s=start: on_token(_s + b, t)),
                               tokenizer, first=start, several=B > 1, model_stops=model_stops)
        if result is None:
            result = part
            continue
        result.prompt_ids += part.prompt_ids
        result.output_ids += part.output_ids
        result.finish_reasons += part.finish_reasons
        result.stopped_by_token += part.stopped_by_token
        result.stop_reasons += part.stop_reasons
        if result.texts is not None:
            result.texts += part.texts
        if return_prompt_logits:
            result.prompt_logits += part.prompt_logits
        result.step_logits += part.step_logits
        result.prefill_seconds += part.prefill_seconds
        result.decode_seconds += part.decode_seconds
        result.decode_steps += part.decode_steps
    return result


def _generate_batch(runner, prompts: list[list[int]], plist: list[SamplingParams], eos_token_id: int | None,
                    return_prompt_logits: bool, keep_step_logits: bool,
                    on_token: Callable[[int, int], None] | None, tokenizer=None, first: int = 0,
                    several: bool = False, model_stops: tuple[int, ...] = ()) -> GenerationResult:
    """`generate_with_runner` for at most runner.max_batch prompts, checked already: prompt
    b in slot b, one SamplingParams per prompt; on_token(b, token_id) with b into
    `prompts`. An error names prompt `first` + b when `several` (of the caller's).
    `model_stops`: every prompt's stop tokens but its params' own (end-of-text and the
    generation config's end ids)."""
    B = len(prompts)
    device = runner.device
    gens = [None if q.is_greedy else q.make_generator(device) for q in plist]
    result = GenerationResult([list(p) for p in prompts], [[] for _ in prompts])
    user = [frozenset(q.stop_token_ids or ()) for q in plist]  # end the sequence even with ignore_eos
    # every stop token (vLLM's _all_stop_token_ids): masked before min_tokens, and allowed by a
    # grammar where it accepts
    stops = [tuple(model_stops) + tuple(q.stop_token_ids or ()) for q in plist]
    stop_sets = [frozenset(x) for x in stops]
    hist = [TokenHistory(prompts[b], result.output_ids[b], stops[b],
                         grammar=_grammar(plist[b], tokenizer, stops[b]))
            if plist[b].adjusts_logits else None for b in range(B)]
    # stop strings matched on the text without the special tokens' strings, as `flintc serve`
    # matches them by default (vLLM's skip_special_tokens, default true, in LLM.generate too);
    # the texts keep those strings
    texts = ([StopStringText(tokenizer.detokenizer(), q.stop or (), q.include_stop_str_in_output,
                             specials=tokenizer.special_strings() if q.stop else None) for q in plist]
             if tokenizer is not None else None)
    result.prompt_logits = [] if return_prompt_logits else None
    result.finish_reasons = ["length"] * B
    result.stopped_by_token = [False] * B
    result.stop_reasons = [None] * B

    _sync(device)
    t0 = time.perf_counter()
    last = []
    for b, ids in enumerate(prompts):
        logits = runner.prefill(b, ids, 0, all_logits=return_prompt_logits)
        if return_prompt_logits:
            result.prompt_logits.append(logits.float().cpu())
            logits = logits[-1]
        last.append(logits)
    _sync(device)
    result.prefill_seconds = time.perf_counter() - t0

    t1 = time.perf_counter()
    logits = torch.stack(last)  # [B, V]
    live = list(range(B))
    pos = [len(p) for p in prompts]
    while True:
        live = [b for b in live if len(result.output_ids[b]) < plist[b].max_tokens]
        if not live:
            break
        toks = sample(logits.float(), [plist[b] for b in live], [gens[b] for b in live],
                      history=[hist[b] for b in live] if any(hist) else None).tolist()
        if keep_step_logits:
            result.step_logits.append(logits.float().cpu())
        still = []
        for b, t in zip(live, toks):
            result.output_ids[b].append(t)
            if on_token is not None:
                on_token(b, t)
            g = hist[b].grammar if hist[b] is not None else None
            if g is not None:
                g.advance(result.output_ids[b])
            bad = drawn_outside_allowed(plist[b], t, len(result.output_ids[b]) - 1)
            if bad is not None:
                raise InputError(bad.replace("'allowed_token_ids'", f"'allowed_token_ids' of prompt {first + b}", 1)
                                 if several else bad)
            q, n = plist[b], len(result.output_ids[b])
            # as the serving engine's `_push`: a stop token (`stop_token_end`: end-of-text and the
            # generation config's ids unless ignore_eos, one of stop_token_ids, or one that ended
            # the grammar), then the stop strings
            ends, reason = stop_token_end(t, n_out=n, min_tokens=q.min_tokens, ignore_eos=q.ignore_eos,
                                          stop_ids=stop_sets[b], user_stop_ids=user[b], eos_token_id=eos_token_id,
                                          grammar_ended=g is not None and g.ended)
            if ends:
                result.finish_reasons[b] = "stop"
                result.stopped_by_token[b] = True
                result.stop_reasons[b] = reason  # vLLM's: None for end-of-text, else the id
                if texts is not None:
                    texts[b].push_stop_token(t)
            elif texts is not None and texts[b].push(t, n, q.min_tokens):  # a stop string
                result.finish_reasons[b] = "stop"
                result.stop_reasons[b] = texts[b].matched
            elif g is not None and g.finished:  # the grammar is complete: nothing more can follow
                result.finish_reasons[b] = "stop"
            elif len(result.output_ids[b]) >= plist[b].max_tokens \
                    or pos[b] + 1 >= runner.max_model_len:  # pos[b] + 1 tokens: prompt + generated
                result.finish_reasons[b] = "length"
            else:
                still.append(b)
        live = still
        if not live:
            break
        logits = runner.decode(live, [result.output_ids[b][-1] for b in live], [pos[b] for b in live])
        for b in live:
            pos[b] += 1
        result.decode_steps += 1
    _sync(device)
    result.decode_seconds = time.perf_counter() - t1
    if texts is not None:
        result.texts = [x.finish() for x in texts]
    return result
