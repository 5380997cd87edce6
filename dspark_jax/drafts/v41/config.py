"""Draft configuration: one frozen dataclass, validated once, loadable from three JSON spellings.

`DSparkConfig.from_json` / `from_dict` accept
  * ours: our own configs (`configs/*.json`, `DSparkConfig.to_dict()`), field names as below;
  * hf: the Hugging Face `config.json` of DeepSeek-V4.1 (HF key names, possibly nested under `text_config`);
  * inference: the `config.json` shipped beside the official `inference/model.py` (flat `ModelArgs` names).
The spelling is detected from the key names alone (`_spelling`): a `family` key means ours; else any
HF-only key (`hidden_size`, `num_hidden_layers`, `architectures`, `text_config`, ...) means hf; else any
other foreign key (`n_mtp_layers`, `dspark_*`, `window_size`, `max_batch_size`, ...) means inference;
else ours.

The foreign files describe the WHOLE model, so next to the draft's keys they carry the backbone's, some
with the names of our fields (`n_layers`, `n_routed_experts`, `temperature`, ...). The draft's values
come from the draft keys only (`_DRAFT_KEYS`): layers from `num_nextn_predict_layers` / `n_mtp_layers`,
experts from `dspark_n_routed_experts` and `dspark_num_experts_per_tok` / `dspark_n_activated_experts`
(falling back to the backbone's counts when absent or 0, as the official code does), the `dspark_*` keys,
and the architecture keys the draft shares with the backbone (`_SHARED`; any spelling's name of them is
read, and two names of one field must agree). `vision` is derived (inference `vision_n_layers > 0`, hf a
non-empty `vision_config`); a foreign `temperature` is the backbone's sampling default and is ignored.
Our numerics switches (`kv_fp8`, `act_fp8`, `param_dtype`, `compute_dtype`) are read in every spelling;
in a foreign file without `act_fp8`, it follows the weight format the file declares (inference
`dtype: "fp8"`, HF an fp8 `quantization_config`), as the official forward does.

Unknown keys (in none of the documented key sets below):
  * ours: a ConfigError naming the key and the closest valid name (our files are written by us: a typo
    is a bug);
  * hf / inference: a ConfigError when the key looks like a draft key (starts with `dspark_`, or is a
    near miss of a draft key of either foreign spelling), since a misspelt draft key would silently load
    a default; otherwise a `warnings.warn` naming the keys and the config still loads, because foreign
    files of later model versions carry new backbone keys that the draft does not read.
Errors are deterministic: fields are visited in dataclass order, unknown keys sorted.

The entry point for a config of ANY draft family is `dspark_jax.drafts.load_config` / `config_from_dict`
(the registry asks each family whether the file is its own). `DSparkConfig.from_dict` of another
family's config still returns that family's config through the registry, with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import warnings
from pathlib import Path
from typing import Any

from dspark_jax.validation import (MARKOV_HEAD_TYPES, SCORE_FUNCS, ConfigError, check_field, did_you_mean,
                                   is_int, is_markov_head_type, is_number, read_json_config)

FAMILY = "deepseek_v41"
TAP_MODE = "entry"  # V4.1 drafts read the backbone residual at the ENTRY of the tap layers (SPEC 2.2)


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    family: str = FAMILY
    dim: int = 5120
    vocab_size: int = 129280
    n_layers: int = 3  # draft blocks
    block_size: int = 5  # K
    noise_token_id: int = 128799
    target_layer_ids: tuple[int, ...] = (37, 38, 39)
    markov_rank: int = 256  # 0 = pure parallel draft (no Markov head)
    # vanilla | gated | rnn (SPEC 4.1; ours only: the official V4.1 draft and its mtp.* layout are vanilla)
    markov_head_type: str = "vanilla"
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
    # The model has a vision tower (inference `vision_n_layers > 0`, HF `vision_config`): its router then
    # carries `ffn.gate.bias_vl`, the bias for image tokens (unused by drafts on text).
    vision: bool = False
    # Numerics switches (not in foreign configs).
    kv_fp8: bool = True  # fp8 quantize-dequantize of every KV row, as the trained V4.1 draft expects
    act_fp8: bool = False  # emulate the official activation fp8 before fp8/fp4 GEMMs (bit-closer parity)
    param_dtype: str = "bfloat16"
    compute_dtype: str = "bfloat16"
    # The MoE's path (`nn.moe.MoE.routing`): "auto" (routed for E > 2k), "routed" or "dense" (every expert on
    # every token). Same numbers either way; `dspark bench moe` times the two side by side.
    moe_routing: str = "auto"

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
        return TAP_MODE

    # ---- validation ----------------------------------------------------------------------------
    def __post_init__(self):
        ids = self.target_layer_ids
        # A JSON string "135" would iterate as digits and floats would truncate: only a list of ints.
        check_field(isinstance(ids, (list, tuple)) and len(ids) >= 1 and all(is_int(i) and i >= 0 for i in ids),
                    "target_layer_ids", "a non-empty list of backbone layer ids (integers >= 0)", ids)
        object.__setattr__(self, "target_layer_ids", tuple(ids))
        check_field(self.family == FAMILY, "family",
                    f"{FAMILY!r} in a DSparkConfig (a 'qwen3' draft is a DeepSpecConfig; "
                    "dspark_jax.drafts.config_from_dict returns each family's config class)", self.family)
        for name in ("dim", "vocab_size", "n_layers", "block_size", "n_routed_experts", "n_activated_experts",
                     "moe_inter_dim", "n_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                     "window", "hc_mult", "hc_sinkhorn_iters"):
            v = getattr(self, name)
            check_field(is_int(v) and v > 0, name, "a positive integer", v)
        check_field(is_markov_head_type(self.markov_head_type), "markov_head_type",
                    f"one of {list(MARKOV_HEAD_TYPES)} (case-insensitive)", self.markov_head_type)
        for name in ("markov_rank", "n_shared_experts"):
            v = getattr(self, name)
            check_field(is_int(v) and v >= 0, name, "a non-negative integer", v)
        check_field(is_int(self.noise_token_id) and 0 <= self.noise_token_id < self.vocab_size, "noise_token_id",
                    f"a token id in [0, vocab_size={self.vocab_size})", self.noise_token_id)
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
            check_field(is_number(v) and v > 0, name, "a positive number", v)
            object.__setattr__(self, name, float(v))  # HF writes `"rope_theta": 10000`; to_dict stays one spelling
        for name in ("hc_eps", "norm_eps"):
            v = getattr(self, name)
            check_field(is_number(v) and 0 < v < 1, name, "a number in (0, 1)", v)
        for name in ("norm_topk_prob", "vision", "kv_fp8", "act_fp8"):
            check_field(isinstance(getattr(self, name), bool), name, "true or false", getattr(self, name))
        for name in ("param_dtype", "compute_dtype"):
            check_field(getattr(self, name) in ("float32", "bfloat16"), name, "'float32' or 'bfloat16'",
                        getattr(self, name))
        check_field(self.moe_routing in ("auto", "routed", "dense"), "moe_routing", "'auto', 'routed' or 'dense'",
                    self.moe_routing)
        if self.kv_fp8 or self.act_fp8:
            check_field(self.head_dim % 32 == 0, "head_dim", "a multiple of 32 (fp8 blocks of 32 values)",
                        self.head_dim)

    # ---- I/O -----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DSparkConfig":
        """A V4.1 draft config in any of the three spellings (module docstring)."""
        from dspark_jax.drafts import registry  # noqa: PLC0415  (the registry imports this module)

        if (other := registry.claiming_family(raw)) is not None and other.name != FAMILY:
            warnings.warn(f"DSparkConfig.from_dict of a {other.name!r} draft config: use "
                          "dspark_jax.drafts.config_from_dict (this alias goes in the next release)",
                          DeprecationWarning, stacklevel=2)
            return other.config_from_dict(raw)
        return parse_config(raw)

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


def parse_config(raw: dict[str, Any]) -> DSparkConfig:
    """A V4.1 draft config in any of the three spellings (the module docstring says how they differ)."""
    spelling = _spelling(raw)
    if spelling == "hf" and isinstance(raw.get("text_config"), dict):
        # Multimodal HF configs nest the text model's keys; they win over the top level's.
        raw = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}
    values, sources = _read_fields(raw, spelling)
    _check_unknown(raw, spelling)
    _check_sizes_given(values, spelling)
    try:
        return DSparkConfig(**values)
    except ConfigError as err:  # a foreign file's user looks for the key, not our field name
        renamed = [f"'{sources[n]}'" for n in sorted(sources) if sources[n] != n and f"'{n}'" in str(err)]
        raise ConfigError(f"{err} (read from {', '.join(renamed)})" if renamed else str(err)) from None
    except TypeError as err:  # wrong value types that slipped past __post_init__
        raise ConfigError(str(err)) from err


# ---- the three spellings ---------------------------------------------------------------------------
# Architecture fields the draft shares with the backbone: a foreign file's value is the draft's too, so
# every spelling's name is read in every spelling (ours, then HF, then inference) and they must agree.
_SHARED: dict[str, tuple[str, ...]] = {
    "dim": ("dim", "hidden_size"),
    "vocab_size": ("vocab_size",),
    "n_shared_experts": ("n_shared_experts",),
    "moe_inter_dim": ("moe_inter_dim", "moe_intermediate_size"),
    "n_heads": ("n_heads", "num_attention_heads"),
    "head_dim": ("head_dim",),
    "rope_head_dim": ("rope_head_dim", "qk_rope_head_dim"),
    "rope_theta": ("rope_theta",),
    "q_lora_rank": ("q_lora_rank",),
    "o_groups": ("o_groups",),
    "o_lora_rank": ("o_lora_rank",),
    "window": ("window", "sliding_window", "window_size"),
    "hc_mult": ("hc_mult",),
    "hc_sinkhorn_iters": ("hc_sinkhorn_iters",),
    "hc_eps": ("hc_eps",),
    "norm_eps": ("norm_eps", "rms_norm_eps"),
    "score_func": ("score_func", "scoring_func"),
    "route_scale": ("route_scale", "routed_scaling_factor"),
    "swiglu_limit": ("swiglu_limit",),
    "norm_topk_prob": ("norm_topk_prob",),
}
_SHARED_NAMES = frozenset(k for keys in _SHARED.values() for k in keys)

# Our numerics switches: no foreign file has them, so a user may add them to one (test set-ups do).
_SWITCHES = ("kv_fp8", "act_fp8", "param_dtype", "compute_dtype")

# The draft's own fields in a foreign file: only these keys, never the backbone's same-named ones
# (`n_layers`, `n_routed_experts`, ... are the backbone's there).
_DRAFT_KEYS: dict[str, dict[str, str]] = {
    "hf": {"n_layers": "num_nextn_predict_layers", "block_size": "dspark_block_size",
           "noise_token_id": "dspark_noise_token_id", "target_layer_ids": "dspark_target_layer_ids",
           "markov_rank": "dspark_markov_rank", "n_routed_experts": "dspark_n_routed_experts",
           "n_activated_experts": "dspark_num_experts_per_tok"},
    "inference": {"n_layers": "n_mtp_layers", "block_size": "dspark_block_size",
                  "noise_token_id": "dspark_noise_token_id", "target_layer_ids": "dspark_target_layer_ids",
                  "markov_rank": "dspark_markov_rank", "n_routed_experts": "dspark_n_routed_experts",
                  "n_activated_experts": "dspark_n_activated_experts"},
}
# The official code reads `dspark_n_routed_experts or n_routed_experts`: absent or 0 means the backbone's.
_BACKBONE_EXPERTS: dict[str, dict[str, str]] = {
    "hf": {"n_routed_experts": "n_routed_experts", "n_activated_experts": "num_experts_per_tok"},
    "inference": {"n_routed_experts": "n_routed_experts", "n_activated_experts": "n_activated_experts"},
}

# Every `ModelArgs` field of the official inference/model.py (the backbone's keys are known, not read).
_INFERENCE_KEYS = frozenset({
    "max_batch_size", "max_seq_len", "temperature", "dtype", "expert_dtype", "vocab_size", "dim",
    "moe_inter_dim", "n_layers", "n_mtp_layers", "n_heads", "n_routed_experts", "n_shared_experts",
    "n_activated_experts", "score_func", "gate_temp", "norm_topk_prob", "route_scale", "swiglu_limit",
    "q_lora_rank", "head_dim", "rope_head_dim", "norm_eps", "o_groups", "o_lora_rank", "window_size",
    "compress_ratios", "kv_source_layers", "index_source_layers", "compress_rope_theta", "original_seq_len",
    "rope_theta", "rope_factor", "beta_fast", "beta_slow", "index_n_heads", "index_head_dim", "index_topk",
    "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters",
    "hc_eps", "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size",
    "engram_n_heads", "engram_head_dim", "engram_pad_id", "engram_compressed_vocab_size", "vision_n_layers",
    "vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size", "vision_rope_theta",
    "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels", "vision_max_wh_ratio",
    "image_token_id", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
    "dspark_markov_rank", "dspark_n_routed_experts", "dspark_n_activated_experts",
})
# The HF config of DeepSeek-V4.1 (the V4 keys of transformers' DeepseekV4Config, their legacy names, the
# V4.1 additions) plus the generic keys transformers' PretrainedConfig and its relatives write.
_HF_KEYS = frozenset({
    # model
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "qk_rope_head_dim", "partial_rotary_factor", "q_lora_rank", "o_lora_rank", "o_groups", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "compress_rope_theta", "sliding_window", "compress_ratios", "compress_rates", "compress_rate_csa",
    "compress_rate_hca", "layer_types", "mlp_layer_types", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "norm_topk_prob",
    "routed_scaling_factor", "scoring_func", "topk_method", "swiglu_limit", "num_hash_layers", "index_n_heads",
    "index_head_dim", "index_topk", "kv_source_layer_ids", "index_source_layer_ids",
    "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size", "expert_dtype",
    "tie_word_embeddings", "num_nextn_predict_layers", "image_token_id", "vision_config", "text_config",
    "temperature", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok",
    # DeepSeek V2/V3 relatives and MoE generics
    "intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_head_dim", "v_head_dim", "first_k_dense_replace",
    "n_group", "topk_group", "ep_size", "moe_layer_freq", "aux_loss_alpha", "seq_aux", "num_experts",
    "num_local_experts", "rope_interleave", "attention_bias", "attention_dropout", "mlp_bias", "initializer_range",
    "use_cache", "pretraining_tp", "use_sliding_window", "max_window_layers", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise",
    # transformers PretrainedConfig / GenerationConfig generics
    "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "quantization_config",
    "_name_or_path", "name_or_path", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "use_bfloat16", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "tie_encoder_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "problem_type", "id2label", "label2id",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "pruned_heads", "tf_legacy_loss",
    "max_length", "min_length", "do_sample", "top_k", "top_p", "typical_p", "repetition_penalty",
    "num_beams", "num_beam_groups", "num_return_sequences", "length_penalty", "early_stopping",
    "no_repeat_ngram_size", "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id",
})
# Key families of the backbone whose members grow from version to version (SPEC 2.1 lists them with "...").
_BACKBONE_PREFIXES = ("vision_", "engram_", "index_", "compress_")
_FOREIGN_KEYS = {"hf": _HF_KEYS, "inference": _INFERENCE_KEYS}

_OUR_FIELDS = frozenset(f.name for f in dataclasses.fields(DSparkConfig))
# A key in either foreign set that is none of ours names a foreign file; HF-only names decide first
# because the inference names overlap ours (`dim`, `n_heads`, ...) and the `dspark_*` keys are in both.
# A `dspark_*` key never decides: one HF-spelt draft key in an inference file is a mix-up to report by
# name, not a reason to read the whole file as HF.
_HF_MARKERS = frozenset(k for k in _HF_KEYS - _INFERENCE_KEYS - _OUR_FIELDS if not k.startswith("dspark_"))
_INFERENCE_MARKERS = _INFERENCE_KEYS - _OUR_FIELDS


def _spelling(raw: dict[str, Any]) -> str:
    """'ours', 'hf' or 'inference', from the key names alone (module docstring)."""
    if "family" in raw:  # our files and to_dict() always write it
        return "ours"
    if any(k in _HF_MARKERS for k in raw):
        return "hf"
    if any(k in _INFERENCE_MARKERS or k.startswith(_BACKBONE_PREFIXES) for k in raw):
        return "inference"
    return "ours"


def _field_keys(name: str, spelling: str) -> tuple[str, ...]:
    if name in _SHARED:
        return _SHARED[name]
    if spelling == "ours" or name in _SWITCHES:
        return (name,)
    key = _DRAFT_KEYS[spelling].get(name)
    return (key,) if key else ()  # family, temperature, vision: not read from a foreign file


# The fields that size the model. A file must give them: their dataclass defaults are V4.1-Flash's, and
# a tiny config that forgot one would otherwise build a 5120-wide layer and fail later as a shape error.
SIZE_FIELDS = ("dim", "vocab_size", "n_layers", "n_heads", "head_dim", "moe_inter_dim", "n_routed_experts")


def _check_sizes_given(values: dict[str, Any], spelling: str) -> None:
    missing = [f for f in SIZE_FIELDS if f not in values]
    if missing:
        keys = [_field_keys(f, spelling)[0] for f in missing]
        raise ConfigError(f"config is missing the size field(s) {', '.join(repr(k) for k in keys)} "
                          f"({spelling} spelling; no V4.1-Flash default is assumed for a model's size)")


def _read_fields(raw: dict[str, Any], spelling: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The dataclass arguments, and the key each came from (for error messages)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in dataclasses.fields(DSparkConfig):  # dataclass order: the first error is always the same one
        present = [k for k in _field_keys(f.name, spelling) if k in raw]
        for k in present[1:]:
            if raw[k] != raw[present[0]]:
                raise ConfigError(f"config keys '{present[0]}' and '{k}' (both field '{f.name}') disagree: "
                                  f"{raw[present[0]]!r} vs {raw[k]!r}")
        if present:
            values[f.name], sources[f.name] = raw[present[0]], present[0]
        backbone = _BACKBONE_EXPERTS.get(spelling, {}).get(f.name)
        if backbone and backbone in raw and not values.get(f.name):
            values[f.name], sources[f.name] = raw[backbone], backbone
    if spelling != "ours":
        values["vision"] = _has_vision(raw, spelling)
        if "act_fp8" not in raw:
            values["act_fp8"] = _fp8_weights(raw, spelling)
    return values, sources


def _fp8_weights(raw: dict[str, Any], spelling: str) -> bool:
    """Whether the file describes fp8/fp4 weights, for which the official forward quantizes the
    activations before every fp8/fp4 GEMM (SPEC 3): inference `dtype: "fp8"`, HF an fp8
    `quantization_config`. Our `act_fp8` then defaults to on, so the draft follows that forward."""
    if spelling == "inference":
        dtype = raw.get("dtype", "bf16")
        check_field(dtype in ("bf16", "fp8"), "dtype", "'bf16' or 'fp8'", dtype)
        return dtype == "fp8"
    quant = raw.get("quantization_config")
    return isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8"


def _has_vision(raw: dict[str, Any], spelling: str) -> bool:
    if spelling == "inference":
        n = raw.get("vision_n_layers", 0)
        check_field(is_int(n) and n >= 0, "vision_n_layers", "a non-negative integer", n)
        return n > 0
    vc = raw.get("vision_config")
    if vc is None:
        return False
    check_field(isinstance(vc, dict), "vision_config", "an object or null", vc)
    n = vc.get("num_hidden_layers", 1)  # a tower with no layer count still is one
    check_field(is_int(n) and n >= 0, "vision_config.num_hidden_layers", "a non-negative integer", n)
    return bool(vc) and n > 0


def _check_unknown(raw: dict[str, Any], spelling: str) -> None:
    """The unknown-key policy of the module docstring."""
    if spelling == "ours":
        valid = sorted(_OUR_FIELDS | _SHARED_NAMES)
        unknown = sorted(set(raw) - set(valid))
        if unknown:
            raise ConfigError("unknown config key(s) " + ", ".join(f"'{k}'{did_you_mean(k, valid)}" for k in unknown)
                              + " (our spelling: the DSparkConfig field names)")
        return
    known = _FOREIGN_KEYS[spelling] | _SHARED_NAMES | set(_SWITCHES)
    unknown = sorted(k for k in raw if k not in known and not k.startswith(_BACKBONE_PREFIXES))
    # Draft keys of BOTH foreign spellings: an inference draft key in an HF file is a mix-up, not a new key.
    draft = sorted({k for keys in _DRAFT_KEYS.values() for k in keys.values()} | _SHARED_NAMES)
    own_draft = sorted(set(_DRAFT_KEYS[spelling].values()) | _SHARED_NAMES | set(_SWITCHES))
    bad = [k for k in unknown if k.startswith("dspark_") or difflib.get_close_matches(k, draft, 1, 0.85)]
    if bad:
        # the other spelling's key of a field: name this spelling's key of the same field, not a look-alike
        other = {key: _DRAFT_KEYS[spelling][f] for keys in _DRAFT_KEYS.values() for f, key in keys.items()}
        raise ConfigError(f"unknown draft config key(s) in the {spelling} spelling: " + ", ".join(
            f"'{k}' (did you mean '{other[k]}'?)" if k in other else f"'{k}'{did_you_mean(k, own_draft)}" for k in bad))
    if unknown:
        warnings.warn(f"{spelling} config: ignoring unknown key(s) {unknown} (not read by the draft; known "
                      f"backbone keys are listed in dspark_jax.drafts.v41.config)", stacklevel=3)
