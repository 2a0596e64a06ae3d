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
  ``json.dumps(ARGS, ensure_ascii=False)`` (ARGS's own text where it holds a number
  beyond a float's range, which json.dumps writes as ``Infinity``); ``finish_reason`` "tool_calls" when
  generation stopped. A reply cut by ``max_tokens`` before the array closes keeps the
  calls completed before the cut, and its raw text is the message's ``content``
  (vLLM fails such a reply: the array does not parse); ``finish_reason`` "length".

:func:`resolve_tool_choice` checks the field (the 400s, vLLM's wording);
:func:`tool_choice_spec` makes the structured-outputs constraint;
:class:`ForcedToolCalls` reads one choice's content, streamed or whole: a named
call's first delta carries index 0, its id, type and name and the arguments so far,
the next ones the arguments' further text; with ``"required"`` each call is sent
whole (index, id, type, name, arguments) once its object closes.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from flintc.serve.protocol import APIError, _dumps, check_guided_backend
from flintc.serve.tool_calls import ToolCall

NAMED = "named"
REQUIRED = "required"
_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
# a tool without parameters (or with empty ones): the empty object (vLLM's {"type": "object",
# "properties": {}}, whose extra properties its default backend, xgrammar, refuses in its strict mode)
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_id() -> str:
    """vLLM's id of a tool call it makes (`make_tool_call_id`): "chatcmpl-tool-" + 32 hex digits."""
    return "chatcmpl-tool-" + uuid.uuid4().hex


def _brief(value) -> str:
    """`value` as the 400s quote it: JSON (`protocol._dumps`), cut at 200 characters."""
    text = _dumps(value)
    return text if len(text) <= 200 else text[:200] + "..."


def resolve_tool_choice(tool_choice, tools: list[dict] | None) -> tuple[str, str | None, list[dict] | None]:
    """The request's tool choice: -> (mode, function name, tools), mode one of "none",
    "auto", `REQUIRED` or `NAMED` (with the name). Absent: "auto" with tools, else
    "none". ``"required"`` with an empty ``tools`` list is "none" with no tools (vLLM's
    reading: OpenAI's behaviour). ``tools`` are checked already (`_check_tools`).

    Raises:
        APIError(400, param "tool_choice"): "required" or a named function without
            ``tools`` ("When using `tool_choice`, `tools` must be set.", vLLM's), a
            name not among them ("Tool 'x' has not been passed in `tools`."), a dict
            whose type is not "function" or without ``function.name``, another string.
    """
    if tool_choice is None:
        return ("auto" if tools else "none"), None, tools
    if tool_choice in ("none", "auto"):
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


def _raw_value(text: str, key: str) -> str:
    """The text of the value of `key` (the last one) in `text`, a JSON object (valid)."""
    decoder, ws = json.JSONDecoder(), json.decoder.WHITESPACE
    found, k = None, ws.match(text, text.index("{") + 1).end()
    while text[k] != "}":
        name, k = decoder.raw_decode(text, k)
        k = ws.match(text, ws.match(text, k).end() + 1).end()  # past the ':'
        start = k
        _, k = decoder.raw_decode(text, k)
        if name == key:
            found = text[start:k]
        k = ws.match(text, k).end()
        if text[k] == ",":
            k = ws.match(text, k + 1).end()
    return found


class ForcedToolCalls:
    """One choice's forced reply (its content, after the reasoning parser), read as tool
    calls: `feed` the content's pieces, then `finish`.

    calls: the calls so far (`ToolCall`, ids `tool_call_id`).
    complete: `REQUIRED`: the array closed (set by `finish`); a named call is always
        complete.
    """

    def __init__(self, mode: str, name: str | None = None):
        self.mode, self.name = mode, name
        self.calls: list[ToolCall] = []
        self.complete = mode == NAMED
        self._text: list[str] = []
        # REQUIRED's scan of the array: nesting depth, inside a string, after a backslash,
        # the text of the item being read (at depth >= 2)
        self._depth, self._in_string, self._escape = 0, False, False
        self._item: list[str] = []

    @property
    def text(self) -> str:
        """The content as generated."""
        return "".join(self._text)

    def feed(self, text: str) -> list[dict]:
        """The next piece of content. -> the ``delta.tool_calls`` entries it makes."""
        if not text:
            return []
        self._text.append(text)
        if self.mode == NAMED:
            if not self.calls:
                self.calls.append(ToolCall(self.name, text, tool_call_id()))
                return [self.calls[0].to_openai(0)]
            self.calls[0].arguments += text
            return [{"index": 0, "function": {"arguments": text}}]
        out = []
        start = 0  # where this piece's part of the current item starts
        for k, ch in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    start = k
                    self._item = []
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1:
                    self._item.append(text[start:k + 1])
                    call = self._call("".join(self._item))
                    self._item = []
                    if call is not None:
                        self.calls.append(call)
                        out.append(call.to_openai(len(self.calls) - 1))
        if self._depth >= 2:
            self._item.append(text[start:])
        return out

    @staticmethod
    def _call(item: str) -> ToolCall | None:
        try:
            obj = json.loads(item)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "parameters" not in obj:
            return None
        try:
            arguments = json.dumps(obj["parameters"], ensure_ascii=False, allow_nan=False)
        except ValueError:  # a number beyond a float's range (1e999: inf, written "Infinity", not JSON)
            arguments = _raw_value(item, "parameters")
        return ToolCall(obj["name"], arguments, tool_call_id())

    def finish(self) -> str:
        """The end of the reply. -> content to send: for `REQUIRED`, the raw text when it
        is not a whole array of calls (cut by max_tokens), else ""."""
        if self.mode == NAMED:
            return ""
        try:
            items = json.loads(self.text)
        except ValueError:
            items = None
        self.complete = isinstance(items, list) and len(items) == len(self.calls) > 0
        return "" if self.complete else self.text
