"""The DeepSpec draft's teacher-forced training forward (SPEC 8 with DeepSpec's attention pattern).

Each block attends to the context of EVERY position strictly before its anchor (no window) and to its
own K slots bidirectionally: exactly what the inference draft sees after committing 0..anchor-1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.drafts.base import DraftActs
from dspark_jax.drafts.markov import draft_block_latents
from dspark_jax.drafts.deepspec.config import DeepSpecConfig
from dspark_jax.drafts.deepspec.heads import confidence_logits
from dspark_jax.drafts.deepspec.model import context_kv, draft_body
from dspark_jax.nn.norm import rms_norm
from dspark_jax.train.anchors import Blocks


def train_forward(params: dict, tied: dict, cfg: DeepSpecConfig, main_hidden: jax.Array, blocks: Blocks,
                  anchors: jax.Array, *, detach_conf_inputs: bool = False, impl: str = "xla",
                  fp8_grad: str = "exact") -> DraftActs:
    """main_hidden [B, T, n_taps*D] (taps of every position), blocks from `train.anchors.make_blocks`,
    anchors i32[B, N] -> DraftActs of the B*N blocks. `impl` and `fp8_grad` are part of the family
    interface; this family has no kernel and no fp8 rounding."""
    del impl, fp8_grad
    b, t, _ = main_hidden.shape
    n, kk = blocks.inputs.shape[1:]
    cd = jnp.dtype(cfg.compute_dtype)
    seq_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    k_ctx, v_ctx = context_kv(params, cfg, main_hidden.astype(cd), seq_pos)
    visible = jnp.arange(t, dtype=jnp.int32)[None, None, :] < anchors.astype(jnp.int32)[:, :, None]
    x = jnp.take(tied["embed"], blocks.inputs, axis=0).astype(cd)  # [B, N, K, D]
    h = draft_body(params, cfg, x, blocks.positions, k_ctx, v_ctx, visible).reshape(b * n, kk, -1)
    normed = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps)
    emb, latent = draft_block_latents(cfg, params, blocks.prev.reshape(b * n, kk), normed)
    n_c = jax.lax.stop_gradient(normed) if detach_conf_inputs else normed
    e_c = None if emb is None else (jax.lax.stop_gradient(emb) if detach_conf_inputs else emb)
    conf = confidence_logits(params, cfg, n_c, e_c)
    return DraftActs(h, normed.astype(jnp.float32), emb, latent, conf)
