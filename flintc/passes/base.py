"""The pass interface every flintc graph pass implements.

A pass is a class with a stable `name`, the legality `stage` its output graph is
in, the numerical `expectation` it promises against its input graph (bit-exact,
or a tolerance it justifies in `expectation.why`), and the `steps` it applies to.
It is constructed with a :class:`PassContext` (the model config and the step's
shapes), then `run(gm)` rewrites the graph in place and returns a
:class:`PassResult`; `verify(gm)` checks the pass's own post-condition (for
example: no unfused pattern left) and raises :class:`PassVerifyError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch.fx import GraphModule

from flintc.config import FlintConfig
from flintc.errors import FlintcError
from flintc.graph.compare import BIT_EXACT, Expectation


class PassVerifyError(FlintcError):
    """A pass's post-condition does not hold on its output graph. `report`: the
    pipeline's report up to the failed stage, last, when `PassManager.run` raised it
    (None otherwise)."""

    report = None


@dataclass(frozen=True)
class PassContext:
    """What a pass may know about the graph it rewrites.

    config: the model config; step: "decode" or "prefill"; batch, tokens: B and T;
    cache_len: S_max of the full-attention caches; weight_format: "bf16" or "nvfp4";
    options: per-pass knobs by name (e.g. `attention_splits`), from the caller's config.
    """

    config: FlintConfig
    step: str
    batch: int
    tokens: int
    cache_len: int
    weight_format: str = "bf16"
    options: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass
class PassResult:
    """What one run of a pass did: `matches` (rewrites made) and free-form `notes`;
    the manager fills in node counts before and after."""

    matches: int = 0
    notes: list[str] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0


class GraphPass:
    """Base class of flintc's graph passes (see the module doc)."""

    name: ClassVar[str] = "unnamed"
    stage: ClassVar[str] = "fused"
    expectation: ClassVar[Expectation] = BIT_EXACT
    steps: ClassVar[tuple[str, ...]] = ("decode", "prefill")

    def __init__(self, ctx: PassContext):
        self.ctx = ctx

    def run(self, gm: GraphModule) -> PassResult:
        raise NotImplementedError

    def verify(self, gm: GraphModule) -> None:
        """Check this pass's post-condition on its output; default: nothing beyond
        the stage's legality, which the manager checks."""
