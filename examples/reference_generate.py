"""Write a tiny NVFP4 checkpoint, load it, and generate greedily on the reference model."""

import tempfile
from pathlib import Path

from flintc.checkpoint.loader import load_checkpoint
from flintc.checkpoint.tokenizer import load_tokenizer
from flintc.checkpoint.writer import make_checkpoint
from flintc.model.generate import generate
from flintc.model.reference import FlintModel
from flintc.sampling import SamplingParams


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint("tiny", "nvfp4", Path(tmp) / "ckpt", seed=0)
        ckpt = load_checkpoint(path, progress=False)
        tokenizer = load_tokenizer(ckpt.tokenizer_dir)
        model = FlintModel(ckpt.config, ckpt.weights, mode="bf16")
        prompt = tokenizer.encode("Flint is a mixture-of-experts model")
        # tokenizer=: the model's stop tokens (end-of-text, <|user|>, <|observation|>) end
        # the output, as in flintc serve and vLLM, and result.texts hold the output texts
        result = generate(model, [prompt], SamplingParams(temperature=0, max_tokens=12), tokenizer=tokenizer)
        print("prompt ids:", prompt)
        print("output ids:", result.output_ids[0])
        print("text:", repr(result.texts[0]), result.finish_reasons[0], result.stop_reasons[0])


if __name__ == "__main__":
    main()
