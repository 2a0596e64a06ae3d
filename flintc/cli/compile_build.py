"""`flintc compile`: run the decode (one schedule per batch bucket 1, 2, 4, 8) and
prefill pass pipelines with every pass checked, and write BUILD: the generated
runtime (runtime.py), the schedule and buffer plan (plan.json), the compile report
(report.md, report.json) and the pass-by-pass graph dumps. Weights are not copied:
build.json records where they come from, and `flintc run --build` checks them."""

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
    p.add_argument("--format", dest="fmt", choices=("bf16", "nvfp4"), default="bf16",
                   help="weight format for --load-format dummy")


def add_build_args(p: argparse.ArgumentParser, backend: bool = True) -> None:
    p.add_argument("--max-batch", type=int, default=8, help="largest decode batch (1..8)")
    p.add_argument("--buckets", default=None,
                   help="decode batch sizes to compile, e.g. 1,8 (default: 1,2,4,8 up to --max-batch)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="positions per sequence (default: max_position_embeddings)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="tokens per prefill call, at most the sliding window (default: 2^k <= min(W, 512))")
    if backend:
        p.add_argument("--backend", choices=("auto", "triton", "torch"), default="auto",
                       help="triton: Triton kernels where they exist (on a CPU: Triton's slow "
                            "interpreter); torch: the reference ops; auto: triton on CUDA, else torch")
    p.add_argument("--device", default=None,
                   help="cpu or cuda (default: cpu; for --build, the device it was compiled for)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the per-pass numeric checks (faster; the report says so)")
    p.add_argument("--no-dump", action="store_true", help="do not write the pass-by-pass dumps")


def add_parser(sub) -> None:
    p = sub.add_parser("compile", help="compile a checkpoint into a BUILD folder (generated runtime)",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="BF16 checkpoint folder or NVFP4 .gguf file (default: the embedded tiny model)")
    p.add_argument("--out", required=True, help="the BUILD folder to write")
    add_model_source_args(p)
    add_build_args(p)
    p.set_defaults(func=run_compile)


def prepare_device(name: str) -> None:
    """Select Triton's interpreter for a CPU run before anything imports triton, and
    fail early for a missing GPU (`flintc compile --load-format dummy --no-check` for
    cuda without a GPU cross-compiles instead: weights on the meta device)."""
    import os

    from flintc.errors import InputError

    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise InputError(f"--device {name}: no CUDA GPU is available")
    elif name == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        raise InputError(f"--device: unknown device {name!r} (expected cpu or cuda)")


def load_model_checkpoint(args, device: str):
    from flintc.checkpoint.loader import load_checkpoint

    model_path = args.model
    if model_path is None and args.load_format != "dummy":
        from flintc.checkpoint.default import default_checkpoint

        model_path = default_checkpoint()
    return load_checkpoint(model_path, hf_config_path=args.hf_config_path, device=device,
                           load_format=args.load_format, config=args.config, fmt=args.fmt,
                           progress=sys.stderr.isatty())


def build_options(args):
    from flintc.runtime.build import BuildOptions

    buckets = None
    if getattr(args, "buckets", None):
        try:
            buckets = tuple(int(b) for b in args.buckets.split(","))
        except ValueError:
            from flintc.errors import InputError

            raise InputError(f"--buckets {args.buckets!r}: expected comma-separated integers, e.g. 1,8") from None
    return BuildOptions(max_batch=args.max_batch, max_model_len=args.max_model_len, decode_buckets=buckets,
                        prefill_chunk=args.prefill_chunk, backend=args.backend, device=args.device,
                        check=not args.no_check, dump=not args.no_dump)


def run_compile(args: argparse.Namespace) -> int:
    import torch

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
    manifest = compile_model(ckpt, args.out, build_options(args), progress=sys.stderr.isatty(),
                             log=lambda msg: print(msg, file=sys.stderr))
    fns = ", ".join(f"{n} ({f['kernels']} kernels)" for n, f in manifest["functions"].items())
    print(f"wrote {args.out}: {fns}; compiled in {manifest['compile_seconds']:.1f} s"
          f"{'' if manifest['checked'] else ' (numeric checks skipped)'}")
    return 0
