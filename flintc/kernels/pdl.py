"""Programmatic dependent launch (PDL) modes of the decode and prefill kernels.

Every kernel of the schedule takes a `USE_PDL` constexpr:

- `PDL_OFF` (0): plain launch; no `griddepcontrol` instruction (the Triton interpreter
  and GPUs before sm_90 need this).
- `PDL_LATE` (1, the default): `gdc_wait` before the first read of anything an earlier
  kernel writes, `gdc_launch_dependents` after the main loop.
- `PDL_EARLY` (2): `gdc_launch_dependents` right before `gdc_wait`, i.e. as soon as the
  program has issued its own prefetch of weights. The next kernel's programs are then
  scheduled while this one still runs (where SM resources allow) and issue their weight
  loads before their own `gdc_wait`.

Measured on the H200 (2026-11-30, session 5, `scripts/gpu_pdl_ab.sh`, docs/gpu-runs.md):
the early trigger made the full decode step slower, not faster: batch 1, NVFP4 4.51 ->
5.53 ms at 1K, BF16 5.15 -> 7.01 ms; the O projection alone (graph of repeated launches)
11.8 -> 14.8 us (BF16). Programs launched early sit in `gdc_wait` holding registers and
warp slots on the SMs the running kernel needs, so `late` stays the default; `early` is
kept for the comparison (and for kernels whose pre-wait prefetch is the whole slice).

Correctness does not depend on the mode: `griddepcontrol.wait` blocks until every
prerequisite grid has completed and its memory operations are visible (PTX ISA,
"griddepcontrol"), whenever the dependents were launched; `launch_dependents` is only a
scheduling hint. What each kernel does before its `gdc_wait` must therefore read only
weights (never activations, caches, counters or workspaces) and write nothing; every
kernel here keeps to that.

The mode is read from the environment variable `FLINTC_PDL_TRIGGER` (`early` or `late`,
default `late`) at each launch, so a benchmark can compare the two in one build.
"""

from __future__ import annotations

import os

PDL_OFF = 0
PDL_LATE = 1
PDL_EARLY = 2

_MODES = {"early": PDL_EARLY, "late": PDL_LATE}


def pdl_mode(use_pdl: bool) -> int:
    """The `USE_PDL` constexpr for a launch: PDL_OFF when `use_pdl` is false, else the mode
    named by FLINTC_PDL_TRIGGER (default late).

    Raises:
        TuningEnvError (a ValueError): FLINTC_PDL_TRIGGER is set to something other than
            early / late (checked also when use_pdl is false).
    """
    name = os.environ.get("FLINTC_PDL_TRIGGER", "late").strip().lower() or "late"
    if name not in _MODES:  # checked even without PDL, so a typo never goes unnoticed
        from flintc.kernels.tuning import TuningEnvError

        raise TuningEnvError(f"FLINTC_PDL_TRIGGER must be 'early' or 'late'; got {name!r}")
    if not use_pdl:
        return PDL_OFF
    return _MODES[name]


__all__ = ["PDL_EARLY", "PDL_LATE", "PDL_OFF", "pdl_mode"]
