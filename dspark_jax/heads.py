"""Deprecated: the Markov head (every head type) lives in `dspark_jax.drafts.markov`. These names stay for
one release; `markov_sample_loop` is the vanilla head's `drafts.markov.sample_block`."""

from __future__ import annotations

import warnings

import jax

from dspark_jax import sampling
from dspark_jax.drafts.markov import draft_noise, sample_block  # noqa: F401

warnings.warn("dspark_jax.heads is deprecated: use dspark_jax.drafts.markov", DeprecationWarning, stacklevel=2)


def markov_sample_loop(base: jax.Array, anchor: jax.Array, w1: jax.Array | None, w2: jax.Array | None,
                       params: sampling.SamplingParams, seeds: jax.Array, first_position: jax.Array, *,
                       impl: str = "auto", filtering: bool = True):
    """The vanilla head's block: -> (tokens i32[B, K], biased logits f32[B, K, V], W1[prev] [B, K, r])."""
    markov = None if w1 is None else {"embed": w1, "head": w2}
    return sample_block("vanilla", markov, base, anchor, None, params, seeds, first_position, impl=impl,
                        filtering=filtering)
