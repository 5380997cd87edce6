"""Draft configuration: one frozen dataclass, validated once, loadable from three JSON spellings.

`DSparkConfig.from_json` accepts
  * our own configs (`configs/*.json`, field names as below),
  * the Hugging Face `config.json` of DeepSeek-V4.1 (HF key names, possibly nested under `text_config`),
  * the inference `config.json` shipped beside `inference/model.py` (flat, short key names).
Each field lists the foreign spellings it accepts in `_ALIASES`.

`DSparkConfig.from_dict` / `from_json` are the one entry point for every draft family: a config of the
DeepSpec "qwen3" family (`"family": "qwen3"`, or a DeepSpec `config.json` whose `architectures` name
`Qwen3DSparkModel`) comes back as a `dspark_jax.deepspec.DeepSpecConfig`, which exposes the same
properties the round, the engine and the trainer read (block_size, target_layer_ids, dim, vocab_size,
noise_token_id, markov_rank, tap_mode, ...).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

# Draft families: "deepseek_v41" (this DSparkConfig) and "qwen3" (DeepSpec drafts for Qwen3 targets,
# `dspark_jax.deepspec.DeepSpecConfig`). `dspark_jax.draft` dispatches on `cfg.family`.
FAMILIES = ("deepseek_v41", "qwen3")
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range; the message names the field."""


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    family: str = "deepseek_v41"
    dim: int = 5120
    vocab_size: int = 129280
    n_layers: int = 3  # draft blocks
    block_size: int = 5  # K
    noise_token_id: int = 128799
    target_layer_ids: tuple[int, ...] = (37, 38, 39)
    markov_rank: int = 256  # 0 = pure parallel draft (no Markov head)
    n_routed_experts: int = 128
    n_activated_experts: int = 3
    n_shared_experts: int = 1
    moe_inter_dim: int = 2304
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    rope_theta: float = 10000.0
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-20
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    norm_topk_prob: bool = True
    temperature: float = 1.0
    # Numerics switches (not in foreign configs).
    kv_fp8: bool = True  # fp8 quantize-dequantize of every KV row, as the trained V4.1 draft expects
    act_fp8: bool = False  # emulate the official activation fp8 before fp8/fp4 GEMMs (bit-closer parity)
    param_dtype: str = "bfloat16"
    compute_dtype: str = "bfloat16"

    # ---- derived -------------------------------------------------------------------------------
    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def main_hidden_dim(self) -> int:
        return self.n_taps * self.dim

    @property
    def hc_mix_dim(self) -> int:
        # pre (hc) + post (hc) + comb (hc x hc)
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def max_keys(self) -> int:
        return self.window + self.block_size

    @property
    def tap_mode(self) -> str:
        """V4.1 drafts read the backbone residual at the ENTRY of the tap layers (SPEC 2.2)."""
        return "entry"

    # ---- validation ----------------------------------------------------------------------------
    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        check_field(self.family in FAMILIES, "family", f"one of {FAMILIES}", self.family)
        check_field(self.family == "deepseek_v41", "family",
                    "'deepseek_v41' in a DSparkConfig (a 'qwen3' DeepSpec draft is a "
                    "dspark_jax.deepspec.DeepSpecConfig; DSparkConfig.from_dict / from_json return one)", self.family)
        for name in ("dim", "vocab_size", "n_layers", "block_size", "n_routed_experts", "n_activated_experts",
                     "moe_inter_dim", "n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                     "window", "hc_mult", "hc_sinkhorn_iters"):
            v = getattr(self, name)
            check_field(is_int(v) and v > 0, name, "a positive integer", v)
        for name in ("markov_rank", "n_shared_experts"):
            v = getattr(self, name)
            check_field(isinstance(v, int) and v >= 0, name, "a non-negative integer", v)
        check_field(0 <= self.noise_token_id < self.vocab_size, "noise_token_id",
                    f"a token id in [0, vocab_size={self.vocab_size})", self.noise_token_id)
        check_field(self.n_taps >= 1, "target_layer_ids", "a non-empty list of backbone layer ids",
                    self.target_layer_ids)
        check_field(self.n_activated_experts <= self.n_routed_experts, "n_activated_experts",
                    f"at most n_routed_experts={self.n_routed_experts}", self.n_activated_experts)
        check_field(self.rope_head_dim % 2 == 0 and self.rope_head_dim <= self.head_dim, "rope_head_dim",
                    f"an even number <= head_dim={self.head_dim}", self.rope_head_dim)
        check_field((self.n_heads * self.head_dim) % self.o_groups == 0, "o_groups",
                    f"a divisor of n_heads*head_dim={self.n_heads * self.head_dim}", self.o_groups)
        check_field(self.n_heads % self.o_groups == 0, "o_groups", f"a divisor of n_heads={self.n_heads}",
                    self.o_groups)
        check_field(self.score_func in SCORE_FUNCS, "score_func", f"one of {SCORE_FUNCS}", self.score_func)
        for name in ("rope_theta", "route_scale", "swiglu_limit", "temperature"):
            v = getattr(self, name)
            check_field(isinstance(v, (int, float)) and math.isfinite(v) and v > 0, name, "a positive number", v)
        for name in ("hc_eps", "norm_eps"):
            v = getattr(self, name)
            check_field(isinstance(v, (int, float)) and 0 < v < 1, name, "a number in (0, 1)", v)
        for name in ("param_dtype", "compute_dtype"):
            check_field(getattr(self, name) in ("float32", "bfloat16"), name, "'float32' or 'bfloat16'",
                        getattr(self, name))
        if self.kv_fp8 or self.act_fp8:
            check_field(self.head_dim % 32 == 0, "head_dim", "a multiple of 32 (fp8 blocks of 32 values)",
                        self.head_dim)

    # ---- I/O -----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DSparkConfig":
        if is_deepspec_config(raw):
            from dspark_jax.deepspec import DeepSpecConfig  # noqa: PLC0415  (imports jax)

            return DeepSpecConfig.from_dict(raw)
        if "text_config" in raw and isinstance(raw["text_config"], dict):
            raw = {**raw, **raw["text_config"]}
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name in fields:
            for key in (name, *_ALIASES.get(name, ())):
                if key in raw:
                    if name in values and values[name] != raw[key]:
                        raise ConfigError(f"config fields '{name}' and its alias '{key}' disagree: "
                                          f"{values[name]!r} vs {raw[key]!r}")
                    values[name] = raw[key]
        if "family" not in raw and "dspark_block_size" in raw:
            values["family"] = "deepseek_v41"
        try:
            return cls(**values)
        except TypeError as err:  # wrong value types that slipped past __post_init__
            raise ConfigError(str(err)) from err

    @classmethod
    def from_json(cls, path: str | Path) -> "DSparkConfig":
        return read_json_config(path, cls.from_dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes) -> "DSparkConfig":
        return dataclasses.replace(self, **changes)


# Foreign spellings (HF config.json first, then the inference config.json).
_ALIASES: dict[str, tuple[str, ...]] = {
    "dim": ("hidden_size",),
    "n_layers": ("num_nextn_predict_layers", "n_mtp_layers"),
    "block_size": ("dspark_block_size",),
    "noise_token_id": ("dspark_noise_token_id",),
    "target_layer_ids": ("dspark_target_layer_ids",),
    "markov_rank": ("dspark_markov_rank",),
    "n_routed_experts": ("dspark_n_routed_experts",),
    "n_activated_experts": ("dspark_num_experts_per_tok", "dspark_n_activated_experts"),
    "moe_inter_dim": ("moe_intermediate_size",),
    "n_heads": ("num_attention_heads",),
    "rope_head_dim": ("qk_rope_head_dim",),
    "window": ("sliding_window", "window_size"),
    "norm_eps": ("rms_norm_eps",),
    "score_func": ("scoring_func",),
    "route_scale": ("routed_scaling_factor",),
}


def is_deepspec_config(raw: Any) -> bool:
    """A config dict of the DeepSpec "qwen3" draft family (ours or DeepSpec's own config.json)."""
    if not isinstance(raw, dict):
        return False
    arch = raw.get("architectures")
    return raw.get("family") == "qwen3" or (isinstance(arch, list) and "Qwen3DSparkModel" in arch)


# ---- validation and file helpers shared by every config class (draft, backbones, DeepSpec) ----------


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float (bool excluded: JSON `true` is not a number here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_field(ok: bool, field: str, expected: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"config field '{field}': expected {expected}, got {got!r}")


def read_json_config(path: str | Path, parse):
    """`parse(dict)` of a JSON config file (a folder means its config.json); every error names the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level")
    try:
        return parse(raw)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
