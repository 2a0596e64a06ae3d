"""`flintc run` and `flintc make-checkpoint` on tiny checkpoints, including bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from flintc.checkpoint.loader import load_checkpoint
from flintc.cli import main
from flintc.cli.run import one_line
from flintc.model.generate import generate
from flintc.model.reference import FlintModel
from flintc.sampling import SamplingParams


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("which", ["bf16", "nvfp4"])
def test_run_json_greedy_matches_python_api(capsys, which, tiny_bf16_dir, tiny_nvfp4_gguf):
    path = tiny_bf16_dir if which == "bf16" else tiny_nvfp4_gguf
    code, out, err = run_cli(capsys, "run", path, "--prompt-ids", "1,2,3", "--max-tokens", 8,
                             "--temperature", 0, "--output", "json", "--ignore-eos")
    assert code == 0, err
    obj = json.loads(out)
    assert obj["prompt_ids"] == [1, 2, 3] and len(obj["output_ids"]) == 8
    ckpt = load_checkpoint(path, progress=False)
    ref = generate(FlintModel(ckpt.config, ckpt.weights), [[1, 2, 3]],
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert obj["output_ids"] == ref.output_ids[0]


def test_run_sampling_controls_match_python_api(capsys, tiny_bf16_dir):
    """--presence-penalty, --frequency-penalty, --repetition-penalty, --min-p, --min-tokens
    and --logit-bias reach SamplingParams: the tokens are the Python API's with the same
    fields (greedy and seeded), and --logit-bias ID=100 makes greedy pick ID."""
    ckpt = load_checkpoint(tiny_bf16_dir, progress=False)
    model = FlintModel(ckpt.config, ckpt.weights)
    flags = ["--presence-penalty", "1.5", "--frequency-penalty", "0.5", "--repetition-penalty", "1.2",
             "--min-p", "0.05", "--min-tokens", "3", "--logit-bias", "9=2.5", "--logit-bias", "11=-1"]
    fields = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2, min_p=0.05,
                  min_tokens=3, logit_bias={9: 2.5, 11: -1.0})
    for extra, kw in ((["--temperature", "0"], dict(temperature=0)), (["--seed", "4"], dict(seed=4))):
        code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1,2,3", "--max-tokens", 6,
                                 "--output", "json", "--ignore-eos", *flags, *extra)
        assert code == 0, err
        ref = generate(model, [[1, 2, 3]], SamplingParams(max_tokens=6, ignore_eos=True, **kw, **fields))
        assert json.loads(out)["output_ids"] == ref.output_ids[0], extra
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1,2,3", "--max-tokens", 3,
                             "--output", "json", "--temperature", "0", "--logit-bias", "77=100")
    assert code == 0, err
    assert json.loads(out)["output_ids"] == [77, 77, 77]


def test_run_structured_outputs(capsys, tiny_bf16_dir):
    """--structured-outputs reaches SamplingParams (and the tokenizer the generate path):
    each prompt's text is one of the choices, finish reason "stop", greedy and seeded."""
    for extra in (["--temperature", "0"], ["--seed", "3"]):
        code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt", "Answer:", "--prompt-ids", "1,2,3",
                                 "--max-tokens", 8, "--output", "json", *extra,
                                 "--structured-outputs", '{"choice": ["yes", "no", "maybe"]}')
        assert code == 0, err
        objs = [json.loads(line) for line in out.splitlines()]
        assert [o["text"] for o in objs if o["text"] not in ("yes", "no", "maybe")] == [] and len(objs) == 2, out
        assert all(o["finish_reason"] == "stop" for o in objs), out


def test_run_structured_outputs_ignore_eos_streams_no_end_of_text(capsys, tiny_bf16_dir):
    """With --ignore-eos, end-of-text drawn where the grammar accepts still ends the output
    (generate ends it: finish reason "stop", the token kept in output_ids, not in the
    text); the streamed text of one prompt printed it as '<|endoftext|>' all the same,
    unlike --output json's text."""
    from flintc.checkpoint.tokenizer import load_tokenizer

    eos = load_tokenizer(tiny_bf16_dir).eos_token_id
    base = ["run", tiny_bf16_dir, "--prompt", "Answer:", "--max-tokens", 8, "--temperature", "0", "--ignore-eos",
            "--structured-outputs", '{"regex": "[0-9]+"}', "--logit-bias", f"{eos}=100"]
    for extra in ([], ["--include-stop-str-in-output"]):
        code, out, err = run_cli(capsys, *base, *extra, "--output", "json")
        assert code == 0, err
        obj = json.loads(out)
        assert obj["output_ids"][-1] == eos and len(obj["output_ids"]) == 2 and obj["finish_reason"] == "stop", obj
        assert obj["text"].isdigit() != bool(extra) and obj["text"].endswith("<|endoftext|>") == bool(extra), obj
        code, out, err = run_cli(capsys, *base, *extra)
        assert code == 0 and out == obj["text"] + "\n", (extra, out)


def test_text_stream_ends_its_line_when_generation_fails(capsys, tiny_bf16_dir):
    """A text run that fails after streaming some text (a grammar that refuses a token)
    ends stdout's line before the one-line error: on a terminal the error followed the
    text on the same line ('naflintc: error: ...')."""
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt", "Answer:", "--max-tokens", 8,
                             "--temperature", "0", "--structured-outputs", '{"choice": ["<|user|>"]}')
    assert code == 2 and err.startswith("flintc: error: structured outputs:"), err
    assert out == "" or out.endswith("\n"), repr(out)


def test_logits_out(capsys, tmp_path, tiny_bf16_dir):
    target = tmp_path / "logits.npy"
    code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "5,6,7,8", "--max-tokens", 1,
                           "--output", "json", "--logits-out", target)
    assert code == 0, err
    logits = np.load(target)
    assert logits.shape == (4, 512) and logits.dtype == np.float32
    ckpt = load_checkpoint(tiny_bf16_dir, progress=False)
    model = FlintModel(ckpt.config, ckpt.weights)
    kv = model.new_kv_cache(1, 8)
    ref = model(torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None], torch.tensor([0]), kv)[0]
    np.testing.assert_array_equal(logits, ref.numpy())
    assert [p.name for p in tmp_path.iterdir()] == ["logits.npy"]  # no temp file left


def test_logits_out_into_a_fifo_writes_into_it(capsys, tmp_path, tiny_bf16_dir):
    """Regression: --logits-out wrote a temporary file and renamed it over the path, so a
    FIFO (or, as root, /dev/null: the device became a regular file) was replaced by a
    regular file instead of written into."""
    import stat

    from harness import fifo_read

    fifo = tmp_path / "fifo"
    with fifo_read(fifo) as got:
        code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "5,6", "--max-tokens", 1,
                               "--output", "json", "--logits-out", fifo)
    assert code == 0, err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    import io

    assert np.load(io.BytesIO(got[0])).shape == (2, 512)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]  # no temp file left
    code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "5", "--max-tokens", 1,
                           "--logits-out", os.devnull)
    assert code == 0, err
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_seeded_sampling_is_reproducible(capsys, tiny_nvfp4_gguf):
    runs = [run_cli(capsys, "run", tiny_nvfp4_gguf, "--prompt", "hello", "--max-tokens", 6,
                    "--seed", 11, "--output", "json", "--ignore-eos")[1] for _ in range(2)]
    assert runs[0] == runs[1] and len(json.loads(runs[0])["output_ids"]) == 6


def test_default_model_is_generated_once(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FLINTC_CACHE_DIR", str(tmp_path))
    code, out, err = run_cli(capsys, "run", "--prompt", "hi", "--max-tokens", 4, "--temperature", 0)
    assert code == 0, err
    assert "generated tokens: " in err
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == ["default-tiny-nvfp4-s0"]
    stamp = os.path.getmtime(tmp_path / made[0] / "model-nvfp4.gguf")
    assert run_cli(capsys, "run", "--prompt-ids", "1", "--max-tokens", 2)[0] == 0
    assert os.path.getmtime(tmp_path / made[0] / "model-nvfp4.gguf") == stamp


def test_damaged_default_model_is_written_again(capsys, tmp_path, monkeypatch):
    """A cached default model truncated later gave "...model-nvfp4.gguf: truncated or
    corrupt GGUF file" with no way out: it is written again (deterministic from its
    seed), with a one-line notice, and the run gives the same tokens."""
    monkeypatch.setenv("FLINTC_CACHE_DIR", str(tmp_path))
    args = ("run", "--prompt-ids", "1,2,3", "--max-tokens", 3, "--temperature", 0, "--ignore-eos",
            "--output", "json")
    code, first, err = run_cli(capsys, *args)
    assert code == 0, err
    gguf = tmp_path / "default-tiny-nvfp4-s0" / "model-nvfp4.gguf"
    size = gguf.stat().st_size
    with open(gguf, "r+b") as f:
        f.truncate(size // 2)
    code, again, err = run_cli(capsys, *args)
    assert code == 0, err
    assert err.count("the cached default model is damaged") == 1 and "writing it again" in err, err
    assert again == first and gguf.stat().st_size == size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["default-tiny-nvfp4-s0"]


def test_default_model_error_says_to_delete_it_when_rewriting_fails(tmp_path, monkeypatch):
    """Should the default, written again, still not load, the error says to delete it."""
    from flintc.checkpoint import default
    from flintc.errors import CheckpointError

    monkeypatch.setenv("FLINTC_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "default-tiny-nvfp4-s0"

    def broken(path):
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file")

    with pytest.raises(CheckpointError, match=f"delete {folder} to have flintc write it again"):
        default.load_default(broken)
    with pytest.raises(CheckpointError, match="^other: bad$"):  # not about the default: as it is
        default.load_default(lambda path: (_ for _ in ()).throw(CheckpointError("other: bad")))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_summary_has_no_decode_rate_without_a_decode_step(capsys, tiny_bf16_dir, max_tokens):
    """--max-tokens 0 decodes nothing, 1 takes its token from the prefill: the summary
    says 0 tokens, not a rate over zero tokens."""
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1,2,3", "--max-tokens", max_tokens,
                             "--temperature", 0, "--ignore-eos", "--output", "json")
    assert code == 0, err
    assert len(json.loads(out)["output_ids"]) == max_tokens
    summary = err.strip().splitlines()[-1]
    assert f"generated tokens: {max_tokens}," in summary and summary.endswith("decode: 0 tokens"), summary
    assert "ms/token" not in err
    code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1,2,3", "--max-tokens", 3,
                           "--temperature", 0, "--ignore-eos", "--output", "json")
    assert code == 0 and err.strip().endswith(" ms/token"), err


@pytest.mark.parametrize("args, needle", [
    (["--top-p", "2"], "top_p"),
    (["--top-k", "-5"], "top_k"),
    (["--temperature", "-1"], "temperature"),
    (["--max-tokens", "-3"], "max_tokens"),
    (["--prompt-ids", "1,x"], "'x'"),
    (["--prompt-ids", "1,600"], "token id 600"),
    (["--prompt-ids", ",".join(["1"] * 4097)], "4097 tokens"),
    (["--presence-penalty", "3"], "--presence-penalty: sampling field 'presence_penalty'"),
    (["--frequency-penalty", "-2.5"], "--frequency-penalty"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--min-p", "2"], "--min-p"),
    (["--min-tokens", "3"], "--min-tokens: sampling field 'min_tokens' (3) must be at most max_tokens (2)"),
    (["--logit-bias", "5"], "--logit-bias '5': expected ID=BIAS"),
    (["--logit-bias", "5=1", "--logit-bias", "5=2"], "token id 5 given twice"),
    (["--logit-bias", "5=200"], "--logit-bias: sampling field 'logit_bias'"),
    (["--logit-bias", "600=1"], "token id 600 is outside the vocabulary [0, 512)"),
    (["--structured-outputs", '{"regex": "[a"}'], "--structured-outputs: sampling field 'structured_outputs': "
                                                  "structured_outputs field 'regex': at 1(8): invalid regex"),
    (["--structured-outputs", '{"regex": "a", "choice": ["a"]}'], "only use one kind"),
    (["--stop", "a", "--stop", ""], "--stop: sampling field 'stop' cannot contain an empty string (entry 1)"),
    # not valid UTF-8 on the command line (surrogateescape): in no text, it never matched
    (["--stop", "a", "--stop", "x\udcff"], "--stop: the text is not valid Unicode: byte 0xff at character 1"),
    (["--stop-token-ids", "1,x"], "--stop-token-ids: 'x' is not an integer token id"),
    (["--stop-token-ids", "3", "--stop-token-ids", "-1"], "--stop-token-ids '-1': token id -1 is negative"),
    (["--stop-token-ids", "1,600"], "--stop-token-ids: token id 600 is outside the vocabulary [0, 512)"),
    (["--structured-outputs", "{x"], "--structured-outputs: not valid JSON"),
    (["--structured-outputs", "[1]"], "--structured-outputs: expected a JSON object"),
    # past llguidance's lexer limits once generation starts: one line too, not a traceback
    (["--structured-outputs", '{"regex": "a{1000000}"}'], "lexer error: too many expressions constructed"),
])
def test_bad_run_arguments(capsys, tiny_bf16_dir, args, needle):
    base = ["run", tiny_bf16_dir, "--max-tokens", 2]
    if "--prompt-ids" not in args:
        base += ["--prompt-ids", "1,2"]
    code, out, err = run_cli(capsys, *base, *args)
    assert code == 2
    assert err.startswith("flintc: error: ") and needle in err and err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("args, needle", [
    (["--prompt", ""], "--prompt '': the prompt text is empty; a prompt needs at least one token"),
    (["--prompt", "hi", "--prompt", ""], "--prompt '': the prompt text is empty"),
    (["--prompt", "h\udce9llo"], "--prompt: the text is not valid Unicode: byte 0xe9 at character 1 is "
                                 "not valid"),
    (["--prompt", "hi", "--prompt", "a\ud800"], "--prompt: the text is not valid Unicode: character 1 "
                                                "('\\ud800') is a lone surrogate; expected UTF-8 text"),
    (["--prompt-ids", "1,2,3", "--max-model-len", "3"], "--prompt-ids: 3 tokens, more than the maximum of 2 "
                                                         "(--max-model-len 3 counts the prompt"),
    # 1 was "--prompt-ids: 1 tokens, more than the maximum of 0", unlike 0 and -5 (and serve)
    (["--prompt-ids", "1", "--max-model-len", "1"], "--max-model-len must be at least 2, got 1"),
    (["--prompt", "hi", "--max-model-len", "1"], "--max-model-len must be at least 2, got 1"),
    (["--prompt-ids", "1,2,3", "--max-model-len", "-5"], "--max-model-len must be at least 2, got -5"),
])
def test_bad_prompts_fail_before_compiling(capsys, monkeypatch, tiny_bf16_dir, args, needle):
    """An empty --prompt, or --prompt-ids longer than --max-model-len allows, used to fail
    only after the weights loaded and the temporary BUILD compiled (10-45 s on the tiny
    model), as "prompt is empty" (no flag named) / "prompt has 3 tokens". Now at once."""
    import flintc.checkpoint.loader
    import flintc.runtime.build

    def never(*a, **k):
        raise AssertionError("loaded or compiled before the prompts were checked")

    monkeypatch.setattr(flintc.checkpoint.loader, "load_checkpoint", never)
    monkeypatch.setattr(flintc.runtime.build, "compile_model", never)
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--backend", "torch", "--max-tokens", 1, *args)
    assert code == 2 and err.startswith("flintc: error: ") and needle in err and err.count("\n") == 1, err
    assert out == ""


def test_one_token_is_singular():
    """"1 tokens" where the prompt is one token long."""
    from flintc.errors import InputError
    from flintc.model.generate import check_prompt

    with pytest.raises(InputError, match=r"^prompt has 1 token, more than the maximum of 0 "):
        check_prompt([1], 10, 1, "prompt")


@pytest.mark.parametrize("case", ["no tokenizer", "other vocabulary", "text too long"])
def test_prompt_text_is_checked_before_compiling(capsys, monkeypatch, tmp_path, tiny_bf16_dir, case):
    """`--prompt` with no tokenizer beside MODEL, a --tokenizer with ids the model has no
    row for, and a --prompt text of --max-model-len tokens or more were refused only
    after the temporary BUILD had compiled, with FLINTC_DUMP_DIR set after its "pass-by-pass
    dumps" line. Now once the checkpoint is read, before the compile: the one line only."""
    import json
    import shutil

    import flintc.runtime.build

    def never(*a, **k):
        raise AssertionError("compiled before the prompt text was checked")

    monkeypatch.setattr(flintc.runtime.build, "compile_model", never)
    monkeypatch.setenv("FLINTC_DUMP_DIR", str(tmp_path / "dumps"))
    model = tmp_path / "model"
    args = ["--prompt", "hi"]
    if case == "no tokenizer":
        shutil.copytree(tiny_bf16_dir, model, ignore=shutil.ignore_patterns("tokenizer*"))
        message = (f"--prompt needs a tokenizer: no tokenizer.json beside MODEL {model}; pass --tokenizer DIR (a "
                   "folder with tokenizer.json and tokenizer_config.json), or give token ids with --prompt-ids")
    elif case == "other vocabulary":
        model.mkdir()
        config = json.loads((tiny_bf16_dir / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "vocab_size": 500}))
        args += ["--load-format", "dummy", "--tokenizer", tiny_bf16_dir]
        message = (f"{tiny_bf16_dir / 'tokenizer.json'}: token ids up to 511, but {model / 'config.json'} has "
                   "vocab_size 500: expected every id below it (a tokenizer of another model?)")
    else:
        model = tiny_bf16_dir
        args = ["--prompt", "hi", "--prompt", "a longer text", "--max-model-len", 4]
        message = ("--prompt: 9 tokens, more than the maximum of 3 (--max-model-len 4 counts the prompt and at "
                   "least one generated token)")
    code, out, err = run_cli(capsys, "run", model, "--backend", "torch", "--max-tokens", 1, *args)
    assert (code, out, err) == (2, "", f"flintc: error: {message}\n")
    assert not (tmp_path / "dumps").exists()


def test_tokenizer_smaller_than_the_model_runs(capsys, tmp_path, tiny_bf16_dir):
    """A --tokenizer of 512 tokens with a model of 1024 embedding rows (a padded
    vocabulary, as vLLM takes): run generates, where "tokenizer in ... has 512 tokens,
    the model 1024" refused it (`flintc serve`, its Engine too; `flintc.load` took it).
    The one rule is `FlintTokenizer.check_fits_model`."""
    import json

    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((tiny_bf16_dir / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    code, out, err = run_cli(capsys, "run", model, "--load-format", "dummy", "--tokenizer", tiny_bf16_dir,
                             "--prompt", "hi", "--max-tokens", 8, "--temperature", 0)
    assert code == 0 and "error" not in err, err


@pytest.mark.parametrize("source, extra", [
    ("bf16", []), ("nvfp4", []), ("bf16", ["--backend", "torch"]), ("bf16", ["--load-format", "dummy"]),
])
def test_token_ids_outside_the_vocabulary_fail_before_loading(capsys, monkeypatch, tiny_bf16_dir,
                                                              tiny_nvfp4_gguf, source, extra):
    """Regression: --logit-bias 600=1 (the tiny vocabulary has 512 tokens) was refused only
    after the weights loaded (and a --backend torch BUILD compiled), as "prompt: token id
    600 is outside the vocabulary" naming no flag. It is refused once config.json is read,
    before any weight is read or made, naming the flag, the id, the range and the file;
    so is a --prompt-ids id."""
    import flintc.checkpoint.dummy
    import flintc.checkpoint.gguf_io
    import flintc.checkpoint.safetensors_io
    import flintc.runtime.build

    def never(*a, **k):
        raise AssertionError("weights loaded or compiled before the token ids were checked")

    for module, name in ((flintc.checkpoint.safetensors_io, "load_bf16"), (flintc.checkpoint.gguf_io, "load_gguf"),
                         (flintc.checkpoint.dummy, "dummy_weights"), (flintc.runtime.build, "compile_model")):
        monkeypatch.setattr(module, name, never)
    model = tiny_bf16_dir if source == "bf16" else tiny_nvfp4_gguf
    config_json = (model if source == "bf16" else model.parent) / "config.json"
    for args, want in ((["--prompt-ids", "1,2", "--logit-bias", "3=1", "--logit-bias", "600=-2.5"],
                        "--logit-bias 600=-2.5: token id 600 is outside the vocabulary [0, 512) of "
                        f"{config_json}"),
                       (["--prompt-ids", "1,512"],
                        f"--prompt-ids: token id 512 is outside the vocabulary [0, 512) of {config_json}")):
        code, out, err = run_cli(capsys, "run", model, "--max-tokens", 1, *extra, *args)
        assert code == 2 and err == f"flintc: error: {want}\n", err
        assert out == ""


def test_bad_config_names_file_and_field(capsys, tmp_path, tiny_bf16_dir):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_bf16_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["layer_types"] = cfg["layer_types"][:3]
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "run", bad, "--prompt-ids", "1")
    assert code == 2 and "config.json" in err and "layer_types" in err


def test_truncated_gguf(capsys, tmp_path, tiny_nvfp4_gguf):
    folder = tmp_path / "trunc"
    shutil.copytree(tiny_nvfp4_gguf.parent, folder)
    f = folder / tiny_nvfp4_gguf.name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, _, err = run_cli(capsys, "run", f, "--prompt-ids", "1")
    assert code == 2 and f.name in err


def test_missing_model_and_unwritable_output(capsys, tmp_path, tiny_bf16_dir):
    code, _, err = run_cli(capsys, "run", tmp_path / "nope", "--prompt-ids", "1")
    assert code == 2 and "nope" in err
    code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1", "--max-tokens", 1,
                           "--logits-out", tmp_path / "missing-dir" / "x.npy")
    assert code == 2 and "missing-dir" in err
    assert not (tmp_path / "missing-dir").exists()


def test_make_checkpoint_refuses_non_empty_dir(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    code, _, err = run_cli(capsys, "make-checkpoint", "--config", "tiny", "--out", tmp_path)
    assert code == 2 and str(tmp_path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_make_checkpoint_refuses_a_file_as_out(capsys, tmp_path):
    """An --out that is a file (even an empty one) was "already exists and is not empty"."""
    (tmp_path / "f").write_text("")
    code, _, err = run_cli(capsys, "make-checkpoint", "--config", "tiny", "--out", tmp_path / "f")
    assert code == 2 and err == f"flintc: error: {tmp_path / 'f'}: already exists and is a file, not a folder; " \
                                "refusing to write\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_console_script_prints_no_traceback(tmp_path):
    """The installed entry point (python -m flintc): one line, exit 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "flintc", "run", str(tmp_path / "absent"),
                           "--prompt-ids", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("flintc: error:") and "Traceback" not in proc.stderr


def test_huge_seed_is_a_clean_error(capsys, tiny_bf16_dir):
    """Regression: a seed past 2**63 crashed in torch.Generator.manual_seed with a traceback."""
    code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1", "--seed", str(10**21))
    assert code == 2 and "seed" in err and "Traceback" not in err


def test_logits_out_is_checked_before_generating(capsys, tmp_path, tiny_bf16_dir):
    """Regression: a bad --logits-out failed only after generating, naming the temp file."""
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1", "--logits-out", tmp_path)
    assert code == 2 and "is a directory" in err and str(tmp_path) in err and out == ""


def test_outputs_are_readable_by_others(capsys, tmp_path, tiny_bf16_dir):
    """Regression: atomic writes through mkstemp left outputs owner-only (0600)."""
    import stat

    target = tmp_path / "l.npy"
    assert run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1", "--max-tokens", 1,
                   "--logits-out", target)[0] == 0
    assert stat.S_IMODE(target.stat().st_mode) & 0o044
    for f in tiny_bf16_dir.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) & 0o044, f


def test_finish_reason_reports_the_context_limit(capsys, tiny_bf16_dir):
    """A sequence stopped by the context limit finishes with "length", as one stopped by
    max_tokens (vLLM's convention, and `flintc serve`'s): it was "max_model_len"."""
    ids = ",".join(["1"] * 4094)
    code, out, _ = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", ids, "--max-tokens", 10,
                           "--ignore-eos", "--output", "json", "--temperature", "0")
    obj = json.loads(out)
    # max_position_embeddings 4096 counts the prompt and the generated tokens
    assert code == 0 and obj["finish_reason"] == "length" and len(obj["output_ids"]) == 2


def test_a_batch_keeps_the_command_line_order_of_prompts(capsys, tiny_bf16_dir):
    """--prompt and --prompt-ids mixed in one batch: every --prompt came first, then every
    --prompt-ids, so the outputs (and their "index") did not follow the command line."""
    from flintc.checkpoint.tokenizer import load_tokenizer

    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1,2", "--prompt", "hi",
                             "--prompt-ids", "7", "--max-tokens", 1, "--output", "json")
    assert code == 0, err
    objs = [json.loads(line) for line in out.splitlines()]
    assert [o["index"] for o in objs] == [0, 1, 2]
    assert [o["prompt_ids"] for o in objs] == [[1, 2], load_tokenizer(tiny_bf16_dir).encode("hi"), [7]]


def test_text_leaves_out_the_end_of_text_token(capsys, monkeypatch, tiny_bf16_dir):
    """A sequence that stops at <|endoftext|> (finish reason "stop"): its text, streamed,
    in --output json and one line per prompt of a batch, ended in "<|endoftext|>"; vLLM
    and `flintc serve` leave it out of the text. output_ids keep it, as vLLM's do."""
    import flintc.runtime.generate as rg
    from flintc.checkpoint.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_bf16_dir)
    eos, word = tok.eos_token_id, tok.encode("hi")[0]

    def sample_word_then_eos():  # each step: every live sequence gets `word`, then `eos`
        picks = iter([word, eos] * 4)
        monkeypatch.setattr(rg, "sample", lambda logits, params, gens, **kw: torch.tensor([next(picks)] * len(params)))

    for extra in (["--output", "json"], [], ["--prompt", "ho"]):
        sample_word_then_eos()
        code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt", "hi", "--max-tokens", 4, *extra)
        assert code == 0, err
        assert "<|endoftext|>" not in out and tok.decode([word]) in out, out
        if extra[:1] == ["--output"]:
            obj = json.loads(out)
            assert obj["output_ids"] == [word, eos] and obj["finish_reason"] == "stop"
            assert obj["text"] == tok.decode([word])
    sample_word_then_eos()
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt", "hi", "--max-tokens", 2, "--ignore-eos")
    assert code == 0 and out.endswith("<|endoftext|>\n"), out  # not a stop: the token is text


def test_run_stops_at_the_generation_config_end_tokens(capsys, tiny_bf16_dir):
    """<|user|> and <|observation|> (GLM's generation config's end ids besides
    <|endoftext|>) end the output as vLLM ends every request there: finish reason "stop",
    stop_reason the id, the token kept in output_ids and left out of the text (streamed
    too); with --ignore-eos they are text and the output runs to --max-tokens, unless
    --stop-token-ids names them."""
    from flintc.checkpoint.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_bf16_dir)
    for name in ("<|user|>", "<|observation|>"):
        t = tok.special_token_ids[name]
        base = ["run", tiny_bf16_dir, "--prompt", "hi", "--max-tokens", 3, "--temperature", "0",
                "--logit-bias", f"{t}=100"]
        code, out, err = run_cli(capsys, *base, "--output", "json")
        assert code == 0, err
        obj = json.loads(out)
        assert (obj["output_ids"], obj["finish_reason"], obj["stop_reason"], obj["text"]) == ([t], "stop", t, "")
        code, out, err = run_cli(capsys, *base)  # streamed: the stop token is not printed
        assert code == 0 and out == "\n", out
        code, out, err = run_cli(capsys, *base, "--ignore-eos", "--output", "json")
        obj = json.loads(out)
        assert (obj["output_ids"], obj["finish_reason"], obj["stop_reason"], obj["text"]) == \
            ([t] * 3, "length", None, name * 3)
        code, out, err = run_cli(capsys, *base, "--ignore-eos")
        assert code == 0 and out == name * 3 + "\n", out
        code, out, err = run_cli(capsys, *base, "--ignore-eos", "--stop-token-ids", str(t), "--output", "json")
        obj = json.loads(out)
        assert (obj["output_ids"], obj["finish_reason"], obj["stop_reason"]) == ([t], "stop", t)


@pytest.mark.parametrize("var, value, backend", [
    ("FLINTC_PREFILL_GRAPHS", "yes", "torch"), ("FLINTC_GEMV_TUNED", "/no/such/tuned.json", "triton"),
    ("FLINTC_MOE_TUNED", "/no/such/tuned.json", "triton"),
])
def test_bad_environment_fails_before_compiling(capsys, monkeypatch, tiny_bf16_dir, var, value, backend):
    """`flintc run --backend torch|triton` checks the FLINTC_* variables its runtime reads
    before loading weights and compiling (a bad value used to cost a whole compile)."""
    import flintc.checkpoint.loader
    import flintc.runtime.build

    def never(*a, **k):
        raise AssertionError("loaded or compiled before the environment was checked")

    monkeypatch.setattr(flintc.checkpoint.loader, "load_checkpoint", never)
    monkeypatch.setattr(flintc.runtime.build, "compile_model", never)
    monkeypatch.setenv(var, value)
    code, _, err = run_cli(capsys, "run", tiny_bf16_dir, "--backend", backend, "--device", "cpu",
                           "--prompt-ids", "1,2", "--max-tokens", 1)
    assert code == 2 and err.startswith(f"flintc: error: {var}") and err.count("\n") == 1, err


def test_reference_generate_refuses_no_prompts_and_too_long_a_model_len():
    """The Python API's reference `generate`: no prompts, and a max_model_len outside
    1..max_positions, are InputErrors naming them (a bare ValueError from max() of
    nothing, and a silent cut to max_positions, before)."""
    from flintc.checkpoint.init import random_weights
    from flintc.config import FlintConfig
    from flintc.errors import InputError
    from flintc.model.reference import FlintModel

    cfg = FlintConfig.preset("tiny")
    model = FlintModel(cfg, random_weights(cfg, 0), max_positions=64)
    params = SamplingParams(temperature=0, max_tokens=1)
    with pytest.raises(InputError, match="no prompts"):
        generate(model, [], params)
    for bad in (0, 65):
        with pytest.raises(InputError, match=f"max_model_len {bad}: expected 1..64"):
            generate(model, [[1, 2]], params, max_model_len=bad)


def test_reference_run_sizes_rope_by_max_model_len(tiny_bf16_dir, monkeypatch, capsys):
    """`flintc run --max-model-len 64` on the reference backend made RoPE tables of
    max_position_embeddings rows (a config's 2**22: 1.0 GB RSS, as without the flag);
    they have the 64 rows the run can use."""
    from flintc.model import ops

    rows = []
    real = ops.rope_tables

    def recording(theta, head_dim, max_positions, cdt):
        rows.append(max_positions)
        return real(theta, head_dim, max_positions, cdt)

    monkeypatch.setattr(ops, "rope_tables", recording)
    assert main(["run", str(tiny_bf16_dir), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--max-model-len", "64"]) == 0
    assert rows == [64]
    assert main(["run", str(tiny_bf16_dir), "--prompt-ids", "1,2,3", "--max-tokens", "2"]) == 0
    assert rows == [64, 4096]  # no flag: max_position_embeddings, as vLLM's default max_model_len


def test_a_closed_pipe_stops_quietly(tiny_bf16_dir):
    """`flintc run ... | head -c 5`: the reader leaves early. flintc stops with 141 (128 +
    SIGPIPE, as `yes | head`) and prints nothing on stderr; it printed "flintc: error:
    Broken pipe" with exit 2, the code of a bad argument."""
    proc = subprocess.Popen([sys.executable, "-m", "flintc", "run", str(tiny_bf16_dir), "--prompt-ids", "1",
                             "--max-tokens", "300", "--ignore-eos", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(5)
    proc.stdout.close()  # the reader leaves
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=600) == 141 and err == "", err


def test_version_into_a_closed_pipe_stops_quietly():
    """`flintc --version | grep -q 0.1`: the reader may leave before the version is
    written. It printed a BrokenPipeError traceback from argparse's action with exit 1;
    now 141 and nothing on stderr, as `flintc run ... | head`."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has left already
    try:
        proc = subprocess.run([sys.executable, "-m", "flintc", "--version"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_closed_stdout_is_no_traceback(tmp_path, tiny_bf16_dir):
    """`flintc run ... >&-` (stdout closed: sys.stdout is None): the streamed text went
    through sys.stdout.write, an AttributeError traceback with exit 1, where print (the
    json and batch outputs, the other commands) writes nothing; `flintc dump`'s flush
    after its tables did the same after writing the dumps. Both now end as the others:
    exit 0, nothing on stderr but the summary line."""
    for args in (["run", str(tiny_bf16_dir), "--prompt", "hi", "--max-tokens", "3"],
                 ["dump", str(tiny_bf16_dir), "--out", str(tmp_path / "d"), "--step", "decode"]):
        proc = subprocess.run([sys.executable, "-m", "flintc", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=600, close_fds=True,
                              preexec_fn=lambda: os.close(1))
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_batch_text_output_keeps_one_line_per_prompt():
    """`--output text` with several prompts prints `[i] text` lines: a generated line break
    or control character (raw, it split the line or moved the cursor) is escaped as Python
    writes it; printable text, non-ASCII included, is kept."""
    from flintc.cli.run import one_line

    assert one_line("a\nb\r\tc\x0e\u2028") == "a\\nb\\r\\tc\\x0e\\u2028"
    assert one_line("été 😀 'q' \"q\"") == "été 😀 'q' \"q\""
    assert one_line("x\\n") == "x\\\\n"  # a literal backslash stays told apart from a line break
    assert all("\n" not in one_line(chr(c)) for c in range(0x3000))


def test_text_the_terminal_cannot_encode_is_escaped(tiny_bf16_dir):
    """With an ASCII stdout (PYTHONIOENCODING=ascii, LANG=C), generated U+FFFD and other
    non-ASCII text is written escaped (\\ufffd), streaming or not; it was a
    UnicodeEncodeError traceback with exit 1."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    for prompts in (["1"], ["1", "2"]):
        args = [a for ids in prompts for a in ("--prompt-ids", ids)]
        proc = subprocess.run([sys.executable, "-m", "flintc", "run", str(tiny_bf16_dir), *args, "--max-tokens",
                               "12", "--temperature", "0", "--ignore-eos"], capture_output=True, env=env,
                              timeout=600)
        assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr.decode()
        assert proc.stdout.isascii() and b"\\ufffd" in proc.stdout, proc.stdout  # this seed's text has one


def test_prompt_bytes_that_are_not_utf8_name_the_flag(tiny_bf16_dir):
    """Regression: a --prompt whose command-line bytes are not UTF-8 (Latin-1 "h\\xe9llo";
    Python hands them on as lone surrogates) was refused only after the model loaded, by
    the tokenizer, in a message naming no flag. Now one line naming --prompt and the
    byte, exit 2, before any load."""
    proc = subprocess.run([sys.executable, "-m", "flintc", "run", str(tiny_bf16_dir).encode(),
                           b"--prompt", b"h\xe9llo"], capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONUTF8": "1"})
    err = proc.stderr.decode("utf-8", "backslashreplace")
    assert proc.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("flintc: error: --prompt: the text is not valid Unicode: byte 0xe9 at "
                          "character 1 is not valid utf-8; expected UTF-8 text"), err


def test_text_with_a_lone_surrogate_is_an_input_error(tiny_bf16_dir):
    """A prompt that is not valid Unicode (undecodable bytes of a command line under the C
    locale, `generate('h\\udce9llo')`) is an InputError naming the character; it was a
    TypeError from the tokenizers library."""
    from flintc.checkpoint.tokenizer import load_tokenizer
    from flintc.errors import InputError

    tok = load_tokenizer(tiny_bf16_dir)
    with pytest.raises(InputError, match="not valid Unicode: surrogates not allowed at character 1"):
        tok.encode("h\udce9llo")
    assert tok.encode("héllo") == tok._tok.encode("héllo", add_special_tokens=False).ids


def test_a_killed_runs_temporary_build_is_removed_by_the_next(tmp_path, monkeypatch):
    """A SIGKILLed `flintc run --backend torch` (or `flintc.compile()` without out) left its
    TMPDIR/flintc-build-* folder behind for good. Temporary builds are now named with
    their pid and hold a lock on their `.lock`; the next one removes the folders of dead
    processes older than `STALE_TEMP_BUILD_S`, and no other: not a fresh one, not one of a
    live process, not one whose lock is held (a live process of another pid namespace)."""
    import fcntl
    import signal
    import tempfile
    import time
    from pathlib import Path

    from flintc import fileio

    code = ("import time; from flintc.fileio import new_temp_build_dir; "
            "d = new_temp_build_dir(); (d / 'build').mkdir(); print(d, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)},
                            stdout=subprocess.PIPE, text=True)
    killed = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert killed.parent == tmp_path and killed.name.startswith(f"flintc-build-{proc.pid}-"), killed
    old = time.time() - fileio.STALE_TEMP_BUILD_S - 60
    dead = proc.pid

    def folder(pid, age=old, suffix="abcdefgh"):
        p = tmp_path / f"flintc-build-{pid}-{suffix}"
        p.mkdir()
        (p / ".lock").touch()
        os.utime(p, (age, age))
        return p

    os.utime(killed, (old, old))
    fresh = folder(dead, age=time.time(), suffix="fresh000")
    live = folder(os.getppid(), suffix="live0000")
    held = folder(dead, suffix="held0000")
    other = tmp_path / "flintc-build-notapid"
    other.mkdir()
    fd = os.open(held / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a live process of another pid namespace would
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        new = fileio.new_temp_build_dir()
    finally:
        os.close(fd)
    assert not killed.exists()
    assert all(p.is_dir() for p in (fresh, live, held, other, new))
    assert new.name.startswith(f"flintc-build-{os.getpid()}-")
    assert fileio.remove_stale_temp_builds(tmp_path) == [held]  # its lock released: now it goes
    fileio.remove_temp_build_dir(new)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (fresh, live, other))


def test_temporary_build_without_flock_support_still_works(tmp_path, monkeypatch):
    """A TMPDIR on a file system that refuses flock (ENOLCK, EOPNOTSUPP: some NFS and FUSE
    mounts) made every `flintc run` without --build and `flintc.compile()` without out fail
    with a bare OSError, leaving the new folder behind; before temporary builds were
    locked it worked. The folder is used unlocked (named with its pid, as before)."""
    import errno
    import fcntl
    import tempfile

    from flintc import fileio

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(fcntl, "flock", no_flock)
    new = fileio.new_temp_build_dir()
    assert new.is_dir() and new.parent == tmp_path
    fileio.remove_temp_build_dir(new)
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_build_with_a_fifo_lock_does_not_hang(tmp_path):
    """The stale-folder sweep opened `.lock` with a blocking open that follows links: a
    FIFO (or a link to one) there hung every later `flintc run` at start. It is opened
    without blocking and without following a link."""
    import time

    from flintc import fileio

    p = tmp_path / "flintc-build-999999999-abcdefgh"
    p.mkdir()
    os.mkfifo(p / ".lock")
    old = time.time() - fileio.STALE_TEMP_BUILD_S - 60
    os.utime(p, (old, old))
    code = ("import sys; from flintc.fileio import remove_stale_temp_builds; "
            "print(remove_stale_temp_builds(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr


def test_logits_out_refuses_to_replace_an_input(capsys, tmp_path, tiny_bf16_dir, tiny_nvfp4_gguf):
    """Regression: `--logits-out CKPT/model.safetensors` (or the .gguf MODEL itself, or a
    file of the build) wrote the logits over the checkpoint's weights, after generating.
    It is refused before any work, naming the flag and the input; a new file inside the
    checkpoint folder is still written."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_bf16_dir, ckpt)
    gguf = tmp_path / "g" / tiny_nvfp4_gguf.name
    shutil.copytree(tiny_nvfp4_gguf.parent, gguf.parent)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    for model, target in ((ckpt, ckpt / "model.safetensors"), (ckpt, ckpt / "config.json"),
                          (gguf, gguf), (gguf, gguf.parent / "tokenizer.json")):
        code, out, err = run_cli(capsys, "run", model, "--prompt-ids", "1", "--max-tokens", 1,
                                 "--logits-out", target)
        assert code == 2 and out == "" and "--logits-out" in err and "which this command reads" in err, err
        assert "MODEL" in err, err
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    code, _, err = run_cli(capsys, "run", ckpt, "--prompt-ids", "1", "--max-tokens", 1,
                           "--logits-out", ckpt / "logits.npy")
    assert code == 0, err
    assert np.load(ckpt / "logits.npy").shape == (1, 512)
    code, out, err = run_cli(capsys, "verify", ckpt, "--json", ckpt / "config.json")
    assert code == 2 and "--json" in err and "MODEL" in err and "which this command reads" in err, err
    assert (ckpt / "config.json").read_bytes() == before["config.json"]


def test_run_stop_strings_do_not_match_inside_special_tokens(capsys, tiny_bf16_dir):
    """--stop is matched on the text without special tokens, as `flintc serve` (by default)
    and the Python API match it: "user" never matches in "<|user|>", so the output runs to
    length with stop_reason None (it printed "<|" and stopped at the first token); the
    printed text keeps the special tokens, streamed or not."""
    from flintc.checkpoint.tokenizer import load_tokenizer

    user = load_tokenizer(tiny_bf16_dir).special_token_ids["<|user|>"]
    base = ["run", tiny_bf16_dir, "--prompt", "Hello world", "--temperature", 0, "--max-tokens", 3, "--ignore-eos",
            "--logit-bias", f"{user}=100", "--stop", "user"]
    code, out, err = run_cli(capsys, *base, "--output", "json")
    obj = json.loads(out)
    assert code == 0 and (obj["text"], obj["output_ids"], obj["finish_reason"], obj["stop_reason"]) == \
        ("<|user|>" * 3, [user] * 3, "length", None), obj
    code, out, err = run_cli(capsys, *base)  # streamed
    assert (code, out) == (0, "<|user|>" * 3 + "\n"), (out, err)


def test_run_stop_strings_text_and_json(capsys, tmp_path, tiny_bf16_dir):
    """--stop (repeatable), --stop-token-ids and --include-stop-str-in-output reach
    SamplingParams: --output json's text, output_ids, finish_reason and stop_reason are the
    Python API's; the streamed text of one prompt and the lines of a batch end before the
    stop string (the text that might begin one is held back, then printed when it does
    not); without a tokenizer --stop is refused in one line."""
    from flintc.checkpoint.tokenizer import load_tokenizer

    ckpt = load_checkpoint(tiny_bf16_dir, progress=False)
    model, tok = FlintModel(ckpt.config, ckpt.weights), load_tokenizer(tiny_bf16_dir)
    base = ["run", tiny_bf16_dir, "--prompt", "Hello world", "--temperature", 0, "--max-tokens", 24, "--ignore-eos"]
    code, out, err = run_cli(capsys, *base, "--output", "json")
    free = json.loads(out)
    text, ids = free["text"], free["output_ids"]
    assert free["stop_reason"] is None and free["finish_reason"] == "length"
    pieces = [tok.decode([t]) for t in ids]
    k = next(k for k in range(2, len(pieces)) if all(p and p.isascii() and p.isprintable()
                                                     for p in pieces[k - 1:k + 1]))
    stop = pieces[k - 1][-1] + pieces[k][0]  # spans two tokens
    for flags, kw in ((["--stop", stop], dict(stop=stop)),
                      (["--stop", "zzz", "--stop", stop, "--include-stop-str-in-output"],
                       dict(stop=["zzz", stop], include_stop_str_in_output=True)),
                      (["--stop-token-ids", str(ids[4]), "--stop-token-ids", str(ids[5])],
                       dict(stop_token_ids=[ids[4], ids[5]])),
                      (["--stop", stop + "~"], dict(stop=stop + "~"))):  # held back, then printed
        ref = generate(model, [tok.encode("Hello world")],
                       SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw), tokenizer=tok,
                       eos_token_id=tok.eos_token_id)
        code, out, err = run_cli(capsys, *base, *flags, "--output", "json")
        assert code == 0, err
        obj = json.loads(out)
        assert (obj["text"], obj["output_ids"], obj["finish_reason"], obj["stop_reason"]) == \
            (ref.texts[0], ref.output_ids[0], ref.finish_reasons[0], ref.stop_reasons[0]), flags
        assert (ref.finish_reasons[0], len(ref.output_ids[0]) < 24) == (("length", False) if "~" in flags[1]
                                                                          else ("stop", True))
        code, out, err = run_cli(capsys, *base, *flags)  # one prompt: streamed
        assert code == 0 and out == ref.texts[0] + "\n", (flags, out)
        code, out, err = run_cli(capsys, *base, *flags, "--prompt", "Hello world")  # a batch: one line each
        assert code == 0 and out == f"[0] {one_line(ref.texts[0])}\n[1] {one_line(ref.texts[0])}\n", flags
    assert text.startswith(json.loads(run_cli(capsys, *base, "--stop", stop, "--output", "json")[1])["text"])
    nothing = tmp_path / "model"
    shutil.copytree(tiny_bf16_dir, nothing, ignore=shutil.ignore_patterns("tokenizer*"))
    code, out, err = run_cli(capsys, "run", nothing, "--prompt-ids", "1,2", "--stop", "x")
    assert (code, out) == (2, "") and err == ("flintc: error: --stop needs the model's tokenizer (stop strings are "
                                              "matched in the output text): pass --tokenizer DIR, or end on token "
                                              "ids with --stop-token-ids\n")
