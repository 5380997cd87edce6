"""Parameter helpers: every parameter is declared with logical axis names (see dspark_jax.parallel)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


def param(module: nn.Module, name: str, init, shape: tuple[int, ...], dtype, axes: tuple[str | None, ...]):
    """Declare a parameter whose logical axis names travel with it (boxed until `nn.unbox`)."""
    assert len(axes) == len(shape), (name, shape, axes)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.dtype(dtype))


def fan_in_normal(fan_in: int):
    """N(0, 1/fan_in): keeps activations O(1) through random-init stacks (tests, the demo)."""
    return nn.initializers.normal(stddev=fan_in ** -0.5)
