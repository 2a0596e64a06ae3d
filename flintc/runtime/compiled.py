"""The generated runtime: load a BUILD folder and run it (`CompiledRunner`).

The runner owns the weights (a `FlintModel` used only as the container of the
weights and the RoPE tables), static KV caches for `max_batch` sequence slots, and
the generated step functions of `BUILD/runtime.py`.

- Decode: a batch of n <= max_batch sequences runs in the smallest bucket >= n;
  the padding rows (position 0, token 0) carry a negative slot (`pad_slot`, vLLM's
  padded-slot convention), so they neither read nor write any cache row. (Until
  session 5 they used a scratch slot, a whole extra sequence of KV cache: 7 GiB of
  full-attention KV at 262K tokens.) On CUDA each bucket is captured once into a CUDA
  graph (its kernels launched with PDL where the backend's kernels support it) and
  replayed with the inputs copied into static buffers.
- Prefill: one sequence, `prefill_chunk` tokens per call of the prefill function, so
  the workspace is bounded whatever the prompt length. The last chunk is padded with
  token 0 at the positions that follow; those padding tokens write ring rows of the
  sliding layers that hold live positions, so the runner saves those rows before the
  chunk and puts them back after it (padding in full layers writes rows past the
  prompt, which decode overwrites before reading; the caches have one chunk of spare
  rows for it). A build whose chunk C is longer than the sliding window W also has
  prefill functions of every power of two below C down to `prefill_tail_chunk` (<= W)
  tokens (`prefill_sizes`): each call takes the longest that the tokens left fill, the
  rest runs as one padded tail chunk (`prefill_pieces`), so only a chunk of at most W
  tokens is ever padded (a padded chunk longer than W would leave its live tokens out
  of the ring). On CUDA with the triton backend the prefill function is captured once
  into a CUDA graph (`prefill_graph`) and each chunk is a replay with its inputs
  copied into static buffers: one chunk launches thousands of kernels, and run
  eagerly it is bound by the host (Python and launch overhead). The save/restore of
  the sliding rows stays eager around the replay. `FLINTC_PREFILL_GRAPHS=0` (or
  `load_build(..., prefill_graphs=False)`) runs prefill eagerly, for A/B measurements.
  A prefill function computes the LM head only for the row its `logits_rows` input
  names (the chunk's last real token, vLLM's logits_indices) and also returns the
  final-normed hidden states of the chunk: `prefill(..., all_logits=True)` applies the
  prefill kernel table's LM head to them (`logits_from_hidden`) for the other rows, as
  the function itself did for every row before build_version 2; each chunk's last row
  is the function's own, so it equals what a prefill without all_logits returns (the
  M = 1 GEMM may differ from the row of an M = C GEMM in the last fp32 bits).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch

from flintc.errors import CheckpointError, InputError, json_type
from flintc.ops.attention import pad_slot
from flintc.runtime.runner import check_request


def _load_module(path: Path, name: str):
    """Import the generated runtime. Raises InputError when it is missing or does not
    import (a corrupt or hand-edited build), naming the file and line."""
    if not path.is_file():
        raise InputError(f"{path} does not exist: the build is incomplete; regenerate it with flintc compile")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:
        raise InputError(f"{path}, line {e.lineno}: {e.msg}: the build is corrupt; regenerate it with "
                         "flintc compile") from None
    except Exception as e:  # noqa: BLE001 - any failure to import generated code means the same
        import traceback

        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if Path(f.filename).resolve() == path.resolve()]
        where = f", line {frames[-1].lineno}" if frames else ""
        raise InputError(f"{path}{where}: {type(e).__name__}: {e}: the build is corrupt; regenerate it "
                         "with flintc compile") from None
    if not isinstance(getattr(mod, "STEPS", None), dict):
        raise InputError(f"{path} defines no STEPS table: the build is corrupt; regenerate it with flintc compile")
    return mod


PREFILL_GRAPHS_ENV = "FLINTC_PREFILL_GRAPHS"


def prefill_graphs_from_env() -> bool:
    """Whether `FLINTC_PREFILL_GRAPHS` allows CUDA graphs for prefill: "1" (the default,
    also when unset or blank) or "0" (prefill runs the generated function eagerly, e.g.
    to measure what the graphs save). Raises InputError for any other value."""
    value = os.environ.get(PREFILL_GRAPHS_ENV, "").strip()
    if value in ("", "1"):
        return True
    if value == "0":
        return False
    raise InputError(f"{PREFILL_GRAPHS_ENV} must be 0 or 1, got {value!r}")


TRITON_MISSING = ("the triton backend needs Triton, which is not installed: pip install triton "
                  "(flintc's extra: pip install 'flintc[triton]'), or use --backend torch")


def check_environment(backend: str | None = None) -> None:
    """Validate every FLINTC_* variable a runtime reads when it loads or launches
    (FLINTC_PREFILL_GRAPHS and FLINTC_SAMPLER; for the triton backend also FLINTC_PDL_TRIGGER,
    FLINTC_GEMV_TUNED and FLINTC_MOE_TUNED, see `flintc.kernels.tuning.check_environment`),
    so that a bad value is reported before a compile or a weight load, not after.

    Args:
        backend: "torch", "triton", "auto" (the kernels' variables are checked when
            triton is installed) or None (same as "auto"). On a CPU call
            `flintc.runtime.device.prepare_device` first: checking the kernels'
            variables imports the kernel modules.

    Raises:
        InputError: the first malformed variable, named with its value and what is
            expected (TuningEnvError for the kernels' variables); the triton backend
            without Triton installed.
    """
    prefill_graphs_from_env()
    from flintc.sampling import sampler_backend

    sampler_backend()  # read by the sampler on every backend (TuningEnvError: an InputError)
    if backend == "torch":
        return
    if importlib.util.find_spec("triton") is None:
        if backend == "triton":
            raise InputError(TRITON_MISSING)
        return  # auto without triton: the reference ops, which read no variable
    from flintc.kernels.tuning import check_environment as check_kernel_environment

    check_kernel_environment()


# build.json's fields that the runtime reads as a number or a name, what each must be
_MANIFEST_COUNTS = ("max_batch", "max_model_len", "prefill_chunk", "prefill_tail_chunk", "cache_rows")
_MANIFEST_NAMES = {"backend": ("torch", "triton"), "weight_format": ("bf16", "nvfp4")}


def read_manifest(build: str | Path) -> dict:
    """BUILD/build.json. Raises InputError naming the file when BUILD is not a flintc
    build, or its build.json is not JSON (bytes that are not UTF-8 included), not a JSON
    object, lacks a field every build has, has
    another build_version, or a field the runtime reads of the wrong kind (a count such
    as max_batch that is not a positive integer, a backend or weight_format this flintc
    does not know, a device that is not a string, functions that are not an object):
    a hand-edited file used to fail later as a bare ValueError / TypeError / KeyError."""
    build = Path(build)
    path = build / "build.json"
    if not path.is_file():
        raise InputError(f"{build} is not a flintc build: {path} does not exist (run flintc compile)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # UnicodeDecodeError: bytes that are not UTF-8
        raise InputError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise InputError(f"{path}: expected a JSON object (a build manifest), got a JSON "
                         f"{json_type(manifest)}; rebuild with flintc compile")
    for key in ("build_version", "config", "weight_sha256", "functions", "max_batch"):
        if key not in manifest:
            raise InputError(f"{path} has no field {key!r}; rebuild with flintc compile")
    from flintc.runtime.build import BUILD_VERSION, BUILD_VERSION_CHANGES

    got = manifest["build_version"]
    if got != BUILD_VERSION:
        changed = [why for v, why in sorted(BUILD_VERSION_CHANGES.items())
                   if isinstance(got, int) and not isinstance(got, bool) and got < v <= BUILD_VERSION]
        since = f" (since then: {'; '.join(changed)})" if changed else ""
        raise InputError(f"{path}: build_version {got!r}, this flintc reads {BUILD_VERSION}{since}; "
                         "recompile it with flintc compile")
    for key in _MANIFEST_COUNTS:
        value = manifest.get(key)
        if key in manifest and not (key == "prefill_tail_chunk" and value is None) and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise InputError(f"{path}: {key} must be a positive integer, got {value!r} (the file was edited?); "
                             "rebuild with flintc compile")
    for key, names in _MANIFEST_NAMES.items():
        if key in manifest and manifest[key] not in names:
            raise InputError(f"{path}: {key} must be one of {', '.join(names)}, got {manifest[key]!r} (the file "
                             "was edited?); rebuild with flintc compile")
    if "device" in manifest and not (isinstance(manifest["device"], str) and manifest["device"]):
        raise InputError(f"{path}: device must be a device name such as cpu or cuda, got {manifest['device']!r} "
                         "(the file was edited?); rebuild with flintc compile")
    if not isinstance(manifest["functions"], dict):
        raise InputError(f"{path}: functions must be an object (function name -> its kernels), got a JSON "
                         f"{json_type(manifest['functions'])}; rebuild with flintc compile")
    _check_manifest_consistency(path, manifest)
    return manifest


def _check_manifest_consistency(path: Path, manifest: dict) -> None:
    """Fields that each look valid but contradict each other (a hand-edited build.json):
    max_batch above the largest compiled decode batch (a batch with no function, which
    failed as a bare StopIteration), max_model_len above the config's
    max_position_embeddings (the RoPE tables' length), and full-attention caches of fewer
    rows than max_model_len plus one prefill chunk (`BuildOptions.cache_rows`; an
    IndexError at the first write past them)."""
    batches = [f.get("batch") for f in manifest["functions"].values()
               if isinstance(f, dict) and f.get("step") == "decode"]
    batches = [b for b in batches if isinstance(b, int) and not isinstance(b, bool)]
    if batches and manifest["max_batch"] > max(batches):
        raise InputError(f"{path}: max_batch {manifest['max_batch']} exceeds the largest compiled decode batch "
                         f"{max(batches)} (the file was edited?); rebuild with flintc compile")
    rows, length, chunk = (manifest.get(k) for k in ("cache_rows", "max_model_len", "prefill_chunk"))
    limit = manifest["config"].get("max_position_embeddings") if isinstance(manifest["config"], dict) else None
    if isinstance(limit, int) and isinstance(length, int) and length > limit:
        raise InputError(f"{path}: max_model_len {length} exceeds the model's max_position_embeddings {limit} "
                         "(the file was edited?); rebuild with flintc compile")
    if None not in (rows, length, chunk) and rows < length + chunk:
        raise InputError(f"{path}: cache_rows {rows} is less than max_model_len + prefill_chunk = "
                         f"{length + chunk} (the file was edited?); rebuild with flintc compile")


def _pass_model_or_recompile(build: Path) -> str:
    """What to do when the checkpoint a build records cannot be loaded."""
    return (f"pass the checkpoint as MODEL (flintc run MODEL --build {build}; the same for flintc serve), "
            "or recompile with flintc compile")


def recorded_weight_source(build: str | Path, manifest: dict) -> str:
    """The weights BUILD/build.json records (`weight_source`): "dummy:<fmt>", or the
    absolute path of the checkpoint the build was compiled from, which must still exist.
    `load_build` calls it when no checkpoint is given; `flintc run --build` and `flintc
    serve --build` too, before they look for the tokenizer beside that checkpoint. A
    build of the embedded default model whose cached copy is gone (the cache was
    cleared) or damaged (any file of it: `flintc.checkpoint.default.check_default_folder`)
    gets it written again (`flintc.checkpoint.default.default_checkpoint`; it is
    deterministic, so the build's fingerprint still matches), with a one-line notice.

    Raises:
        InputError: build.json records no weight_source, or a path that no longer exists
            (the checkpoint was moved or deleted since the compile); the message names
            build.json and the path, and says to pass the checkpoint as MODEL or to
            recompile.
        CheckpointError: the path is there but is no checkpoint any more (a folder whose
            safetensors files were deleted: `flintc.checkpoint.loader.checkpoint_weight_format`,
            the check `load_checkpoint` makes first); so `flintc run --build` and
            `flintc serve --build` say so before they look for the tokenizer beside it
            (they said "no tokenizer found ... pass --tokenizer DIR"). Named as above.
    """
    build = Path(build)
    where, retry = build / "build.json", _pass_model_or_recompile(build)
    source = manifest.get("weight_source")
    if not isinstance(source, str) or not source:
        raise InputError(f"{where} records no weight_source (the checkpoint it was compiled from): {retry}")
    if source.startswith("dummy:"):
        return source
    from flintc.checkpoint.default import default_checkpoint, is_cached_default

    if is_cached_default(source):
        if not Path(source).parent.exists():
            print(f"flintc: the cached default model {Path(source).parent}, which {where} records, is gone; "
                  "writing it again", file=sys.stderr)
        default_checkpoint()  # checked whole; a damaged one (any file of it) is written again
        return source
    if not Path(source).exists():
        raise InputError(f"{where} records the checkpoint {source} (weight_source), which no longer exists "
                         f"(moved or deleted since the compile): {retry}")
    from flintc.checkpoint.loader import checkpoint_weight_format

    try:  # what load_checkpoint checks first: a GGUF file, or a folder with the safetensors files
        checkpoint_weight_format(source)
    except CheckpointError as e:  # its weights deleted since the compile (only config.json left)
        raise CheckpointError(f"{e} (the checkpoint {where} records: {retry})") from None
    return source


def check_weight_kind(build: str | Path, manifest: dict, load_format: str | None = None,
                      model: str | Path | None = None) -> None:
    """Refuse weights that can never match BUILD's, before anything loads: dummy (random)
    weights (`load_format` "dummy") for a build compiled from a checkpoint, or a checkpoint
    (`model`, or the default auto load) for a build compiled with dummy weights: their
    fingerprints never agree. Shared by `load_build` and `flintc serve --build` (which
    checks it up front). Nothing is checked when build.json records no weight_source.

    Raises:
        InputError: naming the build, what its build.json records and what to do.
    """
    source = manifest.get("weight_source")
    if not isinstance(source, str) or not source:
        return
    where = Path(build) / "build.json"
    if source.startswith("dummy:"):
        if load_format != "dummy":
            but = f", not with the weights of MODEL {model}: drop MODEL and" if model is not None else ";"
            raise InputError(f"{build} was compiled with dummy (random) weights ({where} records weight_source "
                             f"{source}){but} pass --load-format dummy (the same random weights are made again)")
    elif load_format == "dummy":
        raise InputError(f"--load-format dummy: {build} was compiled with the weights of {source} ({where} "
                         "records them as weight_source), not with dummy (random) weights; drop --load-format "
                         "dummy")


def recorded_tokenizer_places(build: str | Path, manifest: dict) -> list[tuple[Path, str]]:
    """Where BUILD/build.json says the tokenizer was at compile time, in the order to look
    there: the tokenizer folder it records (tokenizer_dir), then the folder of the
    checkpoint it records (weight_source; none for dummy weights). Each as (path, what it
    is, for messages); the paths are as recorded and may no longer exist."""
    where = Path(build) / "build.json"
    places: list[tuple[Path, str]] = []
    tok = manifest.get("tokenizer_dir")
    if isinstance(tok, str) and tok:
        places.append((Path(tok), f"the tokenizer folder {where} records"))
    source = manifest.get("weight_source")
    if isinstance(source, str) and source and not source.startswith("dummy:"):
        p = Path(source)
        folder = p.parent if p.is_file() or p.suffix == ".gguf" else p
        if all(folder != q for q, _ in places):
            places.append((folder, f"beside the checkpoint {where} records"))
    return places


def _first_tokenizer(places) -> Path | None:
    for p, _ in places:
        if (Path(p) / "tokenizer.json").is_file():
            return Path(p)
    return None


def stale_build_note(build: str | Path, manifest: dict) -> str | None:
    """Why BUILD's graphs may be out of date, or None: its build.json records another
    compiler fingerprint than this flintc's (`flintc.runtime.build.compiler_fingerprint`:
    the model, capture, passes, ops and code generator it was compiled by), or none (a
    build from before flintc recorded one). Such a build still runs (its ops keep their
    contracts) but may lack fusions or kernel arguments added since."""
    from flintc.runtime.build import compiler_fingerprint

    recorded = manifest.get("compiler_sha256")
    if recorded == compiler_fingerprint():
        return None
    what = (f"by other compiler code (compiler_sha256 {str(recorded)[:12]}, this flintc "
            f"{compiler_fingerprint()[:12]})" if recorded else
            "by a flintc that did not record its compiler fingerprint")
    return (f"{Path(build)} was compiled {what}: its schedule may lack fusions or kernel "
            "arguments added since; recompile with flintc compile to get them")


BUILD_LOAD_FORMATS = ("auto", "dummy")


def check_build_load_format(load_format) -> None:
    """Raises InputError naming load_format and the values a build takes
    (`BUILD_LOAD_FORMATS`, or None) unless it is one of them: another one was ignored
    (the build's checkpoint loaded as for "auto"), or refused as if it were "auto" for a
    build compiled with dummy weights."""
    if load_format is not None and load_format not in BUILD_LOAD_FORMATS:
        raise InputError(f"load_format must be {' or '.join(map(repr, BUILD_LOAD_FORMATS))} (or None) to load a "
                         f"build, got {load_format!r} (a build reads its checkpoint's format from build.json)")


def load_build(build: str | Path, model: str | Path | None = None, device: str | None = None,
               load_format: str | None = None, hf_config_path=None, progress: bool = True,
               use_cuda_graphs: bool = True, ckpt=None, prefill_graphs: bool | None = None) -> "CompiledRunner":
    """Load BUILD and its weights.

    Args:
        build: the BUILD folder written by `flintc compile`.
        model: the checkpoint to take the weights from (default: the one recorded in
            build.json, `recorded_weight_source`). Its config and weight fingerprint must
            match the build's.
        device: override the device recorded in the build ("cpu" or "cuda").
        load_format: "dummy" for a build compiled with dummy (random) weights: they are
            made again (same recipe, seed 0); else None (or "auto").
        use_cuda_graphs: on CUDA, replay decode (and prefill, see `prefill_graphs`) from
            CUDA graphs; False runs every step eagerly.
        ckpt: an already loaded checkpoint (skips loading; still checked).
        prefill_graphs: also run prefill chunks from a CUDA graph (CUDA, use_cuda_graphs,
            triton backend only). None: as FLINTC_PREFILL_GRAPHS says (default on).

    Raises:
        InputError: a `load_format` other than "auto", "dummy" or None
            (`check_build_load_format`); BUILD is not a build; no `model` given and the checkpoint build.json
            records no longer exists (`recorded_weight_source`: the message names
            build.json and the path); dummy weights for a build compiled from a
            checkpoint, or the reverse (`check_weight_kind`); the weights or config
            differ from the ones it was compiled for; the device is CUDA and there is no GPU; prefill_graphs=True
            with the torch backend; a FLINTC_* variable is malformed (`check_environment`);
            a triton build on the CPU with TRITON_INTERPRET set to other than 1, or with
            flintc's kernels imported before it was set (`use_triton_interpreter`; else
            TRITON_INTERPRET=1 is set here, as the CLI does for --device cpu); a triton
            build on CUDA when flintc's kernels were imported under TRITON_INTERPRET=1
            (`interpreted_kernel_modules`). With only the variable set, a UserWarning (slow
            paths).
        CheckpointError: the weights cannot be loaded (from the checkpoint build.json
            records, when no `model` is given: the message then names build.json). A
            build of the embedded default model (no `model` given) whose cached copy is
            damaged or gone gets it written again (`load_checkpoint_or_default`,
            `recorded_weight_source`).
    """
    from flintc.checkpoint.default import is_cached_default, load_checkpoint_or_default
    from flintc.checkpoint.loader import load_checkpoint
    from flintc.config import FlintConfig
    from flintc.runtime.build import config_fingerprint, weight_fingerprint

    check_build_load_format(load_format)
    build = Path(build)
    manifest = read_manifest(build)
    device = device or manifest.get("device", "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"{build} was compiled for {device} but no CUDA GPU is available "
                         "(pass --device cpu to run it on the CPU)")
    if manifest.get("backend") == "triton":
        from flintc.runtime.device import interpreted_kernel_modules, use_triton_interpreter

        if torch.device(device).type == "cpu":
            use_triton_interpreter(build)  # as `flintc run --device cpu`: before the kernels are imported
        elif interpreted := interpreted_kernel_modules():
            raise InputError(f"{build} runs Triton kernels on {device}, but {interpreted[0]} was "
                             "imported while TRITON_INTERPRET=1 was set (by the environment, or by an earlier CPU "
                             "run here: flintc.compile / flintc.load with device='cpu'), so its kernels run only "
                             "in Triton's interpreter in this process; load GPU builds in a process that has not "
                             "run flintc on the CPU")
        elif os.environ.get("TRITON_INTERPRET") == "1":
            import warnings

            warnings.warn(f"{build}: TRITON_INTERPRET=1 is set in this process (by the environment, or "
                          "by an earlier CPU run here: flintc.compile / flintc.load with device='cpu'), "
                          f"so on {device} the Triton kernels take the interpreter's paths and the CUDA "
                          "kernels stay off: slow. Run CPU and GPU work in separate processes, or unset "
                          "TRITON_INTERPRET before flintc's kernels are imported", stacklevel=2)
    check_environment(manifest.get("backend"))  # before the weights load
    config = FlintConfig.from_dict(manifest["config"], source=str(build / "build.json"))
    if config_fingerprint(config) != manifest.get("config_sha256"):
        raise InputError(f"{build / 'build.json'}: its config does not match its config_sha256 "
                         "(the file was edited); recompile with flintc compile")
    if ckpt is None:
        check_weight_kind(build, manifest, load_format, model)
        if load_format == "dummy":
            ckpt = load_checkpoint(None, device=device, load_format="dummy", config=config,
                                   fmt=manifest["weight_format"], progress=progress)
        elif model is None and is_cached_default(recorded_weight_source(build, manifest)):
            # a build of the embedded default model: a damaged cached copy is written again
            ckpt = load_checkpoint_or_default(None, hf_config_path=hf_config_path, device=device,
                                              progress=progress)
        else:
            source = model or recorded_weight_source(build, manifest)
            try:
                ckpt = load_checkpoint(source, hf_config_path=hf_config_path, device=device,
                                       progress=progress)
            except CheckpointError as e:
                if model is not None:
                    raise
                # the checkpoint is there but no longer loads (a file of it moved or deleted)
                raise CheckpointError(f"{e} (the checkpoint {build / 'build.json'} records: "
                                      f"{_pass_model_or_recompile(build)})") from None
    if config_fingerprint(ckpt.config) != manifest["config_sha256"]:
        raise InputError(f"the weights' config ({ckpt.source}) differs from the one {build} was "
                         "compiled for; recompile with flintc compile")
    if ckpt.fmt != manifest["weight_format"]:
        raise InputError(f"{build} was compiled for {manifest['weight_format']} weights, "
                         f"{ckpt.source} holds {ckpt.fmt}")
    if weight_fingerprint(ckpt.weights, ckpt.fmt, ckpt.source) != manifest["weight_sha256"]:
        raise InputError(f"the weights in {ckpt.source} are not the ones {build} was compiled "
                         "with (fingerprint differs); recompile, or pass the original checkpoint")
    runner = CompiledRunner(build, manifest, ckpt, torch.device(device), use_cuda_graphs=use_cuda_graphs,
                            prefill_graphs=prefill_graphs)
    note = stale_build_note(build, manifest)
    if note:  # once the build has loaded: an error above stays the only line
        import warnings

        from flintc.errors import StaleBuildWarning

        warnings.warn(note, StaleBuildWarning, stacklevel=2)
    return runner


def check_build_limits(build: str | Path, manifest: dict, max_model_len: int | None = None,
                       max_batch: int | None = None) -> None:
    """Check --max-model-len / --max-batch against BUILD/build.json (`manifest`, from
    `read_manifest`) before the weights load: None leaves the build's value; one up to it
    limits the run; a larger one cannot be met (the build fixes its caches and decode
    buckets at compile time). `limit_build` applies them after the load.

    Raises:
        InputError: a value below 1 or above the build's, naming the flag and the
            build's value.
    """
    for flag, value in (("--max-model-len", max_model_len), ("--max-batch", max_batch)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be at least 1, got {value}")
    if max_model_len is not None and max_model_len > int(manifest["max_model_len"]):
        have = manifest["max_model_len"]
        cap = (manifest.get("config") or {}).get("max_position_embeddings")
        if not isinstance(cap, int) or max_model_len <= cap:
            raise InputError(f"--max-model-len {max_model_len}: {build} was compiled for {have} positions (a build "
                             f"fixes its max model length at compile time); use --max-model-len {have} or less, "
                             f"drop the flag, or recompile with --max-model-len {max_model_len}")
        raise InputError(f"--max-model-len {max_model_len}: {build} was compiled for {have} positions, and no build "
                         f"takes more than {cap}, the positions the model serves (max_position_embeddings); use "
                         f"--max-model-len {have} or less, or drop the flag")
    if max_batch is not None and max_batch > int(manifest["max_batch"]):
        have = manifest["max_batch"]
        if max_batch <= 8:
            raise InputError(f"--max-batch {max_batch}: {build} was compiled for at most {have} sequences (a build "
                             f"fixes its decode buckets at compile time); use --max-batch {have} or less, drop the "
                             f"flag, or recompile with --max-batch {max_batch}")
        raise InputError(f"--max-batch {max_batch}: {build} was compiled for at most {have} sequences, and no build "
                         f"takes more than 8 (the decode schedule's GEMVs); use --max-batch {have} or less, or "
                         f"drop the flag")


def limit_build(runner: "CompiledRunner", build: str | Path, max_model_len: int | None = None,
                max_batch: int | None = None) -> None:
    """Apply --max-model-len / --max-batch to a runner loaded from `build` (shared by
    `flintc run --build` and `flintc serve --build`, which call `check_build_limits`
    before the load). None leaves the build's value; one up to it limits the run.

    Raises:
        InputError: as `check_build_limits` (against the runner's values).
    """
    check_build_limits(build, {"max_model_len": runner.max_model_len, "max_batch": runner.max_batch},
                       max_model_len, max_batch)
    if max_model_len is not None:
        runner.max_model_len = int(max_model_len)
    if max_batch is not None:
        runner.max_batch = int(max_batch)


class CompiledRunner:
    """A `ModelRunner` over a BUILD's generated functions.

    Attributes: config, device, max_batch, max_model_len (see `ModelRunner`),
    manifest (build.json), prefill_chunk, tokenizer_dir, kernels_per_forward
    (per function, from the plan); use_cuda_graphs (CUDA and not turned off) and
    prefill_graphs (prefill may use a graph too: the triton backend, not turned off by
    the argument or FLINTC_PREFILL_GRAPHS); prefill replays a graph when both are true
    (scripts flip either at run time to compare with eager runs).
    """

    def __init__(self, build: Path, manifest: dict, ckpt, device: torch.device,
                 use_cuda_graphs: bool = True, prefill_graphs: bool | None = None):
        from flintc.model.reference import FlintModel
        from flintc.runtime.kernels import KernelTable

        self.build, self.manifest = Path(build), manifest
        for key in ("max_model_len", "prefill_chunk", "cache_rows", "backend", "weight_format"):
            if key not in manifest:  # read_manifest checks their kind, when they are there
                raise InputError(f"{self.build / 'build.json'} has no field {key!r}; rebuild with flintc compile")
        self.config = ckpt.config
        self.device = device
        self.fmt = ckpt.fmt
        # beside the weights, else where build.json says it was at compile time (if still there)
        self.tokenizer_dir = ckpt.tokenizer_dir or _first_tokenizer(recorded_tokenizer_places(build, manifest))
        self.max_batch = int(manifest["max_batch"])
        self.max_model_len = int(manifest["max_model_len"])
        self.prefill_chunk = int(manifest["prefill_chunk"])
        # builds before session 17 have no tail function: their chunk is at most W
        self.prefill_tail_chunk = int(manifest.get("prefill_tail_chunk") or self.prefill_chunk)
        W = self.config.sliding_window
        if "sliding_attention" in self.config.layer_types and self.prefill_tail_chunk > W:
            # a padded chunk longer than W would leave its live tokens out of the ring
            raise InputError(f"{self.build}/build.json: prefill_tail_chunk {self.prefill_tail_chunk} is "
                             f"longer than the sliding window ({W}): the build has no tail prefill "
                             "function of at most W tokens; regenerate it with flintc compile")
        # builds before session 18 have no ladder: their chunk and tail only
        sizes = manifest.get("prefill_sizes") or [self.prefill_chunk, self.prefill_tail_chunk]
        if not isinstance(sizes, list) or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0
                                                  for c in sizes):
            raise InputError(f"{self.build}/build.json: prefill_sizes must be a list of positive integers "
                             f"(tokens per prefill function), got {sizes!r}")
        self.prefill_sizes = sorted(set(sizes), reverse=True)
        missing = [c for c in self.prefill_sizes if f"prefill_t{c}" not in manifest.get("functions", {})]
        if "functions" in manifest and missing:
            raise InputError(f"{self.build}/build.json: prefill sizes {missing} have no prefill_t<size> "
                             "function; regenerate the build with flintc compile")
        if self.prefill_sizes[0] != self.prefill_chunk or self.prefill_sizes[-1] != self.prefill_tail_chunk:
            raise InputError(f"{self.build}/build.json: prefill_sizes {self.prefill_sizes} must run from "
                             f"prefill_chunk {self.prefill_chunk} down to prefill_tail_chunk "
                             f"{self.prefill_tail_chunk}")
        self.cache_rows = int(manifest["cache_rows"])
        self.backend = manifest["backend"]
        if self.backend == "triton" and device.type == "cuda" and ckpt.fmt == "nvfp4":
            # the CUDA NVFP4 decode kernels' weight layout, converted in place before the
            # model takes references to the packed tensors (so they are freed) and before
            # the caches are sized (flintc.kernels.nvfp4_mma.prepack; a no-op when done)
            from flintc.kernels.nvfp4_mma import prepack

            prepack(ckpt.weights, ckpt.config)
        self.model = FlintModel(self.config, ckpt.weights, max_positions=self.cache_rows)
        self.kv = self.model.new_kv_cache(self.max_batch, self.cache_rows, device)
        self._module = _load_module(self.build / "runtime.py", f"flintc_build_{abs(hash(str(build)))}")
        plan_path = self.build / "plan.json"
        if not plan_path.is_file():
            raise InputError(f"{plan_path} does not exist: the build is incomplete; regenerate it with flintc "
                             "compile")
        try:
            self.plan = json.loads(plan_path.read_text())["steps"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"{plan_path} is not a valid plan ({type(e).__name__}: {e}): the build is "
                             "corrupt; regenerate it with flintc compile") from None
        buffers = dict(self.model.named_buffers())
        self._weights: dict[str, SimpleNamespace] = {}
        for name, step in self.plan.items():
            missing = [b for b in step["weights"].values() if b not in buffers]
            if missing:
                raise InputError(f"{self.build}/plan.json names weight {missing[0]!r}, which the "
                                 "model does not have; recompile")
            self._weights[name] = SimpleNamespace(**{a: buffers[b] for a, b in step["weights"].items()})
        self._weights_lm_head = self.model.lm_head.value  # bf16 [V, H] in every format
        if self.backend == "triton":  # a bad FLINTC_* tuning variable: one error now, not mid-run
            if importlib.util.find_spec("triton") is None:
                raise InputError(f"{self.build}: a triton build; {TRITON_MISSING}")
            from flintc.kernels.tuning import check_environment

            check_environment()
        self._tables = {step: KernelTable(self.backend, step) for step in ("decode", "prefill")}
        self.buckets = sorted(s["batch"] for s in self.plan.values() if s["step"] == "decode")
        self.kernels_per_forward = {name: s["kernels"] for name, s in self.plan.items()}
        self.sliding_caches = [t for i in range(self.config.num_hidden_layers)
                               if self.config.is_sliding_layer(i) for t in self.kv[2 * i:2 * i + 2]]
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self._graphs: dict[int, tuple] = {}
        self._static_inputs: dict[int, torch.Tensor] = {}  # bucket -> the graph's inputs [3, B]
        self._staging: dict[int, list] = {}  # bucket -> ring of (pinned [3, B], CUDA event)
        self._staging_next: dict[int, int] = {}
        # The torch backend's prefill_attention_kv (the reference op) takes each chunk's
        # first position to the host (.tolist()) and loops over key blocks in Python: it
        # cannot be captured, so its prefill stays eager.
        allowed = prefill_graphs_from_env() if prefill_graphs is None else bool(prefill_graphs)
        if prefill_graphs and self.backend != "triton":
            raise InputError(f"prefill_graphs=True needs the triton backend; {self.build} uses "
                             f"{self.backend!r} (its prefill attention reads positions on the host)")
        self.prefill_graphs = allowed and self.backend == "triton"
        self._prefill_entries: dict[int, tuple] = {}  # tokens per call -> captured graph
        self._prefill_workspaces: list[torch.Tensor] = []

    # -- the generated functions -------------------------------------------------------
    def _call(self, name: str, ids, positions, slots, logits_rows=None):
        """Call generated function `name`. A prefill function also takes logits_rows
        (int64 [B]: the row of its B*T tokens whose logits each sequence wants; None:
        each sequence's last token) and returns (fp32 logits [B, V] of those rows,
        final-normed hidden states [B, T, H]); a decode function returns logits [B, 1, V]."""
        step = self.plan[name]["step"]
        fn = self._module.STEPS[name]
        if step != "prefill":
            return fn(self._tables[step], self._weights[name], ids, positions, slots, self.kv, self.device)
        if logits_rows is None:  # each sequence's last token
            from flintc.graph.trace import last_rows

            logits_rows = last_rows(*ids.shape, device=ids.device)
        return fn(self._tables[step], self._weights[name], ids, positions, slots, logits_rows, self.kv,
                  self.device)

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed hidden states [N, H] (a prefill function's second
        output): fp32 logits [N, V], through the prefill kernel table's `lm_head`, the
        kernel (and on the CPU the expression) a prefill function ran over all its rows
        before it computed only the rows it returns."""
        return self._tables["prefill"].lm_head(hidden, self._weights_lm_head)

    def forward(self, name: str, input_ids: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, logits_rows: torch.Tensor | None = None):
        """Run one generated function directly (no padding, no CUDA graph): input_ids,
        positions int64 [B, T] and slots int64 [B] of the function's shapes. A decode
        function -> fp32 logits [B, 1, V]. A prefill function -> (fp32 logits [B, V] of
        `logits_rows`, int64 [B] rows of the B*T tokens, b*T + t; default each sequence's
        last token; final-normed hidden states [B, T, H]; `logits_from_hidden` turns them
        into every position's logits). Raises InputError for shapes the function was not
        built for."""
        if name not in self.plan:
            raise InputError(f"no function {name!r} in {self.build}; it has {sorted(self.plan)}")
        B, T = self.plan[name]["batch"], self.plan[name]["tokens"]
        if tuple(input_ids.shape) != (B, T) or tuple(positions.shape) != (B, T) or tuple(slots.shape) != (B,):
            raise InputError(f"{name} takes input_ids and positions [{B}, {T}] and slots [{B}]")
        if logits_rows is not None and (self.plan[name]["step"] != "prefill" or tuple(logits_rows.shape) != (B,)):
            raise InputError(f"{name} takes no logits_rows" if self.plan[name]["step"] != "prefill"
                             else f"{name} takes logits_rows [{B}]")
        with torch.inference_mode():
            return self._call(name, input_ids, positions, slots, logits_rows)

    # -- ModelRunner -----------------------------------------------------------------
    def prefill_pieces(self, num_tokens: int) -> list[tuple[int, int, int]]:
        """How `prefill` cuts a prompt of `num_tokens` tokens: (offset, live tokens, tokens
        per call) per call, in order. Each call takes the longest of `prefill_sizes` that
        the tokens left fill; when none does, the shortest (`prefill_tail_chunk`, at most
        W), padded: only the last call is padded. With a power-of-two prefill_chunk (the
        default) that is the fewest calls; with another (say 33: sizes 33, 32, 16, 8) it
        may not be (64 tokens: 33 + 16 + 8 + 7 padded, not 32 + 32)."""
        pieces, s = [], 0
        while s < num_tokens:
            left = num_tokens - s
            size = next((c for c in self.prefill_sizes if c <= left), self.prefill_sizes[-1])
            n = min(size, left)
            pieces.append((s, n, size))
            s += n
        return pieces

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: Sequence[int], start: int = 0,
                all_logits: bool = False) -> torch.Tensor:
        ids = [int(t) for t in token_ids]
        check_request(self, slot, start, ids)
        W = self.config.sliding_window
        graphed = self.use_cuda_graphs and self.prefill_graphs
        pieces = self.prefill_pieces(len(ids))
        if graphed:
            entries = {size: self._prefill_entries.get(size) or self._capture_prefill(size)
                       for size in {p[2] for p in pieces}}
            padded = sum(p[2] for p in pieces)
            # one upload for the whole prompt (a pageable host-to-device copy waits for the
            # stream: once per prompt, not once per chunk behind the previous replay)
            all_ids = torch.tensor(ids + [0] * (padded - len(ids)), device=self.device)
            for entry in entries.values():
                entry[3].fill_(slot)
        else:
            slots = torch.tensor([slot], device=self.device)
        out = []
        for s, n, C in pieces:
            piece = ids[s:s + n]
            p0 = start + s
            pad = C - n  # only the last piece, and then C <= W (or no sliding layer)
            saved = None
            if pad and self.sliding_caches:
                rows = torch.arange(p0 + n, p0 + C, device=self.device) % W
                saved = [(t, rows, t[slot, rows].clone()) for t in self.sliding_caches]
            if graphed:
                graph, s_ids, s_pos, _, s_rows, (s_logits, s_hidden) = entries[C]
                s_ids.copy_(all_ids[s:s + C][None])
                torch.arange(p0, p0 + C, out=s_pos[0])
                s_rows.fill_(n - 1)  # the last real token (a device fill: no host sync)
                graph.replay()
                last, hidden = s_logits, s_hidden  # static outputs: copied below
            else:
                tok = torch.tensor([piece + [0] * pad], device=self.device)
                pos = torch.arange(p0, p0 + C, device=self.device)[None]
                rows_in = torch.tensor([n - 1], device=self.device)
                last, hidden = self._call(f"prefill_t{C}", tok, pos, slots, rows_in)  # [1, V], [1, C, H]
            if saved:
                for t, rows, keep in saved:
                    t[slot, rows] = keep
            if all_logits:
                # every position's logits: the LM head over all C rows, as the function ran it
                # before it computed only the last (the same kernel and shapes: the same
                # numbers); the last row is the function's own, the one a prefill without
                # all_logits returns, so the two agree on it
                out.append(torch.cat([self.logits_from_hidden(hidden[0])[:n - 1], last]))
            else:
                out.append(last.clone())  # not a view: survives the next replay
        logits = torch.cat(out).float()
        return logits if all_logits else logits[-1]

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], token_ids: Sequence[int],
               positions: Sequence[int]) -> torch.Tensor:
        n = len(slots)
        if not 1 <= n <= self.max_batch or len(set(int(s) for s in slots)) != n:
            raise InputError(f"decode needs 1..{self.max_batch} distinct slots (--max-batch), got {list(slots)}")
        if len(token_ids) != n or len(positions) != n:
            raise InputError("decode needs one token id and one position per slot")
        for s, t, p in zip(slots, token_ids, positions):
            check_request(self, int(s), int(p), [int(t)])
        B = next(b for b in self.buckets if b >= n)
        pad = B - n
        rows = ([int(t) for t in token_ids] + [0] * pad, [int(p) for p in positions] + [0] * pad,
                [int(s) for s in slots] + ([self.pad_slot(slots)] * pad if pad else []))
        if self.use_cuda_graphs:
            logits = self._replay(B, rows)
        else:
            ids, pos, sl = (torch.tensor(r, device=self.device) for r in rows)
            logits = self._call(f"decode_b{B}", ids[:, None], pos[:, None], sl)
        return logits[:n, 0].float()

    def pad_slot(self, live_slots: Sequence[int]) -> int:
        """The slot id for the padding rows of a decode call whose live rows use
        `live_slots`: `flintc.ops.attention.pad_slot(f)` (negative) with f the lowest
        slot not among them, so the torch ops' no-op write-back of a padding row never
        meets a live row's write. Raises InputError when every slot is live (then the
        bucket has no padding)."""
        used = {int(s) for s in live_slots}
        slots = int(self.kv[0].shape[0])  # the caches' slots (max_batch may be lowered after loading)
        free = next((f for f in range(slots) if f not in used), None)
        if free is None:
            raise InputError(f"no free slot for padding rows: all {slots} slots are live")
        return pad_slot(free)

    # -- CUDA graphs -----------------------------------------------------------------
    def _graph_of(self, fn):
        """Run `fn` (no arguments) twice on a side stream, which compiles its Triton
        kernels and settles the allocator, then capture one call of it into a CUDA graph
        with its own memory pool. -> (torch.cuda.CUDAGraph, fn's output in that pool: the
        static tensors each replay rewrites). Raises what the capture raises (a host sync
        or another operation CUDA graphs cannot capture)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the Triton kernels, settle the allocator
                    fn()
        finally:  # also when a warm-up raised after queueing kernels: what runs next is ordered after them
            torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out

    STAGING_RING = 4  # host staging buffers per decode bucket (steps the host may run ahead)

    def _replay(self, B: int, rows: tuple[list[int], list[int], list[int]]):
        """Replay bucket B's graph on rows (token ids, positions, slots; B each): the three
        rows are written into a pinned host buffer [3, B] and reach the graph's static
        inputs, one device buffer [3, B], by one asynchronous copy (three `torch.tensor(...,
        device=cuda)` plus three device copies took 0.09-0.13 ms of host time per step on
        an H200, docs/gpu-runs.md session 17 run 8). A ring of `STAGING_RING` host buffers,
        each reused only after its earlier copy has completed (a CUDA event), lets the host
        queue steps ahead without overwriting a buffer a queued copy still reads."""
        entry = self._graphs.get(B) or self._capture(B)
        graph, out = entry[0], entry[4]
        ring = self._staging[B]
        host, done = ring[self._staging_next[B]]
        self._staging_next[B] = (self._staging_next[B] + 1) % len(ring)
        if done is not None:
            done.synchronize()  # the copy that last read this buffer has finished
        host.numpy()[:] = rows
        self._static_inputs[B].copy_(host, non_blocking=True)
        if done is not None:
            done.record(torch.cuda.current_stream(self.device))
        graph.replay()
        return out

    def _capture(self, B: int):
        """Capture decode_b{B} into a CUDA graph. The static inputs (views of one device
        buffer [3, B]: token ids, positions, slots) are padding rows (`pad_slot`) while
        warming up and capturing, so no live cache is changed."""
        name = f"decode_b{B}"
        static = torch.zeros(3, B, dtype=torch.long, device=self.device)
        static[2] = self.pad_slot(())
        s_ids, s_pos, s_sl = static[0].view(B, 1), static[1].view(B, 1), static[2]
        graph, out = self._graph_of(lambda: self._call(name, s_ids, s_pos, s_sl))
        cuda = self.device.type == "cuda"
        self._static_inputs[B] = static
        self._staging[B] = [(torch.zeros(3, B, dtype=torch.long, pin_memory=cuda),
                             torch.cuda.Event() if cuda else None) for _ in range(self.STAGING_RING)]
        self._staging_next[B] = 0
        entry = (graph, s_ids, s_pos, s_sl, out)
        self._graphs[B] = entry
        return entry

    def _capture_prefill(self, C: int):
        """Capture prefill_t{C} (C one of `prefill_sizes`) into a CUDA
        graph; see `prefill_graph`.

        The prefill kernels have no padding-slot convention (their KV write would take a
        negative slot as an address), so the warm-up runs, which execute, use slot 0 at
        positions 0..C-1 with token 0: they read no cache row (nothing precedes position
        0) and write rows 0..C-1 of slot 0 in every layer (full layers: rows = positions;
        sliding layers: ring rows p % W, all W of them when C >= W). Those rows are saved
        before and written back after, so whatever slot 0 holds (a live sequence, even
        with max_batch 1) is unchanged. The capture itself executes nothing.

        Raises:
            RuntimeError: the capture failed (an operation of the prefill path that CUDA
                graphs cannot capture, e.g. a host sync); the message names
                FLINTC_PREFILL_GRAPHS=0, which runs prefill eagerly.
        """
        name = f"prefill_t{C}"
        dev = self.device
        with torch.inference_mode(False):  # plain tensors: callers of prefill_graph may fill them anywhere
            s_ids = torch.zeros(1, C, dtype=torch.long, device=dev)
            s_pos = torch.arange(C, dtype=torch.long, device=dev)[None].clone()
            s_sl = torch.zeros(1, dtype=torch.long, device=dev)
            s_rows = torch.full((1,), C - 1, dtype=torch.long, device=dev)
        keep = [t[0, :C].clone() for t in self.kv]  # the rows the warm-up writes
        try:
            with torch.inference_mode():
                graph, out = self._graph_of(lambda: self._call(name, s_ids, s_pos, s_sl, s_rows))
        except RuntimeError as e:
            raise RuntimeError(f"capturing {name} into a CUDA graph failed: {e} (set "
                               f"{PREFILL_GRAPHS_ENV}=0 to run prefill eagerly)") from e
        finally:
            with torch.inference_mode():
                for t, k in zip(self.kv, keep):
                    t[0, :C] = k
        # The NVFP4 GEMM's shared dequantization workspace (flintc.kernels.gemm) is baked
        # into the graph by address: hold it (and those of the graphs captured before), so
        # a later call that grows (replaces) it cannot free the memory a graph writes.
        from flintc.kernels import gemm as gemm_kernels

        self._prefill_workspaces += list(gemm_kernels._WORKSPACE.values())
        self._prefill_entries[C] = (graph, s_ids, s_pos, s_sl, s_rows, tuple(out))
        return self._prefill_entries[C]

    def prefill_graph(self, tokens: int | None = None):
        """The CUDA graph of a prefill function (captured on first use) and its static
        buffers: (graph, input_ids int64 [1, C], positions int64 [1, C], slots int64 [1],
        logits_rows int64 [1], (logits fp32 [1, V], hidden states bf16 [1, C, H])) with C =
        `tokens` (one of `prefill_sizes`), default prefill_chunk. Fill the inputs
        (positions p0..p0+C-1, a slot in [0, max_batch), the row 0..C-1 whose logits are
        wanted: the last real token), `graph.replay()`, read the outputs before the next
        replay (`logits_from_hidden` gives every row's logits from the hidden states). A
        replay writes the chunk's K/V rows like the eager function (padding included:
        `prefill` saves and restores the sliding rows of a padded last chunk). Memory: the
        graph's private pool holds one chunk's intermediates and the outputs (the hidden
        states: 16 MiB at full size with 4,096 tokens; the fp32 logits of every row were
        2.5 GB).

        Raises:
            InputError: prefill graphs are off (no CUDA, use_cuda_graphs=False, the torch
                backend, FLINTC_PREFILL_GRAPHS=0), or the build has no function of
                `tokens` tokens.
            RuntimeError: the capture failed (see `_capture_prefill`).
        """
        if not (self.use_cuda_graphs and self.prefill_graphs):
            raise InputError("prefill graphs need a CUDA device, use_cuda_graphs=True, the triton backend "
                             f"and {PREFILL_GRAPHS_ENV} not 0")
        C = self.prefill_chunk if tokens is None else int(tokens)
        if C not in self.prefill_sizes:
            raise InputError(f"no prefill function of {C} tokens in {self.build}; it has "
                             f"{sorted(self.prefill_sizes)}")
        return self._prefill_entries.get(C) or self._capture_prefill(C)

    def decode_graph(self, B: int):
        """The CUDA graph of bucket B (captured on first use) and its static buffers:
        (graph, input_ids [B, 1], positions [B, 1], slots [B], logits [B, 1, V]). Fill
        the inputs, `graph.replay()`, read the logits. Raises InputError without CUDA
        graphs or for a bucket the build does not have."""
        if not self.use_cuda_graphs:
            raise InputError("decode graphs need a CUDA device (and use_cuda_graphs=True)")
        if B not in self.buckets:
            raise InputError(f"no decode bucket {B} in {self.build}; it has {self.buckets}")
        return self._graphs.get(B) or self._capture(B)

    def capture_all(self) -> None:
        """Capture every decode bucket now (otherwise each is captured on first use). The
        prefill graph is captured at the first prefill (or by `prefill_graph()`)."""
        if self.use_cuda_graphs:
            for B in self.buckets:
                if B not in self._graphs:
                    self._capture(B)

    def graph_kernel_count(self, B: int) -> int | None:
        """Kernels launched by one replay of bucket B's CUDA graph, counted from a
        torch.profiler (CUPTI) trace of one replay; memcpy/memset nodes are not kernels.
        None without CUDA graphs."""
        if not self.use_cuda_graphs:
            return None
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        graph = self.decode_graph(B)[0]
        graph.replay()
        torch.cuda.synchronize(self.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize(self.device)
        names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
        return sum(1 for n in names if not n.lower().startswith(("memcpy", "memset")))

    def release(self, slot: int) -> None:
        """Nothing to free: a slot's cache rows are overwritten by its next sequence."""


__all__ = ["CompiledRunner", "load_build", "read_manifest"]
