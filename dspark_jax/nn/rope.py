"""Rotary position embedding, both conventions the models use, with one frequency formula.

* interleaved pairs (V4.1, `apply_rope_interleaved`): on the trailing `rope_dim` dims, pairs
  (x[2i], x[2i+1]) are complex numbers multiplied by exp(i * pos * f_i);
* split half (Llama / Qwen3 "rotate_half", `apply_rope_split_half`): over the whole last axis, dims i and
  i + d/2 form the pair.
f_i = 1 / theta^(2i / rope_dim). Frequencies and angles stay in f32: positions reach 1e5+ and bf16
angles would be off by whole radians.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from dspark_jax.nn.rounding import to_dtype


def rope_frequencies(rope_dim: int, theta: float) -> jax.Array:
    """f_i = 1 / theta^(2i / rope_dim) in f32, computed as the official V4.1 code (and Hugging Face's
    Qwen3) compute it: a reciprocal of a power, which differs from theta^(-2i / rope_dim) in the last bit."""
    exponents = jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim
    return 1.0 / (jnp.asarray(theta, jnp.float32) ** exponents)


def apply_rope_interleaved(x: jax.Array, positions: jax.Array, *, theta: float, rope_dim: int,
                           inverse: bool = False) -> jax.Array:
    """Rotate the last `rope_dim` dims of x [..., d]; `positions` broadcasts against x.shape[:-1].

    `inverse=True` rotates by the negative angle (V4.1 applies it to the attention output).
    """
    d = x.shape[-1]
    nope, rot = x[..., : d - rope_dim], x[..., d - rope_dim:]
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(rope_dim, theta)  # [..., rope/2]
    if inverse:
        angles = -angles
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = rot.astype(jnp.float32).reshape(*rot.shape[:-1], rope_dim // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(rot.shape)
    return jnp.concatenate([nope, to_dtype(out, x.dtype)], axis=-1)


def apply_rope_split_half(x: jax.Array, positions: jax.Array, *, theta: float) -> jax.Array:
    """RoPE over the whole last axis, split-half convention: dims i and i + d/2 form a pair rotated by
    pos * f_i (Llama / Qwen3 "rotate_half"). `positions` broadcasts against x.shape[:-1]."""
    d = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(d, theta)  # [..., d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return to_dtype(jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1), x.dtype)
