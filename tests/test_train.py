"""Training: loss numerics against numpy, anchors and masks, the attention pattern, the data path, the
jitted step (one device, an 8-device mesh, two processes), checkpoint resume, the frozen backbone."""

import dataclasses
import functools
import json
import math
import os
import pickle
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONFIGS, REPO
from spec_helpers import backbone_greedy_drafts

from dspark_jax import draft
from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.config import DSparkConfig
from dspark_jax.errors import UserError
from dspark_jax.nn.norm import rms_norm
from dspark_jax.parallel import make_mesh
from dspark_jax.train import anchors as A
from dspark_jax.train import data as D
from dspark_jax.train import loss as L
from dspark_jax.train import model as M
from dspark_jax.train.config import RunConfig, RunConfigError
from dspark_jax.train.trainer import Trainer, micro_loss, step_normalizer

DATA = REPO / "tests" / "data" / "tiny_train.jsonl"

# ---------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Anchors, blocks, rings
# ---------------------------------------------------------------------------------------------------


def test_anchor_candidate_rule_and_uniform_sampling():
    rng = np.random.default_rng(0)
    mask = rng.random((6, 40)) < 0.7
    mask[5] = False
    mask[5, [3, 4, 10]] = True  # exactly one candidate (3)
    cand = A.anchor_candidates(mask)
    want = np.zeros_like(mask)
    for b in range(6):
        for i in range(39):
            want[b, i] = mask[b, i] and mask[b, i + 1]
    np.testing.assert_array_equal(cand, want)
    anchors, valid = A.sample_anchors(mask, 8, [[1, b] for b in range(6)])
    for b in range(6):
        got = anchors[b][valid[b]]
        assert len(got) == min(8, cand[b].sum())
        assert np.all(cand[b][got]) and np.all(np.diff(got) > 0)  # candidates, distinct, sorted
        assert not valid[b, len(got):].any()
    np.testing.assert_array_equal(anchors[5][valid[5]], [3])
    again, _ = A.sample_anchors(mask, 8, [[1, b] for b in range(6)])
    np.testing.assert_array_equal(again, anchors)  # seeded
    # Uniform without replacement: each of c candidates is picked with probability N / c.
    row = mask[:1]
    c = int(A.anchor_candidates(row).sum())
    draws = 3000
    counts = np.zeros(40)
    for s in range(draws):
        a, v = A.sample_anchors(row, 8, [[s]])
        counts[a[0][v[0]]] += 1
    p = 8 / c
    picked = counts[A.anchor_candidates(row)[0]]
    assert np.all(np.abs(picked - draws * p) < 5 * math.sqrt(draws * p * (1 - p))), picked
    assert counts[~A.anchor_candidates(row)[0]].sum() == 0


def test_blocks_labels_prev_and_supervised_prefix():
    rng = np.random.default_rng(1)
    b, t, k, noise = 3, 20, 5, 99
    tokens = rng.integers(0, 50, size=(b, t)).astype(np.int32)
    mask = rng.random((b, t)) < 0.8
    anchors, valid = A.sample_anchors(mask, 6, [[2, i] for i in range(b)])
    anchors[0, -1], valid[0, -1] = t - 2, True  # a block that runs off the end of the sequence
    blk = A.make_blocks(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(anchors), jnp.asarray(valid), k, noise)
    for bi in range(b):
        for n in range(6):
            a = anchors[bi, n]
            np.testing.assert_array_equal(blk.inputs[bi, n], [tokens[bi, a]] + [noise] * (k - 1))
            np.testing.assert_array_equal(blk.positions[bi, n], a + np.arange(k))
            ok = True
            for j in range(k):
                lp = a + 1 + j
                inside = lp < t
                if inside:
                    assert blk.labels[bi, n, j] == tokens[bi, lp]
                    assert blk.teacher_pos[bi, n, j] == a + j
                ok = ok and bool(valid[bi, n]) and inside and bool(mask[bi, lp])
                assert bool(blk.mask[bi, n, j]) == ok, (bi, n, j)
                if blk.mask[bi, n, j]:  # never past the sequence or outside the loss mask
                    assert lp < t and mask[bi, lp]
            np.testing.assert_array_equal(blk.prev[bi, n], np.concatenate([[tokens[bi, a]], blk.labels[bi, n, :-1]]))
    assert not blk.mask[0, -1, 1:].any() and bool(blk.mask[0, -1, 0]) == bool(mask[0, t - 1])


def test_ring_positions_equal_a_sequentially_written_ring():
    w = 16
    anchors = jnp.asarray([[0, 1, 5, 15], [16, 17, 31, 40]])
    pos, valid = A.ring_positions(anchors, w)
    for bi in range(2):
        for n in range(4):
            a = int(anchors[bi, n])
            ring = [-1] * w
            for p in range(a):  # the inference ring after committing positions 0..a-1
                ring[p % w] = p
            for j in range(w):
                assert bool(valid[bi, n, j]) == (ring[j] >= 0)
                if ring[j] >= 0:
                    assert int(pos[bi, n, j]) == ring[j]


TCFG = DSparkConfig.from_json(CONFIGS / "tiny_v41.json").replace(hc_sinkhorn_iters=3, param_dtype="float32")


@functools.lru_cache(maxsize=None)
def draft_setup():
    params = draft.init_params(TCFG, jax.random.key(0))
    k = jax.random.split(jax.random.key(1), 2)
    v, d = TCFG.vocab_size, TCFG.dim
    tied = {"embed": jax.random.normal(k[0], (v, d)), "head": jax.random.normal(k[1], (v, d)) * d ** -0.5}
    return params, tied


@functools.lru_cache(maxsize=None)
def _forward_jit():
    return jax.jit(lambda p, tied, mh, blocks, anchors: M.draft_forward(p, tied, TCFG, mh, blocks, anchors))


def _pattern_inputs():
    rng = np.random.default_rng(3)
    b, t = 2, 40
    tokens = rng.integers(0, TCFG.vocab_size - 1, size=(b, t)).astype(np.int32)
    mh = rng.normal(size=(b, t, TCFG.main_hidden_dim)).astype(np.float32)
    anchors = np.array([[0, 7, 16, 30], [15, 17, 33, 38]], np.int32)  # empty ring, partial, full, wrapped
    valid = np.ones_like(anchors, bool)
    blocks = A.make_blocks(jnp.asarray(tokens), jnp.ones((b, t), bool), jnp.asarray(anchors), jnp.asarray(valid),
                           TCFG.block_size, TCFG.noise_token_id)
    return tokens, mh, anchors, blocks


def test_training_blocks_equal_inference_draft_at_each_anchor():
    """The per-anchor ring + body of training = prefill of positions < anchor + draft_hidden at inference.

    kv_fp8 off: training computes the context rows for the [2, 40] batch and the bodies for 8 blocks at
    once, inference for one [1, 40] row and one block, and XLA:CPU gives those shapes different last bits
    (the two hidden states differ by up to a few 1e-6). With the fp8 KV rounding on, such a difference
    moves a ring or draft-row value that sits near a rounding midpoint by one fp8 step, which moves the
    draft's outputs by 1e-4 to 7e-3 (measured for single one-step changes), far beyond this tolerance.
    Both sides call the same `context_rows` (rounding included) and body, so the rounding adds nothing to
    what this test checks (ring construction, positions, masks); a wrong ring slot, position or visible
    set changes h by O(1) and still fails."""
    cfg = TCFG.replace(kv_fp8=False)
    params, tied = draft_setup()
    tokens, mh, anchors, blocks = _pattern_inputs()
    acts = jax.jit(lambda p, mh, blocks, anchors: M.draft_forward(p, tied, cfg, mh, blocks, anchors))(
        params, jnp.asarray(mh), blocks, jnp.asarray(anchors))
    n_per = anchors.shape[1]

    @jax.jit
    def inference(mh_row, a, anchor_tok):
        st = draft.prefill(params, cfg, draft.init_state(cfg, 1), mh_row, a, impl="xla")
        h, base = draft.draft_hidden(params, tied, cfg, st, anchor_tok, impl="xla")
        return h, base

    for bi in range(2):
        for n in range(n_per):
            a = int(anchors[bi, n])
            h, base = inference(jnp.asarray(mh[bi:bi + 1]), jnp.asarray([a]), jnp.asarray(tokens[bi, a:a + 1]))
            np.testing.assert_allclose(acts.hidden[bi * n_per + n], h[0], rtol=1e-5, atol=1e-5)
            u = M.draft_logits(params, tied, cfg, acts._replace(markov_emb=None))[bi * n_per + n]
            np.testing.assert_allclose(u, base[0], rtol=1e-5, atol=1e-5)
    # Teacher-forced Markov inputs and the confidence head.
    emb = np.asarray(params["markov"]["embed"])[np.asarray(blocks.prev).reshape(-1, cfg.block_size)]
    np.testing.assert_array_equal(acts.markov_emb, emb)
    np.testing.assert_allclose(acts.conf_logits, draft.confidence_logits(acts.hidden, emb,
                                                                         params["confidence"]["kernel"]), rtol=1e-6)


def test_block_sees_only_its_window_of_earlier_context_and_its_own_slots():
    params, tied = draft_setup()
    tokens, mh, anchors, blocks = _pattern_inputs()
    n_per, w = anchors.shape[1], TCFG.window
    fwd = lambda mh, blocks: np.asarray(_forward_jit()(params, tied, jnp.asarray(mh), blocks,  # noqa: E731
                                                       jnp.asarray(anchors)).hidden)
    base = fwd(mh, blocks)
    rng = np.random.default_rng(4)

    def perturbed(positions, row=0):
        out = mh.copy()
        out[row, positions] += rng.normal(size=out[row, positions].shape).astype(np.float32) * 3
        return out

    changed = lambda got, m: float(np.abs(got[m] - base[m]).max())  # noqa: E731
    # Row 0 anchors: 0, 7, 16, 30 (blocks 0..3). Block 3 (anchor 30) has the window 14..29.
    # 1) a block's own anchor position and everything after: invisible to it, visible to later blocks
    got = fwd(perturbed(slice(16, None)), blocks)
    assert changed(got, 2) == 0 and changed(got, 1) == 0 and changed(got, 0) == 0
    assert changed(got, 3) > 1e-3
    got = fwd(perturbed(slice(30, None)), blocks)
    assert changed(got, 3) == 0
    # 2) positions before the window (0..13): invisible to block 3, visible to block 1 (anchor 7)
    got = fwd(perturbed(slice(0, 30 - w)), blocks)
    assert changed(got, 3) == 0 and changed(got, 1) > 1e-3
    # 3) any single position of the window: visible
    for p in (30 - w, 22, 29):
        assert changed(fwd(perturbed([p]), blocks), 3) > 1e-3, p
    # 4) the other sequence's context and every other block's inputs: invisible
    got = fwd(perturbed(slice(None), row=1), blocks)
    assert all(changed(got, m) == 0 for m in range(n_per))
    others = blocks._replace(inputs=blocks.inputs.at[0, :3].set(7).at[1].set(11))
    got = fwd(mh, others)
    assert changed(got, 3) == 0 and changed(got, 0) > 0
    # 5) its own later slots: visible to its first slot (the block is bidirectional)
    mine = fwd(mh, blocks._replace(inputs=blocks.inputs.at[0, 3, -1].set(7)))
    assert np.abs(mine[3, 0] - base[3, 0]).max() > 1e-4


def test_fused_block_loss_equals_reference_path_with_gradients():
    """The trainer's fused path (teacher rows b*T + pos, label logits from x . head[label] +
    W1[prev] . W2[label]) against materialised logits and gathered teachers, value and gradient."""
    params, tied = draft_setup()
    tokens, _, anchors, blocks = _pattern_inputs()
    rng = np.random.default_rng(6)
    nb, k, d = anchors.size, TCFG.block_size, TCFG.dim
    teacher = jnp.asarray(rng.normal(size=(2, 40, TCFG.vocab_size)) * 2, jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(nb, k, d)), jnp.float32)
    emb = jnp.take(params["markov"]["embed"], blocks.prev.reshape(nb, k), axis=0)
    conf = jnp.asarray(rng.normal(size=(nb, k)), jnp.float32)
    trained = {"norm": params["norm"], "markov": params["markov"]}

    def total(p, hidden, emb, fused, chunk):
        normed = rms_norm(hidden, p["norm"]["scale"], TCFG.norm_eps).astype(jnp.float32)
        acts = M.DraftActs(hidden, normed, emb, conf)
        s = M.block_loss_sums(p, tied, TCFG, acts, teacher, blocks, fused=fused, vocab_chunk=chunk)
        return L.loss_from_sums(s)[0]

    grad = lambda fused, chunk: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda p, h, e: total(p, h, e, fused, chunk), argnums=(0, 1, 2)))(trained, hidden, emb)
    v0, g0 = grad(False, None)
    for chunk in (96, None):
        v1, g1 = grad(True, chunk)
        np.testing.assert_allclose(v1, v0, rtol=1e-5)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    assert float(jnp.abs(g0[0]["markov"]["head"]).max()) > 1e-6 and float(jnp.abs(g0[1]).max()) > 1e-6


@pytest.mark.parametrize("variant", [dict(markov_rank=0), dict(block_size=1)])
def test_pure_parallel_and_one_token_drafts_trace(variant):
    """No Markov head (markov_rank 0) and K = 1 go through the same forward, loss and gradient."""
    cfg = TCFG.replace(**variant)
    params = draft.abstract_params(cfg)
    _, tied = draft_setup()
    tokens, mh, anchors, _ = _pattern_inputs()
    blocks = A.make_blocks(jnp.asarray(tokens), jnp.ones(tokens.shape, bool), jnp.asarray(anchors),
                           jnp.ones(anchors.shape, bool), cfg.block_size, cfg.noise_token_id)
    teacher = jnp.zeros((2, 40, cfg.vocab_size))

    def loss(p):
        acts = M.draft_forward(p, tied, cfg, jnp.asarray(mh), blocks, jnp.asarray(anchors))
        return L.loss_from_sums(M.block_loss_sums(p, tied, cfg, acts, teacher, blocks, vocab_chunk=100))[0]

    value, grads = jax.eval_shape(jax.value_and_grad(loss), params)
    assert value.shape == () and jax.tree.structure(grads) == jax.tree.structure(params)
    assert ("markov" in grads) == bool(cfg.markov_rank)


def test_straight_through_fp8_keeps_values_and_passes_gradients():
    from dspark_jax.nn.quant import fp8_quant_dequant

    x = jax.random.normal(jax.random.key(0), (2, 64))
    st = functools.partial(fp8_quant_dequant, grad="straight_through")
    np.testing.assert_array_equal(st(x), fp8_quant_dequant(x))
    ct = jnp.arange(64.0) * 1e-3
    g_exact = jax.grad(lambda x: jnp.sum(fp8_quant_dequant(x) * ct))(x)
    g_st = jax.grad(lambda x: jnp.sum(st(x) * ct))(x)
    np.testing.assert_allclose(g_st, jnp.broadcast_to(ct, x.shape))
    # The literal derivative rounds the cotangent to fp8: small cotangents vanish (why the trainer uses ST).
    assert float(jnp.abs(g_exact).max()) == 0.0
    with pytest.raises(ValueError, match="fp8 'grad'"):
        fp8_quant_dequant(x, grad="straight")
    # Through the real draft: the context rows' gradient reaches main_proj only with straight-through.
    params, _ = draft_setup()
    mh = jax.random.normal(jax.random.key(1), (1, 6, TCFG.main_hidden_dim))
    pos = jnp.arange(6)[None]

    def rows_grad(fp8_grad):
        f = lambda p: jnp.sum(draft.DSparkDraft(TCFG, "xla", fp8_grad).apply(  # noqa: E731
            {"params": p}, mh, pos, method=draft.DSparkDraft.context_rows) * 1e-3)
        return jax.jit(jax.grad(f))(params)["main_proj"]["kernel"]

    assert float(jnp.abs(rows_grad("exact")).max()) == 0.0
    assert float(jnp.abs(rows_grad("straight_through")).max()) > 1e-6


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


def _stream(tmp_path, lines, **kw):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cfg = D.DataConfig(train=(str(path),), **{"seq_len": 8, "shuffle_buffer": 4, **kw})
    return D.JsonlStream(cfg, process_index=0, process_count=1)


def test_token_records_fixed_length_and_masks(tmp_path):
    s = _stream(tmp_path, [{"tokens": [5, 6, 7], "loss_mask": [0, 1, 1]},
                           {"tokens": list(range(1, 13))}], shuffle_buffer=1)
    got = {e.record: e for e in (next(s), next(s))}
    np.testing.assert_array_equal(got[0].tokens, [5, 6, 7, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(got[0].loss_mask, [0, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(got[1].tokens, np.arange(1, 9))  # truncated
    assert got[1].loss_mask.all()
    with pytest.raises(D.DataError, match="line 1.*loss_mask"):
        next(_stream(tmp_path, [{"tokens": [1, 2], "loss_mask": [1]}]))
    with pytest.raises(D.DataError, match="needs a tokenizer"):
        next(_stream(tmp_path, [{"text": "hi"}]))
    with pytest.raises(D.DataError, match="outside the vocabulary"):
        s = _stream(tmp_path, [{"tokens": [1, 600]}])
        s.vocab_size = 512
        next(s)


def test_a_bad_training_line_is_skipped_with_a_warning_naming_it(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"tokens": [1, 2]}\n{"tokens": [3, "\xff"]}\nnot json\n{"tokens": [1, -4]}\n{"tokens": [5, 6]}\n')
    s = D.JsonlStream(D.DataConfig(train=(str(path),), seq_len=4, shuffle_buffer=1), process_index=0, process_count=1)
    with pytest.warns(D.DataWarning) as caught:
        got = [next(s).tokens[:2].tolist() for _ in range(4)]
    assert got == [[1, 2], [5, 6], [1, 2], [5, 6]]  # two epochs of the good lines, in file order
    said = [str(w.message) for w in caught]
    assert any(f"{path} line 2: not UTF-8" in m for m in said) and any("line 3: not valid JSON" in m for m in said)
    assert any("line 4: 'tokens' must be a list of non-negative integers" in m for m in said)
    assert s.skipped == 6


def test_text_records_with_loss_spans(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "user": 1, ":": 2, "hi": 3, "bot": 4, "hello": 5, "there": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_path = tmp_path / "tok.json"
    tok.save(str(tok_path))
    text = "user: hi bot: hello there"
    start = text.index("hello")
    s = _stream(tmp_path, [{"text": text, "loss_spans": [[start, len(text)]]}], tokenizer=str(tok_path))
    e = next(s)
    # WhitespaceSplit keeps "user:" whole -> [UNK]; tokens: user: hi bot: hello there
    np.testing.assert_array_equal(e.tokens[:5], [0, 3, 0, 5, 6])
    np.testing.assert_array_equal(e.loss_mask[:5], [0, 0, 0, 1, 1])
    assert not e.loss_mask[5:].any()


def test_shuffle_is_seeded_and_hosts_partition_the_records(tmp_path):
    lines = [{"tokens": [i + 1, i + 2]} for i in range(30)]
    first_epoch = lambda s: [next(s).record for _ in range(30)]  # noqa: E731
    a = first_epoch(_stream(tmp_path, lines, seed=1))
    assert sorted(a) == list(range(30)) and a != list(range(30))
    assert first_epoch(_stream(tmp_path, lines, seed=1)) == a
    assert first_epoch(_stream(tmp_path, lines, seed=2)) != a
    path = tmp_path / "d.jsonl"
    cfg = D.DataConfig(train=(str(path),), seq_len=4, shuffle_buffer=8, seed=1)
    hosts = [D.JsonlStream(cfg, process_index=p, process_count=3) for p in range(3)]
    seen = [sorted(next(h).record for _ in range(10)) for h in hosts]
    assert sorted(sum(seen, [])) == list(range(30))
    assert all(all(r % 3 == p for r in rec) for p, rec in enumerate(seen))


def test_seek_continues_exactly_like_an_uninterrupted_stream():
    cfg = D.DataConfig(train=(str(DATA),), seq_len=48, shuffle_buffer=16, seed=3, anchors_per_seq=4)
    one = D.Batches(D.JsonlStream(cfg, process_index=1, process_count=2), per_host_batch=5)
    seq = [next(one) for _ in range(7)]  # 35 examples: crosses the 24-record epoch of this host
    two = D.Batches(D.JsonlStream(cfg, process_index=1, process_count=2), per_host_batch=5)
    two.stream.seek(4 * 5)
    for want in seq[4:]:
        got = next(two)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


# ---------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------

FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_models")
    d = json.loads((CONFIGS / "tiny_v41.json").read_text())
    # kv_fp8 off: fp8 rounding is discontinuous, so a one-ulp difference from another reduction order
    # (another mesh) flips a rounding and moves the loss by ~1e-5; Adam's first steps then amplify it. The
    # step-equivalence tests compare smooth models. (fp8 training is covered by the fused-loss test
    # above and the slow CLI test on configs/train_tiny.yaml.)
    d.update(hc_sinkhorn_iters=2, n_layers=1, target_layer_ids=[0, 1], kv_fp8=False)
    (root / "draft.json").write_text(json.dumps(d))
    b = json.loads((CONFIGS / "tiny_mhc_backbone.json").read_text())
    b.update(hc_sinkhorn_iters=2, n_layers=2, kv_fp8=False)
    (root / "backbone.json").write_text(json.dumps(b))
    return root


def run_config(model_files, run_dir, **over) -> dict:
    raw = {
        "run_dir": str(run_dir), "seed": 0, "steps": 10, "global_batch": 8, "grad_accum": 1,
        "compute_dtype": "float32", "compiler_options": FAST_COMPILE,
        "backbone": {"family": "mhc", "config": str(model_files / "backbone.json")},
        "draft": {"config": str(model_files / "draft.json")},
        "data": {"train": [str(DATA)], "seq_len": 48, "shuffle_buffer": 16, "anchors_per_seq": 6},
        "optim": {"lr": 3e-3, "warmup_frac": 0.1},
        "loss": {"vocab_chunk": 96},
        "checkpoint": {"every": 2, "keep": 5},
        "log": {"every": 1},
    }
    raw.update(over)
    return raw


@functools.lru_cache(maxsize=None)
def initial_params(draft_json, backbone_json):
    dcfg = DSparkConfig.from_json(draft_json).replace(param_dtype="float32")
    bb = MhcBackbone(MhcConfig.from_json(backbone_json))
    return (jax.device_get(draft.init_params(dcfg, jax.random.key(1))),
            jax.device_get(bb.init_params(jax.random.key(0))))


def make_trainer(model_files, run_dir, mesh, **over):
    cfg = RunConfig.from_dict(run_config(model_files, run_dir, **over))
    dp, bp = initial_params(str(model_files / "draft.json"), str(model_files / "backbone.json"))
    return Trainer(cfg, mesh=mesh, draft_params=dp, backbone_params=bp)


def fixed_batch(accum=1):
    cfg = D.DataConfig(train=(str(DATA),), seq_len=48, shuffle_buffer=16, seed=0, anchors_per_seq=6)
    batch = next(D.Batches(D.JsonlStream(cfg, process_index=0, process_count=1), per_host_batch=8))
    return {k: v.reshape(accum, 8 // accum, *v.shape[2:]) for k, v in batch.items()}


def one_device():
    return make_mesh(devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def trainer1(model_files, tmp_path_factory):
    return make_trainer(model_files, tmp_path_factory.mktemp("run1"), one_device())


def test_loss_falls_on_a_fixed_batch(trainer1):
    tr = trainer1
    tr.state = tr._init_state(initial_params(*_paths(tr))[0])
    batch = fixed_batch()
    hist = [jax.device_get(tr.step(batch)) for _ in range(8)]
    losses = [float(h["loss"]) for h in hist]
    assert all(np.isfinite(losses))
    # Measured: 2.44 -> 2.12 in 8 steps (-13%; the run's 10-step cosine schedule flattens it at ~2.11).
    # With the random backbone of an earlier init it was 2.51 -> 2.11 (-16%), which the old bound of 0.85
    # was set against; the end point is the same. Steps that do not update the draft leave it unchanged.
    assert losses[-1] < 0.9 * losses[0], losses
    assert float(hist[-1]["l1"]) < float(hist[0]["l1"])  # the draft moves toward the backbone
    assert hist[0]["supervised_slots"] > 100


def _paths(tr):
    return str(tr.cfg.draft.config), str(tr.cfg.backbone.config)


def test_backbone_gets_no_update_and_no_gradient(trainer1):
    tr = trainer1
    dp, bp = initial_params(*_paths(tr))
    tr.state = tr._init_state(dp)
    batch = fixed_batch()
    for _ in range(2):
        tr.step(batch)
    # The optimizer holds exactly the draft's parameters; the backbone's are untouched, bit for bit.
    assert jax.tree.structure(tr.state.params) == jax.tree.structure(dp)
    for a, b in zip(jax.tree.leaves(tr.backbone_params), jax.tree.leaves(bp)):
        np.testing.assert_array_equal(a, b)
    # d loss / d backbone params == 0 exactly, although the loss does depend on them.
    spec = tr.spec
    mb = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    norm = step_normalizer(spec, {k: jnp.asarray(v) for k, v in batch.items()})
    vg = jax.jit(jax.value_and_grad(lambda bb: micro_loss(spec, tr.state.params, bb, mb, norm)[0]))
    bb = jax.tree.map(jnp.asarray, bp)
    value, grads = vg(bb)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))
    shifted = jax.tree.map(lambda x: x * 1.1 if x.dtype == jnp.float32 else x, bb)
    assert abs(float(vg(shifted)[0]) - float(value)) > 1e-4


def _snapshot(tr):
    return jax.device_get(tr.state.params), jax.device_get(tr.state.opt_state)


def test_resume_from_checkpoint_is_bit_identical(model_files, tmp_path):
    mesh = one_device()
    tr = make_trainer(model_files, tmp_path / "run", mesh)
    tr.fit(until=4, progress=False)
    want = _snapshot(tr)
    assert sorted(tr.manager.all_steps()) == [2, 4]
    log = tmp_path / "run" / "metrics.jsonl"
    first = [json.loads(x) for x in log.read_text().splitlines()]
    tr2 = make_trainer(model_files, tmp_path / "run", mesh)
    assert tr2.restore(step=2) == 2
    assert int(tr2.state.step) == 2
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2]  # rewound with the state
    tr2.fit(until=4, progress=False)
    got = _snapshot(tr2)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]  # no step logged twice
    for r in recs[-2:]:
        assert r.keys() >= {"loss", "ce", "l1", "conf", "accept_rate@1", "accept_rate@5", "tau_estimate",
                            "conf_bias", "lr", "grad_norm", "tokens_per_s"}
    strip = lambda r: {k: v for k, v in r.items() if k != "tokens_per_s"}  # noqa: E731
    assert [strip(r) for r in first] == [strip(r) for r in recs]


def _corrupt(step_dir):
    """Truncate every data file of a checkpoint to half its size (a torn write)."""
    files = [f for f in step_dir.rglob("*") if f.is_file() and f.stat().st_size > 0]
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return len(files)


def test_resume_skips_a_corrupt_latest_checkpoint_and_keeps_it(model_files, tmp_path):
    mesh = one_device()
    run = tmp_path / "run"
    tr = make_trainer(model_files, run, mesh)
    tr.fit(until=4, progress=False)
    want = _snapshot(tr)
    assert _corrupt(run / "checkpoints" / "4") > 0
    tr2 = make_trainer(model_files, run, mesh)
    with pytest.warns(UserWarning, match=r"checkpoints/4 is unreadable .* it is kept, trying the previous one"):
        assert tr2.restore() == 2
    assert (run / "checkpoints" / "4").is_dir()  # kept, not deleted
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    with pytest.warns(UserWarning, match="unreadable checkpoint of step 4 moved to"):
        tr2.fit(until=4, progress=False)
    for a, b in zip(jax.tree.leaves(_snapshot(tr2)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert len(list((run / "unreadable_checkpoints").iterdir())) == 1
    assert make_trainer(model_files, run, mesh).restore() == 4  # the re-saved step 4 is intact
    # every checkpoint unreadable: a clear error naming the folder, nothing moved
    for step in (2, 4):
        _corrupt(run / "checkpoints" / str(step))
    with pytest.warns(UserWarning), pytest.raises(UserError, match=r"no intact checkpoint in .*checkpoints"):
        make_trainer(model_files, run, mesh).restore()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


@pytest.fixture(scope="module")
def mesh_results(model_files, tmp_path_factory):
    """Two steps on one device (one batch of 8) and on a data=2 x fsdp=2 x expert=2 mesh of 8 devices
    (two accumulated micro-batches of 4): same sequences, so the same numbers."""
    out = {}
    for name, mesh, accum in (("one", one_device(), 1), ("mesh", make_mesh(2, 2, 2), 2)):
        tr = make_trainer(model_files, tmp_path_factory.mktemp(name), mesh, grad_accum=accum)
        batch = fixed_batch(accum)
        metrics = [jax.device_get(tr.step(batch))]
        mu = jax.device_get(adam_mu(tr.state))
        metrics.append(jax.device_get(tr.step(batch)))
        out[name] = (metrics, mu, tr)
    return out


def adam_mu(state):
    """Adam's first moment: linear in the (clipped) gradients, so it shows the sharded gradient sums
    without Adam's g / (|g| + eps), which maps rounding noise on near-zero gradients to +-lr steps."""
    return state.opt_state[1][0].mu


def _assert_same_step(a, b):
    """Metrics of both steps (the second at the updated parameters) and Adam's first moment after the
    first step (= 0.1 x the clipped gradient) to 1e-5 of its largest entry: elementwise relative error
    is meaningless where a gradient sum cancels to ~0. (Later moments are not compared: Adam's first
    update g / (|g| + eps) turns rounding noise on those near-zero gradients into +-lr steps.)"""
    (ma, pa), (mb, pb) = a, b
    for x, y in zip(ma, mb):
        for key in ("loss", "ce", "l1", "conf", "accept_rate", "tau_estimate", "conf_bias", "grad_norm", "lr",
                    "supervised_slots"):
            # atol 1e-6: conf_bias is a difference of two O(1) means (~1e-3), so it carries their rounding
            np.testing.assert_allclose(x[key], y[key], rtol=1e-5, atol=1e-6, err_msg=key)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(pa))
    assert scale > 0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_step_on_8_device_mesh_equals_one_device(mesh_results):
    metrics, mu, tr = mesh_results["mesh"]
    _assert_same_step(mesh_results["one"][:2], (metrics, mu))
    w1 = tr.state.params["blocks_0"]["ffn"]["experts"]["w1"]
    assert "expert" in str(w1.sharding.spec) and len(w1.sharding.device_set) == 8
    mu = tr.state.opt_state[1][0].mu["blocks_0"]["ffn"]["experts"]["w1"]
    assert mu.sharding == w1.sharding  # the Adam moments follow their parameters
    assert tr.compiled.batch_shardings["tokens"].spec[1] == ("data", "fsdp")


WORKER = textwrap.dedent("""
    import os, sys, json, pickle
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.experimental import multihost_utils
    from dspark_jax.train.config import DistributedConfig, RunConfig
    from dspark_jax.train.trainer import Trainer, init_distributed
    from dspark_jax.parallel import make_mesh

    pid, port, work = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    init_distributed(DistributedConfig(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid))
    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    with open(os.path.join(work, "inputs.pkl"), "rb") as f:
        raw, draft_params, backbone_params, batch = pickle.load(f)
    trainer = Trainer(RunConfig.from_dict(raw), mesh=make_mesh(2, 2, 2), draft_params=draft_params,
                      backbone_params=backbone_params)
    half = batch["tokens"].shape[1] // 2
    local = {k: v[:, pid * half:(pid + 1) * half] for k, v in batch.items()}
    metrics = [jax.device_get(trainer.step(local))]
    mu = multihost_utils.process_allgather(trainer.state.opt_state[1][0].mu, tiled=True)
    metrics.append(jax.device_get(trainer.step(local)))
    if pid == 0:
        with open(os.path.join(work, "out.pkl"), "wb") as f:
            pickle.dump((metrics, jax.device_get(mu)), f)
    print("worker", pid, "done", flush=True)
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one_process(mesh_results, model_files, tmp_path):
    """jax.distributed with CPU (gloo) collectives: 2 processes x 4 devices run the step of the
    8-device mesh, each feeding its half of the batch."""
    raw = run_config(model_files, tmp_path / "run", grad_accum=2)
    dp, bp = initial_params(str(model_files / "draft.json"), str(model_files / "backbone.json"))
    with open(tmp_path / "inputs.pkl", "wb") as f:
        pickle.dump((raw, dp, bp, fixed_batch(2)), f)
    (tmp_path / "worker.py").write_text(WORKER)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(pid), str(port), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=900)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n\n".join(x[-3000:] for x in logs)
    with open(tmp_path / "out.pkl", "rb") as f:
        metrics, mu = pickle.load(f)
    m_ref, mu_ref, _ = mesh_results["mesh"]
    _assert_same_step((m_ref, mu_ref), (metrics, mu))


def corrupted_greedy_propose(model, weights, state, params, seeds, filtering):
    """A stand-in draft for the round: the backbone's own greedy continuation with draft k replaced
    by a wrong token at a pseudo-random ~27% of (position, seed) pairs, so rounds accept 0 to K."""
    k, bb = model.block_size, model.backbone
    tokens = backbone_greedy_drafts(model, weights, state)
    pos = state.draft.length[:, None] + jnp.arange(k)
    bad = (pos * 7919 + seeds[:, None].astype(jnp.int32) * 104729) % 11 < 3
    tokens = jnp.where(bad, (tokens + 1) % bb.vocab_size, tokens)
    b = tokens.shape[0]
    conf = jnp.broadcast_to(jnp.linspace(2.0, -2.0, k), (b, k))
    return draft.DraftOutput(tokens, jax.nn.one_hot(tokens, bb.vocab_size) * 30.0, conf, jnp.zeros((b, k, 0)),
                             jnp.zeros((b, k, model.cfg.dim)))


@pytest.mark.slow
def test_rollout_is_on_policy_and_its_records_feed_calibration(trainer1, tmp_path):
    """Greedy rollouts through the speculative round reproduce the backbone's own greedy decoding
    (lossless verification), and tau / acceptance / records agree with each other. The draft is a
    corrupted copy of the backbone so that acceptance lengths vary (a random draft accepts ~nothing)."""
    from dspark_jax import sampling
    from dspark_jax import spec_round as sr
    from dspark_jax.calibration_cli import read_records
    from dspark_jax.train import rollout as R

    model, weights = trainer1.spec_pair(impl="xla")
    model = dataclasses.replace(model, propose_fn=corrupted_greedy_propose)
    prompts = [[5, 9, 11], [100, 101, 102, 103, 104, 105], [7]]
    cfg = R.RolloutConfig(max_new_tokens=9, temperature=0.0, batch_size=2, num_verify=3)
    res = R.rollout(model, weights, prompts, cfg)
    # plain greedy decoding of the backbone, one prompt at a time
    plain = jax.jit(sr.plain_step, static_argnums=0)
    start = jax.jit(sr.start, static_argnums=0)
    for p, got in zip(prompts, res.responses):
        st = sr.init_state(model, 1, 32)
        greedy, seeds, on = sampling.SamplingParams.greedy(1), jnp.zeros((1,), jnp.uint32), jnp.ones((1,), bool)
        st, tok = start(model, weights, st, jnp.asarray([p]), jnp.asarray([len(p)]), on, greedy, seeds)
        want = [int(tok[0])]
        while len(want) < 9:
            st, tok = plain(model, weights, st, greedy, seeds, on)
            want.append(int(tok[0]))
        assert got == want
    m = res.metrics
    assert m.emitted == sum(len(r) - 1 for r in res.responses)  # the first token comes from the prefill
    np.testing.assert_allclose(res.tau, m.emitted / m.request_rounds)
    n = np.array([r["num_accepted"] for r in res.records])
    v = np.array([r["num_verified"] for r in res.records])
    assert v.max() == 3 and np.all(n <= v) and set(n.tolist()) >= {0, 1, 3}
    for k in range(1, 4):  # per-position conditional acceptance recomputed from the records
        reached = (v >= k) & (n >= k - 1)
        np.testing.assert_allclose(res.acceptance[k - 1], (reached & (n >= k)).sum() / reached.sum())
    R.write_calibration_records(tmp_path / "rounds.jsonl", res.records)
    z, n2, v2 = read_records(tmp_path / "rounds.jsonl")
    assert z.shape == (len(res.records), model.block_size) and np.array_equal(n2, n)
    R.write_training_jsonl(tmp_path / "regen.jsonl", prompts, res.responses)
    s = D.JsonlStream(D.DataConfig(train=(str(tmp_path / "regen.jsonl"),), seq_len=16, shuffle_buffer=1),
                      process_index=0, process_count=1)
    e = next(s)
    assert e.loss_mask.sum() == 9 and not e.loss_mask[:len(prompts[e.record])].any()


# ---------------------------------------------------------------------------------------------------
# Config and CLI
# ---------------------------------------------------------------------------------------------------


def test_run_config_yaml_and_errors(tmp_path, monkeypatch, capsys):
    cfg = RunConfig.from_yaml(CONFIGS / "train_tiny.yaml")
    assert cfg.backbone.config == str(CONFIGS / "tiny_mhc_backbone.json")
    assert cfg.data.train == (str(CONFIGS / "../tests/data/tiny_train.jsonl"),)
    assert cfg.loss.fused and cfg.optim.weight_decay == 0.0 and cfg.optim.clip_norm == 1.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {train: [x.jsonl]}\ndraft: {config: a.json}\nbackbone: {config: b.json}\n"
                   "optim: {lr: 1, foo: 2}\n")
    with pytest.raises(RunConfigError, match="optim.foo"):
        RunConfig.from_yaml(bad)
    from dspark_jax.cli import main

    monkeypatch.setattr(sys, "argv", sys.argv[:])  # cli.main rewrites sys.argv; restore it after
    assert main(["train", "--config", str(bad)]) == 2  # the CLI boundary: one line naming the key
    assert "optim.foo" in capsys.readouterr().err
    with pytest.raises(RunConfigError, match="multiple of grad_accum"):
        RunConfig.from_dict(run_config(tmp_path, tmp_path, global_batch=6, grad_accum=4))
    # the lr schedule: warmup from lr/warmup (never 0), peak, cosine to 0
    from dspark_jax.train.trainer import lr_schedule

    sched = lr_schedule(dataclasses.replace(cfg.optim, lr=1.0, warmup_frac=0.1), 100)
    np.testing.assert_allclose([sched(0), sched(9), sched(10), sched(55), sched(100)], [0.1, 1.0, 1.0, 0.5, 0.0],
                               atol=1e-6)


@pytest.mark.slow
def test_cli_trains_checkpoints_and_resumes(tmp_path):
    """`dspark train --config configs/train_tiny.yaml` end to end (compiles the full tiny config)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dspark_jax", "train", "--config", str(CONFIGS / "train_tiny.yaml"),
           "--run-dir", str(run_dir), "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run(cmd + ["--steps", "3"], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 3 and np.isfinite(recs[-1]["loss"])
    assert (run_dir / "checkpoints" / "3").is_dir() and (run_dir / "run_config.json").is_file()
    r = subprocess.run(cmd + ["--steps", "5"], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 3" in r.stderr
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 5
