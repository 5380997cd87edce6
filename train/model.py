"""The draft's teacher-forced training forward (SPEC 8) on top of `dspark_jax.draft`.

    acts = draft_forward(params, tied, cfg, main_hidden, blocks, anchors)
    loss sums from acts (fused head, see `block_loss_sums`) or materialised logits (`draft_logits`)

Per sequence the backbone features of all T positions go through `DSparkDraft.context_rows` once; each
anchor then gets the ring the inference draft would hold at that anchor (`anchors.anchor_rings`), and
`DSparkDraft.body` runs on all B*N blocks at once. Markov head teacher-forced: prev = [anchor, labels];
confidence z_k = w . [h_k ; W1[prev_k]] (pre-norm h, as in inference), optionally with h and W1[prev]
detached (`detach_conf_inputs`).

fp8 gradients. The V4.1 draft rounds every KV row to fp8 (`kv_fp8`, and activations with `act_fp8`);
`fp8_grad="straight_through"` (what the trainer passes by default) keeps those forward values and passes
gradients straight through the rounding (`dspark_jax.nn.quant`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.config import DSparkConfig
from dspark_jax.draft import DSparkDraft, base_logits, confidence_logits
from dspark_jax.nn.norm import rms_norm
from dspark_jax.train.anchors import Blocks, anchor_rings
from dspark_jax.train.loss import fused_vocab_stats, loss_sums, vocab_stats

# ---------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------


class DraftActs(NamedTuple):
    hidden: jax.Array  # [B*N, K, D] collapsed pre-norm h
    normed: jax.Array  # f32[B*N, K, D] RMSNorm_final(h), the LM head's input
    markov_emb: jax.Array | None  # [B*N, K, r] W1[prev] (None without a Markov head)
    conf_logits: jax.Array  # f32[B*N, K]


def draft_forward(params: dict, tied: dict, cfg: DSparkConfig, main_hidden: jax.Array, blocks: Blocks,
                  anchors: jax.Array, *, detach_conf_inputs: bool = False, impl: str = "xla",
                  fp8_grad: str = "exact") -> DraftActs:
    """main_hidden [B, T, n_taps*D] (backbone taps of every position), blocks from `make_blocks`,
    anchors i32[B, N] -> DraftActs for the B*N blocks (flattened row-major). `fp8_grad`: how gradients
    cross the fp8 roundings (`nn.quant`; the DeepSpec family has none)."""
    if cfg.family == "qwen3":  # DeepSpec drafts: full context strictly before each anchor (no ring)
        from dspark_jax import deepspec  # noqa: PLC0415

        return DraftActs(*deepspec.train_forward(params, tied, cfg, main_hidden, blocks, anchors,
                                                 detach_conf_inputs=detach_conf_inputs))
    b, t, _ = main_hidden.shape
    n, k = blocks.inputs.shape[1:]
    cd = jnp.dtype(cfg.compute_dtype)
    model = DSparkDraft(cfg, impl, fp8_grad)
    seq_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rows = model.apply({"params": params}, main_hidden.astype(cd), seq_pos, method=DSparkDraft.context_rows)
    ring, ring_len = anchor_rings(rows.astype(cd), anchors, cfg.window)
    embeds = jnp.take(tied["embed"], blocks.inputs.reshape(b * n, k), axis=0).astype(cd)
    h = model.apply({"params": params}, embeds, blocks.positions.reshape(b * n, k), ring, ring_len,
                    method=DSparkDraft.body)
    normed = rms_norm(h, params["norm"]["scale"], cfg.norm_eps).astype(jnp.float32)  # as base_logits
    prev = blocks.prev.reshape(b * n, k)
    emb = jnp.take(params["markov"]["embed"], prev, axis=0) if cfg.markov_rank else None
    h_c = jax.lax.stop_gradient(h) if detach_conf_inputs else h
    emb_c = jnp.zeros((b * n, k, 0), jnp.float32) if emb is None else emb
    emb_c = jax.lax.stop_gradient(emb_c) if detach_conf_inputs else emb_c
    conf = confidence_logits(h_c, emb_c, params["confidence"]["kernel"])
    return DraftActs(h, normed, emb, conf)


def draft_logits(params: dict, tied: dict, cfg: DSparkConfig, acts: DraftActs) -> jax.Array:
    """Materialised teacher-forced draft logits f32[B*N, K, V] = U + W1[prev] @ W2^T (the reference path)."""
    u = base_logits(acts.hidden, params["norm"]["scale"], tied["head"], cfg)
    if acts.markov_emb is None:
        return u
    return u + jnp.einsum("mkr,vr->mkv", acts.markov_emb.astype(jnp.float32),
                          params["markov"]["head"].astype(jnp.float32), precision="highest")


def gather_teacher(teacher_logits: jax.Array, blocks: Blocks) -> jax.Array:
    """Backbone logits [B, T, V] -> the teacher of every slot, f32[B*N, K, V]."""
    b, n, k = blocks.teacher_pos.shape
    idx = blocks.teacher_pos.reshape(b, n * k, 1)
    return jnp.take_along_axis(teacher_logits, idx, axis=1).reshape(b * n, k, -1).astype(jnp.float32)


def block_loss_sums(params: dict, tied: dict, cfg: DSparkConfig, acts: DraftActs, teacher_logits: jax.Array,
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
        emb = None if acts.markov_emb is None else acts.markov_emb.reshape(m, -1)
        w2 = None if acts.markov_emb is None else params["markov"]["head"]
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
