"""The V4.1 draft's window-only latent MQA with a per-head sink (SPEC 2.5).

One 512-wide latent per token serves as both key and value for all 64 heads. Keys are the block's
context ring (the last W backbone positions, written by `context_kv`) plus the K draft rows of the
current call, which all queries see (the block is bidirectional). The attention core itself is
`dspark_jax.kernels.window_attention` (Pallas on TPU, jnp elsewhere).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.kernels.window_attention import window_attention
from dspark_jax.nn.linear import Linear, mixed_einsum
from dspark_jax.nn.norm import RMSNorm
from dspark_jax.nn.params import fan_in_normal, param
from dspark_jax.nn.quant import fp8_quant_dequant
from dspark_jax.nn.rope import apply_rope_interleaved


def grouped_out_proj(o: jax.Array, wo_a: jax.Array, compute_dtype) -> jax.Array:
    """o [.., H*hd] -> [.., G*Ol]: each of the G contiguous groups of H*hd/G values has its own map."""
    g = wo_a.shape[0]
    og = o.reshape(*o.shape[:-1], g, o.shape[-1] // g).astype(compute_dtype)
    y = mixed_einsum("...gi,gio->...go", og, wo_a.astype(compute_dtype))  # bf16 out per group (SPEC 2.9)
    return y.reshape(*o.shape[:-1], -1).astype(compute_dtype)


class WindowAttention(nn.Module):
    cfg: "DSparkConfig"  # noqa: F821
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
