"""The Markov head's sequential sampling loop (SPEC 2.7).

For k = 1..K: logits_k = U_k + W1[x_{k-1}] @ W2^T (x_0 = the anchor), x_k ~ softmax(process(logits_k)).
The bias is f32. Returned logits are the biased logits BEFORE temperature; verification applies the
same processing to them. With markov_rank 0 (a pure parallel draft) every position samples from U_k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax import sampling
from dspark_jax.kernels.markov_sampler import markov_sample


def markov_bias(prev: jax.Array, w1: jax.Array, w2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """prev i32[B] -> (bias f32[B, V] = W1[prev] @ W2^T, embedding W1[prev] [B, r])."""
    emb = jnp.take(w1, prev, axis=0)
    bias = jnp.einsum("br,vr->bv", emb.astype(jnp.float32), w2.astype(jnp.float32), precision="highest")
    return bias, emb


def draft_noise(seeds: jax.Array, first_position: jax.Array, block: int, vocab: int) -> jax.Array:
    """The Gumbel noise of draft tokens 1..K, f32[B, K, V] (keys (seed, first_position + k - 1, DRAFT))."""
    first_position = jnp.asarray(first_position)
    positions = first_position[:, None] + jnp.arange(block, dtype=first_position.dtype)[None, :]
    return sampling.gumbel(jnp.broadcast_to(seeds[:, None], positions.shape), positions, sampling.Stream.DRAFT,
                           vocab)


def markov_sample_loop(base: jax.Array, anchor: jax.Array, w1: jax.Array | None, w2: jax.Array | None,
                       params: sampling.SamplingParams, seeds: jax.Array, first_position: jax.Array, *,
                       impl: str = "auto", filtering: bool = True):
    """-> (tokens i32[B, K], biased logits f32[B, K, V], Markov embeddings [B, K, r])."""
    b, k, v = base.shape
    if w1 is None:
        tokens = jnp.stack([sampling.sample(base[:, i], params, seeds, first_position + i, sampling.Stream.DRAFT)
                            for i in range(k)], axis=1)
        return tokens, base, jnp.zeros((b, k, 0), base.dtype)
    if not filtering:
        # Temperature-only sampling: the fused sampler (Pallas on TPU) draws with the same noise. Greedy
        # rows ignore their noise, so a batch of greedy rows alone draws none.
        noise = jax.lax.cond(jnp.all(params.temperature <= 0.0), lambda: jnp.zeros((b, k, v), jnp.float32),
                             lambda: draft_noise(seeds, first_position, k, v))
        tokens, _, emb, logits = markov_sample(base, anchor, w1, w2, params.temperature, noise,
                                               return_logits=True, impl=impl)
        return tokens, logits, emb

    def step(prev, inputs):
        base_k, offset = inputs
        bias, emb = markov_bias(prev, w1, w2)
        logits = base_k + bias
        token = sampling.sample(logits, params, seeds, first_position + offset, sampling.Stream.DRAFT)
        return token, (token, logits, emb)

    _, (tokens, logits, emb) = jax.lax.scan(step, anchor.astype(jnp.int32),
                                            (jnp.swapaxes(base, 0, 1), jnp.arange(k, dtype=jnp.int32)))
    return jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(logits, 0, 1), jnp.swapaxes(emb, 0, 1)
