"""The baselines `flintc bench` compares against, on the same weights as flintc.

- "eager": the reference model (`flintc.model.reference.FlintModel`, plain PyTorch,
  FLINT_SPEC's numerics) running one decode step.
- "compile": `torch.compile(step, mode="max-autotune")` of the same decode step, where
  `step` wraps the model with its KV cache as static inputs (module attributes marked
  with `torch._dynamo.mark_static_address`, as static caches for compiled decoding do),
  so Inductor's CUDA graphs (on in max-autotune mode) can capture the in-place cache
  writes; the weights are marked static too, so CUDA graphs never copy them. One
  compile per (batch, context) point (`dynamic=False`): every point is the compiler's
  best case for its shapes. Whether CUDA graphs were used (Inductor may skip them and
  say why) and the compile time are part of the result; a failure to compile is
  caught and reported, never raised.
- "fast": the same `torch.compile` (`CompiledStep`, same static inputs, mode and
  reporting) of the decode step of `flintc.bench.fast_model.FastFlintModel`, the model
  a PyTorch user would write for speed (bf16 GEMMs, NVFP4 dequantized to bf16 per call,
  fp32 norms and softmax) where the reference computes every op in fp32: the stronger
  baseline. Same weights (its buffers are the reference's tensors), same cache layout.

The KV cache a baseline reads holds exactly `context` rows per full layer (a view of
the first rows of flintc's caches when given, else its own), so its attention reads
only what the step needs, the most favourable setting for a plain model whose
attention reads the whole cache it is given.
"""

from __future__ import annotations

import logging
import time
import traceback

import torch

from flintc.model.reference import FlintModel


def kv_view(kv: list[torch.Tensor], config, context: int) -> list[torch.Tensor]:
    """The caches limited to `context` rows in the full layers (views, no copy); the
    sliding rings as they are. kv: [k0, v0, k1, v1, ...] with full layers [slots, rows,
    Hkv, D]. Raises ValueError when a full cache has fewer than `context` rows."""
    out = []
    for i in range(config.num_hidden_layers):
        for t in kv[2 * i:2 * i + 2]:
            if config.is_sliding_layer(i):
                out.append(t)
            else:
                if t.shape[1] < context:
                    raise ValueError(f"kv: layer {i} holds {t.shape[1]} rows, fewer than context {context}")
                out.append(t[:, :context])
    return out


class EagerStep:
    """One decode step of the reference model: `__call__(ids [B, 1], positions [B, 1],
    slots [B]) -> fp32 logits [B, V]` over `kv` (updated in place)."""

    name = "eager"

    def __init__(self, model: FlintModel, kv: list[torch.Tensor]):
        self.model, self.kv = model, kv

    @torch.inference_mode()
    def __call__(self, ids, positions, slots):
        return self.model(ids, positions, slots, self.kv)[:, 0]


class _StaticDecode(torch.nn.Module):
    """A model's decode step (the reference's or `FastFlintModel`'s) with the KV cache
    held as attributes."""

    def __init__(self, model: FlintModel, kv: list[torch.Tensor]):
        super().__init__()
        self.model = model
        self.kv = kv

    def forward(self, ids, positions, slots):
        return self.model(ids, positions, slots, self.kv)[:, 0]


class _CudagraphLog(logging.Handler):
    """Collects Inductor's messages about skipped CUDA graphs."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "cudagraph" in msg.lower():
            self.messages.append(msg.strip().splitlines()[0][:300])


class CompiledStep:
    """`torch.compile(mode="max-autotune")` of `model`'s decode step (module doc): the
    "compile" baseline with the reference `FlintModel`, "fast" with `FastFlintModel`
    (`name` says which; it is the results' `engine`).

    After construction `error` is None, or the compile failure (type and message);
    `compile_s` the seconds of the first call (tracing, autotuning, compiling);
    `cudagraphs` True/False/None (unknown) and `cudagraph_notes` Inductor's reasons;
    `graph_breaks` how many times Dynamo broke the step's graph (0: one graph, one
    CUDA graph; each break adds a graph, a CUDA-graph replay and Python between them;
    None: unknown) and `cudagraph_notes` gets the first breaks' reasons.
    """

    name = "compile"

    def __init__(self, model: FlintModel, kv: list[torch.Tensor], example, mode: str = "max-autotune",
                 name: str = "compile"):
        self.name = name
        self.error = None
        self.compile_s = None
        self.cudagraphs = None
        self.cudagraph_notes: list[str] = []
        self.graph_breaks = None
        self.mode = mode
        import torch._dynamo as dynamo

        dynamo.reset()
        try:
            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
        except AttributeError:
            pass
        for t in kv:
            dynamo.mark_static_address(t)
        for b in model.buffers():
            dynamo.mark_static_address(b)
        self.module = _StaticDecode(model, kv)
        handler = _CudagraphLog()
        loggers = [logging.getLogger(n) for n in ("torch._inductor", "torch._inductor.cudagraph_trees",
                                                  "torch._inductor.utils", "torch._inductor.perf_hints")]
        for lg in loggers:
            lg.addHandler(handler)
        skips_before = _cudagraph_skips()
        breaks_before = _graph_breaks()
        try:
            self.fn = torch.compile(self.module, mode=mode, dynamic=False, fullgraph=False)
            t0 = time.perf_counter()
            with torch.inference_mode():
                for _ in range(3):  # compile, then CUDA-graph warm-up and recording
                    self._mark_step()
                    out = self.fn(*example)
                    _ = out.float().sum().item()
            self.compile_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a failure to compile is a result, reported
            tb = traceback.format_exc(limit=3).strip().splitlines()
            self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400] if str(e).strip() else ''}"
            self.traceback = tb[-6:]
        finally:
            for lg in loggers:
                lg.removeHandler(handler)
        self.cudagraph_notes = handler.messages[:5]
        breaks = _graph_breaks()
        if self.error is None and breaks is not None and breaks_before is not None:
            self.graph_breaks = sum((breaks - breaks_before).values())
            self.cudagraph_notes += [f"Dynamo graph break ({n}x): {_first_line(r)}"
                                     for r, n in (breaks - breaks_before).most_common(3)]
        skips = _cudagraph_skips()
        if self.error is None and skips is not None and skips_before is not None:
            self.cudagraphs = skips == skips_before and torch.device(example[0].device).type == "cuda"
        if any("skipping cudagraph" in m.lower() for m in handler.messages):
            self.cudagraphs = False

    @staticmethod
    def _mark_step():
        mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
        if mark is not None:
            mark()

    def __call__(self, ids, positions, slots):
        if self.error is not None:
            raise RuntimeError(f"the {self.name} baseline did not compile: {self.error}")
        self._mark_step()
        with torch.inference_mode():
            return self.fn(ids, positions, slots)

    def release(self) -> None:
        """Drop the compiled function and its CUDA-graph pools."""
        import torch._dynamo as dynamo

        self.fn = None
        dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _cudagraph_skips():
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"].get("cudagraph_skips", 0))
    except Exception:  # noqa: BLE001 - a private counter; unknown when it moves
        return None


def _graph_breaks():
    """Dynamo's graph breaks so far, a Counter of reason -> count (None where this torch
    keeps no such counter)."""
    try:
        from collections import Counter

        from torch._dynamo.utils import counters

        return Counter(counters["graph_break"])
    except Exception:  # noqa: BLE001 - a private counter; unknown when it moves
        return None


def _first_line(reason: str) -> str:
    return str(reason).strip().splitlines()[0][:200] if str(reason).strip() else "?"


BASELINES = ("eager", "compile", "fast")

__all__ = ["BASELINES", "CompiledStep", "EagerStep", "kv_view"]
