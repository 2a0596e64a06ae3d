"""Stop strings (vLLM's `SamplingParams.stop`): one match for the serving engine
(`flintc.serve.engine`) and the Python API / `flintc run` (`flintc.runtime.generate`).

A sequence's text is made token by token (`flintc.checkpoint.tokenizer.
IncrementalDetokenizer`); after each token, once more than `min_tokens` tokens are out
(vLLM looks for stop strings only then), the text not searched yet, with the longest stop
string's length minus one characters before it, is searched for every stop string. The
earliest match wins (at one position, the first in the list); the text ends before it, or
after it with `include_stop_str_in_output`, and the sequence ends with finish reason
"stop". The token ids keep the token that completed the match (vLLM's `token_ids` do),
whatever characters of it follow the stop string.

"Searched" is where the server's streamed text had got to: it sends the text up to the
longest suffix that might begin a stop string (`stop_string_hold`), which it holds back
until it is not. `StopStringText` keeps that cursor for a caller that streams nothing, so
that both cut the same text at the same token.

No torch here: the functions work on Python strings.
"""

from __future__ import annotations


def stop_string_cut(text: str, stops, searched: int, include: bool) -> tuple[str, int] | None:
    """The first stop string in `text` past what was searched already.

    Args:
        text: the sequence's text so far.
        stops: the stop strings (non-empty strings; at least one).
        searched: characters of `text` searched (and sent) already: the search starts
            the longest stop string's length minus one before it, so that a match that
            ends in the new text is found.
        include: cut after the stop string (vLLM's include_stop_str_in_output), else
            before it.

    Returns:
        None for no match; else (the stop string, the length of `text` to keep): the
        earliest match, the first of `stops` among matches at one position.
    """
    longest = max(len(s) for s in stops)
    begin = max(0, searched - longest + 1)
    hits = [(i, s) for i, s in ((text.find(s, begin), s) for s in stops) if i >= 0]
    if not hits:
        return None
    at, stop = min(hits, key=lambda h: h[0])
    return stop, at + len(stop) if include else at


def stop_string_hold(text: str, stops) -> int:
    """How many trailing characters of `text` to hold back while streaming: the longest
    suffix that is a proper prefix of one of `stops` (0 for none, or no stops)."""
    return max((_prefix_overlap(text, s) for s in stops), default=0)


def _prefix_overlap(text: str, stop: str) -> int:
    """Longest suffix of text that is a proper prefix of stop (held back when streaming)."""
    for k in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-k:]):
            return k
    return 0


class StopStringText:
    """One sequence's text, cut at its stop strings as the serving engine cuts it.

    Args:
        detokenizer: the sequence's `IncrementalDetokenizer` (a fresh one).
        stops: the stop strings (a tuple, possibly empty).
        include: keep the stop string in the text (include_stop_str_in_output); and the
            text of a stop token the sequence ends at (`push_stop_token`).

    Attributes:
        text: the text so far (cut at the stop string once one matched).
        matched: the stop string that ended the sequence, or None.
    """

    def __init__(self, detokenizer, stops=(), include: bool = False):
        self._detok = detokenizer
        self.stops = tuple(stops)
        self.include = include
        self.text = ""
        self.matched: str | None = None
        self._searched = 0

    def push(self, token_id: int, n_out: int, min_tokens: int) -> bool:
        """Add the `n_out`-th generated token (1-based). -> True when its text completed a
        stop string (looked for only when n_out > min_tokens): `text` is cut, `matched`
        set, and the sequence ends."""
        self.text += self._detok.push(token_id)
        if self.stops and n_out > min_tokens:
            cut = stop_string_cut(self.text, self.stops, self._searched, self.include)
            if cut is not None:
                self.matched, keep = cut
                self.text = self.text[:keep]
                self._detok.flush()  # the rest of the token's bytes: not text
                return True
        self._searched = max(self._searched, len(self.text) - stop_string_hold(self.text, self.stops))
        return False

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
