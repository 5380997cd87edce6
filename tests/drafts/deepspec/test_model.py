"""The DeepSpec ("qwen3") draft (dspark_jax.drafts.deepspec.model): every formula against plain numpy
(helpers.deepspec), from a DeepSpec checkpoint through the public API, and the shared speculative round
with a Qwen3 backbone (greedy == plain decoding)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import oracle_propose, padded, plain_greedy_tokens, random_prompts
from helpers.deepspec import (CFG, K, np_context, np_propose, np_rms, np_rope_half, our_params, pair,
                              random_hf_weights, released_like)

from dspark_jax import drafts, sampling
from dspark_jax import spec_round as sr
from dspark_jax.checkpoint import deepspec as ckpt
from dspark_jax.drafts.deepspec.model import DeepSpecDraft, context_kv


@pytest.fixture(scope="module", params=["vanilla", "gated", "RNN"])
def checkpoint(request, tmp_path_factory):
    """A DeepSpec-layout checkpoint folder of the tiny config with each Markov head type
    -> (folder, float64 weights, raw config)."""
    return released_like(str(tmp_path_factory.mktemp("deepspec")), request.param)


# ---------------------------------------------------------------------------------------------------
# Formulas against numpy
# ---------------------------------------------------------------------------------------------------


def _context_features(params, cfg, main_hidden):
    """c = hidden_norm(fc(concat taps)) [..., n_taps*D] -> [..., D], the first step of `DeepSpecDraft.context_kv`
    (the module function `context_features` it replaces is gone)."""
    return DeepSpecDraft(cfg).apply({"params": params}, main_hidden, method=lambda m, x: m.hidden_norm(m.fc(x)))


def test_context_features_and_kv_injection_with_k_norm_and_split_half_rope():
    w = random_hf_weights(CFG, seed=1)
    params = our_params(w)
    rng = np.random.default_rng(0)
    taps = rng.normal(size=(2, 6, CFG.main_hidden_dim))
    pos = np.array([np.arange(100, 106), np.arange(6)])  # absolute positions of the rows
    k, v = jax.jit(context_kv, static_argnums=1)(params, CFG, jnp.asarray(taps, jnp.float32), jnp.asarray(pos))
    for b in range(2):
        c = np_context(w, CFG, taps[b])
        np.testing.assert_allclose(_context_features(params, CFG, jnp.asarray(taps[b], jnp.float32)), c,
                                   rtol=2e-5, atol=2e-5)
        for i in range(CFG.num_hidden_layers):
            p = f"layers.{i}.self_attn."
            kk = np_rms((c @ w[p + "k_proj.weight"].T).reshape(6, CFG.num_key_value_heads, -1), w[p + "k_norm.weight"],
                        CFG.rms_norm_eps)
            np.testing.assert_allclose(k[i, b], np_rope_half(kk, pos[b], CFG.rope_theta), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(v[i, b], (c @ w[p + "v_proj.weight"].T).reshape(6, CFG.num_key_value_heads, -1),
                                       rtol=1e-4, atol=1e-4)


def test_propose_from_a_deepspec_checkpoint_equals_numpy(checkpoint):
    """The whole draft: checkpoint -> loader -> prefill/ingest -> propose, against np_propose on the
    checkpoint's own tensors (context from fc + hidden_norm, K/V injection with k_norm on both parts,
    split-half RoPE at absolute positions, the non-causal block over ALL context rows, final norm, the
    tied head, the Markov bias and the confidence head with its bias)."""
    folder, weights, _ = checkpoint
    cfg, params, tied = ckpt.load_deepspec_draft(folder, dtype="float32")
    cfg = cfg.replace(compute_dtype="float32")
    assert cfg == CFG.replace(extra_json=cfg.extra_json, markov_head_type=cfg.markov_head_type)
    rng = np.random.default_rng(4)
    t = 23  # longer than any window a V4.1 draft would use here: DeepSpec sees everything
    taps = rng.normal(size=(2, t, cfg.main_hidden_dim))
    lengths, anchors = [t, 9], [17, 5]
    st = drafts.init_state(cfg, 2, 32)
    st = drafts.prefill(params, cfg, st, jnp.asarray(taps[:, :12], jnp.float32), jnp.asarray([12, 4]))
    # the second chunk carries rows past row 1's count (garbage beyond its length must stay invisible)
    st = drafts.ingest(params, cfg, st, jnp.asarray(np.concatenate([taps[0:1, 12:], taps[1:2, 4:15]]), jnp.float32),
                       jnp.asarray([t - 12, 5]))
    np.testing.assert_array_equal(st.length, lengths)
    out = jax.jit(drafts.propose, static_argnums=2)(params, jax.tree.map(jnp.asarray, tied), cfg, st,
                                                    jnp.asarray(anchors), sampling.SamplingParams.greedy(2),
                                                    jnp.arange(2, dtype=jnp.uint32))
    for b in range(2):
        h, logits, toks, conf = np_propose(weights, cfg, taps[b, :lengths[b]], anchors[b])
        np.testing.assert_allclose(out.hidden[b], h, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(out.logits[b], logits, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(out.conf_logits[b], conf, rtol=2e-4, atol=2e-4)
        np.testing.assert_array_equal(out.tokens[b], toks)
        np.testing.assert_array_equal(out.markov_emb[b], weights["markov_head.markov_w1.weight"][[anchors[b], *toks[:-1]]])


def test_ingest_in_chunks_equals_prefill_and_reset_rows():
    params = our_params(random_hf_weights(CFG, seed=5))
    taps = jnp.asarray(np.random.default_rng(5).normal(size=(2, 10, CFG.main_hidden_dim)), jnp.float32)
    ingest = jax.jit(drafts.ingest, static_argnums=1)
    ref = jax.jit(drafts.prefill, static_argnums=1)(params, CFG, drafts.init_state(CFG, 2, 16), taps,
                                                    jnp.asarray([10, 7]))
    st = drafts.init_state(CFG, 2, 16)
    for lo, hi in ((0, 3), (3, 4), (4, 10)):
        n = jnp.minimum(jnp.asarray([10, 7]), hi) - jnp.minimum(jnp.asarray([10, 7]), lo)
        st = ingest(params, CFG, st, taps[:, lo:hi], n)  # row 1 stops at 7 inside the last chunk
    for r, n in ((0, 10), (1, 7)):
        np.testing.assert_allclose(st.ctx_k[:, r, :n], ref.ctx_k[:, r, :n], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(st.ctx_v[:, r, :n], ref.ctx_v[:, r, :n], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(drafts.reset_rows(st, jnp.asarray([False, True])).length, [10, 0])
    with pytest.raises(ValueError, match="max_len"):
        drafts.init_state(CFG, 2)


# ---------------------------------------------------------------------------------------------------
# The shared speculative round with a Qwen3 backbone
# ---------------------------------------------------------------------------------------------------


N, STEPS, MAXLEN = 22, 40, 72


@functools.lru_cache(maxsize=None)
def plain_greedy():
    """Plain autoregressive greedy decoding of the Qwen3 backbone: i32[N, STEPS + 1]. (XLA:CPU rows may
    differ in the last bits between a 1-token and a K+1-token forward, see helpers/spec.py
    `family`; the Qwen3 backbone has no fp8 rounding to amplify that.)"""
    bb, weights = pair()
    return plain_greedy_tokens(sr.SpecModel(bb, CFG, impl="xla"), weights, random_prompts(N, seed=1), STEPS, MAXLEN)


@pytest.mark.parametrize("which", ["oracle", "real", "real-gated", "real-rnn"])
def test_greedy_speculative_equals_plain_decoding(which):
    """22 prompts in one batch, every row cycling through verify lengths 0..K out of phase, with the
    oracle draft (every accepted count happens) and with the real DeepSpec draft, with each Markov head
    (its context state is then checked against a fresh prefill of the committed sequence)."""
    want = plain_greedy()
    head = which.split("-")[1] if "-" in which else "vanilla"
    cfg = CFG.replace(markov_head_type=head)
    bb, weights = pair(head)
    model = sr.SpecModel(bb, cfg, impl="xla", propose_fn=oracle_propose if which == "oracle" else None)
    assert model.tap_mode == "output"
    prompt, plen = padded(random_prompts(N, seed=1))
    sp, seeds, active = sampling.SamplingParams.greedy(N), jnp.arange(N, dtype=jnp.uint32), jnp.ones(N, bool)
    state, first = jax.jit(sr.start, static_argnums=0)(model, weights, sr.init_state(model, N, MAXLEN), prompt, plen,
                                                       active, sp, seeds)
    rnd = jax.jit(sr.spec_round, static_argnums=0, static_argnames=("width", "mode", "filtering"))
    got = [[int(f)] for f in first]
    seqs = [list(np.asarray(prompt[r, :plen[r]])) + [int(first[r])] for r in range(N)]
    accepted = np.zeros(K + 1, int)
    i = 0
    while min(len(g) for g in got) < STEPS + 1:
        lengths = (jnp.arange(N) + i) % (K + 1)
        state, out = rnd(model, weights, state, sp, seeds, active, width=K + 1, mode="fixed", num_verify=lengths)
        out = jax.device_get(out)
        np.testing.assert_array_equal(out.num_verify, lengths)
        for r in range(N):
            new = [int(t) for t in out.tokens[r, :out.num_emitted[r]]]
            got[r] += new
            seqs[r] += new
            accepted[out.num_accepted[r]] += 1
        i += 1
    for r in range(N):
        assert got[r][:STEPS + 1] == want[r].tolist(), r
    if which == "oracle":
        assert (accepted > 0).all(), accepted
        return
    # The draft holds the context K/V of exactly the committed positions (all but the last anchor).
    committed = [s[:-1] for s in seqs]
    np.testing.assert_array_equal(state.draft.length, [len(c) for c in committed])
    np.testing.assert_array_equal(state.draft.length, state.cache.length)
    t = max(len(c) for c in committed)
    toks = jnp.asarray([c + [0] * (t - len(c)) for c in committed], jnp.int32)
    fresh = bb.forward(weights.backbone, bb.init_cache(N, MAXLEN), toks, taps=cfg.target_layer_ids, tap_mode="output")
    ref = drafts.prefill(weights.draft, cfg, drafts.init_state(cfg, N, MAXLEN), fresh.taps,
                         jnp.asarray([len(c) for c in committed]))
    for r in range(N):
        n = len(committed[r])
        np.testing.assert_allclose(state.draft.ctx_k[:, r, :n], ref.ctx_k[:, r, :n], atol=1e-4)
        np.testing.assert_allclose(state.draft.ctx_v[:, r, :n], ref.ctx_v[:, r, :n], atol=1e-4)


def test_spec_model_takes_the_family_tap_mode():
    bb, _ = pair()
    assert sr.SpecModel(bb, CFG).tap_mode == "output"
    with pytest.raises(ValueError, match="reads backbone taps 'output'"):
        sr.SpecModel(bb, CFG, tap_mode="entry")
