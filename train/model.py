"""The training loss of a draft block batch (SPEC 8), on top of any family's teacher-forced forward.

    acts = draft_forward(params, tied, cfg, main_hidden, blocks, anchors)   # the family's train_forward
    loss sums from acts (fused head, see `block_loss_sums`) or materialised logits (`draft_logits`)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax import drafts
from dspark_jax.drafts.base import DraftActs, base_logits
from dspark_jax.train.anchors import Blocks
from dspark_jax.train.loss import fused_vocab_stats, loss_sums, vocab_stats


# The family's teacher-forced forward (kept under its training name).
draft_forward = drafts.train_forward


def draft_logits(params: dict, tied: dict, cfg, acts: DraftActs) -> jax.Array:
    """Materialised teacher-forced draft logits f32[B*N, K, V] = U + W2 z (the reference path; z = W1[prev]
    for the vanilla head, `drafts.markov` for the others)."""
    u = base_logits(acts.hidden, params["norm"]["scale"], tied["head"], cfg)
    if acts.markov_latent is None:
        return u
    return u + jnp.einsum("mkr,vr->mkv", acts.markov_latent.astype(jnp.float32),
                          params["markov"]["head"].astype(jnp.float32), precision="highest")


def gather_teacher(teacher_logits: jax.Array, blocks: Blocks) -> jax.Array:
    """Backbone logits [B, T, V] -> the teacher of every slot, f32[B*N, K, V]."""
    b, n, k = blocks.teacher_pos.shape
    idx = blocks.teacher_pos.reshape(b, n * k, 1)
    return jnp.take_along_axis(teacher_logits, idx, axis=1).reshape(b * n, k, -1).astype(jnp.float32)


def block_loss_sums(params: dict, tied: dict, cfg, acts: DraftActs, teacher_logits: jax.Array,
                    blocks: Blocks, *, decay_gamma: float = 4.0, vocab_chunk: int | None = None,
                    fused: bool = True) -> dict[str, jax.Array]:
    """Loss sums (`loss.loss_sums`) of the B*N blocks against backbone logits [B, T, V].

    fused=True never forms [B*N, K, V]: logits chunks come from the normed hidden and the head
    (`loss.fused_vocab_stats`, chunk = vocab_chunk or the whole vocabulary). fused=False materialises
    the draft and teacher logits and uses `loss.vocab_stats` (the reference path)."""
    b, n, k = blocks.labels.shape
    labels = blocks.labels.reshape(b * n, k)
    mask = blocks.mask.reshape(b * n, k)
    head = jax.lax.stop_gradient(tied["head"])
    teacher_logits = jax.lax.stop_gradient(teacher_logits)
    if fused:
        m = b * n * k
        rows = (jnp.arange(b, dtype=jnp.int32)[:, None] * teacher_logits.shape[1]
                + blocks.teacher_pos.reshape(b, n * k)).reshape(m)
        emb = None if acts.markov_latent is None else acts.markov_latent.reshape(m, -1)  # bias = W2 z
        w2 = None if acts.markov_latent is None else params["markov"]["head"]
        x = acts.normed.reshape(m, -1)
        lse, l1 = fused_vocab_stats(x, head, emb, w2, teacher_logits.reshape(-1, teacher_logits.shape[-1]), rows,
                                    vocab_chunk=vocab_chunk or head.shape[0])
        flat_labels = labels.reshape(m)
        label_logit = jnp.einsum("md,md->m", x, jnp.take(head, flat_labels, axis=0).astype(jnp.float32),
                                 precision="highest")
        if emb is not None:
            label_logit = label_logit + jnp.einsum("mr,mr->m", emb.astype(jnp.float32),
                                                   jnp.take(w2, flat_labels, axis=0).astype(jnp.float32),
                                                   precision="highest")
        ce = (lse - label_logit).reshape(b * n, k)
        l1 = l1.reshape(b * n, k)
    else:
        logits = draft_logits(params, {**tied, "head": head}, cfg, acts)
        lse, l1 = vocab_stats(logits, gather_teacher(teacher_logits, blocks), vocab_chunk=vocab_chunk)
        ce = lse - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return loss_sums(ce, l1, acts.conf_logits, mask, decay_gamma=decay_gamma)
