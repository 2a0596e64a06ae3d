"""Shared by `flintc verify` and `flintc dump`: build the model to compile, and
print the per-pass table."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from flintc.config import FlintConfig
from flintc.errors import InputError

# Full-width config with few layers, for numeric checks of `--config full` on a CPU:
# layers 0-1 dense, 2 sliding MoE, 3 full-attention MoE (the full model's first four).
FULL_NUMERIC_LAYERS = 4


def add_model_args(p: argparse.ArgumentParser) -> None:
    from flintc.cli.args import device_name, seed

    p.add_argument("model", nargs="?", default=None,
                   help="BF16 checkpoint folder or NVFP4 .gguf (default: random weights of --config)")
    p.add_argument("--config", default=None,
                   help="when no MODEL is given: preset tiny or full, or a config.json path "
                   "(default: tiny)")
    p.add_argument("--format", dest="fmt", choices=("bf16", "nvfp4"), default=None,
                   help="weight format of the random weights when no MODEL is given (default: bf16)")
    p.add_argument("--hf-config-path", default=None, help="folder with config.json for a .gguf MODEL")
    p.add_argument("--device", type=device_name, default="cpu",
                   help="cpu or cuda: where the weights and the checks run")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random weights and the check inputs")
    # None when not given: a flag of the pipeline --step leaves out is refused (check_pass_flags)
    p.add_argument("--batch", type=int, default=None, help="decode batch B (1..8; default: 2; decode only)")
    p.add_argument("--tokens", type=int, default=None,
                   help="prefill tokens per sequence (default: 16; prefill only: the prefill runs at B=1)")
    p.add_argument("--cache-len", type=int, default=64, help="full-attention cache length S_max")
    p.add_argument("--disable", action="append", default=[], metavar="PASS",
                   help="skip a pass by name (repeatable)")
    p.add_argument("--attention-splits", type=int, default=None,
                   help="split-KV chunks for decode attention (default: from the cache length)")
    p.add_argument("--fold-attention-combine", action="store_true",
                   help="decode: fold the split-KV combine into the attention kernel "
                        "(decode_attention_combine; as flintc compile)")
    p.add_argument("--split-lm-head-norm", action=argparse.BooleanOptionalAction, default=None,
                   help="decode: the final RMSNorm a kernel of its own before the plain LM head (the "
                        "default, as flintc compile); --no-split-lm-head-norm: the fused norm_lm_head")


def check_pass_flags(args: argparse.Namespace, steps: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Check the flags that name passes or pass options against the pipelines of `steps`
    ("decode", "prefill"), before any output or work (a bad --disable name was refused
    only when its pipeline was built: after the header, or after the whole decode table
    of `--step both`). -> the --disable names of each step's pipeline: a pass of one
    pipeline only (mark_pdl is decode's) is skipped there, and the other runs in full.

    Raises:
        InputError: a --disable name that is a pass of none of the pipelines (the message
            names them and their passes, and the --step whose pipeline has it, if any);
            --attention-splits, --fold-attention-combine, --split-lm-head-norm or --batch
            with the prefill pipeline only (they are options of decode passes; the prefill
            runs at B=1),
            --tokens with the decode pipeline only: each only when given (a default
            is no choice). Their defaults (--batch 2, --tokens 16) are set here.
    """
    from flintc.passes.pipeline import pipeline_for

    names = {step: [p.name for p in pipeline_for(step)] for step in ("decode", "prefill")}
    for name in args.disable:
        if any(name in names[step] for step in steps):
            continue
        known = list(dict.fromkeys(n for step in steps for n in names[step]))
        other = [step for step in names if step not in steps and name in names[step]]
        hint = f" ({name} is a pass of the {other[0]} pipeline: --step {other[0]})" if other else ""
        raise InputError(f"--disable {name}: not a pass of the {' or '.join(steps)} pipeline; "
                         f"{'its' if len(steps) == 1 else 'their'} passes are {', '.join(known)}{hint}")
    if "decode" not in steps:
        for flag, given in (("--attention-splits", args.attention_splits is not None),
                            ("--fold-attention-combine", getattr(args, "fold_attention_combine", False))):
            if given:
                raise InputError(f"{flag} applies only to the decode pipeline (its attention); drop it, or pass "
                                 "--step decode")
        if getattr(args, "split_lm_head_norm", None) is not None:
            raise InputError("--split-lm-head-norm / --no-split-lm-head-norm applies only to the decode pipeline (its LM head); drop it, "
                             "or pass --step decode")
        if args.batch is not None:  # it was ignored: the prefill ran at B=1
            raise InputError(f"--batch {args.batch} applies only to the decode pipeline (the prefill runs at B=1); "
                             "drop it, or pass --step decode")
    if "prefill" not in steps and args.tokens is not None:  # it was ignored
        raise InputError(f"--tokens {args.tokens} applies only to the prefill pipeline (tokens per sequence); "
                         "drop it, or pass --step prefill")
    if args.batch is None:
        args.batch = 2
    if args.tokens is None:
        args.tokens = 16
    return {step: tuple(n for n in args.disable if n in names[step]) for step in steps}


def pass_options(args: argparse.Namespace, step: str) -> dict:
    """compile_step's per-pass options of `step` from --attention-splits /
    --fold-attention-combine / --split-lm-head-norm: those given, and only those that apply
    to `step` (`flintc.passes.pipeline.step_options`: all three are decode's, so `flintc
    verify --step both` gives the prefill none)."""
    from flintc.passes.pipeline import step_options

    options = {}
    if args.attention_splits:
        options["attention_splits"] = args.attention_splits
    if getattr(args, "fold_attention_combine", False):
        options["fold_attention_combine"] = True
    if getattr(args, "split_lm_head_norm", None) is not None:  # given: True or False
        options["split_lm_head_norm"] = args.split_lm_head_norm
    return step_options(step, options)


def check_target_options(args: argparse.Namespace, targets: list, steps: tuple[str, ...]) -> None:
    """compile_step's check of the pass options (`flintc.passes.pipeline.check_options`: more
    --attention-splits than --cache-len rows of a full-attention cache) for every target and
    step, before the first header: raised by compile_step, the error came after it."""
    from flintc.passes.pipeline import check_options

    for target in targets:
        for step in steps:
            check_options(pass_options(args, step), step, args.cache_len, target.model.config)


def options_note(options: dict) -> str:
    """The pass options given (not at their defaults) for a step's header line, as
    report.json names them: "attention_splits=3, split_lm_head_norm=True"; "" for none."""
    return ", ".join(f"{k}={v}" for k, v in options.items())


def check_failures() -> tuple[type[BaseException], ...]:
    """The errors of a pass's checks (`PassManager.run`): a missed numeric expectation
    (PassCheckError, the captured graph's own check included), an illegal graph
    (GraphLegalityError), a failed `verify` (PassVerifyError), each with the report of the
    passes that ran as its `report` (None for a captured graph that failed its legality
    check). On these `flintc dump` keeps the dumps written so far (on any other error, or a
    signal, nothing) and prints the table; `flintc verify` prints the table, records the
    report and goes on with the next step, as for a missed numeric expectation."""
    from flintc.graph.spec import GraphLegalityError
    from flintc.passes.base import PassVerifyError
    from flintc.passes.manager import PassCheckError

    return PassCheckError, GraphLegalityError, PassVerifyError


@dataclass
class Target:
    """What to compile: `model` (may hold meta weights), `check_model` (real weights or
    None), and a note printed with the table."""

    model: object
    check_model: object
    note: str = ""


def target_subfolder(index: int, count: int) -> str:
    """The subfolder of the dump folder that target `index` of `count` (`build_targets`)
    writes its dumps to: "" (the folder itself) for a single target; "counts" and
    "numerics" for the two of `--config full`, so that neither replaces the other's."""
    if count == 1:
        return ""
    return "counts" if index == 0 else "numerics"


def _split_targets(config) -> bool:
    """True for a config too large for real random weights: `build_targets` then makes
    two targets (kernel counts on meta weights, numerics on a few layers)."""
    return config.num_parameters()["total"] >= 2e9


def target_count(args: argparse.Namespace) -> int:
    """How many targets `build_targets(args)` makes, without building them (reads only
    the --config preset or file): where the dump folders are checked before any work."""
    if args.model is not None:
        return 1
    config = FlintConfig.from_preset_or_path("tiny" if args.config is None else args.config, "--config")
    return 2 if _split_targets(config) else 1


def build_targets(args: argparse.Namespace) -> list[Target]:
    """One target normally; for `--config full` without MODEL two: all 49 layers on meta
    weights (kernel counts only) and a 4-layer full-width model with real weights.

    Raises InputError for flags out of range, for --config / --format next to a MODEL
    (they shape the random weights only; MODEL's own files give both), and for
    --hf-config-path without one (the random weights take their config from --config)."""
    from flintc.checkpoint.dummy import dummy_weights
    from flintc.checkpoint.init import random_weights
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.model.reference import FlintModel
    from flintc.quant.nvfp4 import quantize

    if not 1 <= args.batch <= 8:
        raise InputError(f"--batch must be in 1..8 (decode buckets), got {args.batch}")
    if args.tokens < 1:
        raise InputError(f"--tokens must be at least 1 (prefill tokens per sequence), got {args.tokens}")
    if args.cache_len < 1:
        raise InputError(f"--cache-len must be at least 1 (full-attention cache rows), got {args.cache_len}")
    if getattr(args, "step", "both") != "decode" and args.tokens > args.cache_len:
        raise InputError(f"--tokens {args.tokens} is more than --cache-len {args.cache_len}: a prefill writes "
                         "every token into the full-attention cache; raise --cache-len or lower --tokens")
    if args.attention_splits is not None and args.attention_splits < 1:
        raise InputError(f"--attention-splits must be at least 1, got {args.attention_splits}")
    from flintc.cli.args import torch_device

    device = torch_device(args.device)
    max_pos = max(args.cache_len, args.tokens) + 1

    def check_positions(cfg) -> None:
        if max_pos - 1 > cfg.max_position_embeddings:
            raise InputError(f"--cache-len {args.cache_len} / --tokens {args.tokens}: more positions than "
                             f"the model's max_position_embeddings {cfg.max_position_embeddings}")

    if args.model is None and args.hf_config_path is not None:
        raise InputError(f"--hf-config-path {args.hf_config_path} applies only with a MODEL (the config of a .gguf "
                         "file); without one, the random weights take their config from --config (a preset or a "
                         "config.json path)")
    if args.model is not None:
        for flag, value in (("--config", args.config), ("--format", args.fmt)):
            if value is not None:
                raise InputError(f"{flag} {value} applies only without MODEL (random weights); "
                                 f"MODEL {args.model}'s own config.json and files give its config and "
                                 "format")
        ckpt = load_checkpoint(args.model, hf_config_path=args.hf_config_path, device=device, progress=False)
        check_positions(ckpt.config)
        model = FlintModel(ckpt.config, ckpt.weights, max_positions=max_pos)
        return [Target(model, model, f"weights: {ckpt.source} ({ckpt.fmt})")]
    args.config = "tiny" if args.config is None else args.config
    args.fmt = "bf16" if args.fmt is None else args.fmt
    config = FlintConfig.from_preset_or_path(args.config, "--config")
    check_positions(config)

    def real(cfg):
        w = random_weights(cfg, seed=args.seed, device=device)
        if args.fmt == "nvfp4":
            w = {k: quantize(v).to(device) if "proj" in k and v.dim() >= 2 else v for k, v in w.items()}
        return FlintModel(cfg, w, max_positions=max_pos)

    if not _split_targets(config):
        model = real(config)
        return [Target(model, model, f"random weights ({args.fmt}, seed {args.seed})")]
    meta = FlintModel(config, dummy_weights(config, args.fmt, "meta"), max_positions=max_pos)
    small = config.replace(num_hidden_layers=FULL_NUMERIC_LAYERS)
    model = real(small)
    return [Target(meta, None, f"all {config.num_hidden_layers} layers on meta weights: kernel counts only"),
            Target(model, model, f"full widths, first {FULL_NUMERIC_LAYERS} layers, random {args.fmt} "
                   "weights: numeric checks")]


def format_table(report) -> str:
    """The per-pass table of a `PipelineReport`: a header, a rule, then one row per stage.
    A failed stage (the last: the pipeline stops there) says so in its `ok` column, with
    what failed: "FAILED (numeric check)" (a missed expectation, `max_abs` and the
    columns after it filled in), "FAILED (legality check)" or "FAILED (verify)" (its
    `StageReport.error`, the numeric columns "-"). Returns the lines joined, no newline
    at the end."""
    head = ("#", "pass", "stage", "nodes", "kernels/fwd", "dense", "moe", "expected", "ok",
            "max_abs", "max_rel", "differing", "experts")
    rows = [head]
    for s in report.stages:
        c = s.check
        rows.append((
            str(s.index), s.name, s.stage, str(s.nodes), str(s.kernels.per_forward),
            str(s.kernels.per_kind.get("dense", "-")), str(s.kernels.per_kind.get("moe", "-")),
            c.expected if c else "-", _ok_cell(s),
            f"{c.max_abs:.3g}" if c else "-", f"{c.max_rel:.3g}" if c else "-",
            f"{c.share_differing:.2%}" if c else "-",
            f"{c.experts_agree:.1%}" if c and c.experts_agree is not None else "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ok_cell(stage) -> str:
    """The `ok` column of `format_table`: yes, "-" (not checked), or FAILED and what failed."""
    if stage.error:
        what = stage.error.split(":", 1)[0].removesuffix(" failed")  # "legality check failed: ..."
        return f"FAILED ({what})"
    if stage.check is None:
        return "-"
    return "yes" if stage.check.passed else "FAILED (numeric check)"
