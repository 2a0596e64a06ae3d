"""vLLM's prompt_logprobs in the engine, over both runners: the eager reference
(`ReferenceRunner`) and the generated runtime (`CompiledRunner`, a tiny BF16 build with
the torch backend). The engine prefills a request that asks for them one runner chunk
at a time with ``all_logits=True``; the entries must be those of the prompt's logits in
one prefill call (position i-1 predicting token i), and the generated tokens those of
the same request without prompt logprobs."""

from __future__ import annotations

import queue

import pytest
import torch

from flintc.checkpoint.loader import load_checkpoint
from flintc.checkpoint.tokenizer import load_tokenizer
from flintc.model.reference import FlintModel
from flintc.runtime.runner import ReferenceRunner
from flintc.sampling import SamplingParams
from flintc.serve.engine import Engine, GenRequest, PromptLogprob, prompt_logprobs

PROMPT = [(7 * i + 3) % 500 + 1 for i in range(45)]  # over several prefill chunks


@pytest.fixture(scope="module")
def ckpt(tiny_bf16_dir):
    return load_checkpoint(tiny_bf16_dir, progress=False)


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return load_tokenizer(ckpt.tokenizer_dir)


@pytest.fixture(scope="module")
def compiled_build(tmp_path_factory, ckpt):
    """A tiny BF16 build (torch backend, no checks) with 16-token prefill chunks: prefill
    sizes 16 and 8 (the tail, W = 9 rounds down), so PROMPT takes 16 + 16 + 8 + 5 padded."""
    from flintc.runtime.build import BuildOptions, compile_model

    out = tmp_path_factory.mktemp("build") / "bf16-c16"
    compile_model(ckpt, out, BuildOptions(max_batch=2, max_model_len=96, prefill_chunk=16, backend="torch",
                                          check=False, dump=False), progress=False, log=lambda m: None)
    return out


def make_runner(kind, ckpt, build=None):
    if kind == "reference":
        return ReferenceRunner(FlintModel(ckpt.config, ckpt.weights), max_batch=2, max_model_len=96,
                               prefill_chunk=16)
    from flintc.runtime.compiled import load_build

    return load_build(build, progress=False)


def run(engine, **kw):
    """Submit one GenRequest and collect its Outputs until it finishes."""
    got: queue.Queue = queue.Queue()
    engine.submit(GenRequest(emit=got.put, **kw))
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(got.get(timeout=120))
    assert outs[-1].error is None, outs[-1].error
    return outs


def expected(logits: torch.Tensor, ids: list[int], k: int) -> list:
    """From the logits [T, V] of a whole prompt: [None] + (token, logprob, rank, top k) per
    token after the first, computed here without the engine's code."""
    lsm = torch.log_softmax(logits.float(), -1)
    out = [None]
    for i in range(1, len(ids)):
        row, tok = lsm[i - 1], ids[i]
        vals, idx = row.topk(k)
        out.append((tok, float(row[tok]), int((row >= row[tok]).sum()), list(zip(idx.tolist(), vals.tolist()))))
    return out


@pytest.mark.parametrize("kind", ["reference", "compiled"])
def test_prompt_logprobs_match_one_prefill(kind, ckpt, tokenizer, request):
    """The engine's prompt logprobs, computed chunk by chunk, equal those of the logits of
    one prefill call over the whole prompt; they come with the first Output only; the
    greedy tokens are those of the request without them."""
    build = request.getfixturevalue("compiled_build") if kind == "compiled" else None
    runner = make_runner(kind, ckpt, build)
    whole = runner.prefill(1, PROMPT, all_logits=True)  # [T, V], slot 1 (the engine's first request takes 0)
    assert whole.shape == (len(PROMPT), ckpt.config.vocab_size)
    want = expected(whole, PROMPT, 3)
    engine = Engine(runner, tokenizer).start()
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = run(engine, prompt_ids=PROMPT, params=params, prompt_logprobs=3)
        plain = run(engine, prompt_ids=PROMPT, params=params)
    finally:
        engine.shutdown()
    got = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:] + plain)
    assert len(got) == len(PROMPT) and got[0] is None
    assert all(isinstance(p, PromptLogprob) for p in got[1:])
    assert [(p.token_id, p.logprob, p.rank, p.top) for p in got[1:]] == want[1:]
    assert [t for o in outs for t in o.token_ids] == [t for o in plain for t in o.token_ids]


def test_prompt_logprobs_zero_and_one_token(ckpt, tokenizer):
    """prompt_logprobs 0: each entry has no alternatives; a one-token prompt: [None]."""
    engine = Engine(make_runner("reference", ckpt), tokenizer).start()
    try:
        params = SamplingParams(temperature=0, max_tokens=1)
        got = run(engine, prompt_ids=PROMPT[:5], params=params, prompt_logprobs=0)[0].prompt_logprobs
        assert got[0] is None and [p.token_id for p in got[1:]] == PROMPT[1:5]
        assert all(p.top == [] and p.rank >= 1 and p.logprob <= 0 for p in got[1:])
        assert run(engine, prompt_ids=PROMPT[:1], params=params, prompt_logprobs=2)[0].prompt_logprobs == [None]
    finally:
        engine.shutdown()


def test_prompt_logprobs_rows_and_ranks():
    """prompt_logprobs(): vLLM's rank counts the tokens at or above the target (ties
    included); -inf rows give -inf; blocks of rows give what one block gives."""
    logits = torch.tensor([[2.0, 1.0, 1.0, float("-inf")], [0.0, 0.0, 0.0, 0.0], [5.0, 1.0, 3.0, 4.0]])
    got = prompt_logprobs(logits, [1, 2, 2], 2)
    assert [p.rank for p in got] == [3, 4, 3]
    assert [got[0].top[0][0], got[2].top[0][0]] == [0, 0]  # (row 1 is a four-way tie)
    assert got[0].top[0][1] == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))
    masked = prompt_logprobs(logits, [3, 0, 0], 1)
    assert masked[0].logprob == float("-inf") and masked[0].rank == 4
    assert [(p.token_id, p.logprob, p.rank, p.top) for p in prompt_logprobs(logits, [3, 0, 1], 2, rows=1)] == \
        [(p.token_id, p.logprob, p.rank, p.top) for p in prompt_logprobs(logits, [3, 0, 1], 2)]
    with pytest.raises(ValueError, match=r"logits must be \[2, V\]"):
        prompt_logprobs(logits, [1, 2], 1)
