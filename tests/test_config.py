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
