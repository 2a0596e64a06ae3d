"""NVFP4 checkpoints: one GGUF v3 file, read and written with the `gguf` package.

Tensor names and types are those of FLINT_SPEC section 4 (llama.cpp conventions,
`general.architecture` = "flint"): `linear` weights are ggml NVFP4 (type 40,
super-blocks of 64 weights in 36 bytes), each with an optional F32 companion
`X.scale` holding its global scale (one value, or [E] for `*_exps`; 1.0 when
absent); embedding, LM head and router are BF16; norms, sinks and the correction
bias F32. GGUF lists dims innermost first, so a [N, K] matrix has ne = (K, N) and
a stack of experts [E, N, K] has ne = (K, N, E). The canonical names and shapes
come from :func:`flintc.model.weights.weight_specs`.

:func:`load_gguf` memory-maps the file with `gguf.GGUFReader`, checks the
architecture and every tensor's name, type and dims before converting anything,
then repacks the NVFP4 blocks losslessly into :class:`NVFP4Tensor` (the layout
flintc's kernels read; :func:`flintc.quant.nvfp4.ggml_to_packed`). Every problem is
a one-line :class:`CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
from tqdm import tqdm

from flintc.checkpoint.init import has_global_scale
from flintc.checkpoint.safetensors_io import check_finite, one_line, problems_message
from flintc.config import FlintConfig
from flintc.errors import CheckpointError
from flintc.fileio import naming_write_errors, signals_kept
from flintc.model.weights import TensorSpec, Weight, WeightDict, check_weights, weight_specs
from flintc.quant.nvfp4 import NVFP4FormatError, NVFP4Tensor, ggml_to_packed, packed_to_ggml
from flintc.quant.nvfp4 import quantize

ARCHITECTURE = "flint"
GGUF_VERSION = 3
GGUF_MAGIC = b"GGUF"
_TYPE_OF_KIND = {
    "linear": GGMLQuantizationType.NVFP4,
    "bf16": GGMLQuantizationType.BF16,
    "fp32": GGMLQuantizationType.F32,
}


def scale_name(gguf_name: str) -> str:
    """`blk.0.attn_q.weight` -> `blk.0.attn_q.scale`, the global-scale companion."""
    return gguf_name.removesuffix(".weight") + ".scale"


def gguf_ne(shape: tuple[int, ...]) -> tuple[int, ...]:
    """GGUF dims (innermost first) of a torch shape."""
    return tuple(reversed(shape))


# ---------------------------------------------------------------------------- saving
def save_gguf(config: FlintConfig, weights: WeightDict, path: str | os.PathLike) -> Path:
    """Write canonical `weights` as an NVFP4 GGUF file at `path`.

    `linear` weights given in bf16 are quantized with :func:`quantize`, with a global
    scale for attention and routed-expert weights and a unit one for dense-MLP and
    shared-expert weights (:func:`has_global_scale`); NVFP4Tensor weights are
    written as they are. A `X.scale` tensor is written only when a global scale is
    not 1. The file is written under a temporary name in the same folder, then
    renamed into place.

    Raises:
        CheckpointError: `weights` does not match `config` (see `check_weights`).
    """
    check_weights(config, weights, source="save_gguf")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = GGUFWriter(tmp, ARCHITECTURE)
    try:
        with naming_write_errors(path):  # a full disk: numpy's short write, no file named
            _write_gguf(writer, config, weights)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # its flush on a full disk: the error above stands
            writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write_gguf(writer: GGUFWriter, config: FlintConfig, weights: WeightDict) -> None:
    """The header, metadata and tensors of `save_gguf`'s file, through `writer`."""
    writer.add_name("flint")
    writer.add_file_type(LlamaFileType.MOSTLY_NVFP4)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_expert_count(config.n_routed_experts)
    for spec in weight_specs(config):
        _add_tensor(writer, spec, weights[spec.name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def _add_tensor(writer: GGUFWriter, spec: TensorSpec, w: Weight) -> None:
    if spec.kind == "fp32":
        writer.add_tensor(spec.gguf_name, w.detach().to("cpu", torch.float32).numpy())
        return
    if spec.kind == "bf16":
        bits = w.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy()
        writer.add_tensor(spec.gguf_name, bits, raw_dtype=GGMLQuantizationType.BF16)
        return
    q = w if isinstance(w, NVFP4Tensor) else quantize(w, use_global_scale=has_global_scale(spec))
    blocks = packed_to_ggml(q.codes, q.scales)  # uint8 [..., N, K/64*36]
    writer.add_tensor(spec.gguf_name, blocks, raw_dtype=GGMLQuantizationType.NVFP4)
    g = q.global_scale.detach().to("cpu", torch.float32).reshape(-1)
    if not bool((g == 1.0).all()):
        writer.add_tensor(scale_name(spec.gguf_name), g.numpy())


# ---------------------------------------------------------------------------- loading
def load_gguf(
    path: str | os.PathLike,
    config: FlintConfig,
    device: torch.device | str = "cpu",
    progress: bool = True,
    before_read: Callable[[], None] | None = None,
) -> WeightDict:
    """Load an NVFP4 GGUF file into the canonical weight dict. `before_read` is called
    once the header has been checked against `config`, before any tensor data is read
    (the loader's memory check: a file of another config is refused for that, not for
    the memory the config's weights would take); what it raises propagates.

    Returns:
        name -> weight on `device`: `linear` weights as NVFP4Tensor (codes uint8
        [..., N, K/2], scales float8_e4m3fn [..., N, K/16], global scale fp32 [] or
        [E]), embedding / LM head / router bf16, norms, sinks and bias fp32.

    Raises:
        CheckpointError: the file is missing, not GGUF, truncated (naming the first
            tensor whose data runs past the end, its byte range and the file's size,
            or the header's byte range) or corrupt, not GGUF v3, of another
            architecture; a tensor is missing or unexpected, of the wrong GGML type or
            dims; a global scale, or a value of a BF16 or F32 tensor, is not finite; a
            global scale is 0 or negative; an NVFP4 block scale byte has its top bit set.
    """
    path = Path(path)
    # a Ctrl-C that numpy or torch turned into another error (the reader's "truncated or
    # corrupt"), or swallowed: raised as itself (`flintc.fileio.signals_kept`)
    with signals_kept() as kept:
        reader = open_gguf(path)
        tensors = {t.name: t for t in reader.tensors}
        _validate(config, tensors, path)
        if before_read is not None:
            before_read()
        return _convert(config, tensors, path, torch.device(device), progress, kept.check)


def open_gguf(path: Path) -> GGUFReader:
    """Open `path` with GGUFReader and check its version and architecture.

    Raises:
        CheckpointError: as :func:`load_gguf`, for the file-level problems.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: GGUF file not found")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = _RangeCheckedReader(path, "r")
    except _PastEnd as exc:
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file: {exc}") from None
    except Exception as exc:  # the reader raises ValueError, IndexError, KeyError, ...
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({one_line(exc)})") from None
    version = reader.get_field("GGUF.version").contents()
    if version != GGUF_VERSION:
        raise CheckpointError(f"{path}: GGUF version {version}, expected {GGUF_VERSION}")
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch != ARCHITECTURE:
        raise CheckpointError(
            f"{path}: general.architecture is {arch!r}, expected {ARCHITECTURE!r}"
        )
    return reader


class _PastEnd(ValueError):
    """The header or a tensor's data runs past the end of the file; the message says
    which and the byte ranges."""


class _RangeCheckedReader(GGUFReader):
    """GGUFReader that checks every read of the header, and every tensor's byte range,
    against the file size before it slices the data.

    HACK: GGUFReader (gguf 0.19) slices past the end of a truncated file and then fails
    with an IndexError or a reshape error that names no tensor; this hooks its private
    `_get` and `_build_tensors` to say what runs past the end. Remove when the reader
    reports truncated files itself.
    """

    # Both hooks pass every argument on unchanged, and leave a layout they do not
    # recognise (another gguf version) to the reader's own checks and errors.
    def _get(self, offset, dtype, count=1, *args, **kwargs):
        try:
            stop = int(offset) + np.dtype(dtype).itemsize * int(count)
        except (TypeError, ValueError):
            stop = 0
        if stop > len(self.data):
            raise _PastEnd(
                f"the header needs bytes [{int(offset)}, {stop}), the file has {len(self.data)}"
            )
        return super()._get(offset, dtype, count, *args, **kwargs)

    def _build_tensors(self, start_offs, fields, *args, **kwargs):
        size = len(self.data)
        past_end = []
        for field in fields:
            try:
                _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_dtype[0])]
            except (ValueError, KeyError, TypeError, AttributeError, IndexError):
                continue  # a type or layout this check does not know: the reader's own error
            start = int(start_offs + offset_tensor[0])
            stop = start + int(np.prod(dims, dtype=np.uint64)) * type_size // block_size
            if stop > size:
                past_end.append((start, stop, bytes(name_data).decode("utf-8", "replace")))
        if past_end:
            start, stop, name = min(past_end)
            more = f" (and {len(past_end) - 1} more tensors after it)" if len(past_end) > 1 else ""
            raise _PastEnd(
                f"tensor {name} needs bytes [{start}, {stop}), the file has {size}{more}"
            )
        super()._build_tensors(start_offs, fields, *args, **kwargs)


def _expected(config: FlintConfig):
    """GGUF name -> (spec, GGML type, accepted ne tuples); `.scale` companions
    are included with their spec (a `linear` one) and type F32."""
    out = {}
    for spec in weight_specs(config):
        out[spec.gguf_name] = (spec, _TYPE_OF_KIND[spec.kind], (gguf_ne(spec.shape),))
        if spec.kind == "linear":
            scale_ne = ((spec.shape[0],),) if spec.is_stacked else ((1,), ())
            out[scale_name(spec.gguf_name)] = (spec, GGMLQuantizationType.F32, scale_ne)
    return out


def _validate(config: FlintConfig, tensors: dict, path: Path) -> None:
    """Check every tensor's name, type and dims against the spec table."""
    expected = _expected(config)
    problems = []
    for name, t in tensors.items():
        if name not in expected:
            problems.append(f"unexpected tensor {name}")
            continue
        _, want_type, want_ne = expected[name]
        ne = tuple(int(d) for d in t.shape)
        if t.tensor_type != want_type:
            problems.append(f"{name}: expected type {want_type.name}, found {t.tensor_type.name}")
        elif ne not in want_ne:
            problems.append(f"{name}: expected ne {list(want_ne[0])}, found {list(ne)}")
    for name, (spec, _, _) in expected.items():
        if name not in tensors and name == spec.gguf_name:
            problems.append(f"missing tensor {name}")
    if problems:
        raise CheckpointError(problems_message(path, problems))


def _convert(
    config: FlintConfig, tensors: dict, path: Path, device: torch.device, progress: bool,
    after_tensor: Callable[[], None] = lambda: None,
) -> WeightDict:
    """Convert the validated tensors, one at a time, into the canonical dict, calling
    `after_tensor()` before each (`KeptSignals.check`: a lost interrupt, at once)."""
    weights: WeightDict = {}
    specs = weight_specs(config)
    for spec in tqdm(specs, desc="Loading GGUF weights", unit="tensor", disable=not progress):
        after_tensor()
        t = tensors[spec.gguf_name]
        data = np.array(t.data)  # a copy out of the memory map
        if spec.kind == "linear":
            weights[spec.name] = _to_nvfp4(spec, data, tensors, path).to(device)
        elif spec.kind == "bf16":
            bits = torch.from_numpy(data.view(np.int16))
            weights[spec.name] = bits.view(torch.bfloat16).reshape(spec.shape).to(device)
        else:
            weights[spec.name] = torch.from_numpy(data).reshape(spec.shape).to(device)
        if spec.kind != "linear":
            check_finite(weights[spec.name], path, spec.gguf_name)
    return weights


def _to_nvfp4(spec: TensorSpec, data: np.ndarray, tensors: dict, path: Path) -> NVFP4Tensor:
    try:
        codes, scales = ggml_to_packed(data, spec.shape, name=spec.gguf_name)
    except NVFP4FormatError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    g_shape = (spec.shape[0],) if spec.is_stacked else ()
    companion = tensors.get(scale_name(spec.gguf_name))
    if companion is None:
        global_scale = torch.ones(g_shape, dtype=torch.float32)
    else:
        global_scale = torch.from_numpy(np.array(companion.data, dtype=np.float32))
        global_scale = global_scale.reshape(g_shape)
        if not bool(torch.isfinite(global_scale).all()):
            raise CheckpointError(
                f"{path}: {companion.name}: global scale is not finite "
                f"({global_scale.flatten()[:4].tolist()})"
            )
        if not bool((global_scale > 0).all()):  # 0 zeroes the weight, < 0 negates it
            bad = global_scale.flatten()
            i = int((bad <= 0).nonzero()[0])
            raise CheckpointError(
                f"{path}: {companion.name}: global scale {i} is {float(bad[i])}, expected a positive "
                "number (an NVFP4 encoder writes amax / (6 * 448), or 1)"
            )
    return NVFP4Tensor(codes, scales, global_scale)
