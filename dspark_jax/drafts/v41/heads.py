"""The V4.1 draft's confidence head (SPEC 2.7); its weights are `drafts.base.ConfidenceWeights` (no bias)
and its Markov weights `drafts.markov.MarkovWeights`.

The confidence head reads the PRE-norm collapsed hidden h_k and the Markov embedding W1[x_{k-1}], has
no bias, and returns the logit (the sigmoid and the STS temperatures are applied outside; they are not
in the checkpoint). The Markov loop itself is shared by the families (`dspark_jax.drafts.markov`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def confidence_logits(params: dict, cfg, hidden: jax.Array, markov_emb: jax.Array) -> jax.Array:
    """z_k = w . [h_k ; W1[x_{k-1}]] in f32, no bias. hidden [..., K, D] is the PRE-norm h; markov_emb
    [..., K, r] (r = 0 for a draft without a Markov head)."""
    feats = jnp.concatenate([hidden.astype(jnp.float32), markov_emb.astype(jnp.float32)], axis=-1)
    w = params["confidence"]["kernel"].astype(jnp.float32)
    return jnp.einsum("...i,i->...", feats, w, precision="highest")
