"""The V4.1 draft's teacher-forced training forward (SPEC 8).

Per sequence the backbone features of all T positions go through `DSparkDraft.context_rows` once; each
anchor then gets the ring the inference draft would hold at that anchor (`train.anchors.anchor_rings`:
the context rows of the last W positions before it), and `DSparkDraft.body` runs on all B*N blocks at
once. Markov head teacher-forced: prev = [anchor, labels]; confidence z_k = w . [h_k ; W1[prev_k]]
(pre-norm h, as in inference), optionally with h and W1[prev] detached (`detach_conf_inputs`).

fp8 gradients: the draft rounds every KV row to fp8 (`kv_fp8`, and activations with `act_fp8`);
`fp8_grad="straight_through"` keeps those forward values and passes gradients straight through the
rounding (`dspark_jax.nn.quant`), which the trainer asks for by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.drafts.base import DraftActs
from dspark_jax.drafts.markov import draft_block_latents
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.drafts.v41.heads import confidence_logits
from dspark_jax.drafts.v41.model import DSparkDraft
from dspark_jax.nn.norm import rms_norm
from dspark_jax.nn.rows import take_rows
from dspark_jax.train.anchors import Blocks, anchor_rings


def train_forward(params: dict, tied: dict, cfg: DSparkConfig, main_hidden: jax.Array, blocks: Blocks,
                  anchors: jax.Array, *, detach_conf_inputs: bool = False, impl: str = "xla",
                  fp8_grad: str = "exact") -> DraftActs:
    """main_hidden [B, T, n_taps*D] (backbone taps of every position), blocks from `make_blocks`,
    anchors i32[B, N] -> DraftActs for the B*N blocks (flattened row-major)."""
    b, t, _ = main_hidden.shape
    n, k = blocks.inputs.shape[1:]
    cd = jnp.dtype(cfg.compute_dtype)
    model = DSparkDraft(cfg, impl, fp8_grad)
    seq_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rows = model.apply({"params": params}, main_hidden.astype(cd), seq_pos, method=DSparkDraft.context_rows)
    ring, ring_len = anchor_rings(rows.astype(cd), anchors, cfg.window)
    embeds = take_rows(tied["embed"], blocks.inputs.reshape(b * n, k)).astype(cd)
    h = model.apply({"params": params}, embeds, blocks.positions.reshape(b * n, k), ring, ring_len,
                    method=DSparkDraft.body)
    normed = rms_norm(h, params["norm"]["scale"], cfg.norm_eps)  # as base_logits
    emb, latent = draft_block_latents(cfg, params, blocks.prev.reshape(b * n, k), normed)
    h_c = jax.lax.stop_gradient(h) if detach_conf_inputs else h
    emb_c = jnp.zeros((b * n, k, 0), jnp.float32) if emb is None else emb
    emb_c = jax.lax.stop_gradient(emb_c) if detach_conf_inputs else emb_c
    conf = confidence_logits(params, cfg, h_c, emb_c)
    return DraftActs(h, normed.astype(jnp.float32), emb, latent, conf)
