"""`scripts/gpu_runtime.py`'s flip-aware comparison, run on the CPU at the tiny config.

The script compares the compiled runtime with the reference model step by step and
logs the experts each side selects (FLINT_SPEC section 3): a step outside the tolerance
is a `flip` when an expert choice of that sequence differed at or before it, else a
`FAIL`. Here the same comparison function runs on a tiny build (torch backend, CPU):
unperturbed, every step is `ok`; with the reference's router bias perturbed from a
given decode step on (the bias only selects experts, so every difference comes from a
different selection), the steps before it are `ok` and those after it are `flip`, never
`FAIL`; with the reference's LM head perturbed (no routing change), they are `FAIL`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from flintc.checkpoint.loader import load_checkpoint
from flintc.model.reference import FlintModel
from flintc.runtime.compiled import load_build
from flintc.runtime.runner import ReferenceRunner

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_runtime.py"
MAX_LEN = 64
PROMPTS = [[(7 * i + 3) % 500 + 1 for i in range(19)], [11, 12, 13, 14, 15, 16, 17, 300, 2, 451, 9]]
STEPS = 8


def _load_script():
    spec = importlib.util.spec_from_file_location("flintc_gpu_runtime_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def script():
    return _load_script()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny config's dummy BF16 weights and a build of them named as the script's
    --builds / --build-prefix expect (<root>/tiny-bf16-b1). Decode buckets 1 and 3: the two
    prompts decode in the 3-bucket with a padding row (dropped from the expert log), and
    their last prefill chunks are padded too."""
    from flintc.runtime.build import BuildOptions, compile_model

    root = tmp_path_factory.mktemp("gpu_runtime")
    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt="bf16", progress=False)
    compile_model(ckpt, root / "tiny-bf16-b1", BuildOptions(max_batch=3, decode_buckets=(1, 3), max_model_len=MAX_LEN,
                                                             backend="torch", device="cpu", check=False,
                                                             dump=False),
                  progress=False, log=lambda m: None)
    return root, ckpt


def _runner(tiny):
    root, ckpt = tiny
    return load_build(root / "tiny-bf16-b1", ckpt=ckpt, device="cpu", progress=False)


def _reference(ckpt, weights=None, cls=ReferenceRunner):
    model = FlintModel(ckpt.config, weights or ckpt.weights, max_positions=MAX_LEN + 16)
    return cls(model, max_batch=2, max_model_len=MAX_LEN, prefill_chunk=8)


def test_unperturbed_every_step_ok(script, tiny):
    import flintc.model.ops as model_ops

    _, ckpt = tiny
    runner = _runner(tiny)
    route_topk = model_ops.route_topk
    routing = {(st, op): getattr(t, op) for st, t in runner._tables.items() for op in script.ROUTING_OPS}
    records = script.compare_run(runner, _reference(ckpt), PROMPTS, STEPS)
    moe_layers = sum(ckpt.config.is_moe_layer(i) for i in range(ckpt.config.num_hidden_layers))
    assert moe_layers == 2
    assert [(r["step"], r["row"]) for r in records] == [(0, 0), (0, 1)] + [
        (s, j) for s in range(1, STEPS + 1) for j in range(2)]
    # every prompt token's and every decode row's choice in every MoE layer was compared
    assert [r["choices"] for r in records[:2]] == [moe_layers * len(p) for p in PROMPTS]
    assert all(r["choices"] == moe_layers for r in records[2:])
    assert all(r["topk_vs_own_logits"] == 0 for r in records[2:])  # decode: the fused op's own top-k
    assert [r["verdict"] for r in records] == ["ok"] * len(records)
    assert all(r["flips"] == 0 and r["first_flip"] is None and r["within"] for r in records)
    s = script.summarize(records)
    assert s["passed"] and (s["ok"], s["flip"], s["fail"], s["flipped_choices"]) == (len(records), 0, 0, 0)
    # the hooks are gone and the runner is back to its own settings
    assert model_ops.route_topk is route_topk
    assert all(getattr(runner._tables[st], op) is fn for (st, op), fn in routing.items())


def test_router_bias_perturbed_on_one_side_is_flip_not_fail(script, tiny):
    """From decode step FROM on, the reference's routing bias of both MoE layers pushes
    experts 0..K-1 to the top: its selections differ, its logits move far outside the
    tolerance, and every such step is a `flip`."""
    _, ckpt = tiny
    c = ckpt.config
    FROM = 4
    names = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(c.num_hidden_layers)
             if c.is_moe_layer(i)]
    weights = dict(ckpt.weights)
    for n in names:
        weights[n] = ckpt.weights[n].clone()  # the reference's own bias tensors
    push = 10.0 * (torch.arange(c.n_routed_experts) < c.num_experts_per_tok).float()

    class Perturbed(ReferenceRunner):
        calls = 0

        def decode(self, *a, **k):
            Perturbed.calls += 1
            if Perturbed.calls == FROM:
                for n in names:
                    weights[n] += push
            return super().decode(*a, **k)

    records = script.compare_run(_runner(tiny), _reference(ckpt, weights, Perturbed), PROMPTS, STEPS)
    for r in records:
        if r["step"] < FROM:
            assert (r["verdict"], r["flips"], r["first_flip"]) == ("ok", 0, None), r
        else:
            assert r["first_flip"] == FROM and r["verdict"] in ("ok", "flip"), r
    assert all(r["flips"] > 0 and r["flips_here"] == r["flips"] for r in records if r["step"] == FROM)
    assert sum(r["verdict"] == "flip" for r in records) >= STEPS, "the flips moved no logits?"
    s = script.summarize(records)
    assert s["fail"] == 0 and s["flip"] > 0 and s["first_flip"] == FROM and s["flip_here"] >= 1
    assert s["worst_abs"] > 0.5 and s["worst_abs_no_flip"] <= 1e-3
    assert "0 FAIL" in script.format_summary("bias", s)


def test_lm_head_perturbed_on_one_side_is_fail(script, tiny):
    """A difference after the last MoE layer changes no expert choice: `FAIL`."""
    _, ckpt = tiny
    weights = dict(ckpt.weights)
    weights["lm_head.weight"] = (ckpt.weights["lm_head.weight"].float() * 1.25).to(torch.bfloat16)
    records = script.compare_run(_runner(tiny), _reference(ckpt, weights), PROMPTS, 3)
    assert all(r["flips"] == 0 for r in records)
    assert [r["verdict"] for r in records] == ["FAIL"] * len(records)
    s = script.summarize(records)
    assert not s["passed"] and s["fail"] == len(records)
    lines = script.format_steps(records).splitlines()
    assert len(lines) == len(records) + 1 and all(line.endswith("FAIL") for line in lines[1:])


def test_judge(script):
    b = torch.linspace(-3, 3, 50)
    b[-1] = 5.0  # a clear greedy token
    assert script.judge(b.clone(), b, script.ATOL, flipped=False)["verdict"] == "ok"
    a = b.clone()
    a[7] += 0.5
    assert script.judge(a, b, script.ATOL, flipped=False)["verdict"] == "FAIL"
    assert script.judge(a, b, script.ATOL, flipped=True)["verdict"] == "flip"
    assert script.judge(a, b, 1.0, flipped=False)["verdict"] == "ok"  # the prefill's tolerance is its own
    a = b.clone()
    a[0] = 10.0  # another greedy token where the reference's is clear
    r = script.judge(a, b, script.ATOL, flipped=False)
    assert r["decided"] and not r["token_equal"] and r["verdict"] == "FAIL"


def test_main_on_cpu(script, tiny, capsys, tmp_path):
    """The command line with --device cpu on the prebuilt tiny build: per-step lines, the
    summary line, the Markdown table, exit status 0."""
    root, _ = tiny
    code = script.main(["--device", "cpu", "--config", "tiny", "--formats", "bf16", "--backend", "torch",
                        "--builds", str(root), "--build-prefix", "tiny", "--prompt-len", "12", "--steps", "4",
                        "--max-model-len", str(MAX_LEN), "--ref-chunk", "8", "--out", str(tmp_path / "r.md")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "SUMMARY bf16" in out and "5/5 steps within tol, 0 flip" in out and "0 FAIL (unexplained)" in out and "-> PASS" in out
    md = (tmp_path / "r.md").read_text()
    assert "| bf16 | build |" in md and "| pass |" in md
