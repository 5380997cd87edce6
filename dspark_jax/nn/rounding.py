"""The one way the models round to their compute dtype: a rounding point that XLA cannot fuse away.

The official V4.1 forward rounds activations to bf16 at fixed points (SPEC 2.9) and the port must round
exactly there. `x.astype(bf16)` says so, but a later `.astype(f32)` in the same jitted program makes the
round trip f32 -> bf16 -> f32 something a backend may drop: jaxlib 0.10.2 on CPU fuses a dot, the round
trip and a following reduction (the sum of the experts' outputs, a dot over bf16 probabilities) into one
YNNPACK fusion that skips it, though the HLO still shows both converts (measured; SPEC 2.9 "Backend
trap"). `lax.reduce_precision` is an explicit rounding op that no fusion removes; after it the cast to
bf16 is exact, so it does not matter whether a later widening is elided. Eager and jitted programs then
round at the same points, bit for bit.

Pallas/Mosaic has no lowering for reduce_precision; inside a compiled TPU kernel a plain cast is the
rounding (no XLA fusion runs there), so kernels keep `astype` and use these only off-TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def to_dtype(x: jax.Array, dtype) -> jax.Array:
    """x cast to `dtype`; an f32 -> bf16 cast is first rounded by `reduce_precision` (module docstring).
    Any other cast (f32 -> f32, bf16 -> f32, f64 -> anything) is a plain `astype`."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bfloat16 and x.dtype == jnp.float32:
        x = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    return x.astype(dtype)

