"""The Engine pairs its tokenizer with the model by `FlintTokenizer.check_fits_model`,
the one tokenizer/vocabulary rule of every entry point (as vLLM): a tokenizer may have
fewer tokens than the model's embedding rows (a padded vocabulary), never an id of the
model's vocab_size or more. The Engine required equal sizes (a ValueError), while
`flintc.load` took a smaller tokenizer."""

from __future__ import annotations

import dataclasses
import queue

import pytest

from flintc.checkpoint.loader import load_checkpoint
from flintc.checkpoint.tokenizer import load_tokenizer
from flintc.config import FlintConfig
from flintc.errors import CheckpointError
from flintc.model.reference import FlintModel
from flintc.runtime.runner import ReferenceRunner
from flintc.sampling import SamplingParams
from flintc.serve.engine import Engine, GenRequest


def _runner(vocab_size: int) -> ReferenceRunner:
    config = dataclasses.replace(FlintConfig.preset("tiny"), vocab_size=vocab_size, source="m/config.json")
    ckpt = load_checkpoint(None, load_format="dummy", config=config, progress=False)
    return ReferenceRunner(FlintModel(ckpt.config, ckpt.weights), max_batch=1, max_model_len=32)


def test_engine_serves_a_model_with_more_rows_than_tokens(tiny_bf16_dir):
    """A 512-token tokenizer with a model of 1024 rows: the Engine starts, and a token
    of the padding (600, the tokenizer has none) adds no text, where it would have
    raised "outside the vocabulary" mid-request."""
    tok = load_tokenizer(tiny_bf16_dir)
    assert tok.vocab_size == 512
    ids = tok.encode("hello world")
    engine = Engine(_runner(1024), tok).start()
    try:
        got: queue.Queue = queue.Queue()
        engine.submit(GenRequest(prompt_ids=[1, 2, 3], emit=got.put, forced=[ids[0], 600, *ids[1:]],
                                 params=SamplingParams(temperature=0, max_tokens=len(ids) + 1, ignore_eos=True)))
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(got.get(timeout=120))
    finally:
        engine.shutdown()
    assert outs[-1].error is None, outs[-1].error
    assert [t for o in outs for t in o.token_ids] == [ids[0], 600, *ids[1:]]
    assert "".join(o.text for o in outs) == "hello world"


def test_engine_refuses_a_tokenizer_with_ids_past_the_model(tiny_bf16_dir):
    """A tokenizer with ids the model has no row for: CheckpointError naming the
    tokenizer file and the model's config (a ValueError "tokenizer has 512 tokens, the
    model 500" before)."""
    with pytest.raises(CheckpointError) as err:
        Engine(_runner(500), load_tokenizer(tiny_bf16_dir))
    assert str(err.value).startswith(f"{tiny_bf16_dir / 'tokenizer.json'}: token ids up to 511, but m/config.json "
                                     "has vocab_size 500: expected every id below it")


def test_pairing_again_does_not_walk_the_vocabulary_again(tiny_bf16_dir):
    """`flintc serve` pairs its tokenizer twice: with the build's (or config.json's)
    vocab_size before the weights load, then in its Engine with the config the runner
    loaded. The largest id is found once (a walk of the vocabulary, ~0.2 s for 150k
    tokens, was done at each pairing); each pairing still checks."""
    tok = load_tokenizer(tiny_bf16_dir)
    walks = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def get_vocab(self, **kw):
            walks.append(kw)
            return self.inner.get_vocab(**kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    tok._tok = Counting(tok._tok)
    tok.check_fits_model(1024, "BUILD/build.json")  # as flintc serve's make_runner(check_vocab=...)
    Engine(_runner(1024), tok)
    with pytest.raises(CheckpointError, match="token ids up to 511, but m/config.json has vocab_size 500"):
        Engine(_runner(500), tok)
    assert len(walks) == 1, walks


def test_server_takes_the_padded_models_ids(tiny_bf16_dir, serve_kit):
    """A 512-token tokenizer served with a 1024-row model: the ids the model may sample
    beyond the tokenizer (512..1023) are ids of the API too (/detokenize gives "" for
    them, logit_bias / allowed_token_ids / prompt ids take them), as the sampled ones
    come back in responses; ids of 1024 and more are still refused, naming the range."""
    import json

    from flintc.serve.app import ServeOptions

    ckpt = load_checkpoint(None, load_format="dummy", progress=False,
                           config=dataclasses.replace(FlintConfig.preset("tiny"), vocab_size=1024))
    tok = load_tokenizer(tiny_bf16_dir)
    run = serve_kit.start_server(FlintModel(ckpt.config, ckpt.weights), tok, ServeOptions("m"),
                                 max_batch=1, max_model_len=64)
    try:
        assert run.post("/detokenize", {"model": "m", "tokens": [tok.encode("hi")[0], 600]})[0] == 200
        status, body = run.post("/detokenize", {"model": "m", "tokens": [600]})
        assert (status, body["prompt"]) == (200, "")
        status, body = run.post("/v1/completions", {"model": "m", "prompt": [1, 2, 700], "max_tokens": 1,
                                                    "temperature": 0, "allowed_token_ids": [900],
                                                    "logit_bias": {"900": 5}})
        assert status == 200, body
        assert body["choices"][0]["text"] == "", "the only allowed id, 900, has no token: no text"
        status, body = run.post("/detokenize", {"model": "m", "tokens": [1024]})
        assert status == 400 and "[0, 1024)" in json.dumps(body), body
    finally:
        serve_kit.stop_server(run)
