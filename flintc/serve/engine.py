"""The serving engine: a continuous-batching scheduler over a `ModelRunner`, on its
own thread.

The asyncio server hands :class:`GenRequest` objects to :meth:`Engine.submit` and
receives :class:`Output` events through each request's ``emit`` callback (called
from the engine thread; the server wraps ``loop.call_soon_threadsafe``). The engine
thread loops over *steps*:

1. take new requests and cancellations from its inbox;
2. drop cancelled requests, freeing their slots (the runner keeps a slot's KV cache
   until the slot is reused, so a freed slot's cache is simply overwritten by the
   next prefill into it);
3. admit waiting requests into free slots, in the order of the scheduling policy
   (:class:`RequestQueue`: "fcfs", arrival order; "priority", vLLM's ``--scheduling-policy
   priority``: by ``(priority, arrival)``, lower value first): one ``runner.prefill``
   each, then sample the first token from its logits (with prefix caching, the prefill
   starts past the prompt's leading tokens that a free slot's cache still holds, below);
4. one ``runner.decode`` over every running sequence that still needs a token (up
   to ``runner.max_batch`` of them: the decode batch), sample one token each.

A request beyond the free slots waits in the queue. A running request is never preempted,
whatever the policy: vLLM V1's scheduler preempts (its lowest-priority running request,
with the priority policy) only when its paged KV cache has no block left for a running
request's next tokens, and never to admit a waiting one (it stops admitting at
``max_num_seqs``, `vllm/v1/core/sched/scheduler.py` ``Scheduler.schedule``); here each
slot holds KV rows for a whole sequence of ``max_model_len`` tokens, so a running request
always has room and that case never arises. A higher-priority request that arrives
while every slot is busy is admitted first when one frees. Sampling follows
:mod:`flintc.sampling` (FLINT_SPEC section 6); each request has its own
``torch.Generator`` so its random draws do not depend on its batch neighbours
(its logits may differ in the last bits with the batch size: docs/serve.md, `seed`). A request
whose params adjust the logits (vLLM's penalties, ``logit_bias``, ``min_tokens``,
``allowed_token_ids``, ``bad_words``, ``structured_outputs``)
keeps a :class:`~flintc.sampling.TokenHistory` of its prompt, its generated tokens
(their counts, on the device) and its stop tokens, passed to ``sample(...,
history=...)``; the others keep none and sample as before.

Structured outputs (vLLM's, on llguidance: :mod:`flintc.structured`): a request whose
params have ``structured_outputs`` gets a :class:`~flintc.structured.GrammarMatcher`
(in its TokenHistory) when it is admitted, a copy of the grammar compiled for the
engine's tokenizer (the server compiles it while checking the request, so this is a
cache hit). ``sample`` masks the logits with it at every step (the stop tokens only where
the grammar accepts); each token the sequence generates is fed to it, and once the
grammar is complete (nothing more can follow) the sequence ends with finish reason
"stop". A grammar that fails to compile, or refuses a token (it should not: the forced
tokens of the test hook can), fails that request alone with an error. Logprobs are
those of the logits the grammar's mask leaves (renormalized over the allowed tokens, the
others -inf), as vLLM's, which applies its grammar bitmask to the logits before its
sampler computes even the raw logprobs; the other masks (``allowed_token_ids``, ...)
leave them the model's own, as there.

Text is made here too, so that a stop string can end a sequence at once: each
sequence has an :class:`~flintc.checkpoint.tokenizer.IncrementalDetokenizer`
(special tokens kept unless the request sets ``skip_special_tokens``: chat keeps
them, so ``<think>`` and ``<tool_call>`` reach the parsers), and
text that might be the start of a stop string is held back until it is not. A request
whose output leaves the special tokens out though its text keeps them
(``stop_without_specials``: chat with ``skip_special_tokens``, the server strips them after
parsing) has its stop strings matched on the text without them
(`flintc.stop_strings.VisibleText`), as vLLM matches them on the text it outputs.
Stop tokens (end-of-text and the generation config's ``<|user|>`` / ``<|observation|>``,
both unless ``ignore_eos``, and a request's ``stop_token_ids``:
`flintc.stop_strings.stop_token_end`, vLLM's ``check_stop``) end a sequence with finish
reason ``"stop"`` and add no text (unless ``include_stop_str_in_output``); they count as
completion tokens (as in vLLM). With ``min_tokens`` (as vLLM): the stop tokens cannot be
sampled before that many tokens are generated (and do not stop the sequence before then),
and stop strings are looked for only once more than ``min_tokens`` tokens are out.

Prompt logprobs (vLLM's ``prompt_logprobs``): for a request that asks, the prefill keeps
the logits of every prompt position (``runner.prefill(..., all_logits=True)``, which both
runners support: the compiled runner's prefill functions compute the LM head for each
chunk's last token only, and it applies the LM head to the other rows' hidden states,
keeping each chunk's last row as the function computed it), one
``prefill_chunk`` of the runner at a time so that the fp32 ``[chunk, V]`` rows are the
most held at once (the calls are those one whole-prompt prefill makes, so the first
token's logits are the same), and turns them into :class:`PromptLogprob` entries, sent
with the request's first Output.

Prefix caching (vLLM's automatic prefix caching, ``enable_prefix_caching``; off by
default, unlike vLLM V1, because it changes results, below): a finished sequence's slot keeps the K/V of every token it fed
to the model (its prompt and its generated tokens but the last), and the engine
remembers those token ids. A new request goes to the free slot whose remembered tokens
share the longest prefix with its prompt, and its prefill starts at position L (the
shared length, at most the prompt's length minus one: the last prompt token always runs,
for the first token's logits): ``runner.prefill(slot, prompt[L:], start=L)``. Multi-turn
chat is the case it serves: the next turn's prompt begins with the previous turn's
prompt and answer. Sliding-window layers keep a ring of the last W positions, so a slot
whose cache holds M tokens serves a prefix of L as it is only when no position
L+1..M-1 overwrote a ring row that positions L-W+1..L-1 need: M <= L + 1 or M <= W (or
the model has no sliding layer). The engine also saves a copy of the slot's ring rows
right after each prompt's prefill (W rows per sliding layer, K and V: 2 x W x Hkv x D
bf16 each), so a prompt that starts with the whole earlier prompt reuses that much
even when the answer is not repeated token for token (GLM's chat template re-renders an
earlier answer with ``<think></think>`` before it): the saved rows are copied back and
the prefill starts at the earlier prompt's length. Without a usable prefix the request
takes a free slot that remembers nothing, else the one freed longest ago (LRU). A request with
``prompt_logprobs`` prefills its whole prompt (it needs every position's logits, as in
vLLM). The skipped tokens' K/V are the ones the earlier request wrote and the prompt's
rest runs as other prefill chunks, so the logits differ from a whole-prompt prefill's
in the last bits, and the model amplifies that (on the tiny random checkpoint 5 of 20
random prompts changed, the largest logit by up to 0.34); vLLM's prefix caching has the
same property. Off, the server's results equal `flintc run`'s bit for bit.
``RequestTimeline.cached_tokens`` counts the skipped tokens (the usage's
``prompt_tokens_details.cached_tokens``, vLLM's ``vllm:prefix_cache_hits``).

Metrics: each request carries a :class:`RequestTimeline` (when it was queued,
admitted to a slot, got its first and latest token; how many prompt tokens were
prefilled and tokens generated), and the engine calls its observers
(:class:`EngineObserver`) as it prefills, emits each token and finishes a request, on
the engine thread (:mod:`flintc.serve.metrics` turns them into vLLM's Prometheus
metrics).

Test hook: ``Engine(..., forced_tokens=f)``: for a request whose
``GenRequest.forced`` is None, ``f(prompt_ids)`` may return a token list that
*replaces sampling*: step k emits ``list[k]`` (the model still runs prefill and
decode on those tokens and logprobs come from its real logits), then a stop
token. It exists only as a Python argument, never reachable over HTTP.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import queue
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from flintc.errors import InputError
from flintc.sampling import SamplingParams, TokenHistory, drawn_outside_allowed, sample
from flintc.stop_strings import VisibleText, stop_string_cut, stop_string_hold, stop_token_end
from flintc.structured import GrammarMatcher, ReasoningGate, StructuredOutputError

_WAKE = object()
_STOP = object()
# vLLM's --scheduling-policy values this engine runs (vllm/v1/core/sched/request_queue.py
# SchedulingPolicy; its "sjf" is not taken here)
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class TokenLogprob:
    """One generated token: its id, text, log-probability under the model's raw
    distribution (log_softmax of the fp32 logits, before temperature/top-k/top-p,
    as vLLM reports), and the ``top`` most likely alternatives as (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class PromptLogprob:
    """Prompt token ``i`` (i >= 1) under the model's raw distribution after tokens 0..i-1
    (log_softmax of the fp32 logits of position i-1, as vLLM's prompt_logprobs).

    ``token_id``: the prompt token; ``logprob`` its log-probability; ``rank`` the number
    of vocabulary tokens whose log-probability is at least its own, itself included (1:
    the most likely; tied tokens share the larger rank; vLLM's ``(logprobs >=
    logprob).sum()``); ``top``: the k most likely tokens as (id, logprob), most likely
    first (rank = position + 1)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class Output:
    """An event for one request (choice ``index``): new ``text`` (may be empty),
    the ``token_ids`` produced since the last event, their logprobs when asked for,
    and, on the last event, ``finish_reason`` ("stop", "length", "abort") or
    ``error`` (a message; the request failed). ``prompt_logprobs`` (on the first event
    of a request that asked for them, else None): one entry per prompt token, None for
    the first (nothing precedes it), a :class:`PromptLogprob` for each other.
    ``stop_reason`` (on the last event of a sequence that finished "stop", else None):
    vLLM's ``CompletionOutput.stop_reason``, what ended it: the stop string that matched
    (a str), or the id of the stop token it ended at (an int) when that token is not the
    tokenizer's end-of-text (a request's ``stop_token_ids``; the generation config's
    ``<|user|>`` / ``<|observation|>``, which vLLM adds to every request's
    ``stop_token_ids`` unless ``ignore_eos``); None for end-of-text (unless ``ignore_eos``,
    where only a request's own ``stop_token_ids`` stop it) and for a structured output whose
    grammar completed (`flintc.stop_strings.stop_token_end`)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # the error is the request's own doing (its structured-outputs constraint could not be
    # followed: the server answers a 400, not a 500)
    client_error: bool = False
    # the request field a client error names (the 400's ``param``), when the engine knows it
    # (allowed_token_ids); None: the server names the constraint's field
    param: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class RequestTimeline:
    """What the engine did with one request: ``time.monotonic()`` stamps (None until
    it happens) and token counts. ``queued``: :meth:`Engine.submit`; ``scheduled``:
    admitted into a slot; ``first_token`` / ``last_token``: the first and the latest
    generated token; ``prompt_tokens``: prefilled (0 until the prefill has run);
    ``generated_tokens``: sampled so far, stop tokens included; ``cached_tokens``: the
    leading prompt tokens the prefill skipped because the slot's cache held them (prefix
    caching; counted in ``prompt_tokens``)."""

    queued: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0


class EngineObserver:
    """Callbacks from the engine thread, in each request's order: ``prefilled`` (its
    prompt ran through the model), ``token`` for every generated token, then
    ``finished`` once (also for a request that never ran: aborted while waiting, or
    failed). Here they do nothing; they must be quick and must not raise (an exception
    fails the running requests)."""

    def prefilled(self, req: GenRequest) -> None:
        """``req.timeline.prompt_tokens`` tokens were prefilled."""

    def token(self, req: GenRequest, since_last: float | None) -> None:
        """One more token (``req.timeline`` already counts it); ``since_last``: seconds
        since the previous one, None for the first."""

    def finished(self, req: GenRequest, reason: str | None, error: str | None) -> None:
        """The request's last Output: ``reason`` "stop", "length" or "abort", or None
        with ``error`` (the request failed). Called while ``num_running`` /
        ``num_waiting`` still count the request, so that what an observer counts is in
        by the time they show it gone."""


@dataclass(eq=False)
class GenRequest:
    """One sequence to generate.

    Args:
        prompt_ids: prompt token ids (checked by the caller: non-empty, in
            vocabulary, and len + max_tokens <= runner.max_model_len).
        params: sampling settings (``max_tokens`` counts every generated token,
            reasoning included; None, the rest of the context, :meth:`Engine.submit`
            makes an int).
        emit: called from the engine thread with each :class:`Output`.
        index: the choice index reported back in each Output.
        stop_token_ids: every stop token of the sequence (vLLM's ``_all_stop_token_ids``:
            masked before ``min_tokens``): they end it unless ``params.ignore_eos``. The
            server gives the end-of-text token, the generation config's end ids
            (`flintc.checkpoint.tokenizer.generation_stop_token_ids`) and the request's own.
        stop: stop strings; the text ends before the first match (not included).
        logprobs: None for no logprobs, else how many top alternatives (0..20).
        prompt_logprobs: None, or how many top alternatives (0..20) each prompt token's
            :class:`PromptLogprob` lists (vLLM's ``prompt_logprobs``); sent with the
            first Output.
        user_stop_token_ids: ids (also in ``stop_token_ids``) that end the sequence even
            with ``params.ignore_eos`` (vLLM's ``stop_token_ids``: ignore_eos ignores EOS only).
        skip_special_tokens: leave the tokenizer's special tokens out of the text.
        stop_without_specials: match ``stop`` on the text less the special tokens' strings
            (the output's: the server's chat keeps them in the text for its parsers and
            strips them after, with the request's ``skip_special_tokens``), the cut and the
            hold-back mapped onto the text; no effect with ``skip_special_tokens`` (the
            text has none).
        include_stop_str_in_output: keep the stop string that ended the sequence, or the
            text of the stop token, in the text (vLLM's option).
        forced: tokens that replace sampling (test hook, see module docstring).
        cache_salt: prefix caching reuses only K/V that a request with the same salt
            cached (vLLM's ``cache_salt``: tenants share no cache).
        reasoning_gate: with ``params.structured_outputs``, a
            :class:`~flintc.structured.ReasoningGate` when the reply is a thinking model's
            (``--reasoning-parser``): the grammar holds after the thinking block only.
        priority: vLLM's request ``priority``: with the engine's "priority" scheduling
            policy, waiting requests are admitted by (priority, arrival), lower value
            first; with "fcfs" it must be 0 (:meth:`Engine.submit`).

    The engine fills in ``timeline`` (:class:`RequestTimeline`).
    """

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Output], None]
    index: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    forced: list[int] | None = None
    user_stop_token_ids: frozenset[int] = frozenset()
    skip_special_tokens: bool = False
    stop_without_specials: bool = False
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    reasoning_gate: ReasoningGate | None = None
    priority: int = 0
    cancelled: bool = False
    id: int = field(default_factory=itertools.count().__next__)
    timeline: RequestTimeline = field(default_factory=RequestTimeline)


class _Seq:
    """Engine-side state of a running request."""

    def __init__(self, req: GenRequest, slot: int, detok, device, tokenizer=None,
                 specials: Mapping[int, str] | None = None):
        self.req = req
        self.slot = slot
        self.detok = detok
        self.generator = None if req.params.is_greedy else req.params.make_generator(device)
        self.out_ids: list[int] = []
        self.setup_error: str | None = None  # the request fails at admission (its grammar did not compile)
        self.setup_client_error = False  # ... because of the request (an InputError: a 400)
        grammar = None
        if req.params.structured_outputs is not None:
            try:  # the server compiled it already (a cache hit): a copy of the compiled matcher
                grammar = GrammarMatcher(req.params.structured_outputs, tokenizer, req.stop_token_ids,
                                         reasoning=req.reasoning_gate)
            except Exception as exc:  # an InputError; anything else fails this request alone too
                self.setup_error = f"{type(exc).__name__}: {exc}"
                self.setup_client_error = isinstance(exc, InputError)
        # params that adjust the logits: the tokens `sample` reads (out_ids itself)
        self.history = (TokenHistory(req.prompt_ids, self.out_ids, req.stop_token_ids, grammar=grammar)
                        if req.params.adjusts_logits else None)
        self.pos = len(req.prompt_ids)  # position of the next token fed to the model
        self.prefilled = False  # the prompt's K/V are in the slot's cache (positions < pos hold its tokens)
        self.text = ""  # text so far (stop strings removed)
        # stop strings matched on the text less the special tokens' strings (the output's)
        self.visible = VisibleText(specials) if specials is not None else None
        self.stop_reason: int | str | None = None  # what ended it (`stop_token_end`'s, a stop string)
        self.sent = 0  # characters of text already emitted
        self.pending_ids: list[int] = []
        self.pending_lp: list[TokenLogprob] = []
        self.prompt_lp: list[PromptLogprob | None] | None = None  # sent with the first Output
        self.ring: list[torch.Tensor] | None = None  # prefix caching: the ring rows after the prompt's prefill


@dataclass
class _SlotCache:
    """What a free slot's KV cache holds (prefix caching): the K/V of ``tokens`` at
    positions 0..len-1, written by a request freed at ``freed`` (a counter: the LRU order)
    with ``salt`` (its cache_salt), whose prompt was ``prompt_len`` tokens; ``ring``: copies
    of the slot's sliding-layer ring rows right after that prompt's prefill (None without
    sliding layers), restored to reuse the prompt's K/V when the later tokens' writes
    wrapped over the rows it needs."""

    tokens: np.ndarray  # int64 [M]
    freed: int
    salt: str | None
    prompt_len: int
    ring: list[torch.Tensor] | None


class RequestQueue:
    """The engine's waiting requests, in the order they are admitted: vLLM V1's
    ``FCFSRequestQueue`` and ``PriorityRequestQueue`` (vllm/v1/core/sched/request_queue.py).

    Args:
        policy: "fcfs": arrival order (:meth:`Engine.submit` order); "priority": the
            smallest ``GenRequest.priority`` first, ties by arrival (``timeline.queued``,
            then the request's ``id``: vLLM's ``Request.__lt__`` compares priority,
            arrival_time, then request_id). A request's choices (``n``) arrive in index
            order.

    Raises:
        ValueError: another policy (vLLM's "Unknown scheduling policy: ...").
    """

    def __init__(self, policy: str = "fcfs"):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"Unknown scheduling policy: {policy!r} (expected one of {', '.join(SCHEDULING_POLICIES)})")
        self.policy = policy
        self._fcfs: collections.deque[GenRequest] = collections.deque()
        self._heap: list[tuple[int, float, int, GenRequest]] = []  # (priority, arrival, id, request)

    def add(self, req: GenRequest) -> None:
        if self.policy == "fcfs":
            self._fcfs.append(req)
        else:
            queued = req.timeline.queued
            heapq.heappush(self._heap, (req.priority, float("inf") if queued is None else queued, req.id, req))

    def peek(self) -> GenRequest:
        """The next request to admit. Raises IndexError when empty."""
        return self._fcfs[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> GenRequest:
        """Remove and return the next request to admit. Raises IndexError when empty."""
        return self._fcfs.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def drop(self, pred: Callable[[GenRequest], bool]) -> None:
        """Remove the requests for which ``pred`` is true (it is called once on each, in
        queue order for fcfs)."""
        if self.policy == "fcfs":
            self._fcfs = collections.deque(r for r in self._fcfs if not pred(r))
        else:
            self._heap = [e for e in self._heap if not pred(e[3])]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._fcfs) + len(self._heap)

    def __bool__(self) -> bool:
        return len(self) > 0


class Engine:
    """Continuous-batching generation over ``runner`` on a dedicated thread.

    Args:
        runner: a :class:`~flintc.runtime.runner.ModelRunner`.
        tokenizer: a FlintTokenizer whose ids fit the runner's config's vocab_size
            (`FlintTokenizer.check_fits_model`: it may have fewer tokens, never more).
        forced_tokens: test hook, see the module docstring.
        observers: :class:`EngineObserver` objects to call (more may be appended to
            ``engine.observers`` before :meth:`start`).
        enable_prefix_caching: reuse a free slot's cached K/V for a prompt that starts
            with the tokens it holds (module docstring); False (the default): every
            prefill starts at 0.
        scheduling_policy: the order waiting requests are admitted in (vLLM's
            ``--scheduling-policy``, :class:`RequestQueue`): "fcfs" (the default; a
            request's ``priority`` must be 0) or "priority". Running requests are never
            preempted (module docstring).

    Raises:
        CheckpointError: a tokenizer id of the model's vocab_size or more
            (`FlintTokenizer.check_fits_model`, naming the tokenizer file and config).
        ValueError: an unknown ``scheduling_policy``.
    """

    def __init__(self, runner, tokenizer, forced_tokens: Callable[[list[int]], list[int] | None] | None = None,
                 observers: list[EngineObserver] | None = None, enable_prefix_caching: bool = False,
                 scheduling_policy: str = "fcfs"):
        tokenizer.check_fits_model(runner.config.vocab_size, runner.config.source)
        self.runner = runner
        self.tokenizer = tokenizer
        self.forced_tokens = forced_tokens
        self.max_batch = int(runner.max_batch)
        self.max_model_len = int(runner.max_model_len)
        self._inbox: queue.Queue = queue.Queue()
        self._waiting = RequestQueue(scheduling_policy)  # ValueError for an unknown policy
        self.scheduling_policy = scheduling_policy
        self._lock = threading.Lock()
        self._inbox_requests = 0  # GenRequests in the inbox (it also holds wake-ups)
        self._running: dict[int, _Seq] = {}  # slot -> sequence
        self._thread: threading.Thread | None = None
        self.stats = collections.Counter()  # steps, prefills, cached_prompt_tokens, decode_tokens, finished, aborted, max_decode_batch
        self.fatal_error: str | None = None
        self.observers: list[EngineObserver] = list(observers or [])
        self.enable_prefix_caching = bool(enable_prefix_caching)
        cfg = runner.config
        # the sliding layers' ring rows (None: no sliding layer, a cache row per position)
        self._ring = (int(cfg.sliding_window)
                      if any(cfg.is_sliding_layer(i) for i in range(cfg.num_hidden_layers)) else None)
        self._cached: dict[int, _SlotCache] = {}  # free slot -> what its cache holds
        self._ring_buffers: dict[int, list[torch.Tensor]] = {}  # slot -> its ring snapshot's storage
        # ring rows can be saved after a prompt's prefill (`_save_ring`): sliding layers, and
        # a runner whose caches are the `kv` list (both runners)
        self._can_save_ring = self._ring is not None and getattr(runner, "kv", None) is not None
        self._freed = itertools.count()

    # ---- called from any thread -------------------------------------------------------
    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="flintc-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, req: GenRequest) -> None:
        """Queue ``req``; its Outputs arrive through ``req.emit``. Its params' bad words
        become token ids here, as vLLM's input processor makes them
        (`SamplingParams.with_tokenizer`; the server has made them already). Its params'
        ``stop``, ``stop_token_ids`` and ``include_stop_str_in_output`` (the server leaves
        them unset: it gives the request's own in ``req``) join the request's: their stop
        strings are looked for too, their ids end it (even with ignore_eos). Params with
        ``max_tokens`` None get the rest of the prompt's context, ``max_model_len`` minus
        its length (`SamplingParams.for_prompt`; the server resolves its requests' own).

        Raises:
            InputError: a bad word that makes no tokens; a non-zero ``req.priority`` with
                the "fcfs" policy (vLLM's input processor's check and message); max_tokens
                None with a prompt that leaves no room, or fewer tokens than min_tokens.
        """
        if req.priority != 0 and self.scheduling_policy != "priority":
            raise InputError(priority_not_enabled(req.priority))
        req.params = p = req.params.with_tokenizer(self.tokenizer).for_prompt(len(req.prompt_ids),
                                                                              self.max_model_len)
        if p.stop is not None:
            req.stop = tuple(dict.fromkeys(tuple(req.stop) + p.stop))
        if p.stop_token_ids is not None:
            ids = frozenset(p.stop_token_ids)
            req.stop_token_ids, req.user_stop_token_ids = req.stop_token_ids | ids, req.user_stop_token_ids | ids
        req.include_stop_str_in_output = req.include_stop_str_in_output or p.include_stop_str_in_output
        req.timeline.queued = time.monotonic()
        if self.fatal_error is not None:
            self._notify_finished(req, None, f"engine stopped: {self.fatal_error}")
            req.emit(Output(req.index, error=f"engine stopped: {self.fatal_error}"))
            return
        with self._lock:
            self._inbox_requests += 1
            self._inbox.put(req)

    def abort(self, req: GenRequest) -> None:
        """Cancel ``req`` (a client went away): its slot is freed at the next step and
        it gets one last Output with finish_reason "abort"."""
        req.cancelled = True
        self._inbox.put(_WAKE)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted into a slot."""
        with self._lock:
            return len(self._waiting) + self._inbox_requests

    # ---- the engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            block = not self._running and not self._waiting
            try:
                item = self._inbox.get(block=block, timeout=None)
            except queue.Empty:
                item = None
            stop = False
            while item is not None:
                if item is _STOP:
                    stop = True
                elif isinstance(item, GenRequest):
                    with self._lock:
                        self._waiting.add(item)
                        self._inbox_requests -= 1
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if stop:
                self._fail_all("server shutting down", "abort")
                return
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as exc:  # a runner failure: fail what is running, keep serving
                msg = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
                for seq in list(self._running.values()):
                    self._finish(seq, None, error=msg)
                # a runner that failed may have left any slot's cache half written (a graph
                # capture's warm-up, say): trust no cached prefix after it
                self._cached.clear()

    def _fail_all(self, msg: str, reason: str | None) -> None:
        for seq in list(self._running.values()):
            self._finish(seq, reason, error=None if reason else msg)
        while self._waiting:
            req = self._waiting.peek()
            self._notify_finished(req, reason, None if reason else msg)  # counted, then off the gauge
            self._waiting.pop()
            req.emit(Output(req.index, finish_reason=reason, error=None if reason else msg))

    def _step(self) -> None:
        self.stats["steps"] += 1
        for seq in [s for s in self._running.values() if s.req.cancelled]:
            self._finish(seq, "abort")
        self._waiting.drop(self._drop_cancelled)  # (observers may read num_waiting: no lock held)
        # admit, in the policy's order: one prefill per free slot
        free = [s for s in range(self.max_batch) if s not in self._running]
        while free and self._waiting:
            slot, reuse = self._pick_slot(free, self._waiting.peek())
            req = self._waiting.pop()
            free.remove(slot)
            seq = _Seq(req, slot, self.tokenizer.detokenizer(req.skip_special_tokens), self.runner.device,
                       self.tokenizer, self._special_strings() if req.stop and req.stop_without_specials
                       and not req.skip_special_tokens else None)
            self._running[slot] = seq
            req.timeline.scheduled = time.monotonic()
            if req.params.max_tokens < 1 or seq.setup_error is not None:
                # no prefill: the slot's cache (and what it holds) unchanged
                self._finish(seq, "length" if seq.setup_error is None else None, error=seq.setup_error,
                             client_error=seq.setup_client_error)
                free.insert(0, slot)
                continue
            if req.forced is None and self.forced_tokens is not None:
                req.forced = self.forced_tokens(list(req.prompt_ids))
            self.stats["prefills"] += 1
            held = self._cached.pop(slot, None)  # overwritten from position `reuse` on
            if reuse and not self._direct(len(held.tokens), reuse):  # `reusable_prefix`: the saved ring serves it
                self._restore_ring(slot, held.ring)
            if req.prompt_logprobs is None:
                logits = self.runner.prefill(slot, req.prompt_ids[reuse:], reuse)  # [V]
            else:
                logits, seq.prompt_lp = self._prefill_prompt_logprobs(slot, req.prompt_ids, req.prompt_logprobs)
            seq.prefilled = True
            if self.enable_prefix_caching and self._can_save_ring \
                    and len(req.prompt_ids) + req.params.max_tokens - 1 > self._ring:
                # (a sequence that never passes W positions needs no copy: the direct rule serves it)
                seq.ring = self._save_ring(slot)
            req.timeline.prompt_tokens = len(req.prompt_ids)
            req.timeline.cached_tokens = reuse
            self.stats["cached_prompt_tokens"] += reuse
            for obs in self.observers:
                obs.prefilled(req)
            self._sample_and_push([seq], logits[None])
        # decode: one token for every running sequence
        live = list(self._running.values())
        if not live:
            return
        self.stats["max_decode_batch"] = max(self.stats["max_decode_batch"], len(live))
        self.stats["decode_tokens"] += len(live)
        logits = self.runner.decode([s.slot for s in live], [s.out_ids[-1] for s in live],
                                    [s.pos for s in live])  # [B, V]
        for s in live:
            s.pos += 1
        self._sample_and_push(live, logits)

    def _pick_slot(self, free: list[int], req: GenRequest) -> tuple[int, int]:
        """The free slot for ``req`` and how many leading prompt tokens its cache already
        holds (0..len(prompt) - 1). ``free``: the free slots, in order. Only a cache of the
        request's ``cache_salt`` counts, none with prefix caching off or for
        ``prompt_logprobs``. In order: the slot with the longest hit that discards nothing
        (it reuses all the cache holds but the last token, or more); else, when a hit
        reuses at least as many tokens as it discards, the longest such; else a slot that
        holds nothing; else the longest hit; else the slot freed longest ago (LRU). So a
        short shared header (a chat template's first tokens) does not evict a cached
        conversation while an empty slot is free."""
        hits = []  # (reused, discarded, slot)
        if self.enable_prefix_caching and req.prompt_logprobs is None:
            prompt = np.asarray(req.prompt_ids, dtype=np.int64)
            for slot in free:
                held = self._cached.get(slot)
                if held is not None and held.salt == req.cache_salt:
                    n = self.reusable_prefix(held.tokens, prompt,
                                             held.prompt_len if held.ring is not None else None)
                    if n:
                        hits.append((n, max(0, len(held.tokens) - 1 - n), slot))
        lossless = [h for h in hits if h[1] == 0]
        worth = [h for h in hits if h[0] >= h[1]]
        empty = [s for s in free if s not in self._cached]
        for group in (lossless, worth):
            if group:
                n, _, slot = max(group, key=lambda h: h[0])
                return slot, n
        if empty:
            return empty[0], 0
        if hits:
            n, _, slot = max(hits, key=lambda h: h[0])
            return slot, n
        return min(free, key=lambda s: self._cached[s].freed), 0

    def reusable_prefix(self, cached, prompt, ring_saved_at: int | None = None) -> int:
        """How many leading tokens of ``prompt`` a prefill may skip in a slot whose cache
        holds the K/V of ``cached`` (token ids at positions 0..M-1; sequences of ints):
        their common prefix L, at most len(prompt) - 1, when the sliding layers' ring rows
        that the prefix's last W - 1 positions need are intact (M <= L + 1 or M <= W,
        module docstring). Else, with ``ring_saved_at`` = P (the earlier prompt's length,
        whose ring rows were saved right after its prefill: a cache of P tokens once they
        are restored), min(L, P) when that cache serves it (P <= min(L, P) + 1 or P <= W).
        Else 0."""
        cached = np.asarray(cached, dtype=np.int64)
        prompt = np.asarray(prompt, dtype=np.int64)
        n = min(len(cached), len(prompt) - 1)
        if n <= 0:
            return 0
        differ = np.flatnonzero(cached[:n] != prompt[:n])
        common = int(differ[0]) if differ.size else n
        if self._direct(len(cached), common):
            return common
        if ring_saved_at is not None:
            L = min(common, ring_saved_at)
            if L > 0 and self._direct(ring_saved_at, L):
                return L
        return 0

    def _direct(self, M: int, L: int) -> bool:
        """A cache holding M tokens serves a prefix of L of them as it is: no position
        past L overwrote a ring row the prefix needs (no sliding layer, M <= L + 1 or
        M <= W)."""
        W = self._ring
        return W is None or M <= L + 1 or M <= W

    def _ring_rows(self, slot: int) -> list[torch.Tensor]:
        """Views of ``slot``'s rows in every sliding layer's K and V ring ([W, Hkv, D]
        each; the runners' ``kv`` list: k_0, v_0, k_1, v_1, ...)."""
        cfg, kv = self.runner.config, self.runner.kv
        return [t[slot] for i in range(cfg.num_hidden_layers) if cfg.is_sliding_layer(i)
                for t in kv[2 * i:2 * i + 2]]

    def _restore_ring(self, slot: int, saved: list[torch.Tensor]) -> None:
        """Copy ``saved`` (`_save_ring`'s) back into ``slot``'s ring rows: the ring as the
        earlier prompt's prefill left it."""
        for rows, s in zip(self._ring_rows(slot), saved):
            rows.copy_(s)

    def _save_ring(self, slot: int) -> list[torch.Tensor]:
        """Copy ``slot``'s ring rows into the slot's own snapshot buffers (allocated on
        its first use, then reused: the snapshot a slot's record holds is restored, or
        dropped, before the slot's next prefill takes another). -> the buffers."""
        rows = self._ring_rows(slot)
        buf = self._ring_buffers.get(slot)
        if buf is None:
            buf = self._ring_buffers[slot] = [torch.empty_like(r) for r in rows]
        for b, r in zip(buf, rows):
            b.copy_(r)
        return buf

    def _drop_cancelled(self, req: GenRequest) -> bool:
        if req.cancelled:
            self.stats["aborted"] += 1
            self._notify_finished(req, "abort", None)
            req.emit(Output(req.index, finish_reason="abort"))
        return req.cancelled

    def _sample_and_push(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Pick one token per sequence from fp32 logits [B, V] and process it."""
        logits = logits.float()
        hist = [s.history for s in seqs]
        toks = sample(logits, [s.req.params for s in seqs], [s.generator for s in seqs],
                      history=hist if any(h is not None for h in hist) else None).tolist()
        for b, (seq, tok) in enumerate(zip(seqs, toks)):
            forced = seq.req.forced
            if forced is not None:
                n = len(seq.out_ids)
                tok = forced[n] if n < len(forced) else self._forced_end(seq)
            lp = None
            if seq.req.logprobs is not None:
                row = logits[b]
                grammar = seq.history.grammar if seq.history is not None else None
                if grammar is not None:  # over the tokens its grammar allowed, as vLLM's
                    row = grammar.masked_for_logprobs(row, len(seq.out_ids))
                lp = self._logprob(row, tok, seq.req.logprobs)
            self._push(seq, int(tok), lp)

    def _prefill_prompt_logprobs(self, slot: int, ids: list[int], k: int
                                 ) -> tuple[torch.Tensor, list[PromptLogprob | None]]:
        """Prefill ``ids`` into ``slot`` keeping every position's logits, one runner
        ``prefill_chunk`` per call (the calls one whole-prompt prefill makes inside the
        runner, so the last position's logits are the same). -> (fp32 logits [V] of the
        last position, [None] + one PromptLogprob per prompt token after the first)."""
        chunk = int(getattr(self.runner, "prefill_chunk", 0) or len(ids))
        out: list[PromptLogprob | None] = [None]
        last = None
        for s in range(0, len(ids), chunk):
            logits = self.runner.prefill(slot, ids[s:s + chunk], s, all_logits=True)  # [c, V]
            targets = ids[s + 1:s + 1 + logits.shape[0]]  # the prompt tokens rows 0.. predict
            out += prompt_logprobs(logits[:len(targets)], targets, k)
            last = logits[-1].clone()  # not a view: frees the chunk's rows
        return last, out

    def _special_strings(self) -> dict[int, str]:
        """Special token id -> its string (as the detokenizer makes it; computed once)."""
        return self.tokenizer.special_strings()

    def _forced_end(self, seq: _Seq) -> int:
        stops = sorted(seq.req.stop_token_ids)
        return stops[0] if stops else self.tokenizer.eos_token_id

    @staticmethod
    def _logprob(row: torch.Tensor, tok: int, k: int) -> TokenLogprob:
        lsm = torch.log_softmax(row.float(), dim=-1)  # [V]
        top = []
        if k > 0:
            vals, ids = torch.topk(lsm, k)
            top = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
        return TokenLogprob(tok, float(lsm[tok]), top)

    def _push(self, seq: _Seq, tok: int, lp: TokenLogprob | None) -> None:
        req, params = seq.req, seq.req.params
        seq.out_ids.append(tok)
        grammar = seq.history.grammar if seq.history is not None else None
        if grammar is not None:
            try:
                grammar.advance(seq.out_ids)
            except StructuredOutputError as exc:  # this request fails, not the others
                # a sampled token the grammar refuses: the request's other masks
                # (allowed_token_ids, bad_words, min_tokens) left none of the tokens the grammar
                # allows, or the grammar outgrew llguidance's limits (a regex a{1000000}, a schema
                # of thousands of properties): the request's doing (a 400), unlike a forced token
                seq.pending_ids.append(tok)
                self._finish(seq, None, error=str(exc), client_error=seq.req.forced is None)
                return
        bad = drawn_outside_allowed(params, tok, len(seq.out_ids) - 1)
        if bad is not None:  # its masks left none of its allowed tokens: the request's doing (a 400)
            seq.pending_ids.append(tok)
            self._finish(seq, None, error=bad, client_error=True, param="allowed_token_ids")
            return
        seq.pending_ids.append(tok)
        tl, now = req.timeline, time.monotonic()
        since_last = None if tl.last_token is None else now - tl.last_token
        if tl.first_token is None:
            tl.first_token = now
        tl.last_token = now
        tl.generated_tokens += 1
        for obs in self.observers:
            obs.token(req, since_last)
        if lp is not None:
            seq.pending_lp.append(lp)
        n_out = len(seq.out_ids)
        # a stop token (vLLM's check_stop, and a stop token that ended the grammar even with
        # ignore_eos: `stop_token_end`, the rule `flintc.runtime.generate` follows too) ends
        # the sequence, and its text (a special token's with skip_special_tokens off:
        # '94<|endoftext|>' for [0-9]+) is not the output's unless include_stop_str_in_output
        ends, reason = stop_token_end(tok, n_out=n_out, min_tokens=params.min_tokens, ignore_eos=params.ignore_eos,
                                      stop_ids=req.stop_token_ids, user_stop_ids=req.user_stop_token_ids,
                                      eos_token_id=self.tokenizer.eos_token_id,
                                      grammar_ended=grammar is not None and grammar.ended)
        if ends:
            if req.include_stop_str_in_output:
                seq.text += seq.detok.push(tok)
            seq.stop_reason = reason
            self._finish(seq, "stop")
            return
        new = seq.detok.push(tok)
        seq.text += new
        new_chars = len(new) if seq.visible is None else seq.visible.push(tok, new)
        # (vLLM looks for stop strings only past min_tokens)
        if req.stop and n_out > params.min_tokens and self._cut_stop(seq, new_chars):
            self._finish(seq, "stop")
            return
        if grammar is not None and grammar.finished:  # the structured output is complete
            self._finish(seq, "stop")
            return
        # seq.pos + 1 tokens so far (prompt + generated): vLLM's max_model_len counts both
        if len(seq.out_ids) >= params.max_tokens or seq.pos + 1 >= self.max_model_len:
            self._finish(seq, "length")
            return
        if seq.visible is not None:
            self._emit(seq, seq.visible.emit_upto(req.stop, req.include_stop_str_in_output))
            return
        hold = stop_string_hold(seq.text, req.stop, req.include_stop_str_in_output)
        self._emit(seq, len(seq.text) - hold)

    def _cut_stop(self, seq: _Seq, new_chars: int) -> bool:
        """Truncate seq.text at the first stop string (in the request's order) that ends
        in the `new_chars` characters its latest token added (after it with
        ``include_stop_str_in_output``): `flintc.stop_strings.stop_string_cut`, vLLM's
        match, which `flintc.runtime.generate` makes too; the stop string becomes the
        sequence's ``stop_reason``. The text cut was held back (`stop_string_hold`), never
        sent. With ``seq.visible``: matched on the text less the special tokens' strings
        (`new_chars` its latest characters), the cut mapped onto the text
        (`VisibleText.cut`)."""
        if seq.visible is not None:
            cut = seq.visible.cut(seq.req.stop, new_chars, seq.req.include_stop_str_in_output)
        else:
            cut = stop_string_cut(seq.text, seq.req.stop, new_chars, seq.req.include_stop_str_in_output)
        if cut is None:
            return False
        seq.stop_reason, keep = cut
        seq.text = seq.text[:keep]
        seq.detok.flush()
        return True

    def _emit(self, seq: _Seq, upto: int, finish: str | None = None, error: str | None = None,
              client_error: bool = False, param: str | None = None) -> None:
        text = seq.text[seq.sent:upto]
        if not (text or seq.pending_ids or finish or error):
            return
        seq.sent = max(seq.sent, upto)
        out = Output(seq.req.index, text, seq.pending_ids,
                     seq.pending_lp if seq.req.logprobs is not None else None, finish, error,
                     client_error=client_error and error is not None,
                     param=param if client_error and error is not None else None,
                     stop_reason=seq.stop_reason if finish == "stop" else None)
        seq.pending_ids, seq.pending_lp = [], []
        out.prompt_logprobs, seq.prompt_lp = seq.prompt_lp, None
        seq.req.emit(out)

    def _finish(self, seq: _Seq, reason: str | None, error: str | None = None,
                client_error: bool = False, param: str | None = None) -> None:
        seq.text += seq.detok.flush()  # a dangling partial character becomes U+FFFD
        if self.enable_prefix_caching and seq.prefilled and error is None:
            # positions < pos hold the prompt and every generated token but the last (never fed)
            self._cached[seq.slot] = _SlotCache(np.asarray((list(seq.req.prompt_ids) + seq.out_ids)[:seq.pos],
                                                           dtype=np.int64),
                                                next(self._freed), seq.req.cache_salt,
                                                len(seq.req.prompt_ids), seq.ring)
        self.stats["aborted" if reason == "abort" else "finished"] += 1
        try:
            # the observers (the metrics' counters) first, then off num_running: once the
            # gauges show a request gone, its count is in (a scrape between the two saw
            # neither, and a test that waited for (0, 0) then read the counters missed it)
            self._notify_finished(seq.req, reason, error)
        finally:
            self._running.pop(seq.slot, None)
        self._emit(seq, len(seq.text), reason, error, client_error, param)

    def _notify_finished(self, req: GenRequest, reason: str | None, error: str | None) -> None:
        for obs in self.observers:
            obs.finished(req, reason, error)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int, rows: int = 256) -> list[PromptLogprob]:
    """Each row's target token under the row's raw distribution.

    Args:
        logits: [n, V] logits (any float dtype; read as fp32), row i the distribution of
            the token after position i.
        targets: n token ids, each in [0, V).
        k: how many most likely tokens each entry lists (0..V).
        rows: rows per log_softmax (bounds the [rows, V] temporaries).

    Returns:
        n :class:`PromptLogprob` (log_softmax, vLLM's rank: the number of tokens whose
        log-probability is >= the target's).

    Raises:
        ValueError: ``logits`` is not [len(targets), V].
    """
    if logits.dim() != 2 or logits.shape[0] != len(targets):
        raise ValueError(f"logits must be [{len(targets)}, V], got {list(logits.shape)}")
    out = []
    for r in range(0, len(targets), rows):
        lsm = torch.log_softmax(logits[r:r + rows].float(), dim=-1)  # [m, V]
        tgt = torch.tensor(targets[r:r + rows], device=lsm.device)[:, None]  # [m, 1]
        tok_lp = lsm.gather(1, tgt)  # [m, 1]
        ranks = (lsm >= tok_lp).sum(-1).tolist()
        if k > 0:
            vals, idx = torch.topk(lsm, k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        else:
            tops = [[] for _ in ranks]
        out += [PromptLogprob(t, lp, rank, top) for t, lp, rank, top
                in zip(targets[r:r + rows], tok_lp[:, 0].tolist(), ranks, tops)]
    return out


def priority_not_enabled(priority: int) -> str:
    """vLLM's message for a non-zero request priority under the "fcfs" policy (its input
    processor's ``process_inputs``)."""
    return f"Got priority {priority} but Priority scheduling is not enabled."


def wait_idle(engine: Engine, timeout: float = 10.0) -> bool:
    """Poll until nothing runs or waits (for tests and shutdown). -> True if idle."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if engine.num_running == 0 and engine.num_waiting == 0:
            return True
        time.sleep(0.01)
    return False
