"""Parameter helpers: every parameter is declared with logical axis names (see dspark_jax.parallel)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.nn import packed


def param(module: nn.Module, name: str, init, shape: tuple[int, ...], dtype, axes: tuple[str | None, ...]):
    """Declare a parameter whose logical axis names travel with it (boxed until `nn.unbox`).

    A provided value that is a packed kernel (`nn.packed.Fp8Blocks` / `Fp4Blocks`, weights held at
    checkpoint precision) is returned as it is, for its consumer to dequantise (`packed.as_compute`):
    Flax would compare its leaves' shapes with the initializer's and reject fp4's byte matrix. Its
    LOGICAL shape must equal `shape`; a mismatch is a ValueError naming the parameter.
    """
    assert len(axes) == len(shape), (name, shape, axes)
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if packed.is_packed(value):
            where = "/".join((*module.path, name))
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"packed parameter '{where}' ({type(value).__name__}): logical shape "
                                 f"{list(value.shape)}, the module declares {list(shape)}")
            packed.check(value, where)
            return value
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.dtype(dtype))


def fan_in_normal(fan_in: int):
    """N(0, 1/fan_in): keeps activations O(1) through random-init stacks (tests, the demo)."""
    return nn.initializers.normal(stddev=fan_in ** -0.5)


# A model's parameters come from one `boxed_init(cfg, key)` (its Flax `init`, leaves boxed with their logical
# axes); these three give what every model exposes: the values, the shapes, the axis names.


def init_unboxed(boxed_init, cfg, key: jax.Array):
    """Random parameters as a plain pytree (one compile per config: `cfg` is static and hashable)."""
    return nn.unbox(jax.jit(boxed_init, static_argnums=0)(cfg, key))


def abstract_unboxed(boxed_init, cfg):
    """`jax.ShapeDtypeStruct`s of the parameters, nothing materialised."""
    return nn.unbox(jax.eval_shape(functools.partial(boxed_init, cfg), jax.random.key(0)))


def logical_axes_of(boxed_init, cfg):
    """Same tree as the parameters, each leaf a PartitionSpec of logical axis names."""
    return nn.get_partition_spec(jax.eval_shape(functools.partial(boxed_init, cfg), jax.random.key(0)))
