"""Forced tool calls: ``tool_choice`` ``"required"`` and a named function
(``{"type": "function", "function": {"name": NAME}}``) in ``/v1/chat/completions``, as
vLLM makes them: the reply is constrained by a JSON schema (structured outputs,
:mod:`flintc.structured`) and read back as OpenAI ``tool_calls``, with no tool-call
parser (and no ``--enable-auto-tool-choice``) needed.

* A named function: the reply is the arguments, constrained to the function's
  ``parameters`` schema (``{"type": "object", "properties": {}}`` when it has none or
  an empty one); it becomes one call of that function whose ``arguments`` are the
  generated text, whole or (cut by ``max_tokens``) partial. ``finish_reason`` stays
  the generation's ("stop" / "length"), as in vLLM and OpenAI.
* ``"required"``: the reply is a JSON array of at least one
  ``{"name": NAME, "parameters": ARGS}`` object (no other keys), each ``anyOf`` one tool's
  (:func:`tool_choice_schema`, vLLM's `_get_json_schema_from_tool`, each tool's
  ``$defs`` gathered at the top); each item becomes one call, ``arguments``
  ``json.dumps(ARGS, ensure_ascii=False)`` as `_CallArray` writes it (a number beyond a
  float's range keeps its text, which json.dumps writes as ``Infinity``, no JSON);
  ``finish_reason`` "tool_calls" when generation stopped. A reply cut by ``max_tokens``
  before the array closes keeps the calls completed before the cut, and its raw text
  is the message's ``content`` (vLLM fails such a reply: the array does not parse);
  ``finish_reason`` "length".

:func:`resolve_tool_choice` checks the field (the 400s, vLLM's wording);
:func:`tool_choice_spec` makes the structured-outputs constraint;
:class:`ForcedToolCalls` reads one choice's content, streamed or whole: a call's first
delta carries its index, id, type and name and the arguments so far, the next ones the
arguments' further text; a named call's arguments are the generated text as it comes,
``"required"``'s are sent as they grow (vLLM's `extract_tool_call_required_streaming`),
so that each call's deltas add up to the unstreamed call (`_CallArray`).
``parallel_tool_calls`` false (one call) is the route's (`flintc.serve.app`).
"""

from __future__ import annotations

import copy
import json
import re
from json.encoder import encode_basestring
from typing import Any

from flintc.serve.protocol import APIError, _dumps, check_guided_backend
from flintc.serve.tool_calls import ToolCall, tool_call_id  # noqa: F401 (tool_call_id: re-exported)

NAMED = "named"
REQUIRED = "required"
_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
# a tool without parameters (or with empty ones): the empty object (vLLM's {"type": "object",
# "properties": {}}, whose extra properties its default backend, xgrammar, refuses in its strict mode)
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _brief(value) -> str:
    """`value` as the 400s quote it: JSON (`protocol._dumps`), cut at 200 characters."""
    text = _dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."


def resolve_tool_choice(tool_choice, tools: list[dict] | None) -> tuple[str, str | None, list[dict] | None]:
    """The request's tool choice: -> (mode, function name, tools), mode one of "none",
    "auto", `REQUIRED` or `NAMED` (with the name). Absent or null: "auto" with tools,
    else "none". ``"none"`` is taken with or without ``tools``. ``"required"`` with an
    empty ``tools`` list is "none" with no tools (vLLM's reading: OpenAI's behaviour).
    ``tools`` are checked already (`_check_tools`).

    Raises:
        APIError(400, param "tool_choice"): "auto", "required" or a named function
            without ``tools`` (absent or null: "When using `tool_choice`, `tools` must
            be set.", vLLM's ``check_tool_usage``, as OpenAI; "auto" was taken as "none"
            before), a name not among them ("Tool 'x' has not been passed in
            `tools`."), a dict whose type is not "function" or without
            ``function.name``, another string.
    """
    if tool_choice is None:
        return ("auto" if tools else "none"), None, tools
    if tool_choice == "none":
        return tool_choice, None, tools
    if tool_choice == "auto":
        if tools is None:
            raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return tool_choice, None, tools
    if not isinstance(tool_choice, dict) and tool_choice != REQUIRED:
        raise APIError(400, f"Invalid value for `tool_choice`: {_brief(tool_choice)}! Only named tools, \"none\", "
                       f"\"auto\" or \"required\" are supported.", param="tool_choice")
    if isinstance(tool_choice, dict):
        if tool_choice.get("type", "function") != "function":
            raise APIError(400, f"Invalid `type` in `tool_choice`: {_brief(tool_choice.get('type'))}, "
                           f"expected \"function\". {_USAGE}", param="tool_choice")
        function = tool_choice.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"Invalid value for `function`: `{_brief(function)}` in `tool_choice`! {_USAGE}",
                           param="tool_choice")
        if "name" not in function:
            raise APIError(400, f"Expected field `name` in `function` in `tool_choice`! {_USAGE}",
                           param="tool_choice")
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise APIError(400, f"Invalid `name` in `function`: `{_brief(name)}` in `tool_choice`! {_USAGE}",
                           param="tool_choice")
    if tools is None:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if tool_choice == REQUIRED:
        return ("none", None, None) if not tools else (REQUIRED, None, tools)
    if name not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
    return NAMED, name, tools


def _named_index(tools: list[dict], name: str) -> int:
    """The index of the tool a named tool_choice picks: the last of that name (vLLM's
    ``{tool.function.name: tool.function for tool in tools}[name]``)."""
    return max(k for k, t in enumerate(tools) if t["function"]["name"] == name)


_OBJECT_KEYWORDS = frozenset(("properties", "required", "additionalProperties", "patternProperties"))
_NOT_ONLY_OBJECT = frozenset(("type", "$ref", "anyOf", "oneOf", "allOf", "enum", "const"))


def _parameters(tool: dict) -> dict:
    """A tool's parameters schema; none or an empty one: an object of no properties (what
    vLLM generates for them). One without ``type`` whose keywords are an object's
    (``properties``, ``required``, ...; no ``anyOf``, ``$ref``, ``enum`` ...) gets
    ``"type": "object"``: JSON Schema would let any other JSON value through (the
    arguments ``true``), where vLLM's default backend, xgrammar, reads it as an object."""
    params = tool["function"].get("parameters")
    if not params:
        return dict(EMPTY_PARAMETERS)
    if params.keys() & _OBJECT_KEYWORDS and not params.keys() & _NOT_ONLY_OBJECT:
        return {"type": "object", **params}
    return params


# keywords whose values are data, not subschemas: a "$ref" key inside them is no reference
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))
# keywords whose values map names (any: "default", "$ref", ...) to subschemas
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))


def _rebase_refs(node, base: str):
    """A copy of schema `node` whose document-relative references (``"#"``, ``"#/..."``)
    point under ``base`` (the JSON pointer where the schema now sits, ``"#/..."``), but
    ``#/$defs/...`` ones (the ``$defs`` move to the top, `tool_choice_schema`). Values of
    `_DATA_KEYWORDS`, and schemas with an ``$id`` (a resource of their own, which their
    references are relative to), are kept as given."""
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    if not isinstance(node, dict) or "$id" in node:
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")) \
                and not (value == "#/$defs" or value.startswith("#/$defs/")):
            out[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, base) for name, sub in value.items()}
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebase_refs(value, base)
    return out


def tool_choice_schema(mode: str, name: str | None, tools: list[dict]) -> dict[str, Any]:
    """The JSON schema a forced reply follows (vLLM's `_get_json_schema_from_tool`):
    the named function's parameters, or for `REQUIRED` an array (at least one item) of
    objects each ``anyOf`` one tool's ``{"name": {"enum": [NAME]}, "parameters": ...}``;
    each tool's ``$defs`` move to the array's top-level ``$defs`` (so ``#/$defs/X``
    references still resolve); a tool's other document-relative references (``"#"``,
    ``"#/properties/a"``, as zod-to-json-schema writes them) are rebased to where its
    parameters sit in the array's schema (`_rebase_refs`; vLLM leaves them pointing into
    the array's schema, a 400 or a wrong constraint). The request's tools are not changed. Unlike vLLM's
    schema, these objects (and the empty parameters, `EMPTY_PARAMETERS`) say
    ``"additionalProperties": false``: llguidance follows JSON Schema and would let the
    model write further keys, which vLLM's default backend (xgrammar, strict) refuses.
    A tool's own parameters schema is kept as given (but `_parameters`'s missing object type).

    Raises:
        APIError(400, param "tools"): two tools define one ``$defs`` name differently
            (vLLM's message), or a ``$defs`` that is not an object.
    """
    if mode == NAMED:
        return _parameters(tools[_named_index(tools, name)])
    all_defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        params = _parameters(tool)
        base = f"#/items/anyOf/{i}/properties/parameters"
        # (a schema with an $id is a resource of its own: its "#/$defs/..." stay with it)
        if "$defs" in params and "$id" not in params:
            params = copy.copy(params)
            defs = params.pop("$defs")
            if not isinstance(defs, dict):
                raise APIError(400, f"tools[{i}].function.parameters.$defs must be an object, got "
                               f"{_brief(defs)}", param=f"tools[{i}].function.parameters")
            for def_name, def_schema in defs.items():
                def_schema = _rebase_refs(def_schema, base)
                if def_name in all_defs and all_defs[def_name] != def_schema:
                    raise APIError(400, f"Tool definition '{def_name}' has multiple schemas, which is not "
                                   f"supported (tool_choice \"required\" gathers every tool's $defs in one "
                                   f"schema).", param="tools")
                all_defs[def_name] = def_schema
        params = _rebase_refs(params, base)
        variants.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if all_defs:
        schema["$defs"] = all_defs
    return schema


def tool_choice_spec(req, mode: str, name: str | None, tools: list[dict]):
    """The `flintc.sampling.StructuredOutputsParams` of a forced reply: its schema
    (`tool_choice_schema`), with the request's ``guided_whitespace_pattern`` (vLLM applies
    it to the tool's schema too). llguidance checks the schema (without the tokenizer):
    call it off the event loop.

    Raises:
        APIError(400): `tool_choice_schema`'s; a ``guided_decoding_backend`` other than
            llguidance's names; a schema llguidance refuses (naming the tool's
            parameters, or "tools" for "required").
    """
    from flintc.errors import InputError
    from flintc.sampling import StructuredOutputsParams

    check_guided_backend(req)
    schema = tool_choice_schema(mode, name, tools)
    if mode == NAMED:
        i = _named_index(tools, name)
        where, param = f"tools[{i}].function.parameters (the function tool_choice names)", \
            f"tools[{i}].function.parameters"
    else:
        where, param = "the tools' parameters (tool_choice \"required\")", "tools"
    try:
        return StructuredOutputsParams(json=schema, whitespace_pattern=req.guided_whitespace_pattern)
    except InputError as exc:
        msg = str(exc)
        if "'whitespace_pattern'" in msg:
            raise APIError(400, f"'guided_whitespace_pattern': {msg}", param="guided_whitespace_pattern") from None
        prefix = "structured_outputs field 'json': "
        msg = msg[len(prefix):] if msg.startswith(prefix) else msg
        raise APIError(400, f"{where}: the JSON schema is refused: {msg}", param=param) from None


_WS = " \t\n\r"
_END_OF_BARE = _WS + ",:]}"  # what ends a number or literal
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}  # others: the character itself


def _bare_json(token: str) -> str:
    """A number or literal (``true``, ``false``, ``null``) as ``json.dumps(json.loads(token))``
    writes it (``1.50`` -> ``1.5``, ``1e5`` -> ``100000.0``); as generated where json.dumps
    would write no JSON (``1e999``, a float's inf: "Infinity") or Python refuses it (an int
    of over 4300 digits)."""
    try:
        return json.dumps(json.loads(token), allow_nan=False)
    except ValueError:
        return token


class _CallArray:
    """`REQUIRED`'s reply, vLLM's array ``[{"name": NAME, "parameters": ARGS}, ...]``, read
    as its text comes (in pieces split anywhere), as vLLM streams it
    (`OpenAIServingChat.extract_tool_call_required_streaming`, serving_chat.py): a call
    is sent once its name is whole and its parameters have begun (index, id, type, name
    and the arguments so far), then its further arguments as they grow.

    The arguments are ARGS re-written as ``json.dumps(ARGS, ensure_ascii=False)`` writes
    them (vLLM's unstreamed arguments: separators ``", "`` and ``": "``, strings
    re-escaped, numbers as Python reads them, `_bare_json`), each part as soon as no
    later text can change it: a string's characters as they come, a number or literal
    once it ends; so the pieces add up to the whole call's arguments. (vLLM streams the
    raw text instead, which its unstreamed arguments need not match.) A key written
    twice stays twice (json.loads would keep the last value). Text that is no such
    array (the grammar writes none) gives no error.

    calls: the calls whose object closed (`ToolCall`, ids `tool_call_id`).
    items: how many items of the array closed (calls or not); closed: the array closed.
    """

    def __init__(self):
        self.calls: list[ToolCall] = []
        self.items = 0
        self.closed = False
        # the open arrays and objects: [is an object, a key comes next, the key read last]
        self._stack: list[list] = []
        self._token: str | None = None  # a number or literal being read
        self._chars: list[str] | None = None  # a string being read, decoded
        self._is_key = False
        self._shown = 0  # how many of _chars are written
        self._escape: str | None = None  # a backslash escape being read ("\\", "\\u00")
        self._high: str | None = None  # a \uD800-\uDBFF escape, waiting for its low surrogate
        self._deltas: list[dict] = []
        self._new_item()

    def _new_item(self):
        # the item being read: its "name" and "parameters" values as written (pieces),
        # its call once sent, how many pieces of the arguments are sent
        self._name: list[str] = []
        self._args: list[str] = []
        self._has_args = False
        self._call: ToolCall | None = None
        self._sent = 0
        self._sink: list[str] | None = None  # where the text read now is written

    def feed(self, text: str) -> list[dict]:
        """The next piece of the reply. -> the ``delta.tool_calls`` entries it makes."""
        self._deltas = []
        for ch in text:
            if self._chars is not None:
                self._string_char(ch)
                continue
            if self._token is not None:
                if ch not in _END_OF_BARE:
                    self._token += ch
                    continue
                self._write(_bare_json(self._token))
                self._token = None
                self._value_end()
            if ch in _WS:
                continue
            top = self._stack[-1] if self._stack else None
            if ch == '"':
                self._is_key = top is not None and top[0] and top[1]
                if not self._is_key:
                    self._value_start()
                self._chars, self._shown = [], 0
                self._write('"')
            elif ch in "{[":
                self._value_start()
                self._write(ch)
                self._stack.append([ch == "{", True, None])
            elif ch in "}]":
                if top is None:
                    continue
                self._write(ch)
                self._stack.pop()
                self.closed |= not self._stack
                self._value_end()
            elif ch == ",":
                self._write(", ")
                if top is not None:
                    top[1] = True
            elif ch == ":":
                self._write(": ")
            else:
                self._value_start()
                self._token = ch
        self._show_chars()
        self._send()
        return self._deltas

    def _write(self, text: str):
        if self._sink is not None:
            self._sink.append(text)

    def _member(self) -> str | None:
        """The key of the item's member whose value starts or ends now (None: elsewhere)."""
        if len(self._stack) == 2 and self._stack[1][0]:
            return self._stack[1][2]
        return None

    def _value_start(self):
        key = self._member()
        if key is not None:
            self._sink = self._args if key == "parameters" else self._name if key == "name" else None
            self._has_args |= key == "parameters"

    def _value_end(self):
        key = self._member()
        if key is not None:
            self._sink = None
        elif len(self._stack) == 1:  # an item closed
            self.items += 1
            self._send()
            if self._call is not None:
                self.calls.append(self._call)
            self._new_item()

    def _string_char(self, ch: str):
        if self._escape is not None:
            self._escape += ch
            if self._escape[1] != "u":
                self._escape = None
                self._add_char(_ESCAPES.get(ch, ch))
            elif len(self._escape) == 6:
                try:
                    char = chr(int(self._escape[2:], 16))
                except ValueError:  # (no JSON)
                    char = self._escape
                self._escape = None
                self._add_char(char)
            return
        if ch == "\\":
            self._escape = ch
        elif ch != '"':
            self._add_char(ch)
        else:  # the string ends
            if self._high is not None:
                self._chars.append(self._high)
                self._high = None
            self._show_chars()
            self._write('"')
            chars, self._chars = "".join(self._chars), None
            if self._is_key:
                self._stack[-1][1:] = [False, chars]
            else:
                self._value_end()

    def _add_char(self, char: str):
        """One character of a string, decoded; a surrogate pair written as two \\u escapes
        is one character, as json.loads reads it (a lone one stays alone)."""
        if self._high is not None:
            high, self._high = self._high, None
            if "\udc00" <= char <= "\udfff":
                self._chars.append(chr(0x10000 + ((ord(high) - 0xD800) << 10) + ord(char) - 0xDC00))
                return
            self._chars.append(high)
        if "\ud800" <= char <= "\udbff":
            self._high = char
        else:
            self._chars.append(char)

    def _show_chars(self):
        """Write the string's characters read so far (json.dumps's escapes; a lone
        surrogate, which json.dumps would write raw and UTF-8 cannot encode, as its \\u
        escape)."""
        if self._chars is not None and len(self._chars) > self._shown:
            text = encode_basestring("".join(self._chars[self._shown:]))[1:-1]
            self._write(_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text))
            self._shown = len(self._chars)

    def _send(self):
        """The item's call, once its name is whole and its parameters have begun; then
        its arguments written since."""
        if self._call is None:
            try:
                name = json.loads("".join(self._name))
            except ValueError:  # not yet whole
                name = None
            if not (self._has_args and isinstance(name, str)):
                return
            self._call = ToolCall(name, "".join(self._args), tool_call_id())
            self._sent = len(self._args)
            self._deltas.append(self._call.to_openai(len(self.calls)))
        elif len(self._args) > self._sent:
            piece = "".join(self._args[self._sent:])
            self._sent = len(self._args)
            self._call.arguments += piece
            self._deltas.append({"index": len(self.calls), "function": {"arguments": piece}})


class ForcedToolCalls:
    """One choice's forced reply (its content, after the reasoning parser), read as tool
    calls: `feed` the content's pieces, then `finish`.

    calls: the calls so far (`ToolCall`, ids `tool_call_id`); with `REQUIRED`, those whose
        object closed (`_CallArray`).
    complete: `REQUIRED`: the array closed (set by `finish`); a named call is always
        complete.
    """

    def __init__(self, mode: str, name: str | None = None):
        self.mode, self.name = mode, name
        self.complete = mode == NAMED
        self._text: list[str] = []
        self._array = _CallArray() if mode == REQUIRED else None
        self.calls: list[ToolCall] = self._array.calls if self._array is not None else []

    @property
    def text(self) -> str:
        """The content as generated."""
        return "".join(self._text)

    def feed(self, text: str) -> list[dict]:
        """The next piece of content. -> the ``delta.tool_calls`` entries it makes."""
        if not text:
            return []
        self._text.append(text)
        if self._array is not None:
            return self._array.feed(text)
        if not self.calls:
            self.calls.append(ToolCall(self.name, text, tool_call_id()))
            return [self.calls[0].to_openai(0)]
        self.calls[0].arguments += text
        return [{"index": 0, "function": {"arguments": text}}]

    def finish(self) -> str:
        """The end of the reply. -> content to send: for `REQUIRED`, the raw text when it
        is not a whole array of calls (cut by max_tokens), else ""."""
        if self.mode == NAMED:
            return ""
        try:
            items = json.loads(self.text)
            self.complete = isinstance(items, list) and len(items) == len(self.calls) > 0
        except ValueError:
            self.complete = False
        except RecursionError:  # nested past Python's recursion limit (a 500 before): the reader's count
            self.complete = self._array.closed and self._array.items == len(self.calls) > 0
        return "" if self.complete else self.text
