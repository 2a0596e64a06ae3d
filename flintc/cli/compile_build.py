"""`flintc compile`: run the decode (one schedule per batch bucket 1, 2, 4, 8) and
prefill pass pipelines with every pass checked, and write BUILD: the generated
runtime (runtime.py), the schedule and buffer plan (plan.json), the compile report
(report.md, report.json) and the pass-by-pass graph dumps. Weights are not copied:
build.json records where they come from, and `flintc run --build` checks them.

An existing --out is replaced whole, so it is taken only when it is empty or an earlier
build holding nothing a compile does not write (no notes, no checkpoint copied into it),
and never when it holds MODEL, --tokenizer or --hf-config-path."""

from __future__ import annotations

import argparse
import sys


def add_model_source_args(p: argparse.ArgumentParser) -> None:
    """MODEL and how to read it: shared by compile, run and serve."""
    p.add_argument("--hf-config-path", default=None,
                   help="folder with config.json (and tokenizer) for a .gguf MODEL")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights made on the device (no files)")
    p.add_argument("--config", default=None,
                   help="with --load-format dummy and no MODEL: preset tiny or full")
    p.add_argument("--format", dest="fmt", choices=("bf16", "nvfp4"), default=None,
                   help="weight format for --load-format dummy (default: bf16)")


def check_model_source_args(args, build_manifest: dict | None = None) -> None:
    """Refuse model-source flags that would have no effect, and check the paths given.

    --config and --format only shape dummy weights: with a real MODEL its config.json
    and its files decide both. With a BUILD (`build_manifest`), the build fixes the
    config and the format. Sets args.fmt to its default (bf16) when it is unset.
    Raises InputError naming the flag."""
    from pathlib import Path

    from flintc.errors import InputError

    for flag, value in (("--hf-config-path", args.hf_config_path), ("--tokenizer", args.tokenizer)):
        if value is not None and not Path(value).exists():
            raise InputError(f"{flag} {value}: no such file or folder")
    if getattr(args, "model", None) is not None and not Path(args.model).exists():
        raise InputError(f"MODEL {args.model}: no such checkpoint file or folder")
    if build_manifest is not None:
        if args.config is not None:
            raise InputError(f"--config {args.config}: a build fixes its config at compile time; drop "
                             "--config (or recompile with it)")
        if args.fmt is not None and args.fmt != build_manifest.get("weight_format"):
            raise InputError(f"--format {args.fmt}: the build was compiled for "
                             f"{build_manifest.get('weight_format')} weights; drop --format")
        return
    if args.load_format != "dummy":
        for flag, value in (("--config", args.config), ("--format", args.fmt)):
            if value is not None:
                raise InputError(f"{flag} {value} applies only with --load-format dummy (random weights); "
                                 "a checkpoint's own config.json and files give its config and format")
    if args.config is not None:
        check_config_preset(args.config)
    if args.fmt is None:
        args.fmt = "bf16"


def check_config_preset(value: str, flag: str = "--config") -> None:
    """`value` must name a preset (tiny, full): the --config of compile and run, which
    take no config.json path (their MODEL does, with --load-format dummy). Raises
    InputError naming the flag, listing the presets and saying how to use another config."""
    from flintc.config import PRESETS, preset_names
    from flintc.errors import InputError

    if value not in PRESETS:
        raise InputError(f"{flag} {value!r}: unknown config preset; the presets are {preset_names()} (for "
                         "another config, give its config.json, or the folder holding it, as MODEL with "
                         "--load-format dummy)")


def check_not_empty(path, flag: str, expected: str = "a path") -> None:
    """A path the user gave must not be empty: `Path("")` is the current folder, which no
    one means by `--out ""` or `--build ""` (an unset shell variable, most often). Called
    first by every output check (`check_output_folder`, `check_output_parents`,
    `check_output_file`) and for every input path (`check_input_paths`), before any work.
    Raises InputError naming the flag."""
    from flintc.errors import InputError

    if str(path) == "":
        raise InputError(f"{flag} must not be empty: expected {expected}")


# The input paths of the sub-commands, by argparse dest (the same meaning in every
# sub-command that has one): the option as the user types it, and what it expects.
INPUT_PATHS = (
    ("model", "MODEL", "the path of a BF16 checkpoint folder or an NVFP4 .gguf file (or leave MODEL out for "
                       "the default)"),
    ("build", "--build", "the path of a BUILD folder written by flintc compile"),
    ("tokenizer", "--tokenizer", "the path of a folder holding tokenizer.json"),
    ("hf_config_path", "--hf-config-path", "the path of a folder holding config.json, or of a config.json file"),
    ("from_json", "--from-json", "the path of a bench.json file written by flintc bench"),
    ("chat_template", "--chat-template", "the path of a Jinja chat template file, or the template itself"),
)


def check_input_paths(args) -> None:
    """Refuse an empty input path (MODEL, --build, --tokenizer, --hf-config-path,
    --from-json, --chat-template: `INPUT_PATHS`) of any sub-command, before any work: `Path("")` would be
    taken as the current folder, or an empty --build or --tokenizer as none given.
    `flintc.cli.main` calls it before every sub-command. Raises InputError naming the
    option (`check_not_empty`)."""
    for dest, flag, expected in INPUT_PATHS:
        value = getattr(args, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None:
                check_not_empty(v, flag, expected)


def check_folder_named(path, flag: str) -> None:
    """An output folder that is written under a temporary name beside it and renamed into
    place (`flintc.fileio.move_into_place`) needs a name of its own: not `.`, `..` or `/`,
    which cannot be renamed. Raises InputError naming the flag and path."""
    from pathlib import Path

    from flintc.errors import InputError

    if Path(path).name in ("", ".."):
        raise InputError(f"{flag} {path}: expected a path ending in the name of the folder to write (e.g. "
                         f"{flag} out), not . or .. or /: the output is written beside it and renamed into place")


def check_output_folder(path, flag: str = "--out") -> None:
    """Fail before any work when the folder `path` cannot be created: it must not be
    empty (`check_not_empty`), nor `.` or `..` (`check_folder_named`); its parent must
    exist, be a folder and be writable. Raises InputError naming the flag and path."""
    from pathlib import Path

    from flintc.errors import InputError
    from flintc.fileio import output_parent_problem

    check_not_empty(path, flag, "the path of a folder to write")
    check_folder_named(path, flag)
    from flintc.fileio import follow_out_link

    target = follow_out_link(path)  # a link: its target is written (`flintc.fileio.move_into_place`)
    problem = output_parent_problem(target.parent if str(target.parent) else Path("."))
    if problem:
        raise InputError(f"{flag} {path}: {problem}")


def check_output_parents(path, flag: str = "--out") -> None:
    """Fail before any work when the folder `path`, which the command creates with its
    missing parent folders (bench's and make-checkpoint's --out), cannot be made: it
    must not be empty, and its nearest existing ancestor must be a folder one can write
    in. An output FILE's folder is never created: see `check_output_file`. Raises
    InputError naming the flag and path."""
    from pathlib import Path

    from flintc.errors import InputError
    from flintc.fileio import cannot_write_in

    check_not_empty(path, flag, "a folder path")
    target = Path(path)
    anc = target.parent if str(target.parent) else Path(".")
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise InputError(f"{flag} {path}: {anc} is not a folder")
    why = cannot_write_in(anc)
    if why:
        raise InputError(f"{flag} {path}: cannot write in the folder {anc} ({why})")


def check_output_file(path, flag: str, inputs=()) -> None:
    """Fail before any work if the output file `path` (run's --logits-out, verify's
    --json) cannot be written: it must not be empty, its folder must exist (it is not
    created: a typo in it would make folders) and be one a file can be created in, and
    `path` must not be a folder itself, nor end in a slash (`Path` drops it: --json new/
    wrote a file `new`), nor an existing file that is or lies inside one of `inputs`,
    (label, path or None) pairs of what the command reads, such as ("MODEL", checkpoint)
    (`--logits-out ckpt/model.safetensors` replaced the checkpoint's weights with the
    logits). A device, FIFO or socket (/dev/null, /dev/stdout:
    `flintc.fileio.is_special_file`) is written into, not replaced: it must be writable,
    its folder need not be. Raises InputError naming the flag and path."""
    import os
    from pathlib import Path

    from flintc.errors import InputError
    from flintc.fileio import cannot_write_in, is_special_file

    check_not_empty(path, flag, "a file name")
    target = Path(path)
    if is_special_file(target):
        if not os.access(target, os.W_OK):
            raise InputError(f"{flag} {path}: not writable")
        return
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise InputError(f"{flag} {path}: is a directory, expected a file name")
    if str(path).endswith(("/", os.sep)):
        raise InputError(f"{flag} {path}: ends in a slash (a folder), expected a file name")
    if parent.exists() and not parent.is_dir():
        raise InputError(f"{flag} {path}: {parent} is not a folder")
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: folder {parent} does not exist")
    why = cannot_write_in(parent)
    if why:
        raise InputError(f"{flag} {path}: cannot write in the folder {parent} ({why})")
    if target.exists():
        from flintc.fileio import lies_inside

        for label, source in inputs:
            if source is not None and os.path.lexists(source) and lies_inside(target, source):
                where = "is" if lies_inside(source, target) else "is a file inside"
                raise InputError(f"{flag} {path}: {where} {label} {source}, which this command reads; writing "
                                 f"{flag} would replace it: choose a file outside the command's inputs")


def add_build_args(p: argparse.ArgumentParser, backend: bool = True) -> None:
    # `flintc run` leaves --max-batch unset (None) so that it can tell a flag the user
    # gave from the default: a build fixes its max batch, the reference backend decodes
    # all the prompts at once unless given one.
    p.add_argument("--max-batch", type=int, default=8 if backend else None,
                   help="largest decode batch (1..8)" if backend else
                   "largest decode batch (1..8); with --build at most the build's; more prompts run "
                   "in consecutive batches of it (default: 8 when compiling, the build's with --build, "
                   "all the prompts at once on the reference backend)")
    from flintc.cli.args import buckets, device_name

    p.add_argument("--buckets", type=buckets, default=None,
                   help="decode batch sizes to compile, e.g. 1,8 (default: 1,2,4,8 up to --max-batch)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="positions per sequence (default: max_position_embeddings)" if backend else
                   "tokens per sequence, prompt + output (default: max_position_embeddings, or "
                   "the build's with --build; at most the build's)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="tokens per prefill call, at most (default: 4096 on CUDA, or less for a shorter "
                        "--max-model-len; else 2^k <= min(W, 512)); a chunk longer than the sliding window W "
                        "adds functions of every power of two below it down to a tail of 2^k <= min(W, 512) "
                        "tokens: each call takes the longest chunk the prompt fills (for a power of two, the fewest "
                        "calls), then one padded tail chunk")
    if backend:
        p.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                       help="triton: Triton kernels where they exist (on a CPU: Triton's slow "
                            "interpreter); torch: the reference ops; auto: triton on CUDA, else torch")
    p.add_argument("--device", type=device_name, default=None,
                   help="cpu or cuda (default: cpu; for --build, the device it was compiled for)")
    p.add_argument("--fold-attention-combine", action="store_true",
                   help="decode: merge the attention splits with the sinks inside the attention "
                        "kernel (one kernel less per layer; measured slower on the H200, so off by default)")
    p.add_argument("--split-lm-head-norm", action=argparse.BooleanOptionalAction, default=None,
                   help="decode: run the final RMSNorm as its own kernel, then the plain LM head (the "
                        "default: 6-29 us per step faster than the fused norm_lm_head, level or ahead in the "
                        "whole model; docs/gpu-runs.md, sessions 46-47); --no-split-lm-head-norm: the fused "
                        "norm_lm_head, one kernel less per forward")
    p.add_argument("--no-check", action="store_true",
                   help="skip the per-pass numeric checks (faster; the report says so)")
    p.add_argument("--no-dump", action="store_true",
                   help="do not write the pass-by-pass dumps (BUILD/dumps/), not even into $FLINTC_DUMP_DIR"
                   if backend else
                   "do not write the pass-by-pass dumps, not even into $FLINTC_DUMP_DIR (a temporary BUILD "
                   "writes them only there, one folder per function, when it is set)")


def add_parser(sub) -> None:
    from flintc.cli import HelpFormatter

    p = sub.add_parser("compile", help="compile a checkpoint into a BUILD folder (generated runtime)",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="BF16 checkpoint folder or NVFP4 .gguf file (default: the embedded tiny model)")
    p.add_argument("--out", required=True,
                   help="the BUILD folder to write: new, empty, or an earlier build, which is replaced whole (refused "
                   "when it also holds files a compile does not write, or holds MODEL, --tokenizer or "
                   "--hf-config-path)")
    add_model_source_args(p)
    add_build_args(p)
    p.set_defaults(func=run_compile)


def prepare_device(name: str) -> None:
    """See `flintc.runtime.device.prepare_device` (kept here for the sub-commands)."""
    from flintc.runtime.device import prepare_device as _prepare

    _prepare(name)


def load_model_checkpoint(args, device: str, check_config=None):
    """The checkpoint MODEL (or the default one, or dummy weights) names; `check_config`
    as :func:`flintc.checkpoint.loader.load_checkpoint`'s, before any weight is read."""
    from flintc.checkpoint.default import load_checkpoint_or_default

    return load_checkpoint_or_default(args.model, hf_config_path=args.hf_config_path, device=device,
                                      load_format=args.load_format, config=args.config, fmt=args.fmt,
                                      progress=sys.stderr.isatty(), check_config=check_config)


def build_options(args):
    from flintc.runtime.build import BuildOptions

    buckets = getattr(args, "buckets", None)  # parsed by flintc.cli.args.buckets
    return BuildOptions(max_batch=args.max_batch, max_model_len=args.max_model_len,
                        decode_buckets=buckets if buckets else None,  # its .text: what resolve's errors echo
                        prefill_chunk=args.prefill_chunk, backend=args.backend, device=args.device,
                        check=not args.no_check, dump=not args.no_dump,
                        fold_attention_combine=bool(getattr(args, "fold_attention_combine", False)),
                        split_lm_head_norm=getattr(args, "split_lm_head_norm", None) is not False)


def run_compile(args: argparse.Namespace) -> int:
    import torch

    from flintc.errors import InputError

    check_model_source_args(args)
    check_output_folder(args.out, "--out")
    tokenizer = None
    if args.tokenizer is not None:  # recorded in build.json, for flintc run/serve --build
        from flintc.serve.server import given_tokenizer_dir

        tokenizer = given_tokenizer_dir(args.tokenizer)
    if getattr(args, "backend", None) in ("triton", "auto", None):
        # the variables the build's runtime will read (FLINTC_PDL_TRIGGER, FLINTC_MMA_*, ...):
        # a bad value is refused now, not by `flintc run` after the compile
        from flintc.runtime.compiled import check_environment

        check_environment(getattr(args, "backend", None))
    if args.max_model_len is not None and args.max_model_len < 2:  # as flintc serve: a prompt needs < it
        raise InputError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise InputError(f"--prefill-chunk must be at least 1, got {args.prefill_chunk}")
    if not 1 <= args.max_batch <= 8:
        raise InputError(f"--max-batch must be in 1..8 (the decode schedule's GEMVs), got {args.max_batch}")
    from flintc.runtime.build import check_build_out

    # the weights the new build.json would point to, deleted with the old build it replaces
    check_build_out(args.out, (("MODEL", args.model), ("--tokenizer", args.tokenizer),
                               ("--hf-config-path", args.hf_config_path)))
    args.device = args.device or "cpu"
    weights_on = args.device
    if args.device.startswith("cuda") and not torch.cuda.is_available() and args.load_format == "dummy" \
            and args.no_check:
        # Cross-compile: dummy weights on the meta device; the runtime makes them on the GPU.
        weights_on = "meta"
    else:
        prepare_device(args.device)
    from flintc.runtime.build import compile_model

    ckpt = load_model_checkpoint(args, weights_on)
    if tokenizer is not None:
        ckpt.tokenizer_dir = tokenizer
    from flintc.checkpoint.tokenizer import folder_tokenizer

    paired = folder_tokenizer(ckpt.tokenizer_dir)  # the one the build will record, if any
    if paired is not None:  # ids the model has no row for: refused before the compile, as flintc.compile
        paired.check_fits_model(ckpt.config.vocab_size, ckpt.config.source)
    manifest = compile_model(ckpt, args.out, build_options(args), progress=sys.stderr.isatty(),
                             log=lambda msg: print(msg, file=sys.stderr))
    fns = ", ".join(f"{n} ({f['kernels']} kernels)" for n, f in manifest["functions"].items())
    print(f"wrote {args.out}: {fns}; compiled in {manifest['compile_seconds']:.1f} s"
          f"{'' if manifest['checked'] else ' (numeric checks skipped)'}")
    return 0
