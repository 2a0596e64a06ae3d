"""Triton kernels for flintc's fused ops (one kernel family per file; references in flintc.ops)."""
