"""Seeds, devices and cache lengths of `flintc make-checkpoint`, `verify` and `dump`
(`flintc.cli.args`): a value torch would reject deep in the run (a seed of 2**64 or
more, `--device bogus`, CUDA on a machine without a GPU, more cache positions than the
model has) is a one-line error with exit code 2, before any work. An empty --device or
--buckets (of every sub-command that has one) is refused, one line: it used to mean
the default. `--prompt-ids -1,2` reaches the token-id check (argparse took -1,2 for an
option)."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from flintc.cli import args as cli_args
from flintc.cli import main
from flintc.errors import InputError
from harness import assert_one_line_error, run_cli


@pytest.mark.parametrize("text, value", [("0", 0), ("7", 7), (str(2**63 - 1), 2**63 - 1)])
def test_seed_accepts_the_generator_range(text, value):
    assert cli_args.seed(text) == value


@pytest.mark.parametrize("text", ["1.5", "x", ""])
def test_seed_refuses_what_is_no_integer(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer in \[0, 2\*\*63\)"):
        cli_args.seed(text)


@pytest.mark.parametrize("value", [2**63, 2**64, -1])
def test_seed_range_is_checked_up_front(value):
    with pytest.raises(InputError, match=rf"^--seed {value}: expected an integer in \[0, 2\*\*63\)$"):
        cli_args.check_option_values(argparse.Namespace(seed=value))


def test_torch_device():
    assert cli_args.torch_device("cpu") == torch.device("cpu")
    for bad, msg in (("bogus", "expected cpu or cuda"), ("meta", "expected cpu or cuda"),
                     ("", "expected cpu or cuda")):
        with pytest.raises(InputError, match=f"--device {bad!r}: {msg}|--device {bad}: {msg}"):
            cli_args.torch_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="--device cuda: no CUDA GPU is available"):
            cli_args.torch_device("cuda")


def test_device_name_and_buckets():
    assert cli_args.device_name("cuda:1") == "cuda:1"
    assert cli_args.buckets("1, 8") == (1, 8)
    for text in ("", " ", " \t"):
        assert cli_args.buckets(text) == ()
        with pytest.raises(InputError, match="must not be empty: expected cpu or cuda"):
            cli_args.check_option_values(argparse.Namespace(device=cli_args.device_name(text)))
        # what was typed, whitespace visible (' ' was echoed as '')
        with pytest.raises(InputError, match=f"^--buckets {re.escape(repr(text))}: must not be empty: expected "
                                             "comma-separated"):
            cli_args.check_option_values(argparse.Namespace(buckets=cli_args.buckets(text)))
    with pytest.raises(InputError, match="^--buckets '': must not be empty"):  # a plain tuple (no text)
        cli_args.check_option_values(argparse.Namespace(buckets=()))
    assert cli_args.buckets("1, x") == (1, "x")  # refused by check_option_values, echoing the text
    with pytest.raises(InputError, match="^--buckets '1, x': 'x' is not an integer; expected comma-separated"):
        cli_args.check_option_values(argparse.Namespace(buckets=cli_args.buckets("1, x")))
    assert cli_args.buckets("1,,2") == (1, None, 2) and cli_args.buckets("1, ") == (1, None)
    with pytest.raises(InputError, match="^--buckets '1,,2': item 2 is empty; expected comma-separated"):
        cli_args.check_option_values(argparse.Namespace(buckets=cli_args.buckets("1,,2")))
    # what was typed, spaces included (it was shown re-joined: ' , ' as ',', '1, 1' as '1,1')
    with pytest.raises(InputError, match="^--buckets ' , ': item 1 is empty; expected comma-separated"):
        cli_args.check_option_values(argparse.Namespace(buckets=cli_args.buckets(" , ")))
    with pytest.raises(InputError, match="^--buckets '1, 1': 1 given twice"):
        cli_args.check_option_values(argparse.Namespace(buckets=cli_args.buckets("1, 1")))
    with pytest.raises(InputError, match="^--buckets '1,,2': item 2 is empty"):  # a plain tuple (no text)
        cli_args.check_option_values(argparse.Namespace(buckets=(1, None, 2)))


@pytest.mark.parametrize("argv, flag", [
    (["compile", "--load-format", "dummy", "--config", "tiny", "--out", "{tmp}/b", "--buckets", ""], "--buckets"),
    (["run", "--prompt-ids", "1", "--backend", "torch", "--buckets", ""], "--buckets"),
    (["compile", "--load-format", "dummy", "--config", "tiny", "--out", "{tmp}/b", "--device", ""], "--device"),
    (["run", "--prompt-ids", "1", "--device", ""], "--device"),
    (["serve", "--port", "0", "--device", ""], "--device"),
    (["bench", "--config", "tiny", "--out", "{tmp}/o", "--device", ""], "--device"),
    (["verify", "--step", "decode", "--device", " "], "--device"),
    (["dump", "--out", "{tmp}/d", "--device", ""], "--device"),
])
def test_empty_device_or_buckets_is_refused(argv, flag, tmp_path, capsys):
    """`--buckets ""` compiled the default buckets and `--device ""` ran on the default
    device (compile, run, serve): now the empty value is refused in one line, naming the
    flag, before any work (not argparse's usage block)."""
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert_one_line_error(code, err, f"{flag} ", ": must not be empty: expected ")
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["compile", "--load-format", "dummy", "--config", "tiny", "--out", "{tmp}/b", "--buckets", " "],
    ["run", "--prompt-ids", "1", "--backend", "torch", "--buckets", " "],
])
def test_whitespace_buckets_are_echoed_as_typed(argv, tmp_path, capsys):
    """`--buckets ' '` (only whitespace) said "--buckets '': must not be empty", not what
    was typed, where the other --buckets errors echo it: now `--buckets ' '`."""
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert_one_line_error(code, err, "--buckets ' ': must not be empty: expected comma-separated decode batch sizes")
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, needle", [
    (["compile", "--load-format", "dummy", "--config", "tiny", "--out", "{tmp}/b", "--buckets", "1,,2"],
     "--buckets '1,,2': item 2 is empty"),
    (["run", "--prompt-ids", "1", "--backend", "torch", "--buckets", "1,"], "--buckets '1,': item 2 is empty"),
    (["run", "--prompt-ids", "1", "--backend", "torch", "--buckets", ",4"], "--buckets ',4': item 1 is empty"),
])
def test_empty_bucket_item_is_one_line(argv, needle, tmp_path, capsys):
    """`--buckets 1,,2` (a typo) printed argparse's usage block, where `--buckets ''`
    is one line: now one line too, naming the flag, what was typed and the empty item,
    before any work."""
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert_one_line_error(code, err, needle, "expected comma-separated decode batch sizes, e.g. 1,8")
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, needle", [
    (["compile", "--load-format", "dummy", "--config", "tiny", "--out", "{tmp}/b", "--buckets", "abc"],
     "--buckets 'abc': 'abc' is not an integer; expected comma-separated decode batch sizes, e.g. 1,8"),
    (["run", "--prompt-ids", "1", "--backend", "torch", "--buckets", "1, 2.5"],
     "--buckets '1, 2.5': '2.5' is not an integer; expected comma-separated decode batch sizes"),
    (["compile", "--load-format", "dummy", "--config", "tiny", "--out", "{tmp}/b", "--buckets", "2,1"],
     "--buckets '2,1': each must be >= 1 and the largest must equal --max-batch (8)"),
    (["compile", "--load-format", "dummy", "--config", "tiny", "--out", "{tmp}/b", "--max-batch", "2",
      "--buckets", "2, 0"], "--buckets '2, 0': each must be >= 1 and the largest must equal --max-batch (2)"),
])
def test_bucket_values_are_one_line_echoing_what_was_typed(argv, needle, tmp_path, capsys):
    """`--buckets abc` printed argparse's usage block ("invalid buckets value: 'abc'"), and
    `--buckets 2,1` was echoed as the sorted sizes ("--buckets 1,2: ..."): now one line
    naming the flag and echoing what was typed, before any work."""
    code, out, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert_one_line_error(code, err, needle)
    assert "usage:" not in err and out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, needle", [
    (["make-checkpoint", "--seed", str(2**64), "--out", "{tmp}/ck"], "--seed 18446744073709551616: expected an integer"),
    (["verify", "--seed", str(10**23)], f"--seed {10**23}: expected an integer"),
    (["dump", "--seed", "-3", "--out", "{tmp}/d"], "--seed -3: expected an integer"),
    (["verify", "--device", "bogus"], "--device 'bogus': expected cpu or cuda"),
    (["dump", "--device", "bogus", "--out", "{tmp}/d"], "--device 'bogus': expected cpu or cuda"),
    (["verify", "--step", "decode", "--cache-len", "999999999"],
     "--cache-len 999999999 / --tokens 16: more positions than the model's max_position_embeddings"),
])
def test_bad_seed_device_cache_len_is_one_line(argv, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse errors exit; InputError returns 2
        raise SystemExit(main([a.format(tmp=tmp_path) for a in argv]))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert needle in err and "Traceback" not in err, err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "d").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_verify_on_cuda_without_a_gpu(capsys):
    code = main(["verify", "--device", "cuda"])
    err = capsys.readouterr().err
    assert code == 2 and "--device cuda: no CUDA GPU is available" in err, err


def test_join_int_list_values():
    join = cli_args.join_int_list_values
    assert join(["run", "--prompt-ids", "-1,2", "--seed", "-3"]) == ["run", "--prompt-ids=-1,2", "--seed", "-3"]
    assert join(["run", "--prompt-ids", "1,2", "--prompt-ids", "-4"]) == ["run", "--prompt-ids", "1,2",
                                                                         "--prompt-ids=-4"]
    assert join(["run", "--prompt-ids", "-x"]) == ["run", "--prompt-ids", "-x"]  # an option: argparse says so
    assert join(["run", "--", "--prompt-ids", "-1,2"]) == ["run", "--", "--prompt-ids", "-1,2"]
    assert join(["run", "--prompt-ids"]) == ["run", "--prompt-ids"]


@pytest.mark.parametrize("ids, bad", [("-1,2", -1), ("-1", -1), ("3,-20", -20)])
@pytest.mark.parametrize("joined", [False, True])
def test_negative_prompt_ids_are_refused_naming_the_flag(capsys, tiny_bf16_dir, ids, bad, joined):
    """Token ids are in [0, vocab_size): `--prompt-ids -1,2` said "argument --prompt-ids:
    expected one argument" (argparse took -1,2 for an option), `--prompt-ids=-1,2` and
    `--prompt-ids -1` said "prompt: token id -1 is outside the vocabulary" after loading
    the model. Now every form is one line naming --prompt-ids and the negative id."""
    args = [f"--prompt-ids={ids}"] if joined else ["--prompt-ids", ids]
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, *args, "--max-tokens", 1)
    assert_one_line_error(code, err, f"--prompt-ids {ids!r}: token id {bad} is negative; token ids are in "
                          "[0, vocab_size)")
    assert out == ""


@pytest.mark.parametrize("item, bad", [("-1=1", -1), ("-20=-100", -20)])
@pytest.mark.parametrize("joined", [False, True])
def test_negative_logit_bias_ids_are_refused_naming_the_flag(capsys, tiny_bf16_dir, item, bad, joined):
    """`--logit-bias -1=1` said "argument --logit-bias: expected one argument" (argparse
    took -1=1 for an option), `--logit-bias=-1=1` "sampling field 'logit_bias': token id -1
    is not an integer >= 0": both now say it as `--prompt-ids -1` does."""
    args = [f"--logit-bias={item}"] if joined else ["--logit-bias", item]
    code, out, err = run_cli(capsys, "run", tiny_bf16_dir, "--prompt-ids", "1,2", *args, "--max-tokens", 1)
    assert_one_line_error(code, err, f"--logit-bias {item!r}: token id {bad} is negative; token ids are in "
                          "[0, vocab_size)")
    assert out == ""


def test_version_flag_prints_the_server_s_version(capsys):
    """`flintc --version` (as `vllm --version`): the version `/version` serves, exit 0;
    before, argparse said "the following arguments are required: COMMAND"."""
    import flintc

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"flintc {flintc.__version__}"


def test_version_of_a_source_tree_not_installed(monkeypatch):
    """Run from a source tree with no package metadata (the GPU scripts put the checkout
    on PYTHONPATH), `flintc.__version__` is pyproject.toml's version, not "unknown" (the
    bench records of session 38 said "flintc unknown")."""
    import importlib.metadata as md
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (3.10: "unknown", as before)

    import flintc

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", missing)
    with open(Path(flintc.__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        want = tomllib.load(f)["project"]["version"]
    assert flintc.__version__ == want != "unknown"


def test_version_of_the_tree_that_runs_over_an_installed_one(monkeypatch):
    """A source tree on PYTHONPATH while another flintc is installed (an H100 with a
    pip-installed flintc running the GPU scripts): the version is the tree's, the code
    that runs, not the installed package's."""
    import importlib.metadata as md

    pytest.importorskip("tomllib")
    import flintc

    monkeypatch.setattr(md, "version", lambda name: "0.0.0-installed-elsewhere")
    assert flintc.__version__ == flintc._source_tree_version() != "0.0.0-installed-elsewhere"


def test_an_option_value_of_two_dashes_is_kept(capsys):
    """`--prompt=--` / `--stop=--`: Python's argparse before 3.12.7 dropped a `--` that is
    an option's whole value, leaving an empty list (`--prompt=--` was an AttributeError
    traceback, `--stop=--` "expected strings, got []"). The value is "--", and the
    option's type still checks it."""
    from flintc.cli import build_parser

    args = build_parser().parse_args(["run", "--prompt=--", "--stop=--", "--stop=x", "--tokenizer=--"])
    assert args.prompt == ["--"] and args.stop == ["--", "x"] and args.tokenizer == "--"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--prompt", "a", "--max-tokens=--"])
    assert "argument --max-tokens: invalid int value: '--'" in capsys.readouterr().err
    # "--" alone still ends the options
    assert build_parser().parse_args(["run", "--", "model"]).model == "model"
