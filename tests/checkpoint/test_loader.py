"""`load_checkpoint`'s dispatch on `load_format` (each kind itself: test_safetensors_io.py,
test_gguf_io.py, test_dummy.py)."""

from __future__ import annotations

import pytest

from flintc.checkpoint.loader import load_checkpoint
from flintc.errors import InputError


@pytest.mark.parametrize("path", ["checkpoint", None, "/no/such/checkpoint"])
def test_unknown_load_format_is_an_input_error(tiny_bf16_dir, path):
    """An unknown load_format was a plain ValueError (a traceback on the CLI's terms); it
    is an InputError naming load_format and the accepted values, whatever the path."""
    path = tiny_bf16_dir if path == "checkpoint" else path
    with pytest.raises(InputError, match="^load_format must be one of 'auto', 'safetensors', 'gguf', 'dummy', "
                                         "got 'bogus'$"):
        load_checkpoint(path, load_format="bogus", progress=False)
