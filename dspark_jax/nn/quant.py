"""fp8 (E4M3) quantize-dequantize in blocks of 32 values with power-of-two scales.

The trained V4.1 draft sees every KV row through this rounding (and, in the official forward, the
activations entering each fp8/fp4 GEMM); a port that skips it drifts from the reference.

Gradients. The literal derivative of the rounding is the rounding again: JAX transposes a dtype
conversion into a conversion, so the COTANGENT is rounded to fp8 too, small cotangents flush to zero and
everything upstream of a rounded row (the draft's context path: main_proj, wkv) learns almost nothing.
Training therefore asks for `grad="straight_through"`: the same forward values bit for bit, the identity
as the derivative (a `jax.custom_jvp`). Every module that rounds takes the choice as an argument
(`fp8_grad`), so nothing is patched at trace time.
"""

from __future__ import annotations

import functools

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


FP8_GRADS = ("exact", "straight_through")


def fp8_quant_dequant(x: jax.Array, block: int = 32, out_dtype=None, *, grad: str = "exact") -> jax.Array:
    """Round x to E4M3 per `block` contiguous values of the last axis and scale back (RNE).

    `grad`: "exact" differentiates the rounding literally, "straight_through" passes the cotangent
    through unchanged (module docstring)."""
    if grad == "straight_through":
        return _fp8_straight_through(x, block, out_dtype)
    if grad != "exact":
        raise ValueError(f"fp8 'grad': expected one of {FP8_GRADS}, got {grad!r}")
    return _fp8_round(x, block, out_dtype)


def _fp8_round(x: jax.Array, block: int, out_dtype) -> jax.Array:
    out_dtype = out_dtype or x.dtype
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"fp8 quantization needs the last dimension ({d}) to be a multiple of {block}")
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], d // block, block)
    scale = fp8_block_scale(jnp.max(jnp.abs(xb), axis=-1, keepdims=True))
    q = jnp.clip(xb / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return (q.astype(jnp.float32) * scale).reshape(x.shape).astype(out_dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _fp8_straight_through(x: jax.Array, block: int, out_dtype) -> jax.Array:
    return _fp8_round(x, block, out_dtype)


@_fp8_straight_through.defjvp
def _fp8_straight_through_jvp(block, out_dtype, primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _fp8_round(x, block, out_dtype)
    return y, dx.astype(y.dtype)
