"""Stop tokens and stop strings (vLLM's `SamplingParams.stop_token_ids` and `stop`): one
rule for the serving engine (`flintc.serve.engine`) and the Python API / `flintc run`
(`flintc.runtime.generate`).

Stop tokens (`stop_token_end`): whether the token a sequence just generated ends it, and
its `stop_reason`, as vLLM's `check_stop` (`vllm/v1/core/sched/utils.py`) decides over the
stop-token set that `SamplingParams.update_from_generation_config` makes: the
tokenizer's end-of-text, the model's generation-config end ids (for GLM's tokenizer
`<|user|>` and `<|observation|>`, `flintc.checkpoint.tokenizer.generation_stop_token_ids`),
and the request's own `stop_token_ids`.

Stop strings: a sequence's text is made token by token (`flintc.checkpoint.tokenizer.
IncrementalDetokenizer`); after each token, once more than `min_tokens` tokens are out
(vLLM looks for stop strings only then), each stop string, in the order given, is looked
for where it would end in the characters the token added, as vLLM's
`check_stop_strings` (`vllm/v1/engine/detokenizer.py`) does: the first one found ends the
sequence with finish reason "stop", its text cut before the stop string, or after it with
`include_stop_str_in_output`. So a stop string that lay whole in the text of the first
`min_tokens` tokens is never matched. The token ids keep the token that completed the
match (vLLM's `token_ids` do), whatever characters of it follow the stop string.

A stream holds back the text's last (longest stop string's length - 1) characters
until the sequence ends (`stop_string_hold`, vLLM's detokenizer's `stop_buffer_length`:
none with `include_stop_str_in_output`), so text a stop string cuts was never sent;
`StopStringText` is the same text for a caller that streams nothing (the Python API;
`flintc run`, which streams as the server does).

Where a text keeps the special tokens' strings that its output leaves out (the server's
chat with `skip_special_tokens`: its reasoning and tool-call parsers read them, the
client gets the text without), stop strings are matched on the text without them
(`VisibleText`), as vLLM matches them on the text it outputs: no special token's string
takes part in a match, and the cut and the hold-back map back onto the whole text.

No torch here: the functions work on Python ints and strings.
"""

from __future__ import annotations

import bisect
from collections.abc import Container, Mapping


class _TokenizerEos:
    """The type of `TOKENIZER_EOS`."""

    def __repr__(self) -> str:
        return "TOKENIZER_EOS"


# The default eos_token_id of `flintc.checkpoint.tokenizer.model_stop_token_ids`,
# `flintc.model.generate.generate` and `flintc.runtime.generate.generate_with_runner`: the
# tokenizer's own end-of-text id (None without a tokenizer), as vLLM always takes it from the
# tokenizer; None passed there is "no end-of-text id"
TOKENIZER_EOS = _TokenizerEos()


def resolve_eos_token_id(tokenizer, eos_token_id=TOKENIZER_EOS) -> int | None:
    """The end-of-text id a caller means: `TOKENIZER_EOS` (not passed) is the tokenizer's
    ``eos_token_id`` (None without a tokenizer); anything else (an int, or None for none)
    is itself."""
    if eos_token_id is TOKENIZER_EOS:
        return None if tokenizer is None else tokenizer.eos_token_id
    return eos_token_id


def stop_token_end(tok: int, *, n_out: int, min_tokens: int, ignore_eos: bool, stop_ids: Container[int],
                   user_stop_ids: Container[int], eos_token_id: int | None,
                   grammar_ended: bool = False) -> tuple[bool, int | None]:
    """Does stop token `tok`, a sequence's `n_out`-th generated token, end it, and with
    which `stop_reason`: vLLM's `check_stop` (`vllm/v1/core/sched/utils.py`) over the
    stop-token set of `SamplingParams.update_from_generation_config` /
    `_all_stop_token_ids`, plus flintc's structured-output rule.

    The rule, in vLLM's order:
      * `tok` is no stop token (in neither `stop_ids` nor `user_stop_ids`): it does not end
        the sequence.
      * fewer than `min_tokens` tokens out (``n_out < min_tokens``): no stop token ends it
        (vLLM's `check_stop` returns before looking; its min-tokens logits processor masks
        `_all_stop_token_ids` until then, as `flintc.sampling.TokenHistory` does).
      * without `ignore_eos`: every stop token ends it; `stop_reason` None for the
        tokenizer's end-of-text (`check_stop` tests ``eos_token_id`` first, even one the
        request's `stop_token_ids` list), the id for any other (the generation config's
        end ids join vLLM's `stop_token_ids` then, as the request's own do).
      * with `ignore_eos`: only the request's own `stop_token_ids` (`user_stop_ids`) end
        it, stop_reason the id (`update_from_generation_config` adds the generation
        config's ids to `stop_token_ids` only without ignore_eos; end-of-text is not
        checked).
      * flintc's structured-output rule: a stop token drawn where the grammar accepts
        (`grammar_ended`, `flintc.structured.GrammarMatcher.ended`: the grammar's mask
        allows the stop tokens only there) ends the sequence even with `ignore_eos` and
        before `min_tokens`, stop_reason as above (None for one that is not the
        request's own under ignore_eos): nothing may follow a completed grammar.

    Args:
        tok: the token id just generated.
        n_out: the sequence's generated tokens, `tok` included (1-based).
        min_tokens: `SamplingParams.min_tokens`.
        ignore_eos: `SamplingParams.ignore_eos`.
        stop_ids: every stop token of the sequence (vLLM's `_all_stop_token_ids`): the
            end-of-text token, the generation config's end ids, the request's own ids.
        user_stop_ids: the request's own `stop_token_ids` (`SamplingParams.stop_token_ids`;
            a server request's field); counted as stop tokens even where `stop_ids` lacks
            them.
        eos_token_id: the tokenizer's end-of-text id (None: none).
        grammar_ended: the sequence's grammar took `tok` as its end (a stop token where it
            accepts).

    Returns:
        (ends, stop_reason): ends True when `tok` ends the sequence (finish reason "stop");
        stop_reason the id vLLM reports (an int), or None (end-of-text, a grammar's end
        under ignore_eos, or ends False).
    """
    if tok not in stop_ids and tok not in user_stop_ids:
        return False, None
    if n_out < min_tokens and not grammar_ended:
        return False, None
    if not ignore_eos:
        return True, None if tok == eos_token_id else tok
    if tok in user_stop_ids:
        return True, tok
    return grammar_ended, None


def stop_string_cut(text: str, stops, new_chars: int, include: bool) -> tuple[str, int] | None:
    """The first of `stops` that ends in the last `new_chars` characters of `text`, as
    vLLM's `check_stop_strings`.

    Args:
        text: the sequence's text so far.
        stops: the stop strings (non-empty strings), in the request's order.
        new_chars: characters the latest token added at the end of `text` (0: none, no
            match).
        include: cut after the stop string (vLLM's include_stop_str_in_output), else
            before it.

    Returns:
        None for no match; else (the stop string, the length of `text` to keep): the
        first of `stops`, in their order, found at or after ``len(text) - new_chars -
        len(stop) + 1`` (its first match there).
    """
    if new_chars <= 0:
        return None
    for stop in stops:
        at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if at >= 0:
            return stop, at + len(stop) if include else at
    return None


def stop_string_hold(text: str, stops, include: bool = False) -> int:
    """How many trailing characters of `text` to hold back while streaming, as vLLM's
    detokenizer (`stop_buffer_length`): the longest of `stops`' length minus one, at most
    len(text); 0 with no stops or with `include` (include_stop_str_in_output: a match
    keeps everything before its end, and `stop_string_cut` only ever drops characters
    of the latest token). Constant time: it held back the longest suffix that is a
    proper prefix of a stop before, which cost (stop length)^2 per token (5 ms a token
    for 20,000-character stops)."""
    if include or not stops:
        return 0
    return min(len(text), max(len(s) for s in stops) - 1)


class StopStringText:
    """One sequence's text, cut at its stop strings as the serving engine cuts it.

    Args:
        detokenizer: the sequence's `IncrementalDetokenizer` (a fresh one).
        stops: the stop strings (a tuple, possibly empty).
        include: keep the stop string in the text (include_stop_str_in_output); and the
            text of a stop token the sequence ends at (`push_stop_token`).
        specials: special token id -> its string (`FlintTokenizer.special_strings()`), for a
            text that keeps the special tokens' strings while its stop strings are matched
            on the text without them (`VisibleText`, the serving engine's rule for a text
            whose output leaves them out: vLLM's ``skip_special_tokens``, default true,
            keeps them out of every stop match); None: matched on the whole text.

    Attributes:
        text: the text so far (cut at the stop string once one matched).
        matched: the stop string that ended the sequence, or None.
    """

    def __init__(self, detokenizer, stops=(), include: bool = False, specials: Mapping[int, str] | None = None):
        self._detok = detokenizer
        self.stops = tuple(stops)
        self.include = include
        self.text = ""
        self.matched: str | None = None
        self.visible = VisibleText(specials) if specials is not None and self.stops else None

    def push(self, token_id: int, n_out: int, min_tokens: int) -> bool:
        """Add the `n_out`-th generated token (1-based). -> True when its text completed a
        stop string (looked for only when n_out > min_tokens): `text` is cut, `matched`
        set, and the sequence ends."""
        new = self._detok.push(token_id)
        self.text += new
        new_chars = len(new) if self.visible is None else self.visible.push(token_id, new)
        if self.stops and n_out > min_tokens:
            cut = (stop_string_cut(self.text, self.stops, new_chars, self.include) if self.visible is None
                   else self.visible.cut(self.stops, new_chars, self.include))
            if cut is not None:
                self.matched, keep = cut
                self.text = self.text[:keep]
                self._detok.flush()  # the rest of the token's bytes: not text
                return True
        return False

    def emit_upto(self) -> int:
        """How much of `text` a stream may show while the sequence runs: all but the
        held-back characters a later stop string could still cut (`stop_string_hold`, on
        the visible text with `specials`: `VisibleText.emit_upto`), as the serving engine
        streams."""
        if self.visible is not None:
            return self.visible.emit_upto(self.stops, self.include)
        return len(self.text) - stop_string_hold(self.text, self.stops, self.include)

    def push_stop_token(self, token_id: int) -> None:
        """The sequence ends at stop token `token_id`: its text joins `text` only with
        `include` (vLLM's include_stop_str_in_output), as the server's."""
        if self.include:
            self.text += self._detok.push(token_id)

    def finish(self) -> str:
        """End the text (a dangling partial character becomes U+FFFD, as
        `FlintTokenizer.decode` makes it). -> `text`."""
        self.text += self._detok.flush()
        return self.text


class VisibleText:
    """A sequence's text less its special tokens' strings, kept beside the whole text
    (which the caller keeps), so that stop strings are matched on what the output shows:
    the server's chat with ``skip_special_tokens`` makes its text with the special tokens
    (its parsers read them) and strips them after, as vLLM's detokenizer, which matches
    stop strings on its output text, never has them there. A special token is left out
    by its id, as vLLM's ``skip_special_tokens`` leaves it out, so the visible text is the
    whole text less the special tokens' strings, each a whole token's: any character of
    the whole text is either visible or in one special token's string.

    Args:
        specials: special token id -> its string (the text the detokenizer makes of it).

    Attributes:
        text: the visible text so far.
    """

    def __init__(self, specials: Mapping[int, str]):
        self.specials = specials
        self.text = ""
        self._at: list[int] = []  # visible lengths where special strings sit, nondecreasing
        self._skipped: list[int] = []  # the special characters before each such place, summed

    def push(self, token_id: int, new: str) -> int:
        """Token `token_id` added `new` to the whole text. -> the visible characters it
        added (at the end of `text`): all of `new` but a special token's string (what came
        before it in `new`, a dangling partial character's U+FFFD, is visible)."""
        special = self.specials.get(token_id)
        if special and new.endswith(special):
            new = new[:len(new) - len(special)]
            self.text += new
            if self._at and self._at[-1] == len(self.text):
                self._skipped[-1] += len(special)
            else:
                self._at.append(len(self.text))
                self._skipped.append((self._skipped[-1] if self._skipped else 0) + len(special))
            return len(new)
        self.text += new
        return len(new)

    def whole_at(self, k: int, after_specials: bool = True) -> int:
        """The offset in the whole text of visible offset `k` (0..len(text)): after the
        special strings that sit right before visible character k with `after_specials`
        (a cut before a stop string keeps them: they came before it), else before them (a
        cut after a stop string ending at k keeps none of what follows it)."""
        i = (bisect.bisect_right if after_specials else bisect.bisect_left)(self._at, k)
        return k + (self._skipped[i - 1] if i else 0)

    def cut(self, stops, new_chars: int, include: bool) -> tuple[str, int] | None:
        """`stop_string_cut` on the visible text, for the latest token's `new_chars`
        visible characters. -> None, or (the stop string, the length of the whole text to
        keep): up to the stop string's first character (the special strings before it
        kept), or with `include` up to its last."""
        found = stop_string_cut(self.text, stops, new_chars, include)
        if found is None:
            return None
        stop, keep = found
        self.text = self.text[:keep]
        return stop, self.whole_at(keep, after_specials=not include)

    def emit_upto(self, stops, include: bool = False) -> int:
        """How much of the whole text a stream may send: all but what lies from the visible
        text's `stop_string_hold` held-back characters on (a later match cuts no earlier
        than their first, keeping the special strings before it)."""
        return self.whole_at(len(self.text) - stop_string_hold(self.text, stops, include))
