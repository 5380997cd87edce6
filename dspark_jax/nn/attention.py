"""Attention: the one grouped-query attention core, and the V4.1 latent MQA module.

`grouped_query_attention` is the core every model but the V4.1 draft's window kernel uses: the Qwen3
backbone and the mHC backbone over their KV caches, the DeepSpec draft over the target's context rows
plus its own block. Keys come in segments (a cache; or context rows and block rows) that each carry their
own visibility, so a block's context is never copied once per block.

`WindowAttention` is the V4.1 draft's window-only latent MQA with a per-head sink (SPEC 2.5): one
512-wide latent per token serves as both key and value for all 64 heads. Keys are the block's context
ring (the last W backbone positions, written by `kv`) plus the K draft rows of the current call, which
all queries see (the block is bidirectional). Its core is `dspark_jax.kernels.window_attention`
(Pallas on TPU, jnp elsewhere); the mHC backbone reuses its parameters over a causal cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.kernels.window_attention import window_attention
from dspark_jax.nn.linear import Linear, mixed_einsum
from dspark_jax.nn.norm import RMSNorm
from dspark_jax.nn.params import fan_in_normal, param
from dspark_jax.nn.quant import fp8_quant_dequant
from dspark_jax.nn.rope import apply_rope_interleaved
from dspark_jax.nn.rounding import to_dtype


class KeySegment(NamedTuple):
    """Keys and values one set of queries attends to, with who sees what.

    k, v [..., S, Hkv, hd] (leading dims broadcast against the queries'; MQA: Hkv = 1, and k may be v);
    visible bool[..., T, S] or None (every query sees every key). Keys no query of the call can see are
    zeroed before use: they may hold anything (rolled-back or another request's rows, even inf), and a
    masked score times an inf value would still leak a NaN."""

    k: jax.Array
    v: jax.Array
    visible: jax.Array | None = None


def grouped_query_attention(q: jax.Array, segments, *, scale: float, sink: jax.Array | None = None) -> jax.Array:
    """Softmax attention of q [..., T, H, hd] over the concatenated key segments, f32 math.

    H is a multiple of every segment's Hkv (query head h reads kv head h // (H / Hkv)). `sink` f32[H] is
    an extra per-head logit in the denominator that carries no value (V4.1). -> o [..., T, H, hd] in q's
    dtype. Suffixes name the axes: T queries, S keys, K kv heads, G query heads per kv head, D head dim."""
    *lead, t, h, hd = q.shape
    hkv = segments[0].k.shape[-2]
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    q_TKGD = q.astype(f32).reshape(*lead, t, hkv, h // hkv, hd)
    scores_KGTS, values_SKD = [], []
    for seg in segments:
        k_SKD = seg.k.astype(f32)
        v_SKD = k_SKD if seg.v is seg.k else seg.v.astype(f32)
        if seg.visible is not None:
            seen_S11 = _seen_keys(seg.visible, k_SKD.shape[:-3])[..., None, None]
            k_SKD = jnp.where(seen_S11, k_SKD, 0.0)
            v_SKD = k_SKD if seg.v is seg.k else jnp.where(seen_S11, v_SKD, 0.0)
        s_KGTS = jnp.einsum("...tkgd,...skd->...kgts", q_TKGD, k_SKD, precision=hi) * scale
        if seg.visible is not None:
            s_KGTS = jnp.where(seg.visible[..., None, None, :, :], s_KGTS, -jnp.inf)
        scores_KGTS.append(s_KGTS)
        values_SKD.append(v_SKD)
    s_KGTS = jnp.concatenate(scores_KGTS, axis=-1) if len(scores_KGTS) > 1 else scores_KGTS[0]
    m_KGT1 = jnp.max(s_KGTS, axis=-1, keepdims=True)
    if sink is not None:
        sink_KG11 = sink.astype(f32).reshape(hkv, h // hkv, 1, 1)
        m_KGT1 = jnp.maximum(m_KGT1, sink_KG11)
    p_KGTS = jnp.exp(s_KGTS - m_KGT1)
    denom_KGT1 = jnp.sum(p_KGTS, axis=-1, keepdims=True)
    if sink is not None:
        denom_KGT1 = denom_KGT1 + jnp.exp(sink_KG11 - m_KGT1)
    p_KGTS = p_KGTS / denom_KGT1
    o_TKGD, start = 0.0, 0
    for v_SKD in values_SKD:  # each segment's slice of the probabilities times its values
        n = v_SKD.shape[-3]
        o_TKGD = o_TKGD + jnp.einsum("...kgts,...skd->...tkgd", p_KGTS[..., start:start + n], v_SKD, precision=hi)
        start += n
    return to_dtype(o_TKGD.reshape(*lead, t, h, hd), q.dtype)


def _seen_keys(visible: jax.Array, key_lead: tuple[int, ...]) -> jax.Array:
    """bool[..., S]: keys some query sees, reduced over the queries and over every leading dim the keys
    are broadcast along (a context shared by N blocks is masked once, not copied per block)."""
    seen = jnp.any(visible, axis=-2)
    axes = tuple(i for i, (n_k, n_v) in enumerate(zip(key_lead, seen.shape[:-1])) if n_k == 1 and n_v != 1)
    return jnp.any(seen, axis=axes, keepdims=True) if axes else seen


def grouped_out_proj(o: jax.Array, wo_a: jax.Array, compute_dtype) -> jax.Array:
    """o [.., H*hd] -> [.., G*Ol]: each of the G contiguous groups of H*hd/G values has its own map."""
    g = wo_a.shape[0]
    og = o.reshape(*o.shape[:-1], g, o.shape[-1] // g).astype(compute_dtype)
    y = mixed_einsum("...gi,gio->...go", og, wo_a.astype(compute_dtype))  # bf16 out per group (SPEC 2.9)
    return to_dtype(y.reshape(*o.shape[:-1], -1), compute_dtype)


class WindowAttention(nn.Module):
    cfg: Any  # the V4.1 draft's DSparkConfig or the mHC backbone's MhcConfig (the same field names)
    impl: str = "auto"
    fp8_grad: str = "exact"  # gradient through the KV / activation fp8 rounding (nn.quant)

    def setup(self):
        c = self.cfg
        lin = dict(param_dtype=c.param_dtype, compute_dtype=c.compute_dtype, act_fp8=c.act_fp8,
                   fp8_grad=self.fp8_grad)
        self.wq_a = Linear(c.dim, c.q_lora_rank, ("embed", "q_lora"), **lin)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps, c.param_dtype)
        self.wq_b = Linear(c.q_lora_rank, c.n_heads * c.head_dim, ("q_lora", "heads"), **lin)
        self.wkv = Linear(c.dim, c.head_dim, ("embed", "head_dim"), **lin)
        self.kv_norm = RMSNorm(c.head_dim, c.norm_eps, c.param_dtype)
        self.wo_a = _GroupedKernel(c.o_groups, c.n_heads * c.head_dim // c.o_groups, c.o_lora_rank, c.param_dtype)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.dim, ("o_lora", "embed"), **lin)
        self.sink = param(self, "sink", nn.initializers.zeros, (c.n_heads,), "float32", ("heads_sink",))

    def _rope(self, x, positions, inverse=False):
        c = self.cfg
        return apply_rope_interleaved(x, positions, theta=c.rope_theta, rope_dim=c.rope_head_dim, inverse=inverse)

    def _kv_round(self, kv):
        return fp8_quant_dequant(kv, grad=self.fp8_grad) if self.cfg.kv_fp8 else kv

    def kv(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """The latent KV row of each token: fp8-rounded rope(kv_norm(wkv(x)), pos). [.., T, D] -> [.., T, hd]."""
        return self._kv_round(self._rope(self.kv_norm(self.wkv(x)), positions))

    def __call__(self, x: jax.Array, positions: jax.Array, ring_kv: jax.Array, ring_len: jax.Array) -> jax.Array:
        """x [B, K, D] (normed block input), positions [B, K], ring_kv [B, W, hd], ring_len [B] -> [B, K, D]."""
        c = self.cfg
        b, k, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))).reshape(b, k, c.n_heads, c.head_dim)
        q = self._rope(q, positions[..., None])  # queries are not fp8-rounded
        draft_kv = self.kv(x, positions).astype(ring_kv.dtype)
        o = window_attention(q, ring_kv, ring_len, draft_kv, self.sink, scale=c.head_dim ** -0.5, impl=self.impl)
        o = self._rope(o, positions[..., None], inverse=True)
        o = grouped_out_proj(o.reshape(b, k, -1), self.wo_a(), jnp.dtype(c.compute_dtype))
        return self.wo_b(o)


class _GroupedKernel(nn.Module):
    groups: int
    in_dim: int
    out_dim: int
    param_dtype: str

    @nn.compact
    def __call__(self):
        return param(self, "kernel", fan_in_normal(self.in_dim), (self.groups, self.in_dim, self.out_dim),
                     self.param_dtype, ("o_groups", "heads", "o_lora"))
