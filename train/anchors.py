"""Anchors, draft blocks and their context rings for training (SPEC 8).

Per sequence, up to N anchors are drawn uniformly without replacement among the positions i with
loss_mask[i] and loss_mask[i+1], sorted by position. Block n (anchor a) has inputs
`[x_a, noise x (K-1)]` at positions a..a+K-1, labels `x_{a+1+k}`, teacher rows a+k (the backbone logits
at a+k predict x_{a+1+k}), teacher-forced Markov predecessors `[x_a, labels[:-1]]`, and supervised slots
= the contiguous valid prefix (cumprod of: label inside the sequence and loss_mask at the label).

Attention pattern: each block sees the backbone context of the last W positions before its anchor and
its own K slots (bidirectionally), nothing of other blocks. `anchor_rings` builds, for every anchor,
exactly the ring the inference draft would hold after committing positions 0..a-1 (slot = pos % W,
ring_len = a) by gathering the per-sequence context rows, so `DSparkDraft.body` run on these rings
gives that pattern by construction.

`sample_anchors` runs on the host (numpy, one seeded generator per sequence so the draw does not depend
on batch layout or host count); everything else here is jittable.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """bool[..., T]: position i may anchor a block iff loss_mask[i] and loss_mask[i+1]."""
    m = np.asarray(loss_mask, bool)
    out = np.zeros_like(m)
    out[..., :-1] = m[..., :-1] & m[..., 1:]
    return out


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, seeds) -> tuple[np.ndarray, np.ndarray]:
    """loss_mask bool[B, T], seeds: B entropy values (ints or int sequences) -> (anchors i32[B, N],
    valid bool[B, N]). Row b takes min(N, #candidates) distinct candidates uniformly, sorted; the padding
    entries are anchor 0 with valid False."""
    if num_anchors <= 0:
        raise ValueError(f"num_anchors: expected a positive integer, got {num_anchors}")
    cand = anchor_candidates(loss_mask)
    b = cand.shape[0]
    if len(seeds) != b:
        raise ValueError(f"sample_anchors: got {len(seeds)} seeds for {b} sequences")
    anchors = np.zeros((b, num_anchors), np.int32)
    valid = np.zeros((b, num_anchors), bool)
    for i in range(b):
        pos = np.flatnonzero(cand[i])
        n = min(num_anchors, pos.size)
        if n:
            rng = np.random.default_rng(seeds[i])
            anchors[i, :n] = np.sort(rng.choice(pos, size=n, replace=False))
            valid[i, :n] = True
    return anchors, valid


class Blocks(NamedTuple):
    inputs: jax.Array  # i32[B, N, K] [x_anchor, noise, ...]
    positions: jax.Array  # i32[B, N, K] anchor + k
    labels: jax.Array  # i32[B, N, K] x_{anchor+1+k} (0 where outside the sequence)
    prev: jax.Array  # i32[B, N, K] teacher-forced Markov predecessors [x_anchor, labels[:-1]]
    teacher_pos: jax.Array  # i32[B, N, K] the backbone row whose logits are slot k's teacher (anchor + k)
    mask: jax.Array  # bool[B, N, K] supervised slots (contiguous valid prefix)


def make_blocks(tokens: jax.Array, loss_mask: jax.Array, anchors: jax.Array, anchor_valid: jax.Array,
                block_size: int, noise_token_id: int) -> Blocks:
    """tokens i32[B, T], loss_mask bool[B, T], anchors i32[B, N], anchor_valid bool[B, N] -> Blocks."""
    t = tokens.shape[-1]
    k = jnp.arange(block_size, dtype=jnp.int32)
    anchors = anchors.astype(jnp.int32)
    positions = anchors[..., None] + k  # [B, N, K]
    label_pos = positions + 1
    inside = label_pos < t
    clipped = jnp.minimum(label_pos, t - 1)
    take = lambda x: jnp.take_along_axis(x[:, None, :], clipped, axis=-1)  # noqa: E731  [B, N, K]
    labels = jnp.where(inside, take(tokens), 0).astype(jnp.int32)
    label_ok = inside & take(loss_mask.astype(bool)) & anchor_valid[..., None].astype(bool)
    mask = jnp.cumprod(label_ok.astype(jnp.int32), axis=-1).astype(bool)
    anchor_tok = jnp.take_along_axis(tokens, jnp.clip(anchors, 0, t - 1), axis=-1).astype(jnp.int32)
    noise = jnp.full(positions.shape[:-1] + (block_size - 1,), noise_token_id, jnp.int32)
    inputs = jnp.concatenate([anchor_tok[..., None], noise], axis=-1)
    prev = jnp.concatenate([anchor_tok[..., None], labels[..., :-1]], axis=-1)
    return Blocks(inputs, positions, labels, prev, jnp.minimum(positions, t - 1), mask)


def ring_positions(anchors: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """For every anchor a: the position held by ring slot j after committing 0..a-1, and whether that
    slot is valid. -> (pos i32[..., W], valid bool[..., W]); pos = the largest p < a with p % W == j,
    valid iff j < min(W, a)."""
    a = anchors.astype(jnp.int32)[..., None]
    j = jnp.arange(window, dtype=jnp.int32)
    pos = a - 1 - jnp.mod(a - 1 - j, window)
    return pos, j < jnp.minimum(window, a)


def anchor_rings(rows: jax.Array, anchors: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """rows [L, B, T, hd] (context rows of every position of each sequence), anchors i32[B, N]
    -> (ring [L, B*N, W, hd], ring_len i32[B*N]): the inference ring of each anchor, invalid slots zero."""
    n_layers, b, t, hd = rows.shape
    n = anchors.shape[1]
    pos, valid = ring_positions(anchors, window)  # [B, N, W]
    idx = jnp.clip(pos, 0, t - 1).reshape(1, b, n * window, 1)
    ring = jnp.take_along_axis(rows, idx, axis=2).reshape(n_layers, b, n, window, hd)
    ring = jnp.where(valid[None, ..., None], ring, jnp.zeros((), rows.dtype))
    return ring.reshape(n_layers, b * n, window, hd), anchors.reshape(b * n).astype(jnp.int32)
