"""Request models (pydantic) of the OpenAI API subset `flintc serve` answers, and the
OpenAI error body.

Requests are validated strictly from JSON (``model_validate_json``): a wrong type is
a 400 (an integer field takes a number with a zero fraction, ``"n": 2.0``, as vLLM's lax
models do, but not 2.5, a bool, a string or a number outside 64 bits: :data:`Int`), and
so is an unknown field (as the OpenAI API does: "Unrecognized request argument").
Fields that OpenAI defines but Flint cannot honour are accepted only at their neutral
value (e.g. ``best_of: 1``); any other value is a 400 naming the field (:func:`unsupported`).
``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` are honoured, with
vLLM's semantics (:mod:`flintc.sampling`). Purely
informational fields (``user``, ``metadata``, ``store``, ...) are accepted and ignored.

Extensions, as vLLM names them: ``top_k`` (FLINT_SPEC section 6: 20 by default;
0 or -1 keeps all), ``repetition_penalty``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``return_token_ids`` (adds
``prompt_token_ids`` to the response and ``token_ids`` to each choice),
``skip_special_tokens``, ``spaces_between_special_tokens`` (accepted; no effect, as in vLLM
with a fast tokenizer), ``stop_token_ids``, ``include_stop_str_in_output``, and for
chat ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``),
``add_generation_prompt`` and ``continue_final_message``, and ``prompt_logprobs`` (0..20:
the log-probability of each prompt token and of the most likely tokens at its place,
answered in vLLM's shape, not with ``stream``; checked in :mod:`flintc.serve.app`).
vLLM's other request fields are accepted: ``request_id``, ``truncate_prompt_tokens``,
``add_special_tokens``, chat ``documents``, ``bad_words``, ``allowed_token_ids`` (both
in :mod:`flintc.sampling`) and ``return_tokens_as_token_ids`` (logprobs' tokens as
``"token_id:{id}"``), ``cache_salt`` (requests share prefix-cached K/V only with the
same salt), ``priority`` (with ``--scheduling-policy priority``; else only 0), chat
``echo`` (the last message's content before the reply, vLLM's rule) and chat
``include_reasoning`` (false: no reasoning in the reply) are honoured
(:mod:`flintc.serve.app`), ``length_penalty`` has no effect here, the rest only at their
no-op value (`unsupported`).

Structured outputs (constrained decoding, vLLM's, on llguidance: vLLM's "guidance"
backend; :mod:`flintc.structured`), gathered by :func:`structured_outputs_spec` into one
`flintc.sampling.StructuredOutputsParams`: OpenAI's ``response_format``
(``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}``) and vLLM's
``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...],
"triggers": [...]}`` (its `StructuralTagResponseFormat`, which vLLM turns into
``structured_outputs.structural_tag``, the object's JSON text), vLLM's
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar`` (Lark, as
llguidance reads it; GBNF is converted), ``json_object``, ``structural_tag`` (the JSON
text of such an object, as vLLM's, or the object), and its options
``disable_any_whitespace``, ``disable_additional_properties``, ``whitespace_pattern``,
``disable_fallback``), and vLLM's older ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``, ``structural_tag`` and
``guided_whitespace_pattern``. One kind at most (else a 400, vLLM's "You can only use
one kind of guided decoding"); ``guided_decoding_backend`` may be null, "auto",
"guidance" or "llguidance" (llguidance runs every one). A schema, regex, grammar or
structural tag that llguidance (or the structural tag's shape) refuses is a 400 naming
the field, with llguidance's message. Chat's ``tool_choice``
``"required"`` or a named function makes its own constraint from ``tools``
(:mod:`flintc.serve.tool_choice`), which none of these fields may join.

vLLM's ``/tokenize`` and ``/detokenize`` take :class:`TokenizeCompletionRequest` /
:class:`TokenizeChatRequest` and :class:`DetokenizeRequest`, with vLLM's fields.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError


# /v1/completions' max_tokens when the field is absent (OpenAI's and vLLM's default); an
# explicit null is each prompt's rest of the context (`CompletionRequest`)
COMPLETION_DEFAULT_MAX_TOKENS = 16
INT_RANGE = "[-2**63, 2**63)"  # an Int's: 64 bits, as vLLM's pydantic parses an integer from a float


def _brief(value: int | float) -> str:
    """A number for an error message: a float as JSON gave it (1e+308), an int of up to
    64 bits as it is, a longer one as its number of digits."""
    if type(value) is float or value.bit_length() <= 64:
        return repr(value)
    try:
        return f"an integer of {len(str(abs(value)))} digits"
    except ValueError:  # past Python's int-to-str limit (4300 digits)
        return "an integer of over 4300 digits"


def _integral_float_as_int(value):
    """A JSON number with a zero fraction (2.0, 1e3, -0.0) as the int it equals; any
    other value unchanged, for the strict int check to take or refuse (2.5, NaN, true,
    "2": 400). An integer, or integral float, outside INT_RANGE is refused here, with
    a short message (`_brief`): 1e308 as an int has 309 digits, which the fields' own
    range checks ('seed', 'n', token ids, ...) printed in full."""
    if (type(value) is float and value.is_integer()) or type(value) is int:
        if not -2**63 <= value < 2**63:
            raise PydanticCustomError("int_range", "Input should be an integer in {range}, got {given}",
                                      {"range": INT_RANGE, "given": _brief(value)})
        return int(value)
    return value


# An integer field: an int, or a float with a zero fraction (2.0), as vLLM's lax pydantic
# models take it ("n": 2.0 was a 400 here); 2.5, a bool and a string stay 400s naming the
# field, as the strict models answer any other wrong type. Either is in INT_RANGE (vLLM's
# pydantic refuses a float past it, and its 'seed' an int past it; nothing here needs more).
Int = Annotated[int, BeforeValidator(_integral_float_as_int)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None  # OpenAI's option; nothing to obfuscate here


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: Int | None = None
    n: Int | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: Int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: Int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: Int | None = None  # vLLM's: 0..20 alternatives per prompt token
    # vLLM's other request fields (its protocol.py), which clients send at their defaults:
    # honoured: request_id (the response id), truncate_prompt_tokens, add_special_tokens
    # (per route, below), bad_words, allowed_token_ids, return_tokens_as_token_ids,
    # cache_salt (prefix caching), priority (--scheduling-policy priority; else 0 only);
    # no effect here: length_penalty (beam search only, as in vLLM without
    # use_beam_search); accepted only at their no-op value (`unsupported`): the others
    request_id: str | None = None
    truncate_prompt_tokens: Int | None = None
    length_penalty: float = 1.0
    cache_salt: str | None = None
    use_beam_search: bool = False
    priority: Int = 0
    bad_words: list[str] | None = None
    allowed_token_ids: list[Int] | None = None
    return_tokens_as_token_ids: bool | None = None
    logits_processors: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's (chat): add_special_tokens (the tokenizer's own on top of the template's),
    # documents (passed to the template), echo (the last message's content before the
    # reply) and include_reasoning (false: the reasoning left out) honoured; the others only
    # at their no-op value
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    echo: bool | None = None
    include_reasoning: bool = True
    best_of: Int | None = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    # informational: accepted, ignored
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # defined by OpenAI, not supported: must be absent or null
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(_Common):
    """POST /v1/completions. ``max_tokens`` is vLLM's ``Optional[int] = 16``: absent,
    16 (:data:`COMPLETION_DEFAULT_MAX_TOKENS`); an explicit null, None, which
    :mod:`flintc.serve.app` reads as the rest of the context of each prompt
    (--max-model-len minus its tokens, vLLM's get_max_tokens)."""

    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: Int | None = None
    echo: bool | None = None
    best_of: Int | None = None
    suffix: str | None = None
    # vLLM's (completions): add_special_tokens honoured (vLLM's default: true, a BOS
    # the tokenizer's post-processor adds to a text prompt); the others only when null
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    prompt_embeds: Any = None


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a ``prompt``: its token ids, with the tokenizer's special
    tokens (its post-processor's, e.g. a BOS) unless ``add_special_tokens`` is false."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with ``messages``: the ids of the chat as rendered for
    /v1/chat/completions (``tools`` included), with the generation prompt unless
    ``add_generation_prompt`` is false; ``add_special_tokens`` adds the tokenizer's own
    on top of the template's (default: not). ``continue_final_message`` is accepted
    only as false."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize: the text of ``tokens`` (special tokens kept)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[Int]


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "server_error"]


class APIError(Exception):
    """An error answered in the OpenAI format with HTTP ``status``."""

    def __init__(self, status: int, message: str, type: ErrorType = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API answers."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# vLLM's fields accepted only as null ({} too for the first)
_VLLM_NULL_OR_EMPTY = ("logits_processors", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs",
                       "media_io_kwargs")
# guided_decoding_backend values taken: llguidance serves each (vLLM's "guidance" backend)
GUIDED_BACKENDS = (None, "auto", "guidance", "llguidance")
_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                  ("guided_grammar", "grammar"), ("structural_tag", "structural_tag"))


def _response_format_kind(rf: dict | None) -> tuple[str, Any] | None:
    """OpenAI's ``response_format`` as (StructuredOutputsParams field, value), None for
    absent or ``{"type": "text"}``. vLLM's ``{"type": "structural_tag", "structures",
    "triggers"}`` is ("structural_tag", its JSON text), as vLLM's chat and completions
    make ``structured_outputs.structural_tag`` of it (its shape is
    `flintc.structured.parse_structural_tag`'s to check).

    Raises:
        APIError(400, param "response_format"): another type, a key the type does not
            take, a json_schema not of OpenAI's shape; a structural_tag of vLLM's newer
            form ``{"type": "structural_tag", "format": ...}`` (xgrammar's structural
            tag, which vLLM's guidance backend does not read either), code
            "unsupported_parameter".
    """
    if rf is None:
        return None
    kind = rf.get("type")
    allowed = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema"),
               "structural_tag": ("type", "structures", "triggers")}
    if kind not in allowed:
        raise APIError(400, f"'response_format.type' {_dumps(kind)} must be \"text\", \"json_object\", "
                       f"\"json_schema\" or \"structural_tag\"", param="response_format")
    if kind == "structural_tag" and "format" in rf and "structures" not in rf:
        raise APIError(400, "'response_format': the structural tag {\"type\": \"structural_tag\", \"format\": ...} "
                       "(xgrammar's) is not supported by flintc serve: give \"structures\" and \"triggers\" "
                       "(llguidance, vLLM's guidance backend)", param="response_format", code="unsupported_parameter")
    extra = [k for k in rf if k not in allowed[kind]]
    if extra:
        raise APIError(400, f"Unrecognized request argument supplied: response_format.{extra[0]}",
                       param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", True
    if kind == "structural_tag":
        return "structural_tag", _dumps(rf)
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise APIError(400, "'response_format.json_schema' must be an object {\"name\", \"schema\", "
                       "\"strict\", \"description\"} for type \"json_schema\"", param="response_format")
    extra = [k for k in js if k not in ("name", "schema", "strict", "description")]
    if extra:
        raise APIError(400, f"Unrecognized request argument supplied: response_format.json_schema.{extra[0]}",
                       param="response_format")
    if not isinstance(js.get("name"), str):
        raise APIError(400, "'response_format.json_schema.name' must be a string", param="response_format")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise APIError(400, "'response_format.json_schema.strict' must be true, false or null",
                       param="response_format")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise APIError(400, "'response_format.json_schema.schema' must be a JSON schema (an object)",
                       param="response_format")
    return "json", schema


def _dumps(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def check_guided_backend(req: BaseModel) -> None:
    """The request's ``guided_decoding_backend``: null, "auto", "guidance" or "llguidance"
    (llguidance runs every structured output, vLLM's "guidance" backend).

    Raises:
        APIError(400, param "guided_decoding_backend", code "unsupported_parameter"): another.
    """
    backend = getattr(req, "guided_decoding_backend", None)
    if backend not in GUIDED_BACKENDS:
        raise APIError(400, f"'guided_decoding_backend' = {_dumps(backend)} is not supported by flintc serve "
                       f"(structured outputs run on llguidance, vLLM's \"guidance\" backend): give null, "
                       f"\"auto\", \"guidance\" or \"llguidance\"", param="guided_decoding_backend",
                       code="unsupported_parameter")


def structured_outputs_spec(req: BaseModel):
    """The request's structured-outputs constraint (vLLM's): a
    `flintc.sampling.StructuredOutputsParams` from ``response_format``,
    ``structured_outputs`` or the ``guided_*`` fields, or None when none is set. The
    grammar is checked by llguidance (without the tokenizer; the server compiles it for
    the tokenizer next), which can take a while for a large schema: call it off the event
    loop.

    Raises:
        APIError(400): naming the field: more than one kind ("You can only use one kind of
            guided decoding", as vLLM), a guided_decoding_backend other than null, "auto",
            "guidance" or "llguidance", a bad response_format or structured_outputs
            object, or a schema / regex / grammar / structural tag llguidance refuses (its
            message; a structural tag's shape: `flintc.structured.parse_structural_tag`).
    """
    from flintc.errors import InputError
    from flintc.sampling import StructuredOutputsParams

    check_guided_backend(req)
    kinds: list[tuple[str, str, Any]] = []  # (request field, spec field, value)
    options: dict[str, Any] = {}
    option_fields: dict[str, str] = {}  # an option's spec field -> where the request gave it
    rf = _response_format_kind(getattr(req, "response_format", None))
    if rf is not None:
        kinds.append(("response_format", *rf))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise APIError(400, f"'structured_outputs' must be an object, got {_dumps(so)}",
                           param="structured_outputs")
        constraints = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
        fields = (*constraints, "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                  "disable_fallback")
        for key, value in so.items():
            if key not in fields:
                raise APIError(400, f"Unrecognized request argument supplied: structured_outputs.{key}",
                               param="structured_outputs")
            if value is None:
                continue
            if key in constraints:
                if key == "json_object" and value is False:
                    continue
                kinds.append(("structured_outputs", key, value))
            else:
                options[key] = value
                option_fields[key] = f"structured_outputs.{key}"
    for name, key in _GUIDED_FIELDS:
        value = getattr(req, name, None)
        if value is not None:
            kinds.append((name, key, value))
    pattern = getattr(req, "guided_whitespace_pattern", None)
    if pattern is not None:
        options["whitespace_pattern"] = pattern
        option_fields["whitespace_pattern"] = "guided_whitespace_pattern"
    if len(kinds) > 1:
        names = ", ".join(f"'{f}'" if f != "structured_outputs" else f"'structured_outputs.{k}'"
                          for f, k, _ in kinds)
        raise APIError(400, f"You can only use one kind of guided decoding, but {len(kinds)} are given: {names}",
                       param=kinds[1][0])
    if not kinds:
        if options or so is not None:
            where = "structured_outputs" if so is not None else "guided_whitespace_pattern"
            raise APIError(400, f"'{where}' needs a constraint: one of structured_outputs' json, regex, choice, "
                           f"grammar, json_object or structural_tag (or response_format, or a guided_* field)",
                           param=where)
        return None
    field, key, value = kinds[0]
    try:
        return StructuredOutputsParams(**{key: value}, **options)
    except InputError as exc:
        where = field if field != "structured_outputs" else f"structured_outputs.{key}"
        msg = str(exc)
        named = re.match(r"structured_outputs field '(\w+)': ", msg)
        if named and named.group(1) in option_fields:  # a bad option, not the constraint
            where = option_fields[named.group(1)]
        if named and named.group(1) in (key, *option_fields):
            msg = msg[named.end():]
        raise APIError(400, f"'{where}': {msg}", param=where.split(".")[0]) from None


def unsupported(req: BaseModel) -> None:
    """Raise a 400 APIError for the first OpenAI field set to a value Flint does not
    support (functions, audio, non-text modalities, best_of > 1, suffix), or vLLM field
    away from its no-op value (use_beam_search, logits_processors, ...), or an empty
    ``cache_salt`` (as vLLM). ``response_format`` and the structured outputs fields are
    :func:`structured_outputs_spec`'s; ``priority`` is checked against the server's
    scheduling policy by :mod:`flintc.serve.app` (vLLM's "Got priority ... but Priority
    scheduling is not enabled."); chat's ``echo`` and ``include_reasoning`` are honoured
    there."""
    checks = [
        ("functions", lambda v: v is not None),
        ("function_call", lambda v: v is not None),
        ("audio", lambda v: v is not None),
        ("modalities", lambda v: v not in (None, ["text"])),
        ("prediction", lambda v: v is not None),
        ("web_search_options", lambda v: v is not None),
        ("best_of", lambda v: v not in (None, 1)),
        ("suffix", lambda v: v is not None),
        # vLLM's
        ("use_beam_search", lambda v: v),
        ("prompt_embeds", lambda v: v is not None),
        ("chat_template", lambda v: v is not None),
        *((name, lambda v: bool(v)) for name in _VLLM_NULL_OR_EMPTY),
    ]
    if getattr(req, "cache_salt", None) == "":  # vLLM's check, message and all
        raise APIError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    for name, bad in checks:
        if name in type(req).model_fields and bad(getattr(req, name)):
            raise APIError(400, f"'{name}' = {getattr(req, name)!r} is not supported by flintc serve",
                           param=name, code="unsupported_parameter")
