"""Per-request sampling: parameters, the ONE logits-processing function, and keyed randomness.

Every random number in a speculative round is drawn from a counter-based key of
(request seed, absolute position, stream). Distinct streams keep the draft's sampling noise, the
acceptance uniforms and the correction/bonus draw independent: sharing the draft stream with the
correction draw biases the output (a real bug in a public engine). Because keys depend only on the
request's own seed and position, a request's output does not depend on its batch or on padding.

Positions: the token that will sit at absolute position `pos` is drawn with key (seed, pos, stream).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Stream(enum.IntEnum):
    DRAFT = 0  # Gumbel noise of the draft's Markov sampler
    ACCEPT = 1  # acceptance uniforms u_k < p/q
    RESAMPLE = 2  # the correction (after a rejection) or bonus (after full acceptance) draw


class SamplingParams(NamedTuple):
    """Per-request sampling settings (a pytree of [R] arrays). temperature 0 = greedy;
    top_k 0 = off; top_p 1 = off."""

    temperature: jax.Array  # f32[R]
    top_k: jax.Array  # i32[R]
    top_p: jax.Array  # f32[R]

    @classmethod
    def make(cls, batch: int, temperature=1.0, top_k=0, top_p=1.0) -> "SamplingParams":
        """Host-side constructor with validation; scalars broadcast to [batch]."""
        t = np.broadcast_to(np.asarray(temperature, np.float32), (batch,))
        k = np.broadcast_to(np.asarray(top_k, np.int32), (batch,))
        p = np.broadcast_to(np.asarray(top_p, np.float32), (batch,))
        validate(t, k, p)
        return cls(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p))

    @classmethod
    def greedy(cls, batch: int) -> "SamplingParams":
        return cls.make(batch, temperature=0.0)


def validate(temperature, top_k, top_p) -> None:
    """Raise ValueError naming the first bad field (host-side; never inside jit)."""
    t, k, p = (np.asarray(x) for x in (temperature, top_k, top_p))
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"sampling param 'temperature': expected a finite number >= 0, got {t.tolist()}")
    if np.any(k < 0):
        raise ValueError(f"sampling param 'top_k': expected an integer >= 0 (0 = off), got {k.tolist()}")
    if not np.all(np.isfinite(p)) or np.any(p <= 0) or np.any(p > 1):
        raise ValueError(f"sampling param 'top_p': expected a number in (0, 1] (1 = off), got {p.tolist()}")


def _bcast(x: jax.Array, like: jax.Array) -> jax.Array:
    """Broadcast a per-request [R] value against logits [R, ..., V]."""
    return x.reshape(x.shape + (1,) * (like.ndim - x.ndim))


def process_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p, on logits [R, ..., V]; returns f32 logits whose softmax
    is the sampling distribution. Filtered entries are -inf. Greedy rows (T = 0) come back as a
    one-hot-able mask: only their (first) argmax stays finite.

    This is the single definition of "the distribution a request samples from": the draft samples
    from softmax(process_logits(draft_logits)) and verification compares exactly these p and q.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    t = _bcast(params.temperature.astype(jnp.float32), logits)
    greedy = t <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, t)

    # top-k: keep entries >= the k-th largest value (k = 0 means off).
    k = _bcast(params.top_k.astype(jnp.int32), logits)
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(sorted_desc, jnp.clip(k - 1, 0, vocab - 1), axis=-1)
    keep = jnp.where(k > 0, scaled >= kth, True)
    scaled = jnp.where(keep, scaled, -jnp.inf)

    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p
    # (an entry is kept if the mass strictly before it is < p; the top entry is always kept).
    p = _bcast(params.top_p.astype(jnp.float32), logits)
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    kept_sorted = mass_before < p
    # threshold = smallest kept logit; ties at the threshold are all kept
    threshold = jnp.min(jnp.where(kept_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where((p < 1.0) & (scaled < threshold), -jnp.inf, scaled)

    # greedy: a single finite entry at the first argmax of the raw logits
    top = jnp.argmax(logits, axis=-1)[..., None]
    is_top = jnp.arange(vocab) == top
    return jnp.where(greedy, jnp.where(is_top, 0.0, -jnp.inf), scaled)


def probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The sampling distribution, f32[R, ..., V] (one-hot for greedy rows)."""
    return jax.nn.softmax(process_logits(logits, params), axis=-1)


def request_keys(seeds: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """One PRNG key per request from (seed, absolute position, stream)."""

    def one(seed, pos):
        key = jax.random.key(seed.astype(jnp.uint32))
        key = jax.random.fold_in(key, pos.astype(jnp.uint32))
        return jax.random.fold_in(key, jnp.uint32(int(stream)))

    return jax.vmap(one)(jnp.asarray(seeds), jnp.asarray(positions))


def uniform(seeds: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """f32[R] uniforms in [0, 1)."""
    keys = request_keys(seeds, positions, stream)
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)


def gumbel(seeds: jax.Array, positions: jax.Array, stream: int, vocab: int) -> jax.Array:
    """f32[R, V] standard Gumbel noise; argmax(logits + noise) samples softmax(logits)."""
    keys = request_keys(seeds, positions, stream)
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def sample(logits: jax.Array, params: SamplingParams, seeds: jax.Array, positions: jax.Array,
           stream: int) -> jax.Array:
    """Draw one token per request from softmax(process_logits(logits)), logits [R, V] -> i32[R].

    Gumbel-max with keyed noise: token = argmax(processed + g). For greedy rows the processed logits
    have a single finite entry, so the noise cannot move the argmax.
    """
    processed = process_logits(logits, params)
    noise = gumbel(seeds, positions, stream, logits.shape[-1])
    return jnp.argmax(processed + noise, axis=-1).astype(jnp.int32)
