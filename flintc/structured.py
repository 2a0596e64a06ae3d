"""Structured outputs (constrained decoding) on llguidance, vLLM's "guidance" backend.

A request's `flintc.sampling.StructuredOutputsParams` (vLLM's
`StructuredOutputsParams`: a JSON schema, any JSON object, a regex, a choice of
strings, a Lark grammar, or a structural tag: free text with triggered JSON
structures, `parse_structural_tag`) becomes an llguidance grammar (`grammar_text`, the
serialization vLLM's `backend_guidance.serialize_guidance_grammar` makes), compiled
against the model's tokenizer into an `llguidance.LLMatcher` once per request
(`compiled_matcher`, a small cache keyed by the tokenizer and the spec: the n choices
of a request, and later requests of the same spec, share it). Each sequence holds a
`GrammarMatcher`: a copy of that matcher (`LLMatcher.deep_copy`), which at every
sampling step gives the tokens the grammar allows next (`GrammarMatcher.allowed`: every
other logit becomes -inf in `flintc.sampling.adjust_logits`, on every sampling path),
and consumes each token the sequence generates (`GrammarMatcher.advance`). A batch with
two or more constrained rows has its masks made together (`allowed_batch`: into one host
buffer, on a CUDA device by one llguidance call on its own threads without the GIL, then
one copy to the device).

End of the output: the grammar's own end-of-text is replaced by the sequence's stop
tokens (end-of-text included): they are allowed exactly when the grammar accepts what
is there (`LLMatcher.is_accepting`), and one drawn there ends the grammar. When
nothing more can follow (`LLMatcher.is_stopped`: "yes" of the choice ["yes", "no"], a
JSON object's closing brace) the matcher is `finished` and the callers end the sequence
at once with finish reason "stop" (no stop token is drawn; the output ends with the
grammar's last token). A sequence cut by max_tokens first ends with "length", its text
not conforming, as in vLLM.

The LLTokenizer (`ll_tokenizer`) is made from the `tokenizers.Tokenizer` that
`flintc.checkpoint.tokenizer.FlintTokenizer` wraps (its JSON, `Tokenizer.to_str()`, as
`llguidance.hf.from_tokenizer` passes it; no `transformers`), once per tokenizer object:
it walks the vocabulary (~1 s for 150k tokens).
"""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from flintc.errors import FlintcError, InputError


class StructuredOutputError(FlintcError, RuntimeError):
    """A sequence's grammar matcher failed on a generated token: the mask allows only
    tokens the grammar takes, so the request's other masks (allowed_token_ids, bad_words,
    min_tokens) left none of them, or the grammar outgrew one of llguidance's limits as it
    ran (a regex ``a{1000000}``, a schema of thousands of properties). The callers fail
    that sequence (the server answers the request's 400), not the others; a FlintcError,
    so `flintc run` prints it as one line and exits 2."""


def one_line(message: str) -> str:
    """llguidance's message (lines with a source excerpt and a caret under the place) on
    one line: each line stripped, the caret lines left out, joined by spaces."""
    lines = [ln.strip() for ln in str(message).splitlines()]
    return " ".join(ln for ln in lines if ln and set(ln) != {"^"})


def _llg():
    import llguidance

    return llguidance


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


class _TokenTable:
    """A FlintTokenizer as llguidance's `TokenizerWrapper` takes it (llguidance/_tokenizer.py):
    every id's bytes (`FlintTokenizer.token_bytes`, the ByteLevel decoder's), its special
    ids, end-of-text, and its encoder (called with text only)."""

    def __init__(self, tokenizer):
        n = max(tokenizer.vocab_size, max(tokenizer.all_special_ids, default=-1) + 1)
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        self.special_token_ids = sorted(tokenizer.all_special_ids)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = None
        self._encode = tokenizer.encode

    def __call__(self, text):
        if not isinstance(text, str):  # TokenizerWrapper probes with b"test"; refused, it passes text
            raise TypeError("text only")
        return self._encode(text)


def ll_tokenizer(tokenizer):
    """The `llguidance.LLTokenizer` of `tokenizer` (a FlintTokenizer, or a
    `tokenizers.Tokenizer`), made once per tokenizer object and kept while it lives.
    Its end-of-text token is the FlintTokenizer's eos_token_id (a bare Tokenizer: none).

    A FlintTokenizer goes to llguidance as its token table (`_TokenTable`), a bare
    Tokenizer as its tokenizer.json: llguidance's reading of the JSON grows with the
    square of the added tokens (FLINT_SPEC's 151,552-token vocabulary, ~149,500 of them
    reserved special tokens in the project's tokenizer: 216 s on 2 cores, where the table
    takes under 1 s); both give the same tokens, special ids and masks
    (tests/test_structured_batch.py).

    Raises:
        TypeError: another kind of tokenizer.
    """
    with _TOKENIZERS_LOCK:
        try:
            got = _TOKENIZERS.get(tokenizer)
        except TypeError:  # not weakly referenceable
            got = None
        if got is not None:
            return got
    inner = getattr(tokenizer, "_tok", tokenizer)
    if not hasattr(inner, "to_str"):
        raise TypeError(f"structured outputs need a FlintTokenizer or a tokenizers.Tokenizer, got "
                        f"{type(tokenizer).__name__}")
    llg = _llg()
    if hasattr(tokenizer, "token_bytes") and hasattr(tokenizer, "all_special_ids"):
        lt = llg.LLTokenizer(llg.TokenizerWrapper(_TokenTable(tokenizer)), eos_token=tokenizer.eos_token_id)
    else:
        lt = llg.LLTokenizer(inner.to_str(), eos_token=getattr(tokenizer, "eos_token_id", None))
    with _TOKENIZERS_LOCK:
        try:
            _TOKENIZERS[tokenizer] = lt
        except TypeError:
            pass
    return lt


def _no_additional_properties(schema):
    """vLLM's `process_for_additional_properties`: every object schema (type "object" or
    with "properties") that does not say otherwise gets additionalProperties false."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def _tag_error(msg: str) -> NoReturn:
    """Raise the InputError naming the structural_tag field."""
    raise InputError(f"structured_outputs field 'structural_tag': {msg}")


_TAG_KEYS = ("type", "structures", "triggers")
_STRUCTURE_KEYS = ("begin", "schema", "end")


def parse_structural_tag(value) -> "tuple[list[str], list[tuple[str, str, dict | bool, str]]]":
    """A structural tag, vLLM's format (its `StructuralTagResponseFormat`, which vLLM's
    chat and completions turn into ``structured_outputs.structural_tag``, the JSON text
    of the object; vLLM's guidance backend, `serialize_guidance_grammar`, reads it)::

        {"type": "structural_tag",          # optional here
         "structures": [{"begin": "<function=f>", "schema": {...}, "end": "</function>"}, ...],
         "triggers": ["<function="]}

    as (triggers, [(trigger, begin, schema, end), ...]): each structure's trigger is the
    first of the triggers its begin starts with (vLLM's choice). The output it stands for
    is free text in which, wherever a trigger appears, the text goes on as the begin of
    one of its structures, a JSON value the structure's schema accepts (llguidance's JSON
    schema subset), and the structure's end; then free text again
    (`llguidance.StructTag`: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md#tool-calling).

    value: the JSON text, or the object itself.

    Raises:
        InputError: "structured_outputs field 'structural_tag': ..." for text that is not
            JSON, not an object, another "type", xgrammar's newer ``{"type":
            "structural_tag", "format": ...}`` (vLLM's guidance backend reads only the
            structures and triggers: neither does flintc), a key of neither shape, no
            structures (vLLM's "No structural tags found"), triggers not a list of
            non-empty strings, a structure without a string begin / end or a schema (an
            object, or true), or a begin that starts with none of the triggers (vLLM's
            "Trigger {begin} not found in triggers {triggers}"), naming the structure
            ("structures[1].begin"). The schemas themselves are llguidance's to check
            (`check_spec`).
    """
    import json

    tag = value
    if isinstance(value, str):
        try:
            tag = json.loads(value)
        except ValueError as exc:
            _tag_error(f"not valid JSON: {exc}")
        except RecursionError:
            _tag_error("too deeply nested")
    if not isinstance(tag, dict):
        _tag_error(f"expected an object {{\"type\": \"structural_tag\", \"structures\": [...], \"triggers\": "
                   f"[...]}}, got {type(tag).__name__}")
    if tag.get("type", "structural_tag") != "structural_tag":
        _tag_error(f"'type' must be \"structural_tag\", got {json.dumps(tag['type'])[:80]}")
    if "format" in tag and "structures" not in tag:
        _tag_error("the form {\"type\": \"structural_tag\", \"format\": ...} (xgrammar's structural tag) is not "
                   "supported (llguidance, vLLM's guidance backend, takes \"structures\" and \"triggers\")")
    extra = [k for k in tag if k not in _TAG_KEYS]
    if extra:
        _tag_error(f"unknown key {extra[0]!r} (a structural tag has {', '.join(_TAG_KEYS)})")
    for key in ("structures", "triggers"):
        if key not in tag:
            _tag_error(f"missing {key!r}: a structural tag needs \"structures\" [{{\"begin\", \"schema\", "
                       f"\"end\"}}, ...] and \"triggers\" [str, ...]")
        if not isinstance(tag[key], list):
            _tag_error(f"'{key}' must be a list, got {type(tag[key]).__name__}")
    triggers = tag["triggers"]
    for i, t in enumerate(triggers):
        if not isinstance(t, str) or not t:
            _tag_error(f"triggers[{i}] must be a non-empty string, got {json.dumps(t)[:80]}")
    if not tag["structures"]:
        _tag_error("no structures (vLLM: \"No structural tags found in the grammar spec.\")")
    out = []
    for i, st in enumerate(tag["structures"]):
        where = f"structures[{i}]"
        if not isinstance(st, dict):
            _tag_error(f"{where} must be an object {{\"begin\", \"schema\", \"end\"}}, got {type(st).__name__}")
        extra = [k for k in st if k not in _STRUCTURE_KEYS]
        if extra:
            _tag_error(f"{where}: unknown key {extra[0]!r} (a structure has begin, schema, end)")
        for key in ("begin", "end"):
            if not isinstance(st.get(key), str):
                _tag_error(f"{where}.{key} must be a string, got "
                           f"{'nothing' if key not in st else json.dumps(st[key])[:80]}")
        schema = st.get("schema")
        if schema is False:
            _tag_error(f"{where}.schema: the schema false accepts no value")
        if not isinstance(schema, (dict, bool)):
            _tag_error(f"{where}.schema must be a JSON schema (an object), got "
                       f"{'nothing' if schema is None else json.dumps(schema)[:80]}")
        begin = st["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            _tag_error(f"{where}.begin {json.dumps(begin)} starts with none of the triggers {json.dumps(triggers)} "
                       f"(vLLM: \"Trigger {begin} not found in triggers {triggers}\")")
        out.append((trigger, begin, schema, st["end"]))
    return triggers, out


def structural_tag_json(value) -> str:
    """`StructuredOutputsParams.structural_tag` as it is kept: the JSON text given, or
    the object's (``json.dumps``, key order kept), once `parse_structural_tag` takes it.

    Raises:
        InputError: naming the field: neither a string nor an object, and
            `parse_structural_tag`'s.
    """
    import json

    if not isinstance(value, (str, dict)):
        _tag_error(f"expected the structural tag's JSON text (a string) or object, got {type(value).__name__}")
    parse_structural_tag(value)
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        _tag_error(f"not JSON data: {exc}")
    except RecursionError:
        _tag_error("too deeply nested")


def _json_options(spec) -> dict:
    """llguidance's JSON options of a spec (vLLM's): flexible whitespace unless
    disable_any_whitespace, the whitespace's regex when whitespace_pattern is given."""
    options = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    return options


def _tag_schema(schema, spec) -> dict:
    """A structural tag structure's schema as llguidance's ``%json`` takes it: true as {}
    (any value), vLLM's disable_additional_properties applied, and the spec's JSON
    options (`_json_options`) as its "x-guidance" defaults (the schema's own
    "x-guidance" keys win, as `grammar_from_json_schema`'s defaults do)."""
    schema = {} if schema is True else dict(schema)
    if spec.disable_additional_properties:
        schema = _no_additional_properties(schema)
    own = schema.get("x-guidance")
    schema["x-guidance"] = {**_json_options(spec), **(own if isinstance(own, dict) else {})}
    return schema


def _structural_tag_grammar(spec) -> str:
    """The llguidance grammar (Lark) of a structural_tag spec: one `llguidance.StructTag`
    per structure (its trigger, begin, schema (`_tag_schema`) and end), joined by
    `StructTag.to_grammar` with its defaults (free text, the regex ``(.|\n)*``, around
    the structures; a trigger written ``<...>`` is a special token), as vLLM's guidance
    backend does; vLLM passes each schema as the grammar `grammar_from_json_schema`
    serialized, which StructTag reads as a JSON schema of unknown keys (any JSON value),
    so the schema went unchecked there: here it holds."""
    llg = _llg()
    _, structures = parse_structural_tag(spec.structural_tag)
    try:
        tags = [llg.StructTag(trigger=t, begin=b, grammar=_tag_schema(s, spec), end=e) for t, b, s, e in structures]
        return llg.StructTag.to_grammar(tags)
    except (AssertionError, ValueError) as exc:  # StructTag's own checks (parse_structural_tag's first)
        _tag_error(one_line(exc))


def grammar_text(spec) -> str:
    """The llguidance grammar (its JSON serialization) of a StructuredOutputsParams, as
    vLLM's guidance backend makes it: JSON schemas (and json_object, the schema
    {"type": "object"}) with flexible whitespace unless disable_any_whitespace
    (whitespace_pattern, when given, is the whitespace's regex); regex, choice (each
    string a literal alternative) and grammar (Lark, or GBNF, which llguidance converts)
    through `llguidance.grammar_from`; structural_tag through `llguidance.StructTag`
    (`_structural_tag_grammar`), its schemas with the JSON options. It does not check the
    grammar.

    Raises:
        InputError: naming the field, for what llguidance refuses to serialize (a JSON
            text that is not an object, a GBNF grammar it cannot convert).
    """
    import json

    llg = _llg()
    kind = spec.kind
    if kind == "structural_tag":
        return _structural_tag_grammar(spec)
    try:
        if kind in ("json", "json_object"):
            schema = json.loads(spec.json) if kind == "json" else {"type": "object"}
            if schema is True:  # JSON Schema's boolean schemas: true accepts any value
                schema = {}
            elif schema is False:  # (llguidance refused both: "Expecting object schema to apply options")
                raise InputError("structured_outputs field 'json': the schema false accepts no value")
            if spec.disable_additional_properties:
                schema = _no_additional_properties(schema)
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_json_options(spec))
        if kind == "choice":
            return llg.grammar_from("choice", json.dumps(list(spec.choice)))
        return llg.grammar_from(kind, getattr(spec, kind))  # regex, grammar
    except ValueError as exc:
        raise InputError(f"structured_outputs field '{kind}': {one_line(exc)}") from None
    except RecursionError:  # (json.dumps of a schema nested thousands deep)
        raise InputError(f"structured_outputs field '{kind}': the schema is too deeply nested") from None


_CHECKED: "collections.OrderedDict" = collections.OrderedDict()
_COMPILED: "collections.OrderedDict" = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()
CACHE_SIZE = 64  # specs kept checked, and matchers kept compiled (all tokenizers together)


def _cached(cache, key, make):
    with _CACHE_LOCK:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    value = make()
    with _CACHE_LOCK:
        cache[key] = value
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)
    return value


def _check_tag_schemas(spec) -> str:
    """The first of a structural_tag spec's schemas that llguidance refuses, as
    "structured_outputs field 'structural_tag': structures[i].schema: <its message>";
    "" when it takes them all."""
    import json

    llg = _llg()
    for i, (_, _, schema, _) in enumerate(parse_structural_tag(spec.structural_tag)[1]):
        try:
            err = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(
                json.dumps(_tag_schema(schema, spec))))
        except ValueError as exc:
            err = str(exc)
        except RecursionError:
            err = "the schema is too deeply nested"
        if err:
            return f"structured_outputs field 'structural_tag': structures[{i}].schema: {one_line(err)}"
    return ""


def check_spec(spec) -> None:
    """Check that llguidance takes the spec's grammar (schema, regex, Lark grammar, a
    structural tag's schemas one by one, then its whole grammar), without a tokenizer;
    the result is cached per spec.

    Raises:
        InputError: "structured_outputs field '<kind>': <llguidance's message>" (on one
            line: `one_line`); a structural tag's schema names its structure
            ("structures[1].schema: ...").
    """
    def check() -> str:
        try:
            g = grammar_text(spec)
            if spec.kind == "structural_tag":
                err = _check_tag_schemas(spec)
                if err:
                    return err
        except InputError as exc:
            return str(exc)
        err = _llg().LLMatcher.validate_grammar(g)
        return f"structured_outputs field '{spec.kind}': {one_line(err)}" if err else ""

    msg = _cached(_CHECKED, spec, check)
    if msg:
        raise InputError(msg)


def compiled_matcher(spec, tokenizer):
    """An `llguidance.LLMatcher` of the spec's grammar for `tokenizer`, at the start;
    compiled once and cached (per LLTokenizer and spec): copy it (`deep_copy`), never
    feed it tokens.

    Raises:
        InputError: the grammar fails to compile (naming the field, llguidance's message:
            for a structural tag, a trigger written ``<...>`` that is no special token of
            the tokenizer), or a structural tag whose begin (past its trigger) or end
            holds a special token's text (`_special_text_in_tags`).
    """
    lt = ll_tokenizer(tokenizer)

    def make():
        if spec.kind == "structural_tag":
            _special_text_in_tags(spec, tokenizer)
        m = _llg().LLMatcher(lt, grammar_text(spec), log_level=0)
        if m.is_error():
            err = one_line(m.get_error())
            if spec.kind == "structural_tag" and "unknown special token" in err:
                # without the grammar's excerpt and the list of special tokens (~150k in Flint's vocabulary)
                err = one_line(m.get_error().strip().splitlines()[0]).split("; following special tokens")[0]
                err += (" (llguidance's StructTag reads a trigger written <...> as a special token of the "
                        "tokenizer, as vLLM's guidance backend does; to match text, leave out the closing "
                        "'>', e.g. \"<function=\")")
            raise InputError(f"structured_outputs field '{spec.kind}': {err}")
        return m

    return _cached(_COMPILED, (lt, spec), make)  # (the key keeps lt alive: its id is not reused)


_SPECIAL_TEXTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _special_texts(tokenizer) -> dict:
    """{text: id} of the tokenizer's special tokens (its LLTokenizer's), made once per
    tokenizer object."""
    with _TOKENIZERS_LOCK:
        try:
            got = _SPECIAL_TEXTS.get(tokenizer)
        except TypeError:
            got = None
    if got is not None:
        return got
    lt = ll_tokenizer(tokenizer)
    got = {}
    for i in range(int(lt.vocab_size)):
        if lt.is_special_token(i):
            got.setdefault(lt.decode_str([i]), i)
    with _TOKENIZERS_LOCK:
        try:
            _SPECIAL_TEXTS[tokenizer] = got
        except TypeError:
            pass
    return got


def _special_text_in_tags(spec, tokenizer) -> None:
    """Refuse a structural tag whose structure spells out a special token's text as text:
    its begin past the trigger, its end, or a trigger llguidance matches as text (not
    written ``<...>``): llguidance offers that text only as the special token, then
    refuses it (`GrammarMatcher.advance`'s error, as the sequence runs); e.g. the end
    "</tool_call>" of a tokenizer whose </tool_call> is special.

    Also refused: a trigger that is the end-of-text token (written ``<|endoftext|>``):
    drawing it ends the output, so no structure could follow it.

    Raises:
        InputError: "structured_outputs field 'structural_tag': structures[i].end holds
            the special token '</tool_call>' (id 507) ...", or "... triggers[i] ... is the
            end-of-text token ...".
    """
    specials = _special_texts(tokenizer)
    if not specials:
        return
    eos = getattr(tokenizer, "eos_token_id", None)
    for i, trigger in enumerate(parse_structural_tag(spec.structural_tag)[0]):
        if eos is not None and specials.get(trigger) == eos:
            raise InputError(f"structured_outputs field 'structural_tag': triggers[{i}] {trigger!r} is the "
                             f"end-of-text token (id {eos}), which ends the output: no structure can follow it")
    longest = max(len(t) for t in specials)
    for i, (trigger, begin, _, end) in enumerate(parse_structural_tag(spec.structural_tag)[1]):
        as_special = trigger.startswith("<") and trigger.endswith(">")
        for part, text in (("begin", begin if not as_special else begin[len(trigger):]), ("end", end)):
            for a in range(len(text)):
                for b in range(a + 1, min(len(text), a + longest) + 1):
                    if text[a:b] in specials:
                        raise InputError(
                            f"structured_outputs field 'structural_tag': structures[{i}].{part} {text!r} holds the "
                            f"special token {text[a:b]!r} (id {specials[text[a:b]]}) as text, which llguidance "
                            f"offers only as that token and then refuses: a special token cannot be matched as "
                            f"text (only a trigger written <...>, the whole trigger, is read as a special token)")


_SHIFTS: dict = {}


def _bits(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [..., vocab] from int32 bitmask words [..., W] (bit j of word i: token 32 i + j;
    tokens past 32 W: False), on the words' device."""
    dev = words.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    bits = ((words[..., None] >> shifts) & 1).reshape(*words.shape[:-1], -1).bool()
    if bits.shape[-1] >= vocab:
        return bits[..., :vocab]
    return torch.cat([bits, bits.new_zeros(*bits.shape[:-1], vocab - bits.shape[-1])], dim=-1)


def _to_device_bits(words: np.ndarray, vocab: int, device) -> torch.Tensor:
    """`_bits` of host int32 words [..., W] on `device`: one small asynchronous copy (from
    pinned memory on CUDA), expanded there."""
    host = torch.from_numpy(words)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return _bits(host.to(device, non_blocking=True), vocab)


_EXECUTOR = None


def _executor():
    """The process's `llguidance.LLExecutor` (made on first use: its thread pool, 80% of
    the CPUs up to 32, llguidance's default), which fills several matchers' masks at once."""
    global _EXECUTOR
    with _CACHE_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _llg().LLExecutor()
        return _EXECUTOR


@dataclass(frozen=True)
class ReasoningGate:
    """Where a thinking model's reply leaves its thinking block, for a `GrammarMatcher`
    that constrains only what follows it (vLLM enables a request's grammar once its
    reasoning parser finds the reasoning's end).

    state: the reply's start (`flintc.serve.reasoning.initial_state_for_prompt`):
        "content" (the prompt closed the block: thinking disabled), "reasoning" (the
        prompt opened it: the grammar holds after the generated `end_id`), or "start"
        (the model decides: its first token may be `start_id`, which opens the block, or
        a token the grammar allows, after which the grammar holds).
    start_id, end_id: the token ids of "<think>" and "</think>".

    Raises:
        ValueError: another state.
    """

    state: str
    start_id: int
    end_id: int

    def __post_init__(self):
        if self.state not in ("start", "reasoning", "content"):
            raise ValueError(f"ReasoningGate.state must be start, reasoning or content, got {self.state!r}")


class GrammarMatcher:
    """One sequence's grammar state: the tokens allowed next, and the tokens generated.

    Args:
        spec: a `flintc.sampling.StructuredOutputsParams`.
        tokenizer: the model's tokenizer (a FlintTokenizer), whose ids the model samples.
        stop_token_ids: the sequence's stop tokens (end-of-text included): allowed, and
            ending the grammar, where it accepts; elsewhere only one that is text the
            grammar allows there (it ends the sequence, as in vLLM).
        reasoning: None (the grammar holds from the first generated token), or a
            `ReasoningGate`: a chat reply of a thinking model (`flintc serve
            --reasoning-parser`) is constrained after its thinking block only, as vLLM
            enables the grammar once its reasoning parser sees the reasoning end.

    Raises:
        InputError: the grammar fails to compile for this tokenizer.
    """

    def __init__(self, spec, tokenizer, stop_token_ids=(), reasoning: "ReasoningGate | None" = None):
        self.spec = spec
        self.gate = reasoning
        # "content": the grammar holds; "reasoning": inside the thinking block, nothing is
        # masked or fed; "start": the reply may open the block (its first token)
        self.phase = "content" if reasoning is None else reasoning.state
        self._m = compiled_matcher(spec, tokenizer).deep_copy()
        lt = ll_tokenizer(tokenizer)
        self._ll_vocab = int(lt.vocab_size)
        self._ll_eos = [t for t in lt.eos_tokens if 0 <= t < self._ll_vocab]
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids})
        self.consumed = 0  # tokens of the sequence's output fed to the matcher
        self.ended = False  # a stop token was drawn where the grammar accepts
        # the last `allowed` mask and the `consumed` count it was made at (the logprobs of
        # the token drawn from it are taken over it: `masked_for_logprobs`)
        self._mask = None
        self._mask_at = -1
        self._lt = lt
        # llguidance's own mask held only the end-of-text token where the grammar does not
        # accept: the grammar spells out its text ('<|endoftext|>'), which llguidance can only
        # offer as that token (and then refuses); `allowed_words` leaves nothing to draw there
        self._eos_as_text = False

    @property
    def finished(self) -> bool:
        """Nothing more can be generated: the grammar is complete (llguidance's
        is_stopped), or a stop token ended it."""
        return self.phase == "content" and (self.ended or self._m.is_stopped())

    def is_accepting(self) -> bool:
        return self.phase != "reasoning" and (self.ended or self._m.is_accepting())

    def advance(self, output_ids: list[int]) -> None:
        """Feed the matcher the tokens of `output_ids` (the sequence's generated ids, of
        which the first `consumed` were fed) it has not seen. A stop token drawn where the
        grammar accepts ends it (`finished`); tokens after that are not fed.

        Raises:
            StructuredOutputError: the matcher refuses a token (llguidance's message).
        """
        stops = self.stop_token_ids
        while self.consumed < len(output_ids):
            tok = int(output_ids[self.consumed])
            self.consumed += 1
            if self.phase == "start":  # the reply's first token: the thinking block, or content
                self.phase = "reasoning" if tok == self.gate.start_id else "content"
                if self.phase == "reasoning":
                    continue
            if self.phase == "reasoning":  # unconstrained until the block's end
                if tok == self.gate.end_id:
                    self.phase = "content"
                continue
            if self.ended:
                continue
            if tok in stops and self._m.is_accepting():
                self.ended = True
                continue
            if not self._m.consume_token(tok):
                err = self._m.get_error().strip().splitlines()
                # the mask never allows a token the grammar refuses: either the request's
                # other masks left none of the grammar's tokens (the sampler drew among -inf,
                # or from a NaN row), or llguidance hit one of its limits while consuming (its
                # message says which)
                hint = (" (no token the grammar allows next was left to draw: allowed_token_ids, bad_words, "
                        "min_tokens or the stop tokens excluded them all, or the logits were NaN)"
                        if err and "doesn't satisfy the grammar" in err[0] else "")
                special = self._special_as_text(tok)
                if special is not None and special[0] in self._ll_eos:
                    hint = (f" (the grammar needs the end-of-text token {special[1]!r} (id {special[0]}) in the "
                            f"output: it ends the output and cannot be part of it; leave it out of the grammar)")
                elif special is not None:
                    hint = (f" (the grammar spells out the text of the special token {special[1]!r}, id "
                            f"{special[0]}, which llguidance offers only as that token and then refuses: a "
                            f"special token cannot be matched as text; in a Lark grammar write the token "
                            f"itself, <[{special[0]}]>)")
                raise StructuredOutputError(f"structured outputs: the grammar refused generated token {tok}"
                                            f"{': ' + err[0] if err else ''}{hint}")

    def _special_as_text(self, tok: int) -> "tuple[int, str] | None":
        """(id, text) of the special token the grammar wanted as text when `tok` (just
        refused) was drawn: the end-of-text token when llguidance's mask held only it
        (`_eos_as_text`), or `tok` itself when it is special and the grammar's own mask of
        that step allowed it; None otherwise."""
        if self._eos_as_text and self._ll_eos:
            special = self._ll_eos[0]
        elif (0 <= tok < self._ll_vocab and self._lt.is_special_token(tok) and self._mask is not None
              and self._mask_at == self.consumed - 1 and tok < self._mask.shape[0] and bool(self._mask[tok])):
            special = tok
        else:
            return None
        return special, self._lt.decode_str([special])

    def allowed_words(self) -> np.ndarray:
        """int32 [ceil(max(V_tok, stop ids + 1) / 32)]: the bitmask of the tokens allowed next
        (bit j of word i: token 32 i + j), llguidance's, with its end-of-text replaced by the
        sequence's stop tokens, set when the grammar accepts (nothing when it is finished:
        callers end the sequence there). At the start of a reply that may open a thinking
        block (`ReasoningGate` "start"), the block's start token too. `allowed_words_batch`
        makes the same words for several matchers at once."""
        words = np.frombuffer(self._m.compute_bitmask(), dtype=np.int32).copy()
        need = self._words_needed()
        if need > len(words):
            words = np.concatenate([words, np.zeros(need - len(words), dtype=np.int32)])
        self._finish_words(words)
        return words

    def _words_needed(self) -> int:
        """The number of bitmask words `_finish_words` writes into: past the top stop id,
        and the thinking block's start id while it may come next."""
        top = max(self.stop_token_ids, default=-1)
        if self.phase == "start":
            top = max(top, self.gate.start_id)
        return top // 32 + 1

    def _finish_words(self, words: np.ndarray) -> None:
        """llguidance's mask `words` (int32, at least `_words_needed` long, the words past
        llguidance's zero) made this sequence's, in place: its end-of-text bits cleared
        (noting `_eos_as_text`), the stop tokens set when the grammar accepts and otherwise
        left as llguidance has them (one that is text the grammar allows there may be drawn,
        as in vLLM), and the thinking block's start token set under `ReasoningGate` "start"."""
        u = words.view(np.uint32)
        eos_only = bool(self._ll_eos) and not self._m.is_accepting()
        for t in self._ll_eos:
            eos_only = eos_only and bool(u[t >> 5] >> np.uint32(t & 31) & np.uint32(1))
            u[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        self._eos_as_text = eos_only and not words.any()
        if self.is_accepting():
            for t in self.stop_token_ids:
                u[t >> 5] |= np.uint32(1 << (t & 31))
        # elsewhere a stop token keeps llguidance's bit (its end-of-text ones were cleared):
        # one of stop_token_ids that is ordinary text the grammar allows there may be drawn,
        # and ends the sequence (finish "stop", stop_reason its id), as in vLLM, whose
        # grammar bitmask does not single out stop_token_ids; clearing it left no token to
        # draw where the grammar forces that text (a structural tag's begin "@add(" with
        # stop_token_ids ["("'s id])
        if self.phase == "start":
            t = self.gate.start_id
            u[t >> 5] |= np.uint32(1 << (t & 31))

    def allowed(self, vocab: int, device) -> torch.Tensor | None:
        """bool [vocab] on `device`: the tokens the grammar allows next (`allowed_words`);
        ids past the tokenizer's vocabulary are never allowed. One small asynchronous copy
        (from pinned memory on CUDA) of the int32 words, expanded on the device. None inside
        a thinking block (`ReasoningGate`): every token may come next."""
        if self.phase == "reasoning":
            self._mask, self._mask_at = None, self.consumed
            return None
        mask = _to_device_bits(self.allowed_words(), vocab, device)
        self._mask, self._mask_at = mask, self.consumed
        return mask

    def masked_for_logprobs(self, row: torch.Tensor, drawn_at: int) -> torch.Tensor:
        """`row` (the logits [V] a token was drawn from, at output position `drawn_at`:
        the number of tokens generated before it) with -inf where the grammar's mask of
        that step left none, as vLLM computes a constrained request's logprobs (its
        grammar bitmask is applied to the logits before its sampler, so even its raw
        logprobs are over the allowed tokens). `row` as it is when no mask of that step
        is held (the sequence's first token on a path that never masked)."""
        if self._mask is None or self._mask_at != drawn_at or self._mask.shape[0] != row.shape[-1]:
            return row
        return row.masked_fill(~self._mask, float("-inf"))


def allowed_words_batch(grammars: "list[GrammarMatcher]", parallel: bool = False) -> np.ndarray:
    """int32 [n, W]: row i is ``grammars[i].allowed_words()`` (the same words, and the same
    matcher state it leaves: `_eos_as_text`), zero-padded to the widest row's W, all in one
    host buffer. `parallel`: llguidance fills the n masks in one call,
    `llguidance.numpy.fill_next_token_bitmask_par` on the process's `LLExecutor` threads,
    without the GIL (vLLM's guidance backend fills its rows one by one, on a thread pool
    for big batches); else (the default: faster on the CPU and on an H100 machine,
    `allowed_batch`) one `llguidance.numpy.fill_next_token_bitmask` per row, in this
    thread. One matcher takes `allowed_words` itself. The stop-token, end-of-text and
    thinking-block edits (`GrammarMatcher._finish_words`) are then made row by row on the
    host (a few bit operations each).

    Raises:
        ValueError: llguidance's, for a mask buffer it refuses (a matcher of a tokenizer
            whose mask is not ceil(vocab_size / 32) words: not expected).
    """
    n = len(grammars)
    if n == 1:
        w = grammars[0].allowed_words()
        return w[None, :]
    llg_words = [(g._ll_vocab + 31) // 32 for g in grammars]  # llguidance's mask, per tokenizer
    width = max([0] + llg_words + [g._words_needed() for g in grammars])
    out = np.zeros((n, width), dtype=np.int32)
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(llg_words):
        groups.setdefault(w, []).append(i)
    from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

    for w, rows in groups.items():
        # straight into the result when its rows are llguidance's width (rows: 0..n-1)
        target = out if w == width and len(groups) == 1 else np.zeros((len(rows), w), dtype=np.int32)
        pairs = [(grammars[i]._m, k) for k, i in enumerate(rows)]
        if parallel:
            fill_next_token_bitmask_par(_executor(), pairs, target)
        else:
            for m, k in pairs:
                fill_next_token_bitmask(m, target, k)
        if target is not out:
            out[rows, :w] = target
    for i, g in enumerate(grammars):
        g._finish_words(out[i])
    return out


def allowed_batch(grammars: "list[GrammarMatcher | None]", vocab: int, device,
                  parallel: bool | None = None) -> torch.Tensor | None:
    """bool [B, vocab] on `device`: row b the tokens ``grammars[b]`` allows next (as its
    `GrammarMatcher.allowed`, which it records for `masked_for_logprobs`), every token for
    a row without a grammar (None) or inside a thinking block; None when no row is
    masked. The constrained rows' words come from `allowed_words_batch`, all rows' in one
    host buffer: one small asynchronous copy (from pinned memory on CUDA) and one
    expansion on the device.

    parallel: fill the masks on llguidance's threads (`allowed_words_batch`); None (the
    default): in this thread, one row after another, on every device. llguidance's
    threads were slower on both: with the model on the CPU, torch's intra-op threads spin
    after each op and starve them (on 2 busy cores, 8 rows of the tiny checkpoint's masks
    took 0.3-2 ms in parallel against 0.08-0.16 ms in one thread); on an H100 machine (16
    cores, the full NVFP4 model, a JSON schema at 151,552 ids) 8 rows took 1.65 ms in one
    parallel call against 0.26 ms row by row (`scripts/gpu_serve_features.py`, session
    45, docs/gpu-runs.md).
    """
    if parallel is None:
        parallel = False
    rows = []
    for b, g in enumerate(grammars):
        if g is None:
            continue
        if g.phase == "reasoning":
            g._mask, g._mask_at = None, g.consumed
        else:
            rows.append(b)
    if not rows:
        return None
    words = allowed_words_batch([grammars[b] for b in rows], parallel=parallel)
    buf = np.full((len(grammars), max(words.shape[1], (vocab + 31) // 32)), -1, dtype=np.int32)
    buf[rows] = 0
    buf[rows, :words.shape[1]] = words
    masks = _to_device_bits(buf, vocab, device)
    for b in rows:
        g = grammars[b]
        g._mask, g._mask_at = masks[b], g.consumed
    return masks
