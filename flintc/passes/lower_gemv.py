"""SmallBatchGEMVLoweringPass: at decode (batch <= 8) every remaining linear becomes
a `flintc.gemv` over the packed weights; the LM head becomes `flintc.lm_head` and
the embedding lookup `flintc.embedding`.

Why: at decode a linear reads a whole weight matrix to produce B <= 8 rows; it is a
GEMV, bound by weight bandwidth, and NVFP4 weights must be read packed (W4A16:
dequantize in registers, fp32 accumulation of x * (e2m1 * block scale), global
scale on the accumulator) instead of being dequantized to fp32 first as the
reference does. Cases: BF16 and NVFP4 weights (the NVFP4 pattern is traced per
weight shape, since dequantization has shape-specific views); q/k/v/o
projections, dense gate/up/down, shared expert linears not already fused into
the MoE ops. Runs after fuse_moe, so the router matmul is inside `moe_route`.
Bit-exact: each op's reference implementation is `flintc.model.ops.linear`.

Before / after (BF16, decode B=2):

    _to_copy_90 = aten._to_copy(view_26, dtype=f32)                   [2, 128]
    _to_copy_91 = aten._to_copy(w_layers_2_self_attn_q_proj, dtype=f32)
    permute_22 = aten.permute(_to_copy_91, [1, 0])
    mm_14 = aten.mm(_to_copy_90, permute_22)                          [2, 256] f32
    _to_copy_92 = aten._to_copy(mm_14, dtype=bf16)
  ->
    gemv = flintc.gemv(view_26, [w_layers_2_self_attn_q_proj])       [2, 256] bf16
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

import flintc.ops  # noqa: F401  (registers torch.ops.flintc)
from flintc.graph.match import find_nodes
from flintc.graph.rewrite import refresh_meta, replace_pattern, trace_pattern
from flintc.model import ops
from flintc.passes.base import GraphPass, PassResult, PassVerifyError
from flintc.quant.nvfp4 import NVFP4Tensor

aten = torch.ops.aten
CDT = torch.float32


def _weight_shapes(gm: GraphModule) -> tuple[set, set]:
    """(bf16 [F, K] shapes, NVFP4 [F, K] shapes) of the 2-D linear weight placeholders."""
    bf16, nvfp4 = set(), set()
    for n in gm.graph.nodes:
        if n.op != "placeholder" or not n.name.startswith("w_layers_"):
            continue
        v = n.meta["val"]
        if n.name.endswith("_codes") and v.dim() == 2:
            nvfp4.add((v.shape[0], v.shape[1] * 2))
        elif v.dim() == 2 and v.dtype == torch.bfloat16 and not n.name.endswith("_mlp_gate"):
            bf16.add(tuple(v.shape))
    return bf16, nvfp4


def lower_linears(gm: GraphModule, op, num_rows: int) -> int:
    """Replace every `ops.linear` pattern (rows `num_rows`) with `op(x, [weight parts])`,
    the LM head with `flintc.lm_head` and the embedding with `flintc.embedding`.
    Returns the number of rewrites."""
    count = 0
    bf16_shapes, nvfp4_shapes = _weight_shapes(gm)
    x = torch.empty(num_rows, 8, dtype=torch.bfloat16)
    if bf16_shapes:
        w = torch.empty(4, 8, dtype=torch.bfloat16)
        search = trace_pattern(lambda x, w: ops.linear(x, w, CDT), (x, w))
        repl = trace_pattern(lambda x, w: op(x, [w]), (x, w))
        count += len(replace_pattern(gm, search, repl))
    for F, K in sorted(nvfp4_shapes):
        xk = torch.empty(num_rows, K, dtype=torch.bfloat16)
        parts = (torch.empty(F, K // 2, dtype=torch.uint8), torch.empty(F, K // 16, dtype=torch.float8_e4m3fn),
                 torch.empty((), dtype=torch.float32))

        def search(x, c, s, g):
            return ops.linear(x, NVFP4Tensor(c, s, g), CDT)

        def replace(x, c, s, g):
            return op(x, [c, s, g])

        count += len(replace_pattern(gm, trace_pattern(search, (xk, *parts)), trace_pattern(replace, (xk, *parts))))
    count += _lower_head_and_embedding(gm, num_rows)
    refresh_meta(gm)
    return count


def _lower_head_and_embedding(gm: GraphModule, num_rows: int) -> int:
    x = torch.empty(num_rows, 8, dtype=torch.bfloat16)
    w = torch.empty(4, 8, dtype=torch.bfloat16)
    search = trace_pattern(lambda x, w: ops.lm_head(x, w, CDT), (x, w))
    repl = trace_pattern(lambda x, w: torch.ops.flintc.lm_head(x, w), (x, w))

    def is_lm_head(match, original, pattern) -> bool:
        return any(n.op == "placeholder" and n.name == "w_lm_head" for n in match.placeholder_nodes)

    count = len(replace_pattern(gm, search, repl, match_filters=[is_lm_head]))
    for node in find_nodes(gm, aten.index):
        table = node.args[0]
        if getattr(table, "name", None) == "w_embed_tokens":
            with gm.graph.inserting_before(node):
                emb = gm.graph.call_function(torch.ops.flintc.embedding.default, (node.args[1][0], table))
            emb.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            node.replace_all_uses_with(emb)
            gm.graph.erase_node(node)
            count += 1
    return count


def check_no_linear_left(gm: GraphModule, pass_name: str) -> None:
    """Raise PassVerifyError if an `ops.linear` (an fp32 `mm` rounded to bf16) or the LM
    head is still an aten matmul. (An unfused router matmul feeds a sigmoid, not a
    cast: it belongs to fuse_moe, which may be switched off.)"""
    for mm in find_nodes(gm, aten.mm):
        weight = mm.args[1]
        while weight.op == "call_function":  # permute(_to_copy(placeholder))
            weight = weight.args[0]
        rounded = [u for u in mm.users if u.target is aten._to_copy.default]
        if rounded or weight.name == "w_lm_head":
            raise PassVerifyError(f"{pass_name}: a linear was not lowered: {mm.name} (weight {weight.name})")


class SmallBatchGEMVLoweringPass(GraphPass):
    name = "lower_gemv"
    steps = ("decode",)

    def run(self, gm: GraphModule) -> PassResult:
        n = lower_linears(gm, torch.ops.flintc.gemv, self.ctx.batch * self.ctx.tokens)
        return PassResult(matches=n)

    def verify(self, gm: GraphModule) -> None:
        check_no_linear_left(gm, self.name)
