"""The OpenAI-compatible HTTP front end of `flintc serve` (FastAPI on uvicorn).

Routes: ``GET /health``, ``GET /version`` and ``GET /metrics`` (no API key needed),
``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (these two stream server-sent events, ``data: {json}``
lines ending with ``data: [DONE]``, when ``stream`` is true), and vLLM's
``POST /tokenize`` and ``POST /detokenize``. Every error is answered in the OpenAI
format (``{"error": {"message", "type", "param", "code"}}``) with a 4xx/5xx status,
and the server keeps serving. ``/metrics`` is vLLM's Prometheus metrics
(:mod:`flintc.serve.metrics`).

Each request is tokenized here (chat: the tokenizer folder's Jinja chat template,
rendered as Hugging Face does, tools included), on a worker thread so that a huge
prompt does not stall the event loop and every other client, checked against
``--max-model-len``, and handed to the :class:`~flintc.serve.engine.Engine` as one
:class:`~flintc.serve.engine.GenRequest` per choice (``n``). Engine outputs come back
through an asyncio queue; for chat they go through the reasoning parser
(:mod:`flintc.serve.reasoning`) and, when tools are in play, the tool-call parser
(:mod:`flintc.serve.tool_calls`, tool_choice "auto"), or, for tool_choice "required"
or a named function, the forced calls' reader (:mod:`flintc.serve.tool_choice`: the
reply is constrained to a JSON schema of the tools, as vLLM's). A client that
disconnects (streaming or not) has its requests aborted, which frees their engine
slots. When the server shuts down
(``app.state.abort_in_flight``, called by :func:`flintc.serve.server.uvicorn_server`),
the requests in flight are aborted and answered with a 503 (a stream: an error event,
then ``[DONE]``). An error in the middle of a stream (the 200 sent: an exception while
streaming, logged; a request the engine fails, its runner's error say) is one error event
``data: {"error": {...}}``, then ``data: [DONE]``, as vLLM's; a client that left gets nothing.

Sampling defaults are FLINT_SPEC section 6 (temperature 1.0, top-p 0.95, top-k
20); vLLM's ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``,
``min_p``, ``min_tokens``, ``logit_bias`` (ids in the vocabulary, biases clamped
to [-100, 100] as vLLM does), ``allowed_token_ids`` (not empty, ids in the vocabulary)
and ``bad_words`` (made into token ids here, once per request, as vLLM's
``update_from_tokenizer``) are honoured (:mod:`flintc.sampling`), and so are structured
outputs (``response_format``, ``structured_outputs``, ``guided_*``:
:func:`~flintc.serve.protocol.structured_outputs_spec`; the grammar is compiled for the
tokenizer here, on a worker thread, once per request: :mod:`flintc.structured`). ``n`` > 1
with a ``seed`` gives choice i the seed ``seed + i`` (otherwise every choice would
be the same); a seed may be any 64-bit integer, as in vLLM: -1 means no seed (vLLM's
reading), another negative one is taken modulo 2**63. ``max_tokens`` (or ``max_completion_tokens``) counts every generated
token, reasoning included. As in vLLM, chat with both absent or null may use the rest
of the context (--max-model-len minus the prompt's tokens); completions without the
field get 16 tokens (the OpenAI default), and with ``"max_tokens": null`` each prompt
the rest of its own context (its choices' SamplingParams carry that prompt's count).
A prompt that leaves no room for one token is then a 400 naming the prompt's field
(``context_length_exceeded``), and so is a prompt + max_tokens over --max-model-len
(naming the max_tokens field). vLLM's ``prompt_logprobs`` (0..20, not with
``stream``) adds each prompt token's log-probability, rank and most likely alternatives
in vLLM's shape (`_prompt_logprobs_json`): per choice in /v1/completions, once per
response in /v1/chat/completions. vLLM's ``return_tokens_as_token_ids`` writes the
tokens of ``logprobs`` (top ones included) as ``"token_id:{id}"``; ``prompt_logprobs``
keep their ``decoded_token`` text (they are keyed by id already), as in vLLM.

vLLM's ``priority`` goes to the engine (admission order with ``--scheduling-policy
priority``); under "fcfs" a non-zero one is a 400 with vLLM's message ("Got priority 1
but Priority scheduling is not enabled."). Chat's ``echo`` and ``include_reasoning`` are
vLLM's (`vllm/entrypoints/openai/serving_chat.py`): echo puts the last message's content
before each choice's reply when its role is the reply's (`_chat_echo`); include_reasoning
false, with a reasoning parser, leaves the reasoning, the logprobs and the token ids out
of the reply (no chunk for a step that adds only reasoning) and lets a structured-outputs
constraint hold from the first token.

The chat template is compiled when the app is made (`FlintTokenizer.check_chat_template`):
a malformed one stops the server at startup instead of failing every chat request.
A tokenizer with no chat template still serves /v1/completions; chat requests then
get a 400.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import email.message
import hmac
import json
import logging
import math
import time
import uuid
import weakref
from dataclasses import dataclass

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import flintc
from flintc.checkpoint.tokenizer import model_stop_token_ids
from flintc.errors import InputError, json_type
from flintc.sampling import SamplingParams, bad_words_to_token_ids, first_outside_vocab, min_tokens_over_context
from flintc.serve.engine import Engine, GenRequest, Output, PromptLogprob, TokenLogprob, priority_not_enabled
from flintc.serve.metrics import ServeMetrics
from flintc.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    structured_outputs_spec,
    unsupported,
)
from flintc.serve.reasoning import THINK_END, THINK_START, ReasoningParser, initial_state_for_prompt
from flintc.serve.server import MAX_REQUEST_BYTES
from flintc.structured import ReasoningGate, compiled_matcher
from flintc.serve.tool_calls import ToolCallParser
from flintc.serve.tool_choice import NAMED, REQUIRED, ForcedToolCalls, resolve_tool_choice, tool_choice_spec

_log = logging.getLogger(__name__)

TOOL_CALL_PARSERS = ("glm47",)
REASONING_PARSERS = ("glm47",)
MAX_N = 16
MAX_TOP_LOGPROBS = 20  # chat (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 20  # completions: vLLM's default --max-logprobs (OpenAI's API allows 5)
MAX_PROMPT_LOGPROBS = 20  # vLLM's default --max-logprobs
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_p", "min_tokens")
# the request fields that set (or shape) a structured-outputs constraint (`structured_outputs_spec`)
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern")


def structured_param(req) -> str | None:
    """The request field that set its structured-outputs constraint (a 400's ``param``
    when the constraint could not be followed), None without one."""
    for f in _STRUCTURED_FIELDS[:7]:
        v = getattr(req, f, None)
        if v is not None and not (f == "response_format" and isinstance(v, dict) and v.get("type") == "text"):
            return f
    return None
_TEMPLATE_RESERVED = {"messages", "tools", "documents", "add_generation_prompt", "tokenize"}


@dataclass
class ServeOptions:
    """Server settings (the `flintc serve` flags).

    model_name: the id served by /v1/models; requests naming another model get 404.
    api_key: when set, /v1/*, /tokenize and /detokenize need ``Authorization: Bearer
        <api_key>`` (401 otherwise).
    enable_auto_tool_choice / tool_call_parser: parse tool calls for tool_choice "auto".
    reasoning_parser: split ``<think>`` text into reasoning_content.
    exclude_tools_when_tool_choice_none: leave tool definitions out of the prompt when
        tool_choice is "none".
    max_request_bytes: the largest request body read (a 413 beyond it); 0: no cap.
    return_tokens_as_token_ids: logprobs' tokens as "token_id:{id}" for the requests that
        leave vLLM's field of that name out (vLLM's `--return-tokens-as-token-ids`).
    enable_prompt_tokens_details: the final usage object gains ``prompt_tokens_details:
        {"cached_tokens": N}``, the prompt tokens whose prefill prefix caching skipped
        (summed over the prompts; one choice per prompt), when N > 0 (vLLM's
        `--enable-prompt-tokens-details`, which leaves it out at 0 too).
    """

    model_name: str
    api_key: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    max_request_bytes: int = MAX_REQUEST_BYTES
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.max_request_bytes < 0:
            raise ValueError(f"max_request_bytes must be 0 (no cap) or more, got {self.max_request_bytes}")


# --------------------------------------------------------------------------------------
# The bridge from the engine thread to one HTTP request


class _Generation:
    """The engine requests of one HTTP request (one per choice) and the asyncio queue
    their Outputs arrive on."""

    def __init__(self, engine: Engine, reqs: list[dict]):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Output] = asyncio.Queue()
        emit = lambda out: loop.call_soon_threadsafe(self.queue.put_nowait, out)
        self.engine = engine
        self.reqs = [GenRequest(emit=emit, index=i, **kw) for i, kw in enumerate(reqs)]
        self.open = set(range(len(self.reqs)))

    def prompt_tokens_details(self, options: ServeOptions, choices: int) -> dict:
        """``{"prompt_tokens_details": {"cached_tokens": N}}`` with
        ``options.enable_prompt_tokens_details`` and N > 0 (N: the prompt tokens prefix
        caching skipped, the first of each prompt's ``choices`` requests; vLLM too leaves
        the field out when N is 0), else ``{}``. Read once the requests have finished."""
        if not options.enable_prompt_tokens_details:
            return {}
        cached = sum(r.timeline.cached_tokens for r in self.reqs[::choices])
        return {"prompt_tokens_details": {"cached_tokens": cached}} if cached else {}

    def start(self) -> None:
        for r in self.reqs:
            self.engine.submit(r)

    def abort(self) -> None:
        for i in self.open:
            self.engine.abort(self.reqs[i])

    async def outputs(self):
        """Yield Outputs until every choice has finished."""
        while self.open:
            out = await self.queue.get()
            if out.finished:
                self.open.discard(out.index)
            yield out


async def _abort_on_disconnect(request: Request, gen: _Generation) -> None:
    """For non-streamed requests: wait for the client to go away, then abort."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gen.abort()
            return


# --------------------------------------------------------------------------------------
# Per-choice chat state: parsers and accumulated results


class _SpecialStripper:
    """Removes the tokenizer's special-token strings from streamed text (chat with
    ``skip_special_tokens``: the parsers read the text with them, the client gets it
    without). A suffix that may be the start of one is held until the next chunk, so
    the pieces join to what one call on the whole text gives."""

    def __init__(self, specials: tuple[list[str], set[str], list[int]]):
        self.sorted, self.set, self.lengths = specials
        self.held = ""

    def _could_start(self, frag: str) -> bool:
        i = bisect.bisect_left(self.sorted, frag)
        return i < len(self.sorted) and self.sorted[i].startswith(frag)

    def feed(self, text: str, final: bool = False) -> str:
        buf, self.held = self.held + text, ""
        out, i = [], 0
        while i < len(buf):
            hit = next((buf[i:i + n] for n in self.lengths if buf[i:i + n] in self.set), "")
            if hit:
                i += len(hit)
                continue
            if not final and len(buf) - i < self.lengths[0] and self._could_start(buf[i:]):  # a partial special
                self.held = buf[i:]
                break
            out.append(buf[i])
            i += 1
        return "".join(out)

    def finish(self) -> str:
        return self.feed("", final=True)


def _special_strings(tokenizer) -> tuple[list[str], set[str], list[int]]:
    """The special tokens' texts (sorted, as a set, and their lengths, longest first)."""
    texts = {tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in tokenizer.all_special_ids}
    texts.discard("")
    return sorted(texts), texts, sorted({len(t) for t in texts}, reverse=True)


class _ChatChoice:
    """One choice of a chat reply: the reasoning parser, then the tool-call parser
    (tool_choice "auto") or the forced calls' reader (`ForcedToolCalls`: tool_choice
    "required" or a named function, ``forced``), then the special-token stripper.
    ``one_call`` (the request's ``parallel_tool_calls`` false): the message keeps its
    first tool call only, and a stream sends only the deltas of the call of index 0
    (vLLM's `maybe_filter_parallel_tool_calls`; the generation is not constrained).
    ``include_reasoning`` false (vLLM's request field): the reasoning is parsed out of
    the content as ever, and left out of the deltas and the message."""

    def __init__(self, tokenizer, reasoning_initial: str | None, tools: list[dict] | None,
                 specials: tuple[list[str], set[str], list[int]] | None = None,
                 forced: ForcedToolCalls | None = None, one_call: bool = False,
                 include_reasoning: bool = True):
        self.tokenizer = tokenizer
        self.one_call = one_call
        self.include_reasoning = include_reasoning
        self.reasoning = ReasoningParser(reasoning_initial) if reasoning_initial else None
        self.tools = ToolCallParser(tools) if tools is not None else None
        self.forced = forced
        # skip_special_tokens: strip them from reasoning and content after parsing
        self.strip = (_SpecialStripper(specials), _SpecialStripper(specials)) if specials else None
        self.reasoning_text: list[str] = []
        self.content_text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[PromptLogprob | None] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it

    def feed(self, out: Output) -> dict:
        """Process one Output. -> the OpenAI delta it makes (may be empty)."""
        r, c = self.reasoning.feed(out.text) if self.reasoning else ("", out.text)
        if out.finished and self.reasoning:
            r2, c2 = self.reasoning.finish()
            r, c = r + r2, c + c2
        calls = []
        if self.tools is not None:
            c, calls = self.tools.feed(c)
            if out.finished:
                c2, _ = self.tools.finish()
                c += c2
        if self.strip is not None:
            r, c = self.strip[0].feed(r), self.strip[1].feed(c)
            if out.finished:
                r, c = r + self.strip[0].finish(), c + self.strip[1].finish()
        forced_calls = []
        if self.forced is not None:  # the content is the calls' JSON
            forced_calls = self.forced.feed(c)
            c = self.forced.finish() if out.finished else ""
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.reasoning_text.append(r)
        self.content_text.append(c)
        if out.finished:
            reason = out.finish_reason
            if reason == "stop" and self.tools is not None and self.tools.calls:
                reason = "tool_calls"
            # vLLM and OpenAI: "tool_calls" for "required", the generation's reason for a named function
            if reason == "stop" and self.forced is not None and self.forced.mode == REQUIRED \
                    and self.forced.complete:
                reason = "tool_calls"
            self.finish_reason = reason
            self.stop_reason = out.stop_reason
        delta = {}
        if r and self.include_reasoning:
            delta["reasoning_content"] = r
        if c:
            delta["content"] = c
        if calls:
            first = len(self.tools.calls) - len(calls)
            delta["tool_calls"] = [tc.to_openai(first + k) for k, tc in enumerate(calls)]
        if forced_calls:
            delta["tool_calls"] = forced_calls
        if self.one_call and "tool_calls" in delta:
            delta["tool_calls"] = [tc for tc in delta["tool_calls"] if tc["index"] == 0]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        return delta

    def empty_delta(self) -> dict:
        """The delta of a step whose tokens added no text: ``{"reasoning_content": ""}``
        inside a thinking block, else ``{"content": ""}`` (what vLLM sends for such a step:
        its glm45 reasoning parser's ``DeltaMessage(reasoning_content=delta_text)`` or
        ``DeltaMessage(content=delta_text)`` with an empty ``delta_text``)."""
        if self.reasoning is not None and self.reasoning.state == "reasoning":
            return {"reasoning_content": ""}
        if self.forced is not None:  # (the content is tool calls: an empty delta)
            return {}
        return {"content": ""}

    def message(self) -> dict:
        content = "".join(self.content_text)
        calls = self.tools.calls if self.tools is not None else []
        if self.forced is not None:
            calls = self.forced.calls
        saw_reasoning = self.reasoning is not None and self.reasoning.saw_reasoning
        msg = {"role": "assistant",
               "content": content if content or not (calls or saw_reasoning) else None,
               "reasoning_content": ("".join(self.reasoning_text) if saw_reasoning and self.include_reasoning
                                     else None)}
        if self.one_call:
            calls = calls[:1]
        msg["tool_calls"] = [tc.to_openai() for tc in calls] or None
        return msg


LOGPROB_FLOOR = -9999.0  # vLLM's JSON value for a logprob of -inf


def _json_logprob(value: float, floor_all: bool = True) -> float | None:
    """A log-probability as vLLM writes it in JSON, never -Infinity or NaN (invalid JSON:
    Starlette refuses it with a 500, ``json.dumps`` writes it into a stream as is).

    Args:
        value: a log-probability (a Python float; -inf for a token the model rules out).
        floor_all: True (generated tokens' logprobs, vLLM's ``max(logprob, -9999.0)`` in
            serving_chat.py / serving_completion.py): every value below -9999.0 becomes
            -9999.0. False (``prompt_logprobs``, vLLM's ``clamp_prompt_logprobs``): only
            -inf does.

    Returns:
        the value, floored as above; None (JSON null, as pydantic writes a NaN in vLLM's
        responses) for NaN or +inf, which only logits holding NaN or inf can give.
    """
    if math.isnan(value) or value == math.inf:
        return None
    if floor_all or value == -math.inf:
        return max(value, LOGPROB_FLOOR)
    return value


def _token_str(tokenizer, token_id: int, as_id: bool = False) -> tuple[str, list[int]]:
    """(the token's text, its raw bytes); with ``as_id`` (vLLM's
    ``return_tokens_as_token_ids``) the text is ``"token_id:{id}"``, the bytes still the
    token's own."""
    raw = tokenizer.token_bytes(token_id)
    return (f"token_id:{token_id}" if as_id else raw.decode("utf-8", errors="replace")), list(raw)


def _chat_logprobs(tokenizer, lps: list[TokenLogprob], as_ids: bool = False) -> dict:
    """OpenAI's chat logprobs (``{"content": [...]}``); each logprob floored at -9999.0
    (`_json_logprob`). ``as_ids`` (vLLM's ``return_tokens_as_token_ids``): every
    ``token`` is ``"token_id:{id}"``; as in vLLM, the chosen token's ``bytes`` stay its
    text's and a top_logprobs entry's are those of the ``"token_id:{id}"`` string."""
    def entry(tid, lp, top: bool):
        text, raw = _token_str(tokenizer, tid, as_ids)
        return {"token": text, "logprob": _json_logprob(lp),
                "bytes": list(text.encode("utf-8")) if as_ids and top else raw}

    return {"content": [{**entry(t.token_id, t.logprob, False),
                         "top_logprobs": [entry(i, v, True) for i, v in t.top]} for t in lps]}


def _completion_logprobs(tokenizer, lps: list[TokenLogprob], offset: int, as_ids: bool = False) -> dict:
    """OpenAI's completions logprobs. Each ``top_logprobs`` entry holds the sampled token
    first, then the top alternatives (as OpenAI and vLLM: up to logprobs + 1 items, the
    sampled token alone for ``logprobs: 0``). Each logprob is floored at -9999.0
    (`_json_logprob`, as vLLM). ``as_ids`` (vLLM's ``return_tokens_as_token_ids``): the
    tokens and the top_logprobs keys are ``"token_id:{id}"``, and ``text_offset``
    advances by those strings' lengths, as vLLM's does. An item of ``lps`` may be a bare
    token id (the first token of a prompt echoed with ``echo``): its logprob and
    top_logprobs are null, as in vLLM.

    ``text_offset``: `offset` for the first token, then each token's offset is the one
    before plus the length of the token before (its string in ``tokens``), as vLLM's
    unstreamed completions. A stream passes, for each chunk, the offset after the
    tokens of the chunks before it (not the length of the text they carried), so it
    gives the offsets the same request gets unstreamed: a token whose text was held
    back (half a UTF-8 character, sent with the next chunk's text) still advances the
    offset of the next one. (vLLM's stream starts each chunk at the length of the text
    sent so far, so there the token after a held-back one gets the held-back one's
    offset.)"""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t in lps:
        if isinstance(t, int):  # an echoed prompt's first token: no logprob (vLLM: null, null)
            text, _ = _token_str(tokenizer, t, as_ids)
            tokens.append(text)
            token_lps.append(None)
            tops.append(None)
            offsets.append(offset)
            offset += len(text)
            continue
        text, _ = _token_str(tokenizer, t.token_id, as_ids)
        tokens.append(text)
        token_lps.append(_json_logprob(t.logprob))
        top = {text: token_lps[-1]}
        for i, v in t.top:
            top.setdefault(_token_str(tokenizer, i, as_ids)[0], _json_logprob(v))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _echo_logprobs(prompt_ids: list[int], plps: list[PromptLogprob | None] | None, k: int) -> list:
    """The logprobs entries of an echoed prompt (completions' ``echo`` with ``logprobs``
    k, as vLLM's): its first token as a bare id (no logprob), then each prompt token's
    PromptLogprob as a TokenLogprob with its k most likely alternatives."""
    plps = plps or [None] * len(prompt_ids)
    return [tid if p is None else TokenLogprob(p.token_id, p.logprob, p.top[:k])
            for tid, p in zip(prompt_ids, plps)]


def _prompt_logprobs_json(tokenizer, plps: list[PromptLogprob | None], k: int | None = None) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: one item per prompt token, None for the first, else
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt token
    first, then the k most likely tokens (rank 1..k; a prompt token among them is listed
    once, with its place's rank, as vLLM's dict keeps it), so k or k + 1 entries.
    ``decoded_token`` is the token's text alone (vLLM's ``tokenizer.decode([id])``); a
    logprob of -inf is -9999.0 (vLLM's ``clamp_prompt_logprobs``), NaN null."""
    out: list[dict | None] = []
    for p in plps:
        if p is None:
            out.append(None)
            continue
        entry = {}
        top = p.top if k is None else p.top[:k]
        for tid, lp, rank in [(p.token_id, p.logprob, p.rank)] + [(i, v, r + 1) for r, (i, v) in enumerate(top)]:
            entry[str(tid)] = {"logprob": _json_logprob(lp, floor_all=False), "rank": rank,
                               "decoded_token": _token_str(tokenizer, tid)[0]}
        out.append(entry)
    return out


def _prompt_logprobs_asked(req) -> int | None:
    """The request's ``prompt_logprobs`` for the engine: None when absent, or when
    ``stream`` is on with 0 (vLLM accepts it there and a stream carries none). Raises
    APIError(400): outside [0, MAX_PROMPT_LOGPROBS] (vLLM's -1, the whole vocabulary, is
    over its default --max-logprobs 20 too), or above 0 with ``stream`` (vLLM's
    "`prompt_logprobs` are not available when `stream=True`")."""
    k = req.prompt_logprobs
    if k is None:
        return None
    if not 0 <= k <= MAX_PROMPT_LOGPROBS:
        raise APIError(400, f"'prompt_logprobs' must be in [0, {MAX_PROMPT_LOGPROBS}] (vLLM's default "
                       f"--max-logprobs; -1, the whole vocabulary, is over it), got {k}", param="prompt_logprobs")
    if req.stream:
        if k > 0:
            raise APIError(400, "'prompt_logprobs' are not available when 'stream' is true (as in vLLM); "
                           "ask without stream", param="prompt_logprobs")
        return None
    return k


def _usage_flags(req) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a streamed request, as vLLM reads
    ``stream_options``: the usage chunk at the end, and a usage object (the counts so
    far) on every chunk, which needs include_usage too."""
    so = req.stream_options
    include = bool(so and so.include_usage)
    return include, include and bool(so.continuous_usage_stats)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream_error_body(exc: Exception) -> dict:
    """The error event of an exception raised inside a stream: the body the route's
    exception handlers give it unstreamed (an APIError's own, an InputError a 400's, any
    other the 500's ``internal error: TYPE: MESSAGE``, ``server_error``)."""
    if isinstance(exc, APIError):
        return exc.body()
    if isinstance(exc, InputError):
        return error_body(str(exc))
    return error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error")


# --------------------------------------------------------------------------------------
# The app


def _tokens_as_ids(req, options: ServeOptions) -> bool:
    """vLLM's choice: the request's ``return_tokens_as_token_ids``, or the server's
    default (`--return-tokens-as-token-ids`) when the request leaves it out."""
    field = req.return_tokens_as_token_ids
    return options.return_tokens_as_token_ids if field is None else bool(field)


def create_app(engine: Engine, tokenizer, options: ServeOptions) -> FastAPI:
    """Build the FastAPI app over a (started or not) engine. The app's lifespan starts
    the engine and shuts it down when the server stops. The app's metrics
    (``app.state.metrics``, a :class:`~flintc.serve.metrics.ServeMetrics` with its own
    registry) observe the engine from here on.

    Raises:
        CheckpointError: the tokenizer's chat template is malformed
            (`FlintTokenizer.check_chat_template`).
    """
    has_chat_template = tokenizer.check_chat_template()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="flintc serve", lifespan=lifespan)
    app.state.engine = engine
    app.state.options = options
    app.state.metrics = metrics = ServeMetrics(engine, options.model_name)
    max_model_len = engine.max_model_len
    # every request's stop tokens but its own stop_token_ids (chat and completions alike, as
    # vLLM's update_from_generation_config): the end-of-text token and the generation config's
    # other end ids (<|user|>, <|observation|>), which end a sequence unless ignore_eos
    # (`flintc.stop_strings.stop_token_end`) and are masked before min_tokens either way
    model_stops = frozenset(model_stop_token_ids(tokenizer))
    specials = _special_strings(tokenizer)
    if not specials[1]:
        specials = None

    # ---- errors ----------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(InputError)  # bad input that a check below the handlers found (a 500 before)
    async def _input_error(request, exc: InputError):
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        return JSONResponse(error_body(f"invalid request: {exc.errors()}"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _server_error(request, exc):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    def check_auth(request: Request) -> None:
        if options.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise APIError(401, "invalid API key: pass it as 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != options.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           f"'{options.model_name}'", "not_found_error", "model", "model_not_found")

    async def read_body(request: Request) -> bytes:
        """The request body, refused with a 413 when it is over --max-request-bytes: by
        its Content-Length before any of it is read, else (chunked) once the bytes read
        pass the cap. Parsing a body of 5M token ids held the event loop for seconds."""
        limit = options.max_request_bytes
        if not limit:
            return await request.body()

        def too_large(size: str) -> APIError:
            return APIError(413, f"the request body is over the limit of {limit} bytes (--max-request-bytes){size}",
                            code="request_too_large")

        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large(f": Content-Length {int(length)}")
        chunks, size = [], 0
        async with contextlib.aclosing(request.stream()) as stream:
            async for chunk in stream:
                size += len(chunk)
                if size > limit:
                    raise too_large("")
                chunks.append(chunk)
        return b"".join(chunks)

    async def parse(request: Request, cls):
        """The body as request model ``cls``, or as the one ``cls(data)`` picks by the
        parsed JSON when it is not a class. Raises APIError(400), also for a Content-Type
        other than JSON (`json_content_type`)."""
        json_content_type(request.headers.get("content-type"))
        body = await read_body(request)
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON in the request body: {exc}", code="invalid_json") from None
        except RecursionError:  # arrays / objects nested past Python's recursion limit
            raise APIError(400, "malformed JSON in the request body: nested too deeply",
                           code="invalid_json") from None
        encoding = json.detect_encoding(body)
        if encoding != "utf-8":  # a UTF-8 BOM, UTF-16 or UTF-32 (RFC 8259 8.1), which json.loads and
            # so vLLM's FastAPI take; pydantic reads UTF-8 only
            body = body.decode(encoding).encode("utf-8")
        if not isinstance(cls, type):
            cls = cls(data)
        try:
            return cls.model_validate_json(body)
        except ValidationError as exc:
            e = exc.errors()[0]
            if e["type"] == "json_invalid":  # JSON that json.loads takes and pydantic not: a lone surrogate
                where = _lone_surrogate(data)
                if where is not None:
                    where = where.encode("utf-8", "backslashreplace").decode()  # a key may hold it
                    raise APIError(400, f"malformed JSON in the request body: the string at '{where}' holds an "
                                   f"invalid Unicode escape, a lone UTF-16 surrogate (\\ud800-\\udfff not "
                                   f"in a high-low pair)", param=where, code="invalid_json") from None
                why = (e.get("ctx") or {}).get("error", e["msg"])
                raise APIError(400, f"malformed JSON in the request body: {why}", code="invalid_json") from None
            if e["loc"][:1] == ("prompt",):  # an Int's range error, not the union's first member's type error
                e = next((x for x in exc.errors() if x["type"] == "int_range"), e)
            loc = e["loc"]
            if cls is CompletionRequest and loc[:1] == ("prompt",) and e["type"] not in ("missing", "int_range"):
                # pydantic names the last union member tried ('prompt.str')
                raise APIError(400, "'prompt' must be a string, a list of strings, a list of token ids "
                               "(integers) or a list of such lists", param="prompt") from None
            if loc[:1] == ("stop_token_ids",) and e["type"] != "extra_forbidden":  # as its range errors
                where = "stop_token_ids" + "".join(f"[{p}]" for p in loc[1:])
                raise APIError(400, f"invalid value for '{where}': {e['msg']}", param="stop_token_ids") from None
            where = _json_path(data, loc, missing=e["type"] == "missing")
            msg = ("Unrecognized request argument supplied: " + where if e["type"] == "extra_forbidden"
                   else f"invalid value for '{where}': {e['msg']}")
            raise APIError(400, msg, param=where) from None

    def logit_bias(req) -> dict[int, float] | None:
        """``logit_bias`` with integer ids (each in the vocabulary) and, as vLLM, each bias
        clamped to [-100, 100]. Raises APIError(400) naming the field."""
        if not req.logit_bias:
            return None
        out = {}
        for key, bias in req.logit_bias.items():
            try:
                tok = int(key)
            except ValueError:
                raise APIError(400, f"'logit_bias': the key {key!r} is not a token id (an integer)",
                               param="logit_bias") from None
            if not 0 <= tok < tokenizer.id_limit:
                raise APIError(400, f"'logit_bias': token id {tok} is outside the vocabulary "
                               f"[0, {tokenizer.id_limit})", param="logit_bias")
            if not math.isfinite(bias):
                raise APIError(400, f"'logit_bias': the bias of token {tok} must be a finite number, "
                               f"got {bias!r}", param="logit_bias")
            out[tok] = min(100.0, max(-100.0, bias))
        return out

    def allowed_token_ids(req) -> list[int] | None:
        """vLLM's ``allowed_token_ids``: not empty, each id in the vocabulary (vLLM's
        checks, 400 naming the field). -> the ids sorted, without repeats (at most the
        vocabulary: each choice's SamplingParams then normalises that, not the list
        sent, which may repeat ids a million times)."""
        ids = req.allowed_token_ids
        if ids is None:
            return None
        if not ids:
            raise APIError(400, "'allowed_token_ids' must not be empty (vLLM: \"allowed_token_ids is not None "
                           "and empty!\"); leave it out to allow every token", param="allowed_token_ids")
        bad = first_outside_vocab(ids, tokenizer.id_limit)
        if bad is not None:
            raise APIError(400, f"'allowed_token_ids' contains out-of-vocab token id {bad} (the vocabulary "
                           f"is [0, {tokenizer.id_limit}))", param="allowed_token_ids")
        return sorted(set(ids))

    def request_seed(seed) -> int | None:
        """A request's ``seed`` as SamplingParams takes it, in [0, 2**63), or None for
        random draws. vLLM takes any 64-bit integer, [-2**63, 2**63), and -1 there means
        no seed (its SamplingParams sets seed -1 to None), as clients that send it mean;
        another negative seed is taken modulo 2**63 here. `seed` is an int in that range
        (an `Int` of the request model: another is a 400 there)."""
        if seed is None or seed == -1:
            return None
        return seed % 2**63

    async def sampling(req, max_tokens: list[int], n: int, spec=None,
                       rest_of_context: bool = False) -> list[list[SamplingParams]]:
        """One SamplingParams per choice of each prompt, ``[k][j]`` for prompt k's choice
        j, with ``max_tokens[k]`` (each >= 1: `check_length`'s; a completions request's
        prompts differ with ``"max_tokens": null``, each the rest of its context).
        ``bad_words`` become token ids here (vLLM's update_from_tokenizer), once, and
        with them the choices' SamplingParams (each walks every word's ids), on a worker
        thread: a request of 200,000 words held the event loop, and every other client,
        for seconds per choice. They are built, and checked, once per choice at the
        smallest max_tokens (min_tokens over it is the 400); prompts with another
        max_tokens get copies (`SamplingParams.with_max_tokens`), not a new walk of the lists per
        prompt. Prompts of one max_tokens share their objects. Raises APIError(400)
        naming the field. ``spec``: the structured-outputs constraint (compiled already:
        a forced tool choice's, `tool_choice_spec`), instead of the request's own.
        ``rest_of_context``: the request left max_tokens null (`check_length` made each
        the rest of its prompt's context), so a min_tokens over it is limited by the
        context, as its 400 says (`min_tokens_over_context`, the Python API's wording)."""
        least = min(max_tokens)
        if rest_of_context and isinstance(req.min_tokens, int) and req.min_tokens > least:
            # (another min_tokens is SamplingParams' 400 below) the longest prompt's room
            raise APIError(400, min_tokens_over_context(req.min_tokens, max_model_len - least, max_model_len,
                                                        none="null"), param="min_tokens")
        # the fields the request sets; the others keep SamplingParams' defaults (Flint's)
        given = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
        given.update(logit_bias=logit_bias(req), allowed_token_ids=allowed_token_ids(req))
        base = request_seed(req.seed)
        if spec is None:
            spec = await structured(req)
        if spec is not None:
            given["structured_outputs"] = spec

        def make() -> list[list[SamplingParams]]:
            if req.bad_words:
                given["bad_words"] = req.bad_words
                given["bad_words_token_ids"] = bad_words_to_token_ids(req.bad_words, tokenizer)
            first = []
            for j in range(n):
                # choice j > 0 gets seed + j (wrapping within [0, 2**63))
                seed = base if base is None else (base + j) % 2**63
                first.append(SamplingParams(max_tokens=least, seed=seed, ignore_eos=req.ignore_eos, **given))
            by_value = {least: first}
            for m in max_tokens:
                if m not in by_value:
                    by_value[m] = [p.with_max_tokens(m) for p in first]
            return [by_value[m] for m in max_tokens]

        try:
            return await asyncio.to_thread(make) if req.bad_words else make()
        except InputError as exc:
            param = str(exc).split("'")[1] if "'" in str(exc) else None
            raise APIError(400, str(exc), param=param) from None

    async def structured(req):
        """The request's structured-outputs constraint (`structured_outputs_spec`), its
        grammar compiled for the tokenizer (`flintc.structured.compiled_matcher`: cached,
        so the engine's matchers of each choice are copies), on a worker thread (a large
        schema takes a while); None without one. Raises APIError(400) naming the field."""
        if not any(getattr(req, f, None) is not None for f in _STRUCTURED_FIELDS):
            return None

        def make():
            spec = structured_outputs_spec(req)
            if spec is not None:
                try:
                    compiled_matcher(spec, tokenizer)
                except InputError as exc:
                    raise APIError(400, str(exc), param=structured_param(req) or "structured_outputs") from None
            return spec

        return await asyncio.to_thread(make)

    def common_checks(req) -> tuple[int, tuple[str, ...]]:
        check_model(req.model)
        unsupported(req)
        if req.priority != 0 and engine.scheduling_policy != "priority":
            # vLLM's input processor's check and message (its --scheduling-policy fcfs)
            raise APIError(400, priority_not_enabled(req.priority), param="priority")
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"'n' must be in [1, {MAX_N}], got {n}", param="n")
        # vLLM's check (`data.get("stream_options") and not data.get("stream")`: {} passes), and message
        if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:
            raise APIError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else req.stop
        if any(not s for s in stop):  # vLLM: "stop cannot contain an empty string"
            raise APIError(400, "'stop' cannot contain an empty string", param="stop")
        return n, tuple(stop)

    def stop_token_ids(req) -> frozenset[int]:
        """vLLM's ``stop_token_ids``, each checked to be in the vocabulary (400 naming it)."""
        ids = req.stop_token_ids or []
        for k, t in enumerate(ids):
            if not 0 <= t < tokenizer.id_limit:
                raise APIError(400, f"'stop_token_ids[{k}]': token id {t} is outside the vocabulary "
                               f"[0, {tokenizer.id_limit})", param="stop_token_ids")
        return frozenset(ids)

    def response_id(request: Request, req, prefix: str) -> str:
        """vLLM's response id: ``prefix`` + the X-Request-Id header, else the request's
        ``request_id``, else a random hex id (vLLM's ``_base_request_id``)."""
        return prefix + (request.headers.get("x-request-id") or req.request_id or uuid.uuid4().hex)

    def truncate(req, ids: list[int]) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last k tokens of the prompt (-1: of
        --max-model-len). Raises APIError(400) for 0 or below -1, or over
        --max-model-len (vLLM's message)."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = max_model_len
        if k < 1:
            raise APIError(400, f"'truncate_prompt_tokens' must be at least 1 (or -1: --max-model-len), "
                           f"got {k}", param="truncate_prompt_tokens")
        if k > max_model_len:
            raise APIError(400, f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                           f"({max_model_len}). Please, select a smaller truncation size.",
                           param="truncate_prompt_tokens")
        return ids[-k:]

    def generation_prompt_flags(req) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message); both true is a 400, as in vLLM."""
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true "
                           "(set 'add_generation_prompt': false to continue the last message)",
                           param="continue_final_message")
        return req.add_generation_prompt, req.continue_final_message

    def check_length(n_prompt: int, max_tokens: int | None, param: str, prompt_param: str) -> int:
        """The max_tokens of one prompt of `n_prompt` tokens: `max_tokens` as asked, or
        for None (the field null, or chat's absent) the rest of the context,
        --max-model-len - n_prompt (vLLM's get_max_tokens). `param`: the request field
        that set max_tokens; `prompt_param`: the one holding the prompt ("messages" for
        chat, "prompt" for completions). Raises APIError(400) naming `prompt_param`
        (code context_length_exceeded) for a prompt over --max-model-len, or one that
        leaves no room for a token when `max_tokens` is None; naming `param` for a
        `max_tokens` below 1 or one that, with the prompt, passes --max-model-len."""
        if n_prompt > max_model_len:
            raise APIError(400, f"the prompt has {n_prompt} tokens, more than the maximum context "
                           f"length of {max_model_len} tokens (--max-model-len)",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = max_model_len - n_prompt
            if max_tokens < 1:
                raise APIError(400, f"the prompt has {n_prompt} tokens, which leaves no room to "
                               f"generate within the maximum context length of {max_model_len} tokens",
                               param=prompt_param, code="context_length_exceeded")
        if max_tokens < 1:
            raise APIError(400, f"'{param}' must be at least 1, got {max_tokens}", param=param)
        if n_prompt + max_tokens > max_model_len:
            raise APIError(400, f"the maximum context length is {max_model_len} tokens; the request "
                           f"asks for {n_prompt + max_tokens} ({n_prompt} in the prompt, "
                           f"{max_tokens} to generate)", param=param, code="context_length_exceeded")
        return max_tokens

    def need_chat_template() -> None:
        if not has_chat_template:
            raise APIError(400, "this model has no chat template (its tokenizer_config.json has no "
                           "chat_template and there is no chat_template.jinja beside it), so chat messages "
                           "cannot be rendered; use /v1/completions with a prompt, or serve with a template "
                           "(--chat-template FILE, or --tokenizer DIR of a tokenizer that has one)")

    async def render_chat(messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None,
                          add_generation_prompt: bool = True, add_special_tokens: bool = False,
                          continue_final_message: bool = False,
                          documents: list[dict] | None = None) -> tuple[str, list[int]]:
        """OpenAI ``messages`` and ``tools`` (checked by `_check_tools`) rendered with the
        chat template, on a worker thread (both steps scale with the request). -> (the
        text, its token ids). ``continue_final_message``: the text ends where the last
        message's content ends (transformers' rule), so the model continues it. Raises
        APIError(400): ``template_kwargs`` setting a name the renderer owns, bad messages
        (`_template_messages`), the template rejecting or failing on them, or a last
        message to continue that has no text."""
        kwargs = dict(template_kwargs or {})
        if _TEMPLATE_RESERVED & kwargs.keys():
            raise APIError(400, f"chat_template_kwargs may not set {sorted(_TEMPLATE_RESERVED & kwargs.keys())}",
                           param="chat_template_kwargs")
        messages = _template_messages(messages)
        final = None
        if continue_final_message:
            final = messages[-1].get("content")
            if isinstance(final, list):
                final = final[-1]["text"] if final else None
            if not final:
                raise APIError(400, f"'continue_final_message': the last message (messages[{len(messages) - 1}]) "
                               f"has no text to continue", param=f"messages[{len(messages) - 1}].content")

        def render() -> tuple[str, list[int]]:
            try:
                text = tokenizer.apply_chat_template(messages, tools=tools, documents=documents,
                                                     add_generation_prompt=add_generation_prompt, **kwargs)
            except jinja2.TemplateError as exc:
                raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from None
            except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as exc:
                # the template's own expression failing on these messages (`content + 1` on a
                # string): the request's 400, as vLLM answers, not a 500
                raise APIError(400, f"the chat template failed on the messages: {type(exc).__name__}: {exc}",
                               param="messages") from None
            if final is not None:  # transformers' continue_final_message
                for piece in (final, final.strip()):
                    at = text.rfind(piece)
                    if at >= 0:
                        text = text[:at + len(piece)]
                        break
                else:
                    raise APIError(400, "'continue_final_message': the chat template does not render the "
                                   "last message's content as given", param="continue_final_message")
            return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await asyncio.to_thread(render)

    def model_card() -> dict:
        return {"id": options.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "flintc", "max_model_len": max_model_len}

    # requests in flight, aborted when the server shuts down (`abort_in_flight`)
    in_flight: weakref.WeakSet[_Generation] = weakref.WeakSet()
    closing = False

    def abort_in_flight() -> None:
        """The server is shutting down (called on the event loop by
        `flintc.serve.server.uvicorn_server` before uvicorn waits for the connections):
        abort every request in flight, and refuse new ones (503)."""
        nonlocal closing
        closing = True
        for g in list(in_flight):
            g.abort()

    app.state.abort_in_flight = abort_in_flight

    def shutting_down() -> APIError:
        return APIError(503, "the server is shutting down; the request was not completed", "server_error",
                        code="server_shutting_down")

    def stream_aborted() -> str:
        """The event a stream ends with when the server aborts it (shutting down), before [DONE]."""
        e = shutting_down()
        return _sse(error_body(e.message, e.type, code=e.code))

    async def run(request: Request, gen: _Generation, on_output, stream_body, error_param=None):
        """Start ``gen``; stream (``stream_body`` is an async generator factory) or
        collect all outputs with ``on_output``, aborting if the client goes away."""
        if closing:
            raise shutting_down()
        in_flight.add(gen)
        gen.start()
        if stream_body is not None:
            async def body():
                try:
                    async for chunk in stream_body():
                        yield chunk
                except Exception as exc:
                    # the 200 and the first chunks are sent: as vLLM's stream generators
                    # (serving_chat.py, serving_completion.py), log it, answer one error event,
                    # then [DONE] (the stream was cut before, with neither). A client gone is
                    # a CancelledError or GeneratorExit here, not caught: it stops quietly
                    _log.exception("error in a streamed response (%s)", request.url.path)
                    yield _sse(_stream_error_body(exc))
                    yield "data: [DONE]\n\n"
                finally:
                    in_flight.discard(gen)
                    gen.abort()  # no-op for finished choices; frees the slot on disconnect
            return StreamingResponse(body(), media_type="text/event-stream")
        watcher = asyncio.create_task(_abort_on_disconnect(request, gen))
        aborted = False
        try:
            async for out in gen.outputs():
                if out.error is not None:
                    if out.client_error:  # the request's constraint could not be followed
                        raise APIError(400, f"generation failed: {out.error}", param=out.param or error_param)
                    raise APIError(500, f"generation failed: {out.error}", "server_error")
                if out.finish_reason == "abort":  # its results are partial (prompt_logprobs may be missing)
                    aborted = True
                    continue
                on_output(out)
        finally:
            disconnected = watcher.done() and not watcher.cancelled()
            watcher.cancel()
            in_flight.discard(gen)
            gen.abort()
        if aborted:
            # the client is gone (vLLM: "Client disconnected"), or the server is shutting
            # down: no response is built from the partial results
            if disconnected and not closing:
                raise APIError(400, "client disconnected", code="client_disconnected")
            raise shutting_down()
        return None

    # ---- routes ----------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine.fatal_error is not None:
            return JSONResponse(error_body(engine.fatal_error, "server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        """``{"version": flintc.__version__}``; needs no API key (as vLLM's)."""
        return {"version": flintc.__version__}

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        """vLLM's Prometheus metrics (:mod:`flintc.serve.metrics`), in the text format
        or, when the Accept header asks for it, OpenMetrics; needs no API key (as
        vLLM's)."""
        data, content_type = metrics.render(request.headers.get("accept"))
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model_info(request: Request, model: str):
        """The served model's object, as in /v1/models; another id is a 404
        (``model_not_found``)."""
        check_auth(request)
        check_model(model)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: ``{"prompt": str}`` or ``{"messages": [...]}`` (see
        :class:`~flintc.serve.protocol.TokenizeCompletionRequest` and
        :class:`~flintc.serve.protocol.TokenizeChatRequest`) -> ``{"count", "max_model_len",
        "tokens"}``, plus ``"token_strs"`` with ``return_token_strs``. Messages are
        rendered as /v1/chat/completions renders them, and refused as it refuses them
        (400); another model is a 404. A prompt over ``max_model_len`` is not an error
        here (as in vLLM)."""
        check_auth(request)
        req = await parse(request, lambda data: TokenizeChatRequest if isinstance(data, dict) and "messages" in data
                          else TokenizeCompletionRequest)
        check_model(req.model)
        unsupported(req)
        if isinstance(req, TokenizeChatRequest):
            need_chat_template()
            add_gen, cont = generation_prompt_flags(req)
            _, ids = await render_chat(req.messages, _check_tools(req.tools), req.chat_template_kwargs,
                                       add_gen, req.add_special_tokens, cont)
        else:
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt, req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = await asyncio.to_thread(tokenizer.convert_ids_to_tokens, ids)
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: ``{"tokens": [int, ...]}`` -> ``{"prompt": str}`` (special tokens kept;
        invalid UTF-8 becomes U+FFFD). An id outside the vocabulary is a 400 (``param``
        "tokens"); another model is a 404."""
        check_auth(request)
        req: DetokenizeRequest = await parse(request, DetokenizeRequest)
        check_model(req.model)

        def decode() -> str:  # on a worker thread: it scales with the request
            bad = [t for t in req.tokens if not 0 <= t < tokenizer.id_limit]
            if bad:
                raise APIError(400, f"'tokens': token id {bad[0]} is outside the vocabulary "
                               f"[0, {tokenizer.id_limit})", param="tokens")
            return tokenizer.decode(req.tokens)

        return {"prompt": await asyncio.to_thread(decode)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        n, stop = common_checks(req)
        need_chat_template()
        tools = _check_tools(req.tools)
        # "none", "auto", or a forced call: "required" or a named function (`flintc.serve.tool_choice`)
        choice, forced_name, tools = resolve_tool_choice(req.tool_choice, tools)
        # vLLM: an explicit "auto" needs the flags even with an empty tools list
        if choice == "auto" and (tools or req.tool_choice == "auto") and not options.enable_auto_tool_choice:
            raise APIError(400, "tool_choice \"auto\" needs the server started with "
                           "--enable-auto-tool-choice and --tool-call-parser", param="tool_choice")
        forced = choice in (REQUIRED, NAMED)
        tool_spec = None
        if forced:
            # vLLM: "You can only either use constraints for structured outputs or tools, not both."
            other = structured_param(req)
            if other is not None:
                raise APIError(400, f"You can only either use constraints for structured outputs or tools, not "
                               f"both: '{other}' with tool_choice {json.dumps(req.tool_choice)}", param=other)

            def make_tool_spec():
                spec = tool_choice_spec(req, choice, forced_name, tools)
                try:
                    compiled_matcher(spec, tokenizer)
                except InputError as exc:
                    raise APIError(400, str(exc), param="tool_choice") from None
                return spec

            tool_spec = await asyncio.to_thread(make_tool_spec)
        # the error param of a constraint that cannot be followed as it runs
        constraint_param = "tool_choice" if forced else structured_param(req)
        parse_tools = tools if (tools and choice == "auto") else None
        prompt_tools = None if (choice == "none" and options.exclude_tools_when_tool_choice_none) else tools
        add_gen, cont = generation_prompt_flags(req)
        user_stops = stop_token_ids(req)
        prompt_text, prompt_ids = await render_chat(req.messages, prompt_tools, req.chat_template_kwargs,
                                                    add_gen, req.add_special_tokens, cont, req.documents)
        prompt_ids = truncate(req, prompt_ids)
        if not prompt_ids:  # the runner's prefill refuses it, failing every running request with it
            raise APIError(400, "the chat template rendered the messages to an empty prompt", param="messages")
        # both given: max_completion_tokens (OpenAI's newer name), as vLLM's
        # `max_completion_tokens or max_tokens`; both absent or null: the rest of the
        # context (vLLM's get_max_tokens)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = check_length(len(prompt_ids), asked, "max_completion_tokens"
                                  if req.max_completion_tokens is not None else "max_tokens", "messages")
        params = (await sampling(req, [max_tokens], n, tool_spec, rest_of_context=asked is None))[0]
        top = None
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if req.logprobs:
            top = req.top_logprobs or 0
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                               param="top_logprobs")
        want_plp = _prompt_logprobs_asked(req)
        as_ids = _tokens_as_ids(req, options)
        reasoning_initial = initial_state_for_prompt(prompt_text) if options.reasoning_parser else None
        # vLLM's include_reasoning false (with a reasoning parser): no reasoning in the reply, and
        # no logprobs or token_ids, which would spell it out; a structured-outputs constraint
        # holds from the first token (vLLM passes reasoning_ended=True to its engine then)
        hide_reasoning = not req.include_reasoning and options.reasoning_parser is not None
        constrained = any(p.structured_outputs for p in params)
        gate = _reasoning_gate(tokenizer, reasoning_initial) if constrained and not hide_reasoning else None
        if constrained and hide_reasoning:
            # the grammar holds from the first token: the reply has no thinking block, all of it
            # is content (a prompt ending inside "<think>" would have the parser read the
            # constrained answer as reasoning, and leave it out)
            reasoning_initial = "content"
        echo = _chat_echo(req, add_gen) if req.echo else ""
        role = _chat_role(req, add_gen)
        # the parsers read the text with special tokens; they are stripped after parsing. With
        # tool parsing they are kept (vLLM's tool parsers turn skip_special_tokens off). Stop
        # strings are matched on the text the client gets (vLLM's, on its output text): without
        # the special tokens' strings where they are stripped
        strip = specials if req.skip_special_tokens and parse_tools is None else None
        # the choices share the prompt: the first computes its logprobs
        gen = _Generation(engine, [dict(prompt_ids=prompt_ids, params=p, stop_token_ids=model_stops | user_stops,
                                        user_stop_token_ids=user_stops, stop=stop, logprobs=top,
                                        prompt_logprobs=want_plp if j == 0 else None,
                                        include_stop_str_in_output=req.include_stop_str_in_output,
                                        stop_without_specials=strip is not None,
                                        cache_salt=req.cache_salt, reasoning_gate=gate, priority=req.priority)
                                   for j, p in enumerate(params)])
        # parallel_tool_calls false: one call per choice (vLLM's filter; null or true: all)
        choices = [_ChatChoice(tokenizer, reasoning_initial, parse_tools, strip,
                               ForcedToolCalls(choice, forced_name) if forced else None,
                               one_call=req.parallel_tool_calls is False,
                               include_reasoning=not hide_reasoning) for _ in range(n)]
        rid, created = response_id(request, req, "chatcmpl-"), int(time.time())
        include_usage, continuous_usage = _usage_flags(req)

        def usage_so_far(done: int) -> dict | None:
            """vLLM's continuous_usage_stats: the prompt and one choice's tokens so far."""
            if not continuous_usage:
                return None
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": done,
                    "total_tokens": len(prompt_ids) + done}

        def usage():
            done = sum(len(c.token_ids) for c in choices)
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": done,
                    "total_tokens": len(prompt_ids) + done, **gen.prompt_tokens_details(options, n)}

        def chunk(choice_list, **extra):
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": options.model_name, "choices": choice_list, **extra}

        async def stream_body():
            first = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
            if continuous_usage:
                first["usage"] = usage_so_far(0)
            for i in range(n):  # vLLM: a role chunk per choice, each with the prompt's ids and usage
                yield _sse(chunk([{"index": i, "delta": {"role": role, "content": ""},
                                   "logprobs": None, "finish_reason": None}], **first))
            if echo:  # vLLM: the echoed content, a chunk per choice, before the generated text
                extra = {"usage": usage_so_far(0)} if continuous_usage else {}
                for i in range(n):
                    yield _sse(chunk([{"index": i, "delta": {"content": echo}, "logprobs": None,
                                       "finish_reason": None}], **extra))
            async for out in gen.outputs():
                if out.error is not None:
                    yield _sse(error_body(f"generation failed: {out.error}", "invalid_request_error",
                                          out.param or constraint_param) if out.client_error
                               else error_body(f"generation failed: {out.error}", "server_error"))
                    break
                if out.finish_reason == "abort":
                    if closing:  # the server aborted it (a client gone no longer reads)
                        yield stream_aborted()
                        break
                    continue
                c = choices[out.index]
                delta = c.feed(out)
                if not (delta or out.token_ids or out.finished or out.logprobs):
                    continue
                if hide_reasoning and not (delta or out.finished):
                    # vLLM: a step whose delta holds no content nor tool calls once the reasoning
                    # is left out sends no chunk (its parser's parse_delta answers None)
                    continue
                if not delta and out.token_ids and not hide_reasoning:
                    # one chunk per step that made tokens, as vLLM, even when they add no text
                    # (a special token left out, half a UTF-8 character, text a parser holds)
                    delta = c.empty_delta()
                entry = {"index": out.index, "delta": delta,
                         "logprobs": (_chat_logprobs(tokenizer, out.logprobs, as_ids)
                                      if out.logprobs and not hide_reasoning else None),
                         "finish_reason": c.finish_reason}
                if c.finish_reason is not None:  # vLLM: on the chunk that finishes the choice alone
                    entry["stop_reason"] = c.stop_reason
                if req.return_token_ids:
                    entry["token_ids"] = None if hide_reasoning else out.token_ids
                extra = {"usage": usage_so_far(len(c.token_ids))} if continuous_usage else {}
                yield _sse(chunk([entry], **extra))
            else:
                if include_usage:
                    yield _sse(chunk([], usage=usage()))
            yield "data: [DONE]\n\n"

        if req.stream:
            return await run(request, gen, None, stream_body)
        await run(request, gen, lambda out: choices[out.index].feed(out), None, constraint_param)
        body = {"id": rid, "object": "chat.completion", "created": created, "model": options.model_name,
                "choices": [], "usage": usage()}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        if want_plp is not None:  # vLLM: on the response, not on a choice
            body["prompt_logprobs"] = await asyncio.to_thread(_prompt_logprobs_json, tokenizer,
                                                              choices[0].prompt_logprobs)
        for i, c in enumerate(choices):
            message = {**c.message(), "role": role}
            if req.echo:  # vLLM: the echoed content + the reply's ("" for none, even with echo "")
                message["content"] = echo + (message["content"] or "")
            entry = {"index": i, "message": message,
                     "logprobs": (_chat_logprobs(tokenizer, c.logprobs, as_ids)
                                  if top is not None and not hide_reasoning else None),
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.return_token_ids:
                entry["token_ids"] = None if hide_reasoning else c.token_ids
            body["choices"].append(entry)
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        req: CompletionRequest = await parse(request, CompletionRequest)
        n, stop = common_checks(req)
        prompts = await asyncio.to_thread(_completion_prompts, req.prompt, tokenizer, req.add_special_tokens)
        truncated = [truncate(req, ids) for ids in prompts]
        # vLLM's echo: each choice's text (and logprobs) start with its prompt's; with
        # max_tokens 0 they are the prompt's alone (one token is generated and dropped, as
        # vLLM's `echo_without_generation`), e.g. for lm-eval's loglikelihood requests
        echo = bool(req.echo)
        echo_only = echo and req.max_tokens == 0
        prompt_texts = None
        if echo:
            # a text prompt as sent (vLLM's `res.prompt`); token ids, or a truncated prompt, decoded
            sent = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
            sent = sent if all(isinstance(t, str) for t in sent) else [None] * len(prompts)
            prompt_texts = await asyncio.to_thread(
                lambda: [t if t is not None and len(ids) == len(full) else tokenizer.decode(ids)
                         for t, ids, full in zip(sent, truncated, prompts)])
        prompts = truncated
        # absent: 16 (CompletionRequest's default, vLLM's); null: each prompt's rest of the
        # context (vLLM's get_max_tokens), a 400 naming "prompt" for a prompt that fills it
        asked = 1 if echo_only else req.max_tokens
        params = await sampling(req, [check_length(len(ids), asked, "max_tokens", "prompt") for ids in prompts], n,
                                rest_of_context=asked is None)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}], got {req.logprobs}",
                           param="logprobs")
        want_plp = _prompt_logprobs_asked(req)
        # echo with logprobs: every choice's logprobs start with the prompt's (vLLM asks
        # prompt_logprobs = logprobs then), so every choice computes them
        echo_lps = echo and req.logprobs is not None
        engine_plp = max(want_plp or 0, req.logprobs) if echo_lps else want_plp
        as_ids = _tokens_as_ids(req, options)
        user_stops = stop_token_ids(req)
        stops = model_stops | user_stops
        # the choices of a prompt share it: the first computes its logprobs
        specs = [dict(prompt_ids=ids, params=p, stop_token_ids=stops, stop=stop, logprobs=req.logprobs,
                      prompt_logprobs=engine_plp if j == 0 or echo_lps else None,
                      user_stop_token_ids=user_stops, skip_special_tokens=req.skip_special_tokens,
                      include_stop_str_in_output=req.include_stop_str_in_output,
                      cache_salt=req.cache_salt, priority=req.priority)
                 for ids, prompt_params in zip(prompts, params) for j, p in enumerate(prompt_params)]
        gen = _Generation(engine, specs)
        total = len(specs)
        texts = [[] for _ in range(total)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(total)]
        plps: list[list[PromptLogprob | None] | None] = [None] * total
        ids_out = [[] for _ in range(total)]
        reasons = [None] * total
        stop_reasons: list[int | str | None] = [None] * total  # vLLM's stop_reason of each choice
        offsets = [0] * total  # streamed: each choice's next text_offset (`_completion_logprobs`)
        rid, created = response_id(request, req, "cmpl-"), int(time.time())
        include_usage, continuous_usage = _usage_flags(req)

        def take(out: Output):
            texts[out.index].append(out.text)
            ids_out[out.index] += out.token_ids
            lps[out.index] += out.logprobs or []
            if out.prompt_logprobs is not None:
                plps[out.index] = out.prompt_logprobs
            if out.finished:
                reasons[out.index] = out.finish_reason
                stop_reasons[out.index] = out.stop_reason

        def usage():
            p = sum(len(ids) for ids in prompts)
            c = sum(len(x) for x in ids_out)
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                    **gen.prompt_tokens_details(options, n)}

        def wrap(choice_list, **extra):
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": options.model_name, "choices": choice_list, **extra}

        def echoed(i: int, text: str, out_lps: list, prompt_lps, first: bool) -> tuple[str, list]:
            """A choice's text and logprobs with ``echo``: the prompt's before the first
            generated ones (vLLM's order), or the prompt's alone with max_tokens 0."""
            if not echo:
                return text, out_lps
            if echo_only:
                text, out_lps = "", []
            if not first:
                return text, out_lps
            k = i // n
            head = _echo_logprobs(prompts[k], prompt_lps, req.logprobs) if echo_lps else []
            return prompt_texts[k] + text, head + out_lps

        echo_sent = set()

        async def stream_body():
            async for out in gen.outputs():
                if out.error is not None:
                    yield _sse(error_body(f"generation failed: {out.error}", "invalid_request_error",
                                          out.param or structured_param(req)) if out.client_error
                               else error_body(f"generation failed: {out.error}", "server_error"))
                    break
                if out.finish_reason == "abort":
                    if closing:  # the server aborted it (a client gone no longer reads)
                        yield stream_aborted()
                        break
                    continue
                take(out)
                # one chunk per step that made tokens, as vLLM, even when its text is empty (a
                # special token left out by skip_special_tokens, half a UTF-8 character):
                # a run of such tokens must not silence the stream
                if not (out.text or out.token_ids or out.finished or out.logprobs):
                    continue
                i = out.index
                text, out_lps = echoed(i, out.text, out.logprobs or [], out.prompt_logprobs, i not in echo_sent)
                echo_sent.add(i)
                logprobs = (_completion_logprobs(tokenizer, out_lps, offsets[i], as_ids)
                            if req.logprobs is not None else None)
                # vLLM: stop_reason on every chunk, null but on the one that finishes the choice
                entry = {"index": i, "text": text, "finish_reason": out.finish_reason,
                         "stop_reason": out.stop_reason, "logprobs": logprobs}
                if req.return_token_ids:
                    entry["token_ids"] = out.token_ids
                if logprobs is not None:  # the next token's offset: after this chunk's tokens, as unstreamed
                    offsets[i] += sum(len(t) for t in logprobs["tokens"])
                extra = {}
                if continuous_usage:  # vLLM's continuous_usage_stats: this choice's prompt and tokens so far
                    p, c = len(prompts[i // n]), len(ids_out[i])
                    extra["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
                yield _sse(wrap([entry], **extra))
            else:
                if include_usage:
                    yield _sse(wrap([], usage=usage()))
            yield "data: [DONE]\n\n"

        if req.stream:
            return await run(request, gen, None, stream_body)
        await run(request, gen, take, None, structured_param(req))
        prompt_lps = None
        if want_plp is not None:  # per prompt, from its first choice
            prompt_lps = await asyncio.to_thread(lambda: [_prompt_logprobs_json(tokenizer, plps[k * n], want_plp)
                                                          for k in range(len(prompts))])
        choices = []
        for i in range(total):
            text, choice_lps = echoed(i, "".join(texts[i]), lps[i], plps[i], True)
            entry = {"index": i, "text": text, "finish_reason": reasons[i], "stop_reason": stop_reasons[i],
                     "logprobs": (_completion_logprobs(tokenizer, choice_lps, 0, as_ids)
                                  if req.logprobs is not None else None)}
            if prompt_lps is not None:  # vLLM: on each choice
                entry["prompt_logprobs"] = prompt_lps[i // n]
            if req.return_token_ids:
                entry["prompt_token_ids"] = prompts[i // n]
                entry["token_ids"] = ids_out[i]
            choices.append(entry)
        return wrap(choices, usage=usage())

    return app


# --------------------------------------------------------------------------------------
# Request helpers


def _chat_role(req: ChatCompletionRequest, add_generation_prompt: bool) -> str:
    """The reply's role, vLLM's ``get_chat_request_role``
    (`vllm/entrypoints/openai/serving_chat.py`): "assistant" with
    ``add_generation_prompt``, else the last message's own role (as given: "developer"
    too), the message the reply continues or follows."""
    return "assistant" if add_generation_prompt else req.messages[-1].get("role")


def _chat_echo(req: ChatCompletionRequest, add_generation_prompt: bool) -> str:
    """vLLM's chat ``echo``: the text put before each choice's reply (vLLM's
    `vllm/entrypoints/openai/serving_chat.py`, ``chat_completion_full_generator`` and
    ``chat_completion_stream_generator``): the last message's content when its role is
    the reply's (`_chat_role`: always, without ``add_generation_prompt``); text parts
    joined with newlines (vLLM's "string" content format); else "".
    ``req.messages`` were checked by `_template_messages` (at least one; content a
    string, text parts or null)."""
    last = req.messages[-1]
    if last.get("role") != _chat_role(req, add_generation_prompt):
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""


def _reasoning_gate(tokenizer, initial: str | None) -> ReasoningGate | None:
    """The structured outputs' `ReasoningGate` of a chat reply whose reasoning parser starts
    in `initial` (`initial_state_for_prompt`; None: no --reasoning-parser, the grammar
    holds from the first token), when "<think>" and "</think>" are single special tokens
    of `tokenizer` (else None: nothing tells where the thinking ends in token ids)."""
    ids = getattr(tokenizer, "special_token_ids", {})
    if initial is None or THINK_START not in ids or THINK_END not in ids:
        return None
    return ReasoningGate(initial, ids[THINK_START], ids[THINK_END])


def _check_tools(tools: list[dict] | None) -> list[dict] | None:
    """Validate OpenAI tool definitions; returns them as given (an empty list stays one:
    the template sees `tools == []`, and of named templates "tool_use" renders the chat,
    as vLLM passes it to transformers). Raises APIError(400) naming the bad entry: not
    a function tool with a name, or parameters that are not an object (a 500 before)."""
    if tools is None:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"parameters\": ...}}}}", param=f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):  # read as a schema by the parser and template
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object, got a JSON "
                           f"{json_type(params)}", param=f"tools[{i}].function.parameters")
    return tools


def _template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> what the chat template takes: ``developer`` becomes
    ``system``, assistant tool-call arguments (JSON strings in OpenAI's format) become
    mappings, fields sent as null (other than content) are left out. Raises
    APIError(400) for an unknown role, a missing (or null) content (allowed only for
    an assistant message with tool_calls), a non-text content part,
    tool_calls that are not a list (a 500 before), or arguments that are not a JSON
    object."""
    if not messages:
        raise APIError(400, "'messages' must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role must be system, developer, user, assistant or "
                           f"tool, got {role!r}", param=f"messages[{i}].role")
        # a field sent as null is left out (OpenAI's meaning: absent), but content: templates
        # test `message.content` of an assistant turn holding only tool calls
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        m["role"] = "system" if role == "developer" else role
        content = m.get("content")
        # before the content check: a falsy non-list ({}, "", 0) made it name content instead
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise APIError(400, f"messages[{i}].tool_calls must be a list of tool calls, got "
                           f"{json_type(m['tool_calls'])}", param=f"messages[{i}].tool_calls")
        if content is None and (role != "assistant" or not m.get("tool_calls")):
            # OpenAI and vLLM: required for every role but an assistant turn of tool calls
            raise APIError(400, f"messages[{i}].content is required for {'an' if role == 'assistant' else 'a'} "
                           f"{role} message" + (" without tool_calls" if role == "assistant" else ""),
                           param=f"messages[{i}].content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported "
                                   f"({{\"type\": \"text\", \"text\": ...}})", param=f"messages[{i}].content")
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}]: a text part needs 'text' (a string)",
                                   param=f"messages[{i}].content")
        elif content is not None and not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string, a list of text parts, or null",
                           param=f"messages[{i}].content")
        if m.get("tool_calls"):
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                fn = tc.get("function", tc) if isinstance(tc, dict) else None
                args = fn.get("arguments") if isinstance(fn, dict) else None
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except (ValueError, RecursionError):  # (nested past Python's recursion limit: a 500 before)
                        args = None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, dict):
                    raise APIError(400, f"messages[{i}].tool_calls[{j}]: needs function.name and "
                                   f"function.arguments as a JSON object", param=f"messages[{i}].tool_calls")
                calls.append({"type": "function", "id": tc.get("id"),
                              "function": {"name": fn["name"], "arguments": args}})
            m["tool_calls"] = calls
        out.append(m)
    return out


def json_content_type(value: str | None) -> None:
    """Refuse a request body declared as anything but JSON, as FastAPI's body parsing (and
    so vLLM's server) does: no Content-Type, ``application/json`` or
    ``application/<x>+json`` (any parameters, e.g. charset) are taken. A ``text/plain`` or
    form body needs no CORS preflight, so without this check any web page could make a
    browser post completions to a server on localhost (FastAPI's fix of
    CVE-2021-32677). Raises APIError(400) naming the type."""
    if not value:
        return
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    if message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json")):
        return
    raise APIError(400, f"the request body must be JSON: Content-Type is {value!r}, expected "
                   "'application/json'", code="invalid_content_type")


def _json_path(data, loc: tuple, missing: bool = False) -> str:
    """A pydantic error location as a path into the request's parsed JSON `data`, written
    as the other errors write it (``messages[0].content``, ``tokens[0]``), without the
    union members' names pydantic puts in it (``stop.str`` -> ``stop``): the parts that
    index into `data` are kept, the others dropped, except a missing field's own name
    (`missing`: the last part, which `data` cannot hold). "body" for an empty path."""
    path, node = "", data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and (part in node or (missing and i == len(loc) - 1)):
            path, node = (f"{path}.{part}" if path else part), node.get(part)
        elif isinstance(node, list) and type(part) is int and 0 <= part < len(node):
            path, node = f"{path}[{part}]", node[part]
    return path or "body"


def _lone_surrogate(data, where: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string, or key, in parsed JSON
    holding a lone surrogate (which json.loads lets through from an escape), else None."""
    def bad(text: str) -> bool:
        return any("\ud800" <= ch <= "\udfff" for ch in text)

    if isinstance(data, str):
        return (where or "body") if bad(data) else None
    if isinstance(data, dict):
        for k, v in data.items():
            path = f"{where}.{k}" if where else str(k)
            if bad(k):
                return path
            found = _lone_surrogate(v, path)
            if found is not None:
                return found
    elif isinstance(data, list):
        for k, v in enumerate(data):
            found = _lone_surrogate(v, f"{where}[{k}]")
            if found is not None:
                return found
    return None


def _completion_prompts(prompt, tokenizer, add_special_tokens: bool = True) -> list[list[int]]:
    """The four OpenAI prompt forms -> token id lists (run it off the event loop: encoding
    a long text takes seconds, with the GIL released); a text gets the tokenizer's own
    special tokens (a BOS) with ``add_special_tokens``, vLLM's default. Raises APIError(400) for an empty prompt or a token id
    outside the vocabulary."""
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt, add_special_tokens)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tokenizer.encode(p, add_special_tokens) for p in prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts:
        raise APIError(400, "'prompt' is empty", param="prompt")
    for k, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, "'prompt' is empty" + (f" (prompt {k})" if len(prompts) > 1 else ""),
                           param="prompt")
        bad = [t for t in ids if not 0 <= t < tokenizer.id_limit]
        if bad:
            raise APIError(400, f"'prompt': token id {bad[0]} is outside the vocabulary "
                           f"[0, {tokenizer.id_limit})", param="prompt")
    return prompts
