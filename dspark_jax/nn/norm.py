"""RMSNorm. V4.1 uses eps = 1e-20 everywhere: effectively no epsilon, so the statistic is f32."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.nn.params import param
from dspark_jax.nn.rounding import to_dtype


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) * scale over the last axis, statistics in f32, result in x.dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return to_dtype(normed * scale.astype(jnp.float32), x.dtype)


class RMSNorm(nn.Module):
    dim: int
    eps: float
    dtype: str = "float32"
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = param(self, "scale", nn.initializers.ones, (self.dim,), self.dtype, (self.axis_name,))
        return rms_norm(x, scale, self.eps)
