"""Mixture of experts (dspark_jax.nn.moe, SPEC 2.6) against plain numpy loops: the gate selects by biased score
and weights by unbiased score; clamped SwiGLU experts and their combination."""

import math

import jax.numpy as jnp
import numpy as np

from dspark_jax.nn.moe import moe_ffn, moe_route, swiglu_mlp

RNG = np.random.default_rng(0)


def np_route(x, w_gate, bias, top_k, route_scale):
    out_w, out_i = [], []
    for t in range(x.shape[0]):
        scores = [math.sqrt(math.log1p(math.exp(sum(x[t, d] * w_gate[d, e] for d in range(x.shape[1])))))
                  for e in range(w_gate.shape[1])]
        order = sorted(range(len(scores)), key=lambda e: -(scores[e] + bias[e]))[:top_k]
        w = [scores[e] for e in order]
        tot = sum(w) + 1e-20
        out_w.append([wi / tot * route_scale for wi in w])
        out_i.append(order)
    return np.array(out_w), np.array(out_i)


def test_gate_selects_by_biased_score_and_weights_by_unbiased_score():
    x = RNG.normal(size=(5, 8))
    wg = RNG.normal(size=(8, 6))
    bias = np.array([0.0, 3.0, 0.0, -3.0, 0.5, 0.0])  # big enough to change the selection
    w, idx = moe_route(jnp.asarray(x, jnp.float32), jnp.asarray(wg, jnp.float32), jnp.asarray(bias, jnp.float32),
                       top_k=2, route_scale=1.5)
    ww, wi = np_route(x, wg, bias, 2, 1.5)
    np.testing.assert_array_equal(np.sort(idx, -1), np.sort(wi, -1))
    order = np.argsort(idx, -1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                               np.take_along_axis(ww, np.argsort(wi, -1), -1), rtol=1e-5)
    assert np.all(np.asarray(idx) != 3)  # the -3 bias keeps expert 3 out even if its score is high
    assert np.all((np.asarray(idx) == 1).any(-1))


def np_expert(x, w1, w3, w2, limit, weight=1.0):
    g = x @ w1
    u = x @ w3
    h = np.zeros_like(g)
    for i in range(g.shape[-1]):
        gi = min(g[i], limit)
        ui = min(max(u[i], -limit), limit)
        h[i] = gi / (1 + math.exp(-gi)) * ui * weight
    return h @ w2


def test_clamped_swiglu_expert_and_moe_combination():
    d, i_dim, e, k = 6, 5, 4, 2
    x = RNG.normal(size=(3, d)) * 4  # large enough that clamps bite at limit 1.0
    w1, w3 = RNG.normal(size=(e, d, i_dim)), RNG.normal(size=(e, d, i_dim))
    w2 = RNG.normal(size=(e, i_dim, d))
    sw1, sw3, sw2 = RNG.normal(size=(d, i_dim)), RNG.normal(size=(d, i_dim)), RNG.normal(size=(i_dim, d))
    weights = RNG.random((3, k))
    idx = np.array([[0, 2], [3, 1], [1, 0]])
    limit = 1.0
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = moe_ffn(f(x), f(weights), jnp.asarray(idx), {"w1": f(w1), "w3": f(w3), "w2": f(w2)},
                  {"w1": f(sw1), "w3": f(sw3), "w2": f(sw2)}, limit=limit)
    want = np.stack([sum(np_expert(x[t], w1[idx[t, j]], w3[idx[t, j]], w2[idx[t, j]], limit, weights[t, j])
                         for j in range(k)) + np_expert(x[t], sw1, sw3, sw2, limit) for t in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    single = swiglu_mlp(f(x[0]), f(sw1), f(sw3), f(sw2), limit=limit)
    np.testing.assert_allclose(single, np_expert(x[0], sw1, sw3, sw2, limit), rtol=1e-4, atol=1e-4)
