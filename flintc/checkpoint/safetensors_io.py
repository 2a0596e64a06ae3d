"""BF16 checkpoints in the Hugging Face safetensors layout (FLINT_SPEC section 4).

A folder holds `model.safetensors`, or shards `model-0000N-of-0000M.safetensors`
with `model.safetensors.index.json` (`{"metadata": {"total_size": bytes},
"weight_map": {tensor: shard}}`, the format of `transformers`' `save_pretrained`).
Tensor names are the Hugging Face names of the spec: one tensor per routed expert
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [Im, H]), matrices and norm
weights in bf16, `self_attn.sinks` and `e_score_correction_bias` in fp32.

In memory (the canonical dict of :func:`flintc.model.weights.weight_specs`) the
routed experts are stacked [E, N, K] and norm weights are fp32. :func:`save_bf16`
unstacks and rounds norms to bf16 (exact for weights that came from bf16);
:func:`load_bf16` stacks and upcasts (exact). The safetensors format itself is
https://github.com/huggingface/safetensors: an 8-byte little-endian header length,
a JSON header (`dtype`, `shape`, `data_offsets` per tensor), then the data.

The loader reads every header first and checks names, shapes, dtypes and file
sizes before it reads any tensor data; then it reads tensor by tensor (memory
mapped) onto the device. Every problem is a one-line :class:`CheckpointError`
naming the file and the first few tensors at fault.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flintc.fileio import naming_write_errors, signals_kept
from tqdm import tqdm

from flintc.config import FlintConfig
from flintc.errors import CheckpointError, listing
from flintc.model.weights import TensorSpec, WeightDict, check_weights, weight_specs
from flintc.quant.nvfp4 import NVFP4Tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_PROBLEMS = 4  # tensors listed in one error message
_MAX_HEADER_BYTES = 100 << 20  # the limit safetensors itself applies
_ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2,
    "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}
_TORCH_DTYPE = {"BF16": torch.bfloat16, "F32": torch.float32}

Header = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (dtype, shape)


def shard_name(index: int, count: int) -> str:
    """`model-0000N-of-0000M.safetensors` for shard `index` (1-based) of `count`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def file_dtype(spec: TensorSpec) -> str:
    """The safetensors dtype of `spec` in a BF16 checkpoint: sinks and the
    correction bias are F32, everything else (norm weights included) BF16."""
    if spec.kind == "fp32" and "norm" not in spec.name:
        return "F32"
    return "BF16"


def file_entries(config: FlintConfig) -> dict[str, tuple[TensorSpec, str, tuple[int, ...]]]:
    """HF tensor name -> (canonical spec, file dtype, file shape), in spec order."""
    out = {}
    for spec in weight_specs(config):
        shape = spec.shape[1:] if spec.is_stacked else spec.shape
        for hf_name in spec.hf_names:
            out[hf_name] = (spec, file_dtype(spec), shape)
    return out


# ---------------------------------------------------------------------------- saving
def save_bf16(
    config: FlintConfig,
    weights: WeightDict,
    out_dir: str | os.PathLike,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write canonical bf16 `weights` as a Hugging Face safetensors folder.

    Writes `out_dir/model.safetensors`, or, when `max_shard_bytes` is set, shards of
    at most that many bytes of tensor data (a larger single tensor gets a shard of
    its own) plus `model.safetensors.index.json`. The folder is created if needed;
    existing files of the same names are overwritten (atomicity is the caller's:
    see :func:`flintc.checkpoint.writer.make_checkpoint`).

    Returns:
        The safetensors files written.

    Raises:
        CheckpointError: `weights` does not match `config` (see `check_weights`).
        TypeError: a `linear` weight is an NVFP4Tensor (this writes BF16 only).
    """
    check_weights(config, weights, source="save_bf16")
    tensors = list(_file_tensors(config, weights))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is None:
        path = out_dir / SINGLE_FILE
        with naming_write_errors(path):  # a full disk: SafetensorError, not an OSError
            save_file(dict(tensors), str(path), metadata={"format": "pt"})
        return [path]
    shards = _plan_shards(tensors, max_shard_bytes)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        path = out_dir / shard_name(i, len(shards))
        with naming_write_errors(path):
            save_file(dict(shard), str(path), metadata={"format": "pt"})
        weight_map.update({name: path.name for name, _ in shard})
        paths.append(path)
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with naming_write_errors(out_dir / INDEX_FILE):
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def _file_tensors(config: FlintConfig, weights: WeightDict):
    """(HF name, contiguous CPU tensor in its file dtype), experts unstacked."""
    for spec in weight_specs(config):
        w = weights[spec.name]
        if isinstance(w, NVFP4Tensor):
            raise TypeError(f"save_bf16 writes bf16 weights; {spec.name} is NVFP4")
        w = w.detach().to("cpu", _TORCH_DTYPE[file_dtype(spec)])
        if not spec.is_stacked:
            yield spec.hf_names[0], w.contiguous()
            continue
        for e, hf_name in enumerate(spec.hf_names):
            yield hf_name, w[e].contiguous()


def _plan_shards(tensors, max_shard_bytes: int):
    """Split (name, tensor) pairs, in order, into shards of <= max_shard_bytes."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, found {max_shard_bytes}")
    shards, current, size = [], [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, t))
        size += nbytes
    if current:
        shards.append(current)
    return shards


# ---------------------------------------------------------------------------- loading
def load_bf16(
    folder: str | os.PathLike,
    config: FlintConfig,
    device: torch.device | str = "cpu",
    progress: bool = True,
    before_read: Callable[[], None] | None = None,
) -> WeightDict:
    """Load a BF16 safetensors folder into the canonical weight dict. `before_read` is
    called once the headers have been checked against `config`, before any tensor data
    is read (the loader's memory check: a folder of another config is refused for that,
    not for the memory the config's weights would take); what it raises propagates.

    Returns:
        name -> tensor on `device`: matrices, embedding, LM head and router bf16,
        routed experts stacked [E, N, K], norm weights upcast to fp32, sinks and
        correction bias fp32.

    Raises:
        CheckpointError: no weights file in `folder`; an unreadable index or a shard
            it names that is missing; a file that is not safetensors, is truncated or
            corrupt; missing, unexpected, mis-shaped or mis-typed tensors (all
            checked from the headers before any data is read); a tensor holding NaN or
            infinite values (`check_finite`).
    """
    folder = Path(folder)
    files, weight_map, source = _find_files(folder)
    headers = {path: read_header(path) for path in files}
    located = _validate(config, headers, weight_map, source)
    if before_read is not None:
        before_read()
    return _read_tensors(config, located, torch.device(device), progress)


def _find_files(folder: Path) -> tuple[list[Path], dict[str, str] | None, Path]:
    """The safetensors files of `folder`, its index's weight map (None when
    single-file) and the path to name in errors."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_index(index_path)
        files = []
        for fname in sorted(set(weight_map.values())):
            if not (folder / fname).is_file():
                tensor = next(n for n, f in weight_map.items() if f == fname)
                raise CheckpointError(
                    f"{index_path}: shard {fname} (holding {tensor}) not found in {folder}"
                )
            files.append(folder / fname)
        return files, weight_map, index_path
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single], None, single
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _read_index(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable JSON index ({one_line(exc)})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{path}: expected a 'weight_map' object of tensor -> file names")
    if any(os.sep in v or v.startswith(".") for v in weight_map.values()):
        raise CheckpointError(f"{path}: weight_map names a file outside the checkpoint folder")
    return weight_map


def read_header(path: Path) -> Header:
    """Parse and check a safetensors header: tensor name -> (dtype, shape).

    Raises:
        CheckpointError: not a safetensors file, a malformed header, a file
            shorter than the data its header describes (truncated: the message names
            the first tensor whose data runs past the end, its byte range and the
            file's size), tensors whose data_offsets overlap or leave a gap (naming
            the first such tensor in offset order), or bytes after the last tensor's
            data (`_check_packed`).
    """

    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{path}: {msg}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"not a safetensors file ({size} bytes, shorter than a header)")
            n = int.from_bytes(head, "little")
            if n < 2 or n > _MAX_HEADER_BYTES:
                raise bad(f"not a safetensors file (header length {n} is out of range)")
            if n > size - 8:
                raise bad(f"truncated or not a safetensors file (header of {n} bytes, "
                          f"file of {size})")
            raw = json.loads(f.read(n))
    except OSError as exc:
        raise bad(f"cannot read ({one_line(exc)})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad("not a safetensors file (its header is not JSON)") from None
    if not isinstance(raw, dict):
        raise bad("not a safetensors file (its header is not a JSON object)")
    raw.pop("__metadata__", None)
    header: Header = {}
    spans = []  # (start, stop, name) of every tensor, offsets in the data section
    past_end = []  # (start, stop, name) of each tensor whose data runs past the end
    for name, info in raw.items():
        try:
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            start, stop = (int(x) for x in info["data_offsets"])
            numel = int(torch.Size(shape).numel())
            if not 0 <= start <= stop:
                raise ValueError
        except (TypeError, KeyError, ValueError, RuntimeError):
            raise bad(f"{name}: malformed header entry {info!r}") from None
        if dtype in _ITEM_BYTES and stop - start != numel * _ITEM_BYTES[dtype]:
            raise bad(f"{name}: header gives {stop - start} bytes for {dtype} {list(shape)}")
        header[name] = (dtype, shape)
        spans.append((start, stop, name))
        if 8 + n + stop > size:
            past_end.append((8 + n + start, 8 + n + stop, name))
    if past_end:
        start, stop, name = min(past_end)
        more = f" (and {len(past_end) - 1} more tensors after it)" if len(past_end) > 1 else ""
        raise bad(f"truncated: tensor {name} needs bytes [{start}, {stop}), "
                  f"the file has {size}{more}")
    _check_packed(spans, 8 + n, size, bad)
    return header


def _check_packed(spans, data_start: int, size: int, bad) -> None:
    """The safetensors format packs the tensors' data back to back, in the order of their
    offsets, and covers the file to its end (safetensors itself refuses anything else,
    naming the first tensor out of place, but only when a tensor is read: "cannot read
    (... invalid offset for tensor T)" came under the name of whichever tensor was read
    first). `spans` are (start, stop, name) in the data section, which starts at byte
    `data_start` of a file of `size` bytes. Raises `bad(message)` naming the first
    tensor (in offset order) that overlaps the one before it or leaves a gap after it,
    or the bytes no tensor covers at the end."""
    end, before = 0, None
    for start, stop, name in sorted(spans):
        if start < end:
            raise bad(f"tensor {name}: its data_offsets [{start}, {stop}) overlap those of {before} (which end "
                      f"at {end}); the header is corrupt")
        if start > end:
            raise bad(f"tensor {name}: its data_offsets [{start}, {stop}) leave bytes [{end}, {start}) unused "
                      f"after {before or 'the header'} (safetensors packs tensors back to back); the header is "
                      "corrupt")
        end, before = stop, name
    if data_start + end != size:
        raise bad(f"{size - data_start - end} bytes after the last tensor's data (the tensors end at byte "
                  f"{data_start + end} of {size}); not a valid safetensors file")


def _validate(
    config: FlintConfig,
    headers: dict[Path, Header],
    weight_map: dict[str, str] | None,
    source: Path,
) -> dict[str, Path]:
    """Check the headers against the spec table; return HF name -> file holding it."""
    expected = file_entries(config)
    sharded = weight_map is not None
    located: dict[str, Path] = {}
    bad_entries, unexpected = [], []
    for path, header in headers.items():
        where = f"{path.name}: " if sharded else ""
        for name, (dtype, shape) in header.items():
            if name in located:
                bad_entries.append(f"{where}{name} also in {located[name].name}")
                continue
            located[name] = path
            if name not in expected:
                unexpected.append(f"{where}unexpected {name}")
                continue
            _, want_dtype, want_shape = expected[name]
            if (dtype, shape) != (want_dtype, want_shape):
                bad_entries.append(
                    f"{where}{name}: expected {list(want_shape)} {want_dtype}, "
                    f"found {list(shape)} {dtype}"
                )
            elif sharded and weight_map.get(name) != path.name:
                mapped = weight_map.get(name)
                bad_entries.append(f"{where}{name}: not in the index's weight_map" if mapped is None else
                                   f"{where}{name}: the index maps it to {mapped}")
    missing = [f"missing {name}" for name in expected if name not in located]
    problems = bad_entries + missing + sorted(unexpected)
    if problems:
        raise CheckpointError(problems_message(source, problems))
    return located


def _read_tensors(
    config: FlintConfig, located: dict[str, Path], device: torch.device, progress: bool
) -> WeightDict:
    """Read the validated tensors, one at a time, into the canonical dict.

    A Ctrl-C or SIGTERM during the read is raised as itself (KeyboardInterrupt,
    Terminated), never as a "cannot read" error: torch may catch the KeyboardInterrupt
    inside `get_tensor` and raise its own error, or go on (`flintc.fileio.signals_kept`
    raises it again, at the latest after the tensor being read)."""
    weights: WeightDict = {}
    with signals_kept() as kept, ExitStack() as stack, tqdm(
        total=len(located), desc="Loading BF16 weights", unit="tensor", disable=not progress
    ) as bar:
        handles = {}

        def get(name: str) -> torch.Tensor:
            path = located[name]
            try:
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                tensor = handles[path].get_tensor(name)
            except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
                kept.check()  # an interrupt that torch turned into this error: the interrupt
                raise CheckpointError(f"{path}: {name}: cannot read ({one_line(exc)})") from None
            kept.check()  # one torch swallowed: now, not after the rest of the checkpoint
            bar.update(1)
            return tensor

        for spec in weight_specs(config):
            if not spec.is_stacked:
                t = get(spec.hf_names[0]).to(device)
                check_finite(t, located[spec.hf_names[0]], spec.hf_names[0])
                weights[spec.name] = t.float() if spec.kind == "fp32" else t
                continue
            stacked = torch.empty(spec.shape, dtype=torch.bfloat16, device=device)
            for e, hf_name in enumerate(spec.hf_names):
                stacked[e].copy_(get(hf_name))
                check_finite(stacked[e], located[hf_name], hf_name)
            weights[spec.name] = stacked
    return weights


def check_finite(t: torch.Tensor, source: str | os.PathLike, name: str) -> None:
    """Raise CheckpointError naming `source`, the tensor `name`, how many of its values
    are NaN or infinite and where the first one is, unless every value of the
    floating-point tensor `t` (any shape, on any device) is finite.

    A NaN in a norm weight, a sink or the correction bias turns every later
    activation into NaN (or the top-k into a fixed choice) with no other sign, so
    the loaders refuse such a checkpoint at load time; the check runs on `t`'s own
    device (on a GPU, about 1 ms per GB).
    """
    if not t.is_floating_point() or t.device.type == "meta":
        return
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return
    bad = ~finite
    count = int(bad.sum())
    first = [int(i) for i in bad.nonzero()[0]]
    value = float(t[tuple(first)])
    raise CheckpointError(f"{source}: {name}: {count} of {t.numel()} values are not finite "
                          f"(the first, at {first}, is {value}); the checkpoint is corrupt")


def problems_message(source: str | os.PathLike, problems: list[str]) -> str:
    """One line: `source`, then the first MAX_PROBLEMS problems and how many more."""
    return f"{source}: " + listing(problems, MAX_PROBLEMS, "; ")


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (for wrapping library errors)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
