"""nn.rows: bf16 tables read through their uint16 view give the same rows and gradients as jnp.take /
dynamic_slice, and the compiled read touches the rows, not an f32 copy of the whole table (XLA:CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.bench import hlo_cost
from dspark_jax.nn.rows import slice_rows, take_rows

RNG = np.random.default_rng(3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_same_rows_and_gradients_as_take_and_dynamic_slice(dtype):
    table = jnp.asarray(RNG.normal(size=(50, 8)), dtype)
    ids = jnp.asarray([[3, 49, 3], [0, 7, 21]])
    np.testing.assert_array_equal(np.asarray(take_rows(table, ids)), np.asarray(jnp.take(table, ids, axis=0)))
    np.testing.assert_array_equal(np.asarray(jax.jit(slice_rows, static_argnums=2)(table, 45, 10)),
                                  np.asarray(jax.lax.dynamic_slice_in_dim(table, 45, 10)))  # clamped to 40

    probe = jnp.asarray(RNG.normal(size=(2, 3, 8)), jnp.float32)
    want = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0).astype(jnp.float32) * probe))(table)
    got = jax.jit(jax.grad(lambda t: jnp.sum(take_rows(t, ids).astype(jnp.float32) * probe)))(table)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    want = jax.grad(lambda t: jnp.sum(jax.lax.dynamic_slice_in_dim(t, 45, 10).astype(jnp.float32)))(table)
    got = jax.grad(lambda t: jnp.sum(slice_rows(t, 45, 10).astype(jnp.float32)))(table)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_reading_rows_of_a_bf16_table_moves_the_rows_not_the_table():
    """The cause of the whole-head f32 copy (issue 38): XLA:CPU computes a bf16 gather on an f32 copy of
    its whole operand. Through the uint16 view the program moves a few rows."""
    table = jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((4,), jnp.int32)
    table_bytes = 4096 * 512 * 2

    def bytes_of(f):
        return hlo_cost.analyze(jax.jit(f).lower(table, ids).compile().as_text()).bytes

    assert bytes_of(lambda t, i: jnp.take(t, i, axis=0).astype(jnp.float32)) > table_bytes  # the f32 copy
    assert bytes_of(lambda t, i: take_rows(t, i).astype(jnp.float32)) < 0.01 * table_bytes


def test_writing_rows_into_a_bf16_table_moves_the_rows_not_the_table():
    """The same trap for writes: a bf16 dynamic-update-slice XLA:CPU computes on an f32 copy of the whole
    table. In `writable` form a row written in a loop moves that row, and reads back as bf16."""
    from dspark_jax.nn.rows import put_row, readable, writable

    table = jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((16, 4096), jnp.float32)
    table_bytes = 512 * 4096 * 2

    def fill(write):
        return lambda t, r: jax.lax.fori_loop(0, 16, lambda i, t: write(t, 3 * i, r[i]), t)

    plain = fill(lambda t, i, row: jax.lax.dynamic_update_index_in_dim(t, row.astype(jnp.bfloat16), i, 0))
    viewed = lambda t, r: readable(fill(lambda t, i, row: put_row(t, i, row, jnp.bfloat16))(writable(t), r),  # noqa: E731
                                   jnp.bfloat16)

    def bytes_of(f):
        return hlo_cost.analyze(jax.jit(f, donate_argnums=0).lower(table, rows).compile().as_text()).bytes

    assert bytes_of(plain) > 16 * table_bytes  # a whole-table round trip per row
    assert bytes_of(viewed) < 3 * table_bytes  # the rows, and at most one copy of the table in and out
    t = jnp.asarray(RNG.normal(size=(512, 4096)), jnp.bfloat16)
    r = jnp.asarray(RNG.normal(size=(16, 4096)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(viewed)(t, r)), np.asarray(jax.jit(plain)(t, r)))
