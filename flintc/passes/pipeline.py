"""flintc's pass pipelines, and `compile_step`, which captures a step and runs one.

Decode (batch <= 8, one new token per sequence), in order:

 1. canonicalize           remove no-op aliases, collapse view chains
 2. fuse_rms_norm          every RMSNorm -> flintc.rms_norm
 3. fuse_silu_mul          every SwiGLU activation -> flintc.silu_mul
 4. fuse_qk_norm_rope_kv   per-head Q/K norm + RoPE + KV-cache write -> one op
 5. fuse_moe               router, top-k, selected + shared experts, combine -> 3 ops
 6. fuse_decode_attention  split-KV attention with sinks + combine (tolerance)
 7. lower_gemv             remaining linears -> GEMV over packed weights; LM head; embedding
 8. group_low_latency      fold norms, residual adds and top-k into the GEMVs: 7 / 6 kernels
                           (option fold_attention_combine: the combine into the attention, 6 / 5;
                           option split_lm_head_norm, default True: the final norm stays its own
                           kernel before the plain LM head; False: norm_lm_head, one kernel less)
 9. mark_pdl               PDL marks for every kernel, checked

Prefill (T tokens per sequence) shares 1-5, then:

 6. fuse_prefill_attention flash attention with sinks and window reading the cache, plus
                           the KV write -> prefill_attention_kv (tolerance)
 7. lower_gemm             linears -> large-batch GEMM; LM head; embedding
 8. fuse_add_rms_norm      each residual add + the RMSNorm reading it -> add_rms_norm

Grouping and PDL apply to decode only: prefill kernels are long, launch gaps do not
matter, and its attention must read the old ring before the write. Decode folds its
residual adds into the GEMVs (8); prefill folds them into the norm that follows (8).
"""

from __future__ import annotations

from pathlib import Path

from flintc.graph.trace import DEFAULT_PREFILL_TOKENS, CapturedGraph, capture
from flintc.passes.base import GraphPass, PassContext
from flintc.passes.canonicalize import CanonicalizationPass
from flintc.passes.fuse_add_rms_norm import AddRMSNormFusionPass
from flintc.passes.fuse_decode_attention import DecodeAttentionFusionPass
from flintc.passes.fuse_moe import MoEFusionPass
from flintc.passes.fuse_prefill_attention import PrefillAttentionFusionPass
from flintc.passes.fuse_qk_norm_rope_kv import QKNormRopeKVWriteFusionPass
from flintc.passes.fuse_rms_norm import RMSNormFusionPass
from flintc.passes.fuse_silu_mul import SiLUMulFusionPass
from flintc.passes.group_low_latency import LowLatencyGroupingPass
from flintc.passes.lower_gemm import GEMMLoweringPass
from flintc.passes.lower_gemv import SmallBatchGEMVLoweringPass
from flintc.passes.manager import NumericChecker, PassManager, PipelineReport
from flintc.passes.mark_pdl import PDLChainingPass

COMMON = [CanonicalizationPass, RMSNormFusionPass, SiLUMulFusionPass, QKNormRopeKVWriteFusionPass,
          MoEFusionPass]
DECODE_PIPELINE: list[type[GraphPass]] = COMMON + [
    DecodeAttentionFusionPass, SmallBatchGEMVLoweringPass, LowLatencyGroupingPass, PDLChainingPass]
PREFILL_PIPELINE: list[type[GraphPass]] = COMMON + [PrefillAttentionFusionPass, GEMMLoweringPass,
                                                   AddRMSNormFusionPass]


# The pass options `compile_step` takes: name -> (the steps whose passes read it, its type:
# "bool" True / False, "int" an integer >= 1, and what it is).
PASS_OPTIONS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "attention_splits": (("decode",), "int", "split-KV chunks of decode attention (fuse_decode_attention)"),
    "full_attention_rows": (("decode",), "int",
                            "rows of the runtime's full-attention caches (fuse_decode_attention)"),
    "fold_attention_combine": (("decode",), "bool",
                               "fold the split-KV combine into the attention kernel (group_low_latency)"),
    "split_lm_head_norm": (("decode",), "bool",
                           "the final norm a kernel of its own before the LM head (group_low_latency)"),
}


def step_options(step: str, options: dict) -> dict:
    """The entries of `options` that apply to `step` ("decode", "prefill"): those of
    `PASS_OPTIONS` that a pass of its pipeline reads (every one is decode's: a prefill has
    none), in their order; a name `PASS_OPTIONS` does not know is kept, for `compile_step`
    to refuse. What a caller that holds one set of options for several steps (`flintc
    compile`, `flintc verify --step both`) gives each step, and what its dumps record."""
    return {k: v for k, v in options.items() if k not in PASS_OPTIONS or step in PASS_OPTIONS[k][0]}


def check_options(options, step: str, cache_len: int, config) -> dict:
    """`compile_step`'s `options` for `step`, checked (None: {}): a dict of `PASS_OPTIONS`
    names that apply to `step`, each "bool" one True or False (a NumPy bool is taken, as
    `flintc.compile` takes its flags: `flintc.errors.check_bool`), each "int" one an integer
    >= 1 (not a bool: True was 1 split; 2.5 and "2" became 2). `attention_splits` may be at
    most the rows of a full-attention cache (`full_attention_rows`, else `cache_len`) when
    `config` has a full-attention layer: more chunks than rows are empty ones, launched and
    combined for nothing (a sliding layer's ring takes any count, `num_splits_for`).
    Returns the options as plain bools and ints, in their order.

    Raises:
        InputError: "compile_step: options ...": not a dict; a name it does not know (listing
            those it does); a decode option for a prefill step (its pipeline never reads it:
            `flintc dump --step prefill` refuses the flags); a value of the wrong type or
            range; more attention_splits than full-attention cache rows (naming both).
    """
    import numbers

    from flintc.errors import InputError, check_bool, describe_type

    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InputError(f"compile_step: options: expected a dict of pass options, got {describe_type(options)}")
    checked = {}
    for name, value in options.items():
        if name not in PASS_OPTIONS:
            raise InputError(f"compile_step: options: unknown option {name!r}; the options are "
                             f"{', '.join(PASS_OPTIONS)}")
        steps, kind, what = PASS_OPTIONS[name]
        if step not in steps:
            raise InputError(f"compile_step: options: {name} applies only to the {' and '.join(steps)} pipeline "
                             f"({what}), not to the {step} step; drop it")
        where = f"compile_step: options[{name!r}]"
        if kind == "bool":
            checked[name] = check_bool(value, where)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise InputError(f"{where}: expected an integer >= 1, got {describe_type(value)} {value!r}")
        checked[name] = int(value)  # NumPy's: a plain int
    splits = checked.get("attention_splits")
    if splits is not None and "full_attention" in config.layer_types:
        rows, source = ((checked["full_attention_rows"], "full_attention_rows") if "full_attention_rows" in checked
                        else (cache_len, "cache_len"))
        if splits > rows:
            raise InputError(f"compile_step: options: attention_splits {splits} is more than the {rows} rows of a "
                             f"full-attention cache ({source}): a split gets at least one row; use at most {rows}")
    return checked


def pipeline_for(step: str) -> list[type[GraphPass]]:
    """The ordered pass classes of `step` ("decode" or "prefill")."""
    if step == "decode":
        return list(DECODE_PIPELINE)
    if step == "prefill":
        return list(PREFILL_PIPELINE)
    raise ValueError(f"unknown step {step!r}; expected 'decode' or 'prefill'")


def step_name(step: str, batch: int = 1, tokens: int | None = None) -> str:
    """`decode_b2`, `prefill_t16`: the function a BUILD compiles the step into, and the
    subfolder of `$FLINTC_DUMP_DIR` (or of BUILD/dumps) its dumps go to. A prefill of
    more than one sequence (a BUILD has none) is `prefill_b2_t16`, so that its dumps do
    not replace the batch-1 step's."""
    if step == "decode":
        return f"decode_b{batch}"
    t = DEFAULT_PREFILL_TOKENS if tokens is None else int(tokens)
    return f"prefill_t{t}" if int(batch) == 1 else f"prefill_b{int(batch)}_t{t}"


def env_dump_dir(step: str, batch: int = 1, tokens: int | None = None,
                 target: str | None = None) -> Path | None:
    """`$FLINTC_DUMP_DIR/<step_name>/`, where `compile_step` given no dump_dir writes the
    step's dumps (one subfolder per step, so several steps' dumps survive side by side);
    None when the variable is unset. `target` ("counts", "numerics": the two targets of
    `--config full`, `flintc.cli.graphs.target_subfolder`) adds a subfolder below it.

    Raises:
        InputError: naming the variable: its folder cannot be written or is in a BUILD
            (`flintc.fileio.dump_dir_from_env`), or the step's subfolder holds files
            that are not an earlier dump (they would be deleted).
    """
    from flintc.fileio import dump_dir_from_env

    value = dump_dir_from_env()
    if value is None:
        return None
    name = step_name(step, batch, tokens)
    return check_env_dump_subdir(value, f"{name}/{target}" if target else name)


def check_env_dump_subdir(value: str | Path, name: str) -> Path:
    """`value/name` (value: `$FLINTC_DUMP_DIR`'s, name: a step's subfolder such as
    `decode_b1`), checked to be new, empty or an earlier dump (`check_dump_dir`).

    Raises:
        InputError: "FLINTC_DUMP_DIR=<value>: <value>/<name>: not empty and not the
            output of an earlier flintc dump ...; move those files away, or set
            FLINTC_DUMP_DIR to another folder (unset: no dumps)".
    """
    from flintc.fileio import DUMP_DIR_ENV
    from flintc.graph.dump import check_dump_dir

    out = Path(value) / name
    check_dump_dir(out, f"{DUMP_DIR_ENV}={value}: {out}",
                   f"move those files away, or set {DUMP_DIR_ENV} to another folder (unset: no dumps)")
    return out


def compile_step(model, step: str = "decode", batch: int = 1, tokens: int | None = None,
                 cache_len: int = 64, weight_format: str | None = None, disabled=(),
                 check_model=None, seed: int = 0, dump_dir=None, options: dict | None = None,
                 ) -> tuple[CapturedGraph, PipelineReport]:
    """Capture one step of `model` and run its pipeline.

    Args:
        model: the FlintModel to capture (real weights, or meta weights for counting).
        check_model: a FlintModel with real weights of the same config and format to
            check every pass numerically on (often `model` itself); None: no numeric checks.
        dump_dir: write pass-by-pass dumps here (a new or empty folder, or an earlier
            dump, which is replaced); None: into `$FLINTC_DUMP_DIR/<step_name>/` if the
            variable is set (`env_dump_dir`: decode_b1, prefill_t16, ...); False: no
            dumps, whatever the environment says.
        options: per-pass knobs: {"attention_splits": N} (split-KV chunks of decode
            attention), {"fold_attention_combine": True} (group_low_latency folds the
            combine into the attention kernel), {"split_lm_head_norm": False}
            (group_low_latency fuses the final rms_norm into the LM head, norm_lm_head;
            True, the default, leaves them apart: `group_low_latency.SPLIT_LM_HEAD_NORM`),
            {"full_attention_rows": S} (rows of the runtime's full-attention caches, for
            the split count); all decode's (`PASS_OPTIONS`; `step_options` picks a step's
            from a set), checked by `check_options`.

    Returns (graph, report): `graph.gm` is the final graph.

    Raises:
        GraphLegalityError, PassVerifyError, PassCheckError: a pass broke the graph
        or missed its expectation (the message names the pass).
        InputError: `$FLINTC_DUMP_DIR` (read when dump_dir is None) names a folder that
        cannot be written (`flintc.fileio.dump_dir_from_env`), or the dump folder holds
        files that are not an earlier dump; `model` or `check_model` is not a
        mode="bf16" FlintModel (the pipelines lower the bf16 numerics; the float64
        oracle has no such graph: it failed inside a pass), or `check_model` has
        another config (`max_position_embeddings` aside) or weight format than
        `model`; `options` that `check_options` refuses (an unknown name, a decode option
        for a prefill step, a value of the wrong type, more attention_splits than
        full-attention cache rows); before the capture.
    """
    _check_step_models(model, check_model)
    options = check_options(options, step, cache_len, model.config)
    if dump_dir is None:
        dump_dir = env_dump_dir(step, batch, tokens)
    elif not dump_dir:  # False (or ""): no dumps
        dump_dir = None
    else:
        from flintc.graph.dump import check_dump_dir

        check_dump_dir(dump_dir, f"dump_dir {dump_dir}", "choose another dump_dir")
    # Source lines on the nodes are for the dumps only; recording them slows tracing.
    graph = capture(model, step, batch=batch, tokens=tokens, cache_len=cache_len,
                    stack_traces=dump_dir is not None)
    fmt = weight_format or _weight_format(model)
    ctx = PassContext(model.config, step, batch, graph.tokens, cache_len, fmt, options)
    checker = NumericChecker(check_model, graph, seed=seed) if check_model is not None else None
    manager = PassManager(pipeline_for(step), ctx, disabled=disabled, checker=checker, dump_dir=dump_dir)
    report = manager.run(graph)
    return graph, report


def _check_step_models(model, check_model) -> None:
    """InputError unless `model` (and `check_model`, when given) are FlintModels in the
    bf16 numerics, of one config and one weight format. A float64 oracle (README's
    `mode="float64"`) failed inside the first fusion pass ("fuse_rms_norm: unfused RMSNorm
    left at rsqrt"), and as check_model inside the numeric check ("Index put requires the
    source and destination dtypes match"); a check_model in the other weight format as a
    bare KeyError of a buffer name. The configs are compared without
    `max_position_embeddings`, which shapes no weight the graph reads (a check_model of a
    longer-context config checks every pass as the model itself does)."""
    import dataclasses

    from flintc.errors import InputError

    for name, m in (("model", model), ("check_model", check_model)):
        if m is None and name == "check_model":
            continue
        mode = getattr(m, "mode", None)
        if mode is None or not hasattr(m, "config"):
            raise InputError(f"compile_step: {name}: expected a flintc.model.reference.FlintModel, "
                             f"got {type(m).__name__}")
        if mode != "bf16":
            raise InputError(f"compile_step: {name} is a FlintModel in mode={mode!r}; the pass pipelines "
                             f"compile (and check against) the bf16 numerics: build it with mode='bf16' "
                             f"(the float64 oracle runs eagerly only, FlintModel(...)(...))")
    if check_model is None:
        return
    if dataclasses.replace(check_model.config, max_position_embeddings=model.config.max_position_embeddings) \
            != model.config:
        raise InputError("compile_step: check_model has another config than model; give a FlintModel of the "
                         "same config and weight format (often model itself)")
    formats = [_weight_format(m) for m in (model, check_model)]
    if formats[0] != formats[1]:
        raise InputError(f"compile_step: check_model holds {formats[1]} weights, model {formats[0]}; give a "
                         "FlintModel of the same config and weight format (often model itself)")


def _weight_format(model) -> str:
    """"nvfp4" when `model` holds packed NVFP4 linears (buffers named *.codes), else "bf16"."""
    return "nvfp4" if any(n.endswith(".codes") for n, _ in model.named_buffers()) else "bf16"
