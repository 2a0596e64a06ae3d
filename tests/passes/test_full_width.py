"""Every pass checked numerically at the full model's widths (H 2048, 32 / 4 heads of 128,
MoE width 512, dense width 10240) with few layers: layers 0-1 dense, 2 sliding MoE,
3 full-attention MoE. Experts and vocabulary are cut (16 and 1024) to fit a CI run."""

import pytest

from flintc.checkpoint.init import random_weights
from flintc.config import FlintConfig
from flintc.model.reference import FlintModel
from flintc.passes.pipeline import compile_step, step_options


@pytest.fixture(scope="module")
def model():
    cfg = FlintConfig.preset("full").replace(num_hidden_layers=4, n_routed_experts=16, vocab_size=1024)
    return FlintModel(cfg, random_weights(cfg, seed=5), max_positions=600)


@pytest.mark.parametrize("step,batch,tokens", [("decode", 2, None), ("prefill", 1, 8)])
def test_full_widths_every_pass_checked(model, step, batch, tokens):
    _, report = compile_step(model, step, batch=batch, tokens=tokens, cache_len=520, check_model=model,
                             options=step_options(step, {"attention_splits": 4}))
    for s in report.stages:
        assert s.check is not None and s.check.passed, (s.name, s.check.message)
    if step == "decode":
        assert report.stages[-1].kernels.per_kind == {"dense": 6, "moe": 7}
