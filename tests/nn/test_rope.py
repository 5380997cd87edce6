"""RoPE (dspark_jax.nn.rope): the interleaved-pairs convention of the V4.1 models (SPEC 2.5) against complex
multiplication in plain Python."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.nn.rope import apply_rope_interleaved

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_rotates_interleaved_pairs_of_the_last_dims(inverse):
    d, rope_dim, theta = 12, 8, 10000.0
    x = RNG.normal(size=(3, d))
    pos = np.array([0, 7, 100000])
    want = x.copy()
    for t in range(3):
        for i in range(rope_dim // 2):
            freq = theta ** (-2 * i / rope_dim)
            ang = pos[t] * freq * (-1 if inverse else 1)
            a, b = x[t, d - rope_dim + 2 * i], x[t, d - rope_dim + 2 * i + 1]
            z = complex(a, b) * complex(math.cos(ang), math.sin(ang))
            want[t, d - rope_dim + 2 * i], want[t, d - rope_dim + 2 * i + 1] = z.real, z.imag
    got = apply_rope_interleaved(jnp.asarray(x, jnp.float32), jnp.asarray(pos), theta=theta, rope_dim=rope_dim,
                                 inverse=inverse)
    # angles up to 1e5 rad in f32: the f32 argument itself carries ~4e-3 absolute error
    np.testing.assert_allclose(got[:2], want[:2], atol=1e-5)
    np.testing.assert_allclose(got[2], want[2], atol=2e-2)
    back = apply_rope_interleaved(got, jnp.asarray(pos), theta=theta, rope_dim=rope_dim, inverse=not inverse)
    np.testing.assert_allclose(back, x, atol=1e-5)
