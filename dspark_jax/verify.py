"""Lossless verify-and-accept (SPEC section 5), vectorised over requests, static shapes, jittable.

For request r with verify length l_r, draft token k (1-based) sits at absolute position
`positions[r] + k - 1` and is accepted with probability min(1, p(x_k) / q(x_k)), where p and q are
`sampling.probs` of the backbone row k-1 and of the draft logits k: the same processing (temperature,
top-k, top-p) the draft sampled with. At the first rejection, row j = (accepted count), the emitted token
is drawn from norm(max(0, p_j - q_j)); after l_r acceptances it is the bonus token from p at row l_r.
Either way the emitted token at row j sits at position `positions + j` and is drawn with the key
(seed, positions + j, Stream.RESAMPLE); the acceptance uniform of draft k uses
(seed, positions + k - 1, Stream.ACCEPT). Everything a round consumes at a position is therefore spent
once the token at that position is emitted, and the next round starts at the next position with
fresh keys: the emitted sequence is distributed exactly as the backbone would sample it, and a
request's output depends only on its own inputs, seed and position.

Invariant rows (`params.invariant`, the drafter-invariant coupling of `sampling`): the target's token at
row j is argmax(process(p_j) + G) with G keyed (seed, positions + j, RESAMPLE), the very draw plain
decoding makes at that position. Draft k is accepted iff it equals the target's token at row k-1, and
the emitted token is the target's token at row n: no uniform, no residual. The emitted sequence is then
plain decoding's, token for token, whatever was drafted or how many drafts were verified.

Greedy rows need no special case: p and q are one-hot, so u * q(x) < p(x) holds exactly when x is
the backbone argmax (u < 1), and the emitted token is the backbone argmax (the residual of two
one-hots is p itself, or empty when the draft's own argmax was the backbone's, which falls back to p).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.sampling import SamplingParams, Stream, first_argmax, gumbel, process_logits, uniform

# Below this residual mass p and q agree up to float rounding, so the rejection that led here was a
# rounding artefact (rejection probability = residual mass): draw from p instead of from the rounding
# noise. The output error this allows is at most this mass in total variation.
RESIDUAL_MIN_MASS = 1e-5


class VerifyResult(NamedTuple):
    tokens: jax.Array  # i32[R, K+1]: accepted drafts, then the correction/bonus token, then -1
    num_accepted: jax.Array  # i32[R] in [0, l_r]
    num_emitted: jax.Array  # i32[R] = num_accepted + 1


@jax.jit
def verify_and_accept(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    draft_logits: jax.Array,
    num_verify: jax.Array,
    params: SamplingParams,
    seeds: jax.Array,
    positions: jax.Array,
) -> VerifyResult:
    """Accept a prefix of each request's drafts and emit one backbone token after it.

    target_logits f32[R, K+1, V]: row j = backbone logits after the anchor and drafts 1..j.
    draft_tokens i32[R, K]; draft_logits f32[R, K, V]: the (Markov-biased, unprocessed) logits each
    draft token was sampled from with `sampling.sample(..., Stream.DRAFT)`.
    num_verify i32[R]: l_r, clipped to [0, K]; drafts beyond it are ignored (may be garbage).
    params: SamplingParams, applied identically to p and q. seeds u32[R]. positions i32[R]: absolute
    position of draft token 1. A draft token outside [0, V) within l_r is rejected.
    """
    return _verify_and_accept(target_logits, draft_tokens, draft_logits, num_verify, params, seeds,
                              positions, resample_stream=Stream.RESAMPLE)


def _verify_and_accept(target_logits, draft_tokens, draft_logits, num_verify, params, seeds, positions,
                       *, resample_stream) -> VerifyResult:
    # resample_stream is a parameter only so the tests can reproduce the shared-stream bug and show
    # that the statistical tests catch it; the public function always uses Stream.RESAMPLE.
    if target_logits.ndim != 3:
        raise ValueError(f"target_logits: expected f32[R, K+1, V], got shape {target_logits.shape}")
    R, K1, V = target_logits.shape
    K = K1 - 1
    if draft_tokens.shape != (R, K):
        raise ValueError(f"draft_tokens: expected shape {(R, K)}, got {draft_tokens.shape}")
    if draft_logits.shape != (R, K, V):
        raise ValueError(f"draft_logits: expected shape {(R, K, V)}, got {draft_logits.shape}")
    for name, x in (("num_verify", num_verify), ("seeds", seeds), ("positions", positions)):
        if x.shape != (R,):
            raise ValueError(f"{name}: expected shape {(R,)}, got {x.shape}")

    positions = positions.astype(jnp.int32)
    num_verify = jnp.clip(num_verify.astype(jnp.int32), 0, K)
    rows = jnp.arange(R)

    # p and q through one process_logits call: the same processing by construction, and one
    # compiled filter instead of two.
    both = jnp.concatenate([target_logits.astype(jnp.float32), draft_logits.astype(jnp.float32)], axis=1)
    # Rows past l_r are never read (backbone rows > l_r, draft rows > l_r). Replace them with a
    # one-token row: garbage there (zeros, NaN) must not push the batch onto process_logits' full-sort
    # path, which a flat padding row under top-p would.
    row_index = jnp.concatenate([jnp.arange(K1), jnp.arange(1, K1)])  # backbone row j, draft row k = j + 1
    unused = (row_index[None, :] > num_verify[:, None])[..., None]
    both = jnp.where(unused, jnp.where(jnp.arange(V) == 0, 0.0, -jnp.inf), both)
    processed = process_logits(both, params)
    lse = jax.nn.logsumexp(processed, axis=-1)  # [R, 2K+1]
    target, target_lse = processed[:, :K1], lse[:, :K1]  # [R, K+1, V], [R, K+1]

    if K > 0:
        draft, draft_lse = processed[:, K1:], lse[:, K1:]  # [R, K, V], [R, K]
        steps = jnp.arange(K)
        in_vocab = (draft_tokens >= 0) & (draft_tokens < V)
        x = jnp.clip(draft_tokens, 0, V - 1).astype(jnp.int32)[..., None]
        p_x = jnp.exp(jnp.take_along_axis(target[:, :K], x, axis=-1)[..., 0] - target_lse[:, :K])
        q_x = jnp.exp(jnp.take_along_axis(draft, x, axis=-1)[..., 0] - draft_lse)
        accept_pos = (positions[:, None] + steps).reshape(-1)
        u = uniform(jnp.repeat(seeds, K), accept_pos, Stream.ACCEPT).reshape(R, K)
        # u < p/q without dividing; q(x) = 0 (a token the draft could not have sampled) accepts iff
        # p(x) > 0, the limit of min(1, p/q).
        optimal = u * q_x < p_x
        accept = jnp.where(params.invariant[:, None], _equals_target_draw(target[:, :K], draft_tokens, params, seeds,
                                                                          positions), optimal)
        accept = accept & in_vocab & (steps < num_verify[:, None])
        num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    else:
        num_accepted = jnp.zeros((R,), jnp.int32)

    # The emitted token: row n = num_accepted of the backbone, corrected by the draft on rejection.
    n = num_accepted
    p_logits = target[rows, n]  # [R, V], processed, unnormalised
    emit_logits = p_logits
    if K > 0:
        rejected = n < num_verify
        q_row = jnp.minimum(n, K - 1)  # when n == K nothing was rejected and q is unused
        p_n = jnp.exp(p_logits - target_lse[rows, n][:, None])
        q_n = jnp.exp(draft[rows, q_row] - draft_lse[rows, q_row][:, None])
        residual = jnp.maximum(p_n - q_n, 0.0)
        use_residual = rejected & ~params.invariant & (jnp.sum(residual, axis=-1) > RESIDUAL_MIN_MASS)
        # Gumbel-max needs no normalisation; log(0) = -inf removes the tokens the residual excludes.
        emit_logits = jnp.where(use_residual[:, None], jnp.log(residual), p_logits)
    noise = gumbel(seeds, positions + n, resample_stream, V)
    emitted = first_argmax(emit_logits + noise)

    cols = jnp.arange(K + 1)
    drafts_padded = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((R, 1), -1, jnp.int32)], axis=1)
    tokens = jnp.where(cols < n[:, None], drafts_padded, jnp.where(cols == n[:, None], emitted[:, None], -1))
    return VerifyResult(tokens=tokens, num_accepted=n.astype(jnp.int32), num_emitted=(n + 1).astype(jnp.int32))


def _equals_target_draw(target: jax.Array, draft_tokens: jax.Array, params: SamplingParams, seeds: jax.Array,
                        positions: jax.Array) -> jax.Array:
    """bool[R, K]: draft k equals the target's own draw at its position, argmax(process(p_{k-1}) + G) with
    the plain-decoding key (seed, positions + k - 1, RESAMPLE). target: processed logits [R, K, V].
    Computed only when some row is invariant (the noise is [R, K, V])."""
    R, K, V = target.shape

    def draws():
        pos = positions[:, None] + jnp.arange(K, dtype=positions.dtype)[None, :]
        noise = gumbel(jnp.broadcast_to(seeds[:, None], pos.shape), pos, Stream.RESAMPLE, V)
        return first_argmax(target + noise) == draft_tokens

    return jax.lax.cond(jnp.any(params.invariant), draws, lambda: jnp.zeros((R, K), bool))
