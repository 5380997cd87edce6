"""Manifold-constrained hyper-connections (dspark_jax.nn.mhc, SPEC 2.4) against deliberately plain numpy
loops (helpers.oracles.np_sinkhorn / np_hc_mixes)."""

import jax.numpy as jnp
import numpy as np
from helpers import np_hc_mixes, np_sinkhorn

from dspark_jax.nn.mhc import hc_mixes, hc_post, hc_pre, sinkhorn

RNG = np.random.default_rng(0)


def test_sinkhorn_matches_loops_and_is_doubly_stochastic():
    logits = RNG.normal(size=(4, 4)) * 2
    got = np.asarray(sinkhorn(jnp.asarray(logits, jnp.float32), 20, 1e-6))
    want = np_sinkhorn(logits, 20, 1e-6)
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(got.sum(0), 1, atol=1e-5)  # ends on columns
    np.testing.assert_allclose(got.sum(1), 1, atol=1e-3)


def test_hc_mixes_split_matches_loops():
    hc, d = 4, 8
    streams = RNG.normal(size=(hc, d))
    fn = RNG.normal(size=(24, hc * d)) * 0.3
    base = RNG.normal(size=24)
    scale = np.array([0.7, 1.3, 0.9])
    pre, post, comb = hc_mixes(jnp.asarray(streams, jnp.float32)[None], jnp.asarray(fn, jnp.float32),
                               jnp.asarray(base, jnp.float32), jnp.asarray(scale, jnp.float32),
                               iters=20, eps=1e-6, norm_eps=1e-20)
    wpre, wpost, wcomb = np_hc_mixes(streams, fn, base, scale, 20, 1e-6, 1e-20)
    np.testing.assert_allclose(pre[0], wpre, rtol=1e-5)
    np.testing.assert_allclose(post[0], wpost, rtol=1e-5)
    np.testing.assert_allclose(comb[0], wcomb, atol=1e-5)


def test_hc_pre_and_post_match_loops():
    hc, d = 4, 6
    x = RNG.normal(size=(hc, d))
    y = RNG.normal(size=d)
    pre, post, comb = RNG.random(hc), RNG.random(hc) * 2, RNG.random((hc, hc))
    want_pre = sum(pre[i] * x[i] for i in range(hc))
    want_post = np.stack([post[j] * y + sum(comb[i, j] * x[i] for i in range(hc)) for j in range(hc)])
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    np.testing.assert_allclose(hc_pre(f(x), f(pre)), want_pre, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hc_post(f(y), f(x), f(post), f(comb)), want_post, rtol=1e-5, atol=1e-6)
