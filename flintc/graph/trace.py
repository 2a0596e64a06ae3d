"""Capture: the reference model's decode or prefill step as a torch.fx graph.

`capture(model, step, batch, tokens, cache_len)` traces `FlintModel.forward` with
`make_fx` in fake-tensor mode, so every node carries `meta["val"]` (a FakeTensor:
shape, dtype, device) and no real data is touched; a model built on `meta` weights
(`dummy_weights(config, device="meta")`) captures the full 40B config without
memory. The graph is aten-level and unfused: RMSNorm, RoPE, routing, each expert
matmul and attention appear as their primitive ops.

Graph inputs, in order (placeholder names in brackets):
  1. every weight buffer of the model [`w_<name>`], NVFP4 weights as three
     placeholders (`..._codes`, `..._scales`, `..._global_scale`), then the RoPE
     tables [`rope_cos`, `rope_sin`];
  2. `input_ids` int64 [B, T], `positions` int64 [B, T], `slots` int64 [B]; a
     prefill step also `logits_rows` int64 [B]: the row of the step's B*T tokens
     whose logits each sequence wants (b*T + t for sequence b's token t; the runtime
     passes each sequence's last real token);
  3. the KV cache [`k_cache_<i>`, `v_cache_<i>` per layer], written in place by
     `aten.index_put_` nodes (the graph's only side effects).
The output of a decode step is the logits, fp32 [B, 1, V]; of a prefill step the
tuple (logits of the `logits_rows` rows, fp32 [B, V]; the final-normed hidden states
[B, T, H], bf16, from which the runtime computes every position's logits when asked:
`FlintModel.logits_from_hidden`). The LM head, the largest GEMM of a prefill chunk
(2.5 TFLOP at 4,096 tokens of the full model), runs on B rows instead of B*T.

After tracing, every node gets `meta["flintc_layer"]`: the decoder layer whose
forward produced it (recorded with module hooks during tracing), -1 for the
embedding, L for the final norm and LM head, None for per-step values shared by
all layers (masks, RoPE rows); nodes of a layer's attention or MLP/MoE block get
`meta["flintc_block"]` ("attn", "mlp", "moe"); and the routing's selected-experts
node gets `meta["flintc_role"] = "moe_selected"`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from flintc.config import FlintConfig
from flintc.graph.layer_replay import replay, replay_plan
from flintc.graph.rewrite import fake_mode_section, mark_meta_current
from flintc.model.reference import FlintModel

STEPS = ("decode", "prefill")
ACTIVATION_INPUTS = ("input_ids", "positions", "slots")
LOGITS_ROWS = "logits_rows"  # the prefill step's fourth activation input


def activation_inputs(step: str) -> tuple[str, ...]:
    """The activation placeholders of `step`, in order (after the weights, before the
    KV cache)."""
    return ACTIVATION_INPUTS + ((LOGITS_ROWS,) if step == "prefill" else ())


DEFAULT_PREFILL_TOKENS = 16  # T of a prefill capture given no tokens


def last_rows(batch: int, tokens: int, device=None) -> torch.Tensor:
    """`logits_rows` of each sequence's last token: int64 [B], b*T + T - 1."""
    return torch.arange(1, batch + 1, device=device) * tokens - 1


def graph_args(gm: GraphModule, weights, inputs) -> list:
    """The positional arguments of a captured (or compiled) step graph: the weights,
    input_ids, positions, slots, `logits_rows` when the graph takes it, the KV cache.
    `inputs` is (input_ids, positions, slots, kv) or (..., kv, logits_rows); without
    logits_rows a prefill graph gets each sequence's last token (`last_rows`)."""
    ids, positions, slots, kv = inputs[:4]
    args = [*weights, ids, positions, slots]
    if any(n.op == "placeholder" and n.name == LOGITS_ROWS for n in gm.graph.nodes):
        rows = inputs[4] if len(inputs) > 4 else None
        args.append(last_rows(*ids.shape, device=ids.device) if rows is None else rows)
    return args + list(kv)


@dataclass
class CapturedGraph:
    """A traced step and how to call it.

    Attributes:
        gm: the GraphModule; call as `gm(*weights, input_ids, positions, slots, *kv)`
            (decode) or `gm(*weights, input_ids, positions, slots, logits_rows, *kv)`
            (prefill); `graph_args` builds either.
        step: "decode" (T = 1) or "prefill".
        config: the model config it was traced for.
        batch, tokens, cache_len: B, T and the full-attention cache length S_max.
        buffer_names: the model buffer behind each weight placeholder, in order.
    """

    gm: GraphModule
    step: str
    config: FlintConfig
    batch: int
    tokens: int
    cache_len: int
    buffer_names: list[str] = field(default_factory=list)

    @property
    def num_weight_inputs(self) -> int:
        return len(self.buffer_names)

    def weight_args(self, model: FlintModel) -> list[torch.Tensor]:
        """The weight placeholders' values, taken from `model`'s buffers."""
        buffers = dict(model.named_buffers())
        return [buffers[name] for name in self.buffer_names]

    def example_inputs(self, model: FlintModel, seed: int = 0, device=None):
        """Random (input_ids, positions, slots, kv_cache) of this graph's shapes.

        Decode positions are drawn per sequence so sliding windows have wrapped. A
        prefill chunk starts at a position drawn per sequence from [W, cache_len - T]
        (from cache_len - T when that is less than W): a chunk after earlier ones
        (chunked prefill), so the checks read cached rows in the full layers and a
        wrapped ring in the sliding layers (`prefill_attention_kv`'s cached-key path,
        which a chunk at position 0 never reads). The KV cache is filled with random
        values (as if earlier steps had written it), in the model's activation dtype.
        """
        c, B, T = self.config, self.batch, self.tokens
        device = device or model.rope_cos.device
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, c.vocab_size, (B, T), generator=g)
        start = None
        if self.step == "decode":
            start = torch.randint(0, self.cache_len - T + 1, (B, 1), generator=g)
        slots = torch.randperm(B, generator=g)
        kv = [torch.randn(t.shape, generator=g).to(t.dtype) for t in model.new_kv_cache(B, self.cache_len, "cpu")]
        if start is None:  # drawn last: ids, slots and cache are those a chunk at 0 had
            last = max(0, self.cache_len - T)
            start = torch.randint(min(c.sliding_window, last), last + 1, (B, 1), generator=g)
        positions = start + torch.arange(T)[None]  # [B, T]
        move = lambda t: t.to(device)  # noqa: E731
        return move(ids), move(positions), move(slots), [move(t) for t in kv]


def capture(model: FlintModel, step: str = "decode", batch: int = 1, tokens: int | None = None,
            cache_len: int = 64, stack_traces: bool = True, replay_layers: bool = True) -> CapturedGraph:
    """Trace one step of `model` into an aten-level FX graph (see the module doc).

    Args:
        model: a FlintModel (real, or on meta weights for counting only).
        step: "decode" (tokens must be 1 or None) or "prefill".
        batch: B, sequences per step (decode: 1..8 in flintc's buckets).
        tokens: T, new tokens per sequence (prefill chunk length; default 16).
        cache_len: S_max, the full-attention layers' cache length.
        stack_traces: record each node's source lines (`meta["stack_trace"]`, which
            only the dumps read); off, tracing is faster.
        replay_layers: trace one layer of each kind and copy it for the layers of
            that kind (`flintc.graph.layer_replay`: the same graph, made some ten
            times faster for the full model); False: trace every layer.

    The GraphModule is torch.fx's lazy kind (`_LazyGraphModule`): passes edit the
    graph and call `recompile()` often, and its Python code is only generated when it
    is first called or its `code` read, not after every edit.

    Raises:
        ValueError: unknown step, a decode step with tokens != 1, a batch or cache_len
            below 1, or a prefill step with more tokens than cache_len.
    """
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; expected one of {STEPS}")
    T = 1 if step == "decode" else (DEFAULT_PREFILL_TOKENS if tokens is None else int(tokens))
    if T < 1:
        raise ValueError(f"a prefill step needs at least one token per sequence, got tokens={tokens}")
    if cache_len < 1:
        raise ValueError(f"cache_len must be at least 1, got {cache_len}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    if step == "prefill" and T > cache_len:
        raise ValueError(f"a prefill step of {T} tokens needs cache_len >= {T} (it writes every token "
                         f"into the full-attention cache), got cache_len={cache_len}")
    if step == "decode" and tokens not in (None, 1):
        raise ValueError("a decode step has exactly one new token per sequence")
    names = [n for n, _ in model.named_buffers()]
    buffers = [b for _, b in model.named_buffers()]
    device = model.rope_cos.device
    ids = torch.zeros(batch, T, dtype=torch.long, device=device)
    positions = torch.zeros(batch, T, dtype=torch.long, device=device)
    slots = torch.arange(batch, device=device)
    act = [ids, positions, slots] + ([last_rows(batch, T, device)] if step == "prefill" else [])
    kv = model.new_kv_cache(batch, cache_len, device)
    flat = (*buffers, *act, *kv)
    built = None
    if replay_layers:
        plan = replay_plan(model, names)
        if plan is not None:
            traced, spans = _trace(plan.model, plan.params, plan.kv_index, flat, len(names), len(act),
                                   stack_traces)
            built = replay(traced, spans.spans, plan, names, model.config.num_hidden_layers, len(act))
    if built is None:
        gm, spans = _trace(model, list(zip(names, range(len(names)))), range(len(kv)), flat, len(names),
                           len(act), stack_traces)
    else:
        gm, spans = built[0], _ModuleSpans(model)
        spans.spans = built[1]
    captured = CapturedGraph(gm, step, model.config, batch, T, cache_len, names)
    _name_placeholders(gm, model, names, activation_inputs(step))
    spans.tag(gm, model.config)
    tag_moe_selection(gm)
    mark_meta_current(gm)  # make_fx's values are current: refresh_meta need not redo them
    return captured


def _trace(model, params: list[tuple[str, int]], kv_index, flat: tuple, n: int, n_act: int,
           stack_traces: bool):
    """make_fx of one step of `model` over the inputs `flat` (weights, the `n_act`
    activation inputs: input_ids, positions, slots and for prefill logits_rows, KV
    cache); `model`'s buffer `name` is `flat[k]` for each (name, k) in `params`, and its
    KV cache `flat[n + n_act + k]` for k in `kv_index`. Returns the GraphModule (lazy,
    see `capture`) and the `_ModuleSpans` of its layers."""
    kv_index = list(kv_index)

    def step_fn(*flat):
        weights = {name: flat[k] for name, k in params}
        act = flat[n:n + n_act]
        kv = [flat[n + n_act + k] for k in kv_index]
        return torch.func.functional_call(model, weights, (*act[:3], kv, *act[3:]))

    # a Ctrl-C waits for the trace's end (`fake_mode_section`: one raised inside aborted the process)
    with fake_mode_section(tracing=True), _ModuleSpans(model) as spans, _use_lazy_graph_module(True):
        gm = make_fx(step_fn, tracing_mode="fake", record_stack_traces=stack_traces)(*flat)
    return gm, spans


class _ModuleSpans:
    """Records which traced nodes each decoder layer (and its attention / MLP block)
    produced, with forward hooks that note the tracer's last node before and after
    each call; `tag` then writes `meta["flintc_layer"]` and `meta["flintc_block"]`.
    The reference model itself is not changed."""

    def __init__(self, model: FlintModel):
        self.model = model
        self.spans: list[tuple[str, object, str | None, str | None]] = []  # (key, value, after, last)
        self.handles = []

    def __enter__(self):
        for i, layer in enumerate(self.model.layers):
            self._watch(layer, "flintc_layer", i)
            self._watch(layer.self_attn, "flintc_block", "attn")
            self._watch(layer.mlp, "flintc_block", "moe" if layer.is_moe else "mlp")
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    @staticmethod
    def _last_node_name() -> str | None:
        from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode

        mode = get_innermost_proxy_mode()
        if mode is None:
            return None
        last = mode.tracer.graph._root.prev  # the graph's nodes form a ring around _root
        return last.name if last is not mode.tracer.graph._root else None

    def _watch(self, module, key, value):
        record = {}

        def pre(mod, args):
            record["after"] = self._last_node_name()

        def post(mod, args, out):
            self.spans.append((key, value, record.get("after"), self._last_node_name()))

        self.handles.append(module.register_forward_pre_hook(pre))
        self.handles.append(module.register_forward_hook(post))

    def tag(self, gm: GraphModule, config: FlintConfig) -> None:
        """Tag nodes inside recorded spans; placeholders by name (weights, caches);
        nodes after the last layer (final norm, LM head) get layer L, nodes before the
        first (embedding, masks) get -1 when they read the embedding, else None."""
        order = {n.name: k for k, n in enumerate(gm.graph.nodes)}
        nodes = list(gm.graph.nodes)
        for n in nodes:
            n.meta.setdefault("flintc_layer", None)
        for key, value, after, last in self.spans:
            start = order[after] + 1 if after is not None else 0
            stop = order[last] + 1 if last is not None else 0
            for n in nodes[start:stop]:
                if n.op == "call_function":
                    n.meta[key] = value
        first_layer = min((order[a] for k, _, a, _ in self.spans if k == "flintc_layer" and a), default=0)
        last_layer = max((order[b] for k, _, _, b in self.spans if k == "flintc_layer" and b), default=0)
        for k, n in enumerate(nodes):
            if n.op == "placeholder":
                n.meta["flintc_layer"] = _placeholder_layer(n.name, config)
            elif n.op == "call_function" and k > last_layer:
                n.meta["flintc_layer"] = config.num_hidden_layers
            elif n.op == "call_function" and k <= first_layer and _reads(n, "w_embed_tokens"):
                n.meta["flintc_layer"] = -1


def placeholder_name(buffer_name: str, holders: dict[str, str]) -> str:
    """`w_<canonical weight name>` (dots to underscores, `model.`/`.weight` dropped)
    for a weight buffer, with `_codes` / `_scales` / `_global_scale` for NVFP4 parts."""
    if buffer_name in ("rope_cos", "rope_sin"):
        return buffer_name
    holder, _, part = buffer_name.rpartition(".")
    canonical = holders[holder]
    short = re.sub(r"^model\.", "", canonical)
    short = re.sub(r"\.weight$", "", short).replace(".", "_")
    return f"w_{short}" if part == "weight" else f"w_{short}_{part}"


def _name_placeholders(gm: GraphModule, model: FlintModel, names: list[str],
                       activations: tuple[str, ...] = ACTIVATION_INPUTS) -> None:
    from flintc.model.reference import WeightHolder

    holders = {n: m.name for n, m in model.named_modules() if isinstance(m, WeightHolder)}
    wanted = [placeholder_name(b, holders) for b in names] + list(activations)
    for i in range(model.config.num_hidden_layers):
        wanted += [f"k_cache_{i}", f"v_cache_{i}"]
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    assert len(placeholders) == len(wanted), (len(placeholders), len(wanted))
    for node, name in zip(placeholders, wanted):
        node._rename(name)
        node.target = name
    gm.recompile()


_LAYER_RE = re.compile(r"^(?:w_layers_|[kv]_cache_)(\d+)")


def _placeholder_layer(name: str, config: FlintConfig) -> int | None:
    """A weight's or cache's layer from its placeholder name; -1 embedding, L head."""
    m = _LAYER_RE.match(name)
    if m:
        return int(m.group(1))
    if name.startswith("w_embed"):
        return -1
    if name in ("w_norm", "w_lm_head"):
        return config.num_hidden_layers
    return None


def _reads(node, placeholder_name: str) -> bool:
    """Whether `node` reads the placeholder, directly or through its inputs."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.name == placeholder_name:
            return True
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return False


def tag_moe_selection(gm: GraphModule) -> None:
    """Tag the selected-experts node of each MoE layer: the top-k slice of the
    stable sort's indices (`flintc.model.ops.route_topk`)."""
    import operator

    for node in gm.graph.nodes:
        if node.target is not torch.ops.aten.sort.stable:
            continue
        for user in node.users:
            if user.target is operator.getitem and user.args[1] == 1:
                for sl in user.users:
                    if sl.target is torch.ops.aten.slice.Tensor:
                        sl.meta["flintc_role"] = "moe_selected"
