"""Per-request sampling: parameters, the ONE logits-processing function, and keyed randomness.

Every random number in a speculative round is drawn from a counter-based key of
(request seed, absolute position, stream). Distinct streams keep the draft's sampling noise, the
acceptance uniforms and the correction/bonus draw independent: sharing the draft stream with the
correction draw biases the output (a real bug in a public engine). Because keys depend only on the
request's own seed and position, a request's output does not depend on its batch or on padding.

Positions: the token that will sit at absolute position `pos` is drawn with key (seed, pos, stream).

Two couplings of draft and target, chosen per request (`SamplingParams.invariant`):
  optimal   (default): the draft samples with its own stream; verify accepts with u < p/q and resamples
            from the residual. Acceptance 1 - TV(p, q), the most any coupling gets; lossless in
            distribution, but WHICH tokens a seed gives depends on what was drafted and verified.
  invariant: the draft samples with the target's noise, (seed, pos, RESAMPLE), the key plain decoding
            draws position pos with; verify accepts a draft iff it equals the target's own Gumbel-argmax
            and emits that argmax at the first mismatch (Daliri, Musco, Suresh 2024). Every emitted
            token is what plain decoding with the same seed emits, whatever the draft, scheduler or batch
            did; acceptance falls to at least (1 - TV) / (1 + TV).
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


COUPLINGS = ("optimal", "invariant")


class SamplingParams(NamedTuple):
    """Per-request sampling settings (a pytree of [R] arrays). temperature 0 = greedy;
    top_k 0 = off; top_p 1 = off; invariant: the drafter-invariant coupling (module docstring)."""

    temperature: jax.Array  # f32[R]
    top_k: jax.Array  # i32[R]
    top_p: jax.Array  # f32[R]
    invariant: jax.Array  # bool[R]

    @classmethod
    def make(cls, batch: int, temperature=1.0, top_k=0, top_p=1.0, invariant=False) -> "SamplingParams":
        """Host-side constructor with validation; scalars broadcast to [batch]."""
        t = np.broadcast_to(np.asarray(temperature, np.float32), (batch,))
        k = np.broadcast_to(np.asarray(top_k, np.int32), (batch,))
        p = np.broadcast_to(np.asarray(top_p, np.float32), (batch,))
        validate(t, k, p)
        inv = np.broadcast_to(np.asarray(invariant, bool), (batch,))
        return cls(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p), jnp.asarray(inv))

    @classmethod
    def greedy(cls, batch: int) -> "SamplingParams":
        return cls.make(batch, temperature=0.0)


def coupling_flag(coupling: str) -> bool:
    """The `invariant` flag of a coupling name ("optimal" / "invariant"); ValueError names a bad one."""
    if coupling not in COUPLINGS:
        raise ValueError(f"coupling: expected one of {COUPLINGS}, got {coupling!r}")
    return coupling == "invariant"


def draft_stream(params: SamplingParams) -> jax.Array:
    """u32[R]: the stream each row's draft samples with: its own (DRAFT) under the optimal coupling, the
    target's (RESAMPLE, plain decoding's) under the invariant one."""
    return jnp.where(params.invariant, jnp.uint32(Stream.RESAMPLE), jnp.uint32(Stream.DRAFT))


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


# How many top entries per row the fast path of process_logits looks at. Sorting a whole 129280-entry
# row is what makes nucleus filtering expensive (XLA's CPU sort: ~30 ms a row, so ~20 s for the
# R=64, K=5 verify batch), while a partial top-k of 1024 costs ~0.7 ms a row. The kept set of
# top-k <= 1024 and of nucleus sampling on real LM distributions almost always lies inside these
# candidates; when it does not for some row, a full sort decides that row, exactly.
_CANDIDATES = 1024


def process_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p, on logits [R, ..., V]; returns f32 logits whose softmax
    is the sampling distribution. Filtered entries are -inf. Greedy rows (T = 0) come back as a
    one-hot-able mask: only their (first) argmax stays finite, and top-k / top-p do not apply.

    This is the single definition of "the distribution a request samples from": the draft samples
    from softmax(process_logits(draft_logits)) and verification compares exactly these p and q.

    Rules (ties are resolved by value, so the result never depends on the order of equal logits):
      top-k: keep every entry >= the k-th largest value (ties at the k-th value are all kept);
             k = 0 or k >= V is off.
      top-p: in descending order, keep an entry if the mass strictly before it is < p (so the top
             entry is always kept, and the kept set is the smallest prefix whose mass reaches p);
             every entry equal to the smallest kept value is kept too. The mass is measured after
             top-k. p = 1 is off.
    Cost: rows whose kept set lies within the top 1024 entries need only a partial top-k; if any
    row needs more, a full sort runs for the batch (under vmap both paths run, which is slower but
    gives the same numbers). Each row's result is the same either way, bit for bit, so a request
    never depends on its batch.
    """
    return _process_logits(logits, params, candidates=_CANDIDATES)


def _process_logits(logits: jax.Array, params: SamplingParams, *, candidates: int) -> jax.Array:
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    t = _bcast(params.temperature.astype(jnp.float32), logits)
    greedy = t <= 0.0
    # Shift each row's max to 0 before dividing: with a tiny temperature max/T overflows to +inf and
    # softmax turns inf - inf into NaN. Softmax and argmax are unchanged by the shift.
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    scaled = shifted / jnp.where(greedy, 1.0, t)

    k = _bcast(params.top_k.astype(jnp.int32), logits)
    k = jnp.where(greedy | (k >= vocab), 0, k)  # 0 = off
    p = jnp.where(greedy, 1.0, _bcast(params.top_p.astype(jnp.float32), logits))
    active = (k > 0) | (p < 1.0)
    filtered = jax.lax.cond(
        jnp.any(active),
        lambda: _filter_top_k_top_p(scaled, k, p, min(candidates, vocab)),
        lambda: scaled,
    )

    def greedy_rows():  # a single finite entry at the first argmax of the raw logits
        is_top = jnp.arange(vocab) == jnp.argmax(logits, axis=-1)[..., None]
        return jnp.where(greedy, jnp.where(is_top, 0.0, -jnp.inf), filtered)

    # argmax over a 129280-entry row costs as much as a logsumexp on CPU: skip it without greedy rows
    return jax.lax.cond(jnp.any(greedy), greedy_rows, lambda: filtered)


def _filter_top_k_top_p(scaled: jax.Array, k: jax.Array, p: jax.Array, candidates: int) -> jax.Array:
    """Apply top-k (k > 0) and top-p (p < 1) to scaled logits [..., V]; k, p are [..., 1]."""
    vocab = scaled.shape[-1]
    # Fast path on the top `candidates` values (descending, equal to the sorted row's prefix).
    cand = jax.lax.top_k(scaled, candidates)[0]
    kth_c = jnp.take_along_axis(cand, jnp.clip(k - 1, 0, candidates - 1), axis=-1)
    thr_c, resolved = _top_p_threshold(scaled, cand, kth_c, k, p, whole_row=candidates == vocab)
    fits = (k <= candidates) & ((p >= 1.0) | resolved)

    def full_sort():
        srt = jnp.sort(scaled, axis=-1, descending=True)
        kth_f = jnp.take_along_axis(srt, jnp.clip(k - 1, 0, vocab - 1), axis=-1)
        thr_f, _ = _top_p_threshold(scaled, srt, kth_f, k, p, whole_row=True)
        return kth_f, thr_f

    # Rows that fit keep their fast-path numbers even when another row forces the full sort: the
    # two paths round differently, and a request's output must not depend on its batch.
    kth_f, thr_f = jax.lax.cond(jnp.all(fits), lambda: (kth_c, thr_c), full_sort)
    kth = jnp.where(fits, kth_c, kth_f)
    thr = jnp.where(fits, thr_c, thr_f)
    out = jnp.where((k > 0) & (scaled < kth), -jnp.inf, scaled)
    return jnp.where((p < 1.0) & (out < thr), -jnp.inf, out)


def _top_p_threshold(scaled, sorted_prefix, kth, k, p, *, whole_row: bool):
    """Smallest kept value of the nucleus, from a descending prefix of the row (after top-k).

    Returns (threshold, resolved): resolved is False where every entry of the prefix is kept and
    finite entries may follow it, i.e. the prefix was too short to place the cut.
    """
    use_k = k > 0
    # The mass is normalised over the whole top-k-filtered row, not just the prefix.
    lse = jax.nn.logsumexp(jnp.where(use_k & (scaled < kth), -jnp.inf, scaled), axis=-1, keepdims=True)
    srt = jnp.where(use_k & (sorted_prefix < kth), -jnp.inf, sorted_prefix)
    pr = jnp.exp(srt - lse)
    # the mass strictly before each entry: the running sum shifted by one, so it never decreases along
    # the row (the kept set is a prefix) and is exactly 0 for the top entry (which is always kept)
    running = jnp.cumsum(pr, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(running[..., :1]), running[..., :-1]], axis=-1)
    kept = mass_before < p
    thr = jnp.min(jnp.where(kept, srt, jnp.inf), axis=-1, keepdims=True)
    if whole_row:
        resolved = jnp.ones_like(kept[..., -1:])
    else:
        resolved = ~kept[..., -1:] | (srt[..., -1:] == -jnp.inf)
    return thr, resolved


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) as i32, the same index: the first maximum, or the first NaN of a row
    that has one.

    Plain max / min reductions instead of jnp.argmax's (value, index) reduction: XLA's CPU backend
    vectorises the former, while the latter runs as a scalar loop that becomes ~5x slower when the
    elementwise work producing x (e.g. the fused Gumbel noise of argmax(logits + noise)) is fused into
    it (measured at [8, 4096]: 1.3 ms vs 0.25 ms)."""
    v = x.shape[-1]
    col = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first_max = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), col, v), axis=-1)
    first_nan = jnp.min(jnp.where(jnp.isnan(x), col, v), axis=-1)
    return jnp.where(first_nan < v, first_nan, first_max)


def probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The sampling distribution, f32[R, ..., V] (one-hot for greedy rows)."""
    return jax.nn.softmax(process_logits(logits, params), axis=-1)


def request_keys(seeds: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """One PRNG key per request from (seed, absolute position, stream).

    seeds u32[R], positions i32[R] (negative positions wrap modulo 2**32); stream is a Stream, a traced
    integer, or one per request (u32[R])."""
    seeds = jnp.asarray(seeds)
    streams = jnp.broadcast_to(jnp.asarray(stream, jnp.uint32), seeds.shape)

    def one(seed, pos, stream_id):
        key = jax.random.key(seed.astype(jnp.uint32))
        key = jax.random.fold_in(key, pos.astype(jnp.uint32))
        return jax.random.fold_in(key, stream_id)

    return jax.vmap(one)(seeds, jnp.asarray(positions), streams)


def uniform(seeds: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
    """f32[R] uniforms in [0, 1)."""
    keys = request_keys(seeds, positions, stream)
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)


def gumbel(seeds: jax.Array, positions: jax.Array, stream: int, vocab: int) -> jax.Array:
    """f32[R, V] standard Gumbel noise; argmax(logits + noise) samples softmax(logits).

    Row r is jax.random.gumbel(request_keys(seeds, positions, stream)[r], (vocab,)), bit for bit.
    seeds and positions may carry any (equal) leading shape [...]; the noise is then f32[..., V]. stream
    is one Stream or an array that broadcasts against them (one stream per row).
    """
    seeds, positions = jnp.broadcast_arrays(jnp.asarray(seeds), jnp.asarray(positions))
    stream = jnp.broadcast_to(jnp.asarray(stream, jnp.uint32), seeds.shape)
    if _fused_threefry_matches_jax():
        return _fused_gumbel(seeds, positions, stream, vocab)
    keys = request_keys(seeds.reshape(-1), positions.reshape(-1), stream.reshape(-1))
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
    return noise.reshape(seeds.shape + (vocab,))


# The keyed noise in plain jnp. On CPU jax lowers its threefry hash to a rolled 5-step loop, so every
# gumbel draw is a chain of loop iterations and full-row temporaries, and each key derivation
# (key(seed), fold_in position, fold_in stream) is another loop; here the 20 rounds are unrolled
# integer ops, so XLA fuses key derivation, hash, uniform and the two logs into one elementwise pass
# (~1.5-2x cheaper for the draft's [B, K, V] noise on CPU). Integer ops are exact and the float tail
# is jax's own expression, so the bits are jax.random's; this holds for the configuration checked
# below (tests/test_sampling.py compares the two), and any other configuration uses jax.random.
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _fused_threefry_matches_jax() -> bool:
    cfg = jax.config
    return (getattr(cfg, "jax_default_prng_impl", None) == "threefry2x32"
            and getattr(cfg, "jax_threefry_partitionable", None) is True
            and getattr(cfg, "jax_high_dynamic_range_gumbel", None) is False
            and getattr(cfg, "jax_random_seed_offset", 0) == 0)


def _threefry2x32(k1, k2, x1, x2):
    """The Threefry-2x32 hash (20 rounds, jax's key schedule) of counters (x1, x2) under key (k1, k2)."""
    def rotl(x, d):
        return (x << np.uint32(d)) | (x >> np.uint32(32 - d))

    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ rotl(x2, r)
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def _fused_gumbel(seeds, positions, stream, vocab: int) -> jax.Array:
    u32 = jnp.uint32
    seeds = seeds.astype(u32)
    zero = jnp.zeros_like(seeds)
    # jax.random.key(u32 seed) = (0, seed); fold_in(key, d) = threefry(key, counters (0, d))
    k1, k2 = _threefry2x32(zero, seeds, zero, positions.astype(u32))
    k1, k2 = _threefry2x32(k1, k2, zero, stream)
    # random_bits(key, 32, (V,)) with partitionable threefry: hash of the 64-bit counters 0..V-1 (hi, lo)
    count = jax.lax.iota(u32, vocab)
    b1, b2 = _threefry2x32(k1[..., None], k2[..., None], jnp.zeros_like(count), count)
    bits = b1 ^ b2
    # jax.random.uniform(minval=tiny, maxval=1), then gumbel = -log(-log(u)) (its "low" mode)
    f32 = jnp.float32
    floats = jax.lax.bitcast_convert_type((bits >> u32(9)) | u32(0x3F800000), f32) - f32(1.0)  # [0, 1)
    tiny = jnp.asarray(np.finfo(np.float32).tiny, f32)
    u = jax.lax.max(tiny, floats * (jnp.asarray(1.0, f32) - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def sample(logits: jax.Array, params: SamplingParams, seeds: jax.Array, positions: jax.Array,
           stream) -> jax.Array:
    """Draw one token per request from softmax(process_logits(logits)), logits [R, V] -> i32[R].
    stream: a Stream, or one per request (u32[R], e.g. `draft_stream`).

    Gumbel-max with keyed noise: token = argmax(processed + g). For greedy rows the processed logits
    have a single finite entry, at the first argmax of the raw logits, and the noise is finite, so a
    greedy row draws exactly argmax(logits): a batch of greedy rows alone skips the processing and
    the noise (the same tokens, bit for bit, as inside any other batch).
    """
    def drawn():
        processed = process_logits(logits, params)
        return first_argmax(processed + gumbel(seeds, positions, stream, logits.shape[-1]))

    return jax.lax.cond(jnp.all(params.temperature <= 0.0), lambda: first_argmax(logits), drawn)
