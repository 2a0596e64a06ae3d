"""FlintConfig.from_dict / from_file: every bad config.json is a one-line ConfigError
naming the file and the field."""

from __future__ import annotations

import json

import pytest

from flintc.config import PRESETS, FlintConfig
from flintc.errors import ConfigError


def test_a_float_field_given_an_integer_past_the_float_range(tmp_path):
    """A float field holding an integer too large for a float (`"rope_theta": 1e400`
    written out as digits, which JSON and Python's json accept) was an OverflowError
    traceback from float(); it is a ConfigError naming the file and the field."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**PRESETS["tiny"], "rope_theta": 10**400}))
    with pytest.raises(ConfigError, match=f"^{path}: field 'rope_theta' is too large for a float "
                                          "\\(an integer of 401 digits\\)$"):
        FlintConfig.from_file(path)
    assert FlintConfig.from_dict({**PRESETS["tiny"], "rope_theta": 10**6}).rope_theta == 1e6


@pytest.mark.parametrize("value", [2**62, 2**40, 2**24 + 1])
def test_max_position_embeddings_past_exact_fp32_positions_is_refused(value):
    """max_position_embeddings 2**62 passed validation and was a traceback in the reference
    model's RoPE tables ("Storage size calculation overflowed") on `flintc run` and
    `flintc serve` even with --max-model-len 64. Above 2**24 fp32 positions are not
    exact (FLINT_SPEC 2's angles), so such a config is refused naming the field."""
    import flintc.config

    with pytest.raises(ConfigError, match=f"^<x>: field 'max_position_embeddings' is {value}, more than flintc "
                                          r"supports: at most 16777216 \(2\*\*24"):
        FlintConfig.from_dict({**PRESETS["tiny"], "max_position_embeddings": value}, source="<x>")
    cfg = FlintConfig.from_dict({**PRESETS["tiny"], "max_position_embeddings": 2**24})
    assert cfg.max_position_embeddings == 2**24  # Llama 4 Scout's 10,485,760 fits too
    assert flintc.config.MAX_POSITION_EMBEDDINGS == 2**24


@pytest.mark.parametrize("window", [10**9, 4097])
def test_sliding_window_longer_than_max_position_embeddings_is_refused(window):
    """sliding_window 10**9 (tiny: max_position_embeddings 4096) passed validation; every
    backend keeps W ring rows per sliding layer, so `flintc run`, `compile`, `verify`
    were a 128 GB allocation's traceback. A window of max_position_embeddings is the
    same model: the error says to use it."""
    with pytest.raises(ConfigError, match=f"^<x>: field 'sliding_window' is {window}, more than "
                                          r"max_position_embeddings \(4096\): .* a window of 4096 is the same "
                                          "model; set it to at most that$"):
        FlintConfig.from_dict({**PRESETS["tiny"], "sliding_window": window}, source="<x>")
    assert FlintConfig.from_dict({**PRESETS["tiny"], "sliding_window": 4096}).sliding_window == 4096
    with pytest.raises(ConfigError, match="field 'sliding_window'"):
        FlintConfig.preset("tiny").replace(max_position_embeddings=8)  # below the window of 9
    # no sliding layer: the window is never used, any value goes (as before)
    every_full = {**PRESETS["tiny"], "layer_types": ["full_attention"] * PRESETS["tiny"]["num_hidden_layers"]}
    assert FlintConfig.from_dict({**every_full, "sliding_window": 10**9}).sliding_window == 10**9


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}),
    ("rope_scaling", "yarn"),
    ("partial_rotary_factor", 0.5),
    ("partial_rotary_factor", "1"),
])
def test_rope_fields_asking_for_another_rope_are_refused(field, value):
    """A config.json with Hugging Face's `rope_scaling` (yarn, linear, ...), `rope_parameters`
    of another type, or a `partial_rotary_factor` below 1 loaded without a word and ran
    Flint's plain RoPE, another model than the config describes (vLLM applies them):
    refused naming the file and the field. Their default values load as before."""
    with pytest.raises(ConfigError, match=f"^<x>: field '{field}' is .*flintc would run another model than this "
                                          "config describes; remove the field"):
        FlintConfig.from_dict({**PRESETS["tiny"], field: value}, source="<x>")
    tiny = FlintConfig.preset("tiny")
    for same in ({"rope_scaling": None}, {"rope_scaling": {}}, {"rope_scaling": {"rope_type": "default"}},
                 {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                 {"partial_rotary_factor": 1.0}, {"partial_rotary_factor": 1}, {"some_other_field": [1]}):
        assert FlintConfig.from_dict({**PRESETS["tiny"], **same}) == tiny


@pytest.mark.parametrize("value", [
    {"full_attention": {"rope_type": "yarn", "factor": 4.0}, "sliding_attention": {"rope_type": "default"}},
    {"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
    {"rope_type": "default", "rope_theta": 500000.0},
    {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
     "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
])
def test_rope_parameters_per_layer_type_or_with_another_theta_are_refused(value):
    """Transformers' `rope_parameters` keyed by layer type (full_attention /
    sliding_attention, Flint's two kinds) with a scaled RoPE in one of them was taken as
    the default type (the outer dict has no rope_type); a rope_theta in it other than
    config.json's rope_theta (which flintc runs) loaded without a word. Both refused,
    naming the field; the same value as rope_theta loads."""
    with pytest.raises(ConfigError, match="^<x>: field 'rope_parameters'"):
        FlintConfig.from_dict({**PRESETS["tiny"], "rope_parameters": value}, source="<x>")
    theta = PRESETS["tiny"]["rope_theta"]
    same = {"full_attention": {"rope_type": "default", "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": theta}}
    assert FlintConfig.from_dict({**PRESETS["tiny"], "rope_parameters": same}) == FlintConfig.preset("tiny")
