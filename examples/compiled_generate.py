"""Write a tiny NVFP4 checkpoint, compile it with flintc, and generate a batch of two
prompts greedily with the generated runtime; then check the tokens against the eager
reference model.

    python examples/compiled_generate.py            # CPU: the reference ops (backend auto
                                                    # picks torch on a CPU)
    python examples/compiled_generate.py --backend triton   # CPU: the Triton kernels in
                                                    # Triton's interpreter (slow)
    python examples/compiled_generate.py --device cuda      # GPU: the Triton kernels
"""

import argparse
import tempfile
from pathlib import Path

import flintc
from flintc.checkpoint.loader import load_checkpoint
from flintc.checkpoint.writer import make_checkpoint
from flintc.model.generate import generate
from flintc.model.reference import FlintModel
from flintc.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto",
                    help="auto (triton on CUDA, torch on a CPU), triton or torch")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint("tiny", "nvfp4", Path(tmp) / "ckpt", seed=0)
        m = flintc.compile(path, out=Path(tmp) / "build", device=args.device, backend=args.backend,
                           max_batch=2, max_model_len=256, progress=True)
        print("generated runtime:", m.build / "runtime.py")
        print("kernels per decode forward:", m.runner.kernels_per_forward["decode_b2"])
        prompts = ["Flint is a mixture-of-experts model", "The quick brown fox"]
        r = m.generate(prompts, temperature=0, max_tokens=12)
        for p, text, ids in zip(prompts, r.texts, r.output_ids):
            print(f"{p!r} -> {text!r} {ids}")

        ckpt = load_checkpoint(path, progress=False, device=args.device)
        ref = generate(FlintModel(ckpt.config, ckpt.weights), [m.tokenizer.encode(p) for p in prompts],
                       SamplingParams(temperature=0, max_tokens=12), tokenizer=m.tokenizer)
        print("same tokens as the reference model:", ref.output_ids == r.output_ids)


if __name__ == "__main__":
    main()
