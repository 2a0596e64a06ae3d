"""The decode and prefill pipelines end to end on tiny, pass by pass through the
manager (structure of the lowering passes, numerics, kernel counts); and the kernel
count of a full-width config on meta weights."""

from __future__ import annotations

import pytest

from flintc.checkpoint.dummy import dummy_weights
from flintc.config import FlintConfig
from flintc.graph.accounting import kernels_of
from flintc.graph.match import op_name
from flintc.model.reference import FlintModel
from flintc.passes.pipeline import compile_step, pipeline_for
from harness import TINY, compiled, tiny_model, tiny_nvfp4_model

MOE_SCHEDULE = ["flintc.norm_qkv_rope_kv", "flintc.decode_attention", "flintc.attention_combine",
                "flintc.gemv_residual", "flintc.norm_router", "flintc.moe_topk_gate_up",
                "flintc.moe_down_combine_residual"]
DENSE_SCHEDULE = ["flintc.norm_qkv_rope_kv", "flintc.decode_attention", "flintc.attention_combine",
                  "flintc.gemv_residual", "flintc.norm_gate_up_silu", "flintc.gemv_residual"]


def kernels_by_layer(gm):
    out = {}
    for n in gm.graph.nodes:
        if kernels_of(n):
            out.setdefault(n.meta["flintc_layer"], []).append(op_name(n))
    return out


@pytest.fixture(scope="module", params=["bf16", "nvfp4"])
def decode(request):
    return compiled("decode", request.param)


def test_decode_schedule_is_seven_and_six_kernels(decode):
    g, report = decode
    assert [s.name for s in report.stages[1:]] == [p.name for p in pipeline_for("decode")]
    assert all(s.check.passed for s in report.stages)
    layers = kernels_by_layer(g.gm)
    for i in range(TINY.num_hidden_layers):
        assert layers[i] == (MOE_SCHEDULE if TINY.is_moe_layer(i) else DENSE_SCHEDULE)
    # the head: the final norm, then the plain LM head (the default `split_lm_head_norm`)
    assert layers[-1] == ["flintc.embedding"] and \
        layers[TINY.num_hidden_layers] == ["flintc.rms_norm", "flintc.lm_head"]
    final = report.stages[-1].kernels
    assert final.per_kind == {"dense": 6, "moe": 7} and final.shared == 0
    assert final.per_forward == 2 * 6 + 2 * 7 + 3
    assert report.stages[0].kernels.per_forward > 10 * final.per_forward


def test_lowering_passes_are_bit_exact(decode):
    _, report = decode
    for s in report.stages:
        if s.name != "fuse_decode_attention":
            assert s.check.bit_exact, s.name
        assert s.check.experts_agree == 1.0


def test_prefill_pipeline():
    model = tiny_model()
    g, report = compile_step(model, "prefill", batch=1, tokens=20, cache_len=48, check_model=model)
    assert [s.name for s in report.stages[1:]] == [p.name for p in pipeline_for("prefill")]
    assert all(s.check.passed for s in report.stages)
    # bit-exact everywhere except the flash-attention prefill, which states a tolerance
    assert all(s.check.bit_exact for s in report.stages if s.name != "fuse_prefill_attention")
    names = {op_name(n) for n in g.gm.graph.nodes if n.op == "call_function"}
    assert {"flintc.gemm", "flintc.prefill_attention_kv", "flintc.moe_route", "flintc.lm_head"} <= names
    assert "aten.mm" not in names and "aten._softmax" not in names


@pytest.mark.parametrize("layer_types", [("full_attention",) * 4, ("sliding_attention",) * 4])
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_a_config_of_one_attention_kind_compiles(step, layer_types):
    """FLINT_SPEC: "Code must read layer_types from config.json, never assume it". With no
    sliding layer the model looked up the RoPE tables all the same (only sliding layers
    use them): a dead node, and every compile failed at capture ("dead node (its value is
    never used): index_1 = aten.index(rope_cos, positions)")."""
    from flintc.checkpoint.init import random_weights

    cfg = TINY.replace(layer_types=layer_types)
    model = FlintModel(cfg, random_weights(cfg, 0))
    tokens = None if step == "decode" else 12
    _, report = compile_step(model, step, batch=1, tokens=tokens, cache_len=32, check_model=model)
    assert report.passed and [s.name for s in report.stages[1:]] == [p.name for p in pipeline_for(step)]


def test_disabling_a_pass_keeps_the_rest_checked():
    model = tiny_model()
    _, report = compile_step(model, "decode", batch=1, cache_len=32, check_model=model,
                             disabled=["group_low_latency", "mark_pdl"])
    assert report.skipped == ["group_low_latency", "mark_pdl"]
    assert report.stages[-1].name == "lower_gemv" and report.stages[-1].check.passed


def test_full_width_kernel_counts_on_meta_weights():
    """Full widths (H 2048, 256 experts, V 151552), the first 7 layers (dense, sliding and
    full MoE), meta weights: 6 / 7 kernels per layer; 49 layers give 3 + 2*6 + 47*7 = 344
    (embedding, final norm, LM head; 343 with the fused norm_lm_head)."""
    full = FlintConfig.preset("full")
    cfg = full.replace(num_hidden_layers=7)
    model = FlintModel(cfg, dummy_weights(cfg, "nvfp4", "meta"), max_positions=1025)
    _, report = compile_step(model, "decode", batch=8, cache_len=1024)
    final = report.stages[-1].kernels
    assert final.per_kind == {"dense": 6, "moe": 7}
    assert final.per_forward == 3 + 2 * 6 + 5 * 7
    per_forward_49 = 3 + 2 * final.per_kind["dense"] + 47 * final.per_kind["moe"]
    assert per_forward_49 == 344 <= 346
    assert report.stages[0].kernels.per_forward > 1000 * 7 / 49


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fold_attention_combine_six_and_five_kernels(fmt):
    """The option `fold_attention_combine`: group_low_latency replaces decode_attention +
    attention_combine with decode_attention_combine (its reference composes the two), so
    the pass stays bit-exact and a layer runs 6 (MoE) / 5 (dense) kernels; the PDL marks
    put the sinks (a weight) before the wait and the caches and q after it."""
    model = tiny_model() if fmt == "bf16" else tiny_nvfp4_model()
    g, report = compile_step(model, "decode", batch=2, cache_len=32, check_model=model,
                             options={"fold_attention_combine": True})
    assert all(s.check.passed for s in report.stages)
    assert all(s.check.bit_exact for s in report.stages if s.name != "fuse_decode_attention")
    fused = ["flintc.norm_qkv_rope_kv", "flintc.decode_attention_combine"]
    layers = kernels_by_layer(g.gm)
    for i in range(TINY.num_hidden_layers):
        want = MOE_SCHEDULE if TINY.is_moe_layer(i) else DENSE_SCHEDULE
        assert layers[i] == fused + want[3:]
    final = report.stages[-1].kernels
    assert final.per_kind == {"dense": 5, "moe": 6}
    assert final.per_forward == 2 * 5 + 2 * 6 + 3
    node = next(n for n in g.gm.graph.nodes if op_name(n) == "flintc.decode_attention_combine")
    assert any(name.startswith("w_") and "sinks" in name for name in node.meta["pdl"]["before_wait"])
    assert all(not name.startswith("w_") for name in node.meta["pdl"]["after_wait"])


def test_split_lm_head_norm_one_kernel_more():
    """The option `split_lm_head_norm`: group_low_latency leaves the final rms_norm and the
    lm_head apart (no norm_lm_head), so the pass stays bit-exact, the layers keep their 7 / 6
    kernels and the head runs 2: one kernel more per forward; mark_pdl chains the norm like
    any other kernel (its weight before the wait, the last layer's output after it; the LM
    head's weight before, the normed rows after)."""
    model = tiny_model()
    g, report = compile_step(model, "decode", batch=2, cache_len=32, check_model=model,
                             options={"split_lm_head_norm": True})
    assert all(s.check.passed for s in report.stages)
    assert all(s.check.bit_exact for s in report.stages if s.name != "fuse_decode_attention")
    layers = kernels_by_layer(g.gm)
    for i in range(TINY.num_hidden_layers):
        assert layers[i] == (MOE_SCHEDULE if TINY.is_moe_layer(i) else DENSE_SCHEDULE)
    assert layers[TINY.num_hidden_layers] == ["flintc.rms_norm", "flintc.lm_head"]
    final = report.stages[-1].kernels
    assert final.per_kind == {"dense": 6, "moe": 7}
    assert final.per_forward == 2 * 6 + 2 * 7 + 2 + 1
    norm, head = (n for n in g.gm.graph.nodes if n.meta.get("flintc_layer") == TINY.num_hidden_layers
                  and kernels_of(n))
    assert norm.meta["pdl"]["before_wait"] == ["w_norm"] and len(norm.meta["pdl"]["after_wait"]) == 1
    assert head.meta["pdl"]["before_wait"] == ["w_lm_head"] and len(head.meta["pdl"]["after_wait"]) == 1
    _, default = compile_step(model, "decode", batch=2, cache_len=32)  # the default: the same
    assert default.stages[-1].kernels.per_forward == final.per_forward


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_fused_norm_lm_head_one_kernel_less(fmt):
    """{"split_lm_head_norm": False} (`flintc compile --no-split-lm-head-norm`):
    group_low_latency fuses the final rms_norm into the LM head (norm_lm_head, the norm
    recomputed per program), bit-exact, one kernel less per forward than the default."""
    model = tiny_model() if fmt == "bf16" else tiny_nvfp4_model()
    g, report = compile_step(model, "decode", batch=2, cache_len=32, check_model=model,
                             options={"split_lm_head_norm": False})
    assert all(s.check.passed for s in report.stages)
    assert all(s.check.bit_exact for s in report.stages if s.name != "fuse_decode_attention")
    layers = kernels_by_layer(g.gm)
    assert layers[TINY.num_hidden_layers] == ["flintc.norm_lm_head"]
    assert report.stages[-1].kernels.per_forward == 2 * 6 + 2 * 7 + 2


@pytest.mark.parametrize("which", ["model", "check_model"])
def test_compile_step_refuses_a_float64_model_up_front(which):
    """README's `FlintModel(config, weights, mode="float64")` handed to compile_step (as
    the model, or as the check model) failed deep inside a pass with an internal error
    ("fuse_rms_norm: unfused RMSNorm left at rsqrt", or a dtype mismatch in the numeric
    check); it is an InputError naming the argument and the mode, before the capture."""
    from flintc.errors import InputError

    from harness import random_weights

    bf16 = tiny_model()
    f64 = FlintModel(TINY, random_weights(TINY, 0), mode="float64")
    kwargs = {"model": f64, "check_model": None} if which == "model" else {"model": bf16, "check_model": f64}
    with pytest.raises(InputError, match=f"compile_step: {which} is a FlintModel in mode='float64'"):
        compile_step(kwargs["model"], "decode", batch=1, check_model=kwargs["check_model"], dump_dir=False)


def test_compile_step_refuses_a_check_model_of_another_config():
    from flintc.errors import InputError

    model = tiny_model()
    small = TINY.replace(num_hidden_layers=2, layer_types=TINY.layer_types[:2])
    other = FlintModel(small, dummy_weights(small, "bf16", "cpu"))
    with pytest.raises(InputError, match="check_model has another config"):
        compile_step(model, "decode", batch=1, check_model=other, dump_dir=False)


def test_compile_step_refuses_a_check_model_in_the_other_weight_format():
    """A check_model of the same config in the other weight format failed inside the
    numeric check as a bare KeyError of a buffer name; it is an InputError naming both."""
    from flintc.errors import InputError

    with pytest.raises(InputError, match="check_model holds nvfp4 weights, model bf16"):
        compile_step(tiny_model(), "decode", batch=1, check_model=tiny_nvfp4_model(), dump_dir=False)


def test_compile_step_checks_against_a_longer_context_config():
    """A check_model whose config differs only in max_position_embeddings (no weight the
    graph reads depends on it) checks every pass, as before the config check came."""
    from harness import random_weights

    w = random_weights(TINY, 0)
    model = FlintModel(TINY, w)
    longer = FlintModel(TINY.replace(max_position_embeddings=2 * TINY.max_position_embeddings), w)
    _, report = compile_step(model, "decode", batch=1, cache_len=32, check_model=longer, dump_dir=False)
    assert report.passed and all(s.check is not None and s.check.passed for s in report.stages)


@pytest.mark.parametrize("step, options, message", [
    ("decode", {"fold_attention_combine": "no"},
     "compile_step: options['fold_attention_combine']: expected True or False, got str 'no'"),
    ("decode", {"split_lm_head_norm": 1},
     "compile_step: options['split_lm_head_norm']: expected True or False, got int 1"),
    ("decode", {"fold_atention_combine": True},
     "compile_step: options: unknown option 'fold_atention_combine'; the options are attention_splits, "
     "full_attention_rows, fold_attention_combine, split_lm_head_norm"),
    ("decode", {"attention_splits": 2.5}, "compile_step: options['attention_splits']: expected an integer >= 1, "
     "got float 2.5"),
    ("decode", {"attention_splits": "2"}, "compile_step: options['attention_splits']: expected an integer >= 1, "
     "got str '2'"),
    ("decode", {"attention_splits": True}, "compile_step: options['attention_splits']: expected an integer >= 1, "
     "got bool True"),
    ("decode", {"attention_splits": 0}, "compile_step: options['attention_splits']: expected an integer >= 1, "
     "got int 0"),
    ("decode", {"attention_splits": 1000},
     "compile_step: options: attention_splits 1000 is more than the 64 rows of a full-attention cache (cache_len): "
     "a split gets at least one row; use at most 64"),
    ("decode", {"attention_splits": 100, "full_attention_rows": 80},
     "compile_step: options: attention_splits 100 is more than the 80 rows of a full-attention cache "
     "(full_attention_rows)"),
    ("decode", ["attention_splits"], "compile_step: options: expected a dict of pass options, got a list of str"),
    ("prefill", {"fold_attention_combine": True},
     "compile_step: options: fold_attention_combine applies only to the decode pipeline (fold the split-KV combine "
     "into the attention kernel (group_low_latency)), not to the prefill step; drop it"),
    ("prefill", {"attention_splits": 2}, "compile_step: options: attention_splits applies only to the decode "
     "pipeline"),
    ("prefill", {"split_lm_head_norm": False}, "compile_step: options: split_lm_head_norm applies only to the "
     "decode pipeline"),
])
def test_compile_step_checks_its_options(monkeypatch, step, options, message):
    """Regression: compile_step took any options: "no" folded the combine (truthy), a
    misspelt name was ignored, 2.5 / "2" / True splits became 2 / 2 / 1, decode options for
    a prefill step (which the CLI refuses) were accepted, and 1000 splits of a 64-row cache
    compiled (960 empty chunks launched and combined). Each is an InputError naming the
    option, before the capture."""
    from flintc.errors import InputError
    import flintc.passes.pipeline as pipeline

    monkeypatch.setattr(pipeline, "capture", lambda *a, **k: pytest.fail("captured before the options' check"))
    with pytest.raises(InputError) as exc:
        compile_step(tiny_model(), step, batch=1, cache_len=64, options=options)
    assert str(exc.value).startswith(message), str(exc.value)


def test_compile_step_takes_numpy_values_and_a_ring_split_count(monkeypatch):
    """A NumPy bool and integer are taken (as flintc.compile's flags), as plain bool / int;
    attention_splits up to the full-attention rows is taken though tiny's sliding ring is
    shorter (W = 9: `num_splits_for` gives a ring the count given)."""
    import numpy as np

    from flintc.passes.pipeline import check_options

    options = {"fold_attention_combine": np.True_, "split_lm_head_norm": np.bool_(False),
               "attention_splits": np.int64(40)}
    checked = check_options(options, "decode", 64, TINY)
    assert checked == {"fold_attention_combine": True, "split_lm_head_norm": False, "attention_splits": 40}
    assert [type(v) for v in checked.values()] == [bool, bool, int]
    assert TINY.sliding_window < 40
    assert check_options(None, "prefill", 64, TINY) == {}
