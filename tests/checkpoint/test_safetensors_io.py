"""BF16 safetensors folders: round trips, a folder from plain safetensors, bad folders."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import flintc.checkpoint.safetensors_io as sio
from flintc.checkpoint.init import random_weights
from flintc.checkpoint.loader import load_checkpoint
from flintc.checkpoint.safetensors_io import load_bf16, save_bf16
from flintc.config import FlintConfig
from flintc.errors import CheckpointError

TINY = FlintConfig.preset("tiny")


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=1)


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


def test_round_trip_single_file(weights, tmp_path):
    (path,) = save_bf16(TINY, weights, tmp_path)
    assert path.name == "model.safetensors"
    assert_same(load_bf16(tmp_path, TINY, progress=False), weights)
    with safe_open(str(path), framework="pt") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
        assert f.get_slice("model.layers.0.input_layernorm.weight").get_dtype() == "BF16"
        assert f.get_slice("model.layers.0.self_attn.sinks").get_dtype() == "F32"
        assert f.get_slice("model.layers.2.mlp.gate.e_score_correction_bias").get_dtype() == "F32"
        assert f.get_slice("model.layers.2.mlp.experts.15.down_proj.weight").get_shape() == [
            TINY.hidden_size, TINY.moe_intermediate_size]


def test_round_trip_sharded(weights, tmp_path):
    max_bytes = 150_000
    paths = save_bf16(TINY, weights, tmp_path, max_shard_bytes=max_bytes)
    assert len(paths) > 3
    assert [p.name for p in paths] == [
        f"model-{i:05d}-of-{len(paths):05d}.safetensors" for i in range(1, len(paths) + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    total = 0
    for p in paths:
        with safe_open(str(p), framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
            assert all(index["weight_map"][k] == p.name for k in f.keys())
        assert sum(sizes) <= max_bytes or len(sizes) == 1
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    assert_same(load_bf16(tmp_path, TINY, progress=False), weights)


# ---------------------------------------------------------------------------- another writer
def hf_state_dict(c: FlintConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict with the names, shapes and dtypes of FLINT_SPEC section 4."""
    gen = torch.Generator().manual_seed(seed)
    H, D, V, E = c.hidden_size, c.head_dim, c.vocab_size, c.n_routed_experts
    q, kv, I, Im = c.num_attention_heads * D, c.num_key_value_heads * D, c.intermediate_size, \
        c.moe_intermediate_size

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=gen).to(dtype)

    sd = {"model.embed_tokens.weight": t(V, H), "model.norm.weight": t(H),
          "lm_head.weight": t(V, H)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": t(H), p + "post_attention_layernorm.weight": t(H),
                   p + "self_attn.q_proj.weight": t(q, H), p + "self_attn.k_proj.weight": t(kv, H),
                   p + "self_attn.v_proj.weight": t(kv, H), p + "self_attn.o_proj.weight": t(H, q),
                   p + "self_attn.q_norm.weight": t(D), p + "self_attn.k_norm.weight": t(D),
                   p + "self_attn.sinks": t(c.num_attention_heads, dtype=torch.float32)})
        if i < c.first_k_dense_replace:
            sd.update({p + "mlp.gate_proj.weight": t(I, H), p + "mlp.up_proj.weight": t(I, H),
                       p + "mlp.down_proj.weight": t(H, I)})
            continue
        sd[p + "mlp.gate.weight"] = t(E, H)
        sd[p + "mlp.gate.e_score_correction_bias"] = t(E, dtype=torch.float32)
        for e in range(E):
            sd.update({f"{p}mlp.experts.{e}.gate_proj.weight": t(Im, H),
                       f"{p}mlp.experts.{e}.up_proj.weight": t(Im, H),
                       f"{p}mlp.experts.{e}.down_proj.weight": t(H, Im)})
        sd.update({p + "mlp.shared_experts.gate_proj.weight": t(Im, H),
                   p + "mlp.shared_experts.up_proj.weight": t(Im, H),
                   p + "mlp.shared_experts.down_proj.weight": t(H, Im)})
    return sd


def check_matches_state_dict(loaded: dict, sd: dict) -> None:
    for name, w in loaded.items():
        if ".mlp.experts." in name:
            prefix, proj = name.split(".mlp.experts.")
            want = torch.stack([sd[f"{prefix}.mlp.experts.{e}.{proj}"]
                                for e in range(TINY.n_routed_experts)])
        else:
            want = sd[name]
        if "norm" in name:
            assert w.dtype == torch.float32
            want = want.float()
        assert w.dtype == want.dtype and torch.equal(w, want), name


def test_folder_from_plain_safetensors(tmp_path):
    sd = hf_state_dict(TINY)
    save_file(sd, str(tmp_path / "model.safetensors"))
    TINY.save(tmp_path / "config.json")
    ckpt = load_checkpoint(tmp_path, progress=False)
    assert ckpt.fmt == "bf16" and ckpt.config == TINY
    check_matches_state_dict(ckpt.weights, sd)


def test_sharded_folder_from_plain_safetensors(tmp_path):
    sd = hf_state_dict(TINY, seed=5)
    names = list(sd)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for fname, part in halves.items():
        save_file({n: sd[n] for n in part}, str(tmp_path / fname))
    weight_map = {n: f for f, part in halves.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    check_matches_state_dict(load_bf16(tmp_path, TINY, progress=False), sd)


# ---------------------------------------------------------------------------- bad folders
def write_sd(folder, sd):
    folder.mkdir(exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    return folder / "model.safetensors"


def load_error(folder, name_in_message) -> str:
    with pytest.raises(CheckpointError) as info:
        load_bf16(folder, TINY, progress=False)
    msg = str(info.value)
    assert "\n" not in msg and str(name_in_message) in msg, msg
    return msg


@pytest.fixture(scope="module")
def good_sd():
    return hf_state_dict(TINY, seed=2)


def test_missing_tensor(tmp_path, good_sd):
    sd = dict(good_sd)
    del sd["model.layers.3.mlp.experts.7.up_proj.weight"]
    path = write_sd(tmp_path, sd)
    msg = load_error(tmp_path, path)
    assert "missing model.layers.3.mlp.experts.7.up_proj.weight" in msg


def test_unexpected_tensor(tmp_path, good_sd):
    sd = dict(good_sd)
    sd["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(2, 2)
    path = write_sd(tmp_path, sd)
    msg = load_error(tmp_path, path)
    assert "unexpected model.layers.0.mlp.experts.0.up_proj.weight" in msg


def test_mis_shaped_and_mis_typed_tensors(tmp_path, good_sd):
    sd = dict(good_sd)
    H, q = TINY.hidden_size, TINY.q_size
    sd["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(q // 2, H, dtype=torch.bfloat16)
    sd["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(H, q)  # fp32
    path = write_sd(tmp_path, sd)
    msg = load_error(tmp_path, path)
    assert (f"model.layers.1.self_attn.q_proj.weight: expected [{q}, {H}] BF16, "
            f"found [{q // 2}, {H}] BF16") in msg
    assert f"model.layers.1.self_attn.o_proj.weight: expected [{H}, {q}] BF16, " \
        f"found [{H}, {q}] F32" in msg


def test_validation_reads_no_tensor_data(tmp_path, good_sd, monkeypatch):
    sd = dict(good_sd)
    sd["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    write_sd(tmp_path, sd)

    def no_data(*args, **kwargs):
        raise AssertionError("tensor data read before validation")

    monkeypatch.setattr(sio, "safe_open", no_data)
    assert "model.norm.weight: expected" in load_error(tmp_path, tmp_path)


def test_truncated_file(tmp_path, good_sd):
    path = write_sd(tmp_path, good_sd)
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 100, 4):
        path.write_bytes(data[:cut])
        load_error(tmp_path, path)
    path.write_bytes(data[: len(data) - 10])
    assert "truncated" in load_error(tmp_path, path)


def test_truncated_file_names_the_tensor(tmp_path, good_sd):
    """Regression: a truncated file was refused as "the header describes N bytes",
    naming no tensor. The message names the first tensor whose data runs past the
    end, its byte range in the file and the file's size, as the GGUF loader does."""
    path = write_sd(tmp_path, good_sd)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    name, info = max(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    start, stop = (8 + n + x for x in info["data_offsets"])
    path.write_bytes(data[:-10])
    msg = load_error(tmp_path, path)
    want = f"truncated: tensor {name} needs bytes [{start}, {stop}), the file has {len(data) - 10}"
    assert want in msg, msg
    assert "more tensors" not in msg


def _rewrite_header(path, edit, extra=b""):
    """Rewrite the safetensors file `path` with its header passed through `edit` (the
    data kept, `extra` bytes appended); returns the new data section's start."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:] + extra)


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("shift, needle", [
    (-2, "tensor {q}: its data_offsets [{s}, {e}) overlap those of "),
    (2, "tensor {q}: its data_offsets [{s}, {e}) leave bytes [{s0}, {s}) unused after "),
])
def test_offsets_out_of_place_name_the_tensor(tmp_path, good_sd, shift, needle):
    """A header whose data_offsets overlap (or leave a gap) was refused only when the
    data was read, as "model.embed_tokens.weight: cannot read (... invalid offset for
    tensor model.layers.0.self_attn.q_proj.weight)": the first tensor read named first,
    not the one at fault. The header's offsets are checked up front (safetensors packs
    tensors back to back): the message names the tensor whose offsets are out of place."""
    path = write_sd(tmp_path, good_sd)
    offsets = {}

    def move(header):
        s0, e0 = header[Q]["data_offsets"]
        assert s0 > 2  # another tensor before it
        header[Q]["data_offsets"] = [s0 + shift, e0 + shift]
        offsets.update(s0=s0, s=s0 + shift, e=e0 + shift)

    _rewrite_header(path, move)
    msg = load_error(tmp_path, path)
    assert needle.format(q=Q, **offsets) in msg and "cannot read" not in msg, msg


def test_bytes_after_the_data_are_refused_up_front(tmp_path, good_sd):
    path = write_sd(tmp_path, good_sd)
    _rewrite_header(path, lambda header: None, extra=b"junk")
    size = path.stat().st_size
    msg = load_error(tmp_path, path)
    assert f"4 bytes after the last tensor's data (the tensors end at byte {size - 4} of {size})" in msg, msg


def test_random_bytes_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
                     .to(torch.uint8).numpy().tobytes())
    assert "not a safetensors file" in load_error(tmp_path, path)


def test_missing_shard(weights, tmp_path):
    paths = save_bf16(TINY, weights, tmp_path, max_shard_bytes=150_000)
    paths[2].unlink()
    msg = load_error(tmp_path, tmp_path / "model.safetensors.index.json")
    assert f"shard {paths[2].name}" in msg and "not found" in msg


def test_index_that_leaves_out_or_misplaces_a_tensor(weights, tmp_path):
    """A tensor a shard holds but model.safetensors.index.json leaves out was reported as
    "NAME: index maps it to None"; it names the shard and says the index lacks it."""
    paths = save_bf16(TINY, weights, tmp_path, max_shard_bytes=150_000)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gone = "model.embed_tokens.weight"
    moved = "model.norm.weight"
    holder, elsewhere = index["weight_map"].pop(gone), index["weight_map"][moved]
    index["weight_map"][moved] = next(p.name for p in paths if p.name != elsewhere)
    index_path.write_text(json.dumps(index))
    msg = load_error(tmp_path, index_path)
    assert f"{holder}: {gone}: not in the index's weight_map" in msg, msg
    assert "None" not in msg, msg
    assert f"{elsewhere}: {moved}: the index maps it to {index['weight_map'][moved]}" in msg, msg


def test_bad_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    load_error(tmp_path, "model.safetensors.index.json")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    assert "weight_map" in load_error(tmp_path, "model.safetensors.index.json")


def test_empty_folder(tmp_path):
    assert "no model.safetensors" in load_error(tmp_path, tmp_path)


def test_save_refuses_nvfp4(weights, tmp_path):
    from flintc.quant.nvfp4 import quantize

    nv = dict(weights)
    name = "model.layers.0.self_attn.q_proj.weight"
    nv[name] = quantize(nv[name])
    with pytest.raises(TypeError, match="q_proj"):
        save_bf16(TINY, nv, tmp_path)


@pytest.mark.parametrize("name", ["model.layers.2.mlp.gate.e_score_correction_bias",
                                  "model.layers.3.mlp.experts.5.down_proj.weight"])
def test_non_finite_values(tmp_path, good_sd, name):
    """NaN or infinite values in an fp32 tensor (the correction bias) or in one expert
    of a stacked bf16 tensor are refused at load, naming that tensor and the file."""
    sd = dict(good_sd)
    t = sd[name].clone()
    t.view(-1)[1] = float("nan")
    t.view(-1)[-1] = float("-inf")
    sd[name] = t
    path = write_sd(tmp_path, sd)
    msg = load_error(tmp_path, path)
    assert f"{name}: 2 of {t.numel()} values are not finite (the first, at " in msg, msg
    assert "is nan" in msg
