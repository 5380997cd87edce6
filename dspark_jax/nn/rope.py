"""Rotary position embedding on the trailing `rope_dim` dims, interleaved-pair (complex) convention.

Pairs (x[2i], x[2i+1]) of the rotated part are complex numbers multiplied by exp(i * pos * f_i),
f_i = 1 / theta^(2i / rope_dim). Frequencies and angles stay in f32: positions reach 1e5+ and bf16
angles would be off by whole radians.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    return jnp.concatenate([nope, out.astype(x.dtype)], axis=-1)
