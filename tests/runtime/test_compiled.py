"""The generated runtime on tiny checkpoints, against the reference backend.

A 40-token prompt, then 64 greedy decode steps (the 9-slot sliding windows wrap many
times): the compiled runtime's tokens equal the reference's and its logits agree at
every step within the pipeline's stated tolerance (the decode-attention pass's:
atol 0.06, rtol 0.02, see `flintc/passes/fuse_decode_attention.py`; the prefill is
bit-exact). The same for a batch of three prompts of different lengths, which runs
in the 4-bucket with one padding row on the scratch slot.
"""

from __future__ import annotations

import json

import pytest
import torch

from flintc.checkpoint.default import default_checkpoint
from flintc.checkpoint.loader import load_checkpoint
from flintc.cli import main
from flintc.model.generate import generate
from flintc.model.reference import FlintModel
from flintc.runtime.compiled import load_build
from flintc.runtime.generate import generate_with_runner
from flintc.sampling import SamplingParams

ATOL, RTOL = 0.06, 0.02
MAX_LEN = 128


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def builds(tmp_path_factory, tiny_bf16_dir):
    """Two builds, compiled with every pass checked: the tiny BF16 checkpoint through the
    Python API, and the embedded default (tiny NVFP4) through `flintc compile` with no
    MODEL argument."""
    from flintc.runtime.build import BuildOptions, compile_model

    root = tmp_path_factory.mktemp("builds")
    ckpt = load_checkpoint(tiny_bf16_dir, progress=False)
    compile_model(ckpt, root / "bf16", BuildOptions(max_batch=4, max_model_len=MAX_LEN, backend="torch",
                                                    dump=False), progress=False, log=lambda m: None)
    code = main(["compile", "--out", str(root / "nvfp4"), "--max-batch", "4", "--max-model-len",
                 str(MAX_LEN), "--backend", "torch"])
    assert code == 0
    return {"bf16": (root / "bf16", tiny_bf16_dir), "nvfp4": (root / "nvfp4", default_checkpoint())}


def reference(path):
    ckpt = load_checkpoint(path, progress=False)
    return FlintModel(ckpt.config, ckpt.weights)


def assert_steps_agree(ours, ref):
    assert ours.output_ids == ref.output_ids
    assert len(ours.step_logits) == len(ref.step_logits) > 0
    for i, (a, b) in enumerate(zip(ours.step_logits, ref.step_logits)):
        assert a.shape == b.shape
        excess = ((a - b).abs() - (ATOL + RTOL * b.abs())).max().item()
        assert excess <= 0, f"step {i}: logits differ by more than atol {ATOL} + rtol {RTOL} (by {excess:.3g})"


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_greedy_64_steps_match_reference(builds, fmt):
    build, source = builds[fmt]
    runner = load_build(build, progress=False)
    prompt = [(7 * i + 3) % 500 + 1 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
    ours = generate_with_runner(runner, [prompt], params, keep_step_logits=True, return_prompt_logits=True)
    ref = generate(reference(source), [prompt], params, keep_step_logits=True, return_prompt_logits=True)
    assert torch.equal(ours.prompt_logits[0], ref.prompt_logits[0]), "prefill is bit-exact"
    assert_steps_agree(ours, ref)
    assert ours.decode_steps == 64


def test_batch_of_three_prompts(builds):
    build, source = builds["bf16"]
    runner = load_build(build, progress=False)
    prompts = [list(range(5, 45)), [11, 12, 13, 14, 15, 16, 17], [300, 2, 451, 9, 17, 88, 23, 4, 99, 31, 5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ours = generate_with_runner(runner, prompts, params, keep_step_logits=True)
    ref = generate(reference(source), prompts, params, keep_step_logits=True)
    assert_steps_agree(ours, ref)


def test_padding_never_touches_live_caches(builds):
    """A decode of 3 sequences in the 4-bucket, and a padded prefill chunk, leave every
    other slot's cache rows as they were."""
    build, _ = builds["bf16"]
    runner = load_build(build, progress=False)
    for t in runner.kv:
        t.normal_()
    before = [t.clone() for t in runner.kv]
    runner.decode([2, 0, 1], [5, 6, 7], [30, 31, 32])
    for t, b in zip(runner.kv, before):
        assert torch.equal(t[3], b[3]), "slot 3 (not decoded) changed"
    before = [t.clone() for t in runner.kv]
    runner.prefill(1, list(range(1, 12)), start=20)  # 11 tokens: one full chunk of 8, one padded
    for i, (t, b) in enumerate(zip(runner.kv, before)):
        other = [s for s in range(t.shape[0]) if s != 1]
        assert torch.equal(t[other], b[other]), f"cache {i}: another slot changed"
        if t.shape[1] == runner.config.sliding_window:  # ring: only rows of positions 20..30
            written = {p % t.shape[1] for p in range(20, 31)}
            kept = [r for r in range(t.shape[1]) if r not in written]
            assert torch.equal(t[1, kept], b[1, kept]), f"cache {i}: padding overwrote live ring rows"


def test_generated_runtime_is_readable(builds):
    build, _ = builds["bf16"]
    src = (build / "runtime.py").read_text()
    plan = json.loads((build / "plan.json").read_text())
    manifest = json.loads((build / "build.json").read_text())
    assert set(manifest["functions"]) == {"decode_b1", "decode_b2", "decode_b4", "prefill_t8"}
    body = src.split("def decode_b1(")[1].split("\ndef ")[0]
    launches = [line for line in body.splitlines() if "# kernel " in line]
    assert len(launches) == plan["steps"]["decode_b1"]["kernels"] == 28  # 2 dense x 6 + 2 MoE x 7 + 2
    assert all("K." in line or "aten." in line for line in launches)
    assert "layer 3" in launches[-2] and "moe_down_combine_residual" in launches[-2]
    assert all(l["pdl"] for l in plan["steps"]["decode_b1"]["launches"])
    assert (build / "report.md").is_file() and json.loads((build / "report.json").read_text())[0]["passed"]


def test_cli_run_build_json_and_summary(builds, capsys):
    build, _ = builds["nvfp4"]
    code, out, err = run_cli(capsys, "run", "--build", build, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
                             "--max-tokens", 4, "--temperature", 0, "--ignore-eos", "--output", "json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and all(len(r["output_ids"]) == 4 for r in rows)
    assert "decode:" in err and "ms/token" in err
    # The same request on the reference backend gives the same tokens.
    code, out2, err = run_cli(capsys, "run", default_checkpoint(), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
                              "--max-tokens", 4, "--temperature", 0, "--ignore-eos", "--output", "json")
    assert code == 0, err
    assert [json.loads(line)["output_ids"] for line in out2.splitlines()] == [r["output_ids"] for r in rows]


def test_python_api_generate_text(builds):
    import flintc

    m = flintc.load(builds["nvfp4"][0])
    r = m.generate(["Hello there", "The quick brown fox"], temperature=0, max_tokens=5, ignore_eos=True)
    assert len(r.texts) == 2 and all(len(o) == 5 for o in r.output_ids)
    logits = m.forward(torch.tensor([1, 2, 3]))
    assert logits.shape == (3, m.runner.config.vocab_size) and logits.dtype == torch.float32


@pytest.mark.parametrize("case", ["too_long", "too_many", "other_weights", "other_format", "no_gpu", "not_a_build"])
def test_bad_input_is_one_line(builds, capsys, tmp_path, case, tiny_bf16_dir):
    build, _ = builds["bf16"]
    if case == "too_long":
        args = ["run", "--build", build, "--prompt-ids", ",".join(["1"] * (MAX_LEN + 1))]
        expect = "more than the maximum"
    elif case == "too_many":
        args = ["run", "--build", build] + sum([["--prompt-ids", "1,2"] for _ in range(5)], [])
        expect = "at most 4"
    elif case == "other_weights":
        from flintc.checkpoint.writer import make_checkpoint

        other = make_checkpoint("tiny", "bf16", tmp_path / "other", seed=1)
        args = ["run", other, "--build", build, "--prompt-ids", "1,2"]
        expect = "fingerprint differs"
    elif case == "other_format":
        args = ["run", default_checkpoint(), "--build", build, "--prompt-ids", "1,2"]
        expect = "compiled for bf16"
    elif case == "no_gpu":
        if torch.cuda.is_available():
            pytest.skip("has a GPU")
        args = ["compile", tiny_bf16_dir, "--out", tmp_path / "b", "--device", "cuda"]
        expect = "no CUDA GPU"
    else:
        (tmp_path / "x").mkdir()
        (tmp_path / "x" / "keep.txt").write_text("mine")
        args = ["compile", tiny_bf16_dir, "--out", tmp_path / "x"]
        expect = "not a flintc build"
    code, out, err = run_cli(capsys, *args)
    assert code == 2, (out, err)
    assert expect in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    if case == "no_gpu":
        assert not (tmp_path / "b").exists()
    if case == "not_a_build":
        assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
