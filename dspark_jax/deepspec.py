"""The DeepSpec DSpark draft for Qwen3 targets (the "qwen3" draft family), SPEC section 4.

DeepSeek's DeepSpec trains DSpark drafts for Qwen3 targets (released as
`deepseek-ai/dspark_qwen3_{4b,8b,14b}_block7`, architecture `Qwen3DSparkModel`): N Qwen3 decoder layers
at the target's width whose attention also reads the TARGET's features as extra keys and values.

    c_p   = hidden_norm(fc(concat(taps_p)))          once per committed position p (taps = OUTPUTS of the
                                                     target layers `target_layer_ids`, -1 = embeddings)
    layer l, block rows x (slot k at position anchor + k, inputs [anchor, mask x (K-1)]):
      h = input_layernorm(x)
      q = rope(q_norm(q_proj(h)))                    queries from the block only
      K = [rope(k_norm(k_proj(c_p))) for every committed p ; rope(k_norm(k_proj(h)))]   context rows first
      V = [v_proj(c_p) ...                              ; v_proj(h)]
      x = x + o_proj(softmax(q K^T / sqrt(hd)) V)    no mask inside the block (bidirectional)
      x = x + down(silu(gate(post_attention_layernorm(x))) * up(...))
    h_final = norm(x);  U = lm_head(h_final) (the target's head, tied)
    Markov head (shared with V4.1): logits_k = U_k + W1[x_{k-1}] @ W2^T
    confidence: z_k = proj([h_final_k ; W1[x_{k-1}]]) + bias     (post-norm h, WITH a bias)

RoPE is split-half ("rotate_half", `apply_rope_split_half`) with the config's theta; a context row
sits at its absolute position, block slot k at anchor + k. At inference the block sees ALL cached
context rows (no window); in training each block sees the context strictly before its anchor.

Functional API (the same as `dspark_jax.draft`, which dispatches here when `cfg.family == "qwen3"`):

    params = init_params(cfg, key)                 # or abstract_params(cfg)
    state  = init_state(cfg, batch, max_len)       # per-layer context K/V of every committed position
    state  = prefill / ingest(params, cfg, state, main_hidden, n)
    out    = propose(params, tied, cfg, state, anchor, sampling, seeds)   -> DraftOutput

Parameter tree (layer params stacked on a leading "layers" axis; kernels [in, out]) and the DeepSpec
checkpoint names (`dspark_jax.checkpoint.deepspec` holds the mapping as data):
```
fc.kernel                 [n_taps*D, D]     fc.weight [D, n_taps*D]
hidden_norm.scale         [D]               hidden_norm.weight
layers.attn_norm.scale    [L, D]            layers.{i}.input_layernorm.weight
layers.q_proj.kernel      [L, D, H*hd]      layers.{i}.self_attn.q_proj.weight [H*hd, D]
layers.k_proj.kernel      [L, D, Hkv*hd]    layers.{i}.self_attn.k_proj.weight
layers.v_proj.kernel      [L, D, Hkv*hd]    layers.{i}.self_attn.v_proj.weight
layers.o_proj.kernel      [L, H*hd, D]      layers.{i}.self_attn.o_proj.weight [D, H*hd]
layers.q_norm.scale       [L, hd]           layers.{i}.self_attn.q_norm.weight
layers.k_norm.scale       [L, hd]           layers.{i}.self_attn.k_norm.weight
layers.ffn_norm.scale     [L, D]            layers.{i}.post_attention_layernorm.weight
layers.gate_proj.kernel   [L, D, F]         layers.{i}.mlp.gate_proj.weight [F, D]
layers.up_proj.kernel     [L, D, F]         layers.{i}.mlp.up_proj.weight [F, D]
layers.down_proj.kernel   [L, F, D]         layers.{i}.mlp.down_proj.weight [D, F]
norm.scale                [D]               norm.weight
markov.embed              [V, r]            markov_head.markov_w1.weight        (markov_rank > 0)
markov.head               [V, r]            markov_head.markov_w2.weight        (markov_rank > 0)
confidence.kernel         [D (+ r)]         confidence_head.proj.weight [1, D (+ r)]   (confidence head on)
confidence.bias           [1]               confidence_head.proj.bias [1]
(tied, from the target)   embed [V, D], head [V, D]   embed_tokens.weight, lm_head.weight
```
The `norm` / `markov` / `confidence` keys match the V4.1 tree so the trainer's loss code serves both.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax import sampling
from dspark_jax.backbones.qwen3 import apply_rope_split_half
from dspark_jax.checkpoint.trees import unflatten_paths
from dspark_jax.config import ConfigError, check_field, did_you_mean, is_int, is_number, read_json_config
from dspark_jax.heads import markov_sample_loop
from dspark_jax.nn.linear import linear, mixed_einsum
from dspark_jax.nn.norm import rms_norm

FAMILY = "qwen3"
ARCHITECTURE = "Qwen3DSparkModel"
TAP_MODE = "output"  # DeepSpec taps are layer OUTPUTS (-1 = the embeddings)
MARKOV_HEAD_TYPES = ("vanilla",)
DTYPES = ("float32", "bfloat16")


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------

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
            check_field(self.markov_head_type in MARKOV_HEAD_TYPES, "markov_head_type",
                        f"one of {MARKOV_HEAD_TYPES} (other DeepSpec Markov heads are not implemented)",
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
        if arch is not None and ARCHITECTURE not in (arch or []):
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
            if key not in raw:
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


# ---------------------------------------------------------------------------------------------------
# Parameters (explicit pytree; each leaf declared once with its logical axes)
# ---------------------------------------------------------------------------------------------------


def param_specs(cfg: DeepSpecConfig) -> dict[tuple[str, ...], tuple[tuple[int, ...], tuple[str, ...], str]]:
    """Every leaf of the tree: path -> (shape, logical axes, init) with init one of
    "fan_in" (N(0, 1/fan_in)), "ones", "small" (N(0, 0.02^2), SPEC 8's Markov W1), "zeros"."""
    d, f, hd, l = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_hidden_layers
    h, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    specs = {
        ("fc", "kernel"): ((cfg.main_hidden_dim, d), ("taps_embed", "embed"), "fan_in"),
        ("hidden_norm", "scale"): ((d,), ("norm",), "ones"),
        ("layers", "attn_norm", "scale"): ((l, d), ("layers", "norm"), "ones"),
        ("layers", "q_proj", "kernel"): ((l, d, h), ("layers", "embed", "heads"), "fan_in"),
        ("layers", "k_proj", "kernel"): ((l, d, kv), ("layers", "embed", "kv_heads"), "fan_in"),
        ("layers", "v_proj", "kernel"): ((l, d, kv), ("layers", "embed", "kv_heads"), "fan_in"),
        ("layers", "o_proj", "kernel"): ((l, h, d), ("layers", "heads", "embed"), "fan_in"),
        ("layers", "q_norm", "scale"): ((l, hd), ("layers", "head_dim"), "ones"),
        ("layers", "k_norm", "scale"): ((l, hd), ("layers", "head_dim"), "ones"),
        ("layers", "ffn_norm", "scale"): ((l, d), ("layers", "norm"), "ones"),
        ("layers", "gate_proj", "kernel"): ((l, d, f), ("layers", "embed", "mlp"), "fan_in"),
        ("layers", "up_proj", "kernel"): ((l, d, f), ("layers", "embed", "mlp"), "fan_in"),
        ("layers", "down_proj", "kernel"): ((l, f, d), ("layers", "mlp", "embed"), "fan_in"),
        ("norm", "scale"): ((d,), ("norm",), "ones"),
    }
    if cfg.markov_rank:
        specs[("markov", "embed")] = ((cfg.vocab_size, cfg.markov_rank), ("vocab", "markov"), "small")
        specs[("markov", "head")] = ((cfg.vocab_size, cfg.markov_rank), ("vocab", "markov"), "small")
    if cfg.enable_confidence_head:
        specs[("confidence", "kernel")] = ((cfg.confidence_in_dim,), ("conf_in",), "fan_in")
        specs[("confidence", "bias")] = ((1,), ("conf_out",), "zeros")
    return specs


def _init_leaf(key, shape, init, dtype):
    if init == "ones":
        return jnp.ones(shape, dtype)
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    std = 0.02 if init == "small" else (shape[-1] if len(shape) == 1 else shape[-2]) ** -0.5
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def _init_boxed(cfg: DeepSpecConfig, key: jax.Array) -> dict:
    specs = param_specs(cfg)
    keys = jax.random.split(key, len(specs))
    dtype = jnp.dtype(cfg.param_dtype)
    flat = {path: nn.LogicallyPartitioned(_init_leaf(k, shape, init, dtype), axes)
            for (path, (shape, axes, init)), k in zip(specs.items(), keys)}
    return unflatten_paths(flat)


def init_params(cfg: DeepSpecConfig, key: jax.Array) -> dict:
    """Random parameters (the tree in this module's docstring)."""
    return nn.unbox(jax.jit(_init_boxed, static_argnums=0)(cfg, key))


def abstract_params(cfg: DeepSpecConfig) -> dict:
    return nn.unbox(jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0)))


def param_logical_axes(cfg: DeepSpecConfig) -> dict:
    return nn.get_partition_spec(jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0)))


def param_shardings(cfg: DeepSpecConfig, mesh) -> dict:
    from dspark_jax.parallel import fit_shardings, logical_shardings  # noqa: PLC0415

    return fit_shardings(logical_shardings(param_logical_axes(cfg), mesh), abstract_params(cfg))


# ---------------------------------------------------------------------------------------------------
# Math (plain functions over the param tree)
# ---------------------------------------------------------------------------------------------------


def _dense(x: jax.Array, kernel: jax.Array, cd) -> jax.Array:
    """x @ kernel in the compute dtype with f32 accumulation (as `dspark_jax.nn.Linear`)."""
    return linear(x, kernel, cd)


def context_features(params: dict, cfg: DeepSpecConfig, main_hidden: jax.Array) -> jax.Array:
    """c = hidden_norm(fc(concat taps)): [..., n_taps*D] -> [..., D] (computed once per position)."""
    cd = jnp.dtype(cfg.compute_dtype)
    return rms_norm(_dense(main_hidden, params["fc"]["kernel"], cd), params["hidden_norm"]["scale"], cfg.rms_norm_eps)


def context_kv(params: dict, cfg: DeepSpecConfig, main_hidden: jax.Array, positions: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Every layer's injected context keys and values: main_hidden [B, T, n_taps*D] at absolute positions
    [B, T] -> (K, V) [L, B, T, Hkv, hd]; K = rope(k_norm(k_proj(c))) at the row's position, V = v_proj(c)."""
    cd = jnp.dtype(cfg.compute_dtype)
    lp = params["layers"]
    c = context_features(params, cfg, main_hidden).astype(cd)
    b, t, _ = c.shape
    shape = (cfg.num_hidden_layers, b, t, cfg.num_key_value_heads, cfg.head_dim)
    k = mixed_einsum("btd,lde->lbte", c, lp["k_proj"]["kernel"].astype(cd))
    v = mixed_einsum("btd,lde->lbte", c, lp["v_proj"]["kernel"].astype(cd))
    k = rms_norm(k.astype(cd).reshape(shape), lp["k_norm"]["scale"][:, None, None, None, :], cfg.rms_norm_eps)
    k = apply_rope_split_half(k, positions[None, :, :, None], theta=cfg.rope_theta)
    return k, v.astype(cd).reshape(shape)


def block_attention(q: jax.Array, k_blk: jax.Array, v_blk: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array,
                    ctx_visible: jax.Array, scale: float) -> jax.Array:
    """Attention of N blocks per row over (visible context rows ; their own K rows), f32 math.

    q [B, N, K, H, hd]; k_blk, v_blk [B, N, K, Hkv, hd]; k_ctx, v_ctx [B, S, Hkv, hd] (shared by the N
    blocks of a row); ctx_visible bool[B, N, S]. Inside a block every query sees every row (no causal
    mask). Context rows no block can see are zeroed first: they may hold anything (not-yet-committed
    or another request's leftovers), and 0 * inf must not leak. -> o [B, N, K, H, hd] in q's dtype."""
    b, n, k, h, hd = q.shape
    hkv = k_blk.shape[3]
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    used = jnp.any(ctx_visible, axis=1)[:, :, None, None]
    kc = jnp.where(used, k_ctx.astype(f32), 0.0)
    vc = jnp.where(used, v_ctx.astype(f32), 0.0)
    qg = q.astype(f32).reshape(b, n, k, hkv, h // hkv, hd)
    s_ctx = jnp.einsum("bnqkgd,bskd->bnkgqs", qg, kc, precision=hi) * scale
    s_ctx = jnp.where(ctx_visible[:, :, None, None, None, :], s_ctx, -jnp.inf)
    s_blk = jnp.einsum("bnqkgd,bnjkd->bnkgqj", qg, k_blk.astype(f32), precision=hi) * scale
    s = jnp.concatenate([s_ctx, s_blk], axis=-1)  # the block's own rows keep every softmax row finite
    p = jax.nn.softmax(s, axis=-1)
    s_len = k_ctx.shape[1]
    o = (jnp.einsum("bnkgqs,bskd->bnqkgd", p[..., :s_len], vc, precision=hi)
         + jnp.einsum("bnkgqj,bnjkd->bnqkgd", p[..., s_len:], v_blk.astype(f32), precision=hi))
    return o.reshape(b, n, k, h, hd).astype(q.dtype)


def decoder_layer(lp: dict, cfg: DeepSpecConfig, x: jax.Array, positions: jax.Array, k_ctx: jax.Array,
                  v_ctx: jax.Array, ctx_visible: jax.Array) -> jax.Array:
    """One draft layer on block rows x [B, N, K, D] at positions [B, N, K] (lp: this layer's params)."""
    cd = jnp.dtype(cfg.compute_dtype)
    eps, hd = cfg.rms_norm_eps, cfg.head_dim
    lead = x.shape[:-1]
    h = rms_norm(x, lp["attn_norm"]["scale"], eps)
    q = rms_norm(_dense(h, lp["q_proj"]["kernel"], cd).reshape(*lead, cfg.num_attention_heads, hd),
                 lp["q_norm"]["scale"], eps)
    kb = rms_norm(_dense(h, lp["k_proj"]["kernel"], cd).reshape(*lead, cfg.num_key_value_heads, hd),
                  lp["k_norm"]["scale"], eps)
    vb = _dense(h, lp["v_proj"]["kernel"], cd).reshape(*lead, cfg.num_key_value_heads, hd)
    q = apply_rope_split_half(q, positions[..., None], theta=cfg.rope_theta)
    kb = apply_rope_split_half(kb, positions[..., None], theta=cfg.rope_theta)
    o = block_attention(q, kb, vb, k_ctx, v_ctx, ctx_visible, hd ** -0.5)
    x = x + _dense(o.reshape(*lead, -1), lp["o_proj"]["kernel"], cd)
    h = rms_norm(x, lp["ffn_norm"]["scale"], eps)
    mlp = jax.nn.silu(_dense(h, lp["gate_proj"]["kernel"], cd)) * _dense(h, lp["up_proj"]["kernel"], cd)
    return x + _dense(mlp, lp["down_proj"]["kernel"], cd)


def draft_body(params: dict, cfg: DeepSpecConfig, x: jax.Array, positions: jax.Array, k_ctx: jax.Array,
               v_ctx: jax.Array, ctx_visible: jax.Array) -> jax.Array:
    """The layer stack (one lax.scan): x [B, N, K, D], context K/V [L, B, S, Hkv, hd] -> pre-norm h."""

    def step(x, layer):
        lp, k_l, v_l = layer
        return decoder_layer(lp, cfg, x, positions, k_l, v_l, ctx_visible), None

    x, _ = jax.lax.scan(step, x, (params["layers"], k_ctx, v_ctx))
    return x


def confidence_logits(params: dict, cfg: DeepSpecConfig, normed: jax.Array, markov_emb: jax.Array | None
                      ) -> jax.Array:
    """z_k = w . [h_final_k ; W1[x_{k-1}]] + b in f32 (post-norm h, WITH a bias); zeros without the head."""
    if not cfg.enable_confidence_head:
        return jnp.zeros(normed.shape[:-1], jnp.float32)
    feats = normed.astype(jnp.float32)
    if cfg.confidence_head_with_markov:
        feats = jnp.concatenate([feats, markov_emb.astype(jnp.float32)], axis=-1)
    conf = params["confidence"]
    z = jnp.einsum("...i,i->...", feats, conf["kernel"].astype(jnp.float32), precision="highest")
    return z + conf["bias"].astype(jnp.float32)[0]


# ---------------------------------------------------------------------------------------------------
# Inference state and the functional API
# ---------------------------------------------------------------------------------------------------


class DeepSpecState(NamedTuple):
    ctx_k: jax.Array  # [L, B, S, Hkv, hd] post-norm post-RoPE context keys, slot = absolute position
    ctx_v: jax.Array  # [L, B, S, Hkv, hd]
    length: jax.Array  # i32[B] context positions written (p + 1); the anchor sits at `length`


def init_state(cfg: DeepSpecConfig, batch: int, max_len: int | None = None) -> DeepSpecState:
    """Context K/V for `max_len` positions per row (the backbone cache's length: the draft keeps ALL
    committed context, not a window)."""
    if not (is_int(max_len) and max_len > 0):
        raise ValueError(f"init_state: the DeepSpec draft keeps every committed context row, so it needs "
                         f"'max_len' (a positive integer, the backbone cache length); got {max_len!r}")
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    cd = jnp.dtype(cfg.compute_dtype)
    return DeepSpecState(jnp.zeros(shape, cd), jnp.zeros(shape, cd), jnp.zeros((batch,), jnp.int32))


def ingest(params: dict, cfg: DeepSpecConfig, state: DeepSpecState, main_hidden: jax.Array, num_new: jax.Array,
           *, impl: str = "auto") -> DeepSpecState:
    """Write the context K/V of `num_new[b]` newly committed positions (main_hidden [B, T, n_taps*D] holds
    positions length .. length+T-1; only the first num_new[b] are real).

    Rows past num_new land at positions >= the new length: invisible (a query sees slots < length only)
    and rewritten by the call that later commits those positions. Writes past max_len are dropped."""
    del impl
    b, t, _ = main_hidden.shape
    positions = state.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    k, v = context_kv(params, cfg, main_hidden, positions)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    ctx_k = state.ctx_k.at[:, rows, positions].set(k.astype(state.ctx_k.dtype), mode="drop")
    ctx_v = state.ctx_v.at[:, rows, positions].set(v.astype(state.ctx_v.dtype), mode="drop")
    return DeepSpecState(ctx_k, ctx_v, state.length + num_new.astype(jnp.int32))


def prefill(params: dict, cfg: DeepSpecConfig, state: DeepSpecState, main_hidden: jax.Array, num_valid: jax.Array,
            *, impl: str = "auto") -> DeepSpecState:
    """Seed the context from the prompt's backbone features (the draft body does not run)."""
    return ingest(params, cfg, state._replace(length=jnp.zeros_like(state.length)), main_hidden, num_valid,
                  impl=impl)


def draft_hidden(params: dict, tied: dict, cfg: DeepSpecConfig, state: DeepSpecState, anchor: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """The parallel part of a round: -> (pre-norm h [B, K, D], base logits U f32[B, K, V])."""
    from dspark_jax.draft import base_logits, block_inputs  # noqa: PLC0415  (draft.py dispatches here)

    cd = jnp.dtype(cfg.compute_dtype)
    kk = cfg.block_size
    x = jnp.take(tied["embed"], block_inputs(cfg, anchor), axis=0).astype(cd)[:, None]  # [B, 1, K, D]
    positions = (state.length[:, None] + jnp.arange(kk, dtype=jnp.int32)[None, :])[:, None]
    s = state.ctx_k.shape[2]
    visible = (jnp.arange(s, dtype=jnp.int32)[None, :] < state.length[:, None])[:, None]  # every committed row
    h = draft_body(params, cfg, x, positions, state.ctx_k, state.ctx_v, visible)[:, 0]
    return h, base_logits(h, params["norm"]["scale"], tied["head"], cfg)


def propose(params: dict, tied: dict, cfg: DeepSpecConfig, state: DeepSpecState, anchor: jax.Array,
            sampling_params: sampling.SamplingParams, seeds: jax.Array, *, impl: str = "auto",
            filtering: bool = True):
    """One draft block per request (as `dspark_jax.draft.propose`): the parallel body, the shared Markov
    loop (draft token k keyed (seed, length + k, DRAFT)), the confidence head on the post-norm h.
    DraftOutput.hidden is the pre-norm h (as for V4.1)."""
    from dspark_jax.draft import DraftOutput  # noqa: PLC0415

    h, base = draft_hidden(params, tied, cfg, state, anchor)
    markov = params.get("markov")
    tokens, logits, emb = markov_sample_loop(
        base, anchor, None if markov is None else markov["embed"], None if markov is None else markov["head"],
        sampling_params, seeds, state.length + 1, impl=impl, filtering=filtering)
    normed = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps)
    conf = confidence_logits(params, cfg, normed, emb)
    return DraftOutput(tokens, logits, conf, emb, h)


# ---------------------------------------------------------------------------------------------------
# Training forward (SPEC 8 with DeepSpec's attention pattern)
# ---------------------------------------------------------------------------------------------------


def train_forward(params: dict, tied: dict, cfg: DeepSpecConfig, main_hidden: jax.Array, blocks, anchors: jax.Array,
                  *, detach_conf_inputs: bool = False):
    """Teacher-forced forward of B*N blocks: main_hidden [B, T, n_taps*D] (taps of every position),
    `blocks` from `train.anchors.make_blocks`, anchors i32[B, N]
    -> (pre-norm h [B*N, K, D], f32 normed h, W1[prev] [B*N, K, r] | None, conf logits f32[B*N, K]).

    Each block attends to the context of EVERY position strictly before its anchor (no window) and to its
    own K slots bidirectionally: exactly what the inference draft sees after committing 0..anchor-1."""
    b, t, _ = main_hidden.shape
    n, kk = blocks.inputs.shape[1:]
    cd = jnp.dtype(cfg.compute_dtype)
    seq_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    k_ctx, v_ctx = context_kv(params, cfg, main_hidden.astype(cd), seq_pos)
    visible = jnp.arange(t, dtype=jnp.int32)[None, None, :] < anchors.astype(jnp.int32)[:, :, None]
    x = jnp.take(tied["embed"], blocks.inputs, axis=0).astype(cd)  # [B, N, K, D]
    h = draft_body(params, cfg, x, blocks.positions, k_ctx, v_ctx, visible).reshape(b * n, kk, -1)
    normed = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps)
    prev = blocks.prev.reshape(b * n, kk)
    emb = jnp.take(params["markov"]["embed"], prev, axis=0) if cfg.markov_rank else None
    n_c = jax.lax.stop_gradient(normed) if detach_conf_inputs else normed
    e_c = None if emb is None else (jax.lax.stop_gradient(emb) if detach_conf_inputs else emb)
    conf = confidence_logits(params, cfg, n_c, e_c)
    return h, normed.astype(jnp.float32), emb, conf
