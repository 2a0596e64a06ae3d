"""`flintc run`: generate from a prompt on the reference backend.

MODEL is a BF16 checkpoint folder or an NVFP4 `.gguf` file; with none, the
embedded default (the tiny NVFP4 checkpoint, see `flintc.checkpoint.default`).
Text output streams the generated text, then one summary line on stderr;
`--output json` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from flintc.errors import InputError


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text or token ids from a prompt",
                       description=__doc__.split("\n\n")[1] if __doc__ else None,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="BF16 checkpoint folder or NVFP4 .gguf file (default: the embedded tiny model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20, help="0 or -1 keeps every token")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at <|endoftext|>")
    p.add_argument("--hf-config-path", default=None,
                   help="folder with config.json (and tokenizer) for a .gguf MODEL")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    p.add_argument("--config", default=None,
                   help="with --load-format dummy and no MODEL: preset tiny or full")
    p.add_argument("--format", dest="fmt", choices=("bf16", "nvfp4"), default="bf16",
                   help="weight format for --load-format dummy")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--mode", choices=("bf16", "float64"), default="bf16",
                   help="reference numerics: bf16 (FLINT_SPEC rounding points) or float64 oracle")
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.add_argument("--logits-out", default=None,
                   help="save the fp32 logits of the prompt positions, [T, vocab_size], as .npy")
    p.set_defaults(func=run_generate)


def parse_prompt_ids(text: str) -> list[int]:
    ids = []
    for piece in text.split(","):
        piece = piece.strip()
        try:
            ids.append(int(piece))
        except ValueError:
            raise InputError(f"--prompt-ids: {piece!r} is not an integer token id") from None
    return ids


def run_generate(args: argparse.Namespace) -> int:
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.checkpoint.tokenizer import load_tokenizer
    from flintc.model.generate import generate
    from flintc.model.reference import FlintModel
    from flintc.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    prompt_ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if args.logits_out is not None:
        _check_output_path(args.logits_out, "--logits-out")
    device = _device(args.device)
    model_path = args.model
    if model_path is None and args.load_format != "dummy":
        from flintc.checkpoint.default import default_checkpoint

        model_path = default_checkpoint()
    ckpt = load_checkpoint(model_path, hf_config_path=args.hf_config_path, device=device,
                           load_format=args.load_format, config=args.config, fmt=args.fmt,
                           progress=sys.stderr.isatty())
    tok_dir = args.tokenizer or ckpt.tokenizer_dir
    tokenizer = load_tokenizer(tok_dir) if (tok_dir or args.prompt is not None) else None
    if prompt_ids is None:
        prompt_ids = tokenizer.encode(args.prompt)
    if tokenizer is not None and tokenizer.vocab_size != ckpt.config.vocab_size:
        raise InputError(f"tokenizer in {tok_dir} has {tokenizer.vocab_size} tokens, the model "
                         f"{ckpt.config.vocab_size}")
    model = FlintModel(ckpt.config, ckpt.weights, mode=args.mode)

    stream = _TextStream(tokenizer) if args.output == "text" else None
    result = generate(model, [prompt_ids], params,
                      eos_token_id=tokenizer.eos_token_id if tokenizer else None,
                      return_prompt_logits=args.logits_out is not None,
                      on_token=(lambda b, t: stream.push(t)) if stream else None)
    if args.logits_out is not None:
        _save_npy_atomic(args.logits_out, result.prompt_logits[0].numpy())
    out_ids = result.output_ids[0]
    if args.output == "json":
        obj = {"prompt_ids": prompt_ids, "output_ids": out_ids, "finish_reason": result.finish_reasons[0]}
        if tokenizer is not None:
            obj["text"] = tokenizer.decode(out_ids)
        print(json.dumps(obj))
    else:
        stream.close()
        ms = 1000 * result.decode_seconds / max(result.decode_steps, 1)
        print(f"prompt tokens: {len(prompt_ids)}, generated tokens: {len(out_ids)}, "
              f"prefill: {result.prefill_seconds:.3f} s, decode: {ms:.2f} ms/token", file=sys.stderr)
    return 0


class _TextStream:
    """Prints generated text as it appears (token ids when there is no tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = tokenizer.detokenizer() if tokenizer is not None else None

    def push(self, token_id: int) -> None:
        text = self.decoder.push(token_id) if self.decoder else f"{token_id} "
        sys.stdout.write(text)
        sys.stdout.flush()

    def close(self) -> None:
        if self.decoder:
            sys.stdout.write(self.decoder.flush())
        sys.stdout.write("\n")
        sys.stdout.flush()


def _check_output_path(path: str, flag: str) -> None:
    """Fail before any work if `path` cannot be written: its folder must exist and it
    must not be a folder itself."""
    target = Path(path)
    if target.is_dir():
        raise InputError(f"{flag} {path}: is a directory, expected a file name")
    if not target.parent.is_dir():
        raise InputError(f"{flag} {path}: folder {target.parent} does not exist")


def _device(name: str):
    import torch

    from flintc.errors import FlintcError

    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FlintcError(f"--device {name}: no CUDA GPU is available")
    try:
        return torch.device(name)
    except RuntimeError:
        raise InputError(f"--device: unknown device {name!r} (expected cpu or cuda)") from None


def _save_npy_atomic(path: str, array) -> None:
    import numpy as np

    from flintc.fileio import set_public_mode

    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        set_public_mode(tmp)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
