"""`flintc run`: generate from one or more prompts.

MODEL is a BF16 checkpoint folder or an NVFP4 `.gguf` file; with none, the
embedded default (the tiny NVFP4 checkpoint, see `flintc.checkpoint.default`).
Backends: `reference` (the eager reference model, the default), or a compiled
runtime: `--build BUILD` (written by `flintc compile`), or `--backend triton|torch`
to compile MODEL on the fly into a temporary BUILD. Text output streams the
generated text of a single prompt, then one summary line on stderr; `--output json`
prints one JSON object per prompt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from flintc.errors import InputError


def add_parser(sub) -> None:
    from flintc.cli import HelpFormatter
    from flintc.cli.compile_build import add_build_args, add_model_source_args

    p = sub.add_parser("run", help="generate text or token ids from prompts",
                       description=__doc__.split("\n\n")[1] if __doc__ else None,
                       formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="BF16 checkpoint folder or NVFP4 .gguf file (default: the embedded tiny model, "
                        "or the checkpoint a --build was compiled from)")
    p.add_argument("--prompt", action=_AppendPrompt, default=None,
                   help="prompt text (needs a tokenizer); repeat for a batch (any number: more than "
                        "--max-batch run in consecutive batches)")
    p.add_argument("--prompt-ids", action=_AppendPrompt, default=None,
                   help="prompt token ids, comma-separated, e.g. 1,2,3; repeat for a batch (the batch keeps "
                        "the order of --prompt and --prompt-ids on the command line)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="keep the most likely tokens up to this probability mass (after top-k)")
    p.add_argument("--top-k", type=int, default=20, help="0 or -1 keeps every token")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at <|endoftext|> nor at the generation config's other end tokens "
                        "(<|user|>, <|observation|>), which end the output otherwise (vLLM's)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted from the logit of each token already generated (vLLM's)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]: subtracted from each token's logit times its count in the generated "
                        "tokens (vLLM's)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0: for the tokens of the prompt and the generated ones, positive logits are "
                        "divided by it, the others multiplied (vLLM's; 1 is off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="in [0, 1]: drop tokens less likely than this times the most likely one (vLLM's)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="generate at least this many tokens before a stop token (<|endoftext|>, <|user|>, "
                        "<|observation|> or a --stop-token-ids id) "
                        "may come and --stop strings are looked for")
    p.add_argument("--logit-bias", action="append", default=None, metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to token ID's logit; repeat for more tokens")
    p.add_argument("--structured-outputs", default=None, metavar="JSON",
                   help="constrain the output (vLLM's structured outputs, on llguidance): a JSON object with "
                        "one of json (a JSON schema), regex, choice (a list of strings), grammar (Lark), "
                        "json_object (true) or structural_tag ({\"structures\": [{\"begin\", \"schema\", "
                        "\"end\"}], \"triggers\": [...]}, or its JSON text), e.g. '{\"choice\": [\"yes\", "
                        "\"no\"]}'; needs the tokenizer")
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="stop string: the output ends when one ends in the latest token's text (the first "
                        "in the order given; looked for once more than --min-tokens tokens are out), which "
                        "the text leaves out (vLLM's stop); repeat for more; needs the tokenizer")
    p.add_argument("--stop-token-ids", action="append", default=None, metavar="IDS",
                   help="token ids that end the output, comma-separated, e.g. 5,9 (even with --ignore-eos; "
                        "kept in the output ids, left out of the text; vLLM's stop_token_ids); repeat to add")
    p.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the stop string, or the stop token's text, that ended the output in the text")
    add_model_source_args(p)
    p.add_argument("--build", default=None, help="run this BUILD (from flintc compile)")
    p.add_argument("--backend", choices=("reference", "auto", "triton", "torch"), default=None,
                   help="reference: the eager model; triton/torch: compile MODEL first "
                        "(default: reference, or the build's own with --build)")
    add_build_args(p, backend=False)
    p.add_argument("--mode", choices=("bf16", "float64"), default=None,
                   help="reference backend numerics: bf16 (FLINT_SPEC rounding points) or float64 "
                        "oracle (default: bf16)")
    p.add_argument("--output", choices=("text", "json"), default="text",
                   help="text: stream a single prompt's text (else one line per prompt, line breaks "
                        "and other control characters escaped as \\n, \\x0e, ...); json: one object "
                        "per prompt")
    p.add_argument("--logits-out", default=None,
                   help="save the fp32 logits of the prompt positions, [T, vocab_size], as .npy "
                        "(one prompt only)")
    p.set_defaults(func=run_generate)


def parse_structured_outputs(text: str | None) -> dict | None:
    """--structured-outputs JSON -> the dict of `StructuredOutputsParams` fields (checked
    by SamplingParams). Raises InputError naming the flag for text that is not a JSON
    object."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InputError(f"--structured-outputs: not valid JSON ({exc}); expected an object such as "
                         "'{\"regex\": \"[0-9]+\"}'") from None
    if not isinstance(value, dict):
        raise InputError(f"--structured-outputs: expected a JSON object (json, regex, choice, grammar, "
                         f"json_object or structural_tag), got {json.dumps(value)[:80]}")
    return value


def parse_logit_bias(items: list[str] | None) -> dict[int, float] | None:
    """--logit-bias values ['ID=BIAS', ...] -> {id: bias}. Raises InputError naming the
    flag: an item not ID=BIAS with an integer id and a number, or an id given twice."""
    if not items:
        return None
    out: dict[int, float] = {}
    for item in items:
        tok, sep, bias = item.partition("=")
        try:
            if not sep:
                raise ValueError
            tok_id, value = int(tok.strip()), float(bias.strip())
        except ValueError:
            raise InputError(f"--logit-bias {item!r}: expected ID=BIAS, a token id and a number, "
                             "e.g. --logit-bias 42=-100") from None
        if tok_id < 0:  # as --prompt-ids
            raise InputError(f"--logit-bias {item!r}: token id {tok_id} is negative; token ids are in "
                             "[0, vocab_size)")
        if tok_id in out:
            raise InputError(f"--logit-bias: token id {tok_id} given twice")
        out[tok_id] = value
    return out


def parse_stop_token_ids(items: list[str] | None) -> list[int] | None:
    """--stop-token-ids values ['5,9', ...] -> [5, 9, ...]. Raises InputError naming the
    flag: an item that is not an integer, or a negative one (the upper bound is checked
    once the model's config is read, `_check_ids_in_vocab`)."""
    if not items:
        return None
    ids = []
    for text in items:
        for piece in text.split(","):
            piece = piece.strip()
            try:
                ids.append(int(piece))
            except ValueError:
                raise InputError(f"--stop-token-ids: {piece!r} is not an integer token id (expected ids "
                                 "separated by commas, e.g. --stop-token-ids 5,9)") from None
            if ids[-1] < 0:
                raise InputError(f"--stop-token-ids {text!r}: token id {ids[-1]} is negative; token ids are in "
                                 "[0, vocab_size)")
    return ids


class _AppendPrompt(argparse._AppendAction):
    """--prompt / --prompt-ids: each value appended to its own list, and (dest, index) to
    `prompt_order`, so that a batch mixing the two keeps the command line's order."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        order = list(getattr(namespace, "prompt_order", None) or [])  # a new list: never a shared default
        namespace.prompt_order = order + [(self.dest, len(getattr(namespace, self.dest)) - 1)]


def parse_prompt_ids(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]: one --prompt-ids value. Raises InputError naming the flag: an
    item that is not an integer, or a negative one (token ids are in [0, vocab_size);
    the upper bound is checked once the model's config is read, `_check_ids_in_vocab`)."""
    ids = []
    for piece in text.split(","):
        piece = piece.strip()
        try:
            ids.append(int(piece))
        except ValueError:
            raise InputError(f"--prompt-ids: {piece!r} is not an integer token id") from None
        if ids[-1] < 0:
            raise InputError(f"--prompt-ids {text!r}: token id {ids[-1]} is negative; token ids are in "
                             "[0, vocab_size)")
    return ids


# Flags that only shape a compile: meaningless on the reference backend, and fixed by
# `flintc compile` for a --build.
_COMPILE_ONLY = (("--buckets", "buckets"), ("--no-check", "no_check"), ("--no-dump", "no_dump"),
                 ("--fold-attention-combine", "fold_attention_combine"),
                 ("--split-lm-head-norm / --no-split-lm-head-norm", "split_lm_head_norm"))


def _given(args, dest: str):
    value = getattr(args, dest, None)
    if dest == "split_lm_head_norm":  # argparse.BooleanOptionalAction: None when not given
        return value is not None
    return value not in (None, False)


def _check_backend_flags(args, backend: str) -> None:
    """Refuse flags the chosen backend would ignore; check the limits given. Raises
    InputError naming the flag (no flag is ever silently ignored)."""
    if args.max_batch is not None and args.max_batch < 1:
        raise InputError(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise InputError(f"--prefill-chunk must be at least 1, got {args.prefill_chunk}")
    if backend == "reference":
        for flag, dest in _COMPILE_ONLY:
            if _given(args, dest):
                raise InputError(f"{flag} applies only to a compiled backend (--build, or --backend torch|triton); "
                                 "the reference backend compiles nothing")
        return
    if args.mode is not None and args.mode != "bf16":
        raise InputError(f"--mode {args.mode} applies only to the reference backend; a compiled runtime "
                         "follows the bf16 numerics")
    if backend == "build":
        for flag, dest in _COMPILE_ONLY + (("--prefill-chunk", "prefill_chunk"),):
            if _given(args, dest):
                raise InputError(f"{flag}: a build fixes it at compile time; drop {flag} or recompile "
                                 "with flintc compile")


def _temporary_build_dumps(opts, no_dump: bool, config) -> None:
    """Where a temporary BUILD's pass-by-pass dumps go: the BUILD is removed at exit, so
    they are written only where they outlive the run, into `$FLINTC_DUMP_DIR/<function>/`
    when it is set (as for any compile), else nowhere; --no-dump always means none.

    Raises:
        InputError: naming the variable, before any compile: its folder cannot be
            written, or one of the functions' subfolders holds files that are not an
            earlier dump (`flintc.passes.pipeline.check_env_dump_subdir`)."""
    from flintc.fileio import dump_dir_from_env
    from flintc.passes.pipeline import check_env_dump_subdir
    from flintc.runtime.build import function_names

    dump_dir = None if no_dump else dump_dir_from_env()  # an unwritable one: an InputError now
    opts.dump = dump_dir is not None
    opts.dump_dir = dump_dir if opts.dump else None
    if opts.dump:
        for name in function_names(opts, config):
            check_env_dump_subdir(dump_dir, name)


def _check_ids_in_vocab(params, id_prompts: list[list[int]], vocab_size, source: str) -> None:
    """The token ids of --logit-bias, --stop-token-ids and --prompt-ids against the model's vocabulary, as
    soon as its size is known (config.json, or a --build's build.json): before any weight
    loads and a --backend torch|triton compiles (an id past the end was refused only
    after both, naming no flag). Raises InputError naming the flag, the id, the valid
    range and `source`."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        return  # a malformed build.json: load_build names the field
    for tok, bias in params.logit_bias or ():
        if tok >= vocab_size:
            raise InputError(f"--logit-bias {tok}={bias:g}: token id {tok} is outside the vocabulary "
                             f"[0, {vocab_size}) of {source}")
    for tok in params.stop_token_ids or ():
        if tok >= vocab_size:
            raise InputError(f"--stop-token-ids: token id {tok} is outside the vocabulary [0, {vocab_size}) "
                             f"of {source}")
    for ids in id_prompts:
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InputError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size}) "
                             f"of {source}")


def _runner_and_tokenizer(args, cleanup: contextlib.ExitStack, params, id_prompts):
    """(runner or FlintModel, tokenizer or None, the --prompt texts' token ids) for
    the chosen backend. A temporary BUILD (--backend torch|triton) is removed when `cleanup`
    closes. The prompts' and --logit-bias's token ids are checked against the vocabulary
    before any weight loads (`_check_ids_in_vocab`), the tokenizer and the texts before a
    build loads or a temporary one compiles (`_tokenizer_and_texts`)."""
    from flintc.cli.compile_build import (build_options, check_model_source_args, load_model_checkpoint,
                                          prepare_device)

    backend = args.backend or ("build" if args.build else "reference")
    if args.build and backend not in ("build", "reference") and args.backend is not None:
        raise InputError("--build runs the build's own backend; drop --backend")
    if args.build and args.backend == "reference":
        raise InputError("--build runs the build's own backend; drop --backend reference (or --build)")
    _check_backend_flags(args, backend)
    if args.build:
        from flintc.runtime.compiled import check_build_limits, limit_build, load_build, read_manifest

        manifest = read_manifest(args.build)
        check_build_limits(args.build, manifest, max_model_len=args.max_model_len, max_batch=args.max_batch)
        check_model_source_args(args, build_manifest=manifest)
        build_config = manifest.get("config")
        vocab_size = build_config.get("vocab_size") if isinstance(build_config, dict) else None
        _check_ids_in_vocab(params, id_prompts, vocab_size, str(Path(args.build) / "build.json"))
        device = args.device or manifest.get("device", "cpu")
        if args.device is None and device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise InputError(f"{args.build} was compiled for {device} but no CUDA GPU is available; "
                                 "pass --device cpu to run it on the CPU")
        from flintc.runtime.compiled import check_weight_kind, recorded_weight_source
        from flintc.serve.server import tokenizer_dir

        check_weight_kind(args.build, manifest, args.load_format, args.model)
        if args.model is None and args.load_format != "dummy":
            # as flintc serve --build: the checkpoint build.json records must be there (the
            # tokenizer is looked for beside it; a cached default model is written again)
            recorded_weight_source(args.build, manifest)
        # as flintc serve --build: beside MODEL, then where build.json says; needed for --prompt
        tok_dir = tokenizer_dir(args, required=bool(args.prompt))
        tokenizer, texts = _tokenizer_and_texts(args, tok_dir, vocab_size, str(Path(args.build) / "build.json"))
        prepare_device(device)
        runner = load_build(args.build, model=args.model, device=device,
                            load_format=args.load_format if args.load_format == "dummy" else None,
                            hf_config_path=args.hf_config_path, progress=sys.stderr.isatty())
        limit_build(runner, args.build, max_model_len=args.max_model_len, max_batch=args.max_batch)
        return runner, tokenizer, texts
    check_model_source_args(args)
    args.device = args.device or "cpu"
    prepare_device(args.device)
    if backend != "reference":  # a bad FLINTC_* variable: before the weights load and the compile
        from flintc.runtime.compiled import check_environment

        check_environment("torch" if backend == "auto" and args.device == "cpu" else backend)
    ckpt = load_model_checkpoint(
        args, args.device,
        check_config=lambda config: _check_ids_in_vocab(params, id_prompts, config.vocab_size, config.source))
    limit = ckpt.config.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
        # the reference backend cut it to max_position_embeddings silently (as flintc compile
        # and flintc serve refuse it)
        raise InputError(f"--max-model-len {args.max_model_len}: more than the model's max_position_embeddings "
                         f"({limit}); drop the flag for {limit}, or give a smaller one")
    # before the compile (and its "pass-by-pass dumps" line): a --prompt without a tokenizer
    # was refused after it
    tokenizer, texts = _tokenizer_and_texts(args, ckpt.tokenizer_dir, ckpt.config.vocab_size, ckpt.config.source)
    if backend == "reference":
        from flintc.model.reference import FlintModel

        # RoPE tables for the positions the run may use (2**22 positions' tables took 1 GB)
        return (FlintModel(ckpt.config, ckpt.weights, mode=args.mode or "bf16", max_positions=args.max_model_len),
                tokenizer, texts)
    from flintc.runtime.build import compile_model
    from flintc.runtime.compiled import load_build

    args.backend = backend
    if args.max_batch is None:
        args.max_batch = 8
    from flintc.fileio import new_temp_build_dir, remove_temp_build_dir

    tmp = new_temp_build_dir()  # (and removes those a killed run left)
    cleanup.callback(remove_temp_build_dir, tmp)
    out = tmp / "build"
    opts = build_options(args)
    _temporary_build_dumps(opts, args.no_dump, ckpt.config)
    compile_model(ckpt, out, opts, progress=sys.stderr.isatty(), log=lambda m: print(m, file=sys.stderr))
    if opts.dump:
        print(f"pass-by-pass dumps: {opts.dump_dir}/<function>/", file=sys.stderr)
    runner = load_build(out, ckpt=ckpt, device=args.device)
    return runner, tokenizer, texts


def _tokenizer_and_texts(args, found, vocab_size, config_where):
    """(tokenizer, token ids of each --prompt text): the tokenizer of --tokenizer, else the
    one `found` (beside MODEL, or where a --build records it), None when there is none
    and no --prompt needs one. Called once the model's vocabulary size is known (from
    `config_where`: config.json, or the build's build.json) and before a build loads or
    a temporary one compiles, so that what is wrong with them is the only output.

    Raises:
        InputError: --prompt with no tokenizer (naming where it was looked for), --stop
            with none; a
            --prompt text of --max-model-len tokens or more (as --prompt-ids,
            `_check_prompts_early`).
        CheckpointError: a tokenizer with ids of `vocab_size` or more
            (`FlintTokenizer.check_fits_model`, naming its file and `config_where`; one
            with fewer tokens than the model fits).
    """
    from flintc.checkpoint.tokenizer import load_tokenizer

    tok_dir = args.tokenizer or found
    if args.prompt and tok_dir is None:  # MODEL (or dummy weights) without a tokenizer, no --build
        where = (f"no tokenizer.json beside MODEL {args.model}" if args.model is not None else
                 "dummy weights" + (f" of --config {args.config}" if args.config else "") + " come without one"
                 if args.load_format == "dummy"
                 else "none beside the default model")
        if args.hf_config_path is not None:
            where += f" nor in --hf-config-path {args.hf_config_path}"
        raise InputError(f"--prompt needs a tokenizer: {where}; pass --tokenizer DIR (a folder with "
                         "tokenizer.json and tokenizer_config.json), or give token ids with --prompt-ids")
    if args.stop and tok_dir is None:  # the stop strings are matched in the text
        raise InputError("--stop needs the model's tokenizer (stop strings are matched in the output text): "
                         "pass --tokenizer DIR, or end on token ids with --stop-token-ids")
    tokenizer = load_tokenizer(tok_dir) if tok_dir else None
    if tokenizer is not None and isinstance(vocab_size, int):
        tokenizer.check_fits_model(vocab_size, config_where)
    texts = [tokenizer.encode(t) for t in args.prompt or []]
    _check_prompt_lengths("--prompt", texts, args.max_model_len)
    return tokenizer, texts


def _check_prompts_early(args, id_prompts: list[list[int]]) -> None:
    """What can be told of the prompts before the model loads (and a --backend
    torch|triton compiles): a --prompt text that is empty or not valid Unicode
    (`check_prompt_text`; a --stop string not valid Unicode too), and --prompt-ids that do not fit a --max-model-len given (they
    used to fail only after the load and compile, as "prompt is empty" / "prompt has N
    tokens"). Raises InputError naming the flag. Token ids beyond the vocabulary are
    checked once its size is known (`_check_ids_in_vocab`), text prompts that encode too
    long once the tokenizer is loaded (`flintc.model.generate.check_prompt`)."""
    if args.max_model_len is not None and args.max_model_len < 2:  # as flintc serve: a prompt needs < it
        # before the prompts are measured against it: 1 was "more than the maximum of 0"
        raise InputError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    for text in args.prompt or []:
        if text == "":
            raise InputError("--prompt '': the prompt text is empty; a prompt needs at least one token")
        check_prompt_text(text, "--prompt")
    for text in args.stop or []:  # a lone surrogate is in no decoded text: it never matched
        check_prompt_text(text, "--stop", "give the stop string in UTF-8")
    _check_prompt_lengths("--prompt-ids", id_prompts, args.max_model_len)


def _check_prompt_lengths(flag: str, prompts: list[list[int]], max_model_len: int | None) -> None:
    """Raise InputError naming `flag` for a prompt of `max_model_len` tokens or more (None:
    no limit given): --max-model-len counts the prompt and at least one generated token."""
    if max_model_len is None:
        return
    for ids in prompts:
        if len(ids) >= max_model_len:
            raise InputError(f"{flag}: {_n_tokens(len(ids))}, more than the maximum of {max_model_len - 1} "
                             f"(--max-model-len {max_model_len} counts the prompt and at least one "
                             "generated token)")


def _n_tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def check_prompt_text(text: str, flag: str,
                      hint: str = "convert the prompt to UTF-8, or give token ids with --prompt-ids") -> None:
    """Refuse a prompt text (or another text flag's value, `hint` then telling what to do)
    that is not valid Unicode, naming `flag`. Python decodes the
    command line with surrogateescape: bytes that are not valid in its encoding (Latin-1
    text under a UTF-8 locale, say) arrive as lone surrogates U+DC80..U+DCFF, which no
    tokenizer can encode (the tokenizer's own error named no flag, after the model had
    loaded).

    Raises:
        InputError: `text` holds a lone surrogate; the message names the flag, the
            character's position and the undecodable byte.
    """
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if 0xDC80 <= code <= 0xDCFF:  # surrogateescape's stand-in for an undecodable byte
            what = (f"byte 0x{code - 0xDC00:02x} at character {e.start} is not valid "
                    f"{sys.getfilesystemencoding()}")
        else:
            what = f"character {e.start} ({text[e.start]!r}) is a lone surrogate"
        raise InputError(f"{flag}: the text is not valid Unicode: {what}; expected UTF-8 text ({hint})") from None


def run_generate(args: argparse.Namespace) -> int:
    from flintc.sampling import SamplingParams

    if not args.prompt and not args.prompt_ids:
        raise InputError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3 (repeat either for a batch)")
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                                presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty,
                                repetition_penalty=args.repetition_penalty, min_p=args.min_p,
                                min_tokens=args.min_tokens, logit_bias=parse_logit_bias(args.logit_bias),
                                structured_outputs=parse_structured_outputs(args.structured_outputs),
                                stop=args.stop, stop_token_ids=parse_stop_token_ids(args.stop_token_ids),
                                include_stop_str_in_output=args.include_stop_str_in_output)
    except InputError as exc:  # name the flag the user typed, not only the field
        field = str(exc).split("'")[1] if str(exc).count("'") >= 2 else None
        if field in ("temperature", "top_p", "top_k", "max_tokens", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
                     "structured_outputs", "stop", "stop_token_ids"):
            raise InputError(f"--{field.replace('_', '-')}: {exc}") from None
        raise
    id_prompts = [parse_prompt_ids(t) for t in args.prompt_ids or []]
    _check_prompts_early(args, id_prompts)
    n_prompts = len(id_prompts) + len(args.prompt or [])
    if args.logits_out is not None:
        if n_prompts != 1:
            raise InputError("--logits-out takes one prompt")
        from flintc.cli.compile_build import check_output_file

        check_output_file(args.logits_out, "--logits-out", _run_inputs(args))
    with contextlib.ExitStack() as cleanup:
        return _generate(args, params, id_prompts, cleanup)


def _run_inputs(args) -> list[tuple[str, object]]:
    """What `flintc run` reads, as (label, path or None) pairs for `check_output_file`:
    MODEL (and a .gguf MODEL's folder, where its config and tokenizer are looked for),
    --hf-config-path, --tokenizer, --build and, without MODEL, the checkpoint and
    tokenizer folder the build's build.json records (a build.json that cannot be read
    adds nothing: its error comes when the build loads)."""
    inputs = [("MODEL", args.model), ("--hf-config-path", args.hf_config_path), ("--tokenizer", args.tokenizer),
              ("--build", args.build)]
    if args.model is not None and os.path.isfile(args.model):
        inputs.append(("the folder of MODEL", os.path.dirname(os.path.abspath(args.model))))
    if args.build and args.model is None:
        from flintc.runtime.compiled import read_manifest

        try:
            manifest = read_manifest(args.build)
        except InputError:
            return inputs
        for label, key in (("the build's checkpoint", "weight_source"), ("the build's tokenizer", "tokenizer_dir")):
            value = manifest.get(key)
            if isinstance(value, str) and value and not value.startswith("dummy:"):
                inputs.append((label, value))
    return inputs


def _generate(args, params, id_prompts, cleanup) -> int:
    engine, tokenizer, texts = _runner_and_tokenizer(args, cleanup, params, id_prompts)
    if params.structured_outputs is not None and tokenizer is None:
        raise InputError("--structured-outputs needs the model's tokenizer (tokenizer.json beside the model)")
    given = {"prompt": texts, "prompt_ids": id_prompts}
    order = getattr(args, "prompt_order", None) or [(d, i) for d in given for i in range(len(given[d]))]
    prompts = [given[dest][i] for dest, i in order]  # as on the command line
    single = len(prompts) == 1
    stop_ids = set(params.stop_token_ids or ())
    # end-of-text and the generation config's end ids (<|user|>, <|observation|>:
    # `model_stop_token_ids`, the set `generate_with_runner` takes from the tokenizer) end
    # the output unless --ignore-eos; with --structured-outputs even then, where the grammar
    # accepts them (the only place its mask lets them be drawn), as `generate_with_runner`
    # ends it (`stop_token_end`): the streamed text printed its '<|endoftext|>'
    if (not args.ignore_eos or params.structured_outputs is not None) and tokenizer is not None:
        from flintc.checkpoint.tokenizer import model_stop_token_ids

        stop_ids.update(model_stop_token_ids(tokenizer))
    stream = (_TextStream(tokenizer, stop_ids, params.stop or (), params.include_stop_str_in_output,
                          params.min_tokens)
              if args.output == "text" and single else None)
    kwargs = dict(eos_token_id=tokenizer.eos_token_id if tokenizer else None, tokenizer=tokenizer,
                  return_prompt_logits=args.logits_out is not None,
                  on_token=(lambda b, t: stream.push(t)) if stream else None)
    from flintc.model.reference import FlintModel

    try:
        if isinstance(engine, FlintModel):
            from flintc.model.generate import generate

            if args.prefill_chunk is not None:
                kwargs["prefill_chunk"] = args.prefill_chunk
            result = generate(engine, prompts, params, max_model_len=args.max_model_len,
                              max_batch=args.max_batch, **kwargs)
        else:
            from flintc.runtime.generate import generate_with_runner

            result = generate_with_runner(engine, prompts, params, **kwargs)
    except BaseException:
        if stream is not None:  # the text streamed so far ends its line: the error's is its own
            stream.end_line()
        raise
    if args.logits_out is not None:
        _save_npy_atomic(args.logits_out, result.prompt_logits[0].numpy())
    for i, (ids, out_ids) in enumerate(zip(prompts, result.output_ids)):
        if args.output == "json":
            obj = {"prompt_ids": ids, "output_ids": out_ids, "finish_reason": result.finish_reasons[i],
                   "stop_reason": result.stop_reasons[i]}
            if not single:
                obj = {"index": i, **obj}
            if tokenizer is not None:
                obj["text"] = result.texts[i]
            print(json.dumps(obj))
        elif stream is not None:
            stream.close(result.texts[i] if result.texts is not None else None)
        else:
            text = result.texts[i] if tokenizer else " ".join(map(str, out_ids))
            print(f"[{i}] {one_line(text)}")
    print(f"prompt tokens: {sum(map(len, prompts))}, generated tokens: "
          f"{sum(map(len, result.output_ids))}, prefill: {result.prefill_seconds:.3f} s, "
          f"decode: {_decode_figure(result)}", file=sys.stderr)
    return 0


def one_line(text: str) -> str:
    """`text` on one line: backslashes, line breaks and other characters that do not print
    (control characters, U+2028, ...) escaped as Python writes them (\\\\, \\n, \\x0e,
    \\u2028); printable text, non-ASCII included, as it is."""
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c.isprintable():
            out.append(c)
        else:
            out.append(repr(c)[1:-1])
    return "".join(out)


def _decode_figure(result) -> str:
    """The summary line's decode figure: milliseconds per decode step (one token per
    sequence), or "0 tokens" when no step ran (--max-tokens 0 or 1, or every sequence
    stopped at its first token): never a rate over zero tokens."""
    if result.decode_steps == 0:
        return "0 tokens"
    return f"{1000 * result.decode_seconds / result.decode_steps:.2f} ms/token"


class _TextStream:
    """Prints generated text as it appears (token ids when there is no tokenizer). A stop
    token the sequence ends at (`stop_ids`: end-of-text and the generation config's
    <|user|> / <|observation|> unless --ignore-eos, and --stop-token-ids) is not printed,
    as `--output json`'s text and vLLM's leave it out, unless `include`
    (--include-stop-str-in-output). With stop strings (`stops`, --stop)
    the text is cut as generation cuts it (`flintc.stop_strings.StopStringText`, looked
    for past `min_tokens` tokens in the text without special tokens), and its last
    (longest stop - 1) visible characters are held back until the end
    (`StopStringText.emit_upto`, as `flintc serve` streams, as vLLM); `close`
    prints what the result's text holds beyond what was printed."""

    def __init__(self, tokenizer, stop_ids=frozenset(), stops=(), include: bool = False, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.decoder = tokenizer.detokenizer() if tokenizer is not None else None
        self.stop_ids = frozenset(stop_ids)
        self.include = include
        self.min_tokens = min_tokens
        self.text = None  # with stop strings: the `StopStringText`
        if stops and tokenizer is not None:
            from flintc.stop_strings import StopStringText

            # matched on the text without special tokens, as generation matches them
            self.text = StopStringText(self.decoder, stops, include, specials=tokenizer.special_strings())
        self.n = 0  # tokens pushed
        self.printed = 0  # with stop strings: the characters of the text printed
        self.ended = False  # with stop strings: one matched
        self.wrote = False  # text is on the line (`end_line`)

    def push(self, token_id: int) -> None:
        self.n += 1
        if self.ended or (token_id in self.stop_ids and not self.include):
            return
        if self.text is None:
            text = self.decoder.push(token_id) if self.decoder else f"{token_id} "
        else:
            t = self.text
            if token_id in self.stop_ids:
                t.push_stop_token(token_id)
                upto = len(t.text)
            elif t.push(token_id, self.n, self.min_tokens):
                self.ended, upto = True, len(t.text)
            else:
                upto = t.emit_upto()
            text, self.printed = t.text[self.printed:upto], max(self.printed, upto)
        # print, not sys.stdout.write: with stdout closed (`>&-`) sys.stdout is None, which
        # print skips (as the other outputs) and .write was an AttributeError traceback
        print(text, end="", flush=True)
        self.wrote = self.wrote or bool(text)

    def end_line(self) -> None:
        """Generation failed: end the line of text streamed so far (if any), so the error
        on stderr starts a line of its own instead of following the text on a terminal."""
        if self.wrote:
            print(flush=True)

    def close(self, final: str | None = None) -> None:
        """End the line. `final`: the result's text (with stop strings, the part of it not
        printed yet is printed: what was held back)."""
        if self.text is not None and final is not None:
            done = self.text.text[:self.printed]
            print(final[len(done):] if final.startswith(done) else "", flush=True)
            return
        print(self.decoder.flush() if self.decoder else "", flush=True)


def _save_npy_atomic(path: str, array) -> None:
    import numpy as np

    from flintc.fileio import is_special_file, naming_write_errors, set_public_mode

    target = Path(path)
    if is_special_file(target):  # /dev/null, a FIFO: written into, never renamed over
        import io

        buf = io.BytesIO()  # np.save needs a seekable file for its data (a FIFO is not)
        np.save(buf, array)
        with naming_write_errors(target), open(target, "wb") as f:
            f.write(buf.getbuffer())
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    try:
        with naming_write_errors(target), os.fdopen(fd, "wb") as f:
            np.save(f, array)
        set_public_mode(tmp)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
