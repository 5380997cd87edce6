"""The DeepSpec draft family's config (`Qwen3DSparkModel`, SPEC 4): its `config.json` plus our dtypes."""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

from dspark_jax.validation import (MARKOV_HEAD_TYPES, ConfigError, check_field, did_you_mean, is_int,
                                   is_markov_head_type, is_number, read_json_config)

FAMILY = "qwen3"
ARCHITECTURE = "Qwen3DSparkModel"
TAP_MODE = "output"  # DeepSpec taps are layer OUTPUTS (-1 = the embeddings)
DTYPES = ("float32", "bfloat16")


def claims(raw: Any) -> bool:
    """A config dict of this family: ours (`"family": "qwen3"`) or DeepSpec's own config.json."""
    if not isinstance(raw, dict):
        return False
    arch = raw.get("architectures")
    return raw.get("family") == FAMILY or (isinstance(arch, list) and ARCHITECTURE in arch)


# Fields stored under their config.json (Hugging Face) names.
_HF_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
              "num_target_layers", "block_size", "mask_token_id", "target_layer_ids", "markov_rank",
              "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_anchors",
              "tie_word_embeddings")
_OUR_FIELDS = ("family", "param_dtype", "compute_dtype")


@dataclasses.dataclass(frozen=True)
class DeepSpecConfig:
    """A DeepSpec draft: its `config.json` (the target's Qwen3 config with the draft's layer count and the
    DSpark keys) plus our dtypes. `num_hidden_layers` is the DRAFT's depth, `num_target_layers` the
    target's. Keys of the file we do not model are kept verbatim in `extra_json` for a faithful export."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_target_layers: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    # Not used by the model; DeepSpec's loader requires them, so they are always written.
    num_anchors: int = 512
    tie_word_embeddings: bool = False
    family: str = FAMILY
    param_dtype: str = "bfloat16"
    compute_dtype: str = "bfloat16"
    extra_json: str = "{}"

    # ---- what the round, the engine and the trainer read (same names as DSparkConfig) ----------
    @property
    def dim(self) -> int:
        return self.hidden_size

    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_heads(self) -> int:
        return self.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def noise_token_id(self) -> int:
        return self.mask_token_id

    @property
    def norm_eps(self) -> float:
        return self.rms_norm_eps

    @property
    def tap_mode(self) -> str:
        return TAP_MODE

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def main_hidden_dim(self) -> int:
        return self.n_taps * self.hidden_size

    @property
    def confidence_in_dim(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    @property
    def extra(self) -> dict[str, Any]:
        return json.loads(self.extra_json)

    # ---- validation ----------------------------------------------------------------------------
    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        check_field(self.family == FAMILY, "family", repr(FAMILY), self.family)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_target_layers", "block_size",
                     "max_position_embeddings"):
            v = getattr(self, name)
            check_field(is_int(v) and v > 0, name, "a positive integer", v)
        check_field(is_int(self.markov_rank) and self.markov_rank >= 0, "markov_rank", "a non-negative integer",
                    self.markov_rank)
        check_field(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                    f"a divisor of num_attention_heads={self.num_attention_heads}", self.num_key_value_heads)
        check_field(self.head_dim % 2 == 0, "head_dim", "an even number (split-half RoPE)", self.head_dim)
        check_field(is_int(self.mask_token_id) and 0 <= self.mask_token_id < self.vocab_size, "mask_token_id",
                    f"a token id in [0, vocab_size={self.vocab_size})", self.mask_token_id)
        ids = self.target_layer_ids
        last = self.num_target_layers - 1
        check_field(len(ids) >= 1 and all(is_int(i) for i in ids), "target_layer_ids",
                    "a non-empty list of target layer ids", list(ids))
        check_field(all(-1 <= i < last for i in ids), "target_layer_ids",
                    f"layer ids in [-1, {last - 1}] (-1 = embeddings; the last layer {last} is excluded: DeepSpec "
                    "reads Hugging Face hidden_states, whose last entry is after the final norm)", list(ids))
        check_field(all(a < b for a, b in zip(ids, ids[1:])), "target_layer_ids", "strictly increasing ids", list(ids))
        if self.markov_rank > 0:
            check_field(is_markov_head_type(self.markov_head_type), "markov_head_type",
                        f"one of {list(MARKOV_HEAD_TYPES)} (case-insensitive, as DeepSpec reads it)",
                        self.markov_head_type)
        check_field(is_int(self.num_anchors) and self.num_anchors > 0, "num_anchors", "a positive integer",
                    self.num_anchors)
        for name in ("enable_confidence_head", "confidence_head_with_markov", "tie_word_embeddings"):
            check_field(isinstance(getattr(self, name), bool), name, "true or false", getattr(self, name))
        if self.enable_confidence_head and self.confidence_head_with_markov:
            check_field(self.markov_rank > 0, "confidence_head_with_markov",
                        "false when markov_rank is 0 (there is no W1[prev] to read)", True)
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            check_field(is_number(v) and v > 0, name, "a positive number", v)
        for name in ("param_dtype", "compute_dtype"):
            check_field(getattr(self, name) in DTYPES, name, f"one of {DTYPES}", getattr(self, name))
        try:
            extra = json.loads(self.extra_json)
        except (TypeError, json.JSONDecodeError):
            extra = None
        check_field(isinstance(extra, dict), "extra_json", "a JSON object", self.extra_json)

    # ---- I/O -----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], **overrides) -> "DeepSpecConfig":
        """A DeepSpec `config.json` dict, or our own `to_dict()`; `overrides` set fields (e.g. dtypes)."""
        from dspark_jax.backbones.qwen3 import Qwen3Config  # noqa: PLC0415  (shared Qwen3 validation)

        if not isinstance(raw, dict):
            raise ConfigError(f"expected a JSON object, got {type(raw).__name__}")
        arch = raw.get("architectures")
        if arch is not None and not (isinstance(arch, list) and ARCHITECTURE in arch):
            raise ConfigError(f"config field 'architectures': expected [{ARCHITECTURE!r}] for a DeepSpec draft, "
                              f"got {arch!r}")
        raw = dict(raw)
        legacy = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
        for key in ("mask_token_id", "target_layer_ids"):  # older exports keep these under dflash_config
            if key not in raw and key in legacy:
                raw[key] = legacy[key]
        # DeepSpec's own loader asserts the DSpark keys too; guessing them would silently change the model.
        for key in ("num_target_layers", "block_size", "mask_token_id", "target_layer_ids", "markov_rank",
                    "enable_confidence_head"):
            if raw.get(key) is None:  # null is missing too: it would read as the default
                raise ConfigError(f"config field '{key}' is missing (required for a DeepSpec draft)")
        # Dimensions, activation, biases, sliding windows and RoPE are validated exactly as for a Qwen3 target.
        base = Qwen3Config.from_hf_dict({k: v for k, v in raw.items() if k not in ("param_dtype", "compute_dtype")})
        values = {k: getattr(base, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings")}
        for key in ("num_target_layers", "block_size", "mask_token_id", "target_layer_ids", "markov_rank",
                    "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_anchors",
                    "tie_word_embeddings", *_OUR_FIELDS):
            if key in raw and raw[key] is not None:
                values[key] = raw[key]
        if "target_layer_ids" in values:
            ids = values["target_layer_ids"]
            check_field(isinstance(ids, (list, tuple)), "target_layer_ids", "a list of layer ids", ids)
        if values.get("markov_rank", 256) == 0:
            values.setdefault("markov_head_type", "none")
        if not values.get("enable_confidence_head", True):
            values.setdefault("confidence_head_with_markov", False)
        extra = {k: v for k, v in raw.items() if k not in _HF_FIELDS and k not in _OUR_FIELDS}
        # Foreign keys are kept (byte-identical export), but one that looks like a draft key is a typo:
        # read as an extra key it would leave that field at its default.
        known = sorted({*_HF_FIELDS, *_OUR_FIELDS})
        typos = [k for k in extra if difflib.get_close_matches(k, known, 1, 0.85)]
        if typos:
            raise ConfigError("unknown DeepSpec config key(s) " + ", ".join(f"'{k}'{did_you_mean(k, known)}"
                                                                         for k in sorted(typos)))
        values["extra_json"] = json.dumps(extra, sort_keys=True)
        values.update(overrides)
        try:
            return cls(**values)
        except TypeError as err:
            raise ConfigError(str(err)) from None

    @classmethod
    def from_json(cls, path: str | Path, **overrides) -> "DeepSpecConfig":
        return read_json_config(path, lambda raw: cls.from_dict(raw, **overrides))

    def to_hf_dict(self) -> dict[str, Any]:
        """The DeepSpec `config.json` (the keys we model, always written, plus the kept foreign keys)."""
        out = {"architectures": [ARCHITECTURE], "model_type": "qwen3", **self.extra}
        for key in _HF_FIELDS:
            out[key] = getattr(self, key)
        out["target_layer_ids"] = list(self.target_layer_ids)
        if self.markov_rank == 0:  # DeepSpec writes the head type only when there is a Markov head
            del out["markov_head_type"]
        return out

    def to_dict(self) -> dict[str, Any]:
        """Our own spelling (bundles, run configs): the config.json plus family and dtypes."""
        return {**self.to_hf_dict(), "family": self.family, "param_dtype": self.param_dtype,
                "compute_dtype": self.compute_dtype}

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes) -> "DeepSpecConfig":
        return dataclasses.replace(self, **changes)
