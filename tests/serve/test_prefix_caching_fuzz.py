"""A fuzz test of the serving engine's prefix caching against an exact "hash model".

`FakeRunner` keeps the runners' KV-cache semantics (full layers: a row per position;
sliding layers: a ring of W rows, row j taken to hold position p0-1-((p0-1-j) mod W),
masked by position; chunked prefill with a padded last chunk whose ring rows are saved
and restored, as `CompiledRunner.prefill`) but computes with exact integer hashes: each
layer's output at position p hashes its input and the (position, cached value) of every
key it sees. So a request's tokens are a function of its prompt alone, and a stale or
wrong cache row it reads changes them. Oracle: every finished request's tokens equal
those of the same request in a fresh runner. The workload mixes next turns (with all,
part or none of the earlier answer), repeated and shortened prompts, prompts that part
from an earlier prompt or answer anywhere, max_tokens 0 to past 2W, prompt_logprobs,
cache_salt, several requests per step, aborts and injected decode failures. (From the
session-41 review; with the sliding rule or the ring restore broken it finds 2-27
mismatches per run: `test_the_fuzz_test_catches_a_broken_rule`.)
"""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest
import torch

from flintc.checkpoint.tokenizer import load_tokenizer, write_tokenizer
from flintc.config import FlintConfig
from flintc.runtime.compiled import CompiledRunner
from flintc.sampling import SamplingParams
from flintc.serve.engine import Engine, GenRequest, wait_idle

MASK = (1 << 62) - 1


def H(*xs) -> int:
    return int.from_bytes(hashlib.blake2b(repr(xs).encode(), digest_size=8).digest(), "little") & MASK


class FakeRunner:
    def __init__(self, config, max_batch, max_model_len, sizes=(8, 4), vocab_out=None):
        self.config, self.device = config, torch.device("cpu")
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.sizes = self.prefill_sizes = sorted(sizes, reverse=True)
        self.prefill_chunk = self.sizes[0]
        self.W = config.sliding_window
        self.V = vocab_out or config.vocab_size
        self.kv = []
        for i in range(config.num_hidden_layers):
            rows = self.W if config.is_sliding_layer(i) else max_model_len + self.sizes[0]
            self.kv += [torch.zeros(max_batch, rows, dtype=torch.int64) for _ in range(2)]
        self.fail_decode_at = None
        self.decodes = 0

    # -- one chunk at positions p0..p0+T-1 of slot, exactly the reference's visibility
    def _chunk(self, slot, toks, p0):
        cfg, W = self.config, self.W
        T = len(toks)
        x = [H("emb", t) for t in toks]
        for i in range(cfg.num_hidden_layers):
            k_cache = self.kv[2 * i]
            sliding = cfg.is_sliding_layer(i)
            new_kv = [H("kv", i, xi) for xi in x]
            out = []
            for t in range(T):
                p = p0 + t
                seen = []
                if sliding:
                    for q in range(max(0, p - W + 1), p + 1):
                        if q < p0:
                            # ring row q % W is assumed to hold q (the runners' ring_pos formula)
                            seen.append((q, int(k_cache[slot, q % W])))
                        else:
                            seen.append((q, new_kv[q - p0]))
                else:
                    for q in range(0, p + 1):
                        seen.append((q, int(k_cache[slot, q]) if q < p0 else new_kv[q - p0]))
                out.append(H("layer", i, x[t], tuple(seen)))
            # write: full rows by position; ring rows of the last min(T, W) tokens
            for t in range(T):
                p = p0 + t
                if sliding:
                    if t >= T - min(T, W):
                        self.kv[2 * i][slot, p % W] = new_kv[t]
                        self.kv[2 * i + 1][slot, p % W] = new_kv[t]
                else:
                    self.kv[2 * i][slot, p] = new_kv[t]
                    self.kv[2 * i + 1][slot, p] = new_kv[t]
            x = out
        return x

    def _logits(self, xs):
        out = torch.full((len(xs), self.config.vocab_size), -10.0)
        for r, xv in enumerate(xs):
            out[r, xv % self.V] = 10.0
        return out

    pieces = CompiledRunner.prefill_pieces  # the generated runtime's own cut of a prompt into chunks

    def prefill(self, slot, token_ids, start=0, all_logits=False):
        ids = [int(t) for t in token_ids]
        assert 0 <= slot < self.max_batch and ids and start + len(ids) <= self.max_model_len
        outs = []
        for s, n, C in self.pieces(len(ids)):
            p0 = start + s
            pad = C - n
            saved = None
            if pad:
                rows = [(p % self.W) for p in range(p0 + n, p0 + C)]
                saved = [(t, rows, t[slot, rows].clone()) for i in range(self.config.num_hidden_layers)
                         if self.config.is_sliding_layer(i) for t in self.kv[2 * i:2 * i + 2]]
            x = self._chunk(slot, ids[s:s + n] + [0] * pad, p0)
            if saved:
                for t, rows, keep in saved:
                    t[slot, rows] = keep
            outs += x[:n]
        lg = self._logits(outs)
        return lg if all_logits else lg[-1]

    def decode(self, slots, token_ids, positions):
        self.decodes += 1
        if self.fail_decode_at is not None and self.decodes == self.fail_decode_at:
            raise RuntimeError("injected decode failure")
        assert len(set(slots)) == len(slots)
        xs = []
        for s, t, p in zip(slots, token_ids, positions):
            xs += self._chunk(s, [int(t)], int(p))
        return self._logits(xs)


def fresh_tokens(config, prompt, max_tokens, sizes):
    r = FakeRunner(config, 1, 512, sizes, vocab_out=250)
    out = []
    if max_tokens < 1:
        return out
    lg = r.prefill(0, prompt)
    pos = len(prompt)
    while True:
        t = int(lg.argmax())
        out.append(t)
        if len(out) >= max_tokens or pos + 1 >= r.max_model_len:
            return out
        lg = r.decode([0], [t], [pos])[0]
        pos += 1



@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, FlintConfig.preset("tiny").vocab_size)
    return load_tokenizer(d)


def run_workload(tokenizer, seed: int, rounds: int = 50, max_batch: int = 3, sizes=(8, 4)):
    """The random workload through an Engine with prefix caching over a FakeRunner.
    -> (requests checked, mismatches, the engine's stats, ring restores)."""
    rng = random.Random(seed)
    cfg = FlintConfig.preset("tiny")
    runner = FakeRunner(cfg, max_batch, 512, sizes, vocab_out=250)  # ids < 250: no special token
    restores = []
    engine = Engine(runner, tokenizer, enable_prefix_caching=True)
    real_restore = engine._restore_ring
    engine._restore_ring = lambda slot, saved: (restores.append(slot), real_restore(slot, saved))
    engine.start()
    W = cfg.sliding_window
    history, results = [], []

    def submit(prompt, max_tokens, **kw):
        outs, done, why = [], threading.Event(), []

        def emit(o):
            outs.extend(o.token_ids)
            if o.finished:
                why.append(o.error or o.finish_reason)
                done.set()

        req = GenRequest(prompt_ids=list(prompt), params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                        ignore_eos=True), emit=emit, **kw)
        engine.submit(req)
        return req, outs, done, why

    try:
        for _ in range(rounds):
            batch = []
            for _ in range(rng.choice([1, 1, 1, 2, max_batch + 2])):
                kind = rng.random()
                if history and kind < 0.2:  # next turn with the whole answer but its last token
                    p, o = history[-1]
                    prompt = p + o[:-1] + [rng.randrange(250) for _ in range(rng.randint(1, 12))]
                elif history and kind < 0.35:  # next turn: prompt + part of the answer + more
                    p, o = rng.choice(history)
                    prompt = p + o[:rng.randint(0, len(o))] + [rng.randrange(250) for _ in range(rng.randint(1, 12))]
                elif history and kind < 0.5:  # an earlier prompt again, or a prefix of it
                    p, _ = rng.choice(history)
                    prompt = p[:rng.randint(1, len(p))] if rng.random() < 0.5 else list(p)
                elif history and kind < 0.65:  # parts from an earlier prompt + answer anywhere
                    p, o = rng.choice(history)
                    full = p + o
                    prompt = full[:rng.randint(1, len(full))] + [rng.randrange(250) for _ in range(rng.randint(1, 6))]
                else:
                    prompt = [rng.randrange(250) for _ in range(rng.randint(1, 30))]
                kw = {}
                if rng.random() < 0.1:
                    kw["prompt_logprobs"] = 0
                if rng.random() < 0.1:
                    kw["cache_salt"] = rng.choice(["a", "b"])
                batch.append((prompt[:200], rng.choice([0, 1, 1, 2, 3, 5, 8, W + 3, 2 * W + 1, 25]), kw))
            if rng.random() < 0.05:
                runner.fail_decode_at = runner.decodes + rng.randint(1, 4)
            subs = [(p, mt, *submit(p, mt, **kw)) for p, mt, kw in batch]
            if rng.random() < 0.2 and subs:
                time.sleep(rng.random() * 0.01)
                engine.abort(rng.choice(subs)[2])
            for p, mt, req, outs, done, why in subs:
                assert done.wait(120), "a request never finished"
                results.append((p, mt, outs, why[-1]))
                if why[-1] in ("stop", "length"):
                    history.append((p, list(outs)))
            assert wait_idle(engine)
    finally:
        engine.shutdown()
    checked = [(p, mt, outs) for p, mt, outs, why in results if why in ("stop", "length")]
    bad = sum(outs != fresh_tokens(cfg, p, mt, sizes) for p, mt, outs in checked)
    return len(checked), bad, dict(engine.stats), len(restores)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_caching_never_changes_a_hash_models_tokens(tokenizer, seed):
    checked, bad, stats, restores = run_workload(tokenizer, seed)
    assert bad == 0, f"{bad} of {checked} requests differ from the same request run alone"
    assert checked > 60 and stats["cached_prompt_tokens"] > 100  # the cache was used, much


def test_the_workload_restores_saved_rings(tokenizer):
    assert sum(run_workload(tokenizer, s)[3] for s in range(3)) > 0


@pytest.mark.parametrize("broken", ["direct", "no_restore"])
def test_the_fuzz_test_catches_a_broken_rule(tokenizer, monkeypatch, broken):
    """The oracle is not vacuous: the sliding rule taken as always true, or the saved
    ring never copied back, give mismatches."""
    if broken == "direct":
        monkeypatch.setattr(Engine, "_direct", lambda self, M, L: True)
    else:
        monkeypatch.setattr(Engine, "_restore_ring", lambda self, slot, saved: None)
    bad = sum(run_workload(tokenizer, s)[1] for s in range(3))
    assert bad > 0
