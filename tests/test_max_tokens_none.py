"""`SamplingParams(max_tokens=None)` in the Python API, as vLLM's: generate until the
context is full, each prompt of n tokens getting max_model_len - n (vLLM's
`get_max_tokens`; `flintc serve`'s `"max_tokens": null`, whose agreement is checked in
tests/serve/test_stop_strings_agree.py). On the tiny BF16 checkpoint."""

from __future__ import annotations

import pytest

from flintc.errors import InputError
from flintc.sampling import SamplingParams
from harness import checkpoint_model_and_tokenizer

LEN = 40  # max_model_len of the runs below


@pytest.fixture(scope="module")
def tiny(tiny_bf16_dir):
    """(FlintModel, FlintTokenizer)."""
    return checkpoint_model_and_tokenizer(tiny_bf16_dir)


def test_none_is_accepted_and_other_values_still_refused():
    p = SamplingParams(max_tokens=None, min_tokens=5)
    assert p.max_tokens is None and p.min_tokens == 5
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(InputError, match="sampling field 'max_tokens' must be an integer >= 0, or None"):
            SamplingParams(max_tokens=bad)
    with pytest.raises(InputError, match=r"'min_tokens' \(5\) must be at most max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_for_prompt():
    """An int max_tokens: the params themselves; None: the rest of the context, checked
    against min_tokens and a prompt that leaves no room (InputError naming the field)."""
    p = SamplingParams(max_tokens=7)
    assert p.for_prompt(30, LEN) is p
    q = SamplingParams(max_tokens=None, min_tokens=3, seed=4, stop=["x"])
    r = q.for_prompt(30, LEN)
    assert r.max_tokens == LEN - 30 and (r.min_tokens, r.seed, r.stop) == (3, 4, ("x",)) and q.max_tokens is None
    assert q.for_prompt(37, LEN).max_tokens == 3
    with pytest.raises(InputError, match=r"'min_tokens' of prompt 2 \(3\) must be at most max_tokens, which is "
                                         r"None: the rest of the context, 2 tokens after the prompt's 38"):
        q.for_prompt(38, LEN, " of prompt 2")
    with pytest.raises(InputError, match="'max_tokens' is None .* 40 tokens leave no room"):
        q.for_prompt(40, LEN)
    with pytest.raises(ValueError, match="below these params' min_tokens 3"):
        q.with_max_tokens(2)
    with pytest.raises(ValueError, match="below these params' 7"):
        p.with_max_tokens(6)


def test_reference_generate_runs_each_prompt_to_the_end_of_its_context(tiny):
    """Prompts of different lengths, max_tokens None: each generates LEN minus its length
    ("length"), the tokens those of max_tokens = that number given per prompt (greedy)."""
    from flintc.model.generate import generate

    model, tok = tiny
    prompts = [tok.encode("Hello"), tok.encode("Once upon a time there was a fox")]
    assert len(prompts[0]) != len(prompts[1])
    r = generate(model, prompts, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                 eos_token_id=tok.eos_token_id, max_model_len=LEN, tokenizer=tok)
    assert [len(o) for o in r.output_ids] == [LEN - len(p) for p in prompts]
    assert r.finish_reasons == ["length", "length"] and r.stop_reasons == [None, None]
    each = generate(model, prompts, [SamplingParams(temperature=0, max_tokens=LEN - len(p), ignore_eos=True)
                                     for p in prompts],
                    eos_token_id=tok.eos_token_id, max_model_len=LEN, tokenizer=tok)
    assert each.output_ids == r.output_ids and each.texts == r.texts
    # one prompt None, one an int: the cache is the whole context, the int one stops at its count
    mixed = generate(model, prompts, [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                                      SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)],
                     eos_token_id=tok.eos_token_id, max_model_len=LEN)
    assert [len(o) for o in mixed.output_ids] == [LEN - len(prompts[0]), 3]
    # end-of-text still stops it ("stop" before the end of the context)
    stopped = generate(model, prompts[:1], SamplingParams(temperature=0, max_tokens=None,
                                                          allowed_token_ids=[tok.eos_token_id]),
                       eos_token_id=tok.eos_token_id, max_model_len=LEN)
    assert stopped.output_ids == [[tok.eos_token_id]] and stopped.finish_reasons == ["stop"]


def test_generate_with_runner_errors_name_the_prompt(tiny):
    """min_tokens over a prompt's rest of the context is an InputError before any prompt
    runs, naming the prompt; a prompt that fills the context is check_prompt's error."""
    from flintc.runtime.generate import generate_with_runner
    from flintc.runtime.runner import ReferenceRunner

    model, tok = tiny
    runner = ReferenceRunner(model, max_batch=2, max_model_len=LEN)
    short, long = [5, 6, 7], [5] * 30
    params = SamplingParams(temperature=0, max_tokens=None, min_tokens=LEN - 30 + 1)
    with pytest.raises(InputError, match=r"'min_tokens' of prompt 1 \(11\) must be at most max_tokens, which is "
                                         r"None: the rest of the context, 10 tokens"):
        generate_with_runner(runner, [short, long], params, eos_token_id=tok.eos_token_id)
    r = generate_with_runner(runner, [short, long], SamplingParams(temperature=0, max_tokens=None,
                                                                   min_tokens=LEN - 30, ignore_eos=True))
    assert [len(o) for o in r.output_ids] == [LEN - 3, LEN - 30]
    with pytest.raises(InputError, match="more than the maximum of 39"):
        generate_with_runner(runner, [[5] * LEN], SamplingParams(max_tokens=None))


def test_compiled_build_takes_none(tiny_bf16_dir, tmp_path):
    """`flintc.compile(...).generate(max_tokens=None)`: the rest of the build's
    max_model_len, as the reference."""
    import flintc

    m = flintc.compile(tiny_bf16_dir, out=tmp_path / "b", check=False, dump=False, backend="torch",
                       max_batch=2, max_model_len=32)
    ids = m.tokenizer.encode("Hello world")
    r = m.generate([ids], temperature=0, max_tokens=None, ignore_eos=True)
    assert len(r.output_ids[0]) == 32 - len(ids) and r.finish_reasons == ["length"]
    with pytest.raises(InputError, match="'min_tokens'"):
        m.generate([ids], temperature=0, max_tokens=None, min_tokens=32)
