"""The Qwen3 decoder layer, shared by the Qwen3 backbone and the DeepSpec draft (SPEC 4).

    h = input_layernorm(x)
    q = rope(q_norm(q_proj(h)));  k = rope(k_norm(k_proj(h)));  v = v_proj(h)    (per head, split-half RoPE)
    x = x + o_proj(attend(q, k, v))
    x = x + down_proj(silu(gate_proj(post_attention_layernorm(x))) * up_proj(...))

What the queries attend to is the caller's: the backbone writes k, v into its cache and attends over it;
the DeepSpec draft attends over the target's context rows plus its own block. So the layer takes an
`attend(q, k, v) -> (o, aux)` function, and its subclasses (the scan bodies of the two models) supply it.
The parameter names are the models' tree (`attn_norm`, `q_proj`, ..., `down_proj`; kernels [in, out]).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax

from dspark_jax.nn.linear import Linear
from dspark_jax.nn.norm import RMSNorm
from dspark_jax.nn.rope import apply_rope_split_half


class Qwen3DecoderLayer(nn.Module):
    """One decoder layer. `cfg` carries the Hugging Face Qwen3 field names: hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta,
    param_dtype, compute_dtype (a Qwen3Config, or a DeepSpecConfig, which is one plus the draft keys)."""

    cfg: Any

    def setup(self):
        c = self.cfg
        lin = dict(param_dtype=c.param_dtype, compute_dtype=c.compute_dtype)
        h, kv, hd, d, f = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.intermediate_size
        self.attn_norm = RMSNorm(d, c.rms_norm_eps, c.param_dtype)
        self.q_proj = Linear(d, h * hd, ("embed", "heads"), **lin)
        self.k_proj = Linear(d, kv * hd, ("embed", "kv_heads"), **lin)
        self.v_proj = Linear(d, kv * hd, ("embed", "kv_heads"), **lin)
        self.o_proj = Linear(h * hd, d, ("heads", "embed"), **lin)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps, c.param_dtype, axis_name="head_dim")
        self.k_norm = RMSNorm(hd, c.rms_norm_eps, c.param_dtype, axis_name="head_dim")
        self.ffn_norm = RMSNorm(d, c.rms_norm_eps, c.param_dtype)
        self.gate_proj = Linear(d, f, ("embed", "mlp"), **lin)
        self.up_proj = Linear(d, f, ("embed", "mlp"), **lin)
        self.down_proj = Linear(f, d, ("mlp", "embed"), **lin)

    def queries(self, h: jax.Array, positions: jax.Array) -> jax.Array:
        """h [..., T, D] (normed) at positions [..., T] -> q [..., T, H, hd]."""
        c = self.cfg
        q = self.q_norm(self.q_proj(h).reshape(*h.shape[:-1], c.num_attention_heads, c.head_dim))
        return apply_rope_split_half(q, positions[..., None], theta=c.rope_theta)

    def keys_values(self, h: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [..., T, D] at positions [..., T] -> (k, v) [..., T, Hkv, hd]; k normed per head and rotated.
        (The DeepSpec draft also feeds the target's context features here.)"""
        c = self.cfg
        shape = (*h.shape[:-1], c.num_key_value_heads, c.head_dim)
        k = self.k_norm(self.k_proj(h).reshape(shape))
        return apply_rope_split_half(k, positions[..., None], theta=c.rope_theta), self.v_proj(h).reshape(shape)

    def residual(self, x: jax.Array, positions: jax.Array, attend: Callable) -> tuple[jax.Array, Any]:
        """x [..., T, D] -> (the layer's output, attend's aux). attend(q, k, v) -> (o [..., T, H, hd], aux)."""
        h = self.attn_norm(x)
        o, aux = attend(self.queries(h, positions), *self.keys_values(h, positions))
        x = x + self.o_proj(o.reshape(*x.shape[:-1], -1))
        h = self.ffn_norm(x)
        return x + self.down_proj(jax.nn.silu(self.gate_proj(h)) * self.up_proj(h)), aux
