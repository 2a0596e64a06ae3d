"""`flintc compile`: run the pass pipelines and write a BUILD folder.

BUILD holds (weights are never copied; `build.json` records where they come from):

    build.json        manifest: flintc version, config, weight format and source, weight
                      fingerprint, max batch, max model length, prefill chunk, backend,
                      device, the steps and their kernel implementations
    runtime.py        the generated runtime: one function per step and batch bucket
                      (decode_b1, decode_b2, decode_b4, decode_b8, prefill_t<C>), one line
                      per kernel launch commented with its source graph node
    plan.json         schedule and buffer plan: per step the launches in order (op, node,
                      layer, PDL), static inputs, KV-cache layout, intermediates and bytes
    report.json       the per-pass reports (numeric checks, kernel counts) of every step
    report.md         the same as tables
    dumps/<step>/     pass-by-pass graph dumps (`flintc dump` format), unless disabled or
                      sent elsewhere (BuildOptions.dump_dir)

The folder is written under a temporary name beside BUILD and renamed at the end, so
an interrupted compile leaves no half-written BUILD.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import numbers
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flintc.config import FlintConfig
from flintc.errors import InputError
from flintc.fileio import follow_out_link, temp_dir_beside
from flintc.runtime.codegen import generate_step, module_source

# The format of a build's generated functions, which the runtime calls. A build of another
# version is refused at load (`read_manifest`, naming what changed: `BUILD_VERSION_CHANGES`).
BUILD_VERSION = 2
BUILD_VERSION_CHANGES = {
    2: "prefill functions take logits_rows and compute the LM head for one row per sequence, "
       "returning (logits [B, V], hidden states [B, T, H]) instead of fp32 logits [B, T, V]",
}
DECODE_BUCKETS = (1, 2, 4, 8)
# default tokens per prefill call on CUDA: 8,192-token prefill of the full model on the
# H200 714 / 418 / 373 ms (NVFP4) and 676 / 390 / 339 ms (BF16) with chunks of 512 /
# 2,048 / 4,096 (docs/gpu-runs.md session 17)
CUDA_PREFILL_CHUNK = 4096
MAX_PREFILL_CHUNK = 16384  # tokens per prefill call (its hidden states [C, H]: 64 MiB at full size)


@dataclass
class BuildOptions:
    """What to compile for.

    max_batch: the largest decode batch (buckets 1, 2, 4, 8 up to it, plus max_batch).
        None: 8, as `flintc compile` without --max-batch.
    decode_buckets: the decode batch sizes to compile instead (the largest must be
        max_batch); a batch runs in the smallest bucket that holds it.
    max_model_len: positions per sequence (full-attention cache rows).
    prefill_chunk: tokens per prefill call, at most. None: the largest power of two <=
        min(W, 512), and on CUDA at least `CUDA_PREFILL_CHUNK` (4096) or the largest
        power of two <= max_model_len when that is less. A chunk longer than the sliding
        window W is allowed: every MoE layer then reads its experts' weights once per C
        tokens instead of once per 512 (the grouped GEMMs are weight-bound at 512
        tokens). A padded chunk must not be longer than W (its padding tokens would push
        live tokens out of the ring), so such a build also has a tail function of
        `prefill_tail_chunk` tokens, and one of every power of two between the two
        (`prefill_sizes`): each call takes the longest chunk the tokens left fill (with a
        power-of-two C, the fewest calls), then one padded tail chunk. Such a chunk may not
        be longer than max_model_len (it could never run).
    backend: "triton" (Triton kernels where they exist, reference ops elsewhere; on the
        CPU through Triton's interpreter, slow: for testing kernels), "torch" (reference
        ops only), or "auto" (triton on CUDA when it is installed, else torch).
    device: where the runtime runs ("cpu" or "cuda").
    check: run every pass's numeric check (on a short cache) while compiling.
    dump: write pass-by-pass dumps (False: none, whatever `$FLINTC_DUMP_DIR` says).
    dump_dir: where the dumps go, one subfolder per function (None: BUILD/dumps);
        `flintc run` sends a temporary BUILD's dumps to `$FLINTC_DUMP_DIR` this way.
    attention_splits: split-KV chunks of decode attention (None: from the cache length).
    fold_attention_combine: decode attention and the merge of its splits with the sinks
        in one kernel (`decode_attention_combine`: 6 kernels per MoE layer, 5 per dense
        layer) instead of two; off: slower on the H200 (NVFP4 b1/1K 1.70 -> 1.93 ms,
        docs/gpu-runs.md session 25).
    split_lm_head_norm: decode runs the final RMSNorm as its own kernel (the prefill's
        `rms_norm`), then the plain `lm_head`, instead of `norm_lm_head`, whose every
        program recomputes the norm: one kernel more per forward (344 instead of 343).
        Alone the two are faster (the plain LM head 140.9-144.5 us against 150.9-175.9
        at N = 1-8 on an H200, docs/benchmarks/kernels-2026-12-07-s46-h200.md; the split
        206.4 / 210.5 against 209.2 / 229.0 on an H100, docs/gpu-runs.md session 36);
        on by default since the whole NVFP4 model on an H100 was level at b1 and 0.02 ms
        faster at b8 with it (session 47). False: the fused `norm_lm_head`.
    """

    max_batch: int = 8
    max_model_len: int | None = None
    prefill_chunk: int | None = None
    backend: str = "auto"
    device: str = "cpu"
    check: bool = True
    dump: bool = True
    dump_dir: str | Path | None = None
    attention_splits: int | None = None
    fold_attention_combine: bool = False
    split_lm_head_norm: bool = True
    decode_buckets: tuple[int, ...] | None = None
    extra: dict = field(default_factory=dict)

    def resolve(self, config: FlintConfig) -> "BuildOptions":
        """Fill the defaults from `config` and validate. Raises InputError, also for a
        max_batch, max_model_len, prefill_chunk or decode bucket that is not an integer
        (a bool, a float, a string: `flintc.compile(max_batch=2.0)`)."""
        o = BuildOptions(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        for flag, values in (("--max-batch", [o.max_batch]), ("--max-model-len", [o.max_model_len]),
                             ("--prefill-chunk", [o.prefill_chunk]), ("--buckets", o.decode_buckets or [])):
            for value in values:
                if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                    raise InputError(f"{flag} must be an integer, got {value!r}")
        o.max_batch = int(DECODE_BUCKETS[-1] if o.max_batch is None else o.max_batch)  # NumPy's: a plain int
        if not 1 <= o.max_batch <= 8:
            raise InputError(f"--max-batch must be in 1..8 (the decode schedule's GEMVs), got {o.max_batch}")
        limit = config.max_position_embeddings
        o.max_model_len = int(limit if o.max_model_len is None else o.max_model_len)
        if not 2 <= o.max_model_len <= limit:  # 1: no prompt fits (a prompt needs < max_model_len)
            raise InputError(f"--max-model-len must be in 2..{limit} (a prompt token and one generated; "
                             f"max_position_embeddings), got {o.max_model_len}")
        W = config.sliding_window if "sliding_attention" in config.layer_types else None
        if o.prefill_chunk is None:
            cap = min(W, 512) if W else 512
            o.prefill_chunk = 1 << (cap.bit_length() - 1)
            if str(o.device).startswith("cuda"):  # a prompt of max_model_len fills one
                fits = 1 << (o.max_model_len.bit_length() - 1)
                o.prefill_chunk = max(o.prefill_chunk, min(CUDA_PREFILL_CHUNK, fits))
        o.prefill_chunk = int(o.prefill_chunk)
        if not 1 <= o.prefill_chunk <= MAX_PREFILL_CHUNK:
            raise InputError(f"--prefill-chunk must be in 1..{MAX_PREFILL_CHUNK}, got {o.prefill_chunk}")
        if W and o.prefill_chunk > W and o.prefill_chunk > o.max_model_len:
            # only a chunk of at most W may be padded: this one could never run
            raise InputError(f"--prefill-chunk {o.prefill_chunk} is longer than the sliding window ({W}) "
                             f"and than --max-model-len ({o.max_model_len}): no prompt fills such a chunk; "
                             f"use at most {o.max_model_len}")
        if o.decode_buckets:
            b = sorted(set(int(n) for n in o.decode_buckets))
            if b[0] < 1 or b[-1] != o.max_batch:
                # what was typed (flintc.cli.args.Buckets.text), not the sorted sizes
                text = getattr(o.decode_buckets, "text", None) or ",".join(map(str, o.decode_buckets))
                raise InputError(f"--buckets {text!r}: each must be >= 1 and the largest must equal --max-batch "
                                 f"({o.max_batch})")
        if o.backend == "auto":
            # Triton kernels on a GPU; on a CPU Triton only has its interpreter (seconds per
            # kernel launch), so the reference ops run instead.
            o.backend = "torch"
            if str(o.device).startswith("cuda"):
                try:
                    import triton  # noqa: F401
                    o.backend = "triton"
                except ImportError:
                    pass
        if o.backend not in ("torch", "triton"):
            raise InputError(f"--backend must be auto, torch or triton, got {o.backend!r}")
        return o

    @property
    def buckets(self) -> list[int]:
        if self.decode_buckets:
            return sorted(set(int(n) for n in self.decode_buckets))
        b = [n for n in DECODE_BUCKETS if n <= self.max_batch]
        return b if self.max_batch in b else b + [self.max_batch]

    def prefill_tail_chunk(self, config: FlintConfig) -> int:
        """Tokens per call of the tail prefill function: `prefill_chunk` when it is at
        most the sliding window W (or the model has no sliding layer), else the largest
        power of two <= min(W, 512). Call on resolved options."""
        W = config.sliding_window if "sliding_attention" in config.layer_types else None
        if not W or self.prefill_chunk <= W:
            return self.prefill_chunk
        cap = min(W, 512)
        return 1 << (cap.bit_length() - 1)

    def prefill_sizes(self, config: FlintConfig) -> list[int]:
        """Tokens per call of each prefill function, longest first: `prefill_chunk`; when
        that is longer than the tail chunk, also every power of two strictly between the
        two, then `prefill_tail_chunk`. E.g. [4096, 2048, 1024, 512] for the full model
        on CUDA; a 6,000-token prompt then runs as 4,096 + 1,024 + 512 + 368 (padded to
        512) tokens instead of 2 x 2,048 + 4 x 512 with chunks of 2,048 and a 512 tail
        (each MoE layer reads all its experts' weights once per chunk). Call on resolved
        options."""
        C, tail = self.prefill_chunk, self.prefill_tail_chunk(config)
        if C == tail:
            return [C]
        mids = [1 << e for e in range(C.bit_length() - 1, tail.bit_length() - 1, -1) if tail < 1 << e < C]
        return [C] + mids + [tail]

    @property
    def cache_rows(self) -> int:
        """Rows of a full-attention cache: max_model_len plus one prefill chunk (a padded
        last chunk writes a few rows past the prompt; decode overwrites them)."""
        return self.max_model_len + self.prefill_chunk


def weight_fingerprint(weights: dict, fmt: str, source: str = "") -> str:
    """sha256 over each weight's name, dtype, shape and the bytes of its first and last
    4096 elements: cheap (no full pass over 80 GB), and it tells two checkpoints apart.

    Dummy weights (`source` "dummy:<fmt>") are identified by their recipe instead: seed 0
    on whatever device the runtime uses, so a build compiled against dummy weights on the
    meta device (a cross-compile, no GPU needed) loads against dummy weights on the GPU."""
    from flintc.quant.nvfp4 import NVFP4Tensor

    if source.startswith("dummy:"):
        return hashlib.sha256(f"{source}|seed=0|{fmt}".encode()).hexdigest()
    h = hashlib.sha256(fmt.encode())
    for name in sorted(weights):
        w = weights[name]
        if isinstance(w, NVFP4Tensor) and w.origin is not None:
            parts = w.origin  # converted to the mma layout: the packed tensors' samples
        else:
            parts = fingerprint_parts(w)
        for dtype, shape, sample in parts:
            h.update(f"{name}|{dtype}|{shape}".encode())
            h.update(sample)
    return h.hexdigest()


def fingerprint_parts(w) -> tuple[tuple[str, tuple, bytes], ...]:
    """(dtype, shape, sampled bytes) of each tensor of a weight (a tensor, or an
    NVFP4Tensor's codes, scales and global scale), as `weight_fingerprint` hashes them:
    the first and last 4096 elements (nothing for meta tensors)."""
    from flintc.quant.nvfp4 import NVFP4Tensor

    out = []
    for t in [w.codes, w.scales, w.global_scale] if isinstance(w, NVFP4Tensor) else [w]:
        sample = b""
        if t.device.type != "meta":
            flat = t.reshape(-1)
            pick = torch.cat([flat[:4096], flat[-4096:]]) if flat.numel() > 8192 else flat
            sample = pick.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        out.append((str(t.dtype), tuple(t.shape), sample))
    return tuple(out)


def config_fingerprint(config: FlintConfig) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()


def traced_cache_rows(opts: BuildOptions, config: FlintConfig) -> int:
    """Cache rows a build's functions are traced (and checked) at, `opts` resolved: long
    enough to wrap the sliding ring and hold a prefill chunk, and an odd number no model
    dimension equals, so a graph whose tensors depend on the cache length can be
    recognised (`_depends_on_rows`; such a function is retraced at `opts.cache_rows`);
    at most `opts.cache_rows`. When it equals `opts.cache_rows`, every function is traced
    at the build's full cache length and the build's caches cannot be resized (`flintc
    bench`'s resizable caches need it below)."""
    n = config.sliding_window + 2 * opts.prefill_chunk + 3
    n = n if n % 2 else n + 1
    return min(n, opts.cache_rows)


def _depends_on_rows(gm, rows: int) -> bool:
    """True when a non-cache tensor of the graph has a dimension of `rows` (a mask or a
    gathered copy of the full cache): then the graph is only valid for that length."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor) and rows in tuple(v.shape):
                return True
    return False


def build_steps(options: "BuildOptions", config) -> list[tuple[str, int, int]]:
    """(step, batch, tokens) of every function `compile_model` compiles, in its order:
    the decode buckets, then the prefill sizes (batch 1). `options` is resolved against
    `config` here (InputError for bad options)."""
    return _steps(options.resolve(config), config)


def _steps(opts, config) -> list[tuple[str, int, int]]:
    return [("decode", b, 1) for b in opts.buckets] + [("prefill", 1, c) for c in opts.prefill_sizes(config)]


def function_names(options: "BuildOptions", config) -> list[str]:
    """The names of a BUILD's functions (`decode_b1`, ..., `prefill_t512`), which are also
    the subfolders its pass-by-pass dumps go to."""
    from flintc.passes.pipeline import step_name

    return [step_name(*s) for s in build_steps(options, config)]


def compile_model(ckpt, out: str | os.PathLike, options: BuildOptions, progress: bool = True,
                  log=print) -> dict:
    """Compile the decode buckets and the prefill step of `ckpt` into the BUILD folder `out`.

    Args:
        ckpt: a LoadedCheckpoint (`flintc.checkpoint.loader.load_checkpoint`), its
            weights on the device the runtime will use.
        out: the BUILD folder; replaced if it holds an earlier build and nothing else
            (`check_out_replaceable`), refused if it exists and holds anything else,
            or if it holds the checkpoint, its tokenizer or its config.json.
        options: BuildOptions (resolved here against the checkpoint's config).
        progress: show a progress bar over the steps.

    Returns the manifest (build.json's content).

    Raises:
        InputError: bad options, or `out` exists and is not a flintc build, or is
            one that also holds files a compile does not write, or `out` is or holds
            the checkpoint, its tokenizer folder or its config.json
            (`check_inputs_outside`), or its parent is missing, not a folder or one where no file can be created, or a
            function's subfolder of `options.dump_dir` holds files that are not an
            earlier dump; before the first compile.
        PassCheckError: a pass missed its numeric expectation (nothing is written, its
            dumps neither: unlike `flintc dump`'s, they would have to go into `out`, which
            is no BUILD then and may hold a working one; `flintc dump` shows the step).
        KeyboardInterrupt / Terminated: SIGINT or SIGTERM. `out` is then either the
            earlier build untouched or, when the signal came while the new build was
            being moved into place (`flintc.fileio.move_into_place` defers it), the
            complete new build (logged); never a mix, never none.
    """
    from flintc.model.reference import FlintModel
    from flintc.passes.pipeline import compile_step, step_name, step_options
    from flintc.runtime.kernels import KernelTable

    config = ckpt.config
    opts = options.resolve(config)
    on_meta = ckpt.weights["model.embed_tokens.weight"].device.type == "meta"
    if on_meta and opts.check:
        raise InputError("weights on the meta device (a cross-compile) cannot be checked numerically; "
                         "pass --no-check")
    out = check_build_out(out, checkpoint_inputs(ckpt))  # the weights the new build would point to too
    _check_parent(out)
    steps = _steps(opts, config)
    if opts.dump and opts.dump_dir:  # every step's subfolder refused before the first compile
        from flintc.graph.dump import check_dump_dir

        for step, batch, tokens in steps:
            sub = Path(opts.dump_dir) / step_name(step, batch, tokens)
            check_dump_dir(sub, f"dump_dir {sub}", "choose another dump_dir")
    t_start = time.perf_counter()
    model = FlintModel(config, ckpt.weights, max_positions=opts.cache_rows)
    check_len = traced_cache_rows(opts, config)
    sources, reports, plan_steps = [], [], {}
    tmp = temp_dir_beside(out)  # (and removes those a killed compile left)
    try:
        bar = _progress(steps, progress)
        for step, batch, tokens in bar:
            name = step_name(step, batch, tokens)
            if hasattr(bar, "set_description"):
                bar.set_description(f"compile {name}")
            opts_step = {"full_attention_rows": opts.cache_rows}
            if opts.attention_splits:
                opts_step["attention_splits"] = opts.attention_splits
            if opts.fold_attention_combine:
                opts_step["fold_attention_combine"] = True
            opts_step["split_lm_head_norm"] = bool(opts.split_lm_head_norm)
            # only the options a pass of this step reads: a prefill's dumps recorded the
            # decode schedule's (report.json), which its pipeline never used
            opts_step = step_options(step, opts_step)
            dump_dir = False  # no dumps, not even into $FLINTC_DUMP_DIR
            if opts.dump:
                dump_dir = (Path(opts.dump_dir) if opts.dump_dir else tmp / "dumps") / name
            rows = check_len
            graph, report = compile_step(model, step, batch=batch, tokens=tokens, cache_len=rows,
                                         check_model=model if opts.check else None,
                                         dump_dir=dump_dir, options=opts_step)
            if rows != opts.cache_rows and _depends_on_rows(graph.gm, rows):
                # This step's final graph is specialised to its cache length: recapture at
                # the runtime's length (checks already ran on the short one).
                log(f"{name}: the graph depends on the cache length; recompiling for "
                    f"{opts.cache_rows} rows without checks (checked above at {rows})")
                graph, _ = compile_step(model, step, batch=batch, tokens=tokens,
                                        cache_len=opts.cache_rows, dump_dir=False, options=opts_step)
                rows = opts.cache_rows
            table = KernelTable(opts.backend, step)
            if step == "prefill":
                doc = (f"prefill, batch {batch}, {tokens} token(s) per sequence: input_ids, positions int64 "
                       f"[{batch}, {tokens}]; slots int64 [{batch}]; logits_rows int64 [{batch}] (rows of the "
                       f"{batch * tokens} tokens, b*{tokens} + t). Returns (fp32 logits [{batch}, "
                       f"{config.vocab_size}] of logits_rows, final-normed hidden states bf16 [{batch}, {tokens}, "
                       f"{config.hidden_size}]). Cache rows traced: {rows}.")
            else:
                doc = (f"{step}, batch {batch}, {tokens} token(s) per sequence: input_ids, positions int64 "
                       f"[{batch}, {tokens}]; slots int64 [{batch}]. Returns fp32 logits [{batch}, {tokens}, "
                       f"{config.vocab_size}]. Cache rows traced: {rows}.")
            src = generate_step(graph.gm, name, graph.buffer_names, doc, pdl=(step == "decode"),
                                free=(step == "prefill"))
            sources.append(src)
            reports.append({"function": name, **report.as_dict()})
            plan_steps[name] = {
                "step": step, "batch": batch, "tokens": tokens, "traced_cache_rows": rows,
                "kernels": src.kernels, "launches": src.launches,
                "implementations": table.implementations(
                    [l["op"] for l in src.launches if not l["op"].startswith("aten.")]),
                "weights": src.weights,
                "intermediates": src.intermediates,
                "intermediate_bytes": sum(i["bytes"] for i in src.intermediates),
                "report_passed": report.passed,
            }
        manifest = _manifest(ckpt, opts, plan_steps, time.perf_counter() - t_start)
        plan = {"steps": plan_steps, "kv_cache": _kv_layout(config, opts)}
        source = str(ckpt.source)
        if not source.isprintable():  # a line break in the path would end the comment: escaped, quoted
            source = repr(source)
        header = (f"# Generated by flintc compile on {time.strftime('%Y-%m-%d %H:%M:%S')} -- do not edit.\n"
                  f"# Model: {source} ({ckpt.fmt}), config sha256 {manifest['config_sha256'][:16]}.\n"
                  f"# Backend {opts.backend}, device {opts.device}; kernel implementations in plan.json.\n"
                  "# One function per step and batch bucket; one line per op call, commented with the\n"
                  "# kernels it launches (numbered; prefill_attention_kv launches two).\n")
        from flintc.fileio import move_into_place, naming_write_errors

        for name, text in (("runtime.py", module_source(sources, header)),
                           ("plan.json", json.dumps(plan, indent=1)),
                           ("report.json", json.dumps(reports, indent=1)),
                           ("report.md", _report_md(reports, plan_steps)),
                           ("build.json", json.dumps(manifest, indent=1))):
            with naming_write_errors(tmp / name):  # named as --out below (final_output_error)
                (tmp / name).write_text(text)

        move_into_place(tmp, out, log=log)  # SIGINT/SIGTERM deferred until `out` is whole (logged)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # only the temporary folder, never `out`
        from flintc.fileio import final_output_error

        renamed = final_output_error(exc, tmp, out)  # a full disk names --out, not the hidden folder
        if renamed is not None:
            raise renamed from exc
        raise
    return manifest


# What a BUILD folder holds (module doc): the files `compile_model` writes, its dumps/,
# and the __pycache__/ that importing runtime.py (`flintc run --build`) leaves. An
# earlier build holding anything else is not replaced (`check_out_replaceable`).
BUILD_ENTRIES = ("build.json", "runtime.py", "plan.json", "report.json", "report.md", "dumps", "__pycache__")


def foreign_build_entries(folder: Path) -> list[str]:
    """The entries of the BUILD `folder` that no compile writes, as paths relative to it,
    sorted, a folder's with a trailing slash (a user's notes, a checkpoint copied into
    it): replacing the build would delete them. At the top, anything not in
    `BUILD_ENTRIES`; in dumps/, anything but one dump folder per function holding only
    what a dump writes (`flintc.graph.dump.foreign_dump_files`); in __pycache__/,
    anything but compiled Python (`*.pyc`)."""
    from flintc.graph.dump import foreign_dump_files

    def name(p: Path) -> str:
        return p.name + ("/" if p.is_dir() and not p.is_symlink() else "")

    out = []
    for p in folder.iterdir():
        if p.name not in BUILD_ENTRIES:
            out.append(name(p))
        elif p.is_symlink() or not p.is_dir():
            if p.name in ("dumps", "__pycache__"):
                out.append(p.name)  # a file or a link where a compile writes a folder
        elif p.name == "dumps":
            for d in p.iterdir():
                if d.is_dir() and not d.is_symlink():
                    out += [f"dumps/{d.name}/{f}" for f in foreign_dump_files(d, targets=False)]
                else:
                    out.append(f"dumps/{d.name}")
        elif p.name == "__pycache__":
            out += [f"__pycache__/{name(c)}" for c in p.iterdir() if c.suffix != ".pyc" or not c.is_file()]
    return sorted(out)


def check_out_replaceable(out: Path) -> None:
    """`out` may be written: it does not exist, is an empty folder (taken as a fresh one,
    as make-checkpoint does), or holds an earlier build (build.json) and nothing but
    what a compile writes (`BUILD_ENTRIES`): the compile replaces the folder whole.
    Raises InputError naming `out` otherwise: a file, a folder of other files (no
    build.json), or a build that also holds other entries (naming the first few:
    `foreign_build_entries`), before any work."""
    if not out.exists():
        return
    if (out / "build.json").is_file():
        foreign = foreign_build_entries(out)
        if foreign:
            from flintc.fileio import would_delete

            raise InputError(f"{out} is a flintc build but also holds {would_delete(foreign, 'compile')}")
        return
    if out.is_dir() and not any(out.iterdir()):
        return
    raise InputError(f"{out} exists and is not a flintc build (no build.json); choose another --out")


def check_build_out(out: str | os.PathLike, inputs) -> Path:
    """The BUILD folder a compile may replace whole, checked before any work: `out`, or
    the folder it links to (`flintc.fileio.follow_out_link`: that build is replaced, the
    link kept), holding none of `inputs` (`check_inputs_outside`) and nothing but an
    earlier build (`check_out_replaceable`). `flintc compile` and `flintc.compile()` call
    it before the checkpoint is read, `compile_model` again with the checkpoint's own
    files. -> the folder to write. Raises InputError as those two."""
    check_inputs_outside(out, inputs)
    out = follow_out_link(out)
    check_out_replaceable(out)
    return out


def check_inputs_outside(out: str | os.PathLike, inputs, flag: str = "--out") -> None:
    """Refuse to compile into `out` (the BUILD folder, which the compile replaces whole)
    when one of `inputs`, (label, path or None) pairs such as ("MODEL", checkpoint),
    ("--tokenizer", folder), is `out` itself or lies inside it at any depth, symbolic
    links resolved or not (`flintc.fileio.lies_inside`): the compile would delete the
    weights the new build.json points to. Raises InputError naming the input, `out`
    and `flag`, before any work."""
    from flintc.fileio import lies_inside

    for label, path in inputs:
        if path is None or not os.path.lexists(path) or not lies_inside(path, out):
            continue
        where = "is" if lies_inside(out, path) else "lies inside"
        raise InputError(f"{label} {path}: {where} {flag} {out}, which the compile replaces whole, deleting it; "
                         f"choose an {flag} that does not hold the compile's inputs (or move them out of it)")


def checkpoint_inputs(ckpt) -> list[tuple[str, object]]:
    """The files and folders a compile of `ckpt` reads and the build refers to: its
    weights (`source`, unless dummy), its tokenizer folder and its config.json, as
    (label, path) pairs for `check_inputs_outside`."""
    config_source = getattr(ckpt.config, "source", None)
    return [("MODEL", None if str(ckpt.source).startswith("dummy:") else str(ckpt.source)),
            ("the tokenizer folder", ckpt.tokenizer_dir),
            ("the config", config_source if isinstance(config_source, str) and os.path.exists(config_source)
             else None)]


def _check_parent(out: Path) -> None:
    """The BUILD folder is written beside `out` and renamed into place: its parent must
    exist and be a folder a file can be created in (`flintc.fileio.cannot_write_in`'s
    probe, which also sees what permission bits do not tell root: /proc, a read-only
    file system; the temporary folder's creation failed there as a bare "[Errno 2] No
    such file or directory: '/proc/.x.PID.XXXXXXXX'"). Checked before any compile work.
    Raises InputError naming `out`, the parent and why (`flintc.fileio.output_parent_problem`)."""
    from flintc import fileio

    problem = fileio.output_parent_problem(out.parent)
    if problem:
        raise InputError(f"--out {out}: {problem}")


def _progress(steps, enabled: bool):
    if not enabled:
        return steps
    from tqdm import tqdm

    return tqdm(steps, unit="step", leave=False)


def _kv_layout(config: FlintConfig, opts: BuildOptions) -> dict:
    """The plan's kv_cache entry: the caches `FlintModel.new_kv_cache(max_batch,
    cache_rows)` allocates for the compiled runner (shapes from `kv_cache_shapes`),
    bf16, with each layer's K + V bytes and their total."""
    from flintc.model.reference import kv_cache_shapes

    slots = opts.max_batch
    shapes = kv_cache_shapes(config, slots, opts.cache_rows)
    itemsize = torch.bfloat16.itemsize
    per_layer = []
    total = 0
    for i in range(config.num_hidden_layers):
        sliding = config.is_sliding_layer(i)
        shape_k, shape_v = shapes[2 * i], shapes[2 * i + 1]
        nbytes = (math.prod(shape_k) + math.prod(shape_v)) * itemsize
        total += nbytes
        per_layer.append({"layer": i, "kind": "sliding ring" if sliding else "full", "shape_k": list(shape_k),
                          "shape_v": list(shape_v), "dtype": "torch.bfloat16", "bytes": nbytes})
    return {"slots": slots, "layers": per_layer, "bytes": total,
            "note": "one slot per sequence; padding rows of a decode bucket carry a negative slot "
                    "(flintc.ops.attention.pad_slot) and neither read nor write the cache"}


# What decides a build's graphs: the reference model traced (not its generate loop), the
# capture, the passes and the ops they emit, and the code generator (files, or folders of
# *.py, relative to the package).
COMPILER_SOURCES = ("model/reference.py", "model/ops.py", "model/weights.py", "graph", "passes",
                    "ops", "runtime/codegen.py")


@functools.lru_cache(maxsize=None)
def compiler_fingerprint() -> str:
    """sha256 of the compiler's sources (`COMPILER_SOURCES`: path and bytes of each file,
    in sorted order), computed once per process. Two flintc trees with the same value
    compile the same graphs from the same model; build.json records it
    ("compiler_sha256"), and loading a build compiled by other compiler code warns
    (`StaleBuildWarning`), as a torch.compile cache keys on a hash of its code."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in COMPILER_SOURCES:
        path = root / rel
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(str(f.relative_to(root)).encode() + b"\0")
            h.update(f.read_bytes() + b"\0")
    return h.hexdigest()


def _manifest(ckpt, opts: BuildOptions, plan_steps: dict, seconds: float) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("flintc")
    except PackageNotFoundError:
        ver = "unknown"
    source = ckpt.source
    if not source.startswith("dummy:"):
        source = str(Path(source).resolve())
    return {
        "build_version": BUILD_VERSION, "flintc_version": ver, "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "compile_seconds": round(seconds, 2),
        "config": ckpt.config.to_dict(), "config_sha256": config_fingerprint(ckpt.config),
        "weight_format": ckpt.fmt, "weight_source": source,
        "tokenizer_dir": str(Path(ckpt.tokenizer_dir).resolve()) if ckpt.tokenizer_dir else None,
        "weight_sha256": weight_fingerprint(ckpt.weights, ckpt.fmt, ckpt.source),
        "max_batch": opts.max_batch, "max_model_len": opts.max_model_len,
        "prefill_chunk": opts.prefill_chunk,
        "prefill_tail_chunk": opts.prefill_tail_chunk(ckpt.config),
        "prefill_sizes": opts.prefill_sizes(ckpt.config), "cache_rows": opts.cache_rows,
        "backend": opts.backend, "device": opts.device, "checked": opts.check,
        "buckets": opts.buckets, "fold_attention_combine": bool(opts.fold_attention_combine),
        "split_lm_head_norm": bool(opts.split_lm_head_norm),
        "compiler_sha256": compiler_fingerprint(),
        "functions": {name: {"step": s["step"], "batch": s["batch"], "tokens": s["tokens"],
                             "kernels": s["kernels"]} for name, s in plan_steps.items()},
    }


def _report_md(reports: list[dict], plan_steps: dict) -> str:
    lines = ["# Compile report", ""]
    if not any(s.get("check") for r in reports for s in r["stages"]):
        lines += ["Numeric checks: **off** (`--no-check` / `check=False`): no pass was checked "
                  "against the graph before it.", ""]
    lines += ["| function | kernels per call | passes checked | all passed |", "|---|---|---|---|"]
    for r in reports:
        checked = sum(1 for s in r["stages"] if s.get("check"))
        verdict = ("yes" if r["passed"] else "NO") if checked else "not checked"
        lines.append(f"| {r['function']} | {plan_steps[r['function']]['kernels']} | {checked} | {verdict} |")
    for r in reports:
        lines += ["", f"## {r['function']}", "",
                  "| # | pass | kernels/fwd | expected | ok | max_abs | differing |", "|---|---|---|---|---|---|---|"]
        for s in r["stages"]:
            c = s.get("check") or {}
            lines.append(f"| {s['index']} | {s['name']} | {s['kernels_per_forward']} | {c.get('expected', '-')} | "
                         f"{('yes' if c.get('passed') else 'NO') if c else '-'} | "
                         f"{c.get('max_abs', '-') if c else '-'} | {c.get('share_differing', '-') if c else '-'} |")
        impl = plan_steps[r["function"]]["implementations"]
        lines += ["", "Kernel implementations: " + ", ".join(f"`{k}`: {v}" for k, v in impl.items())]
    return "\n".join(lines) + "\n"
