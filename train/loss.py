"""The DSpark training loss (SPEC 8, DeepSpec reference numerics).

Per supervised slot (block n, position k = 0..K-1), with p_d = softmax(draft logits) and
p_t = softmax(target logits) at T = 1:

    ce_k   = -log p_d(label)
    l1_k   = ||p_d - p_t||_1                              (acceptance estimate: 1 - 0.5 * l1_k)
    conf_k = BCE(sigmoid(z_k), stop_grad(1 - 0.5 * l1_k))

and with w_k = exp(-k / decay_gamma) over the valid slots,

    loss = (ce_weight * sum w ce + l1_weight * sum w l1 + conf_weight * sum w conf) / (sum w + 1e-6).

The vocabulary is the memory hot spot. `vocab_stats` reduces [M, V] logits to the two per-slot
numbers the loss needs (the draft logsumexp and l1) either densely or in vocabulary chunks
(`vocab_chunk`): an online logsumexp pass for both softmaxes, a second pass for l1, and a hand-written
backward that recomputes each chunk, so no [M, V] temporary beyond the inputs and their gradient ever
exists. `fused_vocab_stats` goes further and never forms the draft logits at all: it takes the final
normed hidden x, the tied LM head and the Markov factors and builds each logits chunk on the fly
(`x @ head_c^T + W1[prev] @ W2_c^T`). `dspark_loss` on materialised logits is the reference contract;
the trainer uses the fused path, and tests check they agree in value and gradient.

Gradient accumulation wants the normaliser of the WHOLE accumulated batch, so the loss is assembled in
two steps: `loss_sums` (additive over micro-batches) and `loss_from_sums`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


class LossWeights(NamedTuple):
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    decay_gamma: float = 4.0


def position_weights(block_size: int, decay_gamma: float) -> jax.Array:
    """w_k = exp(-k / gamma), k = 0..K-1."""
    return jnp.exp(-jnp.arange(block_size, dtype=F32) / decay_gamma)


# ---------------------------------------------------------------------------------------------------
# Per-slot vocabulary statistics: (logsumexp of the draft logits, ||p_d - p_t||_1)
# ---------------------------------------------------------------------------------------------------


def _dense_stats(d: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    d, t = d.astype(F32), t.astype(F32)
    lse_d = jax.nn.logsumexp(d, axis=-1)
    l1 = jnp.sum(jnp.abs(jnp.exp(d - lse_d[..., None]) - jax.nn.softmax(t, axis=-1)), axis=-1)
    return lse_d, l1


def _chunk_plan(vocab: int, chunk: int) -> list[tuple[int, int, int]]:
    """[(first chunk start, chunk width, number of chunks)]: the full chunks, then the tail if any."""
    n_full, tail = divmod(vocab, chunk)
    plan = [(0, chunk, n_full)] if n_full else []
    if tail:
        plan.append((n_full * chunk, tail, 1))
    return plan


def _scan_chunks(plan, body, carry):
    """Run body(carry, start, width) over every chunk of the plan (a lax.scan per distinct width)."""
    for first, width, count in plan:
        def step(c, i, first=first, width=width):
            return body(c, first + i * width, width), None
        carry, _ = lax.scan(step, carry, jnp.arange(count, dtype=jnp.int32))
    return carry


def _lse_pass(plan, chunk_fn, m: int, two: bool):
    """Online logsumexp over vocabulary chunks of one or two logit sources. chunk_fn(start, width) -> tuple."""
    init = tuple((jnp.full((m,), -jnp.inf, F32), jnp.zeros((m,), F32)) for _ in range(2 if two else 1))

    def body(carry, start, width):
        out = []
        for (mx, s), x in zip(carry, chunk_fn(start, width)):
            new = jnp.maximum(mx, jnp.max(x, axis=-1))
            s = s * jnp.exp(mx - new) + jnp.sum(jnp.exp(x - new[:, None]), axis=-1)
            out.append((new, s))
        return tuple(out)

    return tuple(mx + jnp.log(s) for mx, s in _scan_chunks(plan, body, init))


def _l1_pass(plan, chunk_fn, lse_d, lse_t):
    """-> (l1, S_d = sum p_d sign(p_d - p_t), S_t = sum p_t sign(p_d - p_t)), all [M]."""
    zeros = jnp.zeros_like(lse_d)

    def body(carry, start, width):
        l1, s_d, s_t = carry
        d, t = chunk_fn(start, width)
        p_d, p_t = jnp.exp(d - lse_d[:, None]), jnp.exp(t - lse_t[:, None])
        sign = jnp.sign(p_d - p_t)
        return (l1 + jnp.sum(jnp.abs(p_d - p_t), axis=-1), s_d + jnp.sum(p_d * sign, axis=-1),
                s_t + jnp.sum(p_t * sign, axis=-1))

    return _scan_chunks(plan, body, (zeros, zeros, zeros))


def _chunk_grads(d, t, lse_d, lse_t, s_d, s_t, ct_lse, ct_l1):
    """Cotangents of one chunk's draft and target logits.

    d lse_d / d d = p_d;  d l1 / d d_j = p_d,j (sign_j - S_d);  d l1 / d t_j = -p_t,j (sign_j - S_t)."""
    p_d, p_t = jnp.exp(d - lse_d[:, None]), jnp.exp(t - lse_t[:, None])
    sign = jnp.sign(p_d - p_t)
    g_d = p_d * (ct_lse[:, None] + ct_l1[:, None] * (sign - s_d[:, None]))
    g_t = -ct_l1[:, None] * p_t * (sign - s_t[:, None])
    return g_d, g_t


def _slice(x, start, width):
    return lax.dynamic_slice_in_dim(x, start, width, axis=-1).astype(F32)


def _chunked_stats_fwd(d, t, chunk):
    plan = _chunk_plan(d.shape[-1], chunk)
    fn = lambda start, width: (_slice(d, start, width), _slice(t, start, width))  # noqa: E731
    lse_d, lse_t = _lse_pass(plan, fn, d.shape[0], two=True)
    l1, s_d, s_t = _l1_pass(plan, fn, lse_d, lse_t)
    return (lse_d, l1), (d, t, lse_d, lse_t, s_d, s_t)


def _chunked_stats_bwd(chunk, res, cts):
    d, t, lse_d, lse_t, s_d, s_t = res
    ct_lse, ct_l1 = cts
    plan = _chunk_plan(d.shape[-1], chunk)

    def body(carry, start, width):
        gd_all, gt_all = carry
        g_d, g_t = _chunk_grads(_slice(d, start, width), _slice(t, start, width), lse_d, lse_t, s_d, s_t,
                                ct_lse, ct_l1)
        return (lax.dynamic_update_slice_in_dim(gd_all, g_d.astype(d.dtype), start, axis=-1),
                lax.dynamic_update_slice_in_dim(gt_all, g_t.astype(t.dtype), start, axis=-1))

    g_d, g_t = _scan_chunks(plan, body, (jnp.zeros_like(d), jnp.zeros_like(t)))
    return g_d, g_t


_chunked_stats = jax.custom_vjp(lambda d, t, chunk: _chunked_stats_fwd(d, t, chunk)[0], nondiff_argnums=(2,))
_chunked_stats.defvjp(_chunked_stats_fwd, _chunked_stats_bwd)


def vocab_stats(draft_logits: jax.Array, target_logits: jax.Array, *, vocab_chunk: int | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """[..., V] logits -> (logsumexp of the draft logits, ||softmax(draft) - softmax(target)||_1), [...] f32.

    `vocab_chunk=None` (or >= V) computes densely; otherwise in chunks of that many vocabulary entries
    with the same value and gradient (to float rounding) and O(slots x chunk) temporaries."""
    lead, v = draft_logits.shape[:-1], draft_logits.shape[-1]
    if target_logits.shape != draft_logits.shape:
        raise ValueError(f"vocab_stats: draft logits {draft_logits.shape} and target logits "
                         f"{target_logits.shape} must have the same shape")
    if vocab_chunk is None or vocab_chunk >= v:
        return _dense_stats(draft_logits, target_logits)
    if vocab_chunk <= 0:
        raise ValueError(f"vocab_chunk: expected a positive integer or None, got {vocab_chunk}")
    lse, l1 = _chunked_stats(draft_logits.reshape(-1, v), target_logits.reshape(-1, v), int(vocab_chunk))
    return lse.reshape(lead), l1.reshape(lead)


# ---------------------------------------------------------------------------------------------------
# Fused: logits chunks are built from the hidden state and the head, never materialised whole
# ---------------------------------------------------------------------------------------------------


def _fused_chunk_fn(x, head, emb, w2, teacher, rows):
    def fn(start, width):
        hc = lax.dynamic_slice_in_dim(head, start, width, axis=0).astype(F32)
        d = jnp.einsum("md,vd->mv", x, hc, precision=HIGHEST)
        if w2 is not None:
            w2c = lax.dynamic_slice_in_dim(w2, start, width, axis=0).astype(F32)
            d = d + jnp.einsum("mr,vr->mv", emb.astype(F32), w2c, precision=HIGHEST)
        t = jnp.take(_slice(teacher, start, width), rows, axis=0)
        return d, t
    return fn


def _fused_fwd(x, head, emb, w2, teacher, rows, chunk):
    plan = _chunk_plan(head.shape[0], chunk)
    fn = _fused_chunk_fn(x, head, emb, w2, teacher, rows)
    lse_d, lse_t = _lse_pass(plan, fn, x.shape[0], two=True)
    l1, s_d, s_t = _l1_pass(plan, fn, lse_d, lse_t)
    return (lse_d, l1), (x, head, emb, w2, teacher, rows, lse_d, lse_t, s_d, s_t)


def _fused_bwd(chunk, res, cts):
    x, head, emb, w2, teacher, rows, lse_d, lse_t, s_d, s_t = res
    ct_lse, ct_l1 = cts
    plan = _chunk_plan(head.shape[0], chunk)
    fn = _fused_chunk_fn(x, head, emb, w2, teacher, rows)

    def body(carry, start, width):
        gx, gemb, gw2 = carry
        d, t = fn(start, width)
        g_d, _ = _chunk_grads(d, t, lse_d, lse_t, s_d, s_t, ct_lse, ct_l1)
        hc = lax.dynamic_slice_in_dim(head, start, width, axis=0).astype(F32)
        gx = gx + jnp.einsum("mv,vd->md", g_d, hc, precision=HIGHEST)
        if w2 is not None:
            w2c = lax.dynamic_slice_in_dim(w2, start, width, axis=0).astype(F32)
            gemb = gemb + jnp.einsum("mv,vr->mr", g_d, w2c, precision=HIGHEST)
            gw2_c = jnp.einsum("mv,mr->vr", g_d, emb.astype(F32), precision=HIGHEST)
            gw2 = lax.dynamic_update_slice_in_dim(gw2, gw2_c.astype(w2.dtype), start, axis=0)
        return gx, gemb, gw2

    init = (jnp.zeros(x.shape, F32), jnp.zeros(emb.shape, F32) if w2 is not None else None,
            jnp.zeros_like(w2) if w2 is not None else None)
    gx, gemb, gw2 = _scan_chunks(plan, body, init)
    # The tied head and the teacher are the frozen backbone's: constants by contract (zero cotangent).
    return (gx.astype(x.dtype), jnp.zeros_like(head), None if w2 is None else gemb.astype(emb.dtype), gw2,
            jnp.zeros_like(teacher), None)


_fused_stats = jax.custom_vjp(lambda x, head, emb, w2, teacher, rows, chunk:
                              _fused_fwd(x, head, emb, w2, teacher, rows, chunk)[0], nondiff_argnums=(6,))
_fused_stats.defvjp(_fused_fwd, _fused_bwd)


def fused_vocab_stats(x: jax.Array, head: jax.Array, markov_emb: jax.Array | None, markov_head: jax.Array | None,
                      teacher_logits: jax.Array, teacher_rows: jax.Array, *, vocab_chunk: int
                      ) -> tuple[jax.Array, jax.Array]:
    """`vocab_stats` of draft logits `x @ head^T + markov_emb @ markov_head^T` against
    `teacher_logits[teacher_rows]`, built one vocabulary chunk at a time.

    x f32[M, D] (final-normed draft hidden), head [V, D] (tied LM head), markov_emb [M, r] (the Markov
    head's z: W1[prev] for the vanilla head, `drafts.markov` for the gated / recurrent ones) and
    markov_head [V, r] (W2^T as stored) or both None, teacher_logits [S, V] (backbone logits rows),
    teacher_rows i32[M]. -> (lse_d f32[M], l1 f32[M]).
    Gradients flow to x, markov_emb and markov_head. `head` and `teacher_logits` are the frozen
    backbone's and are treated as constants: their cotangents are zero by contract.
    """
    if (markov_emb is None) != (markov_head is None):
        raise ValueError("fused_vocab_stats: pass both markov_emb and markov_head, or neither")
    if head.shape[0] != teacher_logits.shape[-1]:
        raise ValueError(f"fused_vocab_stats: head has {head.shape[0]} rows but the teacher logits have "
                         f"vocabulary {teacher_logits.shape[-1]}")
    chunk = int(min(vocab_chunk, head.shape[0]))
    if chunk <= 0:
        raise ValueError(f"vocab_chunk: expected a positive integer, got {vocab_chunk}")
    return _fused_stats(x.astype(F32), head, markov_emb, markov_head, teacher_logits,
                        teacher_rows.astype(jnp.int32), chunk)


# ---------------------------------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------------------------------


def loss_sums(ce: jax.Array, l1: jax.Array, conf_logits: jax.Array, mask: jax.Array, *, decay_gamma: float = 4.0
              ) -> dict[str, jax.Array]:
    """Additive (over blocks and micro-batches) sums of the per-slot terms, each [N, K] -> scalar or [K]."""
    mask = mask.astype(bool)
    w = jnp.where(mask, position_weights(mask.shape[-1], decay_gamma), 0.0)
    acc = jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0)  # rounding can leave [0, 1]; DeepSpec clamps the same way
    z = conf_logits.astype(F32)
    target = lax.stop_gradient(acc)
    bce = jax.nn.softplus(z) - target * z  # BCE(sigmoid(z), target), stable form
    lead = tuple(range(mask.ndim - 1))
    m = mask.astype(F32)
    return {
        "weight": jnp.sum(w),
        "ce": jnp.sum(jnp.where(mask, w * ce, 0.0)),
        "l1": jnp.sum(jnp.where(mask, w * l1, 0.0)),
        "conf": jnp.sum(jnp.where(mask, w * bce, 0.0)),
        "slots_k": jnp.sum(m, axis=lead),
        "accept_k": jnp.sum(jnp.where(mask, acc, 0.0), axis=lead),
        "conf_prob": jnp.sum(jnp.where(mask, jax.nn.sigmoid(z), 0.0)),
    }


def loss_from_sums(sums: dict[str, jax.Array], weights: LossWeights = LossWeights(),
                   normalizer: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """-> (loss, metrics). `normalizer` defaults to sum(w) + 1e-6 of these very sums."""
    denom = sums["weight"] + 1e-6 if normalizer is None else normalizer
    ce, l1, conf = sums["ce"] / denom, sums["l1"] / denom, sums["conf"] / denom
    loss = weights.ce_weight * ce + weights.l1_weight * l1 + weights.conf_weight * conf
    metrics = {"loss": loss, "ce": ce, "l1": l1, "conf": conf}
    metrics.update(acceptance_metrics(sums))
    return loss, metrics


def acceptance_metrics(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """accept_rate [K] (mean of 1 - 0.5 l1 per position), tau_estimate = 1 + sum_k prod_{i<=k} acc_i,
    conf_bias = mean sigmoid(z) - mean acceptance target (over all supervised slots)."""
    slots = sums["slots_k"]
    accept = sums["accept_k"] / jnp.maximum(slots, 1.0)
    total = jnp.maximum(jnp.sum(slots), 1.0)
    return {
        "accept_rate": accept,
        "tau_estimate": 1.0 + jnp.sum(jnp.cumprod(accept)),
        "conf_bias": (sums["conf_prob"] - jnp.sum(sums["accept_k"])) / total,
        "supervised_slots": jnp.sum(slots),
    }


def dspark_loss(draft_logits: jax.Array, target_logits: jax.Array, labels: jax.Array, conf_logits: jax.Array,
                mask: jax.Array, *, ce_weight: float = 0.1, l1_weight: float = 0.9, conf_weight: float = 1.0,
                decay_gamma: float = 4.0, vocab_chunk: int | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DSpark loss on materialised logits (the reference contract, ARCHITECTURE.md).

    draft_logits f32[N, K, V] (Markov-biased, teacher-forced), target_logits f32[N, K, V] (backbone logits
    at the same positions, T = 1), labels i32[N, K], conf_logits f32[N, K], mask bool[N, K] (supervised
    slots). -> (loss f32[], metrics: loss, ce, l1, conf, accept_rate [K], tau_estimate, conf_bias,
    supervised_slots). The confidence inputs' detachment is the caller's (it happens where z is made)."""
    if labels.shape != draft_logits.shape[:-1] or conf_logits.shape != labels.shape or mask.shape != labels.shape:
        raise ValueError(f"dspark_loss: labels {labels.shape}, conf_logits {conf_logits.shape} and mask "
                         f"{mask.shape} must all be the logits' leading shape {draft_logits.shape[:-1]}")
    lse, l1 = vocab_stats(draft_logits, target_logits, vocab_chunk=vocab_chunk)
    label_logit = jnp.take_along_axis(draft_logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ce = lse - label_logit.astype(F32)
    sums = loss_sums(ce, l1, conf_logits, mask, decay_gamma=decay_gamma)
    return loss_from_sums(sums, LossWeights(ce_weight, l1_weight, conf_weight, decay_gamma))
