"""PDLChainingPass: mark every kernel of the final schedule for programmatic
dependent launch, and check the marks.

Why: with PDL (`launch_pdl=True`, `gdc_wait()` in the kernel) kernel n+1 starts
while kernel n still runs, so it can load its weights early; it must wait
(`gdc_wait`) before reading anything kernel n or an earlier kernel of the step
wrote, and before writing anything. FLINT_SPEC section 5 and NOTES.md give the
rules. Each kernel node gets `meta["pdl"]`:

    {"before_wait": [...inputs it may read before gdc_wait...],
     "after_wait":  [...inputs it reads only after gdc_wait...],
     "writes_after_wait": True}

Inputs allowed before the wait: weight placeholders (`w_*`), the RoPE tables
(`rope_cos`, `rope_sin`), and the step inputs the host copies in before the graph
runs (`input_ids`, `positions`, `slots`). Everything produced by a kernel, and the
KV caches (kernels write them), comes after the wait. `check_pdl_marks` rejects a
mark that puts such an input before the wait. Bit-exact: marks change no value.

Before / after: no change in the graph's nodes; e.g. on `gemv_residual_3`:

    meta["pdl"] = {"before_wait": ["w_layers_2_self_attn_o_proj"],
                   "after_wait": ["attention_combine_2", "rms_norm_5"], ...}
"""

from __future__ import annotations

from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from flintc.graph.accounting import kernels_of
from flintc.passes.base import GraphPass, PassResult, PassVerifyError

PRE_WAIT_INPUTS = ("rope_cos", "rope_sin", "input_ids", "positions", "slots")


def _inputs(node: Node) -> list[Node]:
    found: list[Node] = []
    map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return list(dict.fromkeys(found))


def may_read_before_wait(node: Node) -> bool:
    """Weights, tables and host-written step inputs; never a kernel output or a cache."""
    return node.op == "placeholder" and (node.name.startswith("w_") or node.name in PRE_WAIT_INPUTS)




def check_pdl_marks(gm: GraphModule) -> None:
    """Raise PassVerifyError if a kernel node lacks a PDL mark, or marks as readable
    before `gdc_wait` an input that a kernel writes (an activation or a KV cache)."""
    for node in gm.graph.nodes:
        if kernels_of(node) == 0:
            continue
        mark = node.meta.get("pdl")
        if mark is None:
            raise PassVerifyError(f"kernel {node.name} has no PDL mark")
        by_name = {n.name: n for n in _inputs(node)}
        for name in mark["before_wait"]:
            src = by_name.get(name)
            if src is None:
                raise PassVerifyError(f"kernel {node.name}: PDL mark names {name}, which is not an input")
            if not may_read_before_wait(src):
                raise PassVerifyError(
                    f"kernel {node.name}: input {name} is read before gdc_wait, but a kernel writes it "
                    f"({'KV cache' if src.op == 'placeholder' else 'activation'}); read it after the wait")
        missing = set(by_name) - set(mark["before_wait"]) - set(mark["after_wait"])
        if missing:
            raise PassVerifyError(f"kernel {node.name}: inputs {sorted(missing)} are in neither PDL list")


class PDLChainingPass(GraphPass):
    name = "mark_pdl"
    stage = "lowered"
    steps = ("decode",)

    def run(self, gm: GraphModule) -> PassResult:
        marked = 0
        for node in gm.graph.nodes:
            if kernels_of(node) == 0:
                continue
            ins = _inputs(node)
            node.meta["pdl"] = {
                "before_wait": [n.name for n in ins if may_read_before_wait(n)],
                "after_wait": [n.name for n in ins if not may_read_before_wait(n)],
                "writes_after_wait": True,
            }
            marked += 1
        return PassResult(matches=marked, notes=[f"{marked} kernels marked for PDL"])

    def verify(self, gm: GraphModule) -> None:
        check_pdl_marks(gm)
