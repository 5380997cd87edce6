"""The DeepSpec ("qwen3") draft family: every formula against plain numpy, the shared speculative round
with a Qwen3 backbone (greedy == plain decoding), the checkpoint layout round trip, and training."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONFIGS
from spec_helpers import oracle_propose, padded, plain_greedy_tokens, random_prompts

from dspark_jax import deepspec as ds
from dspark_jax import draft, sampling
from dspark_jax import spec_round as sr
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config
from dspark_jax.checkpoint import deepspec as ckpt
from dspark_jax.checkpoint.safetensors_io import CheckpointError, open_checkpoint
from dspark_jax.checkpoint.trees import unflatten_paths
from dspark_jax.config import ConfigError, DSparkConfig

CFG = DSparkConfig.from_json(CONFIGS / "tiny_deepspec.json")
K = CFG.block_size
BCFG = Qwen3Config.from_hf_json(CONFIGS / "tiny_qwen3_backbone.json")


# ---------------------------------------------------------------------------------------------------
# A DeepSpec checkpoint in its own layout, written independently of our table, and a numpy oracle
# that reads those tensors by their DeepSpec names (torch layout [out, in]).
# ---------------------------------------------------------------------------------------------------


def hf_names(cfg):
    """The tensor names and shapes of a DeepSpec Qwen3 draft, spelled out from the format."""
    d, f, hd, v, r = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size, cfg.markov_rank
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = {"embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "norm.weight": (d,),
           "fc.weight": (d, len(cfg.target_layer_ids) * d), "hidden_norm.weight": (d,),
           "markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r),
           "confidence_head.proj.weight": (1, d + r), "confidence_head.proj.bias": (1,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                    p + "mlp.down_proj.weight": (d, f)})
    return out


def random_hf_weights(cfg, seed=0):
    """bf16-representable float64 weights; norm scales far from 1 so a missing norm cannot hide."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_names(cfg).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.5 * rng.normal(size=shape)
        elif name == "confidence_head.proj.bias":
            w = np.array([0.7])
        elif name == "embed_tokens.weight":
            w = rng.normal(size=shape)
        else:
            w = rng.normal(size=shape) * shape[-1] ** -0.5
        out[name] = np.asarray(w.astype(ml_dtypes.bfloat16), np.float64)
    return out


def write_checkpoint(folder, cfg_dict, weights):
    """config.json + a bf16 model.safetensors, written by torch's safetensors (as DeepSpec releases are)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    try:
        import torch
        from safetensors.torch import save_file as torch_save
    except ImportError:  # our own writer then (still the DeepSpec names and layout)
        import ml_dtypes

        from dspark_jax.checkpoint.safetensors_io import save_file

        save_file(folder / "model.safetensors", {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()})
        return
    torch_save({k: torch.tensor(v, dtype=torch.float32).to(torch.bfloat16) for k, v in weights.items()},
               str(folder / "model.safetensors"), metadata={"format": "pt"})


def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_rope_half(x, pos, theta):
    """rotate_half RoPE with explicit pairs (i, i + d/2); x [n, heads, d], pos [n]."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    out = x.copy()
    for i in range(d // 2):
        ang = np.asarray(pos, np.float64) * theta ** (-2.0 * i / d)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        out[..., i] = x[..., i] * c - x[..., i + d // 2] * s
        out[..., i + d // 2] = x[..., i + d // 2] * c + x[..., i] * s
    return out


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_context(W, cfg, taps):
    """c = hidden_norm(fc(taps)) for taps [T, n_taps*D]."""
    return np_rms(taps @ W["fc.weight"].T, W["hidden_norm.weight"], cfg.rms_norm_eps)


def np_layer(W, cfg, i, x, block_pos, c, ctx_pos):
    """One DeepSpec layer: x [K, D] block rows, c [T, D] context features (all visible)."""
    p, eps, hd = f"layers.{i}.", cfg.rms_norm_eps, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    h = np_rms(x, W[p + "input_layernorm.weight"], eps)
    q = np_rms((h @ W[p + "self_attn.q_proj.weight"].T).reshape(len(x), nh, hd), W[p + "self_attn.q_norm.weight"], eps)
    q = np_rope_half(q, block_pos, cfg.rope_theta)

    def keys(src, pos):
        k = np_rms((src @ W[p + "self_attn.k_proj.weight"].T).reshape(len(src), nkv, hd),
                   W[p + "self_attn.k_norm.weight"], eps)
        return np_rope_half(k, pos, cfg.rope_theta), (src @ W[p + "self_attn.v_proj.weight"].T).reshape(len(src), nkv, hd)

    kc, vc = keys(c, ctx_pos)
    kb, vb = keys(h, block_pos)
    kk, vv = np.concatenate([kc, kb]), np.concatenate([vc, vb])  # context rows first
    o = np.zeros((len(x), nh, hd))
    for hh in range(nh):
        g = hh // (nh // nkv)
        s = q[:, hh] @ kk[:, g].T / np.sqrt(hd)  # no mask: every block row sees every key
        pr = np.exp(s - s.max(-1, keepdims=True))
        o[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ vv[:, g]
    x = x + o.reshape(len(x), -1) @ W[p + "self_attn.o_proj.weight"].T
    h = np_rms(x, W[p + "post_attention_layernorm.weight"], eps)
    return x + (np_silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) @ \
        W[p + "mlp.down_proj.weight"].T


def np_propose(W, cfg, taps, anchor):
    """Greedy DeepSpec proposal for one request whose committed context is taps [T, n_taps*D] (positions
    0..T-1); the anchor sits at position T. -> (pre-norm h, biased logits, tokens, confidence logits)."""
    t = len(taps)
    c = np_context(W, cfg, taps)
    ids = [anchor] + [cfg.mask_token_id] * (cfg.block_size - 1)
    x = W["embed_tokens.weight"][ids]
    block_pos = t + np.arange(cfg.block_size)
    for i in range(cfg.num_hidden_layers):
        x = np_layer(W, cfg, i, x, block_pos, c, np.arange(t))
    final = np_rms(x, W["norm.weight"], cfg.rms_norm_eps)
    u = final @ W["lm_head.weight"].T
    w1, w2 = W["markov_head.markov_w1.weight"], W["markov_head.markov_w2.weight"]
    prev, toks, logits, conf = anchor, [], [], []
    for k in range(cfg.block_size):
        lk = u[k] + w1[prev] @ w2.T  # Markov bias of the previous token
        conf.append(np.concatenate([final[k], w1[prev]]) @ W["confidence_head.proj.weight"][0]
                    + W["confidence_head.proj.bias"][0])
        prev = int(np.argmax(lk))
        toks.append(prev)
        logits.append(lk)
    return x, np.array(logits), np.array(toks), np.array(conf)


@functools.lru_cache(maxsize=None)
def released_like(tmp_root):
    """A DeepSpec-layout checkpoint folder of the tiny config -> (folder, float64 weights, raw config)."""
    from pathlib import Path

    folder = Path(tmp_root) / "dspark_qwen3_tiny_block5"
    raw = {k: v for k, v in json.loads((CONFIGS / "tiny_deepspec.json").read_text()).items()
           if k not in ("family", "param_dtype", "compute_dtype")}
    raw.update(torch_dtype="bfloat16", num_anchors=512, bos_token_id=1, layer_types=["full_attention"] * 2)
    weights = random_hf_weights(CFG, seed=3)
    write_checkpoint(folder, raw, weights)
    return folder, weights, raw


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return released_like(str(tmp_path_factory.mktemp("deepspec")))


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


def test_config_from_a_deepspec_config_json_and_errors():
    raw = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 4096, "vocab_size": 151936,
           "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
           "num_target_layers": 36, "block_size": 7, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33],
           "markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
           "confidence_head_with_markov": True, "num_anchors": 512, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False}
    cfg = DSparkConfig.from_dict(raw)
    assert isinstance(cfg, ds.DeepSpecConfig) and cfg.family == "qwen3" and cfg.tap_mode == "output"
    assert (cfg.block_size, cfg.noise_token_id, cfg.dim, cfg.n_taps, cfg.main_hidden_dim, cfg.confidence_in_dim) == \
        (7, 151669, 4096, 5, 5 * 4096, 4096 + 256)
    assert cfg.to_hf_dict() == {**raw, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert DSparkConfig.from_dict(cfg.to_dict()) == cfg  # our spelling round-trips (bundles)
    shapes = {k: v.shape for k, v in jax.tree_util.tree_flatten_with_path(draft.abstract_params(cfg))[0]}
    assert sum(int(np.prod(s)) for s in shapes.values()) == sum(
        int(np.prod(s)) for n, s in ckpt.expected_tensors(cfg).items() if n not in ckpt.TIED.values())
    for change, word in ((dict(target_layer_ids=[1, 9, 35]), "last layer"), (dict(markov_head_type="fir"), "vanilla"),
                         (dict(mask_token_id=151936), "mask_token_id"), (dict(target_layer_ids=[9, 1]), "increasing"),
                         (dict(attention_bias=True), "attention_bias")):
        with pytest.raises(ConfigError, match=word):
            DSparkConfig.from_dict({**raw, **change})
    for key in ("block_size", "markov_rank", "enable_confidence_head"):  # DeepSpec's loader requires them too
        with pytest.raises(ConfigError, match=f"'{key}' is missing"):
            DSparkConfig.from_dict({k: v for k, v in raw.items() if k != key})
    # What DeepSpec's loader needs is written even when the source lacked it; no head type without a head.
    bare = {k: v for k, v in raw.items() if k not in ("num_anchors", "tie_word_embeddings")}
    written = DSparkConfig.from_dict({**bare, "markov_rank": 0, "confidence_head_with_markov": False}).to_hf_dict()
    assert written["num_anchors"] == 512 and written["tie_word_embeddings"] is False
    assert "markov_head_type" not in written
    with pytest.raises(ConfigError, match="DeepSpecConfig"):
        DSparkConfig(family="qwen3")


# ---------------------------------------------------------------------------------------------------
# Formulas against numpy
# ---------------------------------------------------------------------------------------------------


def _our_params(weights, cfg=CFG):
    """Our tree from the float64 DeepSpec weights (through the loader's table transforms)."""
    flat = {}
    for it in ckpt.expand_table(cfg):
        fwd = ckpt.TRANSFORMS[it.entry.transform][0]
        parts = [fwd(weights[n]) for n in it.names]
        flat[it.path] = jnp.asarray(np.stack(parts) if it.entry.per_layer else parts[0], jnp.float32)
    return unflatten_paths(flat)


def test_context_features_and_kv_injection_with_k_norm_and_split_half_rope():
    w = random_hf_weights(CFG, seed=1)
    params = _our_params(w)
    rng = np.random.default_rng(0)
    taps = rng.normal(size=(2, 6, CFG.main_hidden_dim))
    pos = np.array([np.arange(100, 106), np.arange(6)])  # absolute positions of the rows
    k, v = jax.jit(ds.context_kv, static_argnums=1)(params, CFG, jnp.asarray(taps, jnp.float32), jnp.asarray(pos))
    for b in range(2):
        c = np_context(w, CFG, taps[b])
        np.testing.assert_allclose(ds.context_features(params, CFG, jnp.asarray(taps[b], jnp.float32)), c,
                                   rtol=2e-5, atol=2e-5)
        for i in range(CFG.num_hidden_layers):
            p = f"layers.{i}.self_attn."
            kk = np_rms((c @ w[p + "k_proj.weight"].T).reshape(6, CFG.num_key_value_heads, -1), w[p + "k_norm.weight"],
                        CFG.rms_norm_eps)
            np.testing.assert_allclose(k[i, b], np_rope_half(kk, pos[b], CFG.rope_theta), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(v[i, b], (c @ w[p + "v_proj.weight"].T).reshape(6, CFG.num_key_value_heads, -1),
                                       rtol=1e-4, atol=1e-4)


def test_block_attention_sees_visible_context_and_its_whole_block():
    rng = np.random.default_rng(1)
    b, n, kk, h, hkv, hd, s = 2, 2, 4, 4, 2, 8, 7
    q, kb, vb = (rng.normal(size=sh) for sh in ((b, n, kk, h, hd), (b, n, kk, hkv, hd), (b, n, kk, hkv, hd)))
    kc, vc = rng.normal(size=(b, s, hkv, hd)), rng.normal(size=(b, s, hkv, hd))
    vis = np.arange(s)[None, None, :] < np.array([[0, 3], [7, 5]])[..., None]
    kc[0, 6] = np.inf  # a row no block sees may hold anything
    got = ds.block_attention(*(jnp.asarray(a, jnp.float32) for a in (q, kb, vb, kc, vc)), jnp.asarray(vis), hd ** -0.5)
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
    got2 = ds.block_attention(*(jnp.asarray(a, jnp.float32) for a in (q, kb2, vb, kc, vc)), jnp.asarray(vis), hd ** -0.5)
    assert not np.allclose(got2[:, :, 0], got[:, :, 0])


def test_confidence_head_has_a_bias_and_reads_normed_h_and_w1_prev():
    params = _our_params(random_hf_weights(CFG, seed=2))
    rng = np.random.default_rng(2)
    normed, emb = rng.normal(size=(3, K, CFG.dim)), rng.normal(size=(3, K, CFG.markov_rank))
    z = ds.confidence_logits(params, CFG, jnp.asarray(normed, jnp.float32), jnp.asarray(emb, jnp.float32))
    w = np.asarray(params["confidence"]["kernel"])
    np.testing.assert_allclose(z, np.concatenate([normed, emb], -1) @ w + float(params["confidence"]["bias"][0]),
                               rtol=1e-5, atol=1e-5)
    cfg2 = CFG.replace(confidence_head_with_markov=False)
    p2 = {**params, "confidence": {"kernel": params["confidence"]["kernel"][:CFG.dim], "bias": params["confidence"]["bias"]}}
    np.testing.assert_allclose(ds.confidence_logits(p2, cfg2, jnp.asarray(normed, jnp.float32), None),
                               normed @ w[:CFG.dim] + float(params["confidence"]["bias"][0]), rtol=1e-5, atol=1e-5)


def test_propose_from_a_deepspec_checkpoint_equals_numpy(checkpoint):
    """The whole draft: checkpoint -> loader -> prefill/ingest -> propose, against np_propose on the
    checkpoint's own tensors (context from fc + hidden_norm, K/V injection with k_norm on both parts,
    split-half RoPE at absolute positions, the non-causal block over ALL context rows, final norm, the
    tied head, the Markov bias and the confidence head with its bias)."""
    folder, weights, _ = checkpoint
    cfg, params, tied = ckpt.load_deepspec_draft(folder, dtype="float32")
    cfg = cfg.replace(compute_dtype="float32")
    assert cfg == CFG.replace(extra_json=cfg.extra_json)
    rng = np.random.default_rng(4)
    t = 23  # longer than any window a V4.1 draft would use here: DeepSpec sees everything
    taps = rng.normal(size=(2, t, cfg.main_hidden_dim))
    lengths, anchors = [t, 9], [17, 5]
    st = draft.init_state(cfg, 2, 32)
    st = draft.prefill(params, cfg, st, jnp.asarray(taps[:, :12], jnp.float32), jnp.asarray([12, 4]))
    # the second chunk carries rows past row 1's count (garbage beyond its length must stay invisible)
    st = draft.ingest(params, cfg, st, jnp.asarray(np.concatenate([taps[0:1, 12:], taps[1:2, 4:15]]), jnp.float32),
                      jnp.asarray([t - 12, 5]))
    np.testing.assert_array_equal(st.length, lengths)
    out = jax.jit(draft.propose, static_argnums=2)(params, jax.tree.map(jnp.asarray, tied), cfg, st,
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
    params = _our_params(random_hf_weights(CFG, seed=5))
    taps = jnp.asarray(np.random.default_rng(5).normal(size=(2, 10, CFG.main_hidden_dim)), jnp.float32)
    ingest = jax.jit(draft.ingest, static_argnums=1)
    ref = jax.jit(draft.prefill, static_argnums=1)(params, CFG, draft.init_state(CFG, 2, 16), taps, jnp.asarray([10, 7]))
    st = draft.init_state(CFG, 2, 16)
    for lo, hi in ((0, 3), (3, 4), (4, 10)):
        n = jnp.minimum(jnp.asarray([10, 7]), hi) - jnp.minimum(jnp.asarray([10, 7]), lo)
        st = ingest(params, CFG, st, taps[:, lo:hi], n)  # row 1 stops at 7 inside the last chunk
    for r, n in ((0, 10), (1, 7)):
        np.testing.assert_allclose(st.ctx_k[:, r, :n], ref.ctx_k[:, r, :n], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(st.ctx_v[:, r, :n], ref.ctx_v[:, r, :n], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(draft.reset_rows(st, jnp.asarray([False, True])).length, [10, 0])
    with pytest.raises(ValueError, match="max_len"):
        draft.init_state(CFG, 2)


# ---------------------------------------------------------------------------------------------------
# The shared speculative round with a Qwen3 backbone
# ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def pair():
    bb = Qwen3Backbone(BCFG)
    bp = bb.init_params(jax.random.key(0))
    dp = draft.init_params(CFG, jax.random.key(1))
    return bb, sr.Weights(bp, dp, bb.tied(bp), jnp.ones(K))


N, STEPS, MAXLEN = 22, 40, 72


@functools.lru_cache(maxsize=None)
def plain_greedy():
    """Plain autoregressive greedy decoding of the Qwen3 backbone: i32[N, STEPS + 1]. (XLA:CPU rows may
    differ in the last bits between a 1-token and a K+1-token forward, see tests/test_spec_round.py
    `family`; the Qwen3 backbone has no fp8 rounding to amplify that.)"""
    bb, weights = pair()
    return plain_greedy_tokens(sr.SpecModel(bb, CFG, impl="xla"), weights, random_prompts(N, seed=1), STEPS, MAXLEN)


@pytest.mark.parametrize("which", ["oracle", "real"])
def test_greedy_speculative_equals_plain_decoding(which):
    """22 prompts in one batch, every row cycling through verify lengths 0..K out of phase, with the
    oracle draft (every accepted count happens) and with the real DeepSpec draft (its context state is
    then checked against a fresh prefill of the committed sequence)."""
    want = plain_greedy()
    bb, weights = pair()
    model = sr.SpecModel(bb, CFG, impl="xla", propose_fn=oracle_propose if which == "oracle" else None)
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
    fresh = bb.forward(weights.backbone, bb.init_cache(N, MAXLEN), toks, taps=CFG.target_layer_ids, tap_mode="output")
    ref = draft.prefill(weights.draft, CFG, draft.init_state(CFG, N, MAXLEN), fresh.taps,
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


def test_a_bundle_records_the_family_tap_mode(tmp_path):
    from dspark_jax.bundle import load_bundle, save_bundle

    bb, weights = pair()
    save_bundle(tmp_path, backbone_family="qwen3", backbone=bb, backbone_params=weights.backbone, draft_cfg=CFG,
                draft_params=weights.draft)
    assert json.loads((tmp_path / "bundle.json").read_text())["tap_mode"] == "output"
    assert load_bundle(tmp_path, impl="xla").model.tap_mode == "output"


# ---------------------------------------------------------------------------------------------------
# Checkpoint layout
# ---------------------------------------------------------------------------------------------------


def test_checkpoint_loads_runs_and_exports_an_identical_file_set(checkpoint, tmp_path):
    folder, _, raw = checkpoint
    cfg, params, tied = ckpt.load_deepspec_draft(folder)  # bf16, as released
    assert jax.tree.structure(params) == jax.tree.structure(draft.abstract_params(cfg))

    @jax.jit
    def run(params, tied):
        st = draft.prefill(params, cfg, draft.init_state(cfg, 1, 8), jnp.ones((1, 3, cfg.main_hidden_dim)),
                           jnp.asarray([3]))
        return draft.propose(params, tied, cfg, st, jnp.asarray([7]), sampling.SamplingParams.greedy(1),
                             jnp.zeros((1,), jnp.uint32))

    out = run(params, tied)
    assert np.isfinite(np.asarray(out.logits)).all() and np.isfinite(np.asarray(out.conf_logits)).all()
    for name, path in (("export", tmp_path / "export"), ("convert", tmp_path / "convert")):
        if name == "export":
            ckpt.export_deepspec_draft(params, tied, cfg, path)
        else:
            ckpt.convert_deepspec_safetensors(folder, path)
        assert json.loads((path / "config.json").read_text()) == raw
        a, b = open_checkpoint(folder), open_checkpoint(path)
        assert sorted(a.names) == sorted(b.names)
        for n in a.names:
            ia, ib = a.info(n), b.info(n)
            assert (ia.dtype, ia.shape) == (ib.dtype, ib.shape), n
            assert a.view(n).tobytes() == b.view(n).tobytes(), n


def test_checkpoint_loader_is_strict_and_names_the_tensor(checkpoint, tmp_path):
    folder, weights, raw = checkpoint
    cases = {
        "missing": ({k: v for k, v in weights.items() if k != "layers.1.self_attn.k_norm.weight"},
                    "missing.*layers.1.self_attn.k_norm.weight"),
        "extra": ({**weights, "layers.2.input_layernorm.weight": weights["norm.weight"]},
                  "unexpected.*layers.2.input_layernorm.weight"),
        "shape": ({**weights, "fc.weight": weights["fc.weight"][:, :-1]}, "'fc.weight' has shape"),
        "prefixed": ({f"model.{k}": v for k, v in weights.items()}, "missing"),
    }
    for name, (w, pattern) in cases.items():
        write_checkpoint(tmp_path / name, raw, w)
        with pytest.raises(CheckpointError, match=pattern):
            ckpt.load_deepspec_draft(tmp_path / name)


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------


def test_training_blocks_see_all_context_strictly_before_the_anchor():
    """train_forward = the inference draft after committing positions 0..anchor-1, for anchors far
    beyond any window; context at or after the anchor never matters, position 0 always does."""
    from dspark_jax.train import anchors as A

    params = _our_params(random_hf_weights(CFG, seed=6))
    tied = {"embed": jnp.asarray(np.random.default_rng(7).normal(size=(CFG.vocab_size, CFG.dim)), jnp.float32),
            "head": jnp.asarray(np.random.default_rng(8).normal(size=(CFG.vocab_size, CFG.dim)) * 0.1, jnp.float32)}
    rng = np.random.default_rng(9)
    t = 40
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size - 1, size=(1, t)), jnp.int32)
    mh = rng.normal(size=(1, t, CFG.main_hidden_dim))
    anchors = jnp.asarray([[0, 6, 33]], jnp.int32)
    blocks = A.make_blocks(tokens, jnp.ones((1, t), bool), anchors, jnp.ones((1, 3), bool), K, CFG.noise_token_id)
    fwd = jax.jit(lambda m: ds.train_forward(params, tied, CFG, m, blocks, anchors))
    h, normed, emb, conf = fwd(jnp.asarray(mh, jnp.float32))
    infer = jax.jit(lambda m, n, a: draft.draft_hidden(
        params, tied, CFG, draft.prefill(params, CFG, draft.init_state(CFG, 1, t), m, n), a))
    for i, a in enumerate([0, 6, 33]):
        hi, _ = infer(jnp.asarray(mh, jnp.float32), jnp.asarray([a]), tokens[:, a])
        np.testing.assert_allclose(h[i], hi[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(conf, ds.confidence_logits(params, CFG, normed, emb), rtol=1e-6, atol=1e-6)
    late = mh.copy()
    late[0, 33:] += 5.0  # at/after the last anchor: invisible to every block
    np.testing.assert_array_equal(fwd(jnp.asarray(late, jnp.float32))[0], h)
    early = mh.copy()
    early[0, 0] += 5.0  # position 0: seen by the anchor-33 block (no window)
    assert not np.allclose(fwd(jnp.asarray(early, jnp.float32))[0][2], h[2])


@pytest.mark.parametrize("variant", [dict(markov_rank=0, confidence_head_with_markov=False),
                                     dict(enable_confidence_head=False), dict(block_size=1)])
def test_pure_parallel_no_confidence_and_one_token_variants_trace(variant):
    """markov_rank 0 (DFlash-like), no confidence head and K = 1 go through propose and the training loss."""
    from dspark_jax.train import anchors as A
    from dspark_jax.train import loss as L
    from dspark_jax.train import model as M

    cfg = CFG.replace(**variant)
    params = draft.abstract_params(cfg)
    assert ("markov" in params) == bool(cfg.markov_rank) and ("confidence" in params) == cfg.enable_confidence_head
    tied = {"embed": jnp.zeros((cfg.vocab_size, cfg.dim)), "head": jnp.zeros((cfg.vocab_size, cfg.dim))}
    out = jax.eval_shape(lambda p: draft.propose(p, tied, cfg, draft.init_state(cfg, 2, 16), jnp.zeros(2, jnp.int32),
                                                 sampling.SamplingParams.greedy(2), jnp.zeros(2, jnp.uint32)), params)
    assert out.tokens.shape == (2, cfg.block_size) and out.conf_logits.shape == (2, cfg.block_size)
    blocks = A.make_blocks(jnp.zeros((2, 24), jnp.int32), jnp.ones((2, 24), bool), jnp.asarray([[0, 5], [3, 20]]),
                           jnp.ones((2, 2), bool), cfg.block_size, cfg.noise_token_id)

    def loss(p):
        acts = M.draft_forward(p, tied, cfg, jnp.zeros((2, 24, cfg.main_hidden_dim)), blocks, jnp.asarray([[0, 5], [3, 20]]))
        return L.loss_from_sums(M.block_loss_sums(p, tied, cfg, acts, jnp.zeros((2, 24, cfg.vocab_size)), blocks,
                                                  vocab_chunk=128))[0]

    value, grads = jax.eval_shape(jax.value_and_grad(loss), params)
    assert value.shape == () and jax.tree.structure(grads) == jax.tree.structure(params)


def test_dspark_train_trains_the_deepspec_family(tmp_path):
    """The trainer runs unchanged on a Qwen3 backbone + DeepSpec draft: taps at layer outputs by
    default, a conflicting tap mode is refused, the loss falls on a fixed batch."""
    from dspark_jax.parallel import make_mesh
    from dspark_jax.train import data as D
    from dspark_jax.train.config import RunConfig
    from dspark_jax.train.trainer import Trainer

    data = CONFIGS.parent / "tests" / "data" / "tiny_train.jsonl"
    raw = {"run_dir": str(tmp_path / "run"), "steps": 10, "global_batch": 4, "compute_dtype": "float32",
           "compiler_options": {"xla_backend_optimization_level": 0},
           "backbone": {"family": "qwen3", "config": str(CONFIGS / "tiny_qwen3_backbone.json")},
           "draft": {"config": str(CONFIGS / "tiny_deepspec.json")},
           "data": {"train": [str(data)], "seq_len": 32, "shuffle_buffer": 8, "anchors_per_seq": 4},
           "optim": {"lr": 3e-3, "warmup_frac": 0.1}, "loss": {"vocab_chunk": 128}, "log": {"every": 1}}
    mesh = make_mesh(devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="reads backbone taps 'output'"):
        Trainer(RunConfig.from_dict({**raw, "backbone": {**raw["backbone"], "tap_mode": "entry"}}), mesh=mesh)
    tr = Trainer(RunConfig.from_dict(raw), mesh=mesh)
    assert tr.spec.tap_mode == "output" and tr.spec_pair()[0].tap_mode == "output"
    batch = next(D.Batches(D.JsonlStream(D.DataConfig(train=(str(data),), seq_len=32, shuffle_buffer=8, seed=0,
                                                      anchors_per_seq=4), process_index=0, process_count=1),
                           per_host_batch=4))
    losses = [float(jax.device_get(tr.step(batch))["loss"]) for _ in range(6)]
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses


def test_dspark_convert_deepspec_to_bf16_orbax_and_a_serving_bundle(checkpoint, tmp_path):
    """`dspark convert --family deepspec`: the DeepSpec layout again (bf16 and via Orbax), and a bundle of a
    Hugging Face Qwen3 target folder + the draft that the engine serves."""
    import ml_dtypes

    from dspark_jax.backbones.qwen3 import hf_layer_map
    from dspark_jax.bundle import load_bundle
    from dspark_jax.checkpoint.safetensors_io import save_file
    from dspark_jax.cli import main
    from dspark_jax.serve.engine import Engine, EngineConfig, Request

    folder, weights, raw = checkpoint
    assert main(["convert", str(folder), str(tmp_path / "bf16"), "--to", "bf16", "--quiet"]) == 0  # family from config
    assert main(["convert", str(folder), str(tmp_path / "orbax"), "--family", "deepspec", "--to", "orbax",
                 "--quiet"]) == 0
    assert main(["convert", str(tmp_path / "orbax"), str(tmp_path / "back"), "--to", "bf16", "--quiet"]) == 0
    for out in ("bf16", "back"):
        a, b = open_checkpoint(folder), open_checkpoint(tmp_path / out)
        assert sorted(a.names) == sorted(b.names)
        assert all(a.view(n).tobytes() == b.view(n).tobytes() for n in a.names)
    assert main(["convert", str(folder), str(tmp_path / "x"), "--to", "fp8", "--quiet"]) == 2

    # A Qwen3 target in the Hugging Face layout, and the draft trained against it (its embed/head copies).
    bb = Qwen3Backbone(BCFG)
    bp = jax.device_get(bb.init_params(jax.random.key(0)))
    target = tmp_path / "qwen3_target"
    target.mkdir()
    (target / "config.json").write_text((CONFIGS / "tiny_qwen3_backbone.json").read_text())
    hf = {"model.embed_tokens.weight": bp["embed"], "model.norm.weight": bp["norm"]["scale"]}
    for suffix, (mod, leaf), _, _ in hf_layer_map(BCFG):
        for i in range(BCFG.num_hidden_layers):
            w = np.asarray(bp["layers"][mod][leaf][i])
            hf[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(w.T) if w.ndim == 2 else w
    save_file(target / "model.safetensors", {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in hf.items()})
    embed = np.asarray(np.asarray(bp["embed"]).astype(ml_dtypes.bfloat16), np.float64)  # the same bf16 values
    write_checkpoint(tmp_path / "draft", raw, {**weights, "embed_tokens.weight": embed, "lm_head.weight": embed})
    assert main(["convert", str(folder), str(tmp_path / "bad"), "--to", "bundle", "--backbone", str(target),
                 "--quiet"]) == 2  # its embed/head are not this target's
    assert main(["convert", str(tmp_path / "draft"), str(tmp_path / "bundle"), "--to", "bundle", "--backbone",
                 str(target), "--dtype", "float32", "--quiet"]) == 0
    bundle = load_bundle(tmp_path / "bundle", impl="xla")
    assert bundle.model.tap_mode == "output" and bundle.model.cfg.family == "qwen3"
    # One prefill and one round (max_tokens 2 keeps it to one compiled width: this is a plumbing check).
    res = Engine(bundle.model, bundle.weights, EngineConfig(mode="off", max_slots=2, max_len=32, progress=False)
                 ).generate([Request([5, 6, 7], max_tokens=2, id=0), Request([9], max_tokens=2, id=1)])
    assert [r.finish_reason for r in res] == ["length", "length"] and all(len(r.tokens) == 2 for r in res)


# ---------------------------------------------------------------------------------------------------
# The second embedded default (dspark_jax/assets/default_qwen3; skipped when absent)
# ---------------------------------------------------------------------------------------------------

DEFAULT_QWEN3 = CONFIGS.parent / "dspark_jax" / "assets" / "default_qwen3"
needs_default = pytest.mark.skipif(not (DEFAULT_QWEN3 / "bundle.json").is_file(),
                                   reason="embedded default_qwen3 model not present")


@functools.lru_cache(maxsize=None)
def default_qwen3():
    from dspark_jax.bundle import load_bundle

    return load_bundle(DEFAULT_QWEN3, impl="xla")


@needs_default
def test_default_qwen3_bundle_and_its_deepspec_export(tmp_path):
    b = default_qwen3()
    assert b.backbone_family == "qwen3" and b.model.cfg.family == "qwen3" and b.model.tap_mode == "output"
    assert b.model.block_size == 7 and b.model.cfg.markov_rank > 0 and b.model.cfg.enable_confidence_head
    assert b.tokenizer.token_to_id("<|noise|>") == b.model.cfg.mask_token_id
    assert b.calibration is not None and b.calibration.num_positions == 7
    # The committed draft leaves in the DeepSpec layout and comes back unchanged.
    tied = {k: np.asarray(v) for k, v in b.weights.tied.items()}
    ckpt.export_deepspec_draft(jax.device_get(b.weights.draft), tied, b.model.cfg, tmp_path / "out")
    cfg, params, tied2 = ckpt.load_deepspec_draft(tmp_path / "out", dtype="float32")
    assert cfg.replace(compute_dtype="float32") == b.model.cfg
    for (p, a), (_, c) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                              jax.tree_util.tree_flatten_with_path(jax.device_get(b.weights.draft))[0]):
        np.testing.assert_array_equal(a, c, err_msg=str(p))
    np.testing.assert_array_equal(tied2["embed"], tied["embed"])


@needs_default
@pytest.mark.slow
def test_default_qwen3_greedy_speculative_equals_plain_and_accepts():
    from dspark_jax.bench.acceptance import make_requests, read_prompts
    from dspark_jax.serve.engine import Engine, EngineConfig

    b = default_qwen3()
    reqs = make_requests(read_prompts(DEFAULT_QWEN3 / "prompts.jsonl", 2), b.tokenizer, max_tokens=24,
                         temperature=0.0, max_prompt_tokens=64)
    outs, tau = {}, None
    for mode in ("plain", "off"):
        eng = Engine(b.model, b.weights, EngineConfig(max_slots=2, max_len=128, mode=mode, progress=False))
        outs[mode] = [r.tokens for r in eng.generate(reqs)]
        tau = eng.metrics.tau
    assert outs["off"] == outs["plain"] and all(len(t) == 24 for t in outs["plain"])
    assert tau > 1.2, tau  # the trained draft really gets drafts accepted (a random one gives ~1.0)
