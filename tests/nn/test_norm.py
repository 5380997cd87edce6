"""RMSNorm (dspark_jax.nn.norm) against a plain numpy loop, with the V4.1 draft's tiny eps."""

import math

import jax.numpy as jnp
import numpy as np

from dspark_jax.nn.norm import rms_norm

RNG = np.random.default_rng(0)


def test_rms_norm_tiny_eps():
    x = RNG.normal(size=(3, 16))
    w = RNG.normal(size=16)
    want = np.stack([x[i] / math.sqrt(np.mean(x[i] ** 2) + 1e-20) * w for i in range(3)])
    np.testing.assert_allclose(rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-20), want,
                               rtol=1e-5)
