"""fp8 (E4M3) quantize-dequantize in blocks of 32 values with power-of-two scales.

The trained V4.1 draft sees every KV row through this rounding (and, in the official forward, the
activations entering each fp8/fp4 GEMM); a port that skips it drifts from the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def pow2_ceil(x: jax.Array) -> jax.Array:
    """2^ceil(log2(x)) for positive f32 x, exactly: frexp and bit assembly, since XLA's exp2/log2 are
    approximations that can miss an exact power of two by one ulp (and then ceil jumps a whole binade)."""
    mant, exp = jnp.frexp(x.astype(jnp.float32))  # x = mant * 2^exp, mant in [0.5, 1)
    e = jnp.where(mant == 0.5, exp - 1, exp)
    return jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)


def fp8_block_scale(amax: jax.Array) -> jax.Array:
    """2^ceil(log2(max(amax, 1e-4) / 448)): the smallest power of two that fits the block into E4M3."""
    return pow2_ceil(jnp.maximum(amax, AMAX_FLOOR) / E4M3_MAX)


def fp8_quant_dequant(x: jax.Array, block: int = 32, out_dtype=None) -> jax.Array:
    """Round x to E4M3 per `block` contiguous values of the last axis and scale back (RNE)."""
    out_dtype = out_dtype or x.dtype
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"fp8 quantization needs the last dimension ({d}) to be a multiple of {block}")
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], d // block, block)
    scale = fp8_block_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True))
    q = jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return (q.astype(jnp.float32) * scale).reshape(x.shape).astype(out_dtype)
