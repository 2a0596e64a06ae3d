"""How sensitive is the full model with dummy weights to rounding? The reference model
against itself: the same 64-token prompt prefilled in chunks of 64 and of 16 tokens
(only the attention's reduction order and the matmul shapes change; every op keeps its
rounding points), then the same greedy decode steps. If these two runs of the *same*
reference differ as much as the compiled runtime differs from the reference, the
differences come from the model's sensitivity (random weights, 49 layers, 47 routers
with near-ties), not from a kernel.

    python3 scripts/gpu_sensitivity.py --formats nvfp4 --out $OUT/sensitivity.md
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="nvfp4")
    ap.add_argument("--config", default="full")
    ap.add_argument("--layers", default=None, help="also try the first N layers only, e.g. 2,4,8,16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from dataclasses import replace

    from flintc.checkpoint.loader import load_checkpoint
    from flintc.model.reference import FlintModel
    from flintc.runtime.runner import ReferenceRunner

    rows = []
    for fmt in args.formats.split(","):
        ckpt = load_checkpoint(None, load_format="dummy", config=args.config, fmt=fmt, device=args.device, progress=False)
        depths = [ckpt.config.num_hidden_layers] + [int(x) for x in (args.layers or "").split(",") if x]
        for L in depths:
            cfg = ckpt.config if L == ckpt.config.num_hidden_layers else replace(
                ckpt.config, num_hidden_layers=L, layer_types=ckpt.config.layer_types[:L])
            w = {k: v for k, v in ckpt.weights.items()
                 if not k.startswith("model.layers.") or int(k.split(".")[2]) < L}
            model = FlintModel(cfg, w, max_positions=256)
            g = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, cfg.vocab_size, (64,), generator=g).tolist()
            a = ReferenceRunner(model, max_batch=1, max_model_len=128, prefill_chunk=64)
            b = ReferenceRunner(model, max_batch=1, max_model_len=128, prefill_chunk=16)
            la, lb = a.prefill(0, prompt), b.prefill(0, prompt)
            diffs = [float((la - lb).abs().max())]
            tok = int(la.argmax())
            for i in range(4):
                la = a.decode([0], [tok], [64 + i])[0]
                lb = b.decode([0], [tok], [64 + i])[0]
                diffs.append(float((la - lb).abs().max()))
                tok = int(la.argmax())
            r = {"format": fmt, "layers": L, "logit_std": float(la.std()), "max_abs_per_step": [round(d, 4) for d in diffs]}
            rows.append(r)
            print(json.dumps(r), flush=True)
        del ckpt
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    text = ["| format | layers | logit std | max abs diff, prefill then 4 decode steps |", "|---|---|---|---|"]
    text += [f"| {r['format']} | {r['layers']} | {r['logit_std']:.3f} | {r['max_abs_per_step']} |" for r in rows]
    print("\n".join(text))
    if args.out:
        open(args.out, "w").write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
