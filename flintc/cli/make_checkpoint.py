"""`flintc make-checkpoint`: write a random Flint checkpoint (BF16 folder or NVFP4 GGUF)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from flintc.cli.args import seed

    from flintc.cli import HelpFormatter

    p = sub.add_parser(
        "make-checkpoint",
        help="write a random checkpoint (config.json, tokenizer, weights)",
        description="Write a Flint checkpoint with random weights: a BF16 Hugging Face folder, or "
        "an NVFP4 GGUF file (DIR/model-nvfp4.gguf) with config.json and the tokenizer beside it. "
        "--config full writes config.json and the tokenizer only.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", default="tiny", help="preset (tiny, full) or a config.json path")
    p.add_argument("--format", dest="fmt", choices=("bf16", "nvfp4"), default="bf16",
                   help="BF16 safetensors folder or NVFP4 .gguf file")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random weights (0 to 2**63 - 1)")
    p.add_argument("--max-shard-bytes", type=int, default=None,
                   help="BF16 only: split into model-0000N-of-0000M.safetensors shards")
    p.set_defaults(func=run_make_checkpoint)


def run_make_checkpoint(args: argparse.Namespace) -> int:
    from flintc.checkpoint.writer import MAX_RANDOM_PARAMS, make_checkpoint
    from flintc.config import FlintConfig
    from flintc.cli.compile_build import check_folder_named, check_output_parents
    from flintc.errors import InputError

    check_output_parents(args.out, "--out")
    check_folder_named(args.out, "--out")
    if args.max_shard_bytes is not None:
        if args.max_shard_bytes < 1:
            raise InputError(f"--max-shard-bytes must be a positive number of bytes, got {args.max_shard_bytes}")
        if args.fmt != "bf16":
            raise InputError("--max-shard-bytes applies only to --format bf16 (an NVFP4 checkpoint is one "
                             ".gguf file)")
    config = FlintConfig.from_preset_or_path(args.config, "--config")
    if args.max_shard_bytes is not None and config.num_parameters()["total"] > MAX_RANDOM_PARAMS:
        raise InputError(f"--max-shard-bytes: --config {args.config} is too large for random weights "
                         "(config.json and the tokenizer only are written, nothing to shard); drop the flag")
    path = make_checkpoint(config, args.fmt, args.out, seed=args.seed, max_shard_bytes=args.max_shard_bytes)
    print(path)
    return 0
