"""The V4.1-style mHC backbone (dspark_jax.backbones.mhc) against a plain cache-free reference written here
(SPEC 2.4-2.6): the full forward and taps, cached decoding with rollback, and its config's errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_within_one_fp8_step
from helpers.backbones import (B, FAMILY_TAPS, MAX_LEN, MHC_JSON, N, PREFILL, STEPS, decode_schedule, mhc_fixture,
                               random_tokens)

from dspark_jax.backbones.mhc import MhcCache, MhcConfig
from dspark_jax.nn.mhc import hc_mixes, hc_post, hc_pre
from dspark_jax.nn.moe import moe_ffn, moe_route, swiglu_mlp
from dspark_jax.nn.norm import rms_norm
from dspark_jax.nn.quant import fp8_quant_dequant
from dspark_jax.nn.rope import apply_rope_interleaved
from dspark_jax.validation import ConfigError


@pytest.fixture(scope="module", params=["moe", "dense"])
def mhc_both(request, mhc):
    return mhc if request.param == "moe" else mhc_fixture(False)


@pytest.fixture(scope="module", params=["kv_fp8", "smooth"])
def mhc_fp8_and_smooth(request, mhc):
    """The shipped tiny config, and the same weights with the fp8 KV rounding off."""
    return mhc if request.param == "kv_fp8" else mhc_fixture(True, kv_fp8=False)


def reference_mhc(params, cfg: MhcConfig, tokens, attend_kv=None):
    """Cache-free, scan-free forward written from SPEC 2.4-2.6 with causal attention over the sequence.
    -> (logits [B, T, V], stream means at every layer entry and after the last layer [L+1][B, T, D],
    the reference's own latent KV rows [L, B, T, hd] (fp8-rounded when kv_fp8)).

    attend_kv [L, B, T, hd]: attend with these KV rows (the model's cache) instead of the reference's own.
    The model computes the same rows in another op order, so they differ in the last bits, and the fp8
    rounding turns a last-bit difference at a value near a rounding midpoint into a one-fp8-step change
    that moves the logits by up to 0.1 (measured). The caller checks the model's rows against the
    returned own rows to within one fp8 step; attending with the model's rows keeps everything after the
    rounding a smooth comparison."""
    b, t = tokens.shape
    hi = jax.lax.Precision.HIGHEST
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    rope = lambda x, p, inv=False: apply_rope_interleaved(x, p, theta=cfg.rope_theta, rope_dim=cfg.rope_head_dim,
                                                          inverse=inv)
    x = params["embed"][tokens]
    X = jnp.repeat(x[:, :, None, :], cfg.hc_mult, axis=2)
    pre = jnp.zeros((b, t, cfg.hc_mult)).at[..., 0].set(1.0)
    means, own_kv = [], []
    for i in range(cfg.n_layers):
        p = jax.tree.map(lambda a: a[i], params["layers"])
        means.append(X.mean(axis=2))
        mix = lambda hc: hc_mixes(X, hc["fn"], hc["base"], hc["scale"], iters=cfg.hc_sinkhorn_iters,
                                  eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
        attn_pre, attn_post, attn_comb = mix(p["hc_attn"])
        h = rms_norm(hc_pre(X, pre), p["attn_norm"]["scale"], cfg.norm_eps)
        a = p["attn"]
        q = jnp.dot(rms_norm(jnp.dot(h, a["wq_a"]["kernel"], precision=hi), a["q_norm"]["scale"], cfg.norm_eps),
                    a["wq_b"]["kernel"], precision=hi).reshape(b, t, cfg.n_heads, cfg.head_dim)
        q = rope(q, pos[..., None])
        kv = rms_norm(jnp.dot(h, a["wkv"]["kernel"], precision=hi), a["kv_norm"]["scale"], cfg.norm_eps)
        kv = rope(kv, pos)
        if cfg.kv_fp8:
            kv = fp8_quant_dequant(kv)
        own_kv.append(kv)
        if attend_kv is not None:
            kv = jnp.asarray(attend_kv[i])
        s = jnp.einsum("bthd,bsd->bhts", q, kv, precision=hi) * cfg.head_dim ** -0.5
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        s = jnp.concatenate([s, jnp.broadcast_to(a["sink"][None, :, None, None], (b, cfg.n_heads, t, 1))], -1)
        w = jax.nn.softmax(s, axis=-1)[..., :-1]  # the sink takes probability mass, carries no value
        o = rope(jnp.einsum("bhts,bsd->bthd", w, kv, precision=hi), pos[..., None], True)
        o = o.reshape(b, t, cfg.o_groups, -1)
        o = jnp.einsum("btgi,gio->btgo", o, a["wo_a"]["kernel"], precision=hi).reshape(b, t, -1)
        y = jnp.dot(o, a["wo_b"]["kernel"], precision=hi)
        X = hc_post(y, X, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = mix(p["hc_ffn"])
        h = rms_norm(hc_pre(X, attn_pre), p["ffn_norm"]["scale"], cfg.norm_eps)
        f = p["ffn"]
        if cfg.n_routed_experts:
            flat = h.reshape(-1, cfg.dim)
            wts, idx = moe_route(flat, f["gate"]["kernel"], f["gate"]["bias"], top_k=cfg.n_activated_experts,
                                 route_scale=cfg.route_scale, score_func=cfg.score_func,
                                 norm_topk_prob=cfg.norm_topk_prob)
            y = moe_ffn(flat, wts, idx, f["experts"], f.get("shared"), limit=cfg.swiglu_limit).reshape(h.shape)
        else:
            y = swiglu_mlp(h, f["w1"], f["w3"], f["w2"], limit=cfg.swiglu_limit)
        X = hc_post(y, X, ffn_post, ffn_comb)
        pre = ffn_pre
    means.append(X.mean(axis=2))
    h = rms_norm(hc_pre(X, pre), params["norm"]["scale"], cfg.norm_eps)
    return jnp.einsum("btd,vd->btv", h, params["head"], precision=hi), means, jnp.stack(own_kv)


def test_mhc_full_forward_and_taps_match_reference(mhc_both):
    """Logits, taps and the cached KV rows against the reference. The KV rows go through the fp8
    rounding on both sides, computed in different op orders: they must agree to within one fp8 step
    (and at most 1% of them differ at all; a wrong position, a missing rounding or a wrong row fails);
    the reference then attends with the model's rows (see `reference_mhc`) so the logits and taps are
    a smooth comparison at 1e-4, which any error in attention, mixing, FFN or head exceeds."""
    bb, params, fwd = mhc_both
    cfg, D = bb.cfg, bb.dim
    seq = random_tokens(1, (B, N))
    cache = bb.init_cache(B, MAX_LEN)
    out = fwd(params, cache, jnp.asarray(seq), taps=FAMILY_TAPS)
    assert isinstance(out.cache, MhcCache) and out.taps.shape == (B, N, 3 * D)
    model_kv = np.asarray(out.cache.kv[:, :, :N])
    ref_logits, means, ref_kv = reference_mhc(params, cfg, jnp.asarray(seq), attend_kv=model_kv)
    assert_within_one_fp8_step(model_kv, ref_kv, what="cached KV values")
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref_logits), atol=1e-4, rtol=0)
    assert float(jnp.std(ref_logits)) > 0.1  # not a degenerate model
    for j, layer in enumerate(FAMILY_TAPS):  # entry of layer i = mean of the streams entering it
        np.testing.assert_allclose(np.asarray(out.taps[..., j * D:(j + 1) * D]), np.asarray(means[layer]),
                                   atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.taps[..., :D]), np.asarray(bb.embed(params, jnp.asarray(seq))))
    if not cfg.n_routed_experts:
        return  # output-mode taps are the same code path; checked once (saves a compile)
    outp = fwd(params, cache, jnp.asarray(seq), taps=(-1, 2, cfg.n_layers - 1), tap_mode="output")
    for j, state in enumerate((0, 3, cfg.n_layers)):  # output of i = entry of i + 1; -1 = embeddings
        np.testing.assert_allclose(np.asarray(outp.taps[..., j * D:(j + 1) * D]), np.asarray(means[state]),
                                   atol=1e-4, rtol=0)


def test_mhc_incremental_decoding_with_rollback_matches_full(mhc_fp8_and_smooth):
    """Prefill + decode calls of 4 and 1 tokens with rollbacks = one full forward: the committed KV rows
    with the shipped fp8 rounding, the logits and taps with it off.

    The two sides compute the same rows in [B, 4], [B, 1] and [B, 16] calls, which XLA:CPU rounds
    differently in the last bits (~5e-6 on the KV rows). With the fp8 KV rounding a value sitting near a
    rounding midpoint then moves by one fp8 step, and every later logit of that row by up to 0.1, so with
    kv_fp8 on only the cache is compared: every committed row within one fp8 step, at most 1% of the values
    different. A wrong slot, a leaked rejected draft or a wrong position changes most of a row by O(1) and
    fails both variants; without the rounding the logits and taps must agree to 1e-4."""
    bb, params, fwd = mhc_fp8_and_smooth
    seq = random_tokens(2, (B, N))
    taps = FAMILY_TAPS
    full = fwd(params, bb.init_cache(B, MAX_LEN), jnp.asarray(seq), taps=taps)
    logits, feats, cache = decode_schedule(bb, fwd, params, seq, PREFILL, STEPS, taps=taps)
    m = logits.shape[1]
    assert np.all(np.asarray(cache.length) == m)
    if bb.cfg.kv_fp8:
        assert_within_one_fp8_step(cache.kv[:, :, :m], full.cache.kv[:, :, :m], what="cached KV values")
    else:
        np.testing.assert_allclose(cache.kv[:, :, :m], full.cache.kv[:, :, :m], atol=1e-4, rtol=0)
        np.testing.assert_allclose(logits, np.asarray(full.logits[:, :m]), atol=1e-4, rtol=0)
        np.testing.assert_allclose(feats, np.asarray(full.taps[:, :m]), atol=1e-4, rtol=0)


def test_mhc_config_errors():
    raw = json.loads(MHC_JSON.read_text())
    assert MhcConfig.from_dict({**raw, "vocab": 512}).vocab_size == 512
    with pytest.raises(ConfigError, match=r"'vocab_size' and its alias 'vocab' disagree"):
        MhcConfig.from_dict({**raw, "vocab": 100})
    with pytest.raises(ConfigError, match=r"'n_mtp_layers' is not an MhcConfig field"):
        MhcConfig.from_dict({**raw, "n_mtp_layers": 1})
    with pytest.raises(ConfigError, match=r"'o_groups': expected a divisor of n_heads=4"):
        MhcConfig.from_dict({**raw, "o_groups": 3})
    with pytest.raises(ConfigError, match=r"'head_dim': expected a multiple of 32 when kv_fp8"):
        MhcConfig.from_dict({**raw, "head_dim": 48})
    with pytest.raises(ConfigError, match=r"'n_activated_experts': expected at most n_routed_experts=4"):
        MhcConfig.from_dict({**raw, "n_activated_experts": 5})
    # a dense model's MoE fields are unused, but a malformed value in the file is still named
    dense = {**raw, "n_routed_experts": 0}
    MhcConfig.from_dict(dense)
    for key, value in (("moe_inter_dim", "32"), ("n_activated_experts", 1.5), ("score_func", None)):
        with pytest.raises(ConfigError, match=f"'{key}': expected"):
            MhcConfig.from_dict({**dense, key: value})
    with pytest.raises(ConfigError, match="'n_routed_experts': expected a non-negative integer"):
        MhcConfig.from_dict({**raw, "n_routed_experts": "4"})
