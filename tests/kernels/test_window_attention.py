"""The window-attention kernel (dspark_jax.kernels.window_attention): the Pallas kernel vs its reference
(interpret mode on CPU), the reference vs a numpy loop, the row-block rule, and Mosaic-TPU lowering at the
V4.1-Flash shapes (no TPU needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernels import V41_SHAPES, lower_tpu

from dspark_jax.kernels.window_attention import (plan_row_block, window_attention, window_attention_pallas,
                                                 window_attention_reference)

S = jax.ShapeDtypeStruct

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


# Mosaic TPU lowering at the V4.1-Flash shapes (lowering only: Mosaic's own compile needs a TPU)
@pytest.mark.parametrize("b,q_dtype", [(8, jnp.bfloat16), (8, jnp.float32), (1, jnp.bfloat16), (32, jnp.bfloat16)])
def test_window_attention_lowers_for_tpu(b, q_dtype):
    c = V41_SHAPES
    structs = (S((b, c["k"], c["h"], c["hd"]), q_dtype), S((b, c["w"], c["hd"]), jnp.bfloat16), S((b,), jnp.int32),
               S((b, c["k"], c["hd"]), jnp.bfloat16), S((c["h"],), jnp.float32))
    text = lower_tpu(lambda *a: window_attention_pallas(*a, scale=c["hd"] ** -0.5), *structs)
    assert text.count("tpu_custom_call") == 1
