"""The Markov-sampler kernel (dspark_jax.kernels.markov_sampler): the Pallas kernel vs its reference
(interpret mode on CPU), the reference vs `sampling.sample`, ties, masked vocabularies, all-greedy batches,
the vocab-tile rule, and Mosaic-TPU lowering at the V4.1-Flash shapes (no TPU needed)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import V41_SHAPES, lower_tpu

from dspark_jax import sampling
from dspark_jax.kernels.markov_sampler import (markov_sample, markov_sample_pallas, markov_sample_reference,
                                               plan_vocab_tile)

S = jax.ShapeDtypeStruct

R = 16


def _sampler_inputs(b, k, v, dtype, temps, *, r=R, seed=0):
    g = np.random.default_rng(seed)
    base = jnp.asarray(g.normal(size=(b, k, v)) * 2.0, jnp.float32)
    anchor = jnp.asarray(g.integers(0, v, size=b), jnp.int32)
    w1 = jnp.asarray(g.normal(size=(v, r)), dtype)
    w2 = jnp.asarray(g.normal(size=(v, r)) * 0.3, dtype)
    temperature = jnp.asarray(temps, jnp.float32)
    noise = jnp.asarray(g.gumbel(size=(b, k, v)), jnp.float32)
    return base, anchor, w1, w2, temperature, noise


def _temps(b):
    return [[0.0, 0.7, 1.0, 1.6][i % 4] for i in range(b)] if b > 1 else [0.8]


SAMPLER_CASES = [  # (K, B, V, vocab_tile, dtype): V a multiple / not a multiple of the tile
    (5, 1, 512, 128, jnp.float32),
    (7, 1, 300, 128, jnp.bfloat16),
    (5, 3, 300, 128, jnp.float32),
    (7, 3, 384, 128, jnp.bfloat16),
    (5, 16, 384, 128, jnp.bfloat16),
    (7, 16, 200, None, jnp.float32),  # one tile of all of V (not a multiple of 128)
]


@pytest.mark.parametrize("k,b,v,tile,dtype", SAMPLER_CASES,
                         ids=[f"K{c[0]}-B{c[1]}-V{c[2]}-T{c[3]}-{jnp.dtype(c[4]).name}" for c in SAMPLER_CASES])
def test_sampler_pallas_interpret_matches_reference(k, b, v, tile, dtype):
    args = _sampler_inputs(b, k, v, dtype, _temps(b), seed=k * 100 + b)
    ref = markov_sample_reference(*args)
    out = jax.jit(lambda *a: markov_sample(*a, impl="pallas", vocab_tile=tile))(*args)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    assert out[0].dtype == jnp.int32 and out[1].dtype == jnp.float32 and out[3].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(ref[1]), atol=1e-5, rtol=1e-5)
    assert out[2].dtype == dtype
    np.testing.assert_array_equal(np.asarray(out[2], np.float32), np.asarray(ref[2], np.float32))
    np.testing.assert_allclose(np.asarray(out[3]), np.asarray(ref[3]), atol=1e-5, rtol=1e-5)
    greedy = np.asarray(args[4]) == 0
    assert np.all(np.asarray(out[1])[greedy] == 0.0) and np.all(np.asarray(out[1])[~greedy] < 0.0)


def test_sampler_pallas_without_logits():
    args = _sampler_inputs(3, 5, 300, jnp.bfloat16, [0.0, 1.0, 0.5], seed=7)
    ref = markov_sample_reference(*args, return_logits=False)
    out = jax.jit(lambda *a: markov_sample_pallas(*a, return_logits=False, vocab_tile=128, interpret=True))(*args)
    assert ref[3] is None and out[3] is None
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(ref[1]), atol=1e-5, rtol=1e-5)


def test_sampler_ties_and_masked_vocab():
    """Exact ties across and within vocab tiles pick the first index (jnp.argmax); -inf logits are never drawn."""
    b, k, v = 4, 5, 384
    base = np.full((b, k, v), -3.0, np.float32)
    base[:, :, 300] = 5.0  # tile 2
    base[:, :, 130] = 5.0  # tile 1: the first maximum
    base[:, :, 131] = 5.0
    base[:, :, :64] = -np.inf  # masked vocabulary entries
    w1 = jnp.zeros((v, R), jnp.float32)
    w2 = jnp.zeros((v, R), jnp.float32)
    temperature = jnp.asarray([0.0, 0.0, 1.0, 2.0], jnp.float32)
    noise = np.array(jax.random.gumbel(jax.random.key(1), (b, k, v)), np.float32)
    noise[2:, :, 250] = noise[2:, :, 10] = noise[2:, :, 200] = 40.0  # ties after scaling in the sampled rows
    noise[2:, :, 5] = 1e4  # huge noise on a -inf logit must not win
    args = (jnp.asarray(base), jnp.zeros((b,), jnp.int32), w1, w2, temperature, jnp.asarray(noise))
    ref = markov_sample_reference(*args)
    out = jax.jit(lambda *a: markov_sample_pallas(*a, vocab_tile=128, interpret=True))(*args)
    np.testing.assert_array_equal(np.asarray(ref[0])[:2], 130)
    np.testing.assert_array_equal(np.asarray(ref[0])[2:], 200)  # -3/T + 40 ties at 200 and 250; first wins
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(ref[1]), atol=1e-5, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(out[1])))


def test_sampler_reference_matches_sampling_sample():
    """With the keyed draft noise, the reference draws what sampling.sample draws (top_k 0, top_p 1),
    and logq is log softmax(process_logits(biased))[token]; the bias is W1[prev] @ W2^T."""
    b, k, v = 6, 5, 512
    temps = [0.0, 0.3, 0.7, 1.0, 1.5, 2e-38]  # the last: biased / T alone would overflow to inf
    base, anchor, w1, w2, temperature, _ = _sampler_inputs(b, k, v, jnp.bfloat16, temps, r=32, seed=11)
    base = jnp.asarray(np.asarray(base) * np.asarray([1, 1, 1, 1, 1, 20], np.float32)[:, None, None])
    seeds = np.asarray([3, 99, 12345, 7, 7, 42], np.uint32)
    first = np.asarray([10, 0, 57, 1000, 1001, 3], np.int32)
    # every (request, k) as one row: seed of the request, absolute position first + k
    seeds_rows = jnp.asarray(np.repeat(seeds, k))
    pos_rows = jnp.asarray((first[:, None] + np.arange(k, dtype=np.int32)[None, :]).reshape(-1))
    params_rows = sampling.SamplingParams.make(b * k, temperature=np.repeat(temps, k))
    noise = jax.jit(lambda s_, p_: sampling.gumbel(s_, p_, sampling.Stream.DRAFT, v))(seeds_rows, pos_rows)
    noise = noise.reshape(b, k, v)
    tokens, logq, emb, logits = jax.jit(markov_sample_reference)(base, anchor, w1, w2, temperature, noise)

    @jax.jit
    def oracle(logits_rows):
        tok = sampling.sample(logits_rows, params_rows, seeds_rows, pos_rows, sampling.Stream.DRAFT)
        p = sampling.probs(logits_rows, params_rows)
        return tok, jnp.log(jnp.take_along_axis(p, tok[:, None], axis=1))[:, 0]

    want_tok, want_logq = (np.asarray(x).reshape(b, k) for x in oracle(logits.reshape(b * k, v)))
    np.testing.assert_array_equal(np.asarray(tokens), want_tok)
    np.testing.assert_allclose(np.asarray(logq), want_logq, atol=1e-5)
    # the chain and the bias, in float64
    w1n, w2n = np.asarray(w1, np.float64), np.asarray(w2, np.float64)
    prev = np.concatenate([np.asarray(anchor)[:, None], np.asarray(tokens)[:, :-1]], axis=1)  # [B, K]
    np.testing.assert_array_equal(np.asarray(emb, np.float64), w1n[prev])
    biased = np.asarray(base, np.float64) + np.einsum("bkr,vr->bkv", w1n[prev], w2n)
    np.testing.assert_allclose(np.asarray(logits), biased, atol=1e-4, rtol=1e-5)
    # the sampled rows really sample: not all equal to the argmax of the biased logits
    assert np.any(np.asarray(tokens)[1:5] != np.argmax(np.asarray(logits), -1)[1:5])
    # T -> 0 is greedy in the limit, with a finite logq of 0
    np.testing.assert_array_equal(np.asarray(tokens)[5], np.argmax(np.asarray(logits)[5], -1))
    np.testing.assert_array_equal(np.asarray(logq)[5], 0.0)


@pytest.mark.parametrize("return_logits", [True, False])
def test_sampler_all_greedy_batch_equals_its_rows_in_a_mixed_batch(return_logits):
    """With every row greedy the reference runs a plain argmax loop (noise unread); each row's tokens,
    logq, embeddings and logits are bit for bit those of the same greedy rows next to sampled rows, and
    the Pallas kernel (interpret) draws the same tokens."""
    b, k, v = 4, 5, 300
    base, anchor, w1, w2, _, noise = _sampler_inputs(b, k, v, jnp.float32, [0.0] * b, seed=21)
    ref = jax.jit(functools.partial(markov_sample_reference, return_logits=return_logits))
    alone = ref(base, anchor, w1, w2, jnp.zeros((b,), jnp.float32), jnp.zeros_like(noise))
    mixed = ref(base, anchor, w1, w2, jnp.asarray([0.0, 1.0, 0.0, 0.5], jnp.float32), noise)
    for i, (a, m) in enumerate(zip(alone, mixed)):
        if a is None:
            assert m is None and not return_logits
            continue
        np.testing.assert_array_equal(np.asarray(a)[[0, 2]].view(np.uint8), np.asarray(m)[[0, 2]].view(np.uint8),
                                      err_msg=str(i))
    assert np.all(np.asarray(alone[1]) == 0.0)
    out = jax.jit(lambda *a: markov_sample_pallas(*a, vocab_tile=128, interpret=True))(
        base, anchor, w1, w2, jnp.zeros((b,), jnp.float32), jnp.zeros_like(noise))
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(alone[0]))


def test_sampler_pallas_tiny_temperature():
    """A tiny T (here biased / T alone overflows) samples the argmax with logq 0, never NaN."""
    args = list(_sampler_inputs(2, 5, 300, jnp.float32, [2e-38, 1.0], seed=5))
    args[0] = args[0] * 20.0
    ref = markov_sample_reference(*args)
    out = jax.jit(lambda *a: markov_sample_pallas(*a, vocab_tile=128, interpret=True))(*args)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    np.testing.assert_array_equal(np.asarray(out[0])[0], np.argmax(np.asarray(ref[3])[0], -1))
    np.testing.assert_array_equal(np.asarray(out[1])[0], 0.0)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(ref[1]), atol=1e-5, rtol=1e-5)


def test_sampler_tile_rule_and_errors():
    assert plan_vocab_tile(8, 129280, 256, jnp.bfloat16) == (12928, "view")  # V4.1: 10 tiles, no transpose
    assert plan_vocab_tile(8, 300, 16, jnp.float32) == (300, "transpose")
    assert plan_vocab_tile(8, 512, 16, jnp.float32) == (512, "view")
    assert plan_vocab_tile(8, 300, 16, jnp.float32, vocab_tile=128) == (128, "transpose")
    tile, layout = plan_vocab_tile(8, 129280 + 1, 256, jnp.bfloat16)  # no multiple of 128 divides V
    assert layout == "transpose" and tile % 128 == 0
    with pytest.raises(ValueError, match="vocab_tile"):
        plan_vocab_tile(8, 1000, 16, jnp.float32, vocab_tile=100)
    args = _sampler_inputs(2, 5, 300, jnp.float32, [0.0, 1.0])
    with pytest.raises(ValueError, match="impl"):
        markov_sample(*args, impl="triton")
    with pytest.raises(ValueError, match="noise"):
        markov_sample(*args[:5], args[5][:, :4])


# Mosaic TPU lowering at the V4.1-Flash shapes (lowering only: Mosaic's own compile needs a TPU)
@pytest.mark.parametrize("b,w_dtype,return_logits", [
    (8, jnp.bfloat16, True), (8, jnp.bfloat16, False), (16, jnp.float32, True), (1, jnp.bfloat16, True)])
def test_markov_sampler_lowers_for_tpu(b, w_dtype, return_logits):
    c = V41_SHAPES
    structs = (S((b, c["k"], c["v"]), jnp.float32), S((b,), jnp.int32), S((c["v"], c["r"]), w_dtype),
               S((c["v"], c["r"]), w_dtype), S((b,), jnp.float32), S((b, c["k"], c["v"]), jnp.float32))
    text = lower_tpu(lambda *a: markov_sample_pallas(*a, return_logits=return_logits), *structs)
    assert text.count("tpu_custom_call") == 2  # the bias pass and the sampling pass, in a scan over k
