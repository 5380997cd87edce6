"""Each formula of SPEC section 2 against a deliberately plain numpy implementation (loops)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.nn.mhc import hc_mixes, hc_post, hc_pre, sinkhorn
from dspark_jax.nn.moe import moe_ffn, moe_route, swiglu_mlp
from dspark_jax.nn.norm import rms_norm
from dspark_jax.nn.quant import fp8_quant_dequant
from dspark_jax.nn.rope import apply_rope_interleaved

from oracles import e4m3_grid, np_round_e4m3

RNG = np.random.default_rng(0)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------- mHC
def np_sinkhorn(logits, iters, eps):
    n = logits.shape[0]
    c = np.zeros((n, n))
    for i in range(n):
        row = np.exp(logits[i] - logits[i].max())
        c[i] = row / row.sum() + eps
    for j in range(n):
        s = sum(c[i, j] for i in range(n))
        for i in range(n):
            c[i, j] /= s + eps
    for _ in range(iters - 1):
        for i in range(n):
            s = sum(c[i, j] for j in range(n))
            for j in range(n):
                c[i, j] /= s + eps
        for j in range(n):
            s = sum(c[i, j] for i in range(n))
            for i in range(n):
                c[i, j] /= s + eps
    return c


def np_hc_mixes(streams, fn, base, scale, iters, eps, norm_eps):
    hc, d = streams.shape
    x = np.concatenate([streams[i] for i in range(hc)]).astype(np.float64)  # stream-major
    rho = 1.0 / math.sqrt(np.mean(x * x) + norm_eps)
    m = [sum(x[k] * fn[r, k] for k in range(hc * d)) * rho for r in range(fn.shape[0])]
    pre = np.array([sigmoid(m[i] * scale[0] + base[i]) + eps for i in range(hc)])
    post = np.array([2 * sigmoid(m[hc + i] * scale[1] + base[hc + i]) for i in range(hc)])
    comb_logits = np.array([[m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j] for j in range(hc)]
                            for i in range(hc)])
    return pre, post, np_sinkhorn(comb_logits, iters, eps)


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


# ---------------------------------------------------------------- RMSNorm, RoPE
def test_rms_norm_tiny_eps():
    x = RNG.normal(size=(3, 16))
    w = RNG.normal(size=16)
    want = np.stack([x[i] / math.sqrt(np.mean(x[i] ** 2) + 1e-20) * w for i in range(3)])
    np.testing.assert_allclose(rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-20), want,
                               rtol=1e-5)


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


# ---------------------------------------------------------------- fp8 KV rounding
def test_fp8_kv_rounding_lands_on_scaled_e4m3_grid():
    grid = e4m3_grid()
    x = np.concatenate([RNG.normal(size=32) * 3.0, RNG.normal(size=32) * 1e-6, RNG.normal(size=32) * 900]).astype(
        np.float32)
    x[5] = 0.0
    got = np.asarray(fp8_quant_dequant(jnp.asarray(x)[None]))[0]
    for blk in range(3):
        xb = x[32 * blk:32 * blk + 32].astype(np.float64)
        amax = max(np.abs(xb).max(), 1e-4)
        scale = 2.0 ** math.ceil(math.log2(amax / 448.0))
        want = np.array([np_round_e4m3(min(max(v / scale, -448), 448), grid) * scale for v in xb])
        np.testing.assert_array_equal(got[32 * blk:32 * blk + 32], want.astype(np.float32))


# ---------------------------------------------------------------- MoE
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


@pytest.mark.parametrize("vocab", [700, 1024, 1500])
def test_f32_head_logits_widens_tile_by_tile_with_the_same_values(vocab):
    """Each logit is the f32 dot product of x with its widened head row, whatever the tiling (the last
    tile overlaps the one before when the tile does not divide the vocabulary)."""
    import jax

    from dspark_jax.nn.head import f32_head_logits

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((vocab, 64)), jnp.bfloat16)
    got = np.asarray(jax.jit(lambda x, h: f32_head_logits(x, h, tile_rows=256))(x, head))
    want = np.einsum("btd,vd->btv", np.asarray(x, np.float64), np.asarray(head.astype(jnp.float32), np.float64))
    assert got.shape == (2, 3, vocab)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_f32_head_logits_keeps_one_tile_widened_not_the_head():
    """The compiled program's temporaries hold one widened tile, not a widened copy of the head. Shown
    with an f32 head: XLA:CPU widens every bf16 buffer to f32 by itself (bf16 normalisation), so on CPU
    a bf16 head would show the CPU compiler's copy, not ours."""
    import jax

    from dspark_jax.nn.head import f32_head_logits

    S = jax.ShapeDtypeStruct
    v, d, tile = 65536, 256, 1024
    head_bytes = v * d * 4
    fn = jax.jit(lambda x, h: f32_head_logits(x, h, tile_rows=tile))
    temp = fn.lower(S((8, d), jnp.float32), S((v, d), jnp.float32)).compile().memory_analysis().temp_size_in_bytes
    direct = jax.jit(lambda x, h: jnp.einsum("nd,vd->nv", x, (h * 2.0).astype(jnp.float32)))
    temp_direct = direct.lower(S((8, d), jnp.float32), S((v, d), jnp.float32)).compile().memory_analysis()
    assert temp_direct.temp_size_in_bytes >= head_bytes  # the check can see a widened copy ...
    assert temp < head_bytes / 8  # ... and the tiled head has none
