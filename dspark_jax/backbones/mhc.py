"""A small DeepSeek-V4.1-style backbone: 4-stream single-pass mHC residual, latent MQA with a sink over a
causal KV cache, optional MoE. It exists so V4.1-family drafts can run end to end (tests, the demo)
without the 280B model; the block is the V4.1 draft block (SPEC 2.4-2.6) with the window replaced by
full causal attention over the cache.

Per layer (single pass: a sub-layer's `pre` collapses the NEXT sub-layer's input; layer 0's incoming
`pre` is one-hot on stream 0, which equals any convex mix since the embedding is copied to every stream):
```
attn_pre, attn_post, attn_comb = hc_mixes(X; hc_attn)
y = attn(attn_norm(hc_pre(X, pre_in)));   X = hc_post(y, X, attn_post, attn_comb)
ffn_pre, ffn_post, ffn_comb = hc_mixes(X; hc_ffn)
y = ffn(ffn_norm(hc_pre(X, attn_pre)));   X = hc_post(y, X, ffn_post, ffn_comb)
-> (X, ffn_pre)
```
Output: `h = hc_pre(X, last ffn_pre)`, `logits = f32(RMSNorm(h) @ head^T)`.
Attention: `q = wq_b(q_norm(wq_a(x)))` [H, hd]; one latent `kv = kv_norm(wkv(x))` [hd] per token serves
as key and value; interleaved RoPE on the last rope_head_dim dims of q and kv; the kv row is
fp8-rounded after RoPE (`kv_fp8`) and cached; softmax with a per-head sink; inverse RoPE on o; grouped
`wo_a`, then `wo_b`. The attention/FFN/mHC parameter layout equals the V4.1 draft block's
(docs/params.md), stacked on a leading "layers" axis.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.backbones.base import (Backbone, BackboneOutput, as_dtype, at_positions, cache_visibility,
                                       query_positions, record_taps, taps_to_features, write_rows)
from dspark_jax.nn.attention import KeySegment, WindowAttention, grouped_out_proj, grouped_query_attention
from dspark_jax.nn.head import f32_head_logits
from dspark_jax.nn.mhc import MhcBlock, hc_pre, one_hot_pre
from dspark_jax.nn.moe import MoE, swiglu_mlp
from dspark_jax.nn.norm import RMSNorm, rms_norm
from dspark_jax.nn.params import fan_in_normal, param
from dspark_jax.nn.rows import take_rows
from dspark_jax.nn.rounding import to_dtype
from dspark_jax.validation import (SCORE_FUNCS, ConfigError, check_field, did_you_mean, is_int, is_number,
                                   read_json_config)

DTYPES = ("float32", "bfloat16")
MHC_SIZE_FIELDS = ("dim", "vocab_size", "n_layers", "n_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class MhcConfig:
    dim: int = 64
    vocab_size: int = 512
    n_layers: int = 4
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_heads: int = 4
    head_dim: int = 64
    rope_head_dim: int = 16
    rope_theta: float = 10000.0
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 32
    kv_fp8: bool = True
    inter_dim: int = 128  # dense SwiGLU width (used when n_routed_experts == 0)
    n_routed_experts: int = 0  # 0 = dense SwiGLU FFN
    n_activated_experts: int = 2
    n_shared_experts: int = 1
    moe_inter_dim: int = 32
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    norm_topk_prob: bool = True
    norm_eps: float = 1e-20
    act_fp8: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "float32"

    def __post_init__(self):
        for name in ("n_routed_experts", "n_shared_experts"):
            v = getattr(self, name)
            check_field(is_int(v) and v >= 0, name, "a non-negative integer", v)
        # The FFN fields of the other kind (MoE ones for a dense model) are unused but still checked: a
        # malformed value in the file is a mistake either way.
        for name in ("dim", "vocab_size", "n_layers", "hc_mult", "hc_sinkhorn_iters", "n_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "rope_head_dim", "inter_dim", "n_activated_experts",
                     "moe_inter_dim"):
            v = getattr(self, name)
            check_field(is_int(v) and v > 0, name, "a positive integer", v)
        check_field(self.rope_head_dim % 2 == 0 and self.rope_head_dim <= self.head_dim, "rope_head_dim",
                    f"an even number <= head_dim={self.head_dim}", self.rope_head_dim)
        check_field(self.n_heads % self.o_groups == 0, "o_groups", f"a divisor of n_heads={self.n_heads}",
                    self.o_groups)
        if self.n_routed_experts:
            check_field(self.n_activated_experts <= self.n_routed_experts, "n_activated_experts",
                        f"at most n_routed_experts={self.n_routed_experts}", self.n_activated_experts)
        check_field(self.score_func in SCORE_FUNCS, "score_func", f"one of {SCORE_FUNCS}", self.score_func)
        for name in ("rope_theta", "route_scale", "swiglu_limit"):
            v = getattr(self, name)
            check_field(is_number(v) and v > 0, name, "a positive number", v)
        for name in ("hc_eps", "norm_eps"):
            v = getattr(self, name)
            check_field(is_number(v) and 0 < v < 1, name, "a number in (0, 1)", v)
        for name in ("kv_fp8", "act_fp8", "norm_topk_prob"):
            check_field(isinstance(getattr(self, name), bool), name, "true or false", getattr(self, name))
        for name in ("param_dtype", "compute_dtype"):
            check_field(getattr(self, name) in DTYPES, name, f"one of {DTYPES}", getattr(self, name))
        if self.kv_fp8:
            check_field(self.head_dim % 32 == 0, "head_dim", "a multiple of 32 when kv_fp8 (fp8 blocks of 32)",
                        self.head_dim)
        if self.act_fp8:
            for name in ("dim", "q_lora_rank", "moe_inter_dim" if self.n_routed_experts else "inter_dim"):
                check_field(getattr(self, name) % 32 == 0, name, "a multiple of 32 when act_fp8", getattr(self, name))
            check_field(self.o_groups * self.o_lora_rank % 32 == 0, "o_lora_rank",
                        "o_groups * o_lora_rank a multiple of 32 when act_fp8", self.o_lora_rank)

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    # ---- I/O -------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "MhcConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"expected a JSON object, got {type(raw).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, v in raw.items():
            name = _ALIASES.get(key, key)
            if name not in fields:
                raise ConfigError(f"config field '{key}' is not an MhcConfig field{did_you_mean(key, fields)} "
                                  f"(known: {sorted(fields)})")
            if name in values and values[name] != v:
                raise ConfigError(f"config fields '{name}' and its alias '{key}' disagree: {values[name]!r} vs {v!r}")
            values[name] = v
        missing = [f for f in MHC_SIZE_FIELDS if f not in values]
        if missing:
            raise ConfigError(f"config is missing the size field(s) {', '.join(repr(f) for f in missing)} "
                              "(an MhcConfig file must size the model; no default is assumed)")
        try:
            return cls(**values)
        except TypeError as err:
            raise ConfigError(str(err)) from None

    @classmethod
    def from_json(cls, path: str | Path) -> "MhcConfig":
        return read_json_config(path, cls.from_dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "MhcConfig":
        return dataclasses.replace(self, **changes)


_ALIASES = {"vocab": "vocab_size", "hidden_size": "dim", "num_attention_heads": "n_heads",
            "qk_rope_head_dim": "rope_head_dim", "rms_norm_eps": "norm_eps"}


# ---------------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------------


class MhcCache(NamedTuple):
    length: jax.Array  # i32[B]
    kv: jax.Array  # [L, B, S, hd] latent KV rows (post-RoPE, fp8-rounded when kv_fp8)


class _CausalLatentAttention(WindowAttention):
    """The V4.1 latent MQA (same parameters as the draft's `WindowAttention`), causal over a KV cache."""

    def __call__(self, x, positions, kv_all, layer, visible):
        c = self.cfg
        b, t, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))).reshape(b, t, c.n_heads, c.head_dim)
        q = self._rope(q, positions[..., None])  # queries are not fp8-rounded
        kv_all = write_rows(kv_all, layer, self.kv(x, positions), positions)
        keys = kv_all[layer][:, :, None, :]  # [B, S, 1, hd]: MQA, key = value
        o = grouped_query_attention(q, [KeySegment(keys, keys, visible)], scale=c.head_dim ** -0.5, sink=self.sink)
        o = self._rope(o, positions[..., None], inverse=True)
        o = grouped_out_proj(o.reshape(b, t, -1), self.wo_a(), jnp.dtype(c.compute_dtype))
        return self.wo_b(o), kv_all


class _DenseFFN(nn.Module):
    cfg: MhcConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        d, i = c.dim, c.inter_dim
        w1 = param(self, "w1", fan_in_normal(d), (d, i), c.param_dtype, ("embed", "mlp"))
        w3 = param(self, "w3", fan_in_normal(d), (d, i), c.param_dtype, ("embed", "mlp"))
        w2 = param(self, "w2", fan_in_normal(i), (i, d), c.param_dtype, ("mlp", "embed"))
        cd = jnp.dtype(c.compute_dtype)
        y = swiglu_mlp(x, w1.astype(cd), w3.astype(cd), w2.astype(cd), limit=c.swiglu_limit, act_fp8=c.act_fp8)
        return y.astype(cd)


class _Layer(MhcBlock):
    """One single-pass mHC layer as a scan body: carry = (streams, pre_in, kv cache, tap buffer)."""

    tap_states: tuple[int, ...] = ()

    def setup(self):
        super().setup()
        c = self.cfg
        self.attn = _CausalLatentAttention(c)
        if c.n_routed_experts:
            self.ffn = MoE(c.dim, c.n_routed_experts, c.n_activated_experts, c.moe_inter_dim, c.n_shared_experts,
                           c.route_scale, c.score_func, c.norm_topk_prob, c.swiglu_limit, c.param_dtype,
                           c.compute_dtype, c.act_fp8)
        else:
            self.ffn = _DenseFFN(c)

    def __call__(self, carry, layer, positions, visible):
        streams, pre_in, kv_all, taps = carry
        taps = record_taps(taps, stream_mean(streams), layer, self.tap_states)
        streams, ffn_pre, kv_all = self.mix(streams, pre_in,
                                            lambda x: self.attn(x, positions, kv_all, layer, visible))
        return (streams, ffn_pre, kv_all, taps), None


def stream_mean(streams: jax.Array) -> jax.Array:
    """The tap feature of an mHC residual [.., hc, D]: the plain mean over streams (f32, back in dtype)."""
    return to_dtype(jnp.mean(streams.astype(jnp.float32), axis=-2), streams.dtype)


class _Mhc(nn.Module):
    cfg: MhcConfig
    tap_states: tuple[int, ...] = ()

    @nn.compact
    def __call__(self, tokens, length, kv_cache, logits_at=None):
        c = self.cfg
        cd = as_dtype(c.compute_dtype)
        b, t = tokens.shape
        embed = param(self, "embed", nn.initializers.normal(c.dim ** -0.5), (c.vocab_size, c.dim), c.param_dtype,
                      ("vocab", "embed"))
        x = take_rows(embed, tokens).astype(cd)
        streams = jnp.broadcast_to(x[..., None, :], (b, t, c.hc_mult, c.dim))
        pre = one_hot_pre(c.hc_mult, (b, t))
        positions = query_positions(length, t)
        visible = cache_visibility(positions, kv_cache.shape[2])
        taps = jnp.zeros((len(self.tap_states), b, t, c.dim), cd)
        layers = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(0, nn.broadcast, nn.broadcast), length=c.n_layers,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        (streams, pre, kv_cache, taps), _ = layers(c, self.tap_states, name="layers")(
            (streams, pre, kv_cache, taps), jnp.arange(c.n_layers, dtype=jnp.int32), positions, visible)
        taps = record_taps(taps, stream_mean(streams), c.n_layers, self.tap_states)
        h = hc_pre(at_positions(streams, logits_at), at_positions(pre, logits_at))  # no hc_head in V4.1
        h = RMSNorm(c.dim, c.norm_eps, c.param_dtype, name="norm")(h)
        head = param(self, "head", nn.initializers.normal(c.dim ** -0.5), (c.vocab_size, c.dim), c.param_dtype,
                     ("vocab", "embed"))
        logits = f32_head_logits(h, head)  # the LM head is applied in f32 (from its stored dtype)
        return logits, taps, kv_cache


class MhcBackbone(Backbone):
    """V4.1-style mHC backbone behind the backbone interface (see `dspark_jax.backbones.base`).

    Params: `embed` [V, D], `layers.{attn_norm,ffn_norm,hc_attn,hc_ffn,attn,ffn}` stacked [L, ...] (the
    V4.1 draft block layout), `norm.scale` [D], `head` [V, D] (untied, as in V4.1)."""

    def __init__(self, cfg: MhcConfig):
        if not isinstance(cfg, MhcConfig):
            raise TypeError(f"MhcBackbone needs an MhcConfig, got {type(cfg).__name__}")
        self.cfg = cfg

    @property
    def dim(self) -> int:
        return self.cfg.dim

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def _boxed_init(self, key):
        c = self.cfg
        kv = jnp.zeros((c.n_layers, 1, 1, c.head_dim), as_dtype(c.compute_dtype))
        return _Mhc(c).init(key, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), kv)["params"]

    def init_cache(self, batch: int, max_len: int) -> MhcCache:
        c = self.cfg
        if not (isinstance(batch, int) and batch > 0):
            raise ValueError(f"init_cache: 'batch' must be a positive integer, got {batch!r}")
        if not (isinstance(max_len, int) and max_len > 0):
            raise ValueError(f"init_cache: 'max_len' must be a positive integer, got {max_len!r}")
        return MhcCache(jnp.zeros((batch,), jnp.int32),
                        jnp.zeros((c.n_layers, batch, max_len, c.head_dim), as_dtype(c.compute_dtype)))

    def forward(self, params, cache: MhcCache, tokens, *, taps: tuple[int, ...] = (),
                tap_mode: str = "entry", logits_at: jax.Array | None = None) -> BackboneOutput:
        states = self._check_call(cache, tokens, taps, tap_mode)
        logits, buf, kv = _Mhc(self.cfg, states).apply({"params": params}, tokens.astype(jnp.int32), cache.length,
                                                       cache.kv, logits_at)
        b, t = tokens.shape
        feats = taps_to_features(buf, b, t, as_dtype(self.cfg.compute_dtype))
        return BackboneOutput(logits, feats, cache._replace(kv=kv))

    def tied(self, params) -> dict[str, jax.Array]:
        return {"embed": params["embed"], "head": params["head"]}

    def embed(self, params, ids) -> jax.Array:
        return take_rows(params["embed"], ids).astype(as_dtype(self.cfg.compute_dtype))

    def final_norm(self, params, x) -> jax.Array:
        return rms_norm(x, params["norm"]["scale"], self.cfg.norm_eps)
