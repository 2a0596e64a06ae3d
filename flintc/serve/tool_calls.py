"""The GLM-4.7 tool-call parser: ``<tool_call>`` blocks in a reply become OpenAI
``tool_calls``.

Format (what Flint's chat template asks the model for)::

    <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value>...</tool_call>

Whitespace around NAME and between the tags is allowed (GLM-4.5 puts newlines
there). Each block becomes ``{"name": NAME, "arguments": JSON}``, the arguments a
JSON object serialised to a string. A value is kept as a raw string when the
tool's JSON schema types that parameter ``"string"``; otherwise it is parsed as
JSON when it is valid JSON (``42``, ``true``, ``[1, 2]``, ``{"a": 1}``) and kept
as a string when it is not (the rule vLLM's GLM-4.5 parser follows).

A malformed block (no name, a name with ``<`` / ``>`` in it, stray text or tags
between the argument tags, a key without a value, a repeated key, or a block
never closed before the reply ends) is not an error: its raw text, tags
included, goes to content.

:class:`ToolCallParser` works on streamed text split anywhere (tags may be cut
across chunks): text outside blocks is passed through at once except a possible
partial ``<tool_call>`` at the end; a block is held until ``</tool_call>`` and then
emitted whole. Whitespace after a call is held and dropped unless more text
follows, so ``call\\ncall`` gives no stray ``"\\n"`` content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from flintc.serve.reasoning import partial_suffix_len

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"


def tool_call_id() -> str:
    """vLLM's id of a tool call it makes (`make_tool_call_id`, for the calls its tool parsers
    read and the forced ones alike): "chatcmpl-tool-" + 32 hex digits, fresh per call."""
    return "chatcmpl-tool-" + uuid.uuid4().hex


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is a JSON object as a string; ``id`` is
    `tool_call_id`'s (every call's, tool_choice "auto", "required" or named)."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)

    def to_openai(self, index: int | None = None) -> dict:
        """The OpenAI ``tool_calls`` entry (with ``index`` for a streamed delta)."""
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


def string_params(tools: list[dict] | None) -> dict[str, set[str]]:
    """Tool name -> names of its parameters whose JSON schema type is ``"string"``.
    ``tools``: OpenAI tool dicts (``{"type": "function", "function": {...}}``)."""
    out: dict[str, set[str]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        names = set()
        if isinstance(props, dict):
            for k, schema in props.items():
                t = schema.get("type") if isinstance(schema, dict) else None
                if t == "string" or (isinstance(t, list) and t and t[0] == "string"):
                    names.add(k)
        out[fn["name"]] = names
    return out


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def parse_call_body(body: str, string_args: dict[str, set[str]] | None = None) -> ToolCall | None:
    """Parse the text between ``<tool_call>`` and ``</tool_call>``. -> ToolCall, or
    None when it is malformed (see the module docstring)."""
    first = body.find(KEY_START)
    name = (body if first < 0 else body[:first]).strip()
    if not name or any(c in name for c in "<>"):
        return None
    args: dict = {}
    as_string = (string_args or {}).get(name, set())
    i = len(body) if first < 0 else first
    while True:
        i = _skip_ws(body, i)
        if i == len(body):
            break
        if not body.startswith(KEY_START, i):
            return None
        k_end = body.find(KEY_END, i)
        if k_end < 0:
            return None
        key = body[i + len(KEY_START):k_end].strip()
        i = _skip_ws(body, k_end + len(KEY_END))
        if not body.startswith(VALUE_START, i):
            return None
        v_end = body.find(VALUE_END, i)
        if v_end < 0:
            return None
        raw = body[i + len(VALUE_START):v_end]
        i = v_end + len(VALUE_END)
        if not key or key in args or any(t in key or t in raw for t in (KEY_START, VALUE_START)):
            return None
        args[key] = raw if key in as_string else _json_or_string(raw)
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_or_string(raw: str):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # (nested past Python's recursion limit: a 500 before)
        return raw


class ToolCallParser:
    """Streaming tool-call extraction: ``feed(text)`` -> (content delta, new calls);
    ``finish()`` -> the same for held text. Outputs concatenate to exactly what
    :func:`parse_tool_calls` gives for the whole text.

    Args:
        tools: the request's OpenAI tool definitions (for string-typed parameters);
            None parses every value as JSON-if-possible.
    """

    def __init__(self, tools: list[dict] | None = None):
        self._string_args = string_params(tools)
        self._in_call = False
        self._held = ""  # partial <tool_call> tag, or the open block's text
        self._ws = ""  # whitespace after a call, emitted only if text follows
        self._after_call = False  # no content since the last call: whitespace is held
        self.calls: list[ToolCall] = []

    def _content(self, text: str, out: list[str]) -> None:
        if not text:
            return
        if self._after_call and not (self._ws + text).strip():
            self._ws += text
            return
        out.append(self._ws + text)
        self._ws = ""
        self._after_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add the next chunk. -> (content delta, calls completed by this chunk)."""
        buf = self._held + text
        self._held = ""
        content: list[str] = []
        new: list[ToolCall] = []
        while buf:
            if not self._in_call:
                start = buf.find(CALL_START)
                if start < 0:
                    keep = partial_suffix_len(buf, CALL_START)
                    self._content(buf[:len(buf) - keep], content)
                    self._held = buf[len(buf) - keep:]
                    break
                self._content(buf[:start], content)
                buf = buf[start:]
                self._in_call = True
            end = buf.find(CALL_END)
            if end < 0:
                self._held = buf
                break
            block = buf[:end + len(CALL_END)]
            buf = buf[end + len(CALL_END):]
            self._in_call = False
            call = parse_call_body(block[len(CALL_START):-len(CALL_END)], self._string_args)
            if call is None:
                self._content(block, content)
            else:
                if self._ws:  # whitespace between two calls is dropped
                    self._ws = ""
                self.calls.append(call)
                self._after_call = True
                new.append(call)
        return "".join(content), new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of reply: an unclosed block or partial tag becomes content; whitespace
        after the last call is dropped."""
        held, self._held = self._held, ""
        self._in_call = False
        out: list[str] = []
        if held:
            self._content(held, out)
        if self._ws and not self.calls:
            out.append(self._ws)
        self._ws = ""
        return "".join(out), []


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """Parse a whole reply. -> (content text outside well-formed calls, calls)."""
    p = ToolCallParser(tools)
    c1, calls = p.feed(text)
    c2, _ = p.finish()
    return c1 + c2, calls
