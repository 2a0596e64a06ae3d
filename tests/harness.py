"""The shared test harness: a tiny model, freshly captured graphs, pass contexts."""

from __future__ import annotations

import functools

from flintc.checkpoint.init import random_weights
from flintc.config import FlintConfig
from flintc.graph.trace import capture
from flintc.model.reference import FlintModel
from flintc.passes.base import PassContext

TINY = FlintConfig.preset("tiny")


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0) -> FlintModel:
    return FlintModel(TINY, random_weights(TINY, seed))


def fresh_graph(step: str = "decode", batch: int = 2, tokens: int | None = None, model=None):
    """A newly captured graph (passes rewrite in place, so never share one)."""
    model = model or tiny_model()
    return capture(model, step, batch=batch, tokens=tokens, cache_len=48)


def context(g, fmt: str = "bf16") -> PassContext:
    return PassContext(g.config, g.step, g.batch, g.tokens, g.cache_len, fmt)
