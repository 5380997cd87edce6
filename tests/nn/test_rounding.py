"""nn.rounding.to_dtype: an f32 -> bf16 rounding point that XLA's fusions keep (issue 39, SPEC 2.9)."""

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.nn.rounding import to_dtype

F32, BF16 = jnp.float32, jnp.bfloat16


def _sum_of_rounded(a, cast):
    # SPEC 2.9's minimal repro: an elementwise op, a round trip through bf16, a reduction, in one program
    return jnp.sum(cast(a * 1.0001, BF16).astype(F32), axis=0)


def test_rounding_survives_a_fused_reduction():
    a = jax.random.normal(jax.random.key(0), (8, 4096), F32)
    want = np.sum(np.asarray((a * 1.0001).astype(BF16).astype(F32)), axis=0, dtype=np.float32)
    eager = np.asarray(_sum_of_rounded(a, to_dtype))
    jitted = np.asarray(jax.jit(lambda a: _sum_of_rounded(a, to_dtype))(a))
    np.testing.assert_array_equal(jitted, eager)
    np.testing.assert_allclose(jitted, want, rtol=1e-6, atol=1e-6)  # numpy may sum in another order


def test_rounding_equals_a_plain_cast_value_for_value():
    x = jnp.asarray(np.random.default_rng(1).standard_normal(100_000) * np.exp2(
        np.random.default_rng(2).integers(-140, 120, 100_000)), F32)
    x = jnp.concatenate([x, jnp.asarray([0.0, -0.0, jnp.inf, -jnp.inf, 1e-45, 3.4e38], F32)])
    np.testing.assert_array_equal(np.asarray(to_dtype(x, BF16).astype(F32)), np.asarray(x.astype(BF16).astype(F32)))
    assert to_dtype(x, BF16).dtype == BF16
    assert to_dtype(x, F32) is not None and to_dtype(x, F32).dtype == F32
    np.testing.assert_array_equal(np.asarray(to_dtype(x, F32)), np.asarray(x))


def test_gradient_passes_through_the_rounding():
    x = jnp.linspace(-3.0, 3.0, 64, dtype=F32)
    g = jax.grad(lambda x: jnp.sum(to_dtype(x * 3.0, BF16).astype(F32)))(x)
    np.testing.assert_array_equal(np.asarray(g), np.full(64, 3.0, np.float32))
