"""`flintc bench` outputs: the results dict, the targets of issue 8, Markdown, plots.

Files written into the output folder by `write_outputs`:

- `bench.json`: the results dict (`meta`, `ceilings`, `loads`, `builds`, `decode`,
  `prefill`, `baselines`, `baseline_failures`, `breakdown`, `kernels`, `failures` (the
  measurements that failed, with their tracebacks), `unusable_builds` (the builds of
  --builds that could not be used: `path` and `why`, each also a note), `notes`) plus
  `targets` (each target of issue 8 evaluated);
- `bench.md`: the report (what `docs/benchmarks.md` holds), also printed;
- `decode_vs_context.png` (ms per decode step against context length, per format, at
  batch 1: flintc forward and end to end, the roofline, the baselines) and
  `latency_vs_batch.png` (ms per step against batch size at each context), and
  `breakdown.png` (time per kernel type), when matplotlib is installed.

`merge_results([a, b, ...])` joins the results of several runs (the flintc run and the
compile-baseline run happen in separate GPU calls): later records replace earlier ones
with the same key (engine, format, batch, context / tokens; an unusable build's path and
why); the report's header lists each run with its own ceilings. `check_records` checks a results dict read back from a
bench.json (`--from-json`) against `RECORD_FIELDS`, the fields the report reads.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from flintc.errors import FlintcError
from flintc.fileio import write_texts_atomic

# Issue 8's targets on the H200: (key, description, kind, fmt, batch, context, field, op, limit, unit)
TARGETS = [
    ("nvfp4_fwd_b1_100k", "NVFP4 forward b1/100K", "decode", "nvfp4", 1, 100000, "fwd_ms", "<=", 1.35, "ms"),
    ("bf16_fwd_b1_100k", "BF16 forward b1/100K", "decode", "bf16", 1, 100000, "fwd_ms", "<=", 2.2, "ms"),
    ("nvfp4_e2e_b1_100k", "NVFP4 end to end b1/100K", "decode", "nvfp4", 1, 100000, "e2e_ms", "<=", 1.6, "ms"),
    ("nvfp4_fwd_b1_1k", "NVFP4 forward b1/1K", "decode", "nvfp4", 1, 1024, "fwd_ms", "<=", 0.6, "ms"),
    ("bf16_e2e_b1_1k", "BF16 end to end b1/1K", "decode", "bf16", 1, 1024, "e2e_ms", "<=", 1.5, "ms"),
    ("nvfp4_roof_b8_8k", "NVFP4 b8/8K forward, share of its roofline", "decode", "nvfp4", 8, 8192,
     "fwd_roofline_share", ">=", 0.60, "share"),
    ("bf16_roof_b8_8k", "BF16 b8/8K forward, share of its roofline", "decode", "bf16", 8, 8192,
     "fwd_roofline_share", ">=", 0.60, "share"),
    ("bf16_prefill_8192", "BF16 prefill 8,192 tokens", "prefill", "bf16", 1, 8192, "ms", "<=", 145.0, "ms"),
    ("nvfp4_peak_b1_262k", "NVFP4 peak device memory b1/262,144", "decode", "nvfp4", 1, 262144, "peak_gib",
     "<=", 32.0, "GiB"),
    ("bf16_peak_b1_262k", "BF16 peak device memory b1/262,144", "decode", "bf16", 1, 262144, "peak_gib",
     "<=", 90.0, "GiB"),
    ("nvfp4_kernels", "NVFP4 kernels per forward (b1 CUDA graph)", "kernels", "nvfp4", 1, None, "measured",
     "<=", 346, "kernels"),
    ("bf16_kernels", "BF16 kernels per forward (b1 CUDA graph)", "kernels", "bf16", 1, None, "measured",
     "<=", 346, "kernels"),
    ("bf16_vs_compile_b1_1k", "BF16 end to end vs torch.compile, b1/1K", "speedup", "bf16", 1, 1024, "e2e_ms",
     ">=", 3.0, "x"),
    ("bf16_vs_compile_b1_100k", "BF16 end to end vs torch.compile, b1/100K", "speedup", "bf16", 1, 100000,
     "e2e_ms", ">=", 7.5, "x"),
    ("bf16_vs_compile_b8_1k", "BF16 end to end vs torch.compile, b8/1K", "speedup", "bf16", 8, 1024, "e2e_ms",
     ">=", 1.6, "x"),
]

LIST_KEYS = {"decode": ("engine", "fmt", "batch", "context"), "prefill": ("engine", "fmt", "tokens"),
             "baselines": ("engine", "fmt", "batch", "context"), "breakdown": ("fmt", "batch", "context"),
             "kernels": ("fmt", "function"), "baseline_failures": ("engine", "fmt", "batch", "context"),
             "builds": ("fmt", "path"), "loads": ("fmt",), "prefill_breakdown": ("fmt", "tokens"),
             "unusable_builds": ("path", "why")}


# -- the fields the report reads, checked when a bench.json is read back (`check_records`) -------
def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_layer_key(k: str) -> bool:
    try:
        int(k)
    except ValueError:
        return False
    return True


def _finite(v) -> bool:
    """A number a float holds: not NaN or infinite, nor an integer too large for a float
    (10**400: the report's arithmetic raised OverflowError, a bare traceback)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _finite_at_least_0(v) -> bool:
    return _finite(v) and v >= 0


def _finite_above_0(v) -> bool:
    return _finite(v) and v > 0


# a kind: (what it must be, in words; the test), and for numbers a range: (what, test),
# checked once the value is of the kind (so that "x" is "expected a number", -1 "expected
# a finite number >= 0"). Every number the report reads is a measurement (a time, a rate,
# bytes, a share): NaN, Infinity and negative values are refused, and 0 where it makes
# no sense (a time a step took, a rate).
_AT_LEAST_0 = ("a finite number >= 0", _finite_at_least_0)
NUMBER = ("a number", _is_number, _AT_LEAST_0)
POSITIVE = ("a number", _is_number, ("a finite number > 0", _finite_above_0))
INTEGER = ("an integer", _is_integer, ("an integer >= 0", lambda v: _finite(v) and v >= 0))
COUNT = ("an integer", _is_integer, ("an integer >= 1", lambda v: _finite(v) and v >= 1))  # a batch, context, length
STRING = ("a string", lambda v: isinstance(v, str))
BOOLEAN = ("true or false", lambda v: isinstance(v, bool))
INTEGERS = ("a list of integers", lambda v: isinstance(v, list) and all(map(_is_integer, v)))
STRINGS = ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
PER_LAYER = ("an object of layer index (a whole number) -> microseconds",
             lambda v: isinstance(v, dict) and all(_is_layer_key(k) and _is_number(x) for k, x in v.items()),
             ("an object of layer index -> microseconds, each a finite number >= 0",
              lambda v: all(map(_finite_at_least_0, v.values()))))


def _or_null(kind: tuple) -> tuple:
    rng = () if len(kind) < 3 else ((kind[2][0] + " or null", lambda v: v is None or kind[2][1](v)),)
    return (f"{kind[0]} or null", lambda v: v is None or kind[1](v), *rng)


# What `render_markdown`, `evaluate_targets`, `merge_results` and `write_plots` read of a
# results dict, section by section: field -> kind, a nested object (a dict of its own
# fields) or a list of such objects ([dict]). "name?": the field may be missing (runs of
# older code lack it; the report reads it with .get); otherwise it must be there.
# Sections and fields not named here are kept as they are but never read.
_META = {"date?": _or_null(STRING), "command?": _or_null(STRING), "device?": _or_null(STRING),
         "device_name?": _or_null(STRING), "device_memory_gib?": _or_null(NUMBER), "driver?": _or_null(STRING),
         "python?": _or_null(STRING), "torch?": _or_null(STRING), "cuda?": _or_null(STRING),
         "triton?": _or_null(STRING), "flintc?": _or_null(STRING), "flintc_commit?": _or_null(STRING),
         "triton_interpret?": _or_null(BOOLEAN), "timing?": _or_null(STRING), "full_model?": _or_null(BOOLEAN),
         "layers?": _or_null(INTEGER), "wall_s?": _or_null(NUMBER)}
_CEILINGS = {"copy_gbs?": POSITIVE, "matmul_tflops?": POSITIVE, "method?": STRING}
_RUN = {"run?": INTEGER}  # the run a merged record comes from
_OPS = {"op": STRING, "calls": INTEGER, "us": NUMBER, "us_per_call": NUMBER, "share": NUMBER}
RECORD_FIELDS = {
    "meta": {**_META, "runs?": [{**_META, "ceilings?": _CEILINGS, "source?": _or_null(STRING)}]},
    "ceilings": _CEILINGS,
    "loads": {"fmt": STRING, "source": STRING, "weight_bytes": NUMBER, "seconds": NUMBER, **_RUN},
    "builds": {"fmt": STRING, "path": STRING, "backend": STRING, "max_batch": COUNT, "max_model_len": COUNT,
               "kv_cache_bytes": NUMBER, "loaded_max_model_len?": _or_null(INTEGER),
               "loaded_kv_cache_bytes?": _or_null(NUMBER), **_RUN},
    "decode": {"engine": STRING, "fmt": STRING, "batch": COUNT, "context": COUNT, "fwd_ms": POSITIVE,
               "e2e_ms": POSITIVE, "roofline_ms": NUMBER, "fwd_roofline_share": NUMBER,
               "e2e_roofline_share": NUMBER, "distinct_experts": {"mean": NUMBER}, "roofline": {"bytes": NUMBER},
               "kernels_measured?": _or_null(INTEGER), "kernels_plan?": _or_null(INTEGER),
               "peak_gib?": _or_null(NUMBER), "sampling?": _or_null(STRING), "build?": _or_null(STRING),
               "kv_cache_bytes_allocated?": _or_null(NUMBER), "kv_slots?": _or_null(INTEGER),
               "build_max_batch?": _or_null(INTEGER), "build_max_model_len?": _or_null(INTEGER), **_RUN},
    "prefill": {"engine": STRING, "fmt": STRING, "tokens": COUNT, "ms": POSITIVE, "tokens_per_s": POSITIVE,
                "roofline_ms": NUMBER, "roofline": {"bound": STRING}, "roofline_share": NUMBER,
                "chunk?": _or_null(INTEGER), "pieces?": _or_null(INTEGERS), "peak_gib?": _or_null(NUMBER),
                **_RUN},
    "baselines": {"engine": STRING, "fmt": STRING, "batch": COUNT, "context": COUNT, "fwd_ms": POSITIVE,
                  "e2e_ms": POSITIVE, "compile_s?": _or_null(NUMBER), "cudagraphs?": _or_null(BOOLEAN),
                  "graph_breaks?": _or_null(INTEGER), "cudagraph_notes?": _or_null(STRINGS), **_RUN},
    "baseline_failures": {"engine": STRING, "fmt": STRING, "batch": COUNT, "context": COUNT,
                          "error": STRING, **_RUN},
    "breakdown": {"fmt": STRING, "batch": COUNT, "context": COUNT, "method": STRING, "step_us": NUMBER,
                  "kernel_us": NUMBER, "gap_us": NUMBER, "kernels": INTEGER, "matched_to_plan?": BOOLEAN,
                  "ops": [{**_OPS, "per_layer": PER_LAYER}], **_RUN},
    "prefill_breakdown": {"fmt": STRING, "tokens": COUNT, "method": STRING, "step_us": NUMBER,
                          "kernel_us": NUMBER, "gap_us": NUMBER, "kernels": INTEGER, "ops": [_OPS], **_RUN},
    "kernels": {"fmt": STRING, "function": STRING, "measured?": _or_null(INTEGER), **_RUN},
    "unusable_builds": {"path": STRING, "why": STRING, **_RUN},
}


class RecordError(ValueError):
    """A results dict with a record the report cannot read. `where` is the path of the
    bad field (`decode[0].batch`, `breakdown[1].ops[2].us`), `expected` what it must be,
    `got` the value found and `missing` whether it is not there at all."""

    def __init__(self, where: str, expected: str, got=None, missing: bool = False):
        self.where, self.expected, self.got, self.missing = where, expected, got, missing
        if missing:
            record, _, name = where.rpartition(".")
            text = f"{record} has no {name!r} field (expected {expected})"
        else:
            shown = json.dumps(got, default=str)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            text = f"{where}: expected {expected}, got {shown}"
        super().__init__(text)


def _what(kind) -> str:
    return "an object" if isinstance(kind, dict) else "a list of objects" if isinstance(kind, list) else kind[0]


def _check(value, kind, where: str) -> None:
    """`value` at `where` against `kind` (a kind, a dict of fields, or [dict of fields])."""
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            raise RecordError(where, "an object", value)
        for name, sub in kind.items():
            optional, name = name.endswith("?"), name.rstrip("?")
            if name in value:
                _check(value[name], sub, f"{where}.{name}")
            elif not optional:
                raise RecordError(f"{where}.{name}", _what(sub), missing=True)
    elif isinstance(kind, list):
        if not isinstance(value, list):
            raise RecordError(where, "a list of objects", value)
        for i, item in enumerate(value):
            _check(item, kind[0], f"{where}[{i}]")
    elif not kind[1](value):
        raise RecordError(where, kind[0], value)
    elif len(kind) > 2 and not kind[2][1](value):  # of the kind, out of its range
        raise RecordError(where, kind[2][0], value)


def non_finite(value, where: str = "") -> tuple[str, float] | None:
    """(path, value) of the first NaN or infinite number in `value` (dicts and lists
    walked; the path as `RecordError`'s: `decode[0].min_ms`), or None when there is none.
    JSON has no such numbers: json.dumps writes them as bare NaN / Infinity tokens, which
    no JSON parser but Python's reads."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        hit = non_finite(v, f"{where}.{k}" if isinstance(k, str) else f"{where}[{k}]")
        if hit:
            return hit
    return None


class NonFiniteError(FlintcError):
    """A results dict holding NaN or an infinite number, which bench.json cannot hold."""


def dumps_results(results: dict) -> str:
    """`results` as bench.json's text: strict JSON (allow_nan=False: never a bare NaN or
    Infinity token). Raises NonFiniteError naming the field (`decode[0].fwd_ms`) when a
    value is NaN or infinite (a measurement gave no valid number)."""
    try:
        return json.dumps(results, indent=1, default=str, allow_nan=False)
    except ValueError:
        where, value = non_finite(results) or ("a field", float("nan"))
        raise NonFiniteError(f"bench.json not written: {where.lstrip('.')} is {value!r}, not a finite number "
                             "(a measurement gave no valid value)") from None


def check_records(results: dict) -> None:
    """Check that `results` (a results dict read back from a bench.json: an object whose
    sections are the objects and lists of objects a report has) holds every field the
    report reads, of the kind it reads (`RECORD_FIELDS`): numbers are JSON numbers (not
    strings, not true/false), finite and >= 0 (> 0 for times and rates: a negative,
    NaN or Infinity timing used to render), counts integers, names strings; no number
    anywhere is NaN or infinite (JSON has none: they were written back as bare NaN
    tokens). Fields that runs of older
    code lack are optional; a section that is missing or null is not checked. Raises
    RecordError naming the first bad field by its path (`decode[0].batch`) and what was
    expected."""
    for section, fields in RECORD_FIELDS.items():
        if results.get(section) is not None:
            _check(results[section], fields if section in ("meta", "ceilings") else [fields], section)
    hit = non_finite(results)  # in a field the report does not read: it would be written back as NaN
    if hit:
        raise RecordError(hit[0].lstrip("."), "a finite number", hit[1])


def find(records: list[dict], **key) -> dict | None:
    """The last record whose fields equal `key` (None when there is none)."""
    hit = None
    for r in records:
        if all(r.get(k) == v for k, v in key.items()):
            hit = r
    return hit


def _source_runs(run: dict, source: str | None) -> list[dict]:
    """The runs one results dict holds, each its meta with its own `ceilings` and
    `source` (the file it was read from): one, or those of an earlier merge."""
    if run["meta"].get("runs"):
        return [dict(r, source=r.get("source") or source) for r in run["meta"]["runs"]]
    meta = {k: v for k, v in run["meta"].items() if k != "runs"}
    return [dict(meta, ceilings=dict(run.get("ceilings") or {}), source=source)]


def merge_results(runs: list[dict], sources: list[str] | None = None) -> dict:
    """Join several results dicts (module doc). The merged meta and ceilings are the
    first run's; `meta["runs"]` lists every source run's meta with its own `ceilings`
    and `source` (the file names in `sources`, when given), which the report's header
    shows one line each, numbered from 1; with more than one run, every record gets
    `run`, the number of the run it comes from (the report's "run" column; an unusable
    build that several runs name is kept once, with the last of them). `notes` and
    `failures` are each run's in turn. Raises ValueError for an empty list."""
    if not runs:
        raise ValueError("runs: expected at least one results dict")
    sources = list(sources) if sources is not None else [None] * len(runs)
    merged = {"meta": dict(runs[0]["meta"]), "ceilings": dict(runs[0].get("ceilings") or {}), "notes": [],
              "failures": []}
    merged["meta"]["runs"] = [r for run, src in zip(runs, sources) for r in _source_runs(run, src)]
    offsets, n = [], 0  # each input's first run number - 1 (an earlier merge holds several)
    for run, src in zip(runs, sources):
        offsets.append(n)
        n += len(_source_runs(run, src))
    for key, fields in LIST_KEYS.items():
        seen: dict[tuple, dict] = {}
        for run, offset in zip(runs, offsets):
            for rec in run.get(key, []):
                key_ = tuple(rec.get(f) for f in fields)
                seen[key_] = dict(rec, run=offset + int(rec.get("run", 1))) if n > 1 else rec
        merged[key] = list(seen.values())
    for run in runs:
        merged["notes"] += run.get("notes", [])
        merged["failures"] += run.get("failures", [])
        if not merged["ceilings"] and run.get("ceilings"):
            merged["ceilings"] = dict(run["ceilings"])
    return merged


def _top_ops(results: dict, fmt: str, batch: int | None, context: int | None, n: int = 3) -> str:
    bds = [b for b in results.get("breakdown", []) if b["fmt"] == fmt]
    if not bds:
        return "no breakdown measured"
    exact = [b for b in bds if b["batch"] == batch and b["context"] == context]
    bd = (exact or bds)[0]
    parts = [f"{o['op']} {o['us']:.0f} us ({o['share']:.0%})" for o in bd["ops"][:n]]
    where = f"b{bd['batch']}/{bd['context']}"
    return f"{where}: " + ", ".join(parts) + f"; gaps {bd['gap_us']:.0f} us"


def _top_prefill_ops(results: dict, fmt: str, tokens: int | None = None, n: int = 3) -> str:
    """The largest kernel costs of `fmt`'s prefill breakdown of `tokens` tokens (else of
    the longest prefill measured)."""
    bds = [b for b in results.get("prefill_breakdown", []) if b["fmt"] == fmt]
    if not bds:
        return "no prefill breakdown measured"
    bd = next((b for b in bds if b["tokens"] == tokens), None) or max(bds, key=lambda b: b["tokens"])
    parts = [f"{o['op']} {o['us'] / 1e3:.1f} ms ({o['share']:.0%})" for o in bd["ops"][:n]]
    return f"prefill {bd['tokens']} tokens: " + ", ".join(parts) + f"; gaps {bd['gap_us'] / 1e3:.1f} ms"


def evaluate_targets(results: dict) -> list[dict]:
    """Each target of `TARGETS` against the results: {"key", "target", "limit", "unit",
    "measured" (None: not measured), "met", "by" (how far from the limit, words),
    "points_to" (the largest kernel costs, for missed decode targets)}. Empty unless
    every run measured the full model on a CUDA device (the targets are the H200's)."""
    out = []
    runs = results["meta"].get("runs", [results["meta"]])
    if not all(r.get("full_model") and str(r.get("device", "")).startswith("cuda") for r in runs):
        return out
    for key, desc, kind, fmt, batch, context, fld, op, limit, unit in TARGETS:
        measured, extra, vs_fast = None, "", {}
        if kind == "decode":
            r = find(results.get("decode", []), engine="flintc", fmt=fmt, batch=batch, context=context)
            measured = r.get(fld) if r else None
            if r and fld == "peak_gib":
                slots = r.get("kv_slots") or (r.get("build_max_batch") or 0) + 1  # runs before kv_slots
                extra = (f"weights + KV caches of {r.get('build')} "
                         f"({(r.get('kv_cache_bytes_allocated') or 0) / 2**30:.1f} GiB for "
                         f"{slots} slots x {r.get('build_max_model_len')} rows)")
        elif kind == "prefill":
            r = find(results.get("prefill", []), engine="flintc", fmt=fmt, tokens=context)
            measured = r.get(fld) if r else None
        elif kind == "kernels":
            r = find(results.get("kernels", []), fmt=fmt, function=f"decode_b{batch}")
            measured = r.get(fld) if r else None
        elif kind == "speedup":
            ours = find(results.get("decode", []), engine="flintc", fmt=fmt, batch=batch, context=context)
            base = find(results.get("baselines", []), engine="compile", fmt=fmt, batch=batch, context=context)
            if ours and base and ours.get(fld) and base.get(fld):
                measured = base[fld] / ours[fld]
                extra = f"torch.compile {base[fld]:.2f} ms, flintc {ours[fld]:.3f} ms"
            fast = find(results.get("baselines", []), engine="fast", fmt=fmt, batch=batch, context=context)
            if ours and fast and ours.get(fld) and fast.get(fld):
                vs_fast = {"vs_fast": fast[fld] / ours[fld], "fast_ms": fast[fld], "flintc_ms": ours[fld]}
        met = None
        by = "not measured"
        if measured is not None:
            met = measured <= limit if op == "<=" else measured >= limit
            if met:
                by = "met"
            elif op == "<=":
                by = f"{measured - limit:.3g} {unit} over ({(measured / limit - 1):.0%})"
            else:
                by = f"{limit - measured:.3g} {unit} short ({(1 - measured / limit):.0%})"
        points_to = ""
        if met is False and kind in ("decode", "speedup") and fld != "peak_gib":
            points_to = _top_ops(results, fmt, batch, context)
        elif met is False and kind == "prefill":
            points_to = _top_prefill_ops(results, fmt, context)
        elif met is False:
            points_to = extra
        out.append({"key": key, "target": desc, "op": op, "limit": limit, "unit": unit, "measured": measured,
                    "met": met, "by": by, "points_to": points_to, "detail": extra, **vs_fast})
    return out


# -- Markdown ------------------------------------------------------------------------------
def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def _table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(c).replace("|", "\\|") for c in row) + " |")
    return lines


def _chunks(r: dict) -> str:
    """A prefill point's calls: "16 x 512", "4 x 2048", "2 x 2048 + 2 x 512" (from its
    `pieces`, tokens per call; runs before session 17 recorded only `chunk`)."""
    pieces = r.get("pieces")
    if not pieces:
        return f"{-(-r['tokens'] // r['chunk'])} x {r['chunk']}" if r.get("chunk") else "-"
    counts: dict[int, int] = {}
    for size in pieces:
        counts[size] = counts.get(size, 0) + 1
    return " + ".join(f"{n} x {size}" for size, n in counts.items())


def _ctx(c: int) -> str:
    return f"{c // 1024}K" if c % 1024 == 0 and c >= 1024 else (f"{c / 1000:g}K" if c >= 1000 else str(c))


def render_markdown(results: dict, plots: list[str] | None = None) -> str:
    """The report (module doc) as Markdown."""
    m, c = results["meta"], results.get("ceilings", {})
    L = ["# flintc bench", ""]
    known = lambda key: m.get(key) or "unknown"  # noqa: E731 - null in older (or edited) records
    L.append(f"- Date: {known('date')}")
    mem = f", {m['device_memory_gib']} GiB" if m.get("device_memory_gib") else ""
    L.append(f"- Device: {known('device_name')} ({known('device')}{mem}); driver {m.get('driver') or '-'}")
    L.append(f"- Software: Python {known('python')}, torch {known('torch')} ("
             + (f"CUDA {m['cuda']}" if m.get("cuda") else "no CUDA") + f"), triton {known('triton')}, "
             f"flintc {known('flintc')}"
             + (f" (commit {m['flintc_commit']})" if m.get("flintc_commit") else "")
             + ("; Triton interpreter (TRITON_INTERPRET=1)" if m.get("triton_interpret") else ""))
    runs = m.get("runs") or [m]
    if len(runs) == 1:
        L.append(f"- Command: `{runs[0].get('command') or '(python API)'}` ({runs[0].get('wall_s', '-')} s)")
        if c:  # a run stopped while they were measured may lack one
            L.append(f"- Ceilings: copy bandwidth **{_fmt(c.get('copy_gbs'))} GB/s**, bf16 matmul "
                     f"**{_fmt(c.get('matmul_tflops'))} TFLOP/s** ({c.get('method', '')})")
    else:  # a merge: date, device and software above are the first run's; each run's own here
        L.append(f"- Merged from {len(runs)} runs; each row's roofline uses the ceilings of the run that "
                 "measured it:")
        for i, run in enumerate(runs, 1):
            rc = run.get("ceilings") or {}
            ceil = (f"copy bandwidth **{_fmt(rc['copy_gbs'])} GB/s**, bf16 matmul **{_fmt(rc['matmul_tflops'])} "
                    f"TFLOP/s**" if "copy_gbs" in rc and "matmul_tflops" in rc else "no ceilings recorded")
            L.append(f"  - Run {i}" + (f" ({run['source']})" if run.get("source") else "")
                     + f": {run.get('date', '-')}, {run.get('device_name') or run.get('device') or '-'}; "
                     + (f"flintc {run['flintc']}" + (f" (commit {run['flintc_commit']})"
                                                     if run.get("flintc_commit") else "") + "; "
                        if run.get("flintc") else "")
                     + f"{ceil}; `{run.get('command') or '(python API)'}` ({run.get('wall_s', '-')} s)")
        if c.get("method"):
            L.append(f"- Ceilings measured as: {c['method']}")
    for ld in results.get("loads", []):
        L.append(f"- {ld['fmt']} weights: {ld['source']}, {ld['weight_bytes'] / 1e9:.2f} GB, made/loaded in "
                 f"{ld['seconds']} s")
    for b in results.get("builds", []):
        L.append(f"- Build {Path(b['path']).name} ({b['fmt']}, backend {b['backend']}): batch <= {b['max_batch']}, "
                 f"context <= {b['max_model_len']}, KV caches {b['kv_cache_bytes'] / 2**30:.1f} GiB"
                 + (f"; loaded here with caches of {b['loaded_max_model_len']} positions "
                    f"({(b.get('loaded_kv_cache_bytes') or 0) / 2**30:.1f} GiB; its functions do not depend on "
                    "the cache length)" if b.get("loaded_max_model_len") not in (None, b["max_model_len"]) else ""))
    L.append("")

    dec = sorted(results.get("decode", []), key=lambda r: (r["fmt"], r["batch"], r["context"]))
    base = results.get("baselines", [])
    if dec:
        L += ["## Decode step", "",
              "Forward = one call of the decode function (embedding to fp32 logits): "
              + (m.get("timing") or "") + "; end to end = `runner.decode` + sampling (" + (dec[0].get("sampling") or "default") +
              ") + the token read on the host, wall clock. Medians. Roofline = bytes that must be read "
              "(active weights with the distinct experts the batch selected, plus the KV cache read) / copy "
              "bandwidth; % = roofline / measured.", ""]
        rows = []
        has_fast = any(b["engine"] == "fast" for b in base)  # its columns only when the run measured it
        for r in dec:
            e = find(base, engine="eager", fmt=r["fmt"], batch=r["batch"], context=r["context"])
            k = find(base, engine="compile", fmt=r["fmt"], batch=r["batch"], context=r["context"])
            f = find(base, engine="fast", fmt=r["fmt"], batch=r["batch"], context=r["context"])
            rows.append([r["fmt"], r["batch"], _ctx(r["context"]), r["fwd_ms"], r["e2e_ms"], r["roofline_ms"],
                         f"{r['fwd_roofline_share']:.0%}", f"{r['e2e_roofline_share']:.0%}",
                         r["distinct_experts"]["mean"], r["roofline"]["bytes"] / 1e9,
                         f"{_fmt(r.get('kernels_measured'))}/{_fmt(r.get('kernels_plan'))}", r.get("peak_gib"),
                         e["e2e_ms"] if e else None, k["e2e_ms"] if k else None,
                         f"{k['e2e_ms'] / r['e2e_ms']:.2f}x" if k and r["e2e_ms"] else "-"]
                        + ([f["e2e_ms"] if f else None, f"{f['e2e_ms'] / r['e2e_ms']:.2f}x" if f and r["e2e_ms"]
                            else "-"] if has_fast else [])
                        + ([r.get("run", "-")] if len(runs) > 1 else []))
        L += _table(["format", "batch", "context", "fwd ms", "e2e ms", "roofline ms", "fwd % roof", "e2e % roof",
                     "experts/layer", "GB read", "kernels graph/plan", "peak GiB", "eager e2e ms",
                     "compile e2e ms", "vs compile"] + (["fast e2e ms", "vs fast"] if has_fast else [])
                    + (["run"] if len(runs) > 1 else []), rows)
        L.append("")
    pre = sorted(results.get("prefill", []), key=lambda r: (r["fmt"], r["tokens"]))
    if pre:
        L += ["## Prefill", "", "One sequence, `runner.prefill` (chunks: calls x tokens per call), "
              + ("device events" if str(m.get("device", "")).startswith("cuda") else "time.perf_counter")
              + " around the call. Roofline = max(FLOPs / matmul rate, weight bytes / copy bandwidth).", ""]
        merged = len(runs) > 1
        L += _table(["format", "tokens", "chunks", "ms", "tokens/s", "roofline ms", "bound", "% roof", "peak GiB"]
                    + (["run"] if merged else []),
                    [[r["fmt"], r["tokens"], _chunks(r), r["ms"], r["tokens_per_s"], r["roofline_ms"],
                      r["roofline"]["bound"], f"{r['roofline_share']:.0%}", r.get("peak_gib")]
                     + ([r.get("run", "-")] if merged else []) for r in pre])
        L.append("")
    if base or results.get("baseline_failures"):
        fast_text = ("fast = the same `torch.compile` of the decode step of `flintc.bench.fast_model.FastFlintModel` "
                     "(bf16 activations and GEMMs, NVFP4 dequantized to bf16 per call, fp32 norms and softmax; "
                     "what a PyTorch user would write for speed). "
                     if any(b["engine"] == "fast" for b in base + results.get("baseline_failures", [])) else "")
        L += ["## Baselines", "", "Same weights. eager = the reference model (`flintc.model.reference`); compile = "
              "`torch.compile(mode=\"max-autotune\")` of its decode step with the KV cache as static inputs. "
              + fast_text + "Their KV caches hold exactly `context` rows.", ""]
        rows = []
        for r in sorted(base, key=lambda r: (r["engine"], r["fmt"], r["batch"], r["context"])):
            ours = find(dec, engine="flintc", fmt=r["fmt"], batch=r["batch"], context=r["context"])
            rows.append([r["engine"], r["fmt"], r["batch"], _ctx(r["context"]), r["fwd_ms"], r["e2e_ms"],
                         r.get("compile_s"), r.get("cudagraphs") if r["engine"] in ("compile", "fast") else "-",
                         r.get("graph_breaks") if r["engine"] in ("compile", "fast") else "-",
                         f"{r['e2e_ms'] / ours['e2e_ms']:.2f}x" if ours and ours["e2e_ms"] else "-"])
        L += _table(["engine", "format", "batch", "context", "fwd ms", "e2e ms", "compile s", "CUDA graphs",
                     "graph breaks", "flintc speedup (e2e)"], rows)
        for f in results.get("baseline_failures", []):
            L.append(f"- {f['engine']} {f['fmt']} b{f['batch']}/{_ctx(f['context'])} failed to compile: "
                     f"`{f['error']}`")
        notes = {n for r in base for n in (r.get("cudagraph_notes") or [])}
        for n in sorted(notes):
            L.append(f"- {n}" if n.startswith("Dynamo") else f"- Inductor: {n}")
        L.append("")
    targets = results.get("targets") or evaluate_targets(results)
    L += ["## Targets (issue 8, H200)", ""]
    if targets:
        L += _table(["target", "limit", "measured", "met", "by how much", "the breakdown points to"],
                    [[t["target"], f"{t['op']} {t['limit']} {t['unit']}", t["measured"], t["met"], t["by"],
                      t["points_to"] or "-"] for t in targets])
        vs_fast = [t for t in targets if t.get("vs_fast") is not None]
        if vs_fast:
            L += ["", "The same end-to-end points against the fast baseline (torch.compile of "
                  "`FastFlintModel`; no target of its own): "
                  + "; ".join(f"{t['target'].replace('vs torch.compile', 'vs fast')} {t['vs_fast']:.2f}x "
                              f"(fast {t['fast_ms']:.2f} ms, flintc {t['flintc_ms']:.3f} ms)" for t in vs_fast)
                  + "."]
    else:
        L.append("Not evaluated: the targets are for the full model on a GPU (this run: "
                 f"{m.get('layers') or '?'} layers on {known('device')}).")
    L.append("")
    for bd in results.get("breakdown", []):
        L += [f"## Where the time goes: {bd['fmt']} decode b{bd['batch']}/{_ctx(bd['context'])}", "",
              f"{bd['method']}. Step span {bd['step_us']:.0f} us = kernels {bd['kernel_us']:.0f} us + idle gaps "
              f"{bd['gap_us']:.0f} us; {bd['kernels']} kernels"
              + ("" if bd.get("matched_to_plan") else " (not matched to the plan's launches: grouped by name)")
              + ".", ""]
        rows = []
        for o in bd["ops"]:
            layers = sorted(((int(k), v) for k, v in o["per_layer"].items()), key=lambda kv: -kv[1])[:3]
            rows.append([o["op"], o["calls"], o["us"], o["us_per_call"], f"{o['share']:.0%}",
                         ", ".join(f"L{k}: {v:.1f}" if k >= 0 else f"model: {v:.1f}" for k, v in layers)])
        L += _table(["kernel (op)", "calls", "us", "us per call", "share", "largest layers (us)"], rows)
        L.append("")
    for bd in results.get("prefill_breakdown", []):
        L += [f"## Where the time goes: {bd['fmt']} prefill {bd['tokens']} tokens", "",
              f"{bd['method']}. Span {bd['step_us'] / 1e3:.1f} ms = kernels {bd['kernel_us'] / 1e3:.1f} ms + idle "
              f"gaps {bd['gap_us'] / 1e3:.1f} ms; {bd['kernels']} kernels.", ""]
        rows = [[o["op"], o["calls"], o["us"], o["us_per_call"], f"{o['share']:.0%}"] for o in bd["ops"][:25]]
        L += _table(["kernel", "calls", "us", "us per call", "share"], rows)
        if len(bd["ops"]) > 25:
            L.append(f"({len(bd['ops']) - 25} more kernel names, {sum(o['us'] for o in bd['ops'][25:]):.0f} us)")
        L.append("")
    if plots:
        L += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    if results.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    L += ["Method: decode at context C is the step of the token at position C-1 over C-1 cached tokens whose "
          "KV rows hold random bf16 (no kernel branches on values; no 262K-token prefill needed). Inputs rotate "
          "over several token-id/slot sets so neither the L2 cache nor the expert selection repeats. Distinct "
          "experts per layer: the ids the step's own routing kernels returned on an eager run of the same "
          "generated function and inputs (all rows of the bucket).", ""]
    return "\n".join(L)


# -- plots ---------------------------------------------------------------------------------
def _matplotlib_problem() -> str:
    """Why matplotlib cannot be used: 'is not installed' or the import's error."""
    try:
        import matplotlib.pyplot  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "matplotlib":
            return "is not installed"
        return f"does not import ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - a broken install (wrong wheel, missing library)
        return f"does not import ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    return "is installed"


def write_plots(results: dict, out: Path) -> list[str]:
    """Write the PNG plots (module doc) into `out` together (`render_plots`, then
    `flintc.fileio.write_texts_atomic`: an interrupted or failed write leaves no
    truncated PNG) and return their paths; [] when matplotlib does not import (not
    installed, or a broken install) or there is nothing to plot. Raises OSError naming
    the file whose write failed."""
    pngs = {Path(out) / name: data for name, data in render_plots(results).items()}
    write_texts_atomic(pngs)
    return [str(path) for path in pngs]


def _png(fig, plt) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def render_plots(results: dict) -> dict[str, bytes]:
    """The PNG plots (module doc) in memory, {file name: PNG bytes}, in the order
    decode_vs_context.png, latency_vs_batch.png, breakdown.png, each when there is
    something to plot; {} when matplotlib does not import (not installed, or a broken
    install). Nothing is written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - ImportError, or a broken install's other errors
        return {}
    written = {}
    dec = [r for r in results.get("decode", []) if r["engine"] == "flintc"]
    base = results.get("baselines", [])
    fmts = sorted({r["fmt"] for r in dec} | {r["fmt"] for r in base})
    if dec or base:
        fig, axes = plt.subplots(1, max(1, len(fmts)), figsize=(6.5 * max(1, len(fmts)), 4.8), squeeze=False)
        for ax, fmt in zip(axes[0], fmts):
            pts = sorted((r for r in dec if r["fmt"] == fmt and r["batch"] == 1), key=lambda r: r["context"])
            if pts:
                x = [r["context"] for r in pts]
                ax.plot(x, [r["fwd_ms"] for r in pts], "o-", label="flintc forward")
                ax.plot(x, [r["e2e_ms"] for r in pts], "s--", label="flintc end to end")
                ax.plot(x, [r["roofline_ms"] for r in pts], "k:", marker="_", markersize=12,
                        label="roofline (bytes / copy BW)")
            for eng, style in (("eager", "^-"), ("compile", "v-"), ("fast", "d-")):
                bp = sorted((r for r in base if r["fmt"] == fmt and r["engine"] == eng and r["batch"] == 1),
                            key=lambda r: r["context"])
                if bp:
                    ax.plot([r["context"] for r in bp], [r["e2e_ms"] for r in bp], style,
                            label={"eager": "eager end to end", "compile": "torch.compile end to end",
                                   "fast": "torch.compile (fast model) end to end"}[eng])
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("ms per decode step (batch 1)")
            ax.set_title(f"{fmt}: decode ms/token vs context")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        written["decode_vs_context.png"] = _png(fig, plt)
    if dec:
        fig, axes = plt.subplots(1, max(1, len(fmts)), figsize=(6.5 * max(1, len(fmts)), 4.8), squeeze=False)
        for ax, fmt in zip(axes[0], fmts):
            for ctx in sorted({r["context"] for r in dec if r["fmt"] == fmt}):
                pts = sorted((r for r in dec if r["fmt"] == fmt and r["context"] == ctx), key=lambda r: r["batch"])
                line, = ax.plot([r["batch"] for r in pts], [r["fwd_ms"] for r in pts], "o-",
                                label=f"flintc fwd, ctx {_ctx(ctx)}")
                ax.plot([r["batch"] for r in pts], [r["roofline_ms"] for r in pts], ":", marker="_",
                        markersize=12, color=line.get_color())
            for eng, style in (("eager", "^--"), ("compile", "v--"), ("fast", "d--")):
                ctx0 = min((r["context"] for r in base if r["fmt"] == fmt and r["engine"] == eng), default=None)
                bp = sorted((r for r in base if r["fmt"] == fmt and r["engine"] == eng and r["context"] == ctx0),
                            key=lambda r: r["batch"])
                if len(bp) > 0:
                    ax.plot([r["batch"] for r in bp], [r["fwd_ms"] for r in bp], style,
                            label=f"{eng} fwd, ctx {_ctx(ctx0)}")
            batches = sorted({r["batch"] for r in dec if r["fmt"] == fmt})
            if batches:
                ax.set_xscale("log", base=2)
                ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_yscale("log")
            ax.set_xlabel("batch size (sequences)")
            ax.set_ylabel("ms per decode step")
            ax.set_title(f"{fmt}: latency vs batch (dotted: roofline)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        written["latency_vs_batch.png"] = _png(fig, plt)
    bds = results.get("breakdown", [])
    if bds:
        fig, axes = plt.subplots(1, len(bds), figsize=(6.5 * len(bds), 4.2), squeeze=False)
        for ax, bd in zip(axes[0], bds):
            ops = bd["ops"][:10][::-1]
            ax.barh(["(idle gaps)"] + [o["op"] for o in ops], [bd["gap_us"]] + [o["us"] for o in ops])
            ax.set_xlabel("us per step (critical path)")
            ax.set_title(f"{bd['fmt']} b{bd['batch']}/{_ctx(bd['context'])}: {bd['step_us']:.0f} us, "
                         f"gaps {bd['gap_us']:.0f} us", fontsize=9)
        fig.tight_layout()
        written["breakdown.png"] = _png(fig, plt)
    return written


def write_outputs(results: dict, out: Path, plots: bool = True, log=print) -> dict:
    """Evaluate the targets, render the plots, then write bench.json, bench.md and the
    PNGs into `out` (made if missing), print the Markdown. Returns {"json", "markdown",
    "plots"} paths.

    The report is rendered before any file is written: a results dict it cannot render
    raises (KeyError, TypeError: `check_records` catches such dicts read back from a
    file) with nothing written. bench.json, bench.md and the PNGs are written as one
    group (`flintc.fileio.write_texts_atomic`): a failed write of their contents
    (OSError naming the file, e.g. a full disk) or a Ctrl-C leaves every file there as
    it was, never a truncated PNG (a failed rename, rare, can leave a new bench.json
    beside an old bench.md; so does a live `flintc bench` run until this call, as it
    saves bench.json alone after each step). A plotting failure is a note, not an
    error."""
    out = Path(out)
    results["targets"] = evaluate_targets(results)
    render_markdown(results, [])  # raises now, before any file is written
    dumps_results(results)  # likewise: NaN or Infinity (NonFiniteError)
    out.mkdir(parents=True, exist_ok=True)
    pngs: dict[Path, bytes] = {}
    if plots:
        try:
            pngs = {out / name: data for name, data in render_plots(results).items()}
        except Exception as e:  # noqa: BLE001 - a plotting failure must not cost the report
            results.setdefault("notes", []).append(
                f"plots not written: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        else:
            if not pngs and (results.get("decode") or results.get("baselines")):
                results.setdefault("notes", []).append(
                    f"plots not written: matplotlib {_matplotlib_problem()} (pip install 'flintc[bench]')")
    md = render_markdown(results, [str(p) for p in pngs])
    write_texts_atomic({out / "bench.json": dumps_results(results), out / "bench.md": md, **pngs})
    print(md, flush=True)
    return {"json": str(out / "bench.json"), "markdown": str(out / "bench.md"), "plots": [str(p) for p in pngs]}


__all__ = ["RECORD_FIELDS", "TARGETS", "NonFiniteError", "RecordError", "check_records", "dumps_results",
           "evaluate_targets", "find", "merge_results", "non_finite", "render_markdown", "render_plots", "write_outputs",
           "write_plots"]
