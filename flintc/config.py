"""FlintConfig: the model shape from config.json, validated on load.

The fields and the two presets (`tiny`, `full`) are those of FLINT_SPEC section 1.
Validation happens in :meth:`FlintConfig.validate`, which every constructor path
(`from_dict`, `from_file`, `preset`) calls; errors name the file and the field.
Values no flintc backend can run are refused there too, so that every command says one
line rather than failing in an allocation: a max_position_embeddings above
:data:`MAX_POSITION_EMBEDDINGS`, a sliding_window above max_position_embeddings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flintc.errors import ConfigError, json_type

LAYER_TYPES = ("sliding_attention", "full_attention")

# The most positions a config may declare (max_position_embeddings): 2**24 = 16,777,216.
# FLINT_SPEC 2 computes RoPE angles as `position * inv_freq` in fp32, and fp32 holds every
# integer only up to 2**24: past it positions round and the angles are wrong. It is also
# above every released model's context (Llama 4 Scout's 10,485,760 is the longest seen).
# A bigger value was a traceback deep in the reference model (the RoPE tables: "Storage
# size calculation overflowed" for 2**62) instead of a line naming the field.
MAX_POSITION_EMBEDDINGS = 1 << 24


def full_layer_types(num_layers: int) -> list[str]:
    """FLINT_SPEC section 1: layer i is full attention when i % 7 is 3 or 6."""
    return ["full_attention" if i % 7 in (3, 6) else "sliding_attention" for i in range(num_layers)]


@dataclass(frozen=True)
class FlintConfig:
    """The architecture fields of a Flint config.json (FLINT_SPEC section 1).

    Shape legend used across flintc: H = hidden_size, L = num_hidden_layers,
    Hq / Hkv = query / KV heads, D = head_dim, W = sliding_window, E = routed
    experts, K = num_experts_per_tok (top-k), I = intermediate_size,
    Im = moe_intermediate_size, V = vocab_size.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_theta: float
    rms_norm_eps: float
    first_k_dense_replace: int
    intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    model_type: str = "flint"
    # Where the config was read from, for error messages; not part of config.json.
    source: str = field(default="<config>", compare=False, repr=False)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<config>") -> "FlintConfig":
        """Build and validate a config from a parsed config.json.

        Raises:
            ConfigError: a required field is missing, has the wrong type, or fails
                validation; the message names `source` and the field.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, found a JSON {json_type(data)}")
        _check_rope_fields(data, source)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "source":
                continue
            if f.name not in data:
                if f.default is not dataclasses.MISSING:
                    continue
                raise ConfigError(f"{source}: missing field '{f.name}'")
            kwargs[f.name] = _coerce(source, f.name, data[f.name], f.type)
        return cls(**kwargs, source=source).validate()

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "FlintConfig":
        """Read `path` (a config.json, or a folder holding one).

        Raises:
            ConfigError: the file is missing, is not JSON, or fails validation.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: not a readable JSON file ({exc})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def preset(cls, name: str) -> "FlintConfig":
        """The `tiny` or `full` config of FLINT_SPEC section 1.

        Raises:
            ConfigError: `name` is not a known preset.
        """
        if name not in PRESETS:
            raise ConfigError(f"unknown config preset '{name}': the presets are {preset_names()}")
        return cls.from_dict(PRESETS[name], source=f"<preset {name}>")

    @classmethod
    def from_preset_or_path(cls, value: str, flag: str = "--config") -> "FlintConfig":
        """A preset name (`tiny`, `full`), else the path of a config.json or of a folder
        holding one: the `--config` of `flintc make-checkpoint`, `verify` and `dump`. A
        preset wins over a file or folder of the same name.

        Raises:
            ConfigError: `value` is empty, or neither a preset nor an existing path (the
                message names `flag`, lists the presets and says a path is accepted);
                or the file is missing, unreadable or fails validation (`from_file`).
        """
        if value in PRESETS:
            return cls.preset(value)
        if value and Path(value).exists():
            return cls.from_file(value)
        what = "is empty" if not value else "is neither a config preset nor an existing file or folder"
        raise ConfigError(f"{flag} {value!r} {what}: expected a preset ({preset_names()}) or the path of a "
                          "config.json file or of a folder holding one")

    def replace(self, **changes: Any) -> "FlintConfig":
        """A copy with some fields changed, validated again (e.g. fewer layers)."""
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = tuple(self.layer_types[: changes["num_hidden_layers"]])
        return dataclasses.replace(self, **changes).validate()

    def to_dict(self) -> dict[str, Any]:
        """The config.json content (JSON-serialisable)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}
        out["layer_types"] = list(self.layer_types)
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write the config.json content (`to_dict`) to `path`. Raises OSError naming
        `path` when the write fails (a full disk: `fileio.naming_write_errors`)."""
        from flintc.fileio import naming_write_errors

        with naming_write_errors(path):
            Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ------------------------------------------------------------------ validation
    def validate(self) -> "FlintConfig":
        """Check the cross-field rules the model and kernels rely on.

        Raises:
            ConfigError: naming the source file and the offending field.
        """

        def fail(field_name: str, msg: str) -> None:
            raise ConfigError(f"{self.source}: field '{field_name}' {msg}")

        if self.model_type != "flint":
            fail("model_type", f"must be 'flint', found {self.model_type!r}")
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "sliding_window", "intermediate_size",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                fail(name, f"must be positive, found {getattr(self, name)}")
        for name in ("hidden_size", "intermediate_size", "moe_intermediate_size"):
            if getattr(self, name) % 64:
                fail(name, f"must be a multiple of 64 (the NVFP4 super-block), found {getattr(self, name)}")
        if (self.num_attention_heads * self.head_dim) % 64:
            fail("num_attention_heads", f"({self.num_attention_heads}) times head_dim ({self.head_dim}) = "
                 f"{self.num_attention_heads * self.head_dim} must be a multiple of 64 (the NVFP4 super-block)")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(
                "num_attention_heads",
                f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})",
            )
        if self.max_position_embeddings > MAX_POSITION_EMBEDDINGS:
            fail("max_position_embeddings", f"is {self.max_position_embeddings}, more than flintc supports: at most "
                 f"{MAX_POSITION_EMBEDDINGS} (2**24: fp32 RoPE angles need exact positions, FLINT_SPEC 2)")
        if "sliding_attention" in self.layer_types and self.sliding_window > self.max_position_embeddings:
            # Hugging Face configs allow it (full attention in effect), but every flintc
            # backend keeps W rows per sliding layer: 10**9 was a 128 GB allocation's
            # traceback. A window of max_position_embeddings is the same model.
            fail("sliding_window", f"is {self.sliding_window}, more than max_position_embeddings "
                 f"({self.max_position_embeddings}): no sequence is that long, so a window of "
                 f"{self.max_position_embeddings} is the same model; set it to at most that")
        if self.head_dim % 2:
            fail("head_dim", f"must be even for RoPE, found {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            fail(
                "layer_types",
                f"has {len(self.layer_types)} entries, expected num_hidden_layers = "
                f"{self.num_hidden_layers}",
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                fail("layer_types", f"entry {i} is {kind!r}, expected one of {list(LAYER_TYPES)}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            fail("first_k_dense_replace", f"must be in [0, num_hidden_layers], found {self.first_k_dense_replace}")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            fail("num_experts_per_tok", f"must be in [1, n_routed_experts], found {self.num_experts_per_tok}")
        if self.n_shared_experts not in (0, 1):
            fail("n_shared_experts", f"must be 0 or 1, found {self.n_shared_experts}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            fail("rope_theta", f"must be a positive finite number, found {self.rope_theta}")
        if not (0 < self.rms_norm_eps < 1):
            fail("rms_norm_eps", f"must be in (0, 1), found {self.rms_norm_eps}")
        if not (self.routed_scaling_factor > 0 and math.isfinite(self.routed_scaling_factor)):
            fail("routed_scaling_factor", f"must be positive, found {self.routed_scaling_factor}")
        if not self.norm_topk_prob:
            fail("norm_topk_prob", "must be true (FLINT_SPEC section 2 normalises the top-k weights)")
        if self.tie_word_embeddings:
            fail("tie_word_embeddings", "must be false (Flint has a separate lm_head)")
        if self.torch_dtype != "bfloat16":
            fail("torch_dtype", f"must be 'bfloat16', found {self.torch_dtype!r}")
        return self

    # ------------------------------------------------------------------ derived shapes
    @property
    def num_kv_groups(self) -> int:
        """G = Hq / Hkv: query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def is_sliding_layer(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"

    def num_parameters(self) -> dict[str, int]:
        """Parameter counts: `total`, `active_layers` (per decode token, without the
        embedding and the LM head), `active_lm_head`, `embedding`.

        For the full preset: 39.69e9 total, 2.11e9 + 0.31e9 active (FLINT_SPEC 1).
        """
        H, D, V = self.hidden_size, self.head_dim, self.vocab_size
        attn = H * self.q_size * 2 + H * self.kv_size * 2 + 2 * D + self.num_attention_heads
        norms = 2 * H
        dense_mlp = 3 * H * self.intermediate_size
        expert = 3 * H * self.moe_intermediate_size
        router = self.n_routed_experts * H + self.n_routed_experts
        total = active = 0
        for i in range(self.num_hidden_layers):
            total += attn + norms
            active += attn + norms
            if self.is_moe_layer(i):
                total += (self.n_routed_experts + self.n_shared_experts) * expert + router
                active += (self.num_experts_per_tok + self.n_shared_experts) * expert + router
            else:
                total += dense_mlp
                active += dense_mlp
        embedding = V * H
        lm_head = V * H
        total += embedding + lm_head + H
        return {
            "total": total,
            "active_layers": active + H,
            "active_lm_head": lm_head,
            "embedding": embedding,
        }


def _check_rope_fields(data: dict[str, Any], source: str) -> None:
    """Refuse the Hugging Face fields that change RoPE when they ask for anything but
    Flint's plain RoPE over the whole head (FLINT_SPEC 2): `rope_scaling` /
    `rope_parameters` with a type other than "default" (yarn, linear, dynamic, llama3,
    ...), or a `partial_rotary_factor` other than 1. Other unknown fields are ignored, as
    before; these were too, and the model ran without the scaling the config asks for
    (vLLM applies it), so its results were silently another model's.

    Raises:
        ConfigError: naming `source`, the field and its value.
    """
    def shown(v) -> str:
        text = json.dumps(v, default=str)
        return text if len(text) <= 60 else text[:57] + "..."

    layer_types = ("full_attention", "sliding_attention")
    for name in ("rope_scaling", "rope_parameters"):
        value = data.get(name)
        if value is None or value == {}:
            continue
        # transformers' per-layer-type form: {"full_attention": {...}, "sliding_attention": {...}}
        per_type = isinstance(value, dict) and value and all(k in layer_types for k in value)
        for part in (value.values() if per_type else (value,)):
            kind = part.get("rope_type", part.get("type", "default")) if isinstance(part, dict) else None
            if kind != "default":
                raise ConfigError(f"{source}: field '{name}' is {shown(value)}: Flint has no RoPE scaling "
                                  "(FLINT_SPEC 2: plain RoPE at rope_theta), so flintc would run another model "
                                  "than this config describes; remove the field or set it to null")
            theta, top = part.get("rope_theta"), data.get("rope_theta")
            if theta is not None and top is not None and theta != top:
                raise ConfigError(f"{source}: field '{name}' is {shown(value)}: its rope_theta {shown(theta)} is "
                                  f"not the config's rope_theta {shown(top)}, which flintc runs (FLINT_SPEC 2: "
                                  "one rope_theta), so flintc would run another model than this config "
                                  "describes; remove the field or make them equal")
    factor = data.get("partial_rotary_factor")
    if factor is not None and not (isinstance(factor, (int, float)) and not isinstance(factor, bool)
                                   and factor == 1):
        raise ConfigError(f"{source}: field 'partial_rotary_factor' is {shown(factor)}: Flint rotates the whole "
                          "head (FLINT_SPEC 2), so flintc would run another model than this config describes; "
                          "remove the field or set it to 1")


def _coerce(source: str, name: str, value: Any, annotation: Any) -> Any:
    """Check a config.json value's JSON type against the field's annotation."""
    ann = str(annotation)
    want = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}.get(ann)
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    bad = ConfigError(f"{source}: field '{name}' has the wrong type (a JSON {json_type(value)}: {shown}"
                      + (f"; expected {want})" if want else ")"))
    if ann == "bool":
        if not isinstance(value, bool):
            raise bad
        return value
    if ann == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if ann == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        try:
            return float(value)
        except OverflowError:  # an integer literal past the float range (JSON allows any)
            raise ConfigError(f"{source}: field '{name}' is too large for a float (an integer of "
                              f"{len(str(abs(value)))} digits)") from None
    if ann == "str":
        if not isinstance(value, str):
            raise bad
        return value
    if ann.startswith("tuple"):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{source}: field '{name}' must be a list of strings")
        return tuple(value)
    return value


_FULL: dict[str, Any] = {
    "model_type": "flint",
    "vocab_size": 151552,
    "hidden_size": 2048,
    "num_hidden_layers": 49,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "sliding_window": 513,
    "layer_types": full_layer_types(49),
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "first_k_dense_replace": 2,
    "intermediate_size": 10240,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 512,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

_TINY: dict[str, Any] = {
    **_FULL,
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "sliding_window": 9,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "intermediate_size": 256,
    "n_routed_experts": 16,
    "moe_intermediate_size": 64,
    "max_position_embeddings": 4096,
}

PRESETS: dict[str, dict[str, Any]] = {"tiny": _TINY, "full": _FULL}


def preset_names() -> str:
    """The preset names for messages, e.g. "full, tiny"."""
    return ", ".join(sorted(PRESETS))
