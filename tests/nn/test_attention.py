"""Attention (dspark_jax.nn.attention): the V4.1 draft's window attention (SPEC 2.5) and the grouped-query
core the DeepSpec draft runs over its context and block rows, both against numpy loops."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_within_one_fp8_step, np_fp8_round_rows, np_rms_norm, np_rope
from helpers.v41 import CFG, tiny

from dspark_jax.nn.attention import KeySegment, WindowAttention, grouped_query_attention


# ---------------------------------------------------------------------------------------------------
# WindowAttention (the V4.1 draft)
# ---------------------------------------------------------------------------------------------------


def np_attention(p, x, positions, ring, ring_len, cfg, draft_kv=None):
    """SPEC 2.5 in numpy with loops over batch, query, head and key -> (output, own draft KV rows).

    draft_kv [B, K, hd]: attend with these draft KV rows (the module's) instead of the oracle's own. Both
    go through the fp8 rounding from values that differ in the last bits (f32 vs f64), so a value sitting
    near a rounding midpoint can differ by one fp8 step, which moves the output by up to ~80x the
    test's tolerance (measured); the caller checks the module's rows against the returned own rows to
    within one fp8 step, and the attention after the rounding stays a smooth comparison."""
    b, kk, _ = x.shape
    h, hd, w = cfg.n_heads, cfg.head_dim, cfg.window
    a = {n: np.asarray(p[n]["kernel"], np.float64) for n in ("wq_a", "wq_b", "wkv", "wo_b")}
    q = np_rms_norm(x @ a["wq_a"], np.asarray(p["q_norm"]["scale"]), cfg.norm_eps) @ a["wq_b"]
    q = np_rope(q.reshape(b, kk, h, hd), positions[:, :, None], cfg.rope_theta, cfg.rope_head_dim)
    kv = np_rms_norm(x @ a["wkv"], np.asarray(p["kv_norm"]["scale"]), cfg.norm_eps)
    own_kv = kv = np_fp8_round_rows(np_rope(kv, positions, cfg.rope_theta, cfg.rope_head_dim))
    if draft_kv is not None:
        kv = np.asarray(draft_kv, np.float64)
    sink = np.asarray(p["sink"], np.float64)
    o = np.zeros((b, kk, h, hd))
    for bi in range(b):
        keys = [ring[bi, j] for j in range(min(w, ring_len[bi]))] + [kv[bi, j] for j in range(kk)]
        for qi in range(kk):
            for hi in range(h):
                s = [float(q[bi, qi, hi] @ key) * hd ** -0.5 for key in keys]
                m = max(max(s), sink[hi])
                num = sum(np.exp(sj - m) * key for sj, key in zip(s, keys))
                o[bi, qi, hi] = num / (sum(np.exp(sj - m) for sj in s) + np.exp(sink[hi] - m))
    o = np_rope(o, positions[:, :, None], cfg.rope_theta, cfg.rope_head_dim, inverse=True).reshape(b, kk, -1)
    g = cfg.o_groups
    gs = h * hd // g
    wo_a = np.asarray(p["wo_a"]["kernel"], np.float64)
    mid = np.concatenate([o[..., gi * gs:(gi + 1) * gs] @ wo_a[gi] for gi in range(g)], axis=-1)
    return mid @ a["wo_b"], own_kv


@pytest.mark.parametrize("ring_len", [[3, 16], [16, 40]])
def test_attention_matches_numpy(ring_len):
    """The module's fp8-rounded draft KV rows within one fp8 step of numpy's (at most 1% of the values
    different: a wrong position or a missing rounding fails), and its output equal to numpy's attention
    over those rows (see `np_attention`)."""
    params, _ = tiny()
    p = params["blocks_0"]["attn"]
    rng = np.random.default_rng(1)
    b, k = 2, CFG.block_size
    x = rng.normal(size=(b, k, CFG.dim)).astype(np.float32)
    ring_len = np.array(ring_len)
    positions = ring_len[:, None] + np.arange(k)[None]
    ring = np_fp8_round_rows(rng.normal(size=(b, CFG.window, CFG.head_dim))).astype(np.float32)
    attn = WindowAttention(CFG, impl="xla")
    got = attn.apply({"params": p}, jnp.asarray(x), jnp.asarray(positions), jnp.asarray(ring), jnp.asarray(ring_len))
    kv = attn.apply({"params": p}, jnp.asarray(x), jnp.asarray(positions), method=WindowAttention.kv)
    want, want_kv = np_attention(p, x.astype(np.float64), positions, ring.astype(np.float64), ring_len, CFG,
                                 draft_kv=kv)
    assert_within_one_fp8_step(kv, want_kv, what="draft KV values")
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-4)


# ---------------------------------------------------------------------------------------------------
# grouped_query_attention over key segments (the DeepSpec draft's block over its context)
# ---------------------------------------------------------------------------------------------------


def _block_attention(q, k_blk, v_blk, k_ctx, v_ctx, ctx_visible, scale):
    """The DeepSpec draft layer's attention (`drafts.deepspec.model._DraftLayer`): queries q [B, N, K, H, hd]
    of N blocks per row see their visible context rows k/v_ctx [B, S, Hkv, hd] (ctx_visible bool[B, N, S])
    and every row of their own block k/v_blk [B, N, K, Hkv, hd]."""
    return grouped_query_attention(q, [KeySegment(k_ctx[:, None], v_ctx[:, None], ctx_visible[:, :, None, :]),
                                       KeySegment(k_blk, v_blk)], scale=scale)


def test_block_attention_sees_visible_context_and_its_whole_block():
    rng = np.random.default_rng(1)
    b, n, kk, h, hkv, hd, s = 2, 2, 4, 4, 2, 8, 7
    q, kb, vb = (rng.normal(size=sh) for sh in ((b, n, kk, h, hd), (b, n, kk, hkv, hd), (b, n, kk, hkv, hd)))
    kc, vc = rng.normal(size=(b, s, hkv, hd)), rng.normal(size=(b, s, hkv, hd))
    vis = np.arange(s)[None, None, :] < np.array([[0, 3], [7, 5]])[..., None]
    kc[0, 6] = np.inf  # a row no block sees may hold anything
    got = _block_attention(*(jnp.asarray(a, jnp.float32) for a in (q, kb, vb, kc, vc)), jnp.asarray(vis), hd ** -0.5)
    want = np.zeros_like(q)
    for bi in range(b):
        for ni in range(n):
            keys = [(kc[bi, j], vc[bi, j]) for j in range(s) if vis[bi, ni, j]] + \
                   [(kb[bi, ni, j], vb[bi, ni, j]) for j in range(kk)]
            for qi in range(kk):
                for hi in range(h):
                    g = hi // (h // hkv)
                    sc = np.array([q[bi, ni, qi, hi] @ key[g] for key, _ in keys]) * hd ** -0.5
                    pr = np.exp(sc - sc.max())
                    want[bi, ni, qi, hi] = sum(pj * val[g] for pj, (_, val) in zip(pr / pr.sum(), keys))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Non-causal: the first slot's output moves when the LAST slot's key moves.
    kb2 = kb.copy()
    kb2[:, :, -1] += 1.0
    got2 = _block_attention(*(jnp.asarray(a, jnp.float32) for a in (q, kb2, vb, kc, vc)), jnp.asarray(vis), hd ** -0.5)
    assert not np.allclose(got2[:, :, 0], got[:, :, 0])
