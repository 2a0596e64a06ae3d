"""The whole pipeline on tiny: the final graphs against the captured ones.

A 40-token prefill, then 64 decode steps (the 9-slot sliding windows wrap many
times). Each decode step runs the captured and the final graph from the same KV
cache state and compares logits and every cache under the pipeline's stated
tolerance (the decode-attention pass's, the loosest of the pipeline), judging
tokens whose expert selection flips separately (FLINT_SPEC section 3). The
reference's next token and cache state carry the run forward.
"""

from __future__ import annotations

import pytest
import torch

from flintc.graph.compare import compare_graphs, run_graph
from flintc.graph.trace import capture
from flintc.passes.fuse_decode_attention import DecodeAttentionFusionPass
from flintc.passes.fuse_prefill_attention import PrefillAttentionFusionPass
from flintc.passes.pipeline import compile_step
from harness import TINY, tiny_model, tiny_nvfp4_model

PROMPT, STEPS, CACHE = 40, 64, 128


@pytest.mark.parametrize("fmt,batch,steps", [("bf16", 1, STEPS), ("bf16", 3, STEPS), ("nvfp4", 2, 16)])
def test_final_graph_tracks_captured_graph(fmt, batch, steps):
    """NVFP4 runs 16 steps: its captured graph dequantizes every weight each step, which
    is slow on a CPU; the packing is already covered bit-exactly pass by pass."""
    model = tiny_model() if fmt == "bf16" else tiny_nvfp4_model()
    names = [f"{kv}_cache_{i}" for i in range(TINY.num_hidden_layers) for kv in "kv"]
    pre_ref = capture(model, "prefill", batch=batch, tokens=PROMPT, cache_len=CACHE)
    pre_new, _ = compile_step(model, "prefill", batch=batch, tokens=PROMPT, cache_len=CACHE)
    dec_ref = capture(model, "decode", batch=batch, cache_len=CACHE)
    dec_new, dec_report = compile_step(model, "decode", batch=batch, cache_len=CACHE)
    assert dec_report.stages[-1].kernels.per_kind == {"dense": 6, "moe": 7}
    w = pre_ref.weight_args(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY.vocab_size, (batch, PROMPT), generator=g)
    positions = torch.arange(PROMPT)[None].expand(batch, PROMPT).contiguous()
    slots = torch.randperm(batch, generator=g)
    kv = model.new_kv_cache(batch, CACHE)

    # Prefill: bit-exact except the flash-attention prefill, which states a tolerance.
    res = compare_graphs(pre_new.gm, pre_ref.gm, w, (ids, positions, slots, kv),
                         PrefillAttentionFusionPass.expectation, names)
    assert res.passed, res.message
    (logits, _), kv, _ = run_graph(pre_ref.gm, w, (ids, positions, slots, kv))  # each sequence's last row

    expectation = DecodeAttentionFusionPass.expectation
    flips = worst = 0.0
    token = logits.argmax(-1)
    for step in range(steps):
        inputs = (token[:, None], torch.full((batch, 1), PROMPT + step), slots, kv)
        ref_run, new_run = run_graph(dec_ref.gm, w, inputs), run_graph(dec_new.gm, w, inputs)
        res = compare_graphs(dec_new.gm, dec_ref.gm, w, inputs, expectation, names, ref_run, new_run)
        assert res.passed, f"step {step}: {res.message}; first differing node {res.first_differing_node}"
        worst = max(worst, res.max_abs)
        flips += 1 - (res.experts_agree if res.experts_agree is not None else 1)
        logits, kv, _ = ref_run
        token = logits[:, 0].argmax(-1)
    print(f"{fmt} B={batch}: worst |logit diff| over {steps} steps {worst:.3g}, "
          f"mean expert-flip share {flips / steps:.2%}")
