"""Reading rows of a bf16 table (embeddings, expert stacks, head tiles) without an f32 copy of the table.

XLA:CPU has no bf16 data-movement kernels: it computes a bf16 gather or dynamic slice on an f32 copy of
its WHOLE operand, converted in every call (and hoisted out of any loop, since the copy is loop-invariant).
At V4.1-Flash size that is 2.65 GB written for the tied head per propose and 9 GB for the expert stacks of
one MoE block; it is why the head's tile loop still made a whole-head f32 copy behind its optimisation
barrier. Integers XLA moves as they are, so a bf16 table is read through its uint16 view and the rows
are turned back into bf16: the same bits on every platform (TPU and GPU move bf16 natively either way).

A bit view has no gradient, so each reader has its own backward pass: the rows' cotangent added into a
zero table (what differentiating a gather or a slice gives). Other dtypes are read directly.

Writing one row into a bf16 table has the same trap (a bf16 dynamic-update-slice on an f32 copy of the
whole table, then converted back): `writable` / `put_row` / `readable` keep such a table in its uint16
view while rows are written into it, e.g. a gradient accumulated one expert at a time in a loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _bits(table: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(table, jnp.uint16)


def _bf16(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


@jax.custom_vjp
def take_rows(table: jax.Array, index: jax.Array) -> jax.Array:
    """table[index] along axis 0 (any shape of in-range ids): [*index.shape, *table.shape[1:]]."""
    if table.dtype == jnp.bfloat16:
        return _bf16(jnp.take(_bits(table), index, axis=0, mode="clip"))
    return jnp.take(table, index, axis=0, mode="clip")


def _take_forward(table, index):
    return take_rows(table, index), (jnp.zeros((), table.dtype), table.shape, index)


def _take_backward(residuals, d_rows):
    zero, shape, index = residuals
    return jnp.zeros(shape, zero.dtype).at[index].add(d_rows.astype(zero.dtype)), None


take_rows.defvjp(_take_forward, _take_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def slice_rows(table: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """table[start : start + size] along axis 0 (start clamped as dynamic_slice does)."""
    if table.dtype == jnp.bfloat16:
        return _bf16(jax.lax.dynamic_slice_in_dim(_bits(table), start, size))
    return jax.lax.dynamic_slice_in_dim(table, start, size)


def _slice_forward(table, start, size):
    return slice_rows(table, start, size), (jnp.zeros((), table.dtype), table.shape, start)


def _slice_backward(size, residuals, d_rows):
    zero, shape, start = residuals
    return jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, zero.dtype), d_rows.astype(zero.dtype), start,
                                               axis=0), None


slice_rows.defvjp(_slice_forward, _slice_backward)


def writable(table: jax.Array) -> jax.Array:
    """`table` in the form `put_row` writes into: a bf16 table's uint16 view, other dtypes as they are."""
    return _bits(table) if table.dtype == jnp.bfloat16 else table


def put_row(table: jax.Array, index: jax.Array, row: jax.Array, dtype) -> jax.Array:
    """`writable` table (of `dtype` rows) with row `index` along axis 0 replaced by `row` cast to `dtype`."""
    value = row.astype(dtype)
    value = _bits(value) if jnp.dtype(dtype) == jnp.bfloat16 else value
    return jax.lax.dynamic_update_index_in_dim(table, value, index, axis=0)


def readable(table: jax.Array, dtype) -> jax.Array:
    """The `writable` table back as a `dtype` array."""
    return _bf16(table) if jnp.dtype(dtype) == jnp.bfloat16 else table
