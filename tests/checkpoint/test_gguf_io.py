"""NVFP4 GGUF files: round trip, files from plain `gguf.GGUFWriter`, bad files.

The round-trip checks read the file independently with `gguf.GGUFReader` and decode
it with `gguf.quants.dequantize`: every repacked NVFP4Tensor must decode to the same
bits as ggml's decoder times the file's `.scale`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from flintc.checkpoint.gguf_io import load_gguf, save_gguf
from flintc.checkpoint.init import random_weights
from flintc.config import FlintConfig
from flintc.errors import CheckpointError
from flintc.model.weights import weight_specs
from flintc.quant.nvfp4 import NVFP4Tensor

T = GGMLQuantizationType
TINY = FlintConfig.preset("tiny")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    weights = random_weights(TINY, seed=3)
    path = tmp_path_factory.mktemp("gguf") / "model-nvfp4.gguf"
    save_gguf(TINY, weights, path)
    return weights, path


def file_decoded(path) -> dict[str, torch.Tensor]:
    """gguf name -> fp32 values, decoded by the gguf package alone."""
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        values = torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type)))
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is not None:
            g = torch.from_numpy(np.array(scale.data, dtype=np.float32))
            values = values * (g.view(-1, 1, 1) if values.dim() == 3 else g.view(()))
        out[name] = values
    return out


def test_round_trip_decodes_like_gguf(written):
    weights, path = written
    loaded = load_gguf(path, TINY, progress=False)
    reference = file_decoded(path)
    for spec in weight_specs(TINY):
        got, want = loaded[spec.name], reference[spec.gguf_name]
        if spec.kind == "linear":
            assert isinstance(got, NVFP4Tensor) and got.shape == spec.shape
            values = got.dequantize()
            assert torch.equal(values.view(torch.int32), want.view(torch.int32)), spec.name
            # and it is a fair quantization of what was written
            orig = weights[spec.name].float()
            err = (values - orig).pow(2).mean().sqrt() / orig.pow(2).mean().sqrt()
            assert err < 0.2, (spec.name, float(err))
        else:
            assert got.dtype == weights[spec.name].dtype
            assert torch.equal(got, weights[spec.name]), spec.name
            assert torch.equal(got.float(), want), spec.name


def test_global_scales_where_the_policy_says(written):
    _, path = written
    names = {t.name for t in GGUFReader(path).tensors}
    scales = {n for n in names if n.endswith(".scale")}
    assert "blk.0.attn_q.scale" in scales and "blk.3.attn_output.scale" in scales
    assert "blk.2.ffn_gate_exps.scale" in scales and "blk.2.ffn_down_exps.scale" in scales
    assert not any("shexp" in n or n.split(".")[2] in ("ffn_gate", "ffn_up", "ffn_down")
                   for n in scales)
    loaded = load_gguf(path, TINY, progress=False)
    exps = loaded["model.layers.2.mlp.experts.up_proj.weight"]
    assert exps.global_scale.shape == (TINY.n_routed_experts,)
    assert float(loaded["model.layers.0.mlp.up_proj.weight"].global_scale) == 1.0


def test_resaving_loaded_nvfp4_is_byte_identical(written, tmp_path):
    _, path = written
    loaded = load_gguf(path, TINY, progress=False)
    again = save_gguf(TINY, loaded, tmp_path / "again.gguf")
    assert again.read_bytes() == path.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["again.gguf"]  # no temp file left


def test_file_layout(written):
    _, path = written
    reader = GGUFReader(path)
    assert reader.get_field("GGUF.version").contents() == 3
    assert reader.get_field("general.architecture").contents() == "flint"
    t = {t.name: t for t in reader.tensors}
    H, Im, E = TINY.hidden_size, TINY.moe_intermediate_size, TINY.n_routed_experts
    assert (t["blk.0.attn_q.weight"].tensor_type, list(t["blk.0.attn_q.weight"].shape)) == (
        T.NVFP4, [H, TINY.q_size])
    assert list(t["blk.2.ffn_gate_exps.weight"].shape) == [H, Im, E]
    assert list(t["blk.2.ffn_down_exps.weight"].shape) == [Im, H, E]
    assert t["token_embd.weight"].tensor_type == T.BF16
    assert t["blk.2.ffn_gate_inp.weight"].tensor_type == T.BF16
    assert t["output_norm.weight"].tensor_type == T.F32
    assert list(t["blk.2.ffn_up_exps.scale"].shape) == [E]
    assert list(t["blk.0.attn_q.scale"].shape) == [1]


# ---------------------------------------------------------------------------- another writer
def spec_tensors(c: FlintConfig) -> list[tuple[str, GGMLQuantizationType, tuple[int, ...]]]:
    """(name, type, torch shape) of every tensor, written out from FLINT_SPEC section 4."""
    H, D, V, E = c.hidden_size, c.head_dim, c.vocab_size, c.n_routed_experts
    q, kv, I, Im = c.num_attention_heads * D, c.num_key_value_heads * D, c.intermediate_size, \
        c.moe_intermediate_size
    out = [("token_embd.weight", T.BF16, (V, H)), ("output.weight", T.BF16, (V, H)),
           ("output_norm.weight", T.F32, (H,))]
    for i in range(c.num_hidden_layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", T.F32, (H,)), (b + "ffn_norm.weight", T.F32, (H,)),
                (b + "attn_q.weight", T.NVFP4, (q, H)), (b + "attn_k.weight", T.NVFP4, (kv, H)),
                (b + "attn_v.weight", T.NVFP4, (kv, H)),
                (b + "attn_output.weight", T.NVFP4, (H, q)),
                (b + "attn_q_norm.weight", T.F32, (D,)), (b + "attn_k_norm.weight", T.F32, (D,)),
                (b + "attn_sinks.weight", T.F32, (c.num_attention_heads,))]
        if i < c.first_k_dense_replace:
            out += [(b + "ffn_gate.weight", T.NVFP4, (I, H)),
                    (b + "ffn_up.weight", T.NVFP4, (I, H)),
                    (b + "ffn_down.weight", T.NVFP4, (H, I))]
            continue
        out += [(b + "ffn_gate_inp.weight", T.BF16, (E, H)), (b + "exp_probs_b.bias", T.F32, (E,)),
                (b + "ffn_gate_exps.weight", T.NVFP4, (E, Im, H)),
                (b + "ffn_up_exps.weight", T.NVFP4, (E, Im, H)),
                (b + "ffn_down_exps.weight", T.NVFP4, (E, H, Im)),
                (b + "ffn_gate_shexp.weight", T.NVFP4, (Im, H)),
                (b + "ffn_up_shexp.weight", T.NVFP4, (Im, H)),
                (b + "ffn_down_shexp.weight", T.NVFP4, (H, Im))]
    return out


def foreign_arrays(c: FlintConfig, seed: int = 0) -> dict[str, tuple[np.ndarray, object]]:
    """name -> (array, raw_dtype) for GGUFWriter.add_tensor, made with numpy alone."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, qtype, shape in spec_tensors(c):
        if qtype == T.NVFP4:
            blocks = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 64 * 36), dtype=np.uint8)
            blocks.reshape(-1, 36)[:, :4] = rng.integers(0x20, 0x48, size=(blocks.size // 36, 4))
            out[name] = (blocks, T.NVFP4)
            if "attn_v" in name or "_exps" in name:  # a global scale on some tensors
                n = shape[0] if len(shape) == 3 else 1
                out[name.replace(".weight", ".scale")] = (
                    rng.uniform(0.001, 0.01, size=n).astype(np.float32), None)
        elif qtype == T.BF16:
            bits = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16)
            out[name] = (bits.astype(np.uint16).view(np.uint8), T.BF16)
        else:
            out[name] = (rng.standard_normal(shape).astype(np.float32), None)
    return out


def write_gguf(path, arrays, arch="flint"):
    writer = GGUFWriter(path, arch)
    for name, (array, raw_dtype) in arrays.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_file_from_plain_gguf_writer(tmp_path):
    path = write_gguf(tmp_path / "other.gguf", foreign_arrays(TINY))
    loaded = load_gguf(path, TINY, progress=False)
    reference = file_decoded(path)
    for spec in weight_specs(TINY):
        got = loaded[spec.name]
        values = got.dequantize() if isinstance(got, NVFP4Tensor) else got.float()
        want = reference[spec.gguf_name].reshape(spec.shape)
        assert torch.equal(values.view(torch.int32), want.view(torch.int32)), spec.name
    assert loaded["model.layers.0.self_attn.v_proj.weight"].global_scale.item() != 1.0
    assert loaded["model.layers.0.self_attn.q_proj.weight"].global_scale.item() == 1.0


# ---------------------------------------------------------------------------- bad files
@pytest.fixture(scope="module")
def good_arrays():
    return foreign_arrays(TINY, seed=1)


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_gguf(path, TINY, progress=False)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def test_missing_tensor(tmp_path, good_arrays):
    arrays = dict(good_arrays)
    del arrays["blk.1.attn_k.weight"]
    msg = load_error(write_gguf(tmp_path / "m.gguf", arrays))
    assert "missing tensor blk.1.attn_k.weight" in msg


def test_unexpected_tensor(tmp_path, good_arrays):
    arrays = dict(good_arrays)
    arrays["blk.0.attn_qkv.weight"] = (np.zeros(4, dtype=np.float32), None)
    arrays["blk.0.ffn_up.scale"] = (np.ones(1, dtype=np.float32), None)  # fine: a companion
    msg = load_error(write_gguf(tmp_path / "m.gguf", arrays))
    assert "unexpected tensor blk.0.attn_qkv.weight" in msg and "ffn_up" not in msg


def test_wrong_type_bf16_where_nvfp4_expected(tmp_path, good_arrays):
    arrays = dict(good_arrays)
    arrays["blk.0.attn_q.weight"] = (np.zeros((TINY.q_size, TINY.hidden_size * 2), np.uint8),
                                     T.BF16)
    msg = load_error(write_gguf(tmp_path / "m.gguf", arrays))
    assert "blk.0.attn_q.weight: expected type NVFP4, found BF16" in msg


def test_wrong_dims(tmp_path, good_arrays):
    arrays = dict(good_arrays)
    blocks, qtype = arrays["blk.2.ffn_up_exps.weight"]
    arrays["blk.2.ffn_up_exps.weight"] = (blocks[:-1], qtype)  # one expert short
    msg = load_error(write_gguf(tmp_path / "m.gguf", arrays))
    H, Im, E = TINY.hidden_size, TINY.moe_intermediate_size, TINY.n_routed_experts
    assert f"blk.2.ffn_up_exps.weight: expected ne [{H}, {Im}, {E}], found [{H}, {Im}, {E - 1}]" \
        in msg


def test_wrong_scale_dims(tmp_path, good_arrays):
    arrays = dict(good_arrays)
    arrays["blk.2.ffn_up_exps.scale"] = (np.ones(3, dtype=np.float32), None)
    msg = load_error(write_gguf(tmp_path / "m.gguf", arrays))
    assert "blk.2.ffn_up_exps.scale: expected ne [16], found [3]" in msg


def test_wrong_architecture(tmp_path, good_arrays):
    msg = load_error(write_gguf(tmp_path / "m.gguf", good_arrays, arch="llama"))
    assert "general.architecture is 'llama', expected 'flint'" in msg


def test_bad_block_scale_byte(tmp_path, good_arrays):
    arrays = dict(good_arrays)
    blocks = arrays["blk.3.attn_output.weight"][0].copy()
    blocks.reshape(-1, 36)[5, 1] = 0x80
    arrays["blk.3.attn_output.weight"] = (blocks, T.NVFP4)
    msg = load_error(write_gguf(tmp_path / "m.gguf", arrays))
    assert "blk.3.attn_output.weight: block scale 21 is 0x80" in msg


def test_non_finite_global_scale(tmp_path, good_arrays):
    arrays = dict(good_arrays)
    arrays["blk.0.attn_v.scale"] = (np.array([np.inf], dtype=np.float32), None)
    assert "blk.0.attn_v.scale: global scale is not finite" in load_error(
        write_gguf(tmp_path / "m.gguf", arrays))


@pytest.mark.parametrize("value", [0.0, -0.5])
def test_global_scale_not_positive(tmp_path, good_arrays, value):
    # A zero scale loaded as an all-zero matrix, a negative one as the matrix negated:
    # the model ran on wrong weights without a word.
    arrays = dict(good_arrays)
    g = np.full(16, 0.25, dtype=np.float32)
    g[3] = value
    arrays["blk.2.ffn_up_exps.scale"] = (g, None)
    msg = load_error(write_gguf(tmp_path / "m.gguf", arrays))
    assert f"blk.2.ffn_up_exps.scale: global scale 3 is {value}, expected a positive number" in msg, msg


def test_truncated_file(written, tmp_path):
    _, path = written
    data = path.read_bytes()
    for cut in (len(data) // 2, 200, 6):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        assert "truncated or corrupt GGUF file" in load_error(bad)


def test_truncated_file_names_the_tensor(written, tmp_path):
    """Regression: a GGUF file cut inside its tensor data was refused with the reader's
    reshape error ("cannot reshape array of size ..."), naming no tensor. The message
    names the first tensor past the end, its byte range and the file's size; a file
    cut inside its header gives the header's byte range."""
    _, path = written
    data = path.read_bytes()
    good = sorted(GGUFReader(path).tensors, key=lambda t: t.data_offset)
    last, middle = good[-1], good[len(good) // 2]
    cases = {
        len(data) - 1: f"tensor {last.name} needs bytes "
                       f"[{last.data_offset}, {last.data_offset + last.n_bytes}), "
                       f"the file has {len(data) - 1}",
        middle.data_offset + 1: f"tensor {middle.name} needs bytes "
                                f"[{middle.data_offset}, {middle.data_offset + middle.n_bytes}), "
                                f"the file has {middle.data_offset + 1} (and "
                                f"{len(good) - len(good) // 2 - 1} more tensors after it)",
        200: "the header needs bytes [",
    }
    for cut, want in cases.items():
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        msg = load_error(bad)
        assert "truncated or corrupt GGUF file: " + want in msg, msg


def test_random_bytes_and_empty_file(tmp_path):
    bad = tmp_path / "noise.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    assert "not a GGUF file" in load_error(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "not a GGUF file" in load_error(empty)


def test_missing_file(tmp_path):
    assert "not found" in load_error(tmp_path / "absent.gguf")


@pytest.mark.parametrize("name", ["blk.1.attn_sinks.weight", "token_embd.weight"])
def test_non_finite_values(tmp_path, good_arrays, name):
    """A NaN in an F32 tensor (a sink) or an infinity in a BF16 one (the embedding)
    is refused at load, naming the tensor, the count and the first index."""
    arrays = dict(good_arrays)
    array, qtype = arrays[name]
    array = array.copy()
    if qtype == T.BF16:
        bits = array.view(np.uint16)
        bits.reshape(-1)[[3, 7]] = 0x7F80  # +inf in bf16
        want = "2 of"
    else:
        array.reshape(-1)[2] = np.nan
        want = "1 of"
    arrays[name] = (array, qtype)
    msg = load_error(write_gguf(tmp_path / "m.gguf", arrays))
    assert f"{name}: {want}" in msg and "not finite" in msg, msg
