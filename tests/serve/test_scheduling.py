"""vLLM's request ``priority`` and ``--scheduling-policy {fcfs,priority}``
(`flintc.serve.engine.RequestQueue`): with "priority", waiting requests get a free slot
by (priority, arrival), lower value first, as vLLM V1's PriorityRequestQueue; running
requests are never preempted (vLLM V1 preempts only when its paged KV cache runs out,
which a slot holding a whole sequence's rows never does); with "fcfs" (the default) a
non-zero priority is refused with vLLM's message."""

from __future__ import annotations

import threading

import pytest

from flintc.errors import InputError
from flintc.sampling import SamplingParams
from flintc.serve.app import ServeOptions
from flintc.serve.engine import Engine, EngineObserver, GenRequest, RequestQueue, wait_idle
from harness import wait_until

MODEL = "flint-tiny"


class Admitted(EngineObserver):
    """Records each request's prompt text as its prefill runs (its admission order)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.order, self.ended = tokenizer, [], {}

    def prefilled(self, req):
        self.order.append(self.tokenizer.decode(req.prompt_ids))

    def finished(self, req, reason, error):
        self.ended[self.tokenizer.decode(req.prompt_ids)] = (reason, error, req.timeline.generated_tokens)


class Gated:
    """A runner whose decode waits until ``gate`` is set: a request admitted before that
    stays running, holding its slot, while the test queues others."""

    def __init__(self, runner):
        self.runner, self.gate = runner, threading.Event()

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def decode(self, slots, token_ids, positions):
        assert self.gate.wait(60), "the test never opened the gate"
        return self.runner.decode(slots, token_ids, positions)


def _wait(cond, timeout=30.0) -> bool:
    return wait_until(cond, timeout, interval=0.005)


def _req(tok, text, priority=0, max_tokens=2, outputs=None):
    return GenRequest(prompt_ids=tok.encode(text), params=SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                         ignore_eos=True),
                      emit=(outputs.append if outputs is not None else lambda out: None),
                      stop_token_ids=frozenset({tok.eos_token_id}), priority=priority)


def test_request_queue_orders_as_vllm(tiny_serving):
    """fcfs: arrival order, priorities aside (they are 0 there); priority: (priority,
    arrival), lower first, as vLLM's Request.__lt__; drop keeps the order of the rest."""
    _, tok = tiny_serving
    prios = [3, 0, -2, 0, 3, 2**62, -2**62]
    reqs = []
    for k, p in enumerate(prios):
        r = _req(tok, f"r{k}", p)
        r.timeline.queued = float(k)  # arrival: submit order
        reqs.append(r)
    fcfs, prio = RequestQueue("fcfs"), RequestQueue("priority")
    for r in reversed(reqs[:3]):  # (arrival stamps decide, not the order added)
        prio.add(r)
    for r in reqs[3:]:
        prio.add(r)
    for r in reqs:
        fcfs.add(r)
    assert len(prio) == len(fcfs) == 7 and prio and not RequestQueue("priority")
    assert prio.peek() is reqs[6]
    prio.drop(lambda r: r is reqs[1])
    assert [prio.pop() for _ in range(len(prio))] == [reqs[k] for k in (6, 2, 3, 0, 4, 5)]
    assert [fcfs.pop() for _ in range(len(fcfs))] == reqs
    with pytest.raises(IndexError):
        prio.pop()
    with pytest.raises(ValueError, match="Unknown scheduling policy: 'sjf'"):
        RequestQueue("sjf")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_engine_admits_by_priority_then_arrival(tiny_serving, policy):
    """One slot, five requests queued before the engine starts: they run one at a time
    in (priority, arrival) order with "priority", in arrival order with "fcfs"."""
    from flintc.runtime.runner import ReferenceRunner

    model, tok = tiny_serving
    seen = Admitted(tok)
    engine = Engine(ReferenceRunner(model, max_batch=1, max_model_len=64), tok, observers=[seen],
                    scheduling_policy=policy)
    assert engine.scheduling_policy == policy
    prios = [3, 0, -2, 0, 3] if policy == "priority" else [0] * 5
    for k, p in enumerate(prios):
        engine.submit(_req(tok, f"r{k}", p))
    engine.start()
    try:
        assert wait_idle(engine, 60)
    finally:
        engine.shutdown()
    want = ["r2", "r1", "r3", "r0", "r4"] if policy == "priority" else [f"r{k}" for k in range(5)]
    assert seen.order == want
    assert seen.ended == {f"r{k}": ("length", None, 2) for k in range(5)}


def test_a_running_request_is_never_preempted(tiny_serving):
    """A low-priority request holding the only slot runs to its end; the waiting ones,
    one arriving with a higher priority than it and one higher still, get the slot after
    it, the higher first (vLLM V1 preempts only for want of KV blocks, and stops admitting
    at max_num_seqs)."""
    from flintc.runtime.runner import ReferenceRunner

    model, tok = tiny_serving
    seen = Admitted(tok)
    runner = Gated(ReferenceRunner(model, max_batch=1, max_model_len=64))
    engine = Engine(runner, tok, observers=[seen], scheduling_policy="priority").start()
    try:
        outs = []
        engine.submit(_req(tok, "low", priority=10, max_tokens=6, outputs=outs))
        assert _wait(lambda: engine.num_running == 1)
        engine.submit(_req(tok, "mid", priority=0))
        engine.submit(_req(tok, "high", priority=-5))
        assert _wait(lambda: engine.num_waiting == 2)
        runner.gate.set()
        assert wait_idle(engine, 60)
    finally:
        runner.gate.set()
        engine.shutdown()
    assert seen.order == ["low", "high", "mid"]
    assert seen.ended["low"] == ("length", None, 6)
    assert sum(len(o.token_ids) for o in outs) == 6 and outs[-1].finish_reason == "length"
    assert engine.stats["prefills"] == 3  # no request was prefilled twice


def test_fcfs_engine_refuses_a_priority(tiny_serving):
    """vLLM's input processor: "Got priority 1 but Priority scheduling is not enabled."
    (the server checks it first, a 400; the engine refuses it too, for the Python API)."""
    from flintc.runtime.runner import ReferenceRunner

    model, tok = tiny_serving
    engine = Engine(ReferenceRunner(model, max_batch=1, max_model_len=64), tok)
    assert engine.scheduling_policy == "fcfs"
    with pytest.raises(InputError, match=r"^Got priority -1 but Priority scheduling is not enabled\.$"):
        engine.submit(_req(tok, "x", priority=-1))
    assert engine.num_waiting == 0
    with pytest.raises(ValueError, match="Unknown scheduling policy"):
        Engine(ReferenceRunner(model, max_batch=1, max_model_len=64), tok, scheduling_policy="lifo")


# ---- over HTTP ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prio_server(tiny_serving, serve_kit):
    """--scheduling-policy priority, one slot, its decode gated (`Gated`), and an
    `Admitted` observer (``run.seen``)."""
    model, tok = tiny_serving
    seen = Admitted(tok)
    runner = {}

    def wrap(r):
        runner["gated"] = Gated(r)
        runner["gated"].gate.set()  # open unless a test closes it
        return runner["gated"]

    run = serve_kit.start_server(model, tok, ServeOptions(MODEL), max_batch=1, max_model_len=256, wrap=wrap,
                                 scheduling_policy="priority", observers=[seen])
    run.seen, run.gate = seen, runner["gated"].gate
    yield run
    run.gate.set()
    serve_kit.stop_server(run)


def test_server_admits_waiting_requests_by_priority(prio_server):
    """Over HTTP, completions and chat: while one request holds the only slot, three
    queue with priorities 5, -1 and 0 (chat); they are admitted -1, 0, 5, then a fourth
    with the same priority as one queued earlier comes after it (arrival breaks ties)."""
    run, gate = prio_server, prio_server.gate
    engine = run.engine
    results = {}

    def send(name, body, path="/v1/completions"):
        results[name] = run.post(path, body)

    def completion(prompt, **kw):
        return {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, **kw}

    gate.clear()
    try:
        run.seen.order.clear()
        first = threading.Thread(target=send, args=("blocker", completion("blocker", max_tokens=4, priority=100)))
        first.start()
        assert _wait(lambda: engine.num_running == 1), dict(engine.stats)
        jobs = [("five", completion("five", priority=5), "/v1/completions"),
                ("minus one", completion("minus one", priority=-1), "/v1/completions"),
                ("zero", {"model": MODEL, "messages": [{"role": "user", "content": "zero"}], "max_tokens": 2,
                          "priority": 0}, "/v1/chat/completions"),
                ("minus one again", completion("minus one again", priority=-1), "/v1/completions")]
        threads = []
        for k, (name, body, path) in enumerate(jobs):
            threads.append(threading.Thread(target=send, args=(name, body, path)))
            threads[-1].start()
            assert _wait(lambda: engine.num_waiting == k + 1), (k, engine.num_waiting)
    finally:
        gate.set()
    for t in [first, *threads]:
        t.join(60)
    assert all(status == 200 for status, _ in results.values()), results
    order = run.seen.order
    assert order[0] == "blocker" and order[1:3] == ["minus one", "minus one again"], order
    assert "zero" in order[3], order  # the chat's rendered prompt
    assert order[4] == "five", order


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_priority_is_checked_as_vllm(server_fcfs, prio_server, path):
    """fcfs (the default): a non-zero priority is a 400 with vLLM's message, naming the
    field; 0 is served. priority: any 64-bit integer is taken; a non-integer is a 400
    naming 'priority' under either policy."""
    body = ({"model": MODEL, "prompt": "hi", "max_tokens": 1} if path == "/v1/completions"
            else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    for p in (1, -1, 2**63 - 1):
        status, got = server_fcfs.post(path, {**body, "priority": p})
        assert status == 400, got
        assert got["error"] == {"message": f"Got priority {p} but Priority scheduling is not enabled.",
                                "type": "invalid_request_error", "param": "priority", "code": None}, got
    status, got = server_fcfs.post(path, {**body, "priority": 0})
    assert status == 200, got
    for p in (1, -2**63, 2**63 - 1, 3.0):
        status, got = prio_server.post(path, {**body, "priority": p})
        assert status == 200, (p, got)
    for run in (server_fcfs, prio_server):
        for bad in ("1", 1.5, None, True, 2**63):
            status, got = run.post(path, {**body, "priority": bad})
            assert status == 400 and got["error"]["param"] == "priority", (bad, got)


@pytest.fixture(scope="module")
def server_fcfs(tiny_serving, serve_kit):
    model, tok = tiny_serving
    run = serve_kit.start_server(model, tok, ServeOptions(MODEL), max_batch=1, max_model_len=256)
    yield run
    serve_kit.stop_server(run)
