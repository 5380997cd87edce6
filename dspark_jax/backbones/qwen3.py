"""A Qwen3-architecture decoder as a DSpark backbone (target model of the DeepSpec draft family).

Architecture (Hugging Face `Qwen3ForCausalLM`): token embedding; per layer
`x += o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))` on `input_layernorm(x)` (GQA; q/k RMSNorm per
head BEFORE RoPE; split-half "rotate_half" RoPE with rope_theta) and `x += down(silu(gate) * up)` on
`post_attention_layernorm(x)`; final RMSNorm; LM head tied to the embedding or not
(`tie_word_embeddings`). No biases, no sliding window, no rope scaling (rejected when configured).

Parameter tree (layer params stacked on a leading "layers" axis; kernels [in, out]):
```
embed                      [V, D]            (vocab, embed)     model.embed_tokens.weight
layers.attn_norm.scale     [L, D]            (layers, norm)     model.layers.{i}.input_layernorm.weight
layers.q_proj.kernel       [L, D, H*hd]      (layers, embed, heads)      ...self_attn.q_proj.weight [H*hd, D]
layers.k_proj.kernel       [L, D, Hkv*hd]    (layers, embed, kv_heads)   ...self_attn.k_proj.weight
layers.v_proj.kernel       [L, D, Hkv*hd]    (layers, embed, kv_heads)   ...self_attn.v_proj.weight
layers.o_proj.kernel       [L, H*hd, D]      (layers, heads, embed)      ...self_attn.o_proj.weight [D, H*hd]
layers.q_norm.scale        [L, hd]           (layers, head_dim)          ...self_attn.q_norm.weight
layers.k_norm.scale        [L, hd]           (layers, head_dim)          ...self_attn.k_norm.weight
layers.ffn_norm.scale      [L, D]            (layers, norm)     ...post_attention_layernorm.weight
layers.gate_proj.kernel    [L, D, F]         (layers, embed, mlp)        ...mlp.gate_proj.weight [F, D]
layers.up_proj.kernel      [L, D, F]         (layers, embed, mlp)        ...mlp.up_proj.weight [F, D]
layers.down_proj.kernel    [L, F, D]         (layers, mlp, embed)        ...mlp.down_proj.weight [D, F]
norm.scale                 [D]               (norm,)            model.norm.weight
lm_head                    [V, D]            (vocab, embed)     lm_head.weight   (absent when tied)
```
The Hugging Face name table and loader are `dspark_jax.checkpoint.qwen3_hf` (`load_qwen3_hf`, `hf_layer_map`).
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.backbones.base import (Backbone, BackboneOutput, as_dtype, at_positions, cache_from_view,
                                       cache_view, cache_visibility, query_positions, record_taps,
                                       taps_to_features, write_and_read)
from dspark_jax.nn.attention import KeySegment, grouped_query_attention
from dspark_jax.nn.linear import mixed_einsum
from dspark_jax.nn.norm import RMSNorm, rms_norm
from dspark_jax.nn.params import param
from dspark_jax.nn.rows import take_rows
from dspark_jax.nn.qwen3_layer import Qwen3DecoderLayer
from dspark_jax.validation import ConfigError, check_field, did_you_mean, is_number, read_json_config

DTYPES = ("float32", "bfloat16")


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """A Qwen3 backbone; field names are the Hugging Face config.json keys (plus our dtypes)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # defaults as in transformers' Qwen3Config
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    param_dtype: str = "float32"
    compute_dtype: str = "float32"

    @property
    def dim(self) -> int:
        return self.hidden_size

    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            check_field(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, "a positive integer", v)
        check_field(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                    f"a divisor of num_attention_heads={self.num_attention_heads}", self.num_key_value_heads)
        check_field(self.head_dim % 2 == 0, "head_dim", "an even number (RoPE rotates pairs)", self.head_dim)
        check_field(is_number(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1, "rms_norm_eps", "a number in (0, 1)",
                    self.rms_norm_eps)
        check_field(is_number(self.rope_theta) and self.rope_theta > 1, "rope_theta", "a number > 1", self.rope_theta)
        check_field(isinstance(self.tie_word_embeddings, bool), "tie_word_embeddings", "true or false",
                    self.tie_word_embeddings)
        for name in ("param_dtype", "compute_dtype"):
            check_field(getattr(self, name) in DTYPES, name, f"one of {DTYPES}", getattr(self, name))

    # ---- Hugging Face config.json -----------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], **overrides) -> "Qwen3Config":
        """Read a Hugging Face Qwen3 `config.json` dict; `overrides` set our own fields (dtypes)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"expected a JSON object, got {type(raw).__name__}")
        _check_typos(raw)
        mt = raw.get("model_type", "qwen3")
        if mt != "qwen3":
            raise ConfigError(f"config field 'model_type': expected 'qwen3', got {mt!r}"
                              + (" (Qwen3-MoE is not supported)" if mt == "qwen3_moe" else ""))
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in raw:
                raise ConfigError(f"config field '{key}' is missing (required for a Qwen3 config)")
        act = raw.get("hidden_act", "silu")
        check_field(act == "silu", "hidden_act", "'silu' (SwiGLU MLP)", act)
        # `is False`, not falsiness: an object or 0 here is a malformed file, not a "no".
        for key, why in (("attention_bias", "biased q/k/v/o"), ("use_sliding_window", "sliding-window layers")):
            v = raw.get(key)
            check_field(v is None or v is False, key, f"false ({why} not implemented)", v)
        bad_layers = [t for t in raw.get("layer_types") or () if t != "full_attention"]
        check_field(not bad_layers, "layer_types", "only 'full_attention' layers", bad_layers)
        values = {k: raw[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                      "num_attention_heads")}
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads")
        values["num_key_value_heads"] = heads if kv_heads is None else kv_heads  # HF: null = multi-head
        head_dim = raw.get("head_dim")
        if head_dim is None:  # HF default
            hs = raw["hidden_size"]
            check_field(isinstance(heads, int) and heads > 0 and isinstance(hs, int) and hs % heads == 0, "head_dim",
                        "present, or hidden_size divisible by num_attention_heads", None)
            head_dim = hs // heads
        values["head_dim"] = head_dim
        # param_dtype / compute_dtype are ours (written by `to_hf_dict`; transformers ignores them).
        for key in ("rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "param_dtype", "compute_dtype"):
            if key in raw and raw[key] is not None:
                values[key] = raw[key]
        values["rope_theta"] = _rope_theta(raw)
        values.update(overrides)
        try:
            return cls(**values)
        except TypeError as err:
            raise ConfigError(str(err)) from None

    @classmethod
    def from_hf_json(cls, path: str | Path, **overrides) -> "Qwen3Config":
        """Load `config.json` (or the folder holding it)."""
        return read_json_config(path, lambda raw: cls.from_hf_dict(raw, **overrides))

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json spelling (what `transformers.Qwen3Config(**d)` accepts), plus our
        param_dtype / compute_dtype so that `from_hf_dict(to_hf_dict())` round-trips."""
        d = dataclasses.asdict(self)
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                "attention_bias": False, "use_sliding_window": False, "rope_scaling": None, **d}

    def replace(self, **changes) -> "Qwen3Config":
        return dataclasses.replace(self, **changes)


# The keys `from_hf_dict` reads, and keys of Hugging Face Qwen3 configs it knows and does not read. An other
# key that is a near miss of a read one (`rms_norm_epsilon`) is a typo that would leave the field at its
# default; every other key (generic transformers keys, a draft's own) passes, as transformers lets it.
_READ_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
              "tie_word_embeddings", "max_position_embeddings", "attention_bias", "use_sliding_window", "layer_types",
              "hidden_act", "model_type", "param_dtype", "compute_dtype")
_KNOWN_UNREAD = frozenset({"sliding_window", "max_window_layers", "moe_intermediate_size"})


def _check_typos(raw: dict) -> None:
    typos = sorted(k for k in raw if k not in _READ_KEYS and k not in _KNOWN_UNREAD
                   and difflib.get_close_matches(k, _READ_KEYS, 1, 0.85))
    if typos:
        raise ConfigError("unknown config key(s) " + ", ".join(f"'{k}'{did_you_mean(k, _READ_KEYS)}" for k in typos))


def _rope_theta(raw: dict) -> float:
    """rope_theta from either spelling (`rope_theta` + `rope_scaling`, or transformers 5's
    `rope_parameters`); anything but plain RoPE is rejected."""
    thetas = []
    for key in ("rope_scaling", "rope_parameters"):
        spec = raw.get(key)
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise ConfigError(f"config field '{key}': expected an object or null, got {spec!r}")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"config field '{key}': rope type {kind!r} is not implemented "
                              f"(only plain RoPE, rope_type 'default'); got {spec!r}")
        if "rope_theta" in spec:
            thetas.append((f"{key}.rope_theta", spec["rope_theta"]))
    if raw.get("rope_theta") is not None:
        thetas.append(("rope_theta", raw["rope_theta"]))
    for name, v in thetas:
        check_field(is_number(v) and v > 1, name, "a number > 1", v)
    if not thetas:
        return 10000.0  # transformers' default
    if len({v for _, v in thetas}) > 1:
        raise ConfigError(f"config fields disagree on the RoPE base: {dict(thetas)}")
    return thetas[0][1]


# ---------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------


class Qwen3Cache(NamedTuple):
    length: jax.Array  # i32[B] committed positions per row
    k: jax.Array  # [L, B, S, Hkv, hd] post-norm post-RoPE keys
    v: jax.Array  # [L, B, S, Hkv, hd]


class _Layer(Qwen3DecoderLayer):
    """One decoder layer as a scan body: carry = (x, k cache, v cache, tap buffer)."""

    tap_states: tuple[int, ...] = ()

    def __call__(self, carry, layer, positions, visible):
        x, k_all, v_all, taps = carry
        taps = record_taps(taps, x, layer, self.tap_states)

        def attend(q, k, v):  # write this call's rows, then attend over the layer's cache
            k_cache, k_rows = write_and_read(k_all, layer, k, positions)
            v_cache, v_rows = write_and_read(v_all, layer, v, positions)
            o = grouped_query_attention(q, [KeySegment(k_rows, v_rows, visible)], scale=self.cfg.head_dim ** -0.5)
            return o, (k_cache, v_cache)

        x, (k_all, v_all) = self.residual(x, positions, attend)
        return (x, k_all, v_all, taps), None


class _Qwen3(nn.Module):
    cfg: Qwen3Config
    tap_states: tuple[int, ...] = ()

    @nn.compact
    def __call__(self, tokens, length, k_cache, v_cache, logits_at=None):
        c = self.cfg
        cd = as_dtype(c.compute_dtype)
        b, t = tokens.shape
        embed = param(self, "embed", nn.initializers.normal(c.hidden_size ** -0.5), (c.vocab_size, c.hidden_size),
                      c.param_dtype, ("vocab", "embed"))
        x = take_rows(embed, tokens).astype(cd)
        positions = query_positions(length, t)
        max_len = k_cache.shape[2]
        visible = cache_visibility(positions, max_len)
        taps = jnp.zeros((len(self.tap_states), b, t, c.hidden_size), cd)
        layers = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(0, nn.broadcast, nn.broadcast), length=c.num_hidden_layers,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        # The layers carry the cache as a bit view (`cache_view`: one conversion, not two per layer).
        (x, k_view, v_view, taps), _ = layers(c, self.tap_states, name="layers")(
            (x, cache_view(k_cache), cache_view(v_cache), taps), jnp.arange(c.num_hidden_layers, dtype=jnp.int32),
            positions, visible)
        k_cache, v_cache = cache_from_view(k_view, k_cache.dtype), cache_from_view(v_view, v_cache.dtype)
        taps = record_taps(taps, x, c.num_hidden_layers, self.tap_states)
        x = at_positions(x, logits_at)
        x = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype, name="norm")(x)
        if c.tie_word_embeddings:
            head = embed
        else:
            head = param(self, "lm_head", nn.initializers.normal(c.hidden_size ** -0.5),
                         (c.vocab_size, c.hidden_size), c.param_dtype, ("vocab", "embed"))
        logits = mixed_einsum("btd,vd->btv", x, head.astype(cd))
        return logits, taps, k_cache, v_cache


# ---------------------------------------------------------------------------------------------------
# The backbone
# ---------------------------------------------------------------------------------------------------


class Qwen3Backbone(Backbone):
    """Qwen3 decoder behind the backbone interface (see `dspark_jax.backbones.base`)."""

    def __init__(self, cfg: Qwen3Config):
        if not isinstance(cfg, Qwen3Config):
            raise TypeError(f"Qwen3Backbone needs a Qwen3Config, got {type(cfg).__name__}")
        self.cfg = cfg

    @property
    def dim(self) -> int:
        return self.cfg.hidden_size

    @property
    def n_layers(self) -> int:
        return self.cfg.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def _boxed_init(self, key):
        c = self.cfg
        kv = jnp.zeros((c.num_hidden_layers, 1, 1, c.num_key_value_heads, c.head_dim), as_dtype(c.compute_dtype))
        return _Qwen3(c).init(key, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), kv, kv)["params"]

    def init_cache(self, batch: int, max_len: int) -> Qwen3Cache:
        c = self.cfg
        _check_cache_args(batch, max_len, c.max_position_embeddings)
        shape = (c.num_hidden_layers, batch, max_len, c.num_key_value_heads, c.head_dim)
        cd = as_dtype(c.compute_dtype)
        return Qwen3Cache(jnp.zeros((batch,), jnp.int32), jnp.zeros(shape, cd), jnp.zeros(shape, cd))

    def forward(self, params, cache: Qwen3Cache, tokens, *, taps: tuple[int, ...] = (),
                tap_mode: str = "entry", logits_at: jax.Array | None = None) -> BackboneOutput:
        states = self._check_call(cache, tokens, taps, tap_mode)
        logits, buf, k, v = _Qwen3(self.cfg, states).apply({"params": params}, tokens.astype(jnp.int32),
                                                           cache.length, cache.k, cache.v, logits_at)
        b, t = tokens.shape
        feats = taps_to_features(buf, b, t, as_dtype(self.cfg.compute_dtype))
        return BackboneOutput(logits, feats, cache._replace(k=k, v=v))

    def tied(self, params) -> dict[str, jax.Array]:
        head = params["embed"] if self.cfg.tie_word_embeddings else params["lm_head"]
        return {"embed": params["embed"], "head": head}

    def embed(self, params, ids) -> jax.Array:
        return take_rows(params["embed"], ids).astype(as_dtype(self.cfg.compute_dtype))

    def final_norm(self, params, x) -> jax.Array:
        """The final RMSNorm (what a draft applies before the tied head)."""
        return rms_norm(x, params["norm"]["scale"], self.cfg.rms_norm_eps)


def _check_cache_args(batch, max_len, max_positions):
    if not (isinstance(batch, int) and batch > 0):
        raise ValueError(f"init_cache: 'batch' must be a positive integer, got {batch!r}")
    if not (isinstance(max_len, int) and max_len > 0):
        raise ValueError(f"init_cache: 'max_len' must be a positive integer, got {max_len!r}")
    if max_positions is not None and max_len > max_positions:
        raise ValueError(f"init_cache: 'max_len' {max_len} exceeds the model's max_position_embeddings "
                         f"{max_positions}")


# ---------------------------------------------------------------------------------------------------
# Hugging Face checkpoints: the name table and loader live in dspark_jax.checkpoint.qwen3_hf
# ---------------------------------------------------------------------------------------------------

_MOVED_TO_CHECKPOINT = ("load_qwen3_hf", "hf_layer_map", "hf_expected_shapes", "transposed", "unchanged")


def __getattr__(name: str):
    """Deprecated aliases: the Hugging Face name table and loader moved to `dspark_jax.checkpoint.qwen3_hf`
    (model modules do not import checkpoint/; it is imported here only when an old name is asked for)."""
    if name in _MOVED_TO_CHECKPOINT:
        warnings.warn(f"dspark_jax.backbones.qwen3.{name} moved to dspark_jax.checkpoint.qwen3_hf.{name}",
                      DeprecationWarning, stacklevel=2)
        from dspark_jax.checkpoint import qwen3_hf  # noqa: PLC0415  (lazy: no module-level checkpoint import)

        return getattr(qwen3_hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
