"""Structured outputs' batched masks (`flintc.structured.allowed_words_batch`,
`allowed_batch`, and `flintc.sampling.adjust_logits` with several constrained rows):
llguidance fills every row's mask into one buffer (row by row, or in one parallel call), and each row must be exactly
what that row's `GrammarMatcher.allowed_words` / `allowed` make one by one, for several
grammars at several states (the start, part-way, accepting, finished), with the stop
tokens (one past the tokenizer's vocabulary), a thinking block's gate, a grammar that
spells out the end-of-text token, and rows without a grammar, on the tiny checkpoint's
tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flintc.sampling import SamplingParams, StructuredOutputsParams, TokenHistory, adjust_logits

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}

# (spec, a text it accepts): the matchers are advanced over prefixes of its tokens
CASES = [
    (StructuredOutputsParams(regex="a+b?"), "aab"),
    (StructuredOutputsParams(regex="(ab)+"), "ababab"),
    (StructuredOutputsParams(choice=["yes", "no", "maybe not"]), "maybe not"),
    (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), '{"ok":true,"n":42}'),
    (StructuredOutputsParams(json_object=True), '{"a": [1, 2], "b": "x"}'),
    (StructuredOutputsParams(grammar='start: "x" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'), "x12,345,6"),
]


@pytest.fixture(scope="module")
def tok(tiny_bf16_dir):
    from flintc.checkpoint.tokenizer import load_tokenizer

    return load_tokenizer(tiny_bf16_dir)


def _matchers(tok, stops):
    """GrammarMatchers of every CASE at every prefix of its text's tokens (the start to
    finished), each with the given stop tokens."""
    from flintc.structured import GrammarMatcher

    out = []
    for spec, text in CASES:
        ids = tok.encode(text)
        for k in range(len(ids) + 1):
            g = GrammarMatcher(spec, tok, stops)
            g.advance(ids[:k])
            out.append(g)
    return out


def _gated(tok, stops):
    """GrammarMatchers behind a thinking block's gate ("start", and "content" after the
    block), and one whose grammar spells out the end-of-text token (llguidance's mask
    holds only it)."""
    from flintc.structured import GrammarMatcher, ReasoningGate

    start, end = tok.special_token_ids["<think>"], tok.special_token_ids["</think>"]
    spec = StructuredOutputsParams(choice=["yes", "no"])
    a = GrammarMatcher(spec, tok, stops, reasoning=ReasoningGate("start", start, end))
    b = GrammarMatcher(spec, tok, stops, reasoning=ReasoningGate("reasoning", start, end))
    b.advance(tok.encode("hm") + [end] + tok.encode("y"))
    c = GrammarMatcher(StructuredOutputsParams(choice=["<|endoftext|>"]), tok, stops)
    return [a, b, c]


def _check_words(tok, gs, parallel=True):
    from flintc.structured import allowed_words_batch

    single = []
    for g in gs:
        w = g.allowed_words()
        single.append((w, g._eos_as_text))
        g._eos_as_text = None  # the batch must set it again
    batch = allowed_words_batch(gs, parallel=parallel)
    assert batch.dtype == np.int32 and batch.shape[0] == len(gs)
    for i, (g, (w, eos_as_text)) in enumerate(zip(gs, single)):
        n = min(len(w), batch.shape[1])
        assert np.array_equal(batch[i, :n], w[:n]) and not w[n:].any() and not batch[i, n:].any(), i
        assert g._eos_as_text == eos_as_text, i
    return single


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("extra_stop", [None, 600])
def test_batched_words_equal_row_by_row(tok, extra_stop, parallel):
    """Every grammar at every state, in one batch (filled by one parallel llguidance call,
    or row by row into the one buffer): the same words (and the same end-of-text note) as
    `allowed_words` row by row; a stop id past the tokenizer's vocabulary (600 > 512)
    widens every row alike."""
    stops = {tok.eos_token_id, tok.special_token_ids["<|user|>"]} | ({extra_stop} if extra_stop else set())
    gs = _matchers(tok, stops) + _gated(tok, stops)
    single = _check_words(tok, gs, parallel)
    # the states cover: masks of several tokens, stops allowed (accepting) and not, a
    # finished grammar (only the stops), the gate's start token, the end-of-text-as-text case
    bits = [set(np.nonzero(np.unpackbits(w.view(np.uint8), bitorder="little"))[0].tolist()) for w, _ in single]
    assert any(stops <= b and len(b) > len(stops) for b in bits)
    assert any(b == stops for b in bits) and any(not stops & b and b for b in bits)
    assert any(tok.special_token_ids["<think>"] in b for b in bits)
    assert any(e for _, e in single)
    # two or three matchers, and one (the path `allowed` takes), in other orders
    for sub in (gs[:2], gs[3:6][::-1], gs[-1:], gs[::5]):
        _check_words(tok, sub, parallel)


@pytest.mark.parametrize("parallel", [True, False, None])
@pytest.mark.parametrize("vocab", [512, 600, 500])
def test_batched_masks_equal_row_by_row(tok, vocab, parallel):
    """`allowed_batch` over rows with grammars, without (None) and inside a thinking
    block: each constrained row the bool mask `allowed` makes (and records for
    `masked_for_logprobs`), the others every token; a vocabulary wider than the
    tokenizer's (ids past it never allowed) or narrower."""
    from flintc.structured import GrammarMatcher, ReasoningGate, allowed_batch

    stops = {tok.eos_token_id}
    gs = _matchers(tok, stops)[::3] + _gated(tok, stops)
    start, end = tok.special_token_ids["<think>"], tok.special_token_ids["</think>"]
    thinking = GrammarMatcher(CASES[0][0], tok, stops, reasoning=ReasoningGate("reasoning", start, end))
    rows = [None] + gs[:4] + [thinking, None] + gs[4:]
    want = [None if g is None else g.allowed(vocab, "cpu") for g in rows]
    got = allowed_batch(rows, vocab, "cpu", parallel=parallel)
    assert got.dtype == torch.bool and got.shape == (len(rows), vocab)
    for b, (g, w) in enumerate(zip(rows, want)):
        if w is None:
            assert got[b].all(), b
            assert g is None or g._mask is None
        else:
            assert torch.equal(got[b], w), b
            assert torch.equal(g._mask, w) and g._mask_at == g.consumed
    assert allowed_batch([None, thinking], vocab, "cpu", parallel=parallel) is None


@pytest.mark.parametrize("parallel", [False, True])
def test_adjust_logits_batch_equals_row_by_row(tok, parallel, monkeypatch):
    """`adjust_logits` on a batch with several constrained rows (and other masks on
    some: allowed_token_ids, logit_bias) gives each row what it gives that row alone; on
    its masks filled in one thread (the default) and with llguidance's parallel fill
    alike."""
    from flintc import structured
    from flintc.structured import GrammarMatcher

    calls = []
    real = structured.allowed_batch

    def spy(grammars, vocab, device, parallel=None):
        calls.append(parallel)
        return real(grammars, vocab, device, parallel=True if force_parallel else parallel)

    force_parallel = parallel
    monkeypatch.setattr(structured, "allowed_batch", spy)

    stops = [tok.eos_token_id]
    V = 520
    x = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    specs = [CASES[0], CASES[3], None, CASES[5], CASES[2], CASES[3]]
    extras = [{}, {"logit_bias": {7: 3.0}}, {"allowed_token_ids": [1, 2, 3]}, {}, {"allowed_token_ids": [5, 9]}, {}]
    params, hist, alone = [], [], []
    for b, (case, extra) in enumerate(zip(specs, extras)):
        so = case[0] if case else None
        out = tok.encode(case[1])[:b % 3] if case else []
        params.append(SamplingParams(temperature=0, structured_outputs=so, **extra))
        mk = (lambda: GrammarMatcher(so, tok, stops)) if so else (lambda: None)
        hist.append(TokenHistory([1], list(out), stops, grammar=mk()))
        alone.append(TokenHistory([1], list(out), stops, grammar=mk()))
    got = adjust_logits(x, params, hist)
    assert calls == [None]  # one batch call, the device's default (the CPU: one thread)
    for b in range(6):
        assert torch.equal(got[b], adjust_logits(x[b:b + 1], [params[b]], [alone[b]])[0]), b
    assert calls == [None]  # a row alone takes GrammarMatcher.allowed


def test_token_table_tokenizer_equals_the_json_one(tok):
    """`ll_tokenizer` hands a FlintTokenizer to llguidance as its token table (the JSON
    path takes minutes at the full vocabulary): the same bytes, special ids and
    end-of-text per id as llguidance's own reading of tokenizer.json, and the same masks
    for every CASE at every state."""
    import llguidance

    from flintc.structured import grammar_text, ll_tokenizer

    table = ll_tokenizer(tok)
    from_json = llguidance.LLTokenizer(tok._tok.to_str(), eos_token=tok.eos_token_id)
    assert table is not from_json and table.vocab_size == from_json.vocab_size == tok.vocab_size
    assert table.eos_tokens == from_json.eos_tokens == [tok.eos_token_id]
    ids = list(range(tok.vocab_size))
    assert [table.decode_bytes([i]) for i in ids] == [from_json.decode_bytes([i]) for i in ids]
    assert [table.is_special_token(i) for i in ids] == [from_json.is_special_token(i) for i in ids]
    assert len(tok.all_special_ids) > 10 and all(table.is_special_token(i) for i in tok.all_special_ids)
    for spec, text in CASES:
        toks = tok.encode(text)
        assert table.tokenize_str(text) == from_json.tokenize_str(text) == toks
        grammar = grammar_text(spec)
        a, b = llguidance.LLMatcher(table, grammar), llguidance.LLMatcher(from_json, grammar)
        for k in range(len(toks) + 1):
            assert bytes(a.compute_bitmask()) == bytes(b.compute_bitmask()), (spec.kind, k)
            assert a.is_accepting() == b.is_accepting()
            if k < len(toks):
                assert a.consume_token(toks[k]) and b.consume_token(toks[k])
