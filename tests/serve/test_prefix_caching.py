"""Prefix caching in the serving engine (`Engine(enable_prefix_caching=True)`, `flintc
serve --enable-prefix-caching`): which slot a request takes, where its prefill starts,
that the skipped positions' K/V are the ones a replay of the earlier request writes (the
logits equal that replay's bit for bit), and the sliding-window rule that decides when a
slot's cache is usable (checked against the runner: a usable cache gives the logits of a
cache holding only the prefix, an unusable one does not)."""

from __future__ import annotations

import threading

import pytest
import torch

from flintc.runtime.runner import ReferenceRunner
from flintc.sampling import SamplingParams
from flintc.serve.engine import Engine, GenRequest, wait_idle


class Recording:
    """A runner that records every prefill call: (slot, number of tokens, start)."""

    def __init__(self, runner):
        self.inner = runner
        self.prefills: list[tuple[int, int, int]] = []
        self.first_logits: list[torch.Tensor] = []
        for name in ("config", "device", "max_batch", "max_model_len", "prefill_chunk", "kv"):
            setattr(self, name, getattr(runner, name))

    def prefill(self, slot, token_ids, start=0, all_logits=False):
        self.prefills.append((slot, len(token_ids), start))
        out = self.inner.prefill(slot, token_ids, start, all_logits)
        self.first_logits.append(out.clone())
        return out

    def decode(self, slots, token_ids, positions):
        return self.inner.decode(slots, token_ids, positions)


def generate(engine: Engine, prompt: list[int], max_tokens: int, **kw) -> tuple[list[int], GenRequest]:
    """Greedy tokens of one request through the running engine."""
    done, out = threading.Event(), []

    def emit(o):
        out.extend(o.token_ids)
        if o.finished:
            done.set()

    req = GenRequest(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=True), emit=emit, **kw)
    engine.submit(req)
    assert done.wait(120), "the engine did not finish the request"
    return out, req


@pytest.fixture
def engine_of(tiny_serving):
    engines = []

    def make(enable: bool, max_batch: int = 2):
        model, tok = tiny_serving
        runner = Recording(ReferenceRunner(model, max_batch=max_batch, max_model_len=256))
        engine = Engine(runner, tok, enable_prefix_caching=enable).start()
        engines.append(engine)
        return engine, runner

    yield make
    for e in engines:
        e.shutdown()


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_second_turn_skips_the_first_turns_prefill(engine_of, tiny_serving):
    """Turn 2's prompt = turn 1's prompt + answer + more: its prefill starts where turn 1's
    cache ends (the prompt and every generated token but the last), in the same slot, and
    its logits equal a replay of what turn 1 did (whole-prompt prefill, one decode per
    token) followed by the same prefill, bit for bit."""
    model, tok = tiny_serving
    engine, runner = engine_of(True)
    vocab = model.config.vocab_size
    p1 = _prompt(20, 1, vocab)
    out1, r1 = generate(engine, p1, 6)
    assert r1.timeline.cached_tokens == 0
    p2 = p1 + out1 + _prompt(7, 2, vocab)
    out2, r2 = generate(engine, p2, 4)
    written = len(p1) + len(out1) - 1  # the last generated token was never fed
    assert runner.prefills == [(runner.prefills[0][0], len(p1), 0),
                               (runner.prefills[0][0], len(p2) - written, written)]
    assert r2.timeline.cached_tokens == written and r2.timeline.prompt_tokens == len(p2)
    assert engine.stats["cached_prompt_tokens"] == written
    # the replay: a fresh runner doing turn 1's calls, then turn 2's prefill from `written`
    replay = ReferenceRunner(model, max_batch=1, max_model_len=256)
    replay.prefill(0, p1)
    for i, t in enumerate(out1[:-1]):
        replay.decode([0], [t], [len(p1) + i])
    expect = replay.prefill(0, p2[written:], written)
    assert torch.equal(runner.first_logits[1], expect)
    assert out2[0] == int(expect.argmax())


def test_earlier_prompt_reused_through_the_saved_ring(engine_of, tiny_serving):
    """Turn 2 repeats turn 1's prompt but not its answer (chat templates re-render an
    answer, e.g. GLM's `<think></think>` before it), and turn 1 wrote more than W tokens
    past the shared prefix, so the ring rows the prefix needs were overwritten: the engine
    restores the ring rows it saved after turn 1's prefill and starts at turn 1's prompt
    length; the logits equal a fresh runner's prefill of turn 1's prompt followed by the
    same prefill, bit for bit."""
    model, tok = tiny_serving
    engine, runner = engine_of(True)
    V, W = model.config.vocab_size, model.config.sliding_window
    p1 = _prompt(16, 21, V)
    out1, _ = generate(engine, p1, W + 4)
    p2 = p1 + [(out1[0] + 1) % V] + _prompt(5, 22, V)  # differs right after p1
    assert engine.reusable_prefix(p1 + out1[:-1], p2) == 0  # the direct rule alone: nothing
    _, r2 = generate(engine, p2, 2)
    assert runner.prefills[-1][1:] == (len(p2) - len(p1), len(p1)) and r2.timeline.cached_tokens == len(p1)
    replay = ReferenceRunner(model, max_batch=1, max_model_len=256)
    replay.prefill(0, p1)
    assert torch.equal(runner.first_logits[-1], replay.prefill(0, p2[len(p1):], len(p1)))


def test_regenerate_and_short_earlier_prompts_use_the_saved_ring(engine_of, tiny_serving):
    """The saved ring is a cache of the earlier prompt's P tokens, so it serves any shared
    L <= P with P <= L + 1 or P <= W: the same prompt again after an answer that ran past
    W (a "regenerate": L = P - 1), and part of a short earlier prompt (P <= W); both give
    a fresh runner's logits for the same calls, bit for bit."""
    model, tok = tiny_serving
    engine, runner = engine_of(True, max_batch=1)
    V, W = model.config.vocab_size, model.config.sliding_window
    p = _prompt(30, 31, V)
    generate(engine, p, W + 5)
    _, r = generate(engine, p, 2)
    assert runner.prefills[-1][1:] == (1, len(p) - 1) and r.timeline.cached_tokens == len(p) - 1
    replay = ReferenceRunner(model, max_batch=1, max_model_len=256)
    replay.prefill(0, p)
    assert torch.equal(runner.first_logits[-1], replay.prefill(0, p[-1:], len(p) - 1))
    short = _prompt(W - 2, 32, V)
    generate(engine, short, W + 5)
    q = short[:4] + _prompt(5, 33, V)
    _, r = generate(engine, q, 1)
    assert runner.prefills[-1][1:] == (len(q) - 4, 4) and r.timeline.cached_tokens == 4
    replay = ReferenceRunner(model, max_batch=1, max_model_len=256)
    replay.prefill(0, short)
    assert torch.equal(runner.first_logits[-1], replay.prefill(0, q[4:], 4))


def test_a_short_shared_header_does_not_evict_a_cached_conversation(engine_of, tiny_serving):
    """A request sharing only a chat template's first tokens with a cached conversation
    takes the empty slot, so the conversation's next turn still finds all of it."""
    model, tok = tiny_serving
    engine, runner = engine_of(True, max_batch=2)
    V = model.config.vocab_size
    header = [1, 2]
    a = header + _prompt(3, 34, V)
    out, _ = generate(engine, a, 3)  # a + out[:-1]: 7 tokens cached, <= W
    slot_a = runner.prefills[-1][0]
    generate(engine, header + _prompt(3, 35, V), 1)
    assert runner.prefills[-1][0] != slot_a and runner.prefills[-1][2] == 0
    _, r = generate(engine, a + out + [5], 1)
    assert runner.prefills[-1][0] == slot_a and r.timeline.cached_tokens == len(a) + len(out) - 1


def test_off_by_default_and_off_prefills_from_zero(engine_of, tiny_serving):
    model, tok = tiny_serving
    assert Engine(ReferenceRunner(model, max_batch=1, max_model_len=64), tok).enable_prefix_caching is False
    engine, runner = engine_of(False)
    p1 = _prompt(12, 3, model.config.vocab_size)
    out1, _ = generate(engine, p1, 3)
    _, r2 = generate(engine, p1 + out1, 2)
    assert [c[2] for c in runner.prefills] == [0, 0] and r2.timeline.cached_tokens == 0


def test_same_prompt_again_runs_only_its_last_token(engine_of, tiny_serving):
    """A prompt the slot holds in full still prefills its last token (the first token's
    logits come from a prefill); a request with prompt_logprobs prefills it all (it needs
    every position's logits)."""
    model, tok = tiny_serving
    engine, runner = engine_of(True)
    p = _prompt(15, 4, model.config.vocab_size)
    generate(engine, p, 1)  # one token generated, none fed: the cache holds p
    _, r = generate(engine, p, 1)
    assert runner.prefills[-1][1:] == (1, len(p) - 1) and r.timeline.cached_tokens == len(p) - 1
    _, r = generate(engine, p, 1, prompt_logprobs=0)
    assert runner.prefills[-1][2] == 0 and r.timeline.cached_tokens == 0


def test_slot_choice_longest_prefix_then_empty_then_least_recent(engine_of, tiny_serving):
    model, tok = tiny_serving
    engine, runner = engine_of(True, max_batch=3)
    V = model.config.vocab_size
    a, b = _prompt(10, 5, V), _prompt(10, 6, V)
    generate(engine, a, 1)
    slot_a = runner.prefills[-1][0]
    generate(engine, b, 1)  # no shared prefix: an empty slot, not a's
    slot_b = runner.prefills[-1][0]
    assert slot_b != slot_a
    generate(engine, b + [1, 2], 1)  # b's slot, from b's end
    assert runner.prefills[-1] == (slot_b, 2, len(b))
    generate(engine, _prompt(9, 7, V), 1)  # the empty third slot
    slot_c = runner.prefills[-1][0]
    assert slot_c not in (slot_a, slot_b)
    generate(engine, _prompt(9, 8, V), 1)  # none empty: the slot freed longest ago (a's)
    assert runner.prefills[-1] == (slot_a, 9, 0)
    generate(engine, a, 1)  # a's cache is gone
    assert runner.prefills[-1][2] == 0


def test_max_tokens_zero_keeps_the_slots_cache(engine_of, tiny_serving):
    model, tok = tiny_serving
    engine, runner = engine_of(True, max_batch=1)
    p = _prompt(11, 9, model.config.vocab_size)
    generate(engine, p, 1)
    out, _ = generate(engine, _prompt(5, 10, model.config.vocab_size), 0)  # no prefill at all
    assert out == [] and len(runner.prefills) == 1
    generate(engine, p + [3], 1)
    assert runner.prefills[-1][1:] == (1, len(p))


def test_a_failed_request_leaves_no_cache_behind(engine_of, tiny_serving):
    model, tok = tiny_serving
    engine, runner = engine_of(True, max_batch=1)
    p = _prompt(11, 11, model.config.vocab_size)
    calls = {"n": 0}
    real = runner.inner.decode

    def failing(*a):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*a)

    runner.inner.decode = failing
    done = threading.Event()
    errors = []
    req = GenRequest(prompt_ids=p, params=SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                     emit=lambda o: (errors.append(o.error), done.set()) if o.finished else None)
    engine.submit(req)
    assert done.wait(60) and errors[-1] and "boom" in errors[-1]
    assert wait_idle(engine)
    generate(engine, p + [1], 1)
    assert runner.prefills[-1][2] == 0  # the failed slot's cache is not trusted


def test_a_runner_failure_drops_every_cached_prefix(engine_of, tiny_serving):
    """A runner that raised may have left any slot half written (a CUDA graph capture's
    warm-up writes slot 0 and restores it afterwards): no cached prefix is used after it,
    not even a free slot's."""
    model, tok = tiny_serving
    engine, runner = engine_of(True, max_batch=2)
    p = _prompt(11, 36, model.config.vocab_size)
    generate(engine, p, 1)  # cached in a free slot
    real = runner.inner.prefill
    runner.inner.prefill = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("capture failed"))
    done, errors = threading.Event(), []
    engine.submit(GenRequest(prompt_ids=_prompt(5, 37, model.config.vocab_size),
                             params=SamplingParams(temperature=0.0, max_tokens=2),
                             emit=lambda o: (errors.append(o.error), done.set()) if o.finished else None))
    assert done.wait(60) and "capture failed" in errors[-1]
    runner.inner.prefill = real
    _, r = generate(engine, p + [1], 1)
    assert r.timeline.cached_tokens == 0 and runner.prefills[-1][2] == 0


@pytest.mark.parametrize("M, L, usable", [
    (30, 29, True),    # M = L + 1: the one row past the prefix is the next prompt token's own
    (30, 30, True),
    (8, 3, True),      # M <= W: the rows past L were never wrapped over positions < L
    (30, 20, False),   # positions 20..29 overwrote ring rows positions 12..19 need
    (14, 4, False),
])
def test_sliding_rule_matches_the_runner(tiny_serving, M, L, usable):
    """`Engine.reusable_prefix`'s rule against the runner itself: with a usable cache of M
    tokens, a prefill from L gives the logits of a cache that holds the same K/V of
    positions < L and nothing past them; with an unusable one, the stale ring rows change
    them (the rule is not vacuous)."""
    model, tok = tiny_serving
    W = model.config.sliding_window
    assert W == 9, "the cases above are written for the tiny config's window"
    V = model.config.vocab_size
    cached = _prompt(M, 12, V)
    prompt = cached[:L] + _prompt(6, 13, V)
    engine = Engine(ReferenceRunner(model, max_batch=1, max_model_len=64), tok, enable_prefix_caching=True)
    assert engine.reusable_prefix(cached, prompt) == (L if usable else 0)
    runner = ReferenceRunner(model, max_batch=2, max_model_len=64)
    runner.prefill(0, cached[:L])
    for t in runner.kv:  # slot 1: the same K/V of positions < L, nothing past them
        t[1] = t[0]
    if M > L:
        runner.prefill(0, cached[L:], L)  # slot 0 goes on to hold all M tokens
    reused = runner.prefill(0, prompt[L:], L)
    clean = runner.prefill(1, prompt[L:], L)
    assert torch.equal(reused, clean) == usable


def test_reusable_prefix_edges(tiny_serving):
    model, tok = tiny_serving
    engine = Engine(ReferenceRunner(model, max_batch=1, max_model_len=64), tok, enable_prefix_caching=True)
    assert engine.reusable_prefix([], [1, 2]) == 0
    assert engine.reusable_prefix([1, 2], [1]) == 0  # one prompt token: it must run
    assert engine.reusable_prefix([5, 2, 3], [1, 2, 3, 4]) == 0
    assert engine.reusable_prefix([1, 2, 3], [1, 2, 9, 4]) == 2  # M = L + 1
    assert engine.reusable_prefix([1, 2, 3], [1, 2, 3, 4, 5]) == 3
    assert engine.reusable_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 3


# ---------------------------------------------------------------- over HTTP
def _metric(running, name: str) -> float:
    """A counter's value in the server's /metrics (fails when the series is missing)."""
    status, text = running.request("GET", "/metrics")
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert status == 200 and len(values) == 1, (name, status)
    return values[0]


@pytest.fixture(scope="module")
def caching_server(tiny_serving, serve_kit):
    from flintc.serve.app import ServeOptions

    model, tok = tiny_serving
    running = serve_kit.start_server(model, tok, ServeOptions(model_name="m", enable_prompt_tokens_details=True),
                                     max_batch=2)
    running.engine.enable_prefix_caching = True  # as `flintc serve --enable-prefix-caching`
    yield running
    serve_kit.stop_server(running)


def test_multi_turn_chat_reports_cached_tokens(caching_server):
    """Turn 2 of a chat (turn 1's messages and answer, then a new user message) skips the
    prefill of what turn 1 left in its slot: usage.prompt_tokens_details.cached_tokens and
    vLLM's prefix-cache counters say how many; turn 1 had none."""
    srv = caching_server
    q0, h0 = _metric(srv, "vllm:prefix_cache_queries_total"), _metric(srv, "vllm:prefix_cache_hits_total")
    msgs = [{"role": "user", "content": "Tell me about salt."}]
    status, r1 = srv.post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 6,
                                                   "temperature": 0, "ignore_eos": True})
    assert status == 200, r1
    assert "prompt_tokens_details" not in r1["usage"], r1  # nothing cached: left out, as vLLM
    msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And pepper?"}]
    status, r2 = srv.post("/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 3,
                                                   "temperature": 0})
    assert status == 200, r2
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # at least turn 1's prompt (its answer's text may tokenize differently when rendered)
    assert r1["usage"]["prompt_tokens"] <= cached < r2["usage"]["prompt_tokens"], (r1["usage"], r2["usage"])
    assert _metric(srv, "vllm:prefix_cache_hits_total") - h0 == cached
    assert _metric(srv, "vllm:prefix_cache_queries_total") - q0 == \
        r1["usage"]["prompt_tokens"] + r2["usage"]["prompt_tokens"]


def test_cache_salt_isolates_and_empty_salt_is_refused(caching_server):
    srv = caching_server
    body = {"model": "m", "prompt": list(range(40, 70)), "max_tokens": 2, "ignore_eos": True}
    status, r = srv.post("/v1/completions", {**body, "cache_salt": "alice"})
    assert status == 200, r
    status, r = srv.post("/v1/completions", {**body, "cache_salt": "bob"})
    assert status == 200 and "prompt_tokens_details" not in r["usage"], r
    status, r = srv.post("/v1/completions", {**body, "prompt": body["prompt"] + [7], "cache_salt": "alice"})
    assert status == 200 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 30, r
    status, r = srv.post("/v1/completions", {**body, "cache_salt": ""})
    assert status == 400 and r["error"]["param"] == "cache_salt" and "non-empty" in r["error"]["message"], r


def test_prompt_tokens_details_only_with_the_flag(tiny_serving, serve_kit):
    """Without --enable-prompt-tokens-details the usage has no prompt_tokens_details, and
    without --enable-prefix-caching the engine skips nothing and counts no query."""
    from flintc.serve.app import ServeOptions

    model, tok = tiny_serving
    running = serve_kit.start_server(model, tok, ServeOptions(model_name="m"), max_batch=1)
    try:
        for _ in range(2):
            status, r = running.post("/v1/completions", {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 1})
            assert status == 200 and "prompt_tokens_details" not in r["usage"], r
        assert running.engine.stats["cached_prompt_tokens"] == 0
        assert _metric(running, "vllm:prefix_cache_queries_total") == 0
    finally:
        serve_kit.stop_server(running)
