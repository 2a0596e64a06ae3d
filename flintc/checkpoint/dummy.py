"""Dummy weights made directly on the target device, like vLLM's `--load-format dummy`.

:func:`dummy_weights` fills the canonical weight dict of
:func:`flintc.model.weights.weight_specs` with random values drawn by a generator
on `device` itself: no files, no CPU round trip. Tensors are filled in place, in
chunks of at most :data:`CHUNK_ELEMS` weights, so the memory beyond the weights
themselves stays in the tens of MB even for the full config (40B parameters: 79 GB
in bf16, 23 GB in NVFP4; on one H200 either takes under a second). On the `meta` device the tensors are only allocated as
shapes, which checks a config's weight table without memory.

BF16 values follow :func:`flintc.checkpoint.init.init_rule` (the same
distributions as :func:`~flintc.checkpoint.init.random_weights`, other bits). In
NVFP4, `linear` weights are :class:`~flintc.quant.nvfp4.NVFP4Tensor` with uniform
random 4-bit codes (RMS :data:`E2M1_RMS` ~ 2.93) and block scales chosen so that
the dequantized RMS is about 1/sqrt(K); tensors picked by
:func:`~flintc.checkpoint.init.has_global_scale` get a global scale other than 1
(one per expert for stacked experts, each within 10% of the others).
"""

from __future__ import annotations

import math

import torch

from flintc.config import FlintConfig
from flintc.checkpoint.init import apply_rule, has_global_scale, init_rule
from flintc.model.weights import TensorSpec, WeightDict, weight_specs
from flintc.quant.nvfp4 import BLOCK, E2M1_VALUES, NVFP4Tensor

CHUNK_ELEMS = 1 << 24  # weights filled per step
E2M1_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))
# Block scales around this value when a global scale is used: mid-range for E4M3,
# where it has its full 3-bit mantissa.
SCALE_CENTER = 16.0
# Block scales are drawn as center * U(0.5, 1.5); E[U^2] = 13/12.
_SCALE_SPREAD_RMS = math.sqrt(13.0 / 12.0)


def dummy_weights(
    config: FlintConfig,
    fmt: str = "bf16",
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> WeightDict:
    """Random canonical weights for `config`, made on `device`.

    Args:
        fmt: "bf16" (every `linear` weight a bf16 tensor) or "nvfp4" (NVFP4Tensor).
        device: any torch device; "meta" allocates nothing.
        seed: seeds the device's generator (the same seed gives the same weights on
            the same kind of device; CPU and CUDA streams differ).

    Returns:
        name -> tensor, shapes and dtypes as :func:`weight_specs` (fp32 norms).

    Raises:
        ValueError: unknown `fmt`.
    """
    if fmt not in ("bf16", "nvfp4"):
        raise ValueError(f"dummy weight format must be 'bf16' or 'nvfp4', found {fmt!r}")
    device = torch.device(device)
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    weights: WeightDict = {}
    for spec in weight_specs(config):
        if spec.kind == "linear" and fmt == "nvfp4":
            weights[spec.name] = _dummy_nvfp4(spec, device, gen)
        else:
            weights[spec.name] = _dummy_dense(spec, device, gen)
    return weights


def _row_chunks(num_rows: int, row_elems: int):
    """(start, stop) row ranges of at most CHUNK_ELEMS elements each."""
    step = max(1, CHUNK_ELEMS // max(1, row_elems))
    for start in range(0, num_rows, step):
        yield start, min(num_rows, start + step)


def _dummy_dense(spec: TensorSpec, device: torch.device, gen) -> torch.Tensor:
    """A bf16 or fp32 tensor drawn by `init_rule(spec)`, row chunk by row chunk."""
    rule = init_rule(spec)
    out = torch.empty(spec.shape, dtype=rule.dtype, device=device)
    if gen is None:
        return out
    rows = out.view(-1, spec.shape[-1])
    for start, stop in _row_chunks(rows.shape[0], rows.shape[1]):
        if not rule.bf16_exact:
            # drawn in place: no temporary, whatever the chunk size
            rows[start:stop].normal_(rule.mean, rule.std, generator=gen)
            continue
        normal = torch.randn(
            (stop - start, rows.shape[1]), generator=gen, device=device, dtype=torch.float32
        )
        rows[start:stop] = apply_rule(rule, normal)
    return out


def _dummy_nvfp4(spec: TensorSpec, device: torch.device, gen) -> NVFP4Tensor:
    """Random NVFP4 weights [..., N, K] with a dequantized RMS of about 1/sqrt(K)."""
    *lead, K = spec.shape
    codes = torch.empty((*lead, K // 2), dtype=torch.uint8, device=device)
    scales = torch.empty((*lead, K // BLOCK), dtype=torch.float8_e4m3fn, device=device)
    g_shape = (spec.shape[0],) if len(spec.shape) == 3 else ()
    if gen is None:
        return NVFP4Tensor(codes, scales, torch.empty(g_shape, dtype=torch.float32, device=device))

    target = 1.0 / math.sqrt(K) / E2M1_RMS  # wanted RMS of block scale * global scale
    if has_global_scale(spec):
        # each expert (or the one matrix) gets its own global scale, within +-10%
        jitter = 0.9 + 0.2 * torch.rand(g_shape, generator=gen, device=device)
        global_scale = (target / SCALE_CENTER * jitter).to(torch.float32)
        center = SCALE_CENTER
    else:
        global_scale = torch.ones(g_shape, dtype=torch.float32, device=device)
        center = target
    center /= _SCALE_SPREAD_RMS

    code_rows = codes.view(-1, K // 2)
    scale_rows = scales.view(-1, K // BLOCK)
    for start, stop in _row_chunks(code_rows.shape[0], K):
        code_rows[start:stop].random_(0, 256, generator=gen)
        u = torch.rand((stop - start, K // BLOCK), generator=gen, device=device)
        scale_rows[start:stop] = (center * (0.5 + u)).to(torch.float8_e4m3fn)
    return NVFP4Tensor(codes, scales, global_scale)
