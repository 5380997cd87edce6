"""The training loss (dspark_jax.train.loss, SPEC section 8) against a numpy statement with loops: weights,
global normalisation, the detached BCE target, vocabulary chunks and the fused head."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.train import loss as L


def np_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def np_dspark_loss(d, t, labels, z, mask, ce_w=0.1, l1_w=0.9, conf_w=1.0, gamma=4.0):
    """SPEC 8 with loops, in float64."""
    n_blocks, k_size, _ = d.shape
    sums = {"ce": 0.0, "l1": 0.0, "conf": 0.0}
    wsum = 0.0
    acc_k = [[] for _ in range(k_size)]
    sig, accs = [], []
    for n in range(n_blocks):
        for k in range(k_size):
            if not mask[n, k]:
                continue
            w = math.exp(-k / gamma)
            pd, pt = np_softmax(d[n, k].astype(np.float64)), np_softmax(t[n, k].astype(np.float64))
            l1 = np.abs(pd - pt).sum()
            a = 1 - 0.5 * l1
            s = 1 / (1 + math.exp(-float(z[n, k])))
            sums["ce"] += w * -math.log(pd[labels[n, k]])
            sums["l1"] += w * l1
            sums["conf"] += w * -(a * math.log(s) + (1 - a) * math.log(1 - s))
            wsum += w
            acc_k[k].append(a)
            sig.append(s)
            accs.append(a)
    out = {key: v / (wsum + 1e-6) for key, v in sums.items()}
    out["loss"] = ce_w * out["ce"] + l1_w * out["l1"] + conf_w * out["conf"]
    out["accept_rate"] = np.array([np.mean(a) if a else 0.0 for a in acc_k])
    out["tau_estimate"] = 1 + np.cumprod(out["accept_rate"]).sum()
    out["conf_bias"] = np.mean(sig) - np.mean(accs)
    return out


def _loss_inputs(seed=0, n=4, k=5, v=37):
    rng = np.random.default_rng(seed)
    d = (rng.normal(size=(n, k, v)) * 2).astype(np.float32)
    t = (rng.normal(size=(n, k, v)) * 2).astype(np.float32)
    labels = rng.integers(0, v, size=(n, k)).astype(np.int32)
    z = rng.normal(size=(n, k)).astype(np.float32)
    valid = rng.random((n, k)) < 0.8
    mask = np.cumprod(valid, axis=1).astype(bool)
    mask[0] = True  # at least one full block
    return d, t, labels, z, mask


@pytest.mark.parametrize("kw", [{}, dict(ce_weight=0.3, l1_weight=0.5, conf_weight=2.0, decay_gamma=1.5)])
def test_loss_matches_numpy_reference(kw):
    d, t, labels, z, mask = _loss_inputs()
    loss, m = L.dspark_loss(jnp.asarray(d), jnp.asarray(t), jnp.asarray(labels), jnp.asarray(z), jnp.asarray(mask),
                            **kw)
    ref = np_dspark_loss(d, t, labels, z, mask, kw.get("ce_weight", 0.1), kw.get("l1_weight", 0.9),
                         kw.get("conf_weight", 1.0), kw.get("decay_gamma", 4.0))
    np.testing.assert_allclose(loss, ref["loss"], rtol=1e-5)
    for key in ("ce", "l1", "conf", "accept_rate", "tau_estimate", "conf_bias"):
        np.testing.assert_allclose(m[key], ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert m["accept_rate"].shape == (5,)


def test_loss_position_weights_and_global_normalisation():
    np.testing.assert_allclose(L.position_weights(5, 4.0), np.exp(-np.arange(5) / 4.0), rtol=1e-7)
    d, t, labels, z, _ = _loss_inputs(seed=1, n=2, k=4)
    run = lambda mask, **kw: L.dspark_loss(d, t, labels, z, jnp.asarray(mask), **kw)  # noqa: E731
    # One supervised slot: the weight cancels (up to the 1e-6), whatever its position.
    per_slot = {}
    for n, k in [(0, 0), (1, 2)]:
        mask = np.zeros((2, 4), bool)
        mask[n, k] = True
        per_slot[n, k] = float(run(mask, ce_weight=1.0, l1_weight=0.0, conf_weight=0.0)[0])
        pd = np_softmax(d[n, k].astype(np.float64))
        np.testing.assert_allclose(per_slot[n, k], -math.log(pd[labels[n, k]]) * (lambda w: w / (w + 1e-6))(
            math.exp(-k / 4.0)), rtol=1e-5)
    # Two slots in DIFFERENT blocks: one global normaliser, not a per-block mean.
    mask = np.zeros((2, 4), bool)
    mask[0, 0] = mask[1, 2] = True
    w0, w2 = 1.0, math.exp(-2 / 4.0)
    both = float(run(mask, ce_weight=1.0, l1_weight=0.0, conf_weight=0.0)[0])
    np.testing.assert_allclose(both, (w0 * per_slot[0, 0] * (w0 + 1e-6) / w0 + w2 * per_slot[1, 2] * (w2 + 1e-6) / w2)
                               / (w0 + w2 + 1e-6), rtol=1e-5)
    # An explicit normaliser (gradient accumulation) replaces the local weight sum.
    sums = L.loss_sums(jnp.ones((2, 4)), jnp.zeros((2, 4)), jnp.zeros((2, 4)), jnp.asarray(mask))
    loss, _ = L.loss_from_sums(sums, L.LossWeights(1.0, 0.0, 0.0), normalizer=jnp.float32(10.0))
    np.testing.assert_allclose(loss, (w0 + w2) / 10.0, rtol=1e-6)


def test_l1_zero_when_draft_equals_target():
    d, _, labels, z, _ = _loss_inputs(seed=2)
    mask = np.ones(labels.shape, bool)
    _, m = L.dspark_loss(jnp.asarray(d), jnp.asarray(d), jnp.asarray(labels), jnp.asarray(z), jnp.asarray(mask))
    np.testing.assert_allclose(m["l1"], 0.0, atol=1e-6)
    np.testing.assert_allclose(m["accept_rate"], np.ones(5), atol=1e-6)
    np.testing.assert_allclose(m["tau_estimate"], 6.0, atol=1e-5)
    _, m2 = L.dspark_loss(jnp.asarray(d), jnp.asarray(d + 1.0), jnp.asarray(labels), jnp.asarray(z),
                          jnp.asarray(mask))  # a constant shift is the same distribution
    np.testing.assert_allclose(m2["l1"], 0.0, atol=1e-6)


def test_bce_target_is_detached():
    d, t, labels, z, mask = _loss_inputs(seed=3)
    conf_only = lambda d, t, z: L.dspark_loss(d, t, labels, z, mask, ce_weight=0.0, l1_weight=0.0,  # noqa: E731
                                              conf_weight=1.0)[0]
    gd, gt, gz = jax.grad(conf_only, argnums=(0, 1, 2))(jnp.asarray(d), jnp.asarray(t), jnp.asarray(z))
    assert not np.any(np.asarray(gd)) and not np.any(np.asarray(gt))  # no gradient through the target
    # ... while z gets the plain BCE gradient w (sigmoid(z) - target) / sum w.
    ref = np_dspark_loss(d, t, labels, z, mask)
    w = np.exp(-np.arange(5) / 4.0)[None] * mask
    acc = np.array([[1 - 0.5 * np.abs(np_softmax(d[n, k].astype(np.float64)) - np_softmax(t[n, k].astype(np.float64)))
                     .sum() for k in range(5)] for n in range(d.shape[0])])
    want = w * (1 / (1 + np.exp(-z.astype(np.float64))) - acc) / (w.sum() + 1e-6)
    np.testing.assert_allclose(gz, want, rtol=1e-4, atol=1e-7)
    assert np.isfinite(ref["conf"])


@pytest.mark.parametrize("chunk", [5, 8, 12])
def test_chunked_loss_equals_unchunked_in_value_and_gradient(chunk):
    d, t, labels, z, mask = (jnp.asarray(x) for x in _loss_inputs(seed=4))
    f = lambda d, t, z, c: L.dspark_loss(d, t, labels, z, mask, vocab_chunk=c)  # noqa: E731
    (v0, m0), g0 = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(d, t, z, None)
    (v1, m1), g1 = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True), static_argnums=3)(d, t, z, chunk)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for key in ("ce", "l1", "conf", "accept_rate"):
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5, atol=1e-7)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    assert float(jnp.abs(g0[1]).max()) > 1e-4  # the target side does get the l1 gradient


@pytest.mark.parametrize("markov", [True, False])
def test_fused_head_loss_equals_materialised_logits(markov):
    rng = np.random.default_rng(5)
    m, dim, v, r, s = 12, 16, 45, 4, 7
    x = jnp.asarray(rng.normal(size=(m, dim)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(v, dim)) * 0.5, jnp.float32)
    emb = jnp.asarray(rng.normal(size=(m, r)), jnp.float32) if markov else None
    w2 = jnp.asarray(rng.normal(size=(v, r)), jnp.float32) if markov else None
    teacher = jnp.asarray(rng.normal(size=(s, v)) * 2, jnp.float32)
    rows = jnp.asarray(rng.integers(0, s, size=m), jnp.int32)
    ct = jnp.asarray(rng.normal(size=(2, m)), jnp.float32)  # random cotangents for (lse, l1)

    def dense(x, emb, w2):
        logits = x @ head.T + (emb @ w2.T if markov else 0.0)
        lse, l1 = L.vocab_stats(logits, teacher[rows])
        return jnp.sum(ct[0] * lse + ct[1] * l1)

    def fused(x, emb, w2):
        lse, l1 = L.fused_vocab_stats(x, head, emb, w2, teacher, rows, vocab_chunk=8)
        return jnp.sum(ct[0] * lse + ct[1] * l1)

    argnums = (0, 1, 2) if markov else (0,)
    v0, g0 = jax.value_and_grad(dense, argnums=argnums)(x, emb, w2)
    v1, g1 = jax.jit(jax.value_and_grad(fused, argnums=argnums))(x, emb, w2)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
