"""Token sampling (FLINT_SPEC section 6): temperature, then top-k, then top-p on the
renormalised distribution; temperature 0 is greedy. Runs on the logits' device.

Defaults are Flint's: temperature 1.0, top-p 0.95, top-k 20. Each request may carry
a seed; a seeded request draws from its own `torch.Generator`, so its draws do
not depend on what else is in the batch (its logits may, in the last bits: the
model's kernels reduce in an order that follows the batch size).

Ties: tokens with equal logits are kept or dropped together. Top-k keeps every token
whose logit is at least the k-th largest (as vLLM's top-k mask does); top-p drops a
token when the probability mass of the tokens with a strictly larger logit reaches
top_p, so no token is preferred to an equal one for its id. `sampling_probs` is this
definition over the whole vocabulary (with a sort for top-p); `sample` draws from it
without building it when top-k is on (`_top_k_scores`: the k candidates and the k-th
logit's ties as one group, a Gumbel-max draw), which on an H200 cut the default
sampler from ~230 us of device time in 79 kernels per step at batch 1 (~750 us in
204 at batch 8: softmax, sort and cumsum over 151,552 logits, then
`torch.multinomial` per row) to far less (docs/gpu-runs.md, session 18).

On CUDA the default (`FLINTC_SAMPLER` unset or `triton`) draws in one launch instead
(`flintc.kernels.sampler`: the same distribution, Gumbel-max over per-token Philox
uniforms keyed by the request's generator seed and offset), for the rows with
1 <= top_k <= 64 < V (each row decided on its own settings, so a seeded row's tokens
still do not depend on the batch; a batch of only such rows and greedy ones is one
launch); the other rows, the CPU, and `FLINTC_SAMPLER=torch` take the path above.
Written in session 24 without a GPU; session 25's H200 run (`scripts/gpu_sampler_ab.sh`)
made it the default: 0.18 ms per token less at batch 1, 0.13 ms at batch 8.

vLLM's other controls, with vLLM's semantics and order (all off by default; a row that
uses none of them takes exactly the path above, at the same cost):
- Before temperature, on a copy of the row's fp32 logits (`adjust_logits`, in torch),
  in vLLM v1's order: the masks first, `allowed_token_ids` (every other token gets
  -inf), then `bad_words` (at each step, a bad word's last token gets -inf when the
  sequence's generated tokens end with the word's other tokens; a one-token word is
  always banned; the prompt does not count, as in vLLM v1); then `min_tokens` (while
  fewer tokens than that are generated, the sequence's stop tokens, end-of-text
  included, get -inf), `logit_bias` (added), then the penalties (`apply_penalties`, as
  vLLM's: `repetition_penalty` on every token of prompt or output, positive logits
  divided by it and the others multiplied; then `frequency_penalty` times each token's
  count in the output and `presence_penalty` once for each token the output holds,
  subtracted). Greedy rows see them too. The counts and output ids come from each
  row's `TokenHistory` (`sample(..., history=...)`), which the callers keep per
  sequence (the serving engine, `generate_with_runner`); the bad-word match is made on
  the host, on that Python list (no device sync).
- Bad words are text; they become token ids with the tokenizer, as vLLM's
  `SamplingParams.update_from_tokenizer` makes them in its engine's input processor
  (`bad_words_token_ids`: each word with and without a leading space).
  `SamplingParams.with_tokenizer` does that, and the callers that hold a tokenizer call
  it: `flintc.api.CompiledModel.generate`, the server (a 400 for a word that makes no
  tokens) and `flintc.serve.engine.Engine.submit`. Without a tokenizer (the reference
  `generate`, `generate_with_runner`), give `bad_words_token_ids` instead; `bad_words`
  left unconverted there is an InputError.
- Structured outputs (`structured_outputs`, a `StructuredOutputsParams`: vLLM's, on
  llguidance as vLLM's "guidance" backend; `flintc.structured`): the grammar's mask, the
  first of the masks (every token the sequence's grammar does not allow next gets -inf),
  from the row's `TokenHistory.grammar` (a `flintc.structured.GrammarMatcher` the
  callers make with the tokenizer and feed each token).
- After temperature, before top-k: `min_p` drops the tokens whose probability is below
  min_p times the top token's (decided on exp(x - max x) >= min_p in fp64, so equal
  logits are kept or dropped together). Rows with min_p > 0 take the torch path (the
  one-launch kernel has no min_p); rows with only the logit adjustments above still
  take the kernel, on the adjusted logits.

vLLM's stopping fields, `stop` (strings), `stop_token_ids` and `include_stop_str_in_output`,
are carried here and acted on by the callers that run sequences (`generate_with_runner`,
the serving engine; the strings matched by `flintc.stop_strings`, in the text the
tokenizer makes; the stop-token rule in `flintc.stop_strings.stop_token_end`): the sampler
sees only `min_tokens` masking the stop tokens.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass

import torch

from flintc.errors import InputError


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
# FLINTC_SAMPLER unset: the one-launch kernel on CUDA (session 25, H200, NVFP4 1K: decode +
# Flint's default sampling + token read 1.984 -> 1.803 ms at batch 1, 3.370 -> 3.237 ms at
# batch 8; docs/gpu-runs.md). On the CPU the torch path runs unless FLINTC_SAMPLER=triton
# is set with Triton's interpreter (tests).
DEFAULT_SAMPLER = "triton"


def sampler_backend() -> str:
    """FLINTC_SAMPLER: "torch" (the torch ops below) or "triton" (one launch,
    `flintc.kernels.sampler`, on CUDA for the batches it takes); unset or empty:
    `DEFAULT_SAMPLER`.

    Raises:
        TuningEnvError (a ValueError): another value, naming the variable.
    """
    from flintc.kernels.tuning import env_choice

    return env_choice("FLINTC_SAMPLER", ("torch", "triton"), DEFAULT_SAMPLER)


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrained decoding: the output must match one grammar. vLLM's
    `vllm.sampling_params.StructuredOutputsParams` (its fields and rules), run on
    llguidance as vLLM's "guidance" backend (`flintc.structured`).

    Exactly one of:
    json: a JSON schema (a dict, or its JSON text, which may be JSON Schema's boolean
        schema "true", any value, or "false", none (an error); kept as JSON text, key order kept):
        the output is one JSON value the schema accepts (llguidance's JSON schema subset:
        https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md).
    regex: a regular expression (Rust regex syntax) the whole output matches.
    choice: a list of strings (kept as a tuple); the output is one of them.
    grammar: a context-free grammar in Lark syntax as llguidance reads it (its
        extensions included: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md;
        a GBNF grammar, llama.cpp's, is converted), start rule `start`.
    json_object: True: the output is any JSON object (the schema {"type": "object"}; the
        OpenAI response_format {"type": "json_object"}).
    structural_tag: vLLM's structural tag, JSON text (vLLM's field: a str) or the object
        itself (kept as its JSON text): ``{"type": "structural_tag", "structures":
        [{"begin": str, "schema": JSON schema, "end": str}, ...], "triggers": [str, ...]}``
        (vLLM's `StructuralTagResponseFormat`; "type" may be left out). The output is
        free text in which each trigger, wherever it appears, must go on as the begin
        of one of the structures that start with it, then a JSON value its schema
        accepts, then its end; then free text again (llguidance's `StructTag`, as
        vLLM's guidance backend builds it: `flintc.structured.parse_structural_tag`).
        A trigger written ``<...>`` is a special token of the tokenizer (llguidance's
        assumption).
    And, for json / json_object / each structural_tag schema (vLLM's options):
    disable_any_whitespace: no whitespace between JSON tokens (default: flexible
        whitespace, as vLLM's guidance backend).
    disable_additional_properties: object schemas that do not say otherwise get
        "additionalProperties": false (vLLM's option).
    whitespace_pattern: the regex of the whitespace allowed between JSON tokens
        (vLLM's guided_whitespace_pattern), None for the default.
    disable_fallback: accepted (vLLM's); no effect: there is no other backend to fall to.

    Raises:
        InputError: none or several kinds given ("You can only use one kind of structured
            outputs constraint", as vLLM), a value of the wrong type, an empty choice, a
            structural_tag that is not JSON or not of that shape (no structures, a begin
            that starts with none of the triggers: vLLM's "Trigger ... not found in
            triggers ..."), or a schema / regex / grammar llguidance refuses:
            "structured_outputs field '<kind>': <llguidance's message>" (a
            structural_tag's names the structure: "structures[1].schema: ...").
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    structural_tag: str | None = None  # (last: the fields before it keep their places)

    def __post_init__(self) -> None:
        def fail(field: str, msg: str):
            raise InputError(f"structured_outputs field '{field}': {msg}")

        if self.json is not None:
            js = self.json
            if not isinstance(js, str):
                if not isinstance(js, dict):
                    fail("json", f"expected a JSON schema (an object, or its JSON text), got {type(js).__name__}")
                try:
                    js = json.dumps(js)
                except (TypeError, ValueError) as exc:
                    fail("json", f"the schema is not JSON data: {exc}")
                except RecursionError:
                    fail("json", "the schema is too deeply nested")
            else:
                try:
                    parsed = json.loads(js)
                except ValueError as exc:
                    fail("json", f"not valid JSON: {exc}")
                except RecursionError:
                    fail("json", "the schema is too deeply nested")
                if not isinstance(parsed, (dict, bool)):
                    fail("json", f"a JSON schema must be an object, got {type(parsed).__name__}")
            object.__setattr__(self, "json", js)
        if self.choice is not None:
            ch = self.choice
            if isinstance(ch, (str, bytes)) or not hasattr(ch, "__iter__"):
                fail("choice", f"expected a list of strings, got {type(ch).__name__}")
            ch = tuple(ch)
            if not ch:
                fail("choice", "must not be empty")
            bad = [c for c in ch if not isinstance(c, str)]
            if bad:
                fail("choice", f"expected strings, got {bad[0]!r}")
            object.__setattr__(self, "choice", ch)
        if self.structural_tag is not None:
            from flintc.structured import structural_tag_json

            object.__setattr__(self, "structural_tag", structural_tag_json(self.structural_tag))
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                fail(name, f"expected a string, got {type(v).__name__}")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            v = bool_or_self(getattr(self, name))
            if v is None and name == "json_object":
                v = False
            if not isinstance(v, bool):
                fail(name, f"expected true or false, got {v!r}")
            object.__setattr__(self, name, v)
        given = self._given()
        if len(given) > 1:
            raise InputError(f"You can only use one kind of structured outputs constraint but multiple are "
                             f"specified: {', '.join(given)}")
        if not given:
            raise InputError(f"structured_outputs: give one of {', '.join(_STRUCTURED_KINDS)}")
        from flintc.structured import check_spec

        check_spec(self)

    def _given(self) -> list[str]:
        """The kinds of constraint set (json_object when true, the others when not None)."""
        return [k for k in _STRUCTURED_KINDS if (getattr(self, k) if k == "json_object" else
                                                  getattr(self, k) is not None)]

    @property
    def kind(self) -> str:
        """The constraint given: "json", "regex", "choice", "grammar", "json_object" or
        "structural_tag"."""
        return self._given()[0]

    @classmethod
    def from_dict(cls, data: dict) -> "StructuredOutputsParams":
        """From vLLM's `structured_outputs` request object (its field names).

        Raises:
            InputError: not a dict, or a field this class does not take, named; and
                `__init__`'s.
        """
        if not isinstance(data, dict):
            raise InputError(f"structured_outputs: expected an object, got {type(data).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        extra = [k for k in data if k not in fields and data[k] is not None]
        if extra:
            raise InputError(f"structured_outputs field '{extra[0]}' is not supported (flintc takes "
                             f"{', '.join(fields)})")
        return cls(**{k: v for k, v in data.items() if k in fields and v is not None})


def min_tokens_over_context(min_tokens: int, n_prompt: int, max_model_len: int, where: str = "",
                            none: str = "None") -> str:
    """The error for a min_tokens over the room a prompt leaves when max_tokens is unset
    (`none`: "None" in Python, "null" for `flintc serve`'s JSON), where max_tokens is the
    rest of the context: what limits min_tokens then is the context, not a max_tokens the
    caller gave. One wording for `SamplingParams.for_prompt` (the Python API, `flintc run`)
    and `flintc serve`. `where`: appended to the field name (" of prompt 3")."""
    rest = max_model_len - n_prompt
    return (f"sampling field 'min_tokens'{where} ({min_tokens}) must be at most max_tokens, which is {none}: "
            f"the rest of the context, {rest} token{'' if rest == 1 else 's'} after the prompt's {n_prompt} "
            f"(maximum model length {max_model_len})")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature: >= 0; below `GREEDY_TEMPERATURE` (1e-5, vLLM's sampling epsilon) the
        request is greedy (argmax, ties to the lower token id): logits / temperature
        would overflow to inf there.
    top_k: keep the k most likely tokens; 0 or -1 keeps all.
    top_p: in (0, 1]; keep the smallest set of most likely tokens whose
        probability (after top-k, renormalised) reaches top_p.
    max_tokens: tokens to generate at most (an int >= 0); reasoning tokens count. None:
        as many as the context holds, vLLM's None: each prompt of n tokens gets
        max_model_len - n (the rest of its context, prompt and generated tokens counting
        together; `for_prompt` makes it an int), as `flintc serve` reads a request's
        `"max_tokens": null`. A caller that runs prompts (`generate_with_runner`,
        `flintc.model.generate.generate`, `flintc.api.CompiledModel.generate`,
        `flintc.serve.engine.Engine.submit`) resolves it per prompt.
    seed: seeds this request's generator; None draws from a fresh random seed.
    ignore_eos: keep generating after the end-of-text token and the model's other
        generation-config end ids (`<|user|>` / `<|observation|>` with Flint's tokenizer,
        `flintc.checkpoint.tokenizer.generation_stop_token_ids`, which otherwise end every
        sequence with their id as stop_reason, as vLLM's `update_from_generation_config`
        adds them to stop_token_ids unless ignore_eos); `stop_token_ids` still end it.

    vLLM's further controls (the module docstring tells where each applies):
    presence_penalty: in [-2, 2]; subtracted once from the logit of every token the
        output so far holds (0: off).
    frequency_penalty: in [-2, 2]; subtracted from each token's logit times its count
        in the output so far (0: off).
    repetition_penalty: > 0; for every token of the prompt or the output, a positive
        logit is divided by it, any other multiplied (1: off).
    min_p: in [0, 1]; drop the tokens whose probability (after temperature) is below
        min_p times the most likely token's (0: off).
    min_tokens: >= 0, at most max_tokens (with max_tokens None: at most what each
        prompt's context leaves, checked by `for_prompt`); the stop tokens (end-of-text
        included) cannot be drawn, and stop strings are not looked for, until this many
        tokens are generated.
    logit_bias: {token_id: bias} with bias in [-100, 100], added to the logits; kept as
        a tuple of (token_id, bias) pairs sorted by id (so that the params stay
        hashable), None when empty. Ids are checked against the vocabulary by the
        callers that know it (`sample` raises ValueError for one outside).
    allowed_token_ids: the only token ids that may be drawn (every other logit -inf);
        kept as a sorted tuple without repeats. None: all; an empty list is refused (as
        vLLM's "allowed_token_ids is not None and empty!"). Ids are checked against the
        vocabulary by the callers that know it, as logit_bias's.
    bad_words: words (strings) the output must not hold; kept as a tuple, None when
        empty. They act through `bad_words_token_ids`, which `with_tokenizer` fills.
    bad_words_token_ids: the bad words as token id sequences (a tuple of non-empty
        tuples, None when empty): a sequence's last id gets -inf whenever the generated
        tokens end with its other ids (a one-id sequence always). `with_tokenizer`
        makes them from `bad_words`; give them directly only without a tokenizer.
    structured_outputs: a `StructuredOutputsParams` (or a dict of its fields), None for
        none: the output must match its JSON schema, regex, choice, grammar or structural
        tag (vLLM's structured outputs; the module docstring). The callers that hold the
        tokenizer make each sequence's `flintc.structured.GrammarMatcher` (`TokenHistory.grammar`)
        and end the sequence with "stop" when the grammar is complete.
    stop: stop strings (a str or a list of str; kept as a tuple, None when empty): the
        sequence ends (finish reason "stop") when one of them ends in the latest token's
        text (the first in the order given, as vLLM's; `flintc.stop_strings`), looked
        for once more than `min_tokens` tokens are generated; the text ends before the
        stop string (after it with include_stop_str_in_output). Acted on
        by the callers that hold the tokenizer (`flintc.api.CompiledModel.generate`,
        `generate_with_runner` with tokenizer=, `flintc run --stop`, the server); the
        output ids keep the token that completed the match, as vLLM's do.
    stop_token_ids: more token ids that end the sequence (finish reason "stop"), even
        with ignore_eos (which ignores the end-of-text and generation-config end ids alone,
        as vLLM's: `flintc.stop_strings.stop_token_end`); kept as a tuple in
        the order given, None when empty. Like end-of-text, they are masked while fewer
        than `min_tokens` tokens are generated, the output ids keep the one that ended
        the sequence and the text leaves it out. Ids are checked against the vocabulary
        by the callers that know it, as logit_bias's.
    include_stop_str_in_output: keep the stop string that ended the sequence in the text
        (the text ends after it), or the text of the stop token (end-of-text or one of
        stop_token_ids) it ended at.
    A row whose masks leave no token (say allowed_token_ids all bad words) draws an
    unspecified token, as a row of NaN logits does.
    """

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 20
    max_tokens: int | None = 16
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # NumPy scalars (np.float32(0.7), np.int64(20)) as the Python numbers they stand for
        for name, kind, cast in (("temperature", numbers.Real, float), ("top_p", numbers.Real, float),
                                 ("presence_penalty", numbers.Real, float),
                                 ("frequency_penalty", numbers.Real, float),
                                 ("repetition_penalty", numbers.Real, float), ("min_p", numbers.Real, float),
                                 ("top_k", numbers.Integral, int), ("max_tokens", numbers.Integral, int),
                                 ("seed", numbers.Integral, int), ("min_tokens", numbers.Integral, int)):
            v = getattr(self, name)
            if isinstance(v, kind) and not isinstance(v, bool) and type(v) not in (int, float):
                object.__setattr__(self, name, cast(v))
        object.__setattr__(self, "ignore_eos", bool_or_self(self.ignore_eos))
        object.__setattr__(self, "include_stop_str_in_output", bool_or_self(self.include_stop_str_in_output))
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_stop_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", _normalise_allowed(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", _normalise_bad_words(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", _normalise_bad_ids(self.bad_words_token_ids))
        if isinstance(self.structured_outputs, dict):
            try:
                spec = StructuredOutputsParams.from_dict(self.structured_outputs)
            except InputError as exc:
                raise InputError(f"sampling field 'structured_outputs': {exc}") from None
            object.__setattr__(self, "structured_outputs", spec)
        self.validate()

    def validate(self) -> "SamplingParams":
        """Raises InputError naming the field when a value is out of range."""
        t, p, k = self.temperature, self.top_p, self.top_k
        if not (_is_number(t) and math.isfinite(t) and t >= 0):
            raise InputError(f"sampling field 'temperature' must be a finite number >= 0, got {t!r}")
        if not (_is_number(p) and 0 < p <= 1):
            raise InputError(f"sampling field 'top_p' must be in (0, 1], got {p!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"sampling field 'ignore_eos' must be True or False, got {self.ignore_eos!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise InputError(f"sampling field 'top_k' must be an integer >= 1, or 0 / -1 for all, got {k!r}")
        mt = self.max_tokens
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 0):
            raise InputError(f"sampling field 'max_tokens' must be an integer >= 0, or None for the rest of "
                             f"each prompt's context, got {mt!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise InputError(f"sampling field 'seed' must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and -2 <= v <= 2):
                raise InputError(f"sampling field '{name}' must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not (_is_number(r) and math.isfinite(r) and r > 0):
            raise InputError(f"sampling field 'repetition_penalty' must be a finite number > 0, got {r!r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise InputError(f"sampling field 'min_p' must be a number in [0, 1], got {self.min_p!r}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise InputError(f"sampling field 'min_tokens' must be an integer >= 0, got {m!r}")
        if isinstance(self.max_tokens, int) and m > self.max_tokens:
            raise InputError(f"sampling field 'min_tokens' ({m}) must be at most max_tokens "
                             f"({self.max_tokens})")
        for tok, bias in self.logit_bias or ():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise InputError(f"sampling field 'logit_bias': token id {tok!r} is not an integer >= 0")
            if not (_is_number(bias) and -100 <= bias <= 100):
                raise InputError(f"sampling field 'logit_bias': the bias of token {tok} must be a number "
                                 f"in [-100, 100], got {bias!r}")
        for tok in self.allowed_token_ids or ():
            if not _is_token_id(tok):
                raise InputError(f"sampling field 'allowed_token_ids': token id {tok!r} is not an integer >= 0")
        for word in self.bad_words or ():
            if not isinstance(word, str):
                raise InputError(f"sampling field 'bad_words': expected strings, got {word!r}")
        for ids in self.bad_words_token_ids or ():
            if not ids or not all(_is_token_id(t) for t in ids):
                raise InputError(f"sampling field 'bad_words_token_ids': each entry must be a non-empty "
                                 f"sequence of token ids (integers >= 0), got {ids!r}")
        for i, word in enumerate(self.stop or ()):
            if not isinstance(word, str):
                raise InputError(f"sampling field 'stop': expected strings, got {word!r} (entry {i})")
            if not word:  # vLLM's "stop cannot contain an empty string."
                raise InputError(f"sampling field 'stop' cannot contain an empty string (entry {i})")
        for tok in self.stop_token_ids or ():
            if not _is_token_id(tok):
                raise InputError(f"sampling field 'stop_token_ids': token id {tok!r} is not an integer >= 0")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InputError(f"sampling field 'include_stop_str_in_output' must be True or False, got "
                             f"{self.include_stop_str_in_output!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise InputError(f"sampling field 'structured_outputs' must be a StructuredOutputsParams (or a dict "
                             f"of its fields), got {type(so).__name__}")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """presence, frequency or repetition penalty on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust_logits` has work for this row (structured outputs,
        allowed_token_ids, bad words, min_tokens, logit_bias or penalties): the rows whose
        sequences need a `TokenHistory`."""
        return (self.has_penalties or self.logit_bias is not None or self.min_tokens > 0
                or self.allowed_token_ids is not None or self.bad_words is not None
                or self.bad_words_token_ids is not None or self.structured_outputs is not None)

    def with_tokenizer(self, tokenizer) -> "SamplingParams":
        """These params with `bad_words_token_ids` made from `bad_words` by `tokenizer`
        (`bad_words_to_token_ids`; vLLM's `update_from_tokenizer`); self when there are
        no bad words or their ids are already there.

        Raises:
            InputError: a word that makes no tokens, or an id outside the tokenizer's
                vocabulary, naming 'bad_words'.
        """
        if self.bad_words is None or self.bad_words_token_ids is not None:
            return self
        return dataclasses.replace(self, bad_words_token_ids=bad_words_to_token_ids(self.bad_words, tokenizer))

    def with_max_tokens(self, max_tokens: int) -> "SamplingParams":
        """These params with `max_tokens` (an int) instead of their own, which must be at
        most `max_tokens` (or None, with min_tokens at most `max_tokens`): every check
        these params passed still holds (min_tokens <= max_tokens is the one that reads
        it). A copy with that field set, not a new SamplingParams: `__post_init__` would
        walk allowed_token_ids and the bad words' ids again, once per prompt of a
        /v1/completions request of many prompts whose max_tokens differ ("max_tokens":
        null gives each the rest of its context).

        Raises:
            ValueError: `max_tokens` not an int, below these params' own, or (their own
                None) below their min_tokens.
        """
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {max_tokens!r}")
        if self.max_tokens is not None and max_tokens < self.max_tokens:
            raise ValueError(f"max_tokens {max_tokens} is below these params' {self.max_tokens}")
        if max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens {max_tokens} is below these params' min_tokens {self.min_tokens}")
        out = copy.copy(self)
        object.__setattr__(out, "max_tokens", max_tokens)  # frozen dataclass
        return out

    def for_prompt(self, n_prompt: int, max_model_len: int, where: str = "") -> "SamplingParams":
        """These params for a prompt of `n_prompt` tokens in a context of `max_model_len`
        (prompt and generated tokens together, vLLM's max_model_len): self when
        max_tokens is an int; for max_tokens None, a copy with max_tokens =
        max_model_len - n_prompt, the rest of the context (vLLM's `get_max_tokens`, and
        `flintc serve`'s reading of `"max_tokens": null`).

        Args:
            n_prompt: the prompt's length in tokens (>= 1).
            max_model_len: the most tokens a sequence holds, prompt included.
            where: appended to the field name in errors (" of prompt 3").

        Raises:
            InputError: max_tokens None and the prompt leaves no room to generate
                (n_prompt >= max_model_len), or leaves fewer tokens than min_tokens.
        """
        if self.max_tokens is not None:
            return self
        rest = max_model_len - n_prompt
        if rest < 1:
            raise InputError(f"sampling field 'max_tokens'{where} is None (the rest of the context), but the "
                             f"prompt's {n_prompt} tokens leave no room to generate within the maximum model "
                             f"length of {max_model_len} tokens")
        if self.min_tokens > rest:
            raise InputError(min_tokens_over_context(self.min_tokens, n_prompt, max_model_len, where))
        return self.with_max_tokens(rest)

    def make_generator(self, device: torch.device | str) -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def _is_number(v) -> bool:
    """A real number (not a bool, not NaN, and within float range)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return not math.isnan(v)
    except OverflowError:  # an int beyond any float
        return False


def bool_or_self(value):
    """A NumPy bool (`numpy.True_`, `numpy.bool_(x)`) as the Python bool it stands for;
    anything else as it is (for the caller's `isinstance(value, bool)` check to refuse a
    string, an int or None). NumPy is not imported: a value of its type means it is."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    return value


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _int_or_self(t):
    """A NumPy integer, or a 0-d integer tensor (an item of `torch.tensor([5, 6])`), as the
    Python int it stands for; anything else as it is."""
    if type(t) is int:  # the common case, first: the ABC check below costs ~1 us an id
        return t
    if isinstance(t, numbers.Integral) and not isinstance(t, bool) and type(t) is not int:
        return int(t)
    if isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype in (
            torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        return int(t)
    return t


def _id_sequence(value, name: str) -> list:
    """`value` (a list, tuple or other iterable of ids, not a string) as a list."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InputError(f"sampling field '{name}' must be a list of token ids, got {type(value).__name__}")
    try:
        return [_int_or_self(t) for t in value]
    except TypeError:  # has __iter__ but no items: a 0-d tensor or array
        raise InputError(f"sampling field '{name}' must be a list of token ids, got {type(value).__name__} "
                         f"{value!r}") from None


def _normalise_allowed(ids):
    """allowed_token_ids -> a sorted tuple without repeats (None stays None); an empty
    one is refused (vLLM: it would mask every token). Entries that are not ids are left
    for `validate`."""
    if ids is None:
        return None
    ids = _id_sequence(ids, "allowed_token_ids")
    if not ids:
        raise InputError("sampling field 'allowed_token_ids' must not be empty (None allows every token)")
    if not all(_is_token_id(t) for t in ids):
        return tuple(ids)  # validate names the bad id
    return tuple(sorted(set(ids)))


def _normalise_bad_words(words):
    """bad_words -> a tuple of strings, None when empty (vLLM's default, [])."""
    if words is None:
        return None
    if isinstance(words, (str, bytes)) or not hasattr(words, "__iter__"):
        raise InputError(f"sampling field 'bad_words' must be a list of strings, got {type(words).__name__}")
    return tuple(words) or None


def _normalise_stop(stop):
    """stop -> a tuple of strings (a str alone is one stop string, as vLLM takes it), None
    when empty (vLLM's default, []). Entries that are not strings are left for
    `validate`."""
    if stop is None:
        return None
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, bytes) or not hasattr(stop, "__iter__"):
        raise InputError(f"sampling field 'stop' must be a string or a list of strings, got {type(stop).__name__}")
    return tuple(stop) or None


def _normalise_stop_ids(ids):
    """stop_token_ids -> a tuple of ids in the order given, None when empty (vLLM's
    default, []). Entries that are not ids are left for `validate`."""
    if ids is None:
        return None
    return tuple(_id_sequence(ids, "stop_token_ids")) or None


def _normalise_bad_ids(seqs):
    """bad_words_token_ids -> a tuple of id tuples, None when empty."""
    if seqs is None:
        return None
    if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
        raise InputError(f"sampling field 'bad_words_token_ids' must be a list of token id lists, got "
                         f"{type(seqs).__name__}")
    return tuple(tuple(_id_sequence(ids, "bad_words_token_ids")) for ids in seqs) or None


def bad_words_to_token_ids(words, tokenizer) -> tuple[tuple[int, ...], ...] | None:
    """vLLM's `SamplingParams.update_from_tokenizer`: each word, with its leading
    whitespace removed, is encoded without special tokens (`tokenizer.encode(text,
    add_special_tokens=False)`), then again after a space; the second is kept too when
    its first token differs from the first's and it has the same length (the word in the
    middle of a text, for a tokenizer that marks a preceding space in the token).

    Returns: the id sequences in that order (None for no words).
    Raises:
        InputError: a word that makes no tokens (vLLM: "bad_words entries must tokenize
            to at least one token"), or an id outside [0, tokenizer.vocab_size).
    """
    out: list[tuple[int, ...]] = []
    for word in words or ():
        if not isinstance(word, str):
            raise InputError(f"sampling field 'bad_words': expected strings, got {word!r}")
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise InputError(f"sampling field 'bad_words': {word!r} makes no tokens; each entry must tokenize "
                             f"to at least one token")
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    vocab = tokenizer.vocab_size
    bad = [t for ids in out for t in ids if not 0 <= t < vocab]
    if bad:
        raise InputError(f"sampling field 'bad_words': token ids {bad} are outside the vocabulary [0, {vocab})")
    return tuple(out) or None


def _normalise_logit_bias(bias):
    """A {token_id: bias} mapping (or pairs) -> a tuple of (token_id, float(bias)) sorted
    by id, or None when empty. Values that are not numbers are left for `validate`."""
    if bias is None:
        return None
    try:
        pairs = list(bias.items()) if hasattr(bias, "items") else [tuple(p) for p in bias]
    except TypeError:
        raise InputError(f"sampling field 'logit_bias' must be a dict {{token_id: bias}}, got "
                         f"{type(bias).__name__}") from None
    if any(len(p) != 2 for p in pairs):
        raise InputError("sampling field 'logit_bias' must be a dict {token_id: bias}, or (token_id, bias) pairs")
    if not pairs:
        return None
    pairs = [(_int_or_self(t), b) for t, b in pairs]  # NumPy / 0-d tensor ids as ints
    ids = [t for t, _ in pairs]
    if not all(isinstance(t, int) for t in ids):
        return tuple(pairs)  # validate names the bad id
    if len(set(ids)) != len(ids):
        raise InputError("sampling field 'logit_bias' gives a token id twice")
    return tuple(sorted((t, float(b) if _is_number(b) else b) for t, b in pairs))


def params_per_prompt(params, n: int) -> list["SamplingParams"]:
    """One SamplingParams per prompt: `params` itself repeated n times, or a list / tuple
    of n of them.

    Raises:
        InputError: a list of another length, or an entry that is not a SamplingParams
            (a dict, say), named.
    """
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
    if len(plist) != n:
        raise InputError(f"{len(plist)} SamplingParams for {n} prompts: give one, or one per prompt")
    for i, p in enumerate(plist):
        if not isinstance(p, SamplingParams):
            where = "params" if not isinstance(params, (list, tuple)) else f"params[{i}]"
            raise InputError(f"{where}: expected a flintc.sampling.SamplingParams, got {type(p).__name__}")
    return plist


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from (the definition; `sample` draws from it
    without building it). logits: fp32 (or bf16) [..., V]. Not for greedy.

    x = logits / temperature; min_p (when > 0) drops every token with exp(x - max x) <
    min_p (its probability below min_p times the top token's, as vLLM's min-p; equal x
    stay or go together); top-k keeps every token with x >= the k-th largest x (the
    k-th logit's ties all stay); softmax over the kept tokens; top-p drops a token when
    the mass of the tokens with a strictly larger x reaches top_p (tokens with equal x
    stay or go together; the most likely ones always stay); renormalise. The masses that
    decide top-p are computed and summed in fp64. Cost: softmax, sort and cumsum over V (on an H200 ~0.6 ms of device
    time per call with V = 151,552); `sample` uses it only for top-k off or above
    `MAX_FAST_TOP_K`.

    Returns: fp32 [..., V], zero outside the kept set, summing to 1 per row.
    """
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if params.min_p > 0:
        x = _apply_min_p(x, params.min_p)
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        # the decision on fp64 masses, as `_top_k_scores` and the sampler kernel take it:
        # fp32 probabilities would move a token whose mass lies within an fp32 ulp of top_p
        sorted_p = torch.softmax(x.double(), dim=-1).gather(-1, order)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass ahead in the sort
        # the mass of the strictly larger x: `before` at the first token of each run of
        # equal x (found by a binary search of the ascending -sorted_x)
        neg = -sorted_x.contiguous()
        # (a NaN logit is found nowhere, i.e. at V: clamped, so a row with NaN gives some
        # token of that row instead of an out-of-bounds gather, a device assert on CUDA)
        first = torch.searchsorted(neg, neg, side="left").clamp_(max=vocab - 1)
        larger = before.gather(-1, first)
        drop = torch.zeros_like(larger, dtype=torch.bool).scatter(-1, order, larger >= params.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


MAX_FAST_TOP_K = 256  # `_top_k_scores` does O(k^2) work per row; above this, the sort


def _top_k_scores(x: torch.Tensor, k: int, top_p: float):
    """`sampling_probs`'s distribution for 0 < k < V, without any pass over the vocabulary
    but torch.topk and one comparison with a sum (no softmax, sort or cumsum over V).

    Args:
        x: fp32 [R, V], the logits over the temperature. k: top-k. top_p: in (0, 1].

    Returns (cand, scores, tied):
        cand: int64 [R, k], torch.topk's ids; scores: fp64 [R, k + 1], the log-weights
        (up to a per-row constant) of the k candidates that lie strictly above the k-th
        logit and of the k-th logit's ties as one group (last column; they all share its
        weight), -inf for what top-k or top-p drops; tied: bool [R, V], the k-th logit's
        ties (inside the k or not).

    Every token with a larger logit than the k-th is among the candidates, so the mass
    above a candidate, and the total mass (candidates above the k-th plus n_tied times
    the k-th weight), are sums over k values: O(k^2) work per row.
    """
    vals, cand = torch.topk(x, k, dim=-1)  # [R, k], descending
    vd = vals.double()
    m, kth = vd[:, :1], vd[:, -1:]
    tied = x == vals[:, -1:]  # [R, V]
    n_tied = tied.sum(-1, keepdim=True)  # [R, 1], >= 1
    above = vd > kth  # [R, k]
    e = torch.exp(vd - m) * above  # weights of the candidates above the k-th; 0 for its ties
    e_kth = torch.exp(kth - m)
    mass_above = e.sum(-1, keepdim=True)
    total = mass_above + n_tied * e_kth
    larger = ((vd[:, None, :] > vd[:, :, None]) * e[:, None, :]).sum(-1)  # [R, k] mass of larger x
    keep = above & (larger < top_p * total)
    keep_tied = mass_above < top_p * total  # the ties' larger-x mass is every candidate above
    ninf = float("-inf")  # a Python scalar: a device tensor made from it would be a host-to-device copy
    scores = torch.cat([torch.where(keep, vd - m, ninf),
                        torch.where(keep_tied, torch.log(n_tied.double()) + kth - m, ninf)], dim=-1)
    return cand, scores, tied


def _apply_min_p(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """x (the logits over the temperature) with -inf where exp(x - max x) < min_p: vLLM's
    min-p (probability < min_p times the largest probability), decided in fp64 on the
    logits, so that equal logits are kept or dropped together and the top token(s) always
    stay."""
    xd = x.double()
    drop = torch.exp(xd - xd.amax(dim=-1, keepdim=True)) < min_p
    return x.masked_fill(drop, float("-inf"))


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) in fp64 for uniforms u in [0, 1) (u = 0 gives -inf)."""
    return -torch.log(-torch.log(u.double()))


def _draw(x: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """One token per row of x (fp32 [R, V], the logits over the temperature) from
    `sampling_probs`'s distribution, by the Gumbel-max trick (argmax of log-weight plus
    Gumbel noise is a draw from the normalised weights; Gumbel 1954, as in
    Maddison et al. 2014, "A* Sampling"), with uniforms u (fp32 [R, V + k + 1], each row
    from its request's generator). Returns int64 [R]."""
    V = x.shape[-1]
    k = params.top_k
    if params.min_p > 0:
        x = _apply_min_p(x, params.min_p)
    if 0 < k < V and k <= MAX_FAST_TOP_K:
        cand, scores, tied = _top_k_scores(x, k, params.top_p)
        win = torch.argmax(scores + _gumbel(u[:, :k + 1]), dim=-1)  # [R] in [0, k]
        # the group of ties: each tie equally likely (the largest of independent uniforms)
        tie = torch.argmax(torch.where(tied, u[:, k + 1:k + 1 + V], -1.0), dim=-1)
        pick = cand.gather(-1, win.clamp(max=k - 1)[:, None])[:, 0]
        return torch.where(win == k, tie, pick)
    probs = sampling_probs(x, SamplingParams(temperature=1.0, top_k=k, top_p=params.top_p))
    return torch.argmax(torch.log(probs.double()) + _gumbel(u[:, :V]), dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           history: list["TokenHistory | None"] | None = None):
    """Draw one token per row, rows with the same settings batched (one `_draw` per group
    of rows with equal (temperature, top_k, top_p, min_p)). Greedy rows take the argmax
    (ties to the lower token id). Rows with allowed_token_ids, bad words, min_tokens,
    logit_bias or penalties draw from their logits as `adjust_logits` leaves them (on a
    copy: `logits` is never written), on either path (the kernel's rows too). Each
    sampled row fills its own V + MAX_FAST_TOP_K + 1 uniforms from its own generator
    (one `uniform_` launch per row, the same count whatever the settings), so a seeded
    request's tokens do not depend on the rest of the batch, at any step. A row holding
    NaN logits gets an unspecified token of that row (no error; the other rows are
    unaffected). No host sync and no host-to-device copy (with FLINTC_SAMPLER=triton,
    the kernel's rows: one asynchronous copy of their settings from pinned memory; the
    logit adjustments: small asynchronous copies of their ids from pinned memory, kept
    per sequence where they do not change): the launches queue behind the forward pass.

    Args:
        logits: fp32 (or bf16) [B, V].
        params: B `SamplingParams`, one per row.
        generators: B generators on logits' device (None: torch's default generator;
            greedy rows ignore theirs).
        history: None, or B entries: each row's `TokenHistory` (None for a row that
            needs none). Rows with penalties, min_tokens or bad words of several tokens
            need theirs; rows with structured_outputs theirs with its `grammar`.
    Returns: int64 [B] on logits' device.
    Raises:
        ValueError: logits not [B, V] or lists of another length than B; a row with
            penalties, min_tokens or bad words of several tokens and no history;
            bad_words without bad_words_token_ids; a logit_bias, allowed_token_ids or
            bad-word id outside [0, V).
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators) \
            or (history is not None and len(history) != len(params)):
        raise ValueError("sample() needs logits [B, V] and one params/generator (and history, if given) per row")
    if any(p.adjusts_logits for p in params):
        logits = adjust_logits(logits, params, history)
    B, V = logits.shape
    if all(p.is_greedy for p in params):
        return torch.argmax(logits, dim=-1)  # first maximum: the lower token id
    # The kernel's rows are chosen row by row (never for the whole batch), so that which
    # way a seeded row goes, and so its tokens, do not depend on the other rows.
    fast = _triton_rows(logits, params, generators) if sampler_backend() == "triton" else []
    if fast and len(fast) == sum(not p.is_greedy for p in params):
        return _sample_triton(logits, params, generators)  # the greedy rows too
    fast_set = set(fast)
    groups: dict[tuple, list[int]] = {}
    for b, p in enumerate(params):
        if b in fast_set:
            continue
        key = ("greedy",) if p.is_greedy else (p.temperature, p.top_k, p.top_p, p.min_p)
        groups.setdefault(key, []).append(b)
    # Every sampled row draws the same number of uniforms whatever its or the other rows'
    # settings, so a seeded request's generator advances alike in any batch.
    u = torch.empty(B, V + MAX_FAST_TOP_K + 1, dtype=torch.float32, device=logits.device)
    out = None if len(groups) == 1 and not fast else torch.empty(B, dtype=torch.long, device=logits.device)
    if fast:
        tok = _sample_triton(_rows(logits, fast), [params[b] for b in fast], [generators[b] for b in fast])
        for j, b in enumerate(fast):
            out[b] = tok[j]
    for key, rows in groups.items():
        x = _rows(logits, rows)
        if key == ("greedy",):
            tok = torch.argmax(x, dim=-1)
        else:
            p = params[rows[0]]
            x = x.float() if p.temperature == 1 else x.float() / p.temperature  # x / 1 == x
            for b in rows:
                u[b].uniform_(generator=generators[b])
            tok = _draw(x, p, _rows(u, rows))
        if out is None:
            return tok
        for j, b in enumerate(rows):
            out[b] = tok[j]
    return out


def _triton_rows(logits: torch.Tensor, params: list[SamplingParams], generators) -> list[int]:
    """The sampled rows `flintc.kernels.sampler` takes, each decided on its own settings
    alone: logits on CUDA (or any device under Triton's interpreter, for tests), the row
    with 1 <= top_k <= its MAX_TOP_K and < V, and a generator whose Philox state can be
    read (CUDA: seed and offset; the CPU's draws an offset), and no min_p (the kernel has
    none; logit adjustments are already in the logits). CPU logits only under the
    interpreter with FLINTC_SAMPLER=triton set explicitly (the default keeps the CPU on
    the torch path)."""
    if not (logits.is_cuda or (os.environ.get("TRITON_INTERPRET", "0") == "1"
                               and os.environ.get("FLINTC_SAMPLER", "").strip() == "triton")):
        return []
    try:
        from flintc.kernels import sampler
    except ImportError:  # no triton
        return []
    V = logits.shape[-1]
    if V >= 2**24 or logits.dtype not in (torch.float32, torch.bfloat16) or logits.stride(-1) != 1:
        return []
    return [b for b, (p, g) in enumerate(zip(params, generators))
            if not p.is_greedy and p.min_p == 0 and sampler.supports([p.top_k], V)
            and (g is None or g.device.type != "cuda" or hasattr(g, "get_offset"))]


def _philox_state(gen: torch.Generator | None, device: torch.device) -> tuple[int, int]:
    """(seed, offset) for one row's draw, advancing the row's generator so that its next
    draw differs: a CUDA generator's Philox seed and offset (offset + 4 after), a CPU
    generator's seed and a 62-bit offset drawn from it. None: the device's default
    generator."""
    if gen is None:
        gen = (torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
               if device.type == "cuda" else torch.default_generator)
    if gen.device.type == "cuda":
        off = gen.get_offset()
        gen.set_offset(off + 4)
        return gen.initial_seed(), off
    return gen.initial_seed(), int(torch.randint(0, 2**62, (1,), generator=gen))


def _sample_triton(logits: torch.Tensor, params: list[SamplingParams], generators) -> torch.Tensor:
    """`sample` in one launch of `flintc.kernels.sampler` (for the rows of `_triton_rows`,
    and greedy rows). The
    per-row settings and Philox state go to the device in one asynchronous copy from
    pinned memory (no host sync)."""
    from flintc.kernels import sampler

    seeds, offsets, ks, temps, tops = [], [], [], [], []
    for p, g in zip(params, generators):
        if p.is_greedy:
            seed, off, k, t = 0, 0, 1, 0.0
        else:
            (seed, off), k, t = _philox_state(g, logits.device), p.top_k, float(p.temperature)
        seeds.append(seed)
        offsets.append(off)
        ks.append(k)
        temps.append(t)
        tops.append(float(p.top_p))
    host = sampler.pack_params(seeds, offsets, ks, temps, tops)
    if logits.is_cuda:
        host = host.pin_memory()  # the caching host allocator keeps it until the copy is done
    dev = host.to(logits.device, non_blocking=True)
    return sampler.launch_sample(logits, dev, max(ks))


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] without an index tensor (whose host-to-device copy would wait for the GPU):
    x itself when rows are all of x in order, else a stack of row views."""
    if rows == list(range(x.shape[0])):
        return x
    return torch.stack([x[b] for b in rows])


# ---- vLLM's logit adjustments: min_tokens, logit_bias, penalties ------------------------


class TokenHistory:
    """One sequence's tokens, for the rows whose params adjust the logits (penalties,
    min_tokens, logit_bias, allowed_token_ids, bad words): what `sample(...,
    history=...)` reads. The caller keeps one per sequence and appends each generated
    token to `output_ids` (the list given is used as it is, not copied; the bad-word
    match reads it on the host). The device tensors are made when first needed and
    kept: the prompt's token mask and the stop ids (once), the logit bias, the allowed
    ids and the one-token bad words (once per params), and the output's token counts,
    brought up to date with the tokens appended since the last call (one small in-place
    add per new token, no host-to-device copy for it).

    Args:
        prompt_ids: the prompt's token ids.
        output_ids: the generated ids so far (a list the caller appends to).
        stop_token_ids: ids that end the sequence (end-of-text included): masked while
            fewer than `min_tokens` tokens are generated, as vLLM masks them.
        grammar: the sequence's `flintc.structured.GrammarMatcher`, for params with
            structured_outputs (None otherwise); `adjust_logits` feeds it the tokens
            appended since (`GrammarMatcher.advance`), then masks with it.
    """

    def __init__(self, prompt_ids, output_ids: list[int] | None = None, stop_token_ids=(), grammar=None):
        self.grammar = grammar
        self.prompt_ids = list(prompt_ids)
        self.output_ids = output_ids if output_ids is not None else []
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self._prompt_mask = self._counts = self._stops = None
        self._counted = 0
        self._bias_key = self._bias = None
        self._allowed_key = self._allowed = None
        self._bad_key = self._bad = None

    def prompt_mask(self, vocab: int, device) -> torch.Tensor:
        """bool [vocab]: the tokens the prompt holds."""
        if self._prompt_mask is None:
            ids = _checked_ids(self.prompt_ids, vocab, "prompt")
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            if ids:
                mask[torch.tensor(ids, dtype=torch.long).to(device)] = True
            self._prompt_mask = mask
        return self._prompt_mask

    def output_counts(self, vocab: int, device) -> torch.Tensor:
        """fp32 [vocab]: how many times each token occurs in output_ids."""
        out = self.output_ids
        if self._counts is None or len(out) < self._counted:  # (a list cut short: count again)
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._counted = 0
        new = _checked_ids(out[self._counted:], vocab, "generated")
        if len(new) <= 4:
            for t in new:
                self._counts[t:t + 1].add_(1.0)
        else:
            idx = torch.tensor(new, dtype=torch.long).to(device)
            self._counts.index_put_((idx,), torch.ones(len(new), device=device), accumulate=True)
        self._counted = len(out)
        return self._counts

    def stop_ids(self, vocab: int, device) -> torch.Tensor | None:
        """int64 [n]: the stop ids inside the vocabulary, or None for none."""
        if self._stops is None:
            ids = sorted(t for t in self.stop_token_ids if 0 <= t < vocab)
            self._stops = torch.tensor(ids, dtype=torch.long).to(device) if ids else False
        return self._stops if self._stops is not False else None

    def bias(self, params: SamplingParams, vocab: int, device):
        """(int64 ids [n], fp32 biases [n]) of params.logit_bias on the device."""
        if self._bias_key != params.logit_bias:
            self._bias = _bias_tensors(params.logit_bias, vocab, device)
            self._bias_key = params.logit_bias
        return self._bias

    def allowed(self, params: SamplingParams, vocab: int, device) -> torch.Tensor:
        """int64 [n]: params.allowed_token_ids on the device."""
        if self._allowed_key != params.allowed_token_ids:
            self._allowed = _allowed_tensor(params.allowed_token_ids, vocab, device)
            self._allowed_key = params.allowed_token_ids
        return self._allowed

    def bad_words(self, params: SamplingParams, vocab: int, device):
        """`_split_bad_words` of params.bad_words_token_ids: (the one-token words' ids
        on the device or None, the longer words)."""
        if self._bad_key != params.bad_words_token_ids:
            self._bad = _split_bad_words(params.bad_words_token_ids, vocab, device)
            self._bad_key = params.bad_words_token_ids
        return self._bad


def drawn_outside_allowed(params: SamplingParams, tok: int, step: int) -> str | None:
    """A message when `tok`, the token drawn at output position `step` (0-based), is not
    one of params.allowed_token_ids, else None. It happens only when the row's other
    masks left none of the allowed tokens (every logit -inf: bad_words banning them all,
    or min_tokens holding back the stop tokens they all are) or its logits were NaN:
    the sampler then draws an unspecified token, which the request did not allow. The
    server answers it as the request's 400 naming allowed_token_ids, `generate` raises
    an InputError (an allowed_token_ids of the stop token alone with min_tokens drew
    token 0 greedily, another out-of-set token sampled, and answered them)."""
    allowed = params.allowed_token_ids
    if allowed is None:
        return None
    i = bisect.bisect_left(allowed, tok)  # sorted without repeats (`_normalise_allowed`)
    if i < len(allowed) and allowed[i] == tok:
        return None
    why = [w for w, on in (("bad_words", params.bad_words is not None or params.bad_words_token_ids is not None),
                           ("min_tokens (it holds back the stop tokens until then)",
                            step < params.min_tokens)) if on]
    shown = ", ".join(map(str, allowed[:8])) + (", ..." if len(allowed) > 8 else "")
    return (f"sampling field 'allowed_token_ids': none of the allowed tokens ({shown}) could be drawn at output "
            f"token {step}: {' and '.join(why) or 'the other masks'} excluded every one of them (or the logits "
            f"were NaN); drop those tokens from bad_words, lower min_tokens, or allow more tokens")


def first_outside_vocab(ids, vocab: int) -> int | None:
    """The first of `ids` (a sequence of ints) outside [0, vocab), or None when every
    one is inside. min/max first (C loops); the Python scan for the culprit runs only
    when one is outside. The one check behind the server's, `generate`'s, the
    runners' and the sampler's vocabulary errors."""
    if len(ids) == 0 or (0 <= min(ids) and max(ids) < vocab):
        return None
    return next(t for t in ids if not 0 <= t < vocab)


def _checked_ids(ids, vocab: int, what: str) -> list[int]:
    ids = [int(t) for t in ids]
    bad = first_outside_vocab(ids, vocab)
    if bad is not None:
        raise ValueError(f"{what} token id {bad} is outside the vocabulary [0, {vocab})")
    return ids


def _bias_tensors(logit_bias, vocab: int, device):
    ids = _checked_ids([t for t, _ in logit_bias], vocab, "logit_bias:")
    return (_to_device(ids, torch.long, device),
            _to_device([b for _, b in logit_bias], torch.float32, device))


def _allowed_tensor(allowed, vocab: int, device) -> torch.Tensor:
    return _to_device(_checked_ids(allowed, vocab, "allowed_token_ids:"), torch.long, device)


def _split_bad_words(words, vocab: int, device):
    """(int64 [n] ids of the one-token bad words on the device, or None; the bad words
    of two or more tokens by their last-but-one id, {id: [word ids, ...]}: a word can
    match only when the output ends with that id, so a step looks at those alone)."""
    _checked_ids([t for ids in words for t in ids], vocab, "bad_words:")
    single = sorted({ids[0] for ids in words if len(ids) == 1})
    longer: dict[int, list[tuple[int, ...]]] = {}
    for ids in words:
        if len(ids) > 1:
            longer.setdefault(ids[-2], []).append(ids)
    return _to_device(single, torch.long, device) if single else None, longer


def bad_word_bans(words, output_ids: list[int]) -> list[int]:
    """vLLM v1's `apply_bad_words` for one row: the last id of each bad word (a tuple
    of ids) whose other ids the output ends with (every one-token word's). Host work
    only: O(total length of the words) per call."""
    n = len(output_ids)
    bans = []
    for ids in words:
        k = len(ids) - 1
        if k <= n and (k == 0 or tuple(output_ids[n - k:]) == ids[:-1]):
            bans.append(ids[-1])
    return bans


def _to_device(values, dtype, device) -> torch.Tensor:
    """A small host list on `device`: from pinned memory, asynchronously, on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's `apply_penalties` (the OpenAI definition for presence and frequency, the
    CTRL paper's repetition penalty), out of place.

    Args:
        logits: fp32 [R, V]. prompt_mask: bool [R, V], the tokens of each row's prompt.
        output_counts: fp32 [R, V], each token's count in the row's generated tokens.
        presence, frequency, repetition: fp32 [R], each row's penalties.

    Returns: fp32 [R, V]: for the tokens of prompt or output, logits > 0 divided by the
    repetition penalty and the others multiplied by it; then minus frequency * count,
    minus presence for the tokens the output holds.
    """
    in_output = output_counts > 0
    rep = repetition[:, None]
    x = torch.where(prompt_mask | in_output, torch.where(logits > 0, logits / rep, logits * rep), logits)
    x = x - frequency[:, None] * output_counts
    return x - presence[:, None] * in_output


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams],
                  history: list[TokenHistory | None] | None) -> torch.Tensor:
    """The logits `sample` draws from for rows with structured outputs,
    allowed_token_ids, bad words, min_tokens, logit_bias or penalties, in vLLM v1's
    order: the grammar's mask (every token the row's `TokenHistory.grammar` does not allow
    next to -inf; two or more such rows have their masks made together,
    `flintc.structured.allowed_batch`: one host buffer, filled row by row in this thread),
    allowed_token_ids (every other token to -inf), bad words (`bad_word_bans` to -inf),
    min_tokens (the row's stop ids to -inf while its output is shorter), logit_bias (added), then
    `apply_penalties` (one batched call over the rows with penalties). Rows without any
    are left as they are. -> fp32 [B, V], a new tensor.

    Raises:
        ValueError: a row with penalties, min_tokens or bad words of two or more tokens
            and no history, or structured outputs and no history grammar; bad_words
            without their token ids (`with_tokenizer` not called); an id outside the
            vocabulary.
        flintc.structured.StructuredOutputError: a grammar refused a token appended
            since the last call.
    """
    x = logits.float()
    if x is logits:
        x = x.clone()
    B, V = x.shape
    dev = x.device

    def hist(b: int, why: str) -> TokenHistory:
        h = history[b] if history is not None else None
        if h is None:
            raise ValueError(f"sample(): row {b} has {why}, which needs its TokenHistory (history=...)")
        return h

    ninf = float("-inf")
    grammars: list = [None] * B
    for b, p in enumerate(params):
        if p.structured_outputs is not None:
            g = history[b].grammar if history is not None and history[b] is not None else None
            if g is None:
                raise ValueError(f"sample(): row {b} has structured_outputs, which needs its TokenHistory with "
                                 f"a grammar (TokenHistory(..., grammar=flintc.structured.GrammarMatcher(...)))")
            g.advance(history[b].output_ids)
            grammars[b] = g
    constrained = [b for b in range(B) if grammars[b] is not None]
    if len(constrained) == 1:
        b = constrained[0]
        mask = grammars[b].allowed(V, dev)  # None inside a thinking block the grammar waits behind
        if mask is not None:
            x[b].masked_fill_(~mask, ninf)
    elif constrained:  # every row's mask in one host buffer, one copy, one fill
        from flintc.structured import allowed_batch

        masks = allowed_batch(grammars, V, dev)  # every token for the other rows
        if masks is not None:
            x.masked_fill_(~masks, ninf)
    for b, p in enumerate(params):
        if p.allowed_token_ids is not None:
            h = history[b] if history is not None else None
            ids = h.allowed(p, V, dev) if h is not None else _allowed_tensor(p.allowed_token_ids, V, dev)
            kept = x[b].index_select(0, ids)
            x[b].fill_(ninf)
            x[b].index_copy_(0, ids, kept)
        if p.bad_words is not None or p.bad_words_token_ids is not None:
            _mask_bad_words(x[b], p, history[b] if history is not None else None, b)
        if p.min_tokens > 0:
            h = hist(b, "min_tokens")
            if len(h.output_ids) < p.min_tokens:
                stops = h.stop_ids(V, dev)
                if stops is not None:
                    x[b].index_fill_(0, stops, float("-inf"))
        if p.logit_bias is not None:
            h = history[b] if history is not None else None
            ids, vals = h.bias(p, V, dev) if h is not None else _bias_tensors(p.logit_bias, V, dev)
            x[b].index_add_(0, ids, vals)
    rows = [b for b, p in enumerate(params) if p.has_penalties]
    if rows:
        hs = [hist(b, "penalties") for b in rows]
        pen = _to_device([[params[b].presence_penalty, params[b].frequency_penalty, params[b].repetition_penalty]
                          for b in rows], torch.float32, dev)
        out = apply_penalties(_rows(x, rows), torch.stack([h.prompt_mask(V, dev) for h in hs]),
                              torch.stack([h.output_counts(V, dev) for h in hs]), pen[:, 0], pen[:, 1], pen[:, 2])
        if len(rows) == B:
            return out
        for j, b in enumerate(rows):
            x[b].copy_(out[j])
    return x


def _mask_bad_words(row: torch.Tensor, p: SamplingParams, h: TokenHistory | None, b: int) -> None:
    """-inf in `row` (fp32 [V], in place) for the bad-word tokens that the row's output
    so far calls for (`bad_word_bans`)."""
    if p.bad_words_token_ids is None:
        raise ValueError(f"sample(): row {b} has bad_words without bad_words_token_ids: "
                         f"SamplingParams.with_tokenizer(tokenizer) makes them")
    V = row.shape[0]
    single, longer = h.bad_words(p, V, row.device) if h is not None \
        else _split_bad_words(p.bad_words_token_ids, V, row.device)
    ninf = float("-inf")
    if single is not None:
        row.index_fill_(0, single, ninf)
    if not longer:
        return
    if h is None:
        raise ValueError(f"sample(): row {b} has bad words of several tokens, which need its TokenHistory "
                         f"(history=...)")
    out = h.output_ids
    bans = sorted(set(bad_word_bans(longer.get(out[-1], ()), out))) if out else []
    if len(bans) <= 4:  # a few in-place fills: no host-to-device copy
        for t in bans:
            row[t:t + 1].fill_(ninf)
    elif bans:
        row.index_fill_(0, _to_device(bans, torch.long, row.device), ninf)
