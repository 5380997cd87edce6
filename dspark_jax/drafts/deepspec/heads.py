"""The DeepSpec draft's confidence head (SPEC 4): it reads the POST-norm hidden (the LM head's input)
and W1[x_{k-1}] (when `confidence_head_with_markov`), WITH a bias; zeros when the head is disabled."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.drafts.deepspec.config import DeepSpecConfig


def confidence_logits(params: dict, cfg: DeepSpecConfig, normed: jax.Array, markov_emb: jax.Array | None
                      ) -> jax.Array:
    """z_k = w . [h_final_k ; W1[x_{k-1}]] + b in f32 (post-norm h, WITH a bias); zeros without the head."""
    if not cfg.enable_confidence_head:
        return jnp.zeros(normed.shape[:-1], jnp.float32)
    feats = normed.astype(jnp.float32)
    if cfg.confidence_head_with_markov:
        feats = jnp.concatenate([feats, markov_emb.astype(jnp.float32)], axis=-1)
    conf = params["confidence"]
    z = jnp.einsum("...i,i->...", feats, conf["kernel"].astype(jnp.float32), precision="highest")
    return z + conf["bias"].astype(jnp.float32)[0]
