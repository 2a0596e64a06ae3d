"""Per-layer aten-op table of one prefill chunk (and Triton launches): which ops of the
generated prefill function launch the glue kernels (`flintc.runtime.opcount`).

Without --build it compiles tiny dummy-weight builds (triton backend, on the CPU through
Triton's interpreter; prefill chunk 8): op counts do not depend on shapes, so a tiny
build shows the full model's per-layer counts. On the CPU the count follows the GPU's
choices (`--no-gpu-like` counts the CPU's own path). With --build it counts that build's
own prefill function (eagerly; dummy weights for a dummy-weight build, else the weights
its build.json names) and, on a GPU with --cuda-kernels, also lists the CUDA kernels of
that call by name (torch.profiler). Bad arguments are refused before anything compiles.

    python scripts/prefill_op_count.py                     # tiny nvfp4 and bf16, on the CPU
    python scripts/prefill_op_count.py --formats nvfp4 --json counts.json
    python3 scripts/prefill_op_count.py --build gpu_builds/full-nvfp4-b1 --cuda-kernels   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel


def tiny_build(root: Path, fmt: str):
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.runtime.build import BuildOptions, compile_model
    from flintc.runtime.compiled import load_build

    ckpt = load_checkpoint(None, load_format="dummy", config="tiny", fmt=fmt, progress=False)
    compile_model(ckpt, root / fmt, BuildOptions(max_batch=1, decode_buckets=(1,), max_model_len=48,
                                                 backend="triton", device="cpu", check=False, dump=False),
                  progress=False, log=lambda m: None)
    return load_build(root / fmt, ckpt=ckpt, progress=False)


def cuda_kernel_table(runner, name: str) -> str:
    """CUDA kernels of one eager call of `name`, by name (count), most frequent first."""
    from collections import Counter

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    T = runner.plan[name]["tokens"]
    ids = torch.ones(1, T, dtype=torch.long, device=runner.device)
    pos = torch.arange(T, device=runner.device)[None]
    slots = torch.zeros(1, dtype=torch.long, device=runner.device)
    runner.forward(name, ids, pos, slots)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(name, ids, pos, slots)
        torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events() if e.device_type == DeviceType.CUDA)
    lines = ["| CUDA kernel | calls |", "|---|---|"]
    lines += [f"| {n[:100]} | {c} |" for n, c in names.most_common()]
    return "\n".join(lines)


def check_args(ap: argparse.ArgumentParser, args) -> list[str]:
    """Refuse bad arguments before any compile (one line, exit 2, as argparse does); the
    tiny formats to build."""
    formats = [f.strip() for f in args.formats.split(",")]
    if args.build is None and (not formats or not all(f in ("nvfp4", "bf16") for f in formats)):
        ap.error(f"--formats {args.formats!r}: expected a comma-separated list of nvfp4 and bf16")
    if args.build is not None and not (Path(args.build) / "build.json").is_file():
        ap.error(f"--build {args.build}: not a flintc build (no build.json there; run flintc compile)")
    if args.cuda_kernels and (args.build is None or not torch.cuda.is_available()):
        ap.error("--cuda-kernels needs --build and a CUDA GPU")
    if args.json is not None and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json {args.json}: the folder {Path(args.json).parent} does not exist")
    return formats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=None, help="a build folder (default: tiny dummy builds)")
    ap.add_argument("--formats", default="nvfp4,bf16", help="tiny builds to make (without --build)")
    ap.add_argument("--no-gpu-like", action="store_true", help="on a CPU, count the CPU's own path")
    ap.add_argument("--cuda-kernels", action="store_true",
                    help="also list the CUDA kernels (with --build, on a GPU)")
    ap.add_argument("--json", default=None, help="write the counts here")
    args = ap.parse_args()
    formats = check_args(ap, args)
    from flintc.errors import FlintcError
    from flintc.runtime.opcount import count_step_ops, format_counts

    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.build:
            from flintc.runtime.compiled import load_build

            try:
                # dummy weights for a dummy-weight build, else the weights its build.json names
                source = json.loads((Path(args.build) / "build.json").read_text()).get("weight_source", "")
                fmt = "dummy" if str(source).startswith("dummy:") else None
                runners = [(Path(args.build).name, load_build(args.build, load_format=fmt, progress=False))]
            except FlintcError as e:
                ap.exit(2, f"{ap.prog}: error: --build {args.build}: {e}\n")
        else:
            runners = [(fmt, tiny_build(Path(tmp), fmt)) for fmt in formats]
        for label, runner in runners:
            name = f"prefill_t{runner.prefill_chunk}"
            counts = count_step_ops(runner, name, gpu_like=not args.no_gpu_like)
            print(format_counts(counts, f"### {label}: {name}, aten ops per layer "
                                        f"({runner.device.type}{', GPU choices' if not args.no_gpu_like else ''})"))
            print()
            report[label] = {str(layer): {f"{c} {o}": n for (c, o), n in sorted(v.items())}
                             for layer, v in counts.by_layer.items()}
            if args.cuda_kernels:
                if runner.device.type != "cuda":
                    ap.exit(2, f"{ap.prog}: error: --cuda-kernels: {args.build} is not a CUDA build\n")
                print(cuda_kernel_table(runner, name))
                print()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
