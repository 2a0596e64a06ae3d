"""Checkpoints: tokenizer, random and dummy weights, BF16 safetensors, NVFP4 GGUF, loader."""
