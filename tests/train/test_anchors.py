"""Anchors, blocks and rings of training (dspark_jax.train.anchors)."""

import math

import jax.numpy as jnp
import numpy as np

from dspark_jax.train import anchors as A


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
