"""Override files for the measured launch-configuration tables (`gemv.TUNED`,
`moe.TUNED`): a JSON file named by an environment variable whose entries take precedence
over the table, so sweep winners can be tried in the whole model (a compiled build looks
its kernels and configurations up at launch) without editing the source.

Format, as `benchmarks/bench_gemv.py --tuned-json` and `benchmarks/bench_moe.py
--tuned-json` write it::

    {"entries": [{"key": [...], "config": {<dataclass fields>}, ...}, ...]}

Other fields of an entry (the measured microseconds) are ignored.
"""

from __future__ import annotations

import json
import os

from flintc.errors import InputError


class TuningEnvError(InputError, ValueError):
    """A FLINTC_* tuning environment variable is malformed: a user error (the CLI prints
    one line), and a ValueError for Python callers."""


_CACHE: dict[tuple[str, str, float], dict] = {}


def env_choice(env_var: str, choices: tuple[str, ...], default: str) -> str:
    """The value of `env_var` (stripped), one of `choices`; `default` when it is unset or
    empty.

    Raises:
        TuningEnvError: another value: "`env_var` must be a or b, got 'x'".
    """
    value = os.environ.get(env_var, "").strip()
    if value == "":
        return default
    if value not in choices:
        raise TuningEnvError(f"{env_var} must be {' or '.join(choices)}, got {value!r}")
    return value


def env_entries(var: str, parse, expected: str) -> list:
    """The `/`-separated entries of the tuning variable `var` (none when unset or blank),
    each stripped and passed through `parse`, which raises ValueError for a malformed one.

    Raises:
        TuningEnvError (a ValueError): naming `var`, the `expected` form and the entry.
    """
    out = []
    for entry in (e.strip() for e in os.environ.get(var, "").split("/") if e.strip()):
        try:
            out.append(parse(entry))
        except ValueError:
            raise TuningEnvError(f"{var}: expected entries {expected}; got {entry!r}") from None
    return out


def overrides(env_var: str, factory, key_types: tuple) -> dict:
    """The entries of the file named by `env_var` as {key tuple: factory(**config)}; empty
    when the variable is unset or blank. Re-read when the file changes.

    Args:
        env_var: environment variable holding the path (e.g. FLINTC_GEMV_TUNED).
        factory: the configuration dataclass (GemvConfig, MoeConfig).
        key_types: converters for the key's fields, e.g. (str, int, int, int).

    Raises:
        ValueError: the file is unreadable, not JSON, or an entry is malformed; the message
            names the variable, the file and the expected format.
    """
    path = os.environ.get(env_var, "").strip()
    if not path:
        return {}
    try:
        mtime = os.path.getmtime(path)
    except OSError as e:
        raise TuningEnvError(f"{env_var}={path}: cannot read the file ({e.strerror})") from None
    hit = _CACHE.get((env_var, path, mtime))
    if hit is not None:
        return hit
    try:
        with open(path) as f:
            data = json.load(f)
        table = {}
        for ent in data["entries"]:
            key = ent["key"]
            if len(key) != len(key_types):
                raise ValueError(f"key {key!r} has {len(key)} fields, expected {len(key_types)}")
            table[tuple(t(k) for t, k in zip(key_types, key))] = factory(**ent["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TuningEnvError(f"{env_var}={path}: expected {{\"entries\": [{{\"key\": [...], \"config\": "
                         f"{{{factory.__name__} fields}}}}]}}; {type(e).__name__}: {e}") from None
    _CACHE[(env_var, path, mtime)] = table
    return table


def check_environment() -> None:
    """Validate every kernel-tuning environment variable at once (FLINTC_PDL_TRIGGER,
    FLINTC_GEMV_TUNED, FLINTC_MOE_TUNED, FLINTC_NVFP4_MMA, and the CUDA kernels' launch
    knobs FLINTC_MMA_TRIGGER, FLINTC_MMA_GEMV_LAUNCH, FLINTC_MMA_GATE_UP_LAUNCH,
    FLINTC_MMA_DOWN_LAUNCH,
    FLINTC_MMA_NORM_GATE_UP_LAUNCH, FLINTC_MMA_NORM_GATE_UP_FORMATS,
    FLINTC_MMA_GATE_UP_ROUTE, FLINTC_MMA_L2_PREFETCH, FLINTC_MMA_EARLY_EPILOGUE;
    FLINTC_DECODE_ATTN_PRELOAD,
    FLINTC_DECODE_ATTN_RING_LAUNCH, FLINTC_DECODE_ATTN_MIN_ROWS;
    FLINTC_SAMPLER), so a
    bad value is
    reported when a runtime loads, not at the first launch that reads it (or never, on
    paths that do not).

    Raises:
        TuningEnvError: the first malformed variable, named with its value.
    """
    from flintc.kernels.gemv import GemvConfig
    from flintc.kernels.moe import MoeConfig
    from flintc.kernels import nvfp4_mma
    from flintc.kernels.pdl import pdl_mode

    pdl_mode(True)
    from flintc.kernels.decode_attention import full_min_rows, preload_enabled, ring_launch

    preload_enabled()
    ring_launch(1)
    full_min_rows()
    from flintc.sampling import sampler_backend

    sampler_backend()
    nvfp4_mma.enabled_from_env()
    nvfp4_mma.mma_trigger_early("gemv")
    nvfp4_mma.mma_l2_prefetch("gemv")
    nvfp4_mma.mma_early_epilogue("gemv")
    nvfp4_mma.gemv_launch("nvfp4", 16, 64)
    nvfp4_mma.gate_up_launch("nvfp4", 1)
    nvfp4_mma.down_launch("nvfp4", 1)
    nvfp4_mma.norm_gate_up_launch("nvfp4", 1)
    nvfp4_mma.norm_gate_up_formats()
    nvfp4_mma.gate_up_route()
    overrides("FLINTC_GEMV_TUNED", GemvConfig, (str, int, int, int))
    overrides("FLINTC_MOE_TUNED", MoeConfig, (str, str, int))


__all__ = ["TuningEnvError", "check_environment", "overrides"]
