"""The DeepSpec confidence head (dspark_jax.drafts.deepspec.heads) against plain numpy."""

import jax.numpy as jnp
import numpy as np
from helpers.deepspec import CFG, K, our_params, random_hf_weights

from dspark_jax.drafts.deepspec.heads import confidence_logits


def test_confidence_head_has_a_bias_and_reads_normed_h_and_w1_prev():
    params = our_params(random_hf_weights(CFG, seed=2))
    rng = np.random.default_rng(2)
    normed, emb = rng.normal(size=(3, K, CFG.dim)), rng.normal(size=(3, K, CFG.markov_rank))
    z = confidence_logits(params, CFG, jnp.asarray(normed, jnp.float32), jnp.asarray(emb, jnp.float32))
    w = np.asarray(params["confidence"]["kernel"])
    np.testing.assert_allclose(z, np.concatenate([normed, emb], -1) @ w + float(params["confidence"]["bias"][0]),
                               rtol=1e-5, atol=1e-5)
    cfg2 = CFG.replace(confidence_head_with_markov=False)
    p2 = {**params, "confidence": {"kernel": params["confidence"]["kernel"][:CFG.dim], "bias": params["confidence"]["bias"]}}
    np.testing.assert_allclose(confidence_logits(p2, cfg2, jnp.asarray(normed, jnp.float32), None),
                               normed @ w[:CFG.dim] + float(params["confidence"]["bias"][0]), rtol=1e-5, atol=1e-5)
