"""`flintc bench`: measure flintc and its baselines side by side in one run.

`run_bench(options)` does, in this order, writing `bench.json` after each format so a
run cut short by a time limit still leaves its numbers:

1. the ceilings: copy bandwidth and bf16 matmul rate (`flintc.bench.timing`);
2. per weight format: the weights (dummy weights are made on the device, once per
   format, and shared by every build and baseline), the builds that cover the asked
   points (`--builds`; a missing one is compiled, with a warning about time; each point
   runs on the covering build that needs the least KV-cache memory for it, or, when that
   build has no room for it in the free device memory, on the next one), then per
   build: its KV caches filled with random bf16 up to the largest context it serves,
   and for each (batch, context) point the decode step timed forward only (CUDA-graph
   replays, device events) and end to end (`runner.decode` + sampling + the token read
   on the host), the distinct experts the step selected (`record_step`), the roofline,
   the kernel count and peak memory; prefill at each length; the per-kernel breakdown;
   the eager baseline on views of the same caches;
3. the compile baselines ("compile", and "fast" when asked: torch.compile of the fast
   plain-PyTorch model, `flintc.bench.fast_model`) and the eager one when flintc is not
   run, each on caches of its own.

Decode at context C means the step of the token at position C - 1 over a cache holding
C - 1 earlier tokens (C keys read per full layer): the KV rows hold random values, not
a prefill's output, which changes no timing (no kernel branches on values) and saves a
262K-token prefill. Inputs are rotated over `rotations` sets (token ids, and slots over
the build's sequence slots) so neither L2 nor the expert selection repeats a step.
"""

from __future__ import annotations

import fnmatch
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flintc.errors import InputError, listing
from flintc.fileio import write_text_atomic

TARGET_COMPILE_POINTS = ((1, 1024), (1, 100000), (8, 1024))
COMPILED_BASELINES = ("compile", "fast")  # torch.compile of the reference model / of FastFlintModel
DEFAULT_CONTEXTS = (1024, 8192, 32768, 100000, 262144)
DEFAULT_PREFILL = (1024, 8192)
# the kinds of a flintc point (kind, batch, context), in the order a build measures them,
# and how notes name them
_KINDS = {"decode": "decode", "prefill": "prefill", "eager": "eager baseline"}


@dataclass
class BenchOptions:
    """What `flintc bench` measures (see `flintc bench --help` for each field)."""

    out: Path
    model: str | None = None
    load_format: str = "dummy"
    config: str | None = "full"
    hf_config_path: str | None = None
    formats: list[str] = field(default_factory=lambda: ["bf16", "nvfp4"])
    contexts: list[int] | None = None  # None: DEFAULT_CONTEXTS up to the config's max_position_embeddings
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    prefill: list[int] | None = None  # None: DEFAULT_PREFILL, likewise
    baselines: list[str] = field(default_factory=lambda: ["eager", "compile"])
    baseline_points: list[tuple[int, int]] | None = None
    builds: Path | None = None
    build_globs: list[str] | None = None
    backend: str | None = None
    device: str = "cuda"
    warmup: int | None = None
    iters: int | None = None
    e2e_iters: int | None = None
    prefill_iters: int | None = None
    rotations: int | None = None
    breakdown: list[tuple[int, int]] | None = None
    time_budget: float | None = None
    step_timeout: float | None = None
    run_flintc: bool = True
    compile_missing: bool = True
    max_model_len: int | None = None
    sampling: str = "default"
    size_caches: bool = True
    plots: bool = True
    command: str = ""
    cut_defaults: list[str] = field(default_factory=list)  # set by resolved(): notes for the report

    def resolved(self) -> "BenchOptions":
        """Defaults that depend on the device; validation. Raises InputError naming the
        option: a count or size out of range (--iters, ... below 1; --max-model-len below
        2, above the config's max_position_embeddings or, when bench would compile a build
        at it (flintc measured, no --no-compile, no build of a format in --builds that bench
        can use: `_formats_to_compile`), below the longest --contexts / --prefill point with
        --build-caches, or too short to resize its caches to that point without
        (`_check_resizable`)), a --time-budget or --step-timeout that is not a positive number
        of seconds, a --time-budget not above the seconds kept for writing the outputs
        (`_Clock.RESERVE_S`), a --build-glob that is malformed or names no build
        (`_check_build_globs`), a --breakdown point that is not one of the decode points
        measured, an unknown name, a missing MODEL or --hf-config-path, --hf-config-path
        without MODEL, an unknown --config preset, or weights (of --config or MODEL) that the CPU has not
        the memory for (`flintc.runtime.device.check_weights_fit`), a --contexts or --prefill
        value over the config's max_position_embeddings (the defaults, DEFAULT_CONTEXTS and
        DEFAULT_PREFILL, are cut there instead, with a note in `cut_defaults`; contexts to
        [max_position_embeddings] when it is below them all); MODEL is checked by `_check_model`
        (CheckpointError / ConfigError for one that is no checkpoint)."""
        o = BenchOptions(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        defaults = {name for name in ("contexts", "prefill") if getattr(o, name) is None}
        o.contexts = list(DEFAULT_CONTEXTS) if o.contexts is None else o.contexts
        o.prefill = list(DEFAULT_PREFILL) if o.prefill is None else o.prefill
        cuda = o.device.startswith("cuda")
        o.warmup = 10 if o.warmup is None and cuda else (1 if o.warmup is None else o.warmup)
        o.iters = 100 if o.iters is None and cuda else (2 if o.iters is None else o.iters)
        o.e2e_iters = (50 if cuda else 2) if o.e2e_iters is None else o.e2e_iters
        o.prefill_iters = (5 if cuda else 1) if o.prefill_iters is None else o.prefill_iters
        o.rotations = (8 if cuda else 2) if o.rotations is None else o.rotations
        for name in ("iters", "e2e_iters", "prefill_iters", "rotations"):
            if getattr(o, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(o, name)}")
        if o.warmup < 0:
            raise InputError(f"--warmup must be >= 0, got {o.warmup}")
        if o.max_model_len is not None and o.max_model_len < 2:  # 0 used to mean the default
            # flintc compile's bound (a prompt token and one generated): 1 passed here and
            # failed in the compile, after the ceilings and the report were written
            raise InputError(f"--max-model-len must be >= 2 (a prompt token and one generated), got "
                             f"{o.max_model_len} (leave it out for the longest --contexts / --prefill point)")
        for flag, seconds in (("--time-budget", o.time_budget), ("--step-timeout", o.step_timeout)):
            # 0 used to mean no limit, a negative budget skipped every point
            if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
                raise InputError(f"{flag} must be a positive number of seconds, got {seconds:g} (leave it out "
                                 "for no limit)")
        if o.time_budget is not None and o.time_budget <= _Clock.RESERVE_S:
            # the last RESERVE_S seconds are kept for writing the outputs: a smaller budget
            # measured nothing, each format "skipped, the time budget is spent", exit 0
            raise InputError(f"--time-budget must be more than {_Clock.RESERVE_S:g} s (the time kept for "
                             f"writing the outputs), got {o.time_budget:g} (leave it out for no limit)")
        for f in o.formats:
            if f not in ("bf16", "nvfp4"):
                raise InputError(f"--formats: unknown format {f!r} (expected bf16, nvfp4)")
        for b in o.baselines:
            if b not in ("eager", "compile", "fast"):
                raise InputError(f"--baselines: unknown baseline {b!r} (expected eager, compile, fast)")
        for flag, values in (("--contexts", o.contexts), ("--batches", o.batches), ("--prefill", o.prefill)):
            bad = [v for v in values if v < 1]
            if bad:
                raise InputError(f"{flag}: each must be a positive integer, got {bad[0]}")
        if any(b > 8 for b in o.batches):
            raise InputError(f"--batches: flintc decodes at most 8 sequences at once, got {max(o.batches)}")
        if o.sampling not in ("default", "greedy"):
            raise InputError(f"--sampling must be default or greedy, got {o.sampling!r}")
        if o.load_format not in ("auto", "dummy"):
            raise InputError(f"--load-format must be auto or dummy, got {o.load_format!r}")
        if o.model is not None and not Path(o.model).exists():
            raise InputError(f"MODEL {o.model}: no such checkpoint file or folder")
        if o.model is None and o.load_format != "dummy":
            raise InputError("--load-format auto needs a MODEL (a BF16 folder or an NVFP4 .gguf)")
        if o.hf_config_path is not None and not Path(o.hf_config_path).exists():
            raise InputError(f"--hf-config-path {o.hf_config_path}: no such file or folder")
        if o.model is None and o.hf_config_path is not None:  # it was ignored silently (as verify refuses it)
            raise InputError(f"--hf-config-path {o.hf_config_path} applies only with a MODEL (the config of a .gguf "
                             "file); without one, the random weights take their config from --config")
        config = None
        if o.model is not None:
            config = _check_model(o)
        if o.model is None and o.config is not None:
            from flintc.config import FlintConfig
            from flintc.errors import ConfigError

            try:
                config = FlintConfig.preset(o.config)
            except ConfigError as e:
                raise InputError(f"--config {o.config}: {e}") from None
        if config is not None:  # no build serves a longer context: each point was skipped, after minutes
            longest = config.max_position_embeddings
            for name in sorted(defaults):
                values = getattr(o, name)
                kept = [v for v in values if v <= longest]
                kept = kept if kept or name == "prefill" else [longest]
                if kept != values:
                    o.cut_defaults.append(
                        f"--{name}: the default {','.join(map(str, values))} cut to "
                        f"{','.join(map(str, kept)) or 'none'}, what the model serves (max_position_embeddings "
                        f"{longest})")
                setattr(o, name, kept)
            source = (f"--hf-config-path {o.hf_config_path}" if o.hf_config_path is not None else
                      f"MODEL {o.model}'s config" if o.model is not None else f"the {o.config} config")
            for flag, values in (("--contexts", o.contexts), ("--prefill", o.prefill)):
                over = [v for v in values if v > longest]
                if over:
                    raise InputError(f"{flag}: {max(over)} tokens is more than the model serves "
                                     f"(max_position_embeddings {longest} in {source}); pass values up to "
                                     f"{longest}")
            if o.max_model_len is not None and o.max_model_len > longest:  # flintc compile refuses it
                raise InputError(f"--max-model-len {o.max_model_len} is more than the model serves "
                                 f"(max_position_embeddings {longest} in {source}); pass at most {longest}")
        o.contexts, o.batches, o.prefill = sorted(set(o.contexts)), sorted(set(o.batches)), sorted(set(o.prefill))
        if o.builds is None:
            o.builds = Path(o.out) / "builds"
        points = o.contexts + o.prefill
        # --max-model-len is the length of a build compiled here: the two checks below apply
        # only when one would be compiled, not when --builds holds a build of every format that
        # bench uses (it compiles none then; they refused such runs)
        short = (o.max_model_len is not None and points and o.max_model_len < max(points) and o.run_flintc
                 and o.compile_missing)
        compiled = (list(o.formats) if config is None else _formats_to_compile(o, config)) if short else []
        if compiled and not o.size_caches:
            # with --build-caches a build compiled here keeps the caches it was compiled with,
            # so it must hold the longest point (it used to compile one that did not, then skip
            # the point after the measurements began); by default its caches are sized to the
            # points it serves, and a shorter build still measures them
            flag = "--contexts" if max(points) in o.contexts else "--prefill"
            given = ", the default" if flag[2:] in defaults else ""
            raise InputError(f"--max-model-len {o.max_model_len} is shorter than the longest point measured "
                             f"({flag} {max(points)}{given}) and --build-caches keeps a build's caches at its "
                             f"max model len; pass --max-model-len >= {max(points)}, leave it out (the longest "
                             "point), or drop --build-caches")
        if compiled and o.size_caches and config is not None:
            _check_resizable(o, config, points, defaults, compiled)
        if o.breakdown:  # a breakdown is taken at a measured decode point: others were skipped silently
            if not o.run_flintc:
                raise InputError("--breakdown applies only when flintc is measured; drop --no-flintc (or "
                                 "--breakdown)")
            for batch, context in o.breakdown:
                if batch not in o.batches or context not in o.contexts:
                    raise InputError(f"--breakdown {batch}x{context}: not a decode point this run measures; "
                                     f"expected BATCHxCONTEXT with BATCH in --batches "
                                     f"({','.join(map(str, o.batches))}) and CONTEXT in --contexts "
                                     f"({','.join(map(str, o.contexts))})")
        if o.model is None and o.config is not None and o.device.startswith("cpu"):
            # the weights of --config on a CPU without the memory (the default config is full):
            # refused now, not killed (out of memory) after the ceilings are written
            from flintc.config import FlintConfig
            from flintc.runtime.device import check_weights_fit

            for fmt in o.formats:
                check_weights_fit(FlintConfig.preset(o.config), fmt, o.device)
        if o.build_globs is not None:
            _check_build_globs(o)
        return o


def _build_options(o: BenchOptions, config, max_model_len: int):
    """The resolved BuildOptions of the build bench compiles (`_compile_missing`) at
    `max_model_len`."""
    from flintc.runtime.build import BuildOptions

    backend = o.backend or ("triton" if o.device.startswith("cuda") else "torch")
    return BuildOptions(max_batch=max(o.batches), max_model_len=max_model_len, backend=backend, device=o.device,
                        check=False, dump=False).resolve(config)


def _unresizable_rows(o: BenchOptions, config, max_model_len: int) -> int | None:
    """The cache rows of the build bench compiles at `max_model_len` when it traces its
    functions at its full cache length (max_model_len + a prefill chunk), else None:
    `flintc compile` traces at a fixed shorter length
    (`flintc.runtime.build.traced_cache_rows`) only when the caches are longer, and only
    then are its caches resizable (`_build_record`'s `resizable`)."""
    from flintc.runtime.build import traced_cache_rows

    bo = _build_options(o, config, max_model_len)
    return bo.cache_rows if traced_cache_rows(bo, config) >= bo.cache_rows else None


def _check_resizable(o: BenchOptions, config, points: list[int], defaults: set, compiled: list[str]) -> None:
    """--max-model-len shorter than the longest point, without --build-caches, and bench
    to compile a build of the formats `compiled` (`_formats_to_compile`): the build
    compiled at it serves the longer points only with resizable caches, which a build
    that short does not have (its functions are traced at its full cache length): it was
    compiled, every longer point skipped with a note, exit 0. Raises InputError naming
    both flags, the formats and a longer length whose build resizes (the least above it;
    not every longer one does on CUDA, where the prefill chunk grows with the length)."""
    rows = _unresizable_rows(o, config, o.max_model_len)
    if rows is None:
        return
    longest = max(points)
    least = o.max_model_len + 1
    while least < longest and _unresizable_rows(o, config, least) is not None:
        least += 1
    flag = "--contexts" if longest in o.contexts else "--prefill"
    given = ", the default" if flag[2:] in defaults else ""
    resize = f", one whose build resizes its caches (e.g. {least})" if least < longest else ""
    its, s = ("their", "s") if len(compiled) > 1 else ("its", "")
    raise InputError(f"--max-model-len {o.max_model_len} is shorter than the longest point measured ({flag} "
                     f"{longest}{given}), and the {' and '.join(compiled)} build{s} bench would compile at it "
                     f"(--builds {o.builds} holds none it can use) cannot resize {its} KV caches to it ({its} "
                     f"functions are traced at {its} full cache length, {rows} rows); pass --max-model-len "
                     f">= {longest}{resize}, or leave it out (the longest point)")


def _listed_build(o: BenchOptions, path: Path) -> bool:
    """Whether bench considers the folder `path` in --builds: it holds build.json and
    (with --build-glob) its name matches a pattern."""
    if not (path / "build.json").is_file():
        return False
    return not o.build_globs or any(fnmatch.fnmatchcase(path.name, g) for g in o.build_globs)


def _manifest_serves(o: BenchOptions, manifest: dict, fmt: str, config_sha: str) -> bool:
    """Whether a build's manifest is of weight format `fmt`, the model config whose
    fingerprint is `config_sha` and (when --backend is given) that backend; its weights
    are checked apart (`_Bench._builds_for`, `_formats_to_compile`)."""
    if manifest.get("weight_format") != fmt or manifest.get("config_sha256") != config_sha:
        return False
    return not o.backend or manifest.get("backend") == o.backend


def _formats_to_compile(o: BenchOptions, config) -> list[str]:
    """The formats of --formats for which bench would compile a build (`_compile_missing`),
    read before any weight is: those --builds holds no usable build of, as
    `_Bench._builds_for` finds them (listed by `_listed_build`, a readable build.json and
    plan.json, `_manifest_serves`, the weights). Dummy weights are told by their
    fingerprint (it names their recipe); a MODEL's real weights, whose fingerprint needs
    them read, by the manifest's weight_source (MODEL, or a file in it): a build of other
    weights at that path is found unusable only once they are loaded, and one is then
    compiled. Every format (an empty --builds, or one that cannot be read) when none is
    found; o.builds must be set."""
    from flintc.runtime.build import config_fingerprint, weight_fingerprint
    from flintc.runtime.compiled import read_manifest

    if not o.compile_missing:
        return []
    root = Path(o.builds)
    try:
        paths = sorted(root.iterdir()) if root.is_dir() else []
    except OSError:
        paths = []
    cfg_sha = config_fingerprint(config)
    model = Path(o.model).resolve() if o.model is not None and o.load_format != "dummy" else None
    usable = set()
    for path in paths:
        if not _listed_build(o, path):
            continue
        try:
            m = read_manifest(path)
            read_plan(path)
        except (InputError, OSError):
            continue
        fmt = m.get("weight_format")
        if fmt not in o.formats or fmt in usable or not _manifest_serves(o, m, fmt, cfg_sha):
            continue
        if model is None:
            same = m.get("weight_sha256") == weight_fingerprint({}, fmt, f"dummy:{fmt}")
        else:
            source = m.get("weight_source")
            same = isinstance(source, str) and (Path(source) == model or model in Path(source).parents)
        if same:
            usable.add(fmt)
    return [f for f in o.formats if f not in usable]


def compiled_build_name(o: BenchOptions, fmt: str) -> str:
    """The folder name (in --builds) of the build bench compiles when none covers `fmt`:
    CONFIG-FORMAT (full-bf16), model-FORMAT for a MODEL."""
    return f"{o.config or 'model'}-{fmt}"


def _unclosed_bracket(pattern: str) -> bool:
    """Whether a '[' of the shell pattern opens a set that no ']' closes (fnmatch then
    matches it as a literal '[': a typo, not a set)."""
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                return True
            i = j
        i += 1
    return False


def _manifest_format(path: Path) -> str | None:
    """The weight_format of the build in `path` (its build.json); None when the manifest
    cannot be read (bench then notes it, "not used")."""
    try:
        m = json.loads((path / "build.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return m.get("weight_format") if isinstance(m, dict) else None


def _check_build_globs(o: BenchOptions) -> None:
    """--build-glob, before anything is measured. Raises InputError naming it: an empty
    pattern, one with an unclosed '[', or (when flintc is measured) patterns that match
    no build folder in --builds of a format in --formats (its manifest's weight_format)
    while bench would not compile one under a matching name (--no-compile, or no
    CONFIG-FORMAT of those formats matching a pattern): that run measured no flintc
    point, with a note at the end, or compiled a build the patterns did not name. An
    --builds folder that cannot be read is an InputError naming it."""
    for g in o.build_globs:
        if not g:
            raise InputError("--build-glob: empty pattern; expected comma-separated shell patterns, e.g. "
                             "'full-nvfp4*,full-bf16*'")
        if _unclosed_bracket(g):
            raise InputError(f"--build-glob {g!r}: a '[' that no ']' closes; expected shell patterns (* any "
                             "text, ? one character, [abc] one of a set, [[] a literal [)")
    if not o.run_flintc:
        return
    root = Path(o.builds)
    try:
        names = sorted(p.name for p in root.iterdir() if (p / "build.json").is_file()) if root.is_dir() else []
    except OSError as e:
        where = "" if e.filename in (None, str(root)) else f" ({e.filename})"
        raise InputError(f"--builds {root}: cannot be read{where}: {e.strerror or e}; pass a folder of builds "
                         "this user can read") from e

    def matched(name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, g) for g in o.build_globs)

    formats = {n: _manifest_format(root / n) for n in names if matched(n)}
    if any(f in o.formats for f in formats.values()):
        return
    compiled = [compiled_build_name(o, fmt) for fmt in o.formats]
    if o.compile_missing and any(matched(n) for n in compiled):
        return  # none yet: bench compiles it under a name the patterns match
    if formats:  # builds of another format (or unreadable): no point of --formats runs on them
        found = ", ".join(f"{n} ({f or 'unreadable build.json'})" for n, f in formats.items())
        what = f"matches no {' or '.join(o.formats)} build in {root} (it matches: {found})"
    else:
        there = listing(names, 8, more=" and {} more") or "none"
        what = f"matches no build in {root} (builds there: {there})"
    why = ("--no-compile is given" if not o.compile_missing else
           f"a missing build is compiled only under a name a pattern matches ({', '.join(compiled)})")
    raise InputError(f"--build-glob {','.join(o.build_globs)}: {what} and {why}; pass patterns that match a "
                     "build's folder name, or leave --build-glob out")


class _ConfigRead(Exception):
    """Raised by `_check_model`'s check_config once the loader has read MODEL's config."""


def _check_model(o: BenchOptions):
    """MODEL's config read (from it, or --hf-config-path) and, with --load-format auto, its
    weight format told, before anything is measured: a MODEL that is no checkpoint, or
    whose format is not every one of --formats, failed each format's "load weights" after
    the ceilings had been measured and written (exit 1); so did weights the CPU has not
    the memory for (`check_weights_fit`, as for --config). No weight is read. Returns
    the config (FlintConfig).

    Raises:
        CheckpointError, ConfigError: as `load_checkpoint` (no config found, a folder that
            is neither kind of checkpoint, an invalid config.json).
        InputError: --load-format auto and --formats other than MODEL's own format; on a
            CPU, weights larger than the memory available.
    """
    from flintc.checkpoint.loader import checkpoint_weight_format, load_checkpoint

    read = []

    def stop(config):
        read.append(config)
        if o.device.startswith("cpu"):  # as for --config: refused now, not after the ceilings
            from flintc.runtime.device import check_weights_fit

            for fmt in o.formats:
                check_weights_fit(config, fmt, o.device)
        raise _ConfigRead()

    try:
        load_checkpoint(o.model, hf_config_path=o.hf_config_path, device="cpu", load_format=o.load_format,
                        fmt=(o.formats or ["bf16"])[0], progress=False, check_config=stop)
    except _ConfigRead:
        pass
    if o.load_format == "auto":
        held = checkpoint_weight_format(o.model)
        if set(o.formats) != {held}:
            raise InputError(f"--formats {','.join(o.formats)}: MODEL {o.model} holds {held} weights, which "
                             f"--load-format auto measures; pass --formats {held} (or --load-format dummy for "
                             "random weights of each format with its config)")
    return read[0] if read else None


class _Clock:
    """The run's time budget: `left()` seconds before outputs must be written."""

    RESERVE_S = 15.0

    def __init__(self, budget: float | None):
        self.t0 = time.monotonic()
        self.budget = budget
        self.share_until = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        if not self.budget:
            return float("inf")
        left = self.budget - self.RESERVE_S - self.elapsed()
        if self.share_until is not None:
            left = min(left, self.share_until - time.monotonic())
        return left

    def share(self, parts: int) -> None:
        """From now on, at most 1/parts of what is left (one weight format's share)."""
        self.share_until = None
        if self.budget and parts > 0:
            self.share_until = time.monotonic() + self.left() / parts


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_bench(options: BenchOptions, log=_log) -> dict:
    """Run the benchmark described by `options` and write its outputs into options.out
    (bench.json, bench.md, PNG plots). Returns the results dict (see `report`).

    Raises InputError for bad options, a malformed FLINTC_* variable or a CUDA device
    without a GPU, before anything is written. Failures of a single measurement (an
    error, out of memory) are recorded in the results (`failures`: one record each,
    with its traceback; and a note) and the run goes on; a baseline that does not
    compile (`baseline_failures`) and a step past its timeout are notes."""
    from flintc.bench import report
    from flintc.runtime.compiled import check_environment
    from flintc.runtime.device import prepare_device

    o = options.resolved()
    prepare_device(o.device)  # the Triton interpreter for cpu, before the kernels are imported
    check_environment(o.backend)  # a bad FLINTC_* variable: now, not after a compile
    device = torch.device(o.device)
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = _Clock(o.time_budget)
    results = _new_results(o, device)
    bench = _Bench(o, device, clock, results, log)
    for msg in o.cut_defaults:
        bench.note(msg)

    def save():  # never half-written; a failed write leaves no temporary file; strict JSON (no NaN)
        write_text_atomic(out / "bench.json", report.dumps_results(results))

    bench.save = save

    try:
        bench.ceilings()
        save()
        for i, fmt in enumerate(o.formats):
            clock.share(len(o.formats) - i)  # each format gets an equal share of what is left
            if clock.left() <= 0:
                bench.note(f"{fmt}: skipped, the time budget ({o.time_budget:g} s) is spent")
                continue
            bench.run_format(fmt)
            save()
    except KeyboardInterrupt:
        bench.note(f"interrupted (SIGINT, e.g. the calling script's hard time limit) after "
                   f"{clock.elapsed():.0f} s: the points after the last one reported were not measured")
        raise
    finally:
        results["meta"]["wall_s"] = round(clock.elapsed(), 1)
        # bench.json alone (beside the last run's bench.md, as after each step): kept even
        # when the report below cannot be rendered; write_outputs then writes the pair
        save()
        report.write_outputs(results, out, plots=o.plots, log=log)
    return results


def flintc_unmeasured(o: BenchOptions, results: dict) -> str | None:
    """Why no flintc point was measured, when flintc was to be measured at some point
    (decode or prefill) and none was, one line: the builds of --builds that could not be
    used and why (`unusable_builds`), else the run's notes that say what was skipped.
    None when a point was measured (or none was asked for). Such a run measured the
    ceilings and wrote its report, and exited 0 ("flintc not measured" in a note)."""
    if not o.run_flintc or not (o.contexts and o.batches or o.prefill):
        return None
    if any(r.get("engine") == "flintc" for key in ("decode", "prefill") for r in results.get(key, [])):
        return None
    parts = [b["why"] if b["path"] in b["why"] else f"{b['path']}: {b['why']}"
             for b in results.get("unusable_builds") or []]
    parts = [f"not used: {p}" for p in parts]
    skipped = [n for n in results.get("notes", []) if "not measured" in n or "skipped" in n]
    parts += [listing(skipped, 3, "; ", "; {} more points skipped")] if skipped else []
    return "; ".join(parts) or "see the notes"


def _new_results(o: BenchOptions, device: torch.device) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import flintc

    def ver(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": o.command,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_memory_gib": (round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
                              if device.type == "cuda" else None),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": ver("triton"),
        "flintc": flintc.__version__,  # a source tree's: its pyproject.toml version ("unknown" without one)
        "flintc_commit": _source_commit(),
        "driver": _driver_version() if device.type == "cuda" else None,
        # the interpreter runs only the triton backend's kernels (the torch backend: none)
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"
        and (o.backend or ("triton" if device.type == "cuda" else "torch")) == "triton",
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in o.__dict__.items()},
        "timing": ("CUDA-graph replays timed with device events" if device.type == "cuda"
                   else "eager calls of the generated functions timed with time.perf_counter (no CUDA graphs)"),
        "full_model": None,
    }
    return {"meta": meta, "ceilings": {}, "loads": [], "builds": [], "decode": [], "prefill": [],
            "baselines": [], "baseline_failures": [], "breakdown": [], "prefill_breakdown": [], "kernels": [],
            "failures": [], "notes": [], "unusable_builds": []}


def _source_commit() -> str | None:
    """The git commit of the flintc source that runs (short hash, "+modified" when the
    tracked files differ from it), or None outside a git checkout (an installed wheel, a
    copied tree) or without git. Informational: a benchmark record names its code."""
    try:
        import subprocess

        root = Path(__file__).resolve().parents[2]
        run = lambda *a: subprocess.run(["git", "--no-optional-locks", "-C", str(root), *a],  # noqa: E731
                                        capture_output=True, text=True, timeout=10, check=False)
        top = run("rev-parse", "--show-toplevel")  # flintc's own checkout, not a repository
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:  # around site-packages
            return None
        head = run("rev-parse", "--short=12", "HEAD")
        if head.returncode != 0 or not head.stdout.strip():
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no", "--", "flintc")
        return head.stdout.strip() + ("+modified" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001 - informational only
        return None


def _driver_version() -> str | None:
    try:
        import subprocess

        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10, check=False)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except Exception:  # noqa: BLE001 - informational only
        return None


class _Bench:
    def __init__(self, o: BenchOptions, device: torch.device, clock: _Clock, results: dict, log):
        self.o, self.device, self.clock, self.r, self.log = o, device, clock, results, log
        self.cuda = device.type == "cuda"
        self.gen = torch.Generator().manual_seed(1234)  # host-side: same inputs on any device
        self._last_compile_s = None
        self._kernel_counts: dict[tuple, tuple] = {}

    # -- bookkeeping ----------------------------------------------------------------------
    def note(self, msg: str) -> None:
        self.log(msg)
        self.r["notes"].append(msg)

    def note_once(self, msg: str) -> None:
        """`note`, unless the same note was made before (a build every format skips)."""
        if msg not in self.r["notes"]:
            self.note(msg)

    def _unusable(self, path: Path, why: str) -> None:
        """A build in --builds that bench could not use, and why (results'
        `unusable_builds`, which `flintc bench` names when no flintc point was measured)."""
        rec = {"path": str(path), "why": why}
        if rec not in self.r["unusable_builds"]:
            self.r["unusable_builds"].append(rec)

    def fail(self, what: str, msg: str) -> None:
        """A measurement that failed: a one-line note, and a record in `failures` with
        the traceback of the exception being handled (bench.json only)."""
        self.note(f"{what}: {msg}")
        self.r["failures"].append({"what": what, "error": msg, "traceback": traceback.format_exc(limit=8)})

    def save(self) -> None:
        """Rewrite bench.json with what is measured so far (set by `run_bench`)."""

    def guarded(self, what: str, fn, need_s: float = 0.0):
        """Run one measurement: out of time (less than `need_s` seconds left), out of
        memory, timeout and errors become notes (one line each); out of memory and
        errors are also recorded as failures, with the traceback (`fail`)."""
        from flintc.bench.timing import StepTimeout, step_timeout

        self.save()  # what is measured so far: a run killed during this step keeps it
        if self.clock.left() <= need_s:
            self.note(f"{what}: skipped, the time budget is spent"
                      + (f" (it needs about {need_s:.0f} s)" if need_s else ""))
            return None
        t0 = time.monotonic()
        try:
            with step_timeout(self.o.step_timeout):
                res = fn()
            from flintc.bench.report import non_finite

            bad = non_finite(res)
            if bad:  # bench.json cannot hold it (JSON has no NaN), and no report should show it
                raise ValueError(f"{bad[0].lstrip('.') or 'its result'} is {bad[1]!r}, not a finite number; "
                                 "not recorded")
            self.log(f"{what}: done in {time.monotonic() - t0:.1f} s")
            return res
        except StepTimeout as e:
            self.note(f"{what}: {e}")
        except torch.cuda.OutOfMemoryError as e:
            self.fail(what, f"out of device memory ({str(e).splitlines()[0][:200]})")
        except Exception as e:  # noqa: BLE001 - one point's failure is recorded, the run goes on
            self.fail(what, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return None

    # -- ceilings -------------------------------------------------------------------------
    def ceilings(self) -> None:
        from flintc.bench.timing import copy_bandwidth_gbs, matmul_tflops

        c = self.r["ceilings"]
        c["copy_gbs"] = copy_bandwidth_gbs(self.device)
        c["matmul_tflops"] = matmul_tflops(self.device)
        for key in ("copy_gbs", "matmul_tflops"):
            if not (math.isfinite(c[key]) and c[key] > 0):  # every roofline divides by them
                from flintc.bench.report import NonFiniteError

                value = c.pop(key)  # the report is still written, without it
                raise NonFiniteError(f"ceilings: the measured {key} is {value!r}, not a finite number > 0; "
                                     "nothing was measured against it")
        size, n = ("1 GiB", 8192) if self.cuda else ("64 MiB", 256)
        c["method"] = (f"copy: dst.copy_(src) of {size}, read + written bytes, median of 20; "
                       f"matmul: bf16 {n}x{n}x{n} torch.matmul, median of 20")
        self.log(f"ceilings: copy {c['copy_gbs']:.0f} GB/s, bf16 matmul {c['matmul_tflops']:.1f} TFLOP/s")

    # -- one weight format ----------------------------------------------------------------
    def run_format(self, fmt: str) -> None:
        ckpt = self.guarded(f"{fmt}: load weights", lambda: self._load(fmt))
        if ckpt is None:
            return
        try:
            if self.o.run_flintc:
                self._flintc(fmt, ckpt)
            standalone = [b for b in self.o.baselines if b in COMPILED_BASELINES or not self.o.run_flintc]
            for name in standalone:
                self._standalone_baseline(name, fmt, ckpt)
        finally:
            del ckpt
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def _load(self, fmt: str):
        from flintc.checkpoint.loader import load_checkpoint

        t0 = time.perf_counter()
        if self.o.load_format == "dummy":
            ckpt = load_checkpoint(self.o.model, hf_config_path=self.o.hf_config_path, device=self.device,
                                   load_format="dummy", config=self.o.config if self.o.model is None else None,
                                   fmt=fmt, progress=False)
        else:
            if self.o.model is None:
                raise InputError("a MODEL path is needed unless --load-format dummy")
            ckpt = load_checkpoint(self.o.model, hf_config_path=self.o.hf_config_path, device=self.device,
                                   progress=False)
            if ckpt.fmt != fmt:
                raise InputError(f"{self.o.model} holds {ckpt.fmt} weights; pass --formats {ckpt.fmt}")
        if self.cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        from flintc.bench.roofline import weight_bytes

        cfg = ckpt.config
        from flintc.config import FlintConfig

        self.r["meta"]["full_model"] = cfg.to_dict() == FlintConfig.preset("full").to_dict()
        self.r["meta"]["layers"] = cfg.num_hidden_layers
        wb = weight_bytes(cfg, fmt, cfg.n_routed_experts, cfg.vocab_size).total
        self.r["loads"].append({"fmt": fmt, "source": ckpt.source, "seconds": round(seconds, 2),
                                "weight_bytes": wb})
        return ckpt

    # -- builds ---------------------------------------------------------------------------
    def _builds_for(self, fmt: str, ckpt) -> list[dict]:
        from flintc.runtime.build import config_fingerprint, weight_fingerprint
        from flintc.runtime.compiled import read_manifest

        root = Path(self.o.builds)
        cfg_sha = config_fingerprint(ckpt.config)
        w_sha = weight_fingerprint(ckpt.weights, ckpt.fmt, ckpt.source)
        found = []
        if root.is_dir():
            for path in sorted(root.iterdir()):
                if not _listed_build(self.o, path):
                    continue  # not a build, or (--build-glob) not one of the named builds
                try:
                    m = read_manifest(path)
                except (InputError, OSError) as e:  # not JSON, not an object, another build_version
                    self.note_once(f"{e}; not used")
                    self._unusable(path, str(e))
                    continue
                if m.get("weight_format") != fmt or m.get("config_sha256") != cfg_sha:
                    continue
                if m.get("weight_sha256") != w_sha:
                    self.note(f"{path}: compiled for other weights than these {fmt} weights; not used")
                    self._unusable(path, f"compiled for other weights than these {fmt} weights")
                    continue
                if not _manifest_serves(self.o, m, fmt, cfg_sha):  # another --backend
                    continue
                try:
                    plan = read_plan(path)
                except InputError as e:
                    self.note(f"{e}; not used")
                    self._unusable(path, str(e))
                    continue
                from flintc.runtime.compiled import stale_build_note

                stale = stale_build_note(path, m)
                if stale:
                    self.note(stale)  # measured all the same: the results say which code compiled it
                found.append(_build_record(path, m, plan))
        if not found:
            found = self._compile_missing(fmt, ckpt, root)
        prefer = "triton" if self.cuda else "torch"
        found.sort(key=lambda b: (b["manifest"].get("backend") != prefer, b["kv_bytes"]))
        for b in found:
            m = b["manifest"]
            self.r["builds"].append({"fmt": fmt, "path": str(b["path"]), "max_batch": m["max_batch"],
                                     "max_model_len": m["max_model_len"], "backend": m["backend"],
                                     "buckets": m.get("buckets"), "kv_cache_bytes": b["kv_bytes"],
                                     "caches_resizable": b["resizable"],
                                     "created": m.get("created"), "functions": m.get("functions"),
                                     "fold_attention_combine": bool(m.get("fold_attention_combine")),
                                     "split_lm_head_norm": bool(m.get("split_lm_head_norm"))})
        return found

    def _compile_missing(self, fmt: str, ckpt, root: Path) -> list[dict]:
        from flintc.runtime.build import BuildOptions, compile_model

        cfg = ckpt.config
        name = compiled_build_name(self.o, fmt)
        path = root / name
        globs = self.o.build_globs
        which = f" matching --build-glob {','.join(globs)}" if globs else ""
        if not self.o.compile_missing:
            self.note(f"{fmt}: no build for these weights{which} in {root} and --no-compile given; flintc not "
                      "measured")
            return []
        if os.path.lexists(path):
            # a build this run does not use (other weights, another backend, unreadable) or
            # anything else: never replaced (compiling over it destroyed a user's build);
            # the next free name NAME-2, NAME-3, ... is compiled instead
            n = 2
            while os.path.lexists(root / f"{name}-{n}"):
                n += 1
            self.note(f"{fmt}: {path} exists and is not used here; it is kept, not replaced")
            name = f"{name}-{n}"
            path = root / name
        if globs and not any(fnmatch.fnmatchcase(name, g) for g in globs):
            # a build the patterns do not name: the next run with them would not use it either
            self.note(f"{fmt}: no build for these weights{which} in {root}; not compiling {path}: its name "
                      f"matches no pattern (compile one with flintc compile --out {root}/NAME, NAME matching a "
                      "pattern, or leave --build-glob out); flintc not measured")
            return []
        # the longest point, at least 2 (flintc compile's least: --contexts 1 --prefill none
        # asked for 1, which the compile refused after the ceilings were measured)
        max_len = self.o.max_model_len or max(2, min(cfg.max_position_embeddings,
                                                     max(self.o.contexts + self.o.prefill)))
        backend = self.o.backend or ("triton" if self.cuda else "torch")
        opts = BuildOptions(max_batch=max(self.o.batches), max_model_len=max_len, backend=backend,
                            device=self.o.device, check=False, dump=False)
        self.note(f"{fmt}: no build in {root}; compiling {path} (max batch {opts.max_batch}, max model len "
                  f"{max_len}, backend {backend}). This takes minutes: about 2.5 min per function for the full "
                  f"config; cross-compile builds ahead with `flintc compile` (docs/benchmarks.md)")
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        m = compile_model(ckpt, path, opts, progress=False, log=self.log)
        self.note(f"{fmt}: compiled {path} in {time.perf_counter() - t0:.0f} s")
        return [_build_record(path, m, read_plan(path))]

    def _resize(self, build: dict) -> bool:
        """Whether this run sizes the build's KV caches to the points it serves."""
        return self.o.size_caches and build["resizable"]

    def _covers(self, build: dict, batch: int, context: int, config) -> bool:
        m = build["manifest"]
        if m["max_batch"] < batch:
            return False
        return context <= (config.max_position_embeddings if self._resize(build) else m["max_model_len"])

    def _kv_need(self, build: dict, context: int) -> int:
        return build["kv_for"](context) if self._resize(build) else build["kv_bytes"]

    def _next_build(self, builds, point, config, skip=()) -> int | None:
        """The index of the build to run `point` (kind, batch, context) on, of those not in
        `skip` that cover it: the one that needs the least KV-cache memory for it (a build
        with resizable caches: its slots x the point's context; otherwise the build's
        caches as compiled), then the first; None when none covers it."""
        _, batch, context = point
        cover = [i for i, b in enumerate(builds) if i not in skip and self._covers(b, batch, context, config)]
        return min(cover, key=lambda i: (self._kv_need(builds[i], context), i), default=None)

    def _assign(self, builds, points, fmt: str, config) -> dict[int, list]:
        """{build index: [points]}: each point (kind, batch, context) to its build
        (`_next_build`); points no build covers become notes."""
        groups: dict[int, list] = {}
        for p in points:
            idx = self._next_build(builds, p, config)
            if idx is None:
                kind, batch, context = p
                have = ", ".join(f"{b['path'].name} (batch <= {b['manifest']['max_batch']}, context <= "
                                 f"{b['manifest']['max_model_len']})" for b in builds) or "none"
                self.note(f"{fmt} {_KINDS[kind]} batch {batch} context {context}: skipped, no build covers it "
                          f"(builds: {have}); compile one with --max-batch >= {batch} --max-model-len >= {context}")
                continue
            groups.setdefault(idx, []).append(p)
        return groups

    # -- flintc ---------------------------------------------------------------------------
    def _flintc(self, fmt: str, ckpt) -> None:
        """flintc's points of `fmt` on the builds of --builds. A point is (kind, batch,
        context): decode (batch, context), prefill (1, tokens), the eager baseline's
        (batch, context). Each goes to its build (`_assign`); the builds that have points
        run one at a time, the lowest index first, each loaded once, with the points `_fit`
        finds room for. A point a build cannot take moves on to its next build among those
        not run yet (`_next_build`), or is skipped when none is left, with a note saying
        which (`_move_on`). A build skipped because the time budget is spent hands nothing
        on."""
        builds = self._builds_for(fmt, ckpt)
        if not builds:
            return
        o = self.o
        eager_points = self._baseline_points("eager") if "eager" in o.baselines else []
        points = ([("decode", b, c) for b in o.batches for c in o.contexts] + [("prefill", 1, t) for t in o.prefill]
                  + [("eager", b, c) for b, c in eager_points])
        breakdown = set(self._breakdown_points())
        cfg = ckpt.config
        pending = self._assign(builds, points, fmt, cfg)
        done: set[int] = set()
        # a build's first point compiles the Triton kernels and captures the CUDA graphs
        need_s = 30.0 if self.cuda and cfg.num_hidden_layers > 8 else 0.0
        while pending:
            idx = min(pending)
            pts = pending.pop(idx)
            done.add(idx)
            name = builds[idx]["path"].name
            if self.clock.left() <= need_s:
                self.note(f"{fmt}: build {name} skipped, the time budget is spent ({_point_words(pts)} not "
                          "measured)")
                continue
            build, taken, left, why = self._fit(fmt, builds[idx], ckpt, pts)
            if left:
                self._move_on(fmt, builds, name, left, why, done, pending, cfg, order=points.index)
            if build is None:
                continue
            dec, pre, eager = ([(b, c) for k, b, c in taken if k == kind] for kind in _KINDS)
            runner = self.guarded(f"{fmt}: load build {name} (KV caches {build['kv_bytes'] / 2**30:.1f} GiB: "
                                  f"{build['manifest']['max_batch']} slots x "
                                  f"{build['manifest']['max_model_len']} positions)",
                                  lambda build=build: self._runner(build, ckpt))
            if runner is None:
                continue
            try:
                self._with_runner(fmt, runner, build, dec, pre, eager, breakdown)
            finally:
                del runner
                gc.collect()
                if self.cuda:
                    torch.cuda.empty_cache()

    def _move_on(self, fmt: str, builds, name: str, left, why: str, done, pending, config, order) -> None:
        """The points `left` that build `name` could not take (`why`, from `_fit`): each to
        its next build not in `done` (`_next_build`), added to that build's points in
        `pending` (kept in the run's order: `order`); one note saying where each went, or
        that it is skipped."""
        to: dict[int | None, list] = {}
        for p in left:
            to.setdefault(self._next_build(builds, p, config, skip=done), []).append(p)
        tries = sorted(j for j in to if j is not None)
        for j in tries:
            pending[j] = sorted(pending.get(j, []) + to[j], key=order)
        if len(to) == 1 and tries:
            fate = [f"trying build {builds[tries[0]]['path'].name}"]
        else:
            fate = [f"trying build {builds[j]['path'].name} for {_point_words(to[j])}" for j in tries]
        if None in to:
            it = "them" if len(to[None]) > 1 else "it"
            fate.append(f"skipped {_point_words(to[None])}: no build left covers {it}")
        self.note(f"{fmt}: build {name} could not take {_point_words(left)}: {why}; {'; '.join(fate)}")

    def _free_bytes(self) -> int | None:
        """The device memory free now, in bytes, the allocator's cached blocks released
        first (they count as free for the caches); None on a CPU, which has no such
        figure: `_fit` then gives each build every point."""
        if not self.cuda:
            return None
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def _workspace(self, build: dict, config, points) -> int:
        """The bytes `points` need on `build` next to its KV caches: 1 GiB, the largest
        intermediates of the functions they run (`plan.json`'s intermediate_bytes of the
        decode buckets of their batches, of the prefill functions) and, for the eager
        baseline, the fp32 copy of the largest weight (the LM head) its linears make."""
        buckets = {next((k for k in build["buckets"] if k >= b), None) for kind, b, _ in points if kind != "prefill"}
        prefill = any(kind == "prefill" for kind, _, _ in points)
        used = [s for s in build["plan_steps"].values()
                if (s["step"] == "decode" and s["batch"] in buckets) or (s["step"] == "prefill" and prefill)]
        workspace = (1 << 30) + max((int(s.get("intermediate_bytes", 0)) for s in used), default=0)
        if any(kind == "eager" for kind, _, _ in points):
            workspace += 2 * 4 * config.vocab_size * config.hidden_size
        return workspace

    def _fit(self, fmt: str, build: dict, ckpt, points) -> tuple[dict | None, list, list, str]:
        """`(build, taken, left, why)`: the build as this run loads it, the points it takes,
        those it cannot take and why (words for a note, "" when none). A set of points
        needs the build's KV caches (resizable: sized to its longest context; otherwise
        as compiled) and their workspace (`_workspace`) in the device memory free next to
        the weights (`_free_bytes`). Taken in order of what each needs alone (ties in the
        given order), a point joins those taken when they all still fit; on a CPU every
        point is taken. Resizable caches are sized to the longest context taken. build is
        None when it takes no point; taken and left keep the given order."""
        from flintc.bench.roofline import weight_bytes

        cfg = ckpt.config
        m = build["manifest"]
        if self.cuda and m.get("backend") == "triton" and ckpt.fmt == "nvfp4":
            # the CUDA NVFP4 kernels' weight layout, as the runtime will convert them: now,
            # with the conversion's temporaries freed before the caches are sized
            # (flintc.kernels.nvfp4_mma.prepack)
            from flintc.kernels.nvfp4_mma import prepack

            prepack(ckpt.weights, ckpt.config)
        free = self._free_bytes()

        def need(pts) -> int:
            return self._kv_need(build, max(c for _, _, c in pts)) + self._workspace(build, cfg, pts)

        fitting = []
        for p in sorted(points, key=lambda p: need([p])):
            if free is None or need(fitting + [p]) <= free:
                fitting.append(p)
        taken = [p for p in points if p in fitting]
        left = [p for p in points if p not in fitting]
        why = ""
        if left:  # then all the points together do not fit either (a point only adds to the need)
            rows = max(c for _, _, c in points) if self._resize(build) else m["max_model_len"]
            slots = f"{m['max_batch']} slot{'s' if m['max_batch'] > 1 else ''}"
            compiled = "" if self._resize(build) else " as compiled"
            which = "" if len(points) == 1 else f" for all {len(points)} of its points"
            weights_gib = weight_bytes(cfg, ckpt.fmt, cfg.n_routed_experts, cfg.vocab_size).total / 2**30
            why = (f"KV caches of {slots} x {rows} positions{compiled} ({self._kv_need(build, rows) / 2**30:.1f} "
                   f"GiB) and {self._workspace(build, cfg, points) / 2**30:.1f} GiB of workspace{which} do not fit "
                   f"in the {free / 2**30:.1f} GiB free next to the weights ({weights_gib:.1f} GiB)")
            if not taken and not self._resize(build):
                why += "; compile a build with a smaller --max-batch or --max-model-len"
        if not taken:
            return None, taken, left, why
        rows = max(c for _, _, c in taken)
        if not self._resize(build) or rows == m["max_model_len"]:
            return build, taken, left, why
        chunk = int(m["prefill_chunk"])
        manifest = dict(m, max_model_len=rows, cache_rows=rows + chunk)
        for rec in self.r["builds"]:
            if rec["fmt"] == fmt and rec["path"] == str(build["path"]):
                rec.update(loaded_max_model_len=rows, loaded_kv_cache_bytes=build["kv_for"](rows))
        resized = dict(build, manifest=manifest, kv_bytes=build["kv_for"](rows),
                       compiled_max_model_len=m["max_model_len"])
        return resized, taken, left, why

    def _runner(self, build: dict, ckpt):
        from flintc.runtime.compiled import CompiledRunner, load_build

        if build["manifest"] is build["compiled_manifest"]:
            return load_build(build["path"], ckpt=ckpt, device=self.o.device, progress=False)
        # the same build with caches of another length: its functions do not depend on the
        # cache length (build["resizable"]); the config and weights were matched in _builds_for
        return CompiledRunner(build["path"], build["manifest"], ckpt, torch.device(self.o.device))

    def _with_runner(self, fmt, runner, build, dec, pre, eager, breakdown) -> None:
        contexts = [c for _, c in dec + eager]
        if contexts:
            self.guarded(f"{fmt}: fill KV caches to {max(contexts)} rows",
                         lambda: _fill_kv(runner, max(contexts) - 1))
        for batch, context in dec:
            rec = self.guarded(f"{fmt} flintc decode batch {batch} context {context}",
                               lambda b=batch, c=context: self._decode_point(fmt, runner, build, b, c))
            if rec is not None:
                self.r["decode"].append(rec)
            if (batch, context) in breakdown:
                bd = self.guarded(f"{fmt} kernel breakdown batch {batch} context {context}",
                                  lambda b=batch, c=context: self._breakdown(fmt, runner, b, c))
                if bd is not None:
                    self.r["breakdown"].append(bd)
        for _, tokens in pre:
            rec = self.guarded(f"{fmt} flintc prefill {tokens} tokens",
                               lambda t=tokens: self._prefill_point(fmt, runner, build, t))
            if rec is not None:
                self.r["prefill"].append(rec)
        if pre:
            tokens = max(t for _, t in pre)
            bd = self.guarded(f"{fmt} prefill kernel breakdown {tokens} tokens",
                              lambda: self._prefill_breakdown(fmt, runner, tokens))
            if bd is not None:
                self.r.setdefault("prefill_breakdown", []).append(bd)
        if eager:
            from flintc.bench.baselines import EagerStep

            for batch, context in eager:
                def run(batch=batch, context=context):
                    from flintc.bench.baselines import kv_view

                    if self.cuda:
                        torch.cuda.reset_peak_memory_stats(self.device)
                    step = EagerStep(runner.model, kv_view(runner.kv, runner.config, context))
                    return self._baseline_point(step, runner.config, fmt, batch, context,
                                                slots=runner.max_batch)
                rec = self.guarded(f"{fmt} eager baseline batch {batch} context {context}", run)
                if rec is not None:
                    self.r["baselines"].append(rec)

    def _inputs(self, cfg, batch: int, bucket: int, context: int, slots: int, runner=None):
        """`rotations` input sets: ids [bucket, 1], positions [bucket, 1], slots [bucket]
        (live rows first; padding rows at position 0, token 0, with `runner.pad_slot`'s
        negative slot: they touch no cache row)."""
        sets = []
        for r in range(self.o.rotations):
            ids = torch.randint(0, cfg.vocab_size, (batch,), generator=self.gen).tolist()
            step = batch if batch < slots else 1  # batch == slots: rotate the permutation
            sl = [(r * step + j) % slots for j in range(batch)]
            pad = bucket - batch
            sets.append({
                "ids": ids, "slots": sl, "positions": [context - 1] * batch,
                "t_ids": torch.tensor([[t] for t in ids] + [[0]] * pad, device=self.device),
                "t_pos": torch.tensor([[context - 1]] * batch + [[0]] * pad, device=self.device),
                "t_slots": torch.tensor(sl + ([runner.pad_slot(sl)] * pad if pad else []),
                                        device=self.device),
            })
        return sets

    def _sampler(self, batch: int):
        from flintc.sampling import SamplingParams

        if self.o.sampling == "greedy":
            params = [SamplingParams(temperature=0)] * batch
        else:
            params = [SamplingParams(seed=1000 + j) for j in range(batch)]
        gens = [None if p.is_greedy else p.make_generator(self.device) for p in params]
        return params, gens

    def _decode_point(self, fmt, runner, build, batch: int, context: int) -> dict:
        from flintc.bench.instrument import record_step
        from flintc.bench.roofline import decode_roofline
        from flintc.bench.timing import time_host, time_replays
        from flintc.sampling import sample

        o, cfg = self.o, runner.config
        bucket = next(b for b in runner.buckets if b >= batch)
        name = f"decode_b{bucket}"
        sets = self._inputs(cfg, batch, bucket, context, runner.max_batch, runner)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        # the step's own routing, through the recording kernel table (eager, not graphed)
        n_sets = min(len(sets), 4 if self.cuda else 1)
        distinct = []
        for s in sets[:n_sets]:
            rec = record_step(runner, name, s["t_ids"], s["t_pos"], s["t_slots"])
            distinct.append(rec["distinct_experts"])
        moe = sorted({layer for d in distinct for layer in d})
        per_layer = {layer: sum(d.get(layer, 0) for d in distinct) / len(distinct) for layer in moe}
        kernels_measured, method = self._kernel_count(runner, bucket, name, rec)

        if self.cuda:
            graph, s_ids, s_pos, s_sl, _ = runner.decode_graph(bucket)

            def prepare(i):
                s = sets[i % len(sets)]
                s_ids.copy_(s["t_ids"])
                s_pos.copy_(s["t_pos"])
                s_sl.copy_(s["t_slots"])

            fwd = time_replays(graph.replay, prepare, self.device, o.warmup, o.iters)
        else:
            cur = {}

            def prepare(i):
                cur["s"] = sets[i % len(sets)]

            fwd = time_replays(lambda: runner.forward(name, cur["s"]["t_ids"], cur["s"]["t_pos"],
                                                      cur["s"]["t_slots"]),
                               prepare, self.device, o.warmup, o.iters)
        params, gens = self._sampler(batch)

        def e2e_step(i):
            s = sets[i % len(sets)]
            logits = runner.decode(s["slots"], s["ids"], s["positions"])
            return sample(logits, params, gens).tolist()

        e2e = time_host(e2e_step, self.device, min(o.warmup, 5), o.e2e_iters)
        ctxs = [context] * batch + [1] * (bucket - batch)
        roof = decode_roofline(cfg, fmt, ctxs, per_layer, self.r["ceilings"]["copy_gbs"],
                               self.r["ceilings"]["matmul_tflops"])
        fwd_ms, e2e_ms = fwd["median_s"] * 1e3, e2e["median_s"] * 1e3
        m = build["manifest"]
        return {
            "engine": "flintc", "fmt": fmt, "batch": batch, "bucket": bucket, "context": context,
            "fwd_ms": fwd_ms, "fwd_min_ms": fwd["min_s"] * 1e3, "fwd_max_ms": fwd["max_s"] * 1e3,
            "e2e_ms": e2e_ms, "e2e_min_ms": e2e["min_s"] * 1e3, "iters": fwd["iters"], "e2e_iters": e2e["iters"],
            "rotations": len(sets), "roofline": roof, "roofline_ms": roof["ms"],
            "fwd_roofline_share": roof["ms"] / fwd_ms, "e2e_roofline_share": roof["ms"] / e2e_ms,
            "distinct_experts": {
                "mean": sum(per_layer.values()) / len(per_layer) if per_layer else 0.0,
                "min": min((min(d.values()) for d in distinct if d), default=0),
                "max": max((max(d.values()) for d in distinct if d), default=0),
                "per_layer": {str(k): v for k, v in per_layer.items()}, "steps": len(distinct),
                "method": "expert ids returned by the step's own MoE routing kernels, recorded through the "
                          "kernel table on an eager run of the same generated function and inputs",
            },
            "kernels_measured": kernels_measured, "kernel_count_method": method,
            "kernels_plan": runner.kernels_per_forward.get(name),
            "peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None,
            "build": build["path"].name, "build_max_batch": m["max_batch"],
            "build_max_model_len": m["max_model_len"], "kv_cache_bytes_allocated": build["kv_bytes"],
            "kv_slots": int(runner.kv[0].shape[0]),
            "build_compiled_max_model_len": build.get("compiled_max_model_len", m["max_model_len"]),
            "sampling": self.o.sampling,
        }

    def _kernel_count(self, runner, bucket: int, name: str, rec: dict):
        key = (str(runner.build), bucket)
        if key in self._kernel_counts:
            return self._kernel_counts[key]
        if self.cuda:
            n = runner.graph_kernel_count(bucket)
            method = "kernel nodes of the captured CUDA graph (cuda-python)"
            if n is None:
                from flintc.bench.instrument import count_kernels_profiled

                n = count_kernels_profiled(runner.decode_graph(bucket)[0], self.device)
                method = "kernels per replay of the captured CUDA graph in a torch.profiler trace"
        else:
            n = rec["kernel_calls"] + rec["aten_launches"]
            method = "kernel-table calls of one eager run + the plan's aten launches (no CUDA graph on CPU)"
        self._kernel_counts[key] = (n, method)
        self.r["kernels"].append({"fmt": runner.fmt, "function": name, "measured": n, "method": method,
                                  "plan": runner.kernels_per_forward.get(name),
                                  "launches_matched_plan": rec["launches_matched"]})
        return n, method

    def _breakdown(self, fmt, runner, batch: int, context: int) -> dict:
        from flintc.bench.instrument import (breakdown_from_calls, breakdown_from_kernels, profile_graph,
                                             record_step, split_replays)

        bucket = next(b for b in runner.buckets if b >= batch)
        name = f"decode_b{bucket}"
        s = self._inputs(runner.config, batch, bucket, context, runner.max_batch, runner)[0]
        launches = runner.plan[name]["launches"]
        if self.cuda:
            graph, s_ids, s_pos, s_sl, _ = runner.decode_graph(bucket)
            s_ids.copy_(s["t_ids"])
            s_pos.copy_(s["t_pos"])
            s_sl.copy_(s["t_slots"])
            replays = 5
            kernels = profile_graph(graph, replays, self.device)
            per = len(kernels) // replays
            bd = breakdown_from_kernels(split_replays(kernels, per), launches)
            bd["method"] = ("torch.profiler (CUPTI) over 5 replays of the CUDA graph; each kernel charged its "
                            "critical-path time (end minus the later of its start and the previous kernel's end)")
        else:
            rec = record_step(runner, name, s["t_ids"], s["t_pos"], s["t_slots"], time_ops=True)
            bd = breakdown_from_calls(rec["calls"])
            bd["method"] = "host-timed kernel-table calls of one eager run, synchronized around each (CPU)"
        bd.update({"fmt": fmt, "batch": batch, "context": context, "function": name})
        return bd

    def _prefill_breakdown(self, fmt, runner, tokens: int) -> dict:
        """Where a prefill of `tokens` tokens spends its time. CUDA: the kernels of one
        `runner.prefill` call (after the prefill points warmed it up) from torch.profiler,
        grouped by kernel name (prefill launches aten ops too, so kernels are not matched
        to the plan's launches), each charged its critical-path time. CPU: host-timed
        kernel-table calls of one eager run of one prefill chunk."""
        from flintc.bench.instrument import (_short_name, breakdown_from_calls, breakdown_from_kernels,
                                             profile_call, record_step)

        cfg = runner.config
        if self.cuda:
            prompt = torch.randint(0, cfg.vocab_size, (tokens,), generator=self.gen).tolist()
            kernels = profile_call(lambda: runner.prefill(0, prompt, 0), self.device,
                                   what=f"a prefill of {tokens} tokens")
            bd = breakdown_from_kernels([kernels], [], labels=[(_short_name(k["name"]), None) for k in kernels])
            sizes = [p[2] for p in runner.prefill_pieces(tokens)]
            calls = " + ".join(f"{sizes.count(c)} chunks of {c}" for c in dict.fromkeys(sizes))
            bd["method"] = (f"torch.profiler (CUPTI) over one prefill of {tokens} tokens ({calls}); kernels "
                            "grouped by name, each charged its critical-path time")
            bd["function"] = f"prefill ({tokens} tokens)"
        else:
            T = runner.prefill_chunk
            name = f"prefill_t{T}"
            ids = torch.randint(0, cfg.vocab_size, (1, T), generator=self.gen).to(self.device)
            pos = torch.arange(T, device=self.device)[None, :]
            rec = record_step(runner, name, ids, pos, torch.zeros(1, dtype=torch.long, device=self.device),
                              time_ops=True)
            bd = breakdown_from_calls(rec["calls"])
            bd["method"] = f"host-timed kernel-table calls of one eager run of {name} (one chunk; CPU)"
            bd["function"] = name
        bd.update({"fmt": fmt, "tokens": tokens})
        return bd

    def _prefill_point(self, fmt, runner, build, tokens: int) -> dict:
        from flintc.bench.roofline import prefill_roofline
        from flintc.bench.timing import time_replays

        cfg = runner.config
        prompts = [torch.randint(0, cfg.vocab_size, (tokens,), generator=self.gen).tolist()
                   for _ in range(min(self.o.rotations, 3))]
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        cur = {}

        def prepare(i):
            cur["i"] = i

        def call():
            i = cur["i"]
            runner.prefill(i % runner.max_batch, prompts[i % len(prompts)], 0)

        t = time_replays(call, prepare, self.device, 1, self.o.prefill_iters)
        ms = t["median_s"] * 1e3
        roof = prefill_roofline(cfg, fmt, tokens, self.r["ceilings"]["copy_gbs"],
                                self.r["ceilings"]["matmul_tflops"])
        return {"engine": "flintc", "fmt": fmt, "tokens": tokens, "ms": ms, "min_ms": t["min_s"] * 1e3,
                "iters": t["iters"], "tokens_per_s": tokens / t["median_s"], "chunk": runner.prefill_chunk,
                "pieces": [p[2] for p in runner.prefill_pieces(tokens)],
                "roofline": roof, "roofline_ms": roof["ms"], "roofline_share": roof["ms"] / ms,
                "peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None,
                "build": build["path"].name}

    # -- baselines ------------------------------------------------------------------------
    def _baseline_points(self, name: str) -> list[tuple[int, int]]:
        o = self.o
        if o.baseline_points:
            return list(o.baseline_points)
        if name == "eager":
            pts = [(1, c) for c in o.contexts] + [(b, o.contexts[0]) for b in o.batches if b != 1]
            return pts if 1 in o.batches else [(b, o.contexts[0]) for b in o.batches]
        pts = [p for p in TARGET_COMPILE_POINTS if p[0] in o.batches and p[1] in o.contexts]
        return pts or [(o.batches[0], o.contexts[0])]

    def _breakdown_points(self) -> list[tuple[int, int]]:
        o = self.o
        if o.breakdown:
            return list(o.breakdown)
        want = [(1, 100000), (8, 8192)]
        pts = [p for p in want if p[0] in o.batches and p[1] in o.contexts]
        return pts or [(o.batches[0], o.contexts[-1])]

    def _baseline_point(self, step, cfg, fmt, batch: int, context: int, slots: int) -> dict:
        """Time one baseline step (`EagerStep` or `CompiledStep` (compile, fast), which
        wraps the model and has no `.model`) for the model config `cfg`."""
        from flintc.bench.timing import time_host, time_replays
        from flintc.sampling import sample

        sets = self._inputs(cfg, batch, batch, context, slots, None)
        cur = {}

        def prepare(i):
            cur["s"] = sets[i % len(sets)]

        def fwd_call():
            s = cur["s"]
            step(s["t_ids"], s["t_pos"], s["t_slots"])

        # the eager model takes 0.1-0.4 s per step at full size (more at batch 8, NVFP4
        # weights dequantized on every call), and runs the same work every step: a few
        # runs suffice (6 steps in all on CUDA; the e2e steps come warm after the forward ones)
        compiled = step.name in COMPILED_BASELINES
        iters = min(self.o.iters, (20 if compiled else 3) if self.cuda else self.o.iters)
        fwd = time_replays(fwd_call, prepare, self.device, min(self.o.warmup, 2 if compiled else 1), iters)
        params, gens = self._sampler(batch)

        def e2e_step(i):
            s = sets[i % len(sets)]
            logits = step(s["t_ids"], s["t_pos"], s["t_slots"]).float()
            return sample(logits, params, gens).tolist()

        e2e = time_host(e2e_step, self.device, 1 if compiled or not self.cuda else 0,
                        min(self.o.e2e_iters, (10 if compiled else 2) if self.cuda else self.o.e2e_iters))
        return {"engine": step.name, "fmt": fmt, "batch": batch, "context": context,
                "fwd_ms": fwd["median_s"] * 1e3, "e2e_ms": e2e["median_s"] * 1e3, "iters": fwd["iters"],
                "e2e_iters": e2e["iters"], "compile_s": getattr(step, "compile_s", None),
                "cudagraphs": getattr(step, "cudagraphs", None), "mode": getattr(step, "mode", None),
                "cudagraph_notes": getattr(step, "cudagraph_notes", None),
                "graph_breaks": getattr(step, "graph_breaks", None),
                "peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None}

    def _standalone_baseline(self, name: str, fmt: str, ckpt) -> None:
        from flintc.bench.baselines import CompiledStep, EagerStep
        from flintc.bench.fast_model import FastFlintModel
        from flintc.model.reference import FlintModel

        points = self._baseline_points(name)
        cfg = ckpt.config
        model = (FastFlintModel if name == "fast" else FlintModel)(cfg, ckpt.weights,
                                                                   max_positions=max(c for _, c in points))
        for batch, context in points:
            def run(batch=batch, context=context):
                if self.cuda:
                    torch.cuda.reset_peak_memory_stats(self.device)
                kv = model.new_kv_cache(batch, context, self.device)
                _fill_kv_tensors(kv, cfg, batch, context - 1)
                try:
                    if name == "eager":
                        step = EagerStep(model, kv)
                    else:
                        sets = self._inputs(cfg, batch, batch, context, batch, None)
                        self.log(f"{fmt} {name} baseline batch {batch} context {context}: compiling "
                                 "(mode max-autotune; minutes at full size)")
                        step = CompiledStep(model, kv, (sets[0]["t_ids"], sets[0]["t_pos"], sets[0]["t_slots"]),
                                            name=name)
                        if step.error is not None:
                            self.r["baseline_failures"].append({
                                "engine": name, "fmt": fmt, "batch": batch, "context": context,
                                "error": step.error, "traceback": getattr(step, "traceback", None)})
                            self.note(f"{fmt} {name} baseline batch {batch} context {context}: did not compile: "
                                      f"{step.error}")
                            return None
                    rec = self._baseline_point(step, cfg, fmt, batch, context, slots=batch)
                    if name in COMPILED_BASELINES:
                        step.release()
                    return rec
                finally:
                    del kv
            need = 0.0
            if name in COMPILED_BASELINES and self.cuda:  # a full-size max-autotune compile takes minutes
                need = self._last_compile_s or (240.0 if cfg.num_hidden_layers > 8 else 0.0)
            rec = self.guarded(f"{fmt} {name} baseline batch {batch} context {context}", run, need_s=need)
            if rec is not None:
                self.r["baselines"].append(rec)
                if rec.get("compile_s"):
                    self._last_compile_s = rec["compile_s"]


def _point_words(points) -> str:
    """flintc points (kind, batch, context) as notes name them: "batch 1 context 1024,
    prefill 1024, eager baseline batch 1 context 1024"."""
    return ", ".join(f"prefill {c}" if kind == "prefill" else f"batch {b} context {c}" if kind == "decode" else
                     f"{_KINDS[kind]} batch {b} context {c}" for kind, b, c in points)


def read_plan(build: Path) -> dict:
    """BUILD/plan.json (the launch plan `flintc compile` writes).

    Raises:
        InputError: the file is missing, not JSON, or without `steps` / `kv_cache`; the
            message names it.
    """
    f = Path(build) / "plan.json"
    try:
        plan = json.loads(f.read_text())
    except FileNotFoundError:
        raise InputError(f"{f} does not exist: {build} is an incomplete build (recompile it with "
                         "flintc compile)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{f} is not valid JSON ({e}); recompile {build} with flintc compile") from None
    if not isinstance(plan, dict) or not {"steps", "kv_cache"} <= plan.keys():
        raise InputError(f"{f} is not a launch plan (a JSON object with steps and kv_cache); "
                         f"recompile {build} with flintc compile")
    return plan


def _build_record(path: Path, manifest: dict, plan: dict) -> dict:
    """A build as `_Bench` uses it: path, manifest, plan steps, KV bytes as the runner
    allocates them at the compiled length,
    `kv_for(max_model_len)` (the bytes of its caches at another length: max_batch slots
    as the runner allocates them (builds before session 5 list a scratch slot more in
    their plan), full layers max_model_len + prefill_chunk rows, sliding rings as they are) and
    `resizable`: every function was traced at fewer cache rows than the build's, so none
    depends on the cache length (`flintc compile` retraces a function that does at the
    build's length) and the caches can be allocated at any length."""
    kv = plan["kv_cache"]
    slots, rows = int(kv["slots"]), int(manifest["cache_rows"])
    full = sum(int(layer["bytes"]) for layer in kv["layers"] if layer["kind"] == "full")
    sliding = int(kv["bytes"]) - full
    per_row = full // (slots * rows) if rows else 0
    sliding = sliding // slots * int(manifest["max_batch"])
    slots = int(manifest["max_batch"])  # what CompiledRunner allocates
    chunk = int(manifest["prefill_chunk"])
    steps = plan["steps"]
    resizable = bool(steps) and all(int(s.get("traced_cache_rows", rows)) < rows for s in steps.values())
    return {"path": path, "manifest": manifest, "compiled_manifest": manifest,
            "kv_bytes": sliding + slots * per_row * rows,
            "kv_for": lambda n: sliding + slots * per_row * (int(n) + chunk), "resizable": resizable,
            "plan_steps": steps, "buckets": sorted(s["batch"] for s in steps.values() if s["step"] == "decode")}


@torch.inference_mode()
def _fill_kv(runner, rows: int) -> None:
    """Random bf16 in every live slot's cache rows (full layers: rows [0, rows); sliding
    rings: all W rows)."""
    _fill_kv_tensors(runner.kv, runner.config, runner.max_batch, rows)


@torch.inference_mode()
def _fill_kv_tensors(kv, config, slots: int, rows: int) -> None:
    g = torch.Generator(device=kv[0].device).manual_seed(7)
    for i in range(config.num_hidden_layers):
        for t in kv[2 * i:2 * i + 2]:
            n = t.shape[1] if config.is_sliding_layer(i) else min(rows, t.shape[1])
            for s in range(min(slots, t.shape[0])):
                if n > 0:
                    t[s, :n].normal_(generator=g)


__all__ = ["BenchOptions", "run_bench"]
