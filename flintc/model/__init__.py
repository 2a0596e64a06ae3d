"""The reference Flint model (plain PyTorch) and the canonical weight table."""
