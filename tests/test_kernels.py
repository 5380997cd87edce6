"""Pallas kernels vs their references (interpret mode on CPU), the references vs independent
implementations, dispatch, and Mosaic-TPU lowering at the V4.1-Flash shapes (no TPU needed)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import sampling
from dspark_jax.kernels import _common
from dspark_jax.kernels.markov_sampler import (markov_sample, markov_sample_pallas, markov_sample_reference,
                                               plan_vocab_tile)
from dspark_jax.kernels.window_attention import (plan_row_block, window_attention, window_attention_pallas,
                                                 window_attention_reference)

S = jax.ShapeDtypeStruct

# ----------------------------------------------------------------------------------------------------
# window attention

W, H, HD = 16, 4, 128
SCALE = HD ** -0.5


def _attn_inputs(b, k, lens, dtype, *, h=H, hd=HD, w=W, kv_dtype=None, seed=0):
    """Random inputs; unwritten ring slots hold NaN so that any leak of them shows."""
    g = np.random.default_rng(seed)
    kv_dtype = kv_dtype or dtype
    q = g.normal(size=(b, k, h, hd)) * 1.5
    ring = g.normal(size=(b, w, hd))
    for i, n in enumerate(lens):
        ring[i, min(max(n, 0), w):] = np.nan
    draft = g.normal(size=(b, k, hd))
    sink = g.normal(size=(h,)) * 2.0
    return (jnp.asarray(q, dtype), jnp.asarray(ring, kv_dtype), jnp.asarray(lens, jnp.int32),
            jnp.asarray(draft, kv_dtype), jnp.asarray(sink, jnp.float32))


def _attn_numpy(q, ring, lens, draft, sink, scale):
    """Plain float64 loop: keys = the valid ring rows then the draft rows; the sink is in the denominator."""
    q, ring, draft, sink = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, ring, draft, sink))
    b, k, h, hd = q.shape
    out = np.zeros_like(q)
    for i in range(b):
        n = min(max(int(lens[i]), 0), ring.shape[1])
        keys = np.concatenate([ring[i, :n], draft[i]], axis=0)
        for j in range(k):
            for hh in range(h):
                s = keys @ q[i, j, hh] * scale
                m = max(s.max(), sink[hh])
                p = np.exp(s - m)
                out[i, j, hh] = p @ keys / (p.sum() + np.exp(sink[hh] - m))
    return out


@pytest.mark.parametrize("k,lens", [(5, [1]), (7, [W]), (5, [W + 9]), (7, [0, 3, W, 2 * W + 1])])
def test_attention_reference_matches_numpy_loop(k, lens):
    args = _attn_inputs(len(lens), k, lens, jnp.float32, seed=k)
    want = _attn_numpy(*args, SCALE)
    got = np.asarray(window_attention_reference(*args, scale=SCALE))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # the sink is not a no-op at these magnitudes (guards against a test that cannot see it)
    no_sink = _attn_numpy(*args[:4], args[4] - 1e4, SCALE)
    assert np.max(np.abs(no_sink - want)) > 1e-2


ATTN_CASES = [  # (K, ring_len per request): fill below, at and past W, and an empty ring
    (5, [3]),
    (7, [W]),
    (5, [2, W, W + 37]),
    (7, [0, 1, 5, W - 1, W, W + 1, 3 * W, 9, 12, W, 2, 15, W + 100, 7, 4, 11]),
]


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("k,lens", ATTN_CASES, ids=["K5-B1-below", "K7-B1-at", "K5-B3-mixed", "K7-B16-mixed"])
def test_attention_pallas_interpret_matches_reference(k, lens, dtype, atol):
    args = _attn_inputs(len(lens), k, lens, dtype, seed=len(lens) + k)
    ref = window_attention_reference(*args, scale=SCALE)
    # the dispatcher under jit: impl="pallas" on CPU is interpret mode
    out = jax.jit(lambda *a: window_attention(*a, scale=SCALE, impl="pallas"))(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out32))
    np.testing.assert_allclose(out32, ref32, atol=atol, rtol=0)
    if dtype == jnp.bfloat16:
        # Both round the same probabilities to bf16, but their score products sum in different orders,
        # so now and then a probability sits on a bf16 rounding boundary and lands one bf16 step (2^-8)
        # apart: a few outputs move by up to 2^-8 * |v| (within atol above). Such flips are rare: on
        # average the outputs agree to well below one bf16 step of a typical output (2^-8).
        assert np.mean(np.abs(out32 - ref32)) < 2.0 ** -14


def test_attention_pallas_row_tiles_and_mixed_dtypes():
    # K*H = 40 rows in 5 row blocks of 8; f32 queries against bf16 KV (the f32-compute draft)
    args = _attn_inputs(3, 5, [4, W, W + 3], jnp.float32, h=8, kv_dtype=jnp.bfloat16, seed=3)
    ref = window_attention_reference(*args, scale=SCALE)
    out = jax.jit(lambda *a: window_attention_pallas(*a, scale=SCALE, interpret=True, row_block=8))(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="row_block"):
        window_attention_pallas(*args, scale=SCALE, interpret=True, row_block=12)


def test_attention_row_block_rule():
    assert plan_row_block(5 * 64, 512, 128, 5, jnp.bfloat16, jnp.bfloat16) == 320  # V4.1: one step/request
    assert plan_row_block(20, 128, 16, 5, jnp.float32, jnp.float32) == 20
    assert plan_row_block(16 * 64, 512, 128, 16, jnp.bfloat16, jnp.bfloat16) == 512  # largest 16-multiple divisor
    assert plan_row_block(9 * 60, 512, 128, 9, jnp.float32, jnp.float32) == 540  # no multiple of 8 divides 540
    assert plan_row_block(8 * 100, 512, 128, 8, jnp.float32, jnp.float32) == 400
    assert plan_row_block(8 * 64, 512, 1 << 16, 8, jnp.bfloat16, jnp.bfloat16) is None  # a 64K-row ring never fits


def test_attention_shape_errors():
    args = list(_attn_inputs(2, 5, [1, 2], jnp.float32))
    args[3] = args[3][:, :4]
    with pytest.raises(ValueError, match="draft_kv"):
        window_attention(*args, scale=SCALE)


# ----------------------------------------------------------------------------------------------------
# Markov sampler

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


# ----------------------------------------------------------------------------------------------------
# dispatch


def _has_pallas_call(fn, *structs) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*structs))


def test_dispatch_routes(monkeypatch):
    attn = (S((2, 5, 4, 128), jnp.float32), S((2, 16, 128), jnp.float32), S((2,), jnp.int32),
            S((2, 5, 128), jnp.float32), S((4,), jnp.float32))
    samp = (S((2, 5, 300), jnp.float32), S((2,), jnp.int32), S((300, 16), jnp.float32), S((300, 16), jnp.float32),
            S((2,), jnp.float32), S((2, 5, 300), jnp.float32))
    a = lambda impl: (lambda *x: window_attention(*x, scale=SCALE, impl=impl))  # noqa: E731
    m = lambda impl: (lambda *x: markov_sample(*x, impl=impl))  # noqa: E731
    # off TPU: auto and xla are the reference, pallas is the (interpreted) kernel
    assert not _has_pallas_call(a("auto"), *attn) and not _has_pallas_call(m("auto"), *samp)
    assert not _has_pallas_call(a("xla"), *attn) and not _has_pallas_call(m("xla"), *samp)
    assert _has_pallas_call(a("pallas"), *attn) and _has_pallas_call(m("pallas"), *samp)
    # on TPU: auto is the kernel ...
    monkeypatch.setattr(_common.jax, "default_backend", lambda: "tpu")
    assert _has_pallas_call(a("auto"), *attn) and _has_pallas_call(m("auto"), *samp)
    # ... except for shapes it cannot run (a 64K-row ring; V >= 2^24), where auto falls back and pallas raises
    big_attn = (S((8, 5, 64, 512), jnp.bfloat16), S((8, 1 << 16, 512), jnp.bfloat16), S((8,), jnp.int32),
                S((8, 5, 512), jnp.bfloat16), S((64,), jnp.float32))
    v = 1 << 24
    big_samp = (S((2, 5, v), jnp.float32), S((2,), jnp.int32), S((v, 16), jnp.bfloat16), S((v, 16), jnp.bfloat16),
                S((2,), jnp.float32), S((2, 5, v), jnp.float32))
    assert not _has_pallas_call(a("auto"), *big_attn) and not _has_pallas_call(m("auto"), *big_samp)
    with pytest.raises(ValueError, match="VMEM"):
        jax.make_jaxpr(a("pallas"))(*big_attn)
    with pytest.raises(ValueError, match="2\\^24"):
        jax.make_jaxpr(m("pallas"))(*big_samp)


# ----------------------------------------------------------------------------------------------------
# Mosaic TPU lowering at the V4.1-Flash shapes (lowering only: Mosaic's own compile needs a TPU)

V41 = dict(b=8, k=5, h=64, hd=512, w=128, v=129280, r=256)


def _lower_tpu(fn, *structs) -> str:
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*structs).mlir_module()
    assert "tpu_custom_call" in text
    return text


@pytest.mark.parametrize("b,q_dtype", [(8, jnp.bfloat16), (8, jnp.float32), (1, jnp.bfloat16), (32, jnp.bfloat16)])
def test_window_attention_lowers_for_tpu(b, q_dtype):
    c = V41
    structs = (S((b, c["k"], c["h"], c["hd"]), q_dtype), S((b, c["w"], c["hd"]), jnp.bfloat16), S((b,), jnp.int32),
               S((b, c["k"], c["hd"]), jnp.bfloat16), S((c["h"],), jnp.float32))
    text = _lower_tpu(lambda *a: window_attention_pallas(*a, scale=c["hd"] ** -0.5), *structs)
    assert text.count("tpu_custom_call") == 1


@pytest.mark.parametrize("b,w_dtype,return_logits", [
    (8, jnp.bfloat16, True), (8, jnp.bfloat16, False), (16, jnp.float32, True), (1, jnp.bfloat16, True)])
def test_markov_sampler_lowers_for_tpu(b, w_dtype, return_logits):
    c = V41
    structs = (S((b, c["k"], c["v"]), jnp.float32), S((b,), jnp.int32), S((c["v"], c["r"]), w_dtype),
               S((c["v"], c["r"]), w_dtype), S((b,), jnp.float32), S((b, c["k"], c["v"]), jnp.float32))
    text = _lower_tpu(lambda *a: markov_sample_pallas(*a, return_logits=return_logits), *structs)
    assert text.count("tpu_custom_call") == 2  # the bias pass and the sampling pass, in a scan over k
