"""The GLM-4.7 reasoning parser: splits generated text into reasoning and content.

Flint (like GLM-4.5/4.7) thinks inside ``<think>...</think>`` at the start of an
assistant turn and answers after it. :class:`ReasoningParser` is a streaming state
machine over *text* (not token ids), so a tag split across any two chunks is
still recognised; :func:`split_reasoning` runs the same machine over a whole reply.

Rules (the same whether streamed or not):

* ``start`` state (the default): leading whitespace is held; if the reply then
  begins with ``<think>`` the tag and that whitespace are dropped and the parser
  enters ``reasoning``; any other text means the reply has no thinking block and
  everything, from its first character, is content.
* ``reasoning``: text goes to reasoning until ``</think>`` (dropped); after it,
  everything is content.
* A reply cut off inside the thinking block keeps all its text as reasoning; a
  reply with no tags keeps all its text as content. No text is lost except the
  two tags and whitespace before ``<think>``.
* When the prompt itself ends inside a thinking block (it ends with ``<think>``),
  start in ``reasoning`` (``initial="reasoning"``); when it ends with
  ``<think></think>`` (thinking disabled), start in ``content``. See
  :func:`initial_state_for_prompt`.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
STATES = ("start", "reasoning", "content")


def partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``
    (the part a streaming parser must hold back until the next chunk)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def initial_state_for_prompt(prompt_text: str) -> str:
    """The parser state a reply starts in, from the rendered prompt's end:
    ``"content"`` after ``<think></think>``, ``"reasoning"`` after an open
    ``<think>``, else ``"start"``."""
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_END):
        return "content"
    if tail.endswith(THINK_START):
        return "reasoning"
    return "start"


class ReasoningParser:
    """Streaming ``<think>`` splitter: ``feed(text)`` -> (reasoning_delta, content_delta);
    ``finish()`` returns what was held back. Deltas concatenate to exactly what
    :func:`split_reasoning` returns for the whole text.

    Raises:
        ValueError: ``initial`` is not one of ``"start"``, ``"reasoning"``, ``"content"``.
    """

    def __init__(self, initial: str = "start"):
        if initial not in STATES:
            raise ValueError(f"initial must be one of {STATES}, got {initial!r}")
        self.state = initial
        self.saw_reasoning = initial == "reasoning"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Add the next chunk of reply text. -> (reasoning delta, content delta)."""
        buf = self._held + text
        self._held = ""
        reasoning, content = [], []
        while buf:
            if self.state == "content":
                content.append(buf)
                buf = ""
            elif self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_START):
                    self.state = "reasoning"
                    self.saw_reasoning = True
                    buf = stripped[len(THINK_START):]
                elif THINK_START.startswith(stripped):  # all whitespace, or a partial tag
                    self._held = buf
                    buf = ""
                else:
                    self.state = "content"
            else:  # reasoning
                end = buf.find(THINK_END)
                if end >= 0:
                    reasoning.append(buf[:end])
                    buf = buf[end + len(THINK_END):]
                    self.state = "content"
                else:
                    keep = partial_suffix_len(buf, THINK_END)
                    reasoning.append(buf[:len(buf) - keep])
                    self._held = buf[len(buf) - keep:]
                    buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of the reply: release held text (a partial tag stays text). -> deltas."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held


def split_reasoning(text: str, initial: str = "start") -> tuple[str | None, str]:
    """Split a whole reply. -> (reasoning or None when there was no thinking block,
    content). Same rules as :class:`ReasoningParser`."""
    p = ReasoningParser(initial)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2 if p.saw_reasoning else None), c1 + c2
