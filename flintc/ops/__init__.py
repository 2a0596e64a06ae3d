"""flintc's fused ops: `torch.ops.flintc.*`, each with a plain-PyTorch reference
implementation that keeps FLINT_SPEC section 3's rounding points, and a fake
(meta) implementation so capture and shape propagation work on them.

Importing this package registers the ops with torch.library (that is how torch
custom ops exist; nothing else is registered at import). Kernels (Triton, issue
5) implement the same contracts; each kernel file points to its op here.

Weights are passed as a list of tensors: `[w]` for a bf16 weight, `[codes, scales,
global_scale]` for NVFP4 (the packed layout of `flintc.quant.nvfp4`).
"""

from flintc.ops import attention, grouped, linear, moe, norm  # noqa: F401  (registers the ops)
from flintc.ops.common import as_weight, weight_args  # noqa: F401
